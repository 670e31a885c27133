"""The one loss, optimizer and train-step body that every strategy shares.

``train_step(state, batch) -> (state, metrics)`` is pure. ``jit``, ``pmap`` and ``shard_map`` are applied
where a strategy is built (:mod:`course_lib.strategies`), so each lesson shows the transform, not a rewrite.
Averaging across devices happens only when a data axis name is given, and *where* it happens depends on
the transform (``notebooks/06_shard_map.ipynb``, "the gradient trap"):

- ``sync="grads"`` — the classic recipe: differentiate the local loss, then ``lax.pmean`` the gradients.
  Correct under ``pmap`` (and ``shard_map`` with ``check_vma=False``).
- ``sync="loss"`` — differentiate the *global* loss ``lax.pmean(local_loss, axis)``. Correct under
  ``shard_map`` with ``check_vma=True``: there the transpose of a replicated parameter's implicit
  broadcast is already a ``psum``, so averaging the gradients again would leave them ``n_data ×`` too big.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax
from jax import lax

SYNC_MODES = ("grads", "loss")


class TrainState(NamedTuple):
    """Parameters and optimizer state: a plain pytree.

    Attributes:
      params: the model parameters (nested dict of float32 arrays).
      opt_state: the optax optimizer state for ``params``.
    """

    params: Any
    opt_state: Any


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy: float32 [B, K] logits, int32 [B] labels → float32 scalar (nats).

    Uses the one-hot form ``optax.softmax_cross_entropy(logits, one_hot(labels))``: its gradient works on
    Explicit mesh axes, where JAX 0.12 refuses the integer-label form's gradient with ``ShardingTypeError``
    (``notebooks/05_sharding.ipynb``).
    """
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, logits.shape[-1])).mean()


def make_optimizer(
    learning_rate: float = 0.01, momentum: float = 0.9
) -> optax.GradientTransformation:
    """SGD with momentum (optax), the same for every strategy.

    Args:
      learning_rate: step size; the default keeps the loss falling smoothly, which parity tests need.
      momentum: heavy-ball momentum coefficient.

    Raises:
      ValueError: a non-positive learning rate or a momentum outside [0, 1).
    """
    if not learning_rate > 0:
        raise ValueError(f"learning_rate={learning_rate!r} must be > 0, e.g. 0.01")
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum={momentum!r} must be in [0, 1), e.g. 0.9")
    return optax.sgd(learning_rate, momentum=momentum)


def init_state(params: Any, optimizer: optax.GradientTransformation) -> TrainState:
    """A fresh :class:`TrainState` for ``params``."""
    return TrainState(params=params, opt_state=optimizer.init(params))


def train_step(
    state: TrainState,
    batch: tuple[jax.Array, jax.Array],
    *,
    apply_fn: Callable[[Any, jax.Array], jax.Array],
    optimizer: optax.GradientTransformation,
    data_axis: str | None = None,
    sync: str = "grads",
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One SGD step on one batch (or one device's shard of it).

    Args:
      state: parameters and optimizer state.
      batch: ``(images, labels)``: float32 [b, H, W, 3] and int32 [b]; ``b`` is the local batch
        (global batch // data shards) inside ``pmap``/``shard_map``.
      apply_fn: ``(params, images) -> logits`` float32 [b, num_classes].
      optimizer: the optax optimizer.
      data_axis: the mapped axis name to average over, or ``None`` on a single device / under sharded jit.
      sync: ``"grads"`` (pmean the gradients: pmap) or ``"loss"`` (pmean the loss before differentiating:
        shard_map with check_vma=True); ignored when ``data_axis`` is None.

    Returns:
      The new state and ``{"loss": float32 scalar}``, the mean loss over the global batch, before the update.
    """
    if sync not in SYNC_MODES:
        raise ValueError(f"sync={sync!r} must be one of {SYNC_MODES}")
    images, labels = batch

    def loss_fn(params):
        loss = cross_entropy(apply_fn(params, images), labels)
        if data_axis is not None and sync == "loss":
            loss = lax.pmean(loss, data_axis)
        return loss

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    if data_axis is not None and sync == "grads":
        grads = lax.pmean(grads, data_axis)
        loss = lax.pmean(loss, data_axis)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return TrainState(params, opt_state), {"loss": loss}

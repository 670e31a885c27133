"""Experts beside data: the expert × data layout of a mixture-of-experts MLP, its bytes and its time.

The usual way to run a MoE layer on many devices (GShard, Switch, DeepSeek-V3's EP × DP) splits two ways at
once: a 2-D mesh ``data × expert``, the **tokens split over both axes** (every device routes its own tokens,
as in data parallelism) and the **experts split over the** ``expert`` **axis only** (each device holds
``E/n_e`` of them; the ``n_d`` devices of a ``data`` group hold the same experts). A device routes its ``N``
tokens into a buffer ``[E, C, D]`` (:func:`course_lib.moe.dispatch`), and the exchange is two
``all_to_all`` over the ``expert`` axis alone:

- :func:`to_experts` — ``[E, C, D]`` (expert-major: expert group ``j``'s rows go to device ``j``) →
  ``[E/n_e, n_e·C, D]``: this device's experts, each with the places of every device of its expert group,
  source-major (``lax.all_to_all`` with ``split_axis=0``, ``concat_axis=1``, ``tiled=True``);
- :func:`from_experts` — the experts' outputs ``[E/n_e, n_e·C, D]`` back to ``[E, C, D]`` on the devices
  whose tokens they are (``split_axis=1``, ``concat_axis=0``: the same exchange transposed).

:func:`moe_mlp_ep_dp` is the layer inside ``shard_map``; :func:`ep_dp_loss` a training loss (the layer's
squared error to a target plus ``α`` times the load-balancing loss, its ``f`` and ``P`` averaged over every
device by :func:`global_balancing_loss`); :func:`predict_transfers` every collective of its gradient program
from shapes (the ``expert`` axis carries three all-to-alls — four in a layer whose input needs a gradient —,
the ``data`` axis the experts' gradients, both axes together the router's gradient and the loss),
compared with the compiled program's in
``notebooks/11_pipeline_experts.ipynb`` (section 9) and ``tests/test_moe_layout.py``; :func:`mesh_shape`
picks the mesh for a device count. The one-device reference is :func:`course_lib.moe.moe_mlp` with
``n_groups`` = the device count (each group one device's tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from . import comms, moe

__all__ = [
    "mesh_shape",
    "to_experts",
    "from_experts",
    "moe_mlp_ep_dp",
    "global_balancing_loss",
    "ep_dp_loss",
    "predict_transfers",
    "expert_param_count",
]


def mesh_shape(n_devices: int, n_experts: int) -> tuple[int, int]:
    """``(n_data, n_expert)`` for ``n_devices``: 2 on ``data`` once there are 4 devices or more (so both axes
    exchange something), the rest on ``expert``.

    Raises:
      ValueError: the expert axis would not divide ``n_experts`` (e.g. 8 devices and 6 experts); use a
        device count whose ``n_expert`` divides it.
    """
    n_data = 2 if n_devices >= 4 and n_devices % 2 == 0 else 1
    n_expert = n_devices // n_data
    if n_experts % n_expert:
        raise ValueError(
            f"{n_devices} devices give an expert axis of {n_expert}, which does not divide "
            f"n_experts={n_experts}: use a device count d with n_experts % (d // 2) == 0"
        )
    return n_data, n_expert


def to_experts(buf: jax.Array, axis: str) -> jax.Array:
    """Inside ``shard_map`` over ``axis`` (``n`` devices): this device's dispatch buffer ``[E, C, D]``
    (expert-major) → ``[E/n, n·C, D]``, this device's ``E/n`` experts, each with the ``C`` places of device 0,
    then device 1, … of ``axis``. One ``all_to_all``; each device sends ``(n-1)/n`` of ``E·C·D`` elements."""
    return lax.all_to_all(buf, axis, split_axis=0, concat_axis=1, tiled=True)


def from_experts(y: jax.Array, axis: str) -> jax.Array:
    """The inverse of :func:`to_experts`: ``[E/n, n·C, D]`` → ``[E, C, D]``, each device's places back to it,
    expert-major."""
    return lax.all_to_all(y, axis, split_axis=1, concat_axis=0, tiled=True)


def moe_mlp_ep_dp(
    x: jax.Array,
    p: dict,
    *,
    expert_axis: str,
    k: int = 2,
    capacity_factor: float = 1.25,
    exchange: tuple[Callable, Callable] = (to_experts, from_experts),
) -> jax.Array:
    """The MoE MLP inside ``shard_map`` over a mesh with an ``expert_axis`` (any other axes, e.g. ``data``,
    split only the tokens).

    Args:
      x: [..., D], this device's tokens (N after flattening), float.
      p: the router whole (``router.kernel`` [D, E]); the experts' leaves split over ``expert_axis``
        (``w1.kernel`` [E/n_e, D, F], …; :func:`course_lib.moe.expert_specs`).
      expert_axis: the mesh axis the experts are split over.
      k: experts per token; capacity_factor: ``C = ceil(capacity_factor·k·N/E)`` places per expert and
        device (:func:`course_lib.moe.capacity`); choices beyond are dropped.
      exchange: ``(to_experts, from_experts)``, each ``(array, axis) -> array`` (an exercise passes its own).

    Returns:
      [..., D], equal to :func:`course_lib.moe.moe_mlp` with one group per device.

    Raises:
      ValueError: ``E`` does not split over the expert axis.
    """
    n = lax.axis_size(expert_axis)
    flat = x.reshape(-1, x.shape[-1])
    e = p["router"]["kernel"].shape[1]
    if e % n:
        raise ValueError(f"{e} experts do not split over {n} devices of axis {expert_axis!r}")
    cap = moe.capacity(flat.shape[0], e, k, capacity_factor)
    r = moe.route(flat @ p["router"]["kernel"], k, cap)
    send, receive = exchange
    mine = send(moe.dispatch(flat, r, e, cap), expert_axis)  # [E/n, n·C, D]
    back = receive(moe.experts(p, mine), expert_axis)  # [E, C, D]
    return moe.combine(back, r).reshape(x.shape)


def global_balancing_loss(logits: jax.Array, k: int, axes: tuple[str, ...]) -> jax.Array:
    """:func:`course_lib.moe.load_balancing_loss` over the tokens of every device of ``axes`` (inside
    ``shard_map``): ``f`` and ``P`` are averaged over the devices (``pmean``, two ``[E]`` arrays) before
    ``E · Σ f_i·P_i``, so it equals the loss of all the tokens on one device. logits [N, E] → scalar."""
    e = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1)
    chosen = lax.top_k(probs, k)[1]
    frac = lax.pmean(jax.nn.one_hot(chosen, e, dtype=probs.dtype).mean((0, 1)), axes)
    return e * jnp.sum(lax.stop_gradient(frac) * lax.pmean(probs.mean(0), axes))


def ep_dp_loss(
    mesh: Any,
    *,
    data_axis: str,
    expert_axis: str,
    k: int = 2,
    capacity_factor: float = 1.25,
    alpha: float = 0.01,
) -> Callable:
    """``loss(p, x, target)`` of one MoE layer in the expert × data layout: the mean over all tokens of
    ``|moe(x) - target|²`` plus ``alpha`` times :func:`global_balancing_loss`; differentiate it with
    ``jax.grad``.

    Args:
      mesh: a mesh with ``data_axis`` and ``expert_axis``; x and target [T, D] are split over both (T a
        multiple of the device count), the experts over ``expert_axis``, the router replicated.

    Returns:
      A function of ``(p, x, target)`` returning a float scalar, equal to the same loss on one device with
      :func:`course_lib.moe.moe_mlp` (``n_groups`` = devices) and :func:`course_lib.moe.load_balancing_loss`.
    """
    axes = (data_axis, expert_axis)

    def body(p, x, target):
        # the router is used twice (routing, balancing loss): made to vary once, so that its gradient is
        # summed over the devices by one all-reduce (each implicit pvary would transpose to its own)
        p = {**p, "router": {"kernel": lax.pcast(p["router"]["kernel"], axes, to="varying")}}
        out = moe_mlp_ep_dp(x, p, expert_axis=expert_axis, k=k, capacity_factor=capacity_factor)
        err = lax.pmean(jnp.mean(jnp.sum((out - target) ** 2, -1)), axes)
        return err + alpha * global_balancing_loss(x @ p["router"]["kernel"], k, axes)

    def loss(p, x, target):
        specs = (moe.expert_specs(p, expert_axis), P(axes), P(axes))
        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P())(p, x, target)

    return loss


def expert_param_count(d_model: int, d_ff: int, n_experts: int) -> int:
    """Parameters of the ``n_experts`` expert MLPs of :func:`course_lib.moe.init_moe`: ``E·(2·D·F + F + D)``."""
    return n_experts * (2 * d_model * d_ff + d_ff + d_model)


def predict_transfers(
    tokens_per_device: int,
    d_model: int,
    d_ff: int,
    n_experts: int,
    k: int,
    capacity_factor: float,
    n_data: int,
    n_expert: int,
    itemsize: int = 4,
) -> list[comms.Transfer]:
    """Every collective of the gradient of :func:`ep_dp_loss`, predicted from shapes (per device, per step).

    - ``expert``: three all-to-alls of the buffer ``E·C·D``: the dispatch and the return in the forward,
      and the return's transpose in the backward (the experts' output cotangents to the experts). The
      dispatch's transpose would carry the cotangent of the tokens, which nothing here needs (the tokens
      are an input, and the router's gradient flows through the gates of the combine): XLA removes it. A
      layer inside a model, whose input has a gradient, runs all four;
    - ``data``: one all-reduce of this device's experts' gradients, ``(E/n_e)·(2DF + F + D)`` elements
      (the ``n_d`` devices of a data group hold the same experts);
    - ``data,expert`` (every device): the router's gradient ``D·E``, and in the forward the two ``[E]``
      arrays ``f`` and ``P`` of the balancing loss and the loss's scalar.

    An axis of one device exchanges nothing: its transfers are left out (the compiled program has none).
    Compare with :func:`course_lib.comms.sent_by_axis` of the compiled program's collectives.

    Returns:
      :class:`course_lib.comms.Transfer` items (``axis`` names as :attr:`course_lib.comms.Collective.axis`).
    """
    cap = moe.capacity(tokens_per_device, n_experts, k, capacity_factor)
    buffer = n_experts * cap * d_model * itemsize
    local_experts = expert_param_count(d_model, d_ff, n_experts // n_expert) * itemsize
    both = ",".join(a for a, n in (("data", n_data), ("expert", n_expert)) if n > 1)
    out = []
    if n_expert > 1:
        out += [comms.transfer("all-to-all", "expert", n_expert, buffer, what) for what in (
            "tokens to experts", "outputs back", "output cotangents to experts")]  # fmt: skip
    if n_data > 1:
        out.append(
            comms.transfer("all-reduce", "data", n_data, local_experts, "experts' gradients")
        )
    if both:
        n = n_data * n_expert
        out.append(
            comms.transfer("all-reduce", both, n, d_model * n_experts * itemsize, "router grad")
        )
        out.append(
            comms.transfer("all-reduce", both, n, (2 * n_experts + 1) * itemsize, "f, P, loss")
        )
    return out

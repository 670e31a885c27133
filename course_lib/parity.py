"""Parity of the strategies with single-device ``jit``, and why float32 runs drift apart anyway.

**The right test depends on the precision** (measured on the cpu profile, seeds 0–9, in
``notebooks/08_lab.ipynb``):

- ``float64``: every strategy's whole loss trajectory equals A's to 1e-10 relative at every step (measured
  ~5e-15). This proves the parallel programs compute the same mathematics.
- ``float32``: a strategy that adds a sum in another order (a ``psum`` of partial sums, another per-device
  batch size) changes the last bits; where a 2×2 max-pool window holds two values a few ulp apart, the
  argmax can flip, the gradient of the layers below jumps by ~1e-3, and momentum carries the difference on.
  Trajectories then drift (1e-2 relative after 20 steps), for the single-device run nudged by one ulp too;
  a first-steps check failed at seed 3. What holds for any seed is **one-step parity**: from the *same*
  state (A's, before step k), one step of the strategy gives A's loss (1e-4 relative) and A's update
  (per parameter leaf, max |Δu| / max |u| ≤ 5e-2; a flip moves it ≤ 5e-3, a bug ≥ 0.5) — errors cannot
  accumulate. :func:`one_step` measures it.
- ``bfloat16``: 8 mantissa bits; every reordering differs at ~1e-3, so trajectories part within steps;
  one-step parity with the looser tolerances of :data:`TOLERANCES`.

On a TPU float64 does not run (:func:`course_lib.precision.float64_runs`) and float32 matmuls multiply
bfloat16 inputs at JAX's default precision: :func:`tolerance` gives each platform's tolerances.

The float32 mechanism is shown live with :func:`activations` (the pre-activations of A's forward and of a
tensor-parallel layout's order of additions, on one device), :func:`pool_flips`, :func:`gradient_jump` and
:func:`nudge`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import precision as precision_lib
from .model import flatten_channel_major, max_pool
from .parallel import conv
from .steps import cross_entropy

NAMES = ("conv1", "conv2", "conv3", "dense1", "dense2")


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """What a parity check allows, per precision (relative differences).

    Attributes:
      trajectory: every step's loss vs A's over the whole run (None: not checked; it drifts).
      one_step_loss: the loss of one step from A's state vs A's.
      one_step_update: per parameter leaf, max |u_X − u_A| / max |u_A| of one step's update u.
    """

    trajectory: float | None
    one_step_loss: float
    one_step_update: float


TOLERANCES = {
    "float64": Tolerance(trajectory=1e-10, one_step_loss=1e-10, one_step_update=1e-8),
    "float32": Tolerance(trajectory=None, one_step_loss=1e-4, one_step_update=5e-2),
    "bfloat16": Tolerance(trajectory=None, one_step_loss=2e-2, one_step_update=0.3),
}
"""Tolerances of the parity checks where matmuls compute in float32 (XLA:CPU; module docstring for the
measurements behind them). :func:`tolerance` gives the platform's."""


def tolerance(precision: str, backend: str | None = None) -> Tolerance:
    """The parity tolerances of ``precision`` on ``backend`` (``None``: JAX's default backend).

    :data:`TOLERANCES` [precision], except for ``float32`` where the platform's float32 matmuls round their
    inputs more coarsely than float32 (:func:`course_lib.precision.float32_rtol` above its floor: a TPU at
    JAX's default precision multiplies bfloat16 inputs, a recent NVIDIA GPU TF32): there one step's loss may
    differ by ``float32_rtol`` and its update by as much as a bfloat16 run's (the same input rounding), still
    below the 0.5 a bug moves it. ``float64`` raises where it does not run
    (:func:`course_lib.precision.float64_runs`: not on XLA:TPU).

    Raises:
      ValueError: an unknown precision, or ``float64`` on a backend where the course does not run it.
    """
    precision_lib.check_runs(precision, backend)
    rtol = precision_lib.float32_rtol(backend)
    if precision != "float32" or rtol <= precision_lib.FLOAT32_RTOL_FLOOR:
        return TOLERANCES[precision]
    return Tolerance(
        trajectory=None,
        one_step_loss=max(TOLERANCES["float32"].one_step_loss, rtol),
        one_step_update=TOLERANCES["bfloat16"].one_step_update,
    )


def relative_diff(values: Sequence[float], reference: Sequence[float]) -> np.ndarray:
    """``|values − reference| / |reference|`` element-wise, as float64."""
    v, r = np.asarray(values, np.float64), np.asarray(reference, np.float64)
    return np.abs(v - r) / np.abs(r)


def update_diff(new: Any, reference_new: Any, old: Any) -> tuple[float, str]:
    """Largest per-leaf ``max |u − u_ref| / max |u_ref|`` with ``u = new − old``; and the leaf's path."""
    worst, where = 0.0, ""
    leaves = jax.tree_util.tree_leaves_with_path(old)
    for (path, o), n, r in zip(
        leaves, jax.tree.leaves(new), jax.tree.leaves(reference_new), strict=True
    ):
        u, u_ref = np.asarray(n, np.float64) - o, np.asarray(r, np.float64) - o
        scale = float(np.max(np.abs(u_ref)))
        d = float(np.max(np.abs(u - u_ref))) / scale if scale else float(np.max(np.abs(u)))
        if d > worst:
            worst, where = d, "/".join(str(getattr(k, "key", k)) for k in path)
    return worst, where


def one_step(run: Any, reference: Any, steps: Sequence[int]) -> list[dict]:
    """One-step parity of a strategy's run against A's (both from :func:`course_lib.lab.run_strategy`).

    For each step k: the strategy's compiled step, from A's state before step k (``reference.states[k]``),
    on its own layout of batch k; its loss and update compared with A's step k.

    Args:
      run: the strategy's :class:`course_lib.lab.StrategyRun` (its ``strategy``, ``compiled``, ``batches``).
      reference: A's run, made with ``keep_states=True``.
      steps: the steps to check.

    Returns:
      One row per step: ``step, loss_rel, update_rel, worst_leaf``.
    """
    s, rows = run.strategy, []
    for k in steps:
        before, after = reference.states[k], reference.states[k + 1]
        with precision_lib.enabled(run.row["precision"]):  # float64 arrays stay float64
            new, metrics = run.compiled(s.place_state(before), run.batches[k])
            new_params = s.host_params(new)
        loss = float(np.asarray(metrics["loss"]).ravel()[0])
        d, leaf = update_diff(new_params, after.params, before.params)
        rel = abs(loss - reference.losses[k]) / abs(reference.losses[k])
        rows.append({"step": k, "loss_rel": rel, "update_rel": d, "worst_leaf": leaf})
    return rows


# ---- the float32 mechanism, on one device ------------------------------------------------------------


def activations(params: Any, images: jax.Array, order: str = "A", n_model: int = 2) -> dict:
    """Pre-activations ``z1 … z4`` and ``logits`` of the CNN, summed in one strategy's order, on one device.

    Args:
      params: the full parameters (as A holds them).
      images: float [B, H, W, 3].
      order: ``"A"`` (the model's sums), ``"pairs"`` (conv2 and dense1 as ``n_model`` input-split partial
        sums added together, as strategy ``shard_map_pairs`` does with its psums) or ``"gather"`` (conv3 and
        dense2 likewise, strategy C). Each device of the real strategy also runs its own batch size, which
        can change the last bits again; this shows the order of additions alone.
    """
    p = params

    def split(x, kernel, op, axis_x, axis_k):
        parts = [
            op(a, b)
            for a, b in zip(
                jnp.split(x, n_model, axis_x), jnp.split(kernel, n_model, axis_k), strict=True
            )
        ]
        return sum(parts[1:], parts[0])

    def conv_sum(x, name, split_here):
        if not split_here:
            return conv(x, p[name]["kernel"]) + p[name]["bias"]
        return split(x, p[name]["kernel"], conv, 3, 2) + p[name]["bias"]

    z1 = conv_sum(images, "conv1", False)
    z2 = conv_sum(max_pool(jax.nn.relu(z1)), "conv2", order == "pairs")
    z3 = conv_sum(max_pool(jax.nn.relu(z2)), "conv3", order == "gather")
    h3 = max_pool(jax.nn.relu(z3))
    if order == "pairs":  # dense1's rows grouped by conv3 channel (channel-major flatten)
        parts = [
            flatten_channel_major(h) @ k
            for h, k in zip(
                jnp.split(h3, n_model, 3), jnp.split(p["dense1"]["kernel"], n_model, 0), strict=True
            )
        ]
        z4 = sum(parts[1:], parts[0]) + p["dense1"]["bias"]
    else:
        z4 = flatten_channel_major(h3) @ p["dense1"]["kernel"] + p["dense1"]["bias"]
    h4 = jax.nn.relu(z4)
    if order == "gather":
        logits = split(h4, p["dense2"]["kernel"], jnp.matmul, 1, 0) + p["dense2"]["bias"]
    else:
        logits = h4 @ p["dense2"]["kernel"] + p["dense2"]["bias"]
    return {"z1": z1, "z2": z2, "z3": z3, "z4": z4, "logits": logits}


@dataclasses.dataclass(frozen=True)
class Flip:
    """A 2×2 max-pool window whose argmax differs between two forwards.

    Attributes:
      layer: the pre-activation pooled (``"z1"``, ``"z2"``, ``"z3"``: after conv1, conv2, conv3).
      where: ``(example, row, column, channel)`` of the pooled pixel.
      a, b: the window's four values (after ReLU) in each forward.
      gap_ulp: the top two values' distance in forward a, in ulp of the window's largest value (a or b).
      moved_ulp: how far forward b moved each value, in ulp.
    """

    layer: str
    where: tuple[int, int, int, int]
    a: tuple[float, ...]
    b: tuple[float, ...]
    gap_ulp: float
    moved_ulp: tuple[int, ...]


def _windows(x: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    b, h, w, c = x.shape
    win = x.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 5, 2, 4).reshape(-1, 4)
    return win, (b, h // 2, w // 2, c)


def pool_flips(za: dict, zb: dict) -> list[Flip]:
    """Every max-pool window (of the three pools) whose argmax differs between forwards ``za`` and ``zb``
    (:func:`activations` outputs), ignoring windows that are all zero after the ReLU in both."""
    flips = []
    for layer in ("z1", "z2", "z3"):
        wa, shape = _windows(np.maximum(np.asarray(za[layer]), 0))
        wb, _ = _windows(np.maximum(np.asarray(zb[layer]), 0))
        live = (wa.max(1) > 0) | (wb.max(1) > 0)
        for i in np.nonzero(live & (wa.argmax(1) != wb.argmax(1)))[0]:
            # ulp of the window's largest value in either forward: A's window may be all zeros after the
            # ReLU where b's is not, and the spacing of 0 (a subnormal) would overflow the ratios below
            ulp = float(np.spacing(max(wa[i].max(), wb[i].max()).astype(wa.dtype)))
            top = np.sort(wa[i])
            flips.append(
                Flip(
                    layer,
                    tuple(int(v) for v in np.unravel_index(int(i), shape)),
                    tuple(float(v) for v in wa[i]),
                    tuple(float(v) for v in wb[i]),
                    float((top[3] - top[2]) / ulp),
                    tuple(int(v) for v in np.round((wb[i] - wa[i]) / ulp)),
                )
            )
    return flips


@functools.partial(jax.jit, static_argnames=("order", "n_model"))
def _gradient(params, images, labels, order, n_model):
    return jax.grad(
        lambda p: cross_entropy(activations(p, images, order, n_model)["logits"], labels)
    )(params)


def gradient_jump(params: Any, batch: tuple, order: str, n_model: int = 2) -> dict[str, float]:
    """Per layer, ``max |g_order − g_A| / max |g_A|`` of the loss gradient at ``params`` on ``batch``."""
    images, labels = batch
    ga = jax.device_get(_gradient(params, images, labels, "A", n_model))
    gb = jax.device_get(_gradient(params, images, labels, order, n_model))
    out = {}
    for name in NAMES:
        diff = max(float(np.max(np.abs(ga[name][t] - gb[name][t]))) for t in ("kernel", "bias"))
        scale = max(float(np.max(np.abs(ga[name][t]))) for t in ("kernel", "bias"))
        out[name] = diff / scale
    return out


def nudge(params: Any, ulp_of: Any = None) -> Any:
    """``params`` with every entry moved up by one ulp (``numpy.nextafter``): a rounding-size change.

    Args:
      params: a pytree of floating arrays.
      ulp_of: move by one ulp of this dtype instead of the entries' own (e.g. ``jnp.bfloat16`` for a
        bfloat16 run, which computes with bfloat16 copies of float32 parameters: a float32 ulp vanishes
        in that cast). Each entry becomes the next value of ``ulp_of`` above its own rounding to
        ``ulp_of``, kept in its own dtype; None: the entries' dtype.
    """
    if ulp_of is None:
        return jax.tree.map(
            lambda v: np.nextafter(np.asarray(v), np.inf, dtype=np.asarray(v).dtype), params
        )
    dtype = np.dtype(ulp_of)

    def up(v):
        low = np.asarray(v).astype(dtype)
        return np.nextafter(low, np.array(np.inf, dtype)).astype(np.asarray(v).dtype)

    return jax.tree.map(up, params)

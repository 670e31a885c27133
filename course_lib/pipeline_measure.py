"""Measuring a pipeline: its bubble in the compiled program's FLOPs and in time, its stash in memory, the
bytes its ``ppermute`` send — each beside the prediction from the schedule's table (:mod:`course_lib.schedules`).

The measurements run :func:`course_lib.pipeline.train` on a **residual layer** ``x + tanh(x @ w)``
(:func:`residual_stage`): what a schedule wastes does not depend on what a layer computes, and this layer
compiles in a fraction of the transformer block's time. The programs:

- **FLOPs** (:func:`flops_bubble`): ``cost_analysis()`` counts a loop's body once, so the program is
  compiled with every loop unrolled (the ticks and the layers) and its FLOPs are the whole step's. The useful
  work is ``m·v`` times one F and one B of one chunk, each compiled alone (:func:`lane_flops`).
- **time** (:func:`time_bubble`): a call costs its ticks plus a fixed cost (starting the program, the work
  outside the loops). Two runs of :func:`course_lib.schedules.busy` tables (``m`` and ``2m`` micro-batches,
  no bubble) give the time per micro-batch ``c`` and the fixed cost ``o``; a schedule's bubble time is
  ``t - o - m·c``. All programs are timed in one run, interleaved, medians of repeats.
- **time ratios** (:func:`median_ratio`): a schedule's step against the ``busy`` table of the same
  ``(p, m, v)`` (the same cells, no stage waiting), per round, the median: between 1 and
  ``1/(1 - bubble)`` (the fixed cost of a call pulls it below the bound). The sturdier of the two time
  measurements on a busy machine: one quotient of two calls timed side by side, no differences.
- **memory** (:func:`stash_growth`): ``memory_analysis()`` of the step at ``m`` and ``2m`` micro-batches;
  what grows is the stash (its slots × one activation).

Used by ``notebooks/11_pipeline_experts.ipynb``; ``tests/test_pipeline_measure.py``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from . import pipeline, programs, schedules
from .measure import Timing

__all__ = [
    "ANALYSIS_OPTIONS",
    "residual_stage",
    "ResidualStage",
    "init_residual",
    "build_train",
    "lane_flops",
    "flops_bubble",
    "permute_bytes",
    "round_robin",
    "interleaved_times",
    "time_bubble",
    "time_bubbles",
    "median_ratio",
    "stash_growth",
]


ANALYSIS_OPTIONS = {"xla_backend_optimization_level": 0}
"""Compiler options of the programs that are only read, never timed (FLOPs, memory): the FLOPs and the
buffers come from XLA's HLO passes, which the backend's optimisation level leaves alone
(``tests/test_pipeline_measure.py`` checks it), and the programs compile in about half the time."""


def residual_stage(unroll: bool = False, *, split: bool = False) -> Callable:
    """A stage of residual layers: ``x [N, D] -> x + tanh(x @ w)`` for each ``w`` of ``chunk["w"] [k, D, D]``.
    ``split=True`` returns a :class:`ResidualStage`: the same function, with the split backward of
    zero-bubble pipelines (:mod:`course_lib.pipeline_ops`)."""
    if split:
        return ResidualStage(unroll)

    def stage(x, chunk):
        # an input every stage holds, on a stage's own layers
        return _residual_layers(pipeline.vary_like(x, chunk), chunk["w"], unroll)

    return stage


def _residual_layers(x, w, unroll):
    return lax.scan(lambda h, w_l: (h + jnp.tanh(h @ w_l), None), x, w, unroll=unroll)[0]


class ResidualStage:
    """:func:`residual_stage` as a **split stage** (Qi et al. 2023's B and W): callable as the plain
    ``stage(x, chunk)``, and

    - ``backward_input(x, chunk, dy) -> (dx, saved)``: recompute the chunk from its input ``x [..., D]`` and
      run the input-gradient chain from the output cotangent ``dy`` (like ``x``); ``saved`` keeps, per layer
      ``l``, its input ``h_l`` and the cotangent ``g_l`` of its matmul output ``h_l @ w_l``
      (``{"h", "g"}``, each ``[k, ..., D]``: ``2k`` activations). The ``g_l`` are the cotangents of zero
      **probes** added to each matmul output: a vjp with respect to ``(x, probes)``, not the weights.
    - ``backward_weight(saved, chunk) -> d_chunk``: ``dW_l = h_lᵀ g_l`` (``{"w": [k, D, D]}``), one matmul
      per layer: about one forward's FLOPs, against about three for a W that starts from ``dy`` alone.

    Taught in ``notebooks/11_pipeline_experts.ipynb``; ``tests/test_pipeline_ops.py``.
    """

    def __init__(self, unroll: bool = False):
        self.unroll = unroll

    def _layers(self, x, w, probes):
        def layer(h, w_e):
            return h + jnp.tanh(h @ w_e[0] + w_e[1]), h  # (next input, this layer's input)

        return lax.scan(layer, x, (w, probes), unroll=self.unroll)

    def __call__(self, x, chunk):
        return _residual_layers(pipeline.vary_like(x, chunk), chunk["w"], self.unroll)

    def backward_input(self, x, chunk, dy):
        x, w = pipeline.vary_like(x, chunk), chunk["w"]
        probes = pipeline.vary_like(jnp.zeros((w.shape[0], *x.shape), x.dtype), chunk)
        _, vjp, hs = jax.vjp(lambda h, e: self._layers(h, w, e), x, probes, has_aux=True)
        dx, gs = vjp(pipeline.vary_like(dy, chunk))
        return dx, {"h": hs, "g": gs}

    def backward_weight(self, saved, chunk):
        # a scan over the layers, like the stage's own: cost_analysis counts a loop's body once, so the
        # FLOPs of F, B and W compare per layer unrolled or not (pipeline_ops.op_flops)
        k, d = chunk["w"].shape[0], chunk["w"].shape[-1]
        hs, gs = (saved[a].reshape(k, -1, d) for a in ("h", "g"))
        dw = lax.scan(lambda _, hg: (None, hg[0].T @ hg[1]), None, (hs, gs), unroll=self.unroll)[1]
        return {"w": dw.astype(chunk["w"].dtype)}


def init_residual(key: jax.Array, n_layers: int, d: int, dtype=jnp.float32) -> dict:
    """``{"w": [L, D, D]}``, each ``w`` normal with variance ``1/D`` (LeCun)."""
    return {"w": jax.random.normal(key, (n_layers, d, d), dtype) / np.sqrt(d)}


def _head(_, y, r):  # the loss of one micro-batch: <y, r>, so its gradient is r
    return (y * r).sum()


def build_train(
    mesh: Any,
    axis: str,
    sched: schedules.Schedule,
    stage_fn: Callable,
    *,
    unroll: bool = False,
    input_grads: bool = False,
    trace: bool = False,
) -> Callable:
    """``step(params, xs, r) -> (loss, grads, dxs[, trace])``: :func:`course_lib.pipeline.train` under
    ``shard_map`` with the loss ``Σ_i <y_i, r_i>`` (``xs``, ``r``: [m, N, D], replicated; ``params``
    :func:`~course_lib.pipeline.chunked` to ``sched.n_chunks``, placed with ``stage_spec``). ``dxs`` is
    the inputs' cotangent (``input_grads``; else a zero block). With ``trace``, also the trace of every
    device, int32 [T, 4, p] (:func:`course_lib.pipeline.train`)."""
    spec = pipeline.stage_spec(axis)

    def body(params, xs, r):
        loss, grads, _, dxs, tr = pipeline.train(
            stage_fn, _head, params, {}, xs, r, sched, axis, unroll=unroll, input_grads=input_grads
        )
        out = (lax.psum(loss, axis), grads, lax.psum(dxs, axis))
        return (*out, tr[..., None]) if trace else out

    out_specs = (P(), spec, P(), P(None, None, axis)) if trace else (P(), spec, P())
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P(), P()), out_specs=out_specs))


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


def lowered_flops(fn: Callable, *args: Any) -> float:
    """FLOPs of ``jax.jit(fn)`` on ``args``, from the lowered program's cost analysis (the HLO before XLA's
    optimisations: nothing is compiled where the platform answers there, as XLA:CPU does).

    Where the lowered program gives no cost analysis (XLA:TPU under JAX 0.10.2 returns None), the compiled
    program's is used. Taught in ``notebooks/11_pipeline_experts.ipynb`` (section 4: the head on every
    stage); ``tests/test_pipeline_measure.py``.

    Args:
      fn: a function of arrays (any shapes and dtypes ``jax.jit`` takes).
      *args: its arguments, arrays or pytrees of arrays.

    Returns:
      The program's ``cost_analysis()["flops"]`` (a loop body counts once), as a float.

    Raises:
      KeyError: the cost analysis has no ``"flops"`` entry.
    """
    lowered = jax.jit(fn).lower(*args)
    cost = lowered.cost_analysis()
    cost = lowered.compile().cost_analysis() if cost is None else cost
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


def lane_flops(stage_fn: Callable, chunk: Any, x: jax.Array) -> tuple[float, float]:
    """FLOPs of one F cell (the chunk's forward) and one B cell (its recomputed forward and the vjp), each
    compiled alone on one device: ``(f, b)``. (:func:`flops_bubble` keeps them per shape.)"""

    def b_cell(chunk, x, r):
        y, vjp = jax.vjp(lambda c, h: stage_fn(h, c), chunk, x)
        return vjp(r)

    f = _flops(jax.jit(stage_fn).lower(x, chunk).compile(ANALYSIS_OPTIONS))
    b = _flops(jax.jit(b_cell).lower(chunk, x, x).compile(ANALYSIS_OPTIONS))
    return f, b


@functools.lru_cache(maxsize=16)
def _residual_lanes(w_shape: tuple, x_shape: tuple, dtype: str) -> tuple[float, float]:
    chunk = {"w": jnp.zeros(w_shape, dtype)}
    return lane_flops(residual_stage(unroll=True), chunk, jnp.zeros(x_shape, dtype))


def flops_bubble(
    mesh: Any, axis: str, sched: schedules.Schedule, params: dict, xs: jax.Array
) -> dict:
    """The bubble in FLOPs: the step compiled unrolled against ``m·v·(f + b)`` of :func:`lane_flops`.

    Args:
      params: ``{"w": [L, D, D]}`` (:func:`init_residual`), L a multiple of ``p·v``.
      xs: [m, N, D] micro-batch inputs.

    Returns:
      ``{"total", "useful", "bubble", "predicted", "permute_bytes"}``: FLOPs per device of the step and of
      its useful cells, ``1 - useful/total``, :func:`~course_lib.schedules.bubble_fraction` with the
      measured ``f``/``b`` costs, and the bytes of the program's ``collective-permute`` ops.
    """
    p, v = sched.n_stages, sched.n_chunks
    chunk = {"w": params["w"][: params["w"].shape[0] // (p * v)]}
    f, b = _residual_lanes(chunk["w"].shape, xs.shape[1:], str(xs.dtype))
    step = build_train(
        mesh, axis, sched, residual_stage(unroll=True), unroll=True, input_grads=True
    )
    compiled = step.lower(pipeline.chunked(params, v), xs, xs).compile(ANALYSIS_OPTIONS)
    total = _flops(compiled)
    useful = sched.n_micro * v * (f + b)
    sent = sum(
        op.nbytes
        for op in programs.collective_ops(compiled.as_text())
        if op.op == "collective-permute"
    )
    return {
        "total": total,
        "useful": useful,
        "bubble": 1 - useful / total,
        "predicted": schedules.bubble_fraction(sched, f, b),
        "permute_bytes": sent,
    }


def permute_bytes(sched: schedules.Schedule, act_bytes: int) -> int:
    """Predicted bytes of the ``collective-permute`` ops of an unrolled step, per device: one activation
    (or its cotangent) after each tick whose next tick uses the same lane. (The executor also sends after
    a lane's last tick, but nothing reads that message, and XLA removes it.) For two stages or more: with
    one, the stage index is a constant and XLA removes every send whose message it can see is unused."""
    lanes = sched.lanes()
    return int((lanes[:-1] & lanes[1:]).sum()) * act_bytes


def round_robin(
    calls: dict[str, Callable[[], Any]],
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Time each zero-argument call ``repeats`` times, round-robin (one warm-up each first), so a load that
    changes during the run falls on every call alike; ``jax.block_until_ready`` on every result.

    Args:
      clock: ``time.perf_counter`` (wall time) or ``time.process_time`` (CPU time of every thread of this
        process: on simulated CPU devices it leaves out the time the threads wait for cores that other
        programs hold; see :func:`course_lib.measure.time_calls`).

    Returns:
      ``{name: [seconds of round 0, round 1, …]}``.
    """
    for fn in calls.values():
        jax.block_until_ready(fn())
    samples = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            t0 = clock()
            jax.block_until_ready(fn())
            samples[name].append(clock() - t0)
    return samples


def interleaved_times(
    calls: dict[str, Callable[[], Any]],
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Timing]:
    """:func:`round_robin`, summarised: a :class:`~course_lib.measure.Timing` per call."""
    return {name: Timing.from_samples(s) for name, s in round_robin(calls, repeats, clock).items()}


def time_bubble(
    times: dict[str, float], n_micro: int, busy: str = "busy", busy2: str = "busy2"
) -> dict:
    """Bubble fractions from medians of one run: ``times[busy]`` and ``times[busy2]`` are
    :func:`~course_lib.schedules.busy` steps of ``m`` and ``2m`` micro-batches (same stages), the rest
    schedules of ``m``. ``c = (t_busy2 - t_busy)/m`` per micro-batch, ``o = t_busy - m·c``; each schedule's
    bubble is ``1 - m·c / (t - o)``.

    Returns:
      ``{"c": seconds per micro-batch, "o": fixed seconds per call, name: bubble fraction, …}``.
    """
    c = (times[busy2] - times[busy]) / n_micro
    o = times[busy] - n_micro * c
    out = {"c": c, "o": o}
    for name, t in times.items():
        if name not in (busy, busy2):
            out[name] = 1 - n_micro * c / (t - o)
    return out


def time_bubbles(
    samples: dict[str, list[float]], n_micro: int, busy: str = "busy", busy2: str = "busy2"
) -> dict:
    """:func:`time_bubble` of each round of :func:`round_robin` (the calls of one round ran side by side),
    and the median over the rounds of each number."""
    per_round = [time_bubble({k: v[i] for k, v in samples.items()}, n_micro, busy, busy2)
                 for i in range(len(next(iter(samples.values()))))]  # fmt: skip
    return {k: float(np.median([r[k] for r in per_round])) for k in per_round[0]}


def median_ratio(samples: dict[str, list[float]], name: str, baseline: str) -> float:
    """The median over the rounds of :func:`round_robin` of ``samples[name][i] / samples[baseline][i]``
    (two calls of the same round ran side by side, so a load that changes between rounds cancels).

    Raises:
      ValueError: the two lists differ in length or are empty.
    """
    a, b = samples[name], samples[baseline]
    if len(a) != len(b) or not a:
        raise ValueError(
            f"{name!r} has {len(a)} rounds and {baseline!r} {len(b)}: time them together"
        )
    return float(np.median(np.asarray(a, float) / np.asarray(b, float)))


def stash_growth(
    mesh: Any,
    axis: str,
    name: str,
    n_micro: int,
    n_chunks: int,
    params: dict,
    act: jax.ShapeDtypeStruct,
) -> dict:
    """Temporary memory of the step (``memory_analysis().temp_size_in_bytes``) at ``m`` and ``2m``
    micro-batches, and its growth beside the stash's predicted growth (slots × activation bytes).

    Args:
      name: a key of :data:`course_lib.schedules.SCHEDULES`; params: :func:`init_residual`'s dict;
      act: shape and dtype of one micro-batch's activation [N, D].
    """
    p = mesh.shape[axis]
    out = {}
    for m in (n_micro, 2 * n_micro):
        sched = schedules.make(name, p, m, n_chunks)
        xs = jax.ShapeDtypeStruct((m, *act.shape), act.dtype)
        step = build_train(mesh, axis, sched, residual_stage())
        mem = (
            step.lower(pipeline.chunked(params, n_chunks), xs, xs)
            .compile(ANALYSIS_OPTIONS)
            .memory_analysis()
        )
        out[m] = {"temp": int(mem.temp_size_in_bytes), "slots": sched.n_slots}
    act_bytes = int(np.prod(act.shape)) * jnp.dtype(act.dtype).itemsize
    lo, hi = out[n_micro], out[2 * n_micro]
    return {
        "temp": (lo["temp"], hi["temp"]),
        "slots": (lo["slots"], hi["slots"]),
        "measured": hi["temp"] - lo["temp"],
        "predicted": (hi["slots"] - lo["slots"]) * act_bytes,
    }

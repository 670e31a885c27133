"""One executor for every one-operation-per-tick schedule (:mod:`course_lib.op_schedules`): GPipe,
PipeDream-Flush 1F1B, interleaved 1F1B, ZB-H1, inside ``shard_map`` over a ``stage`` axis.

At each tick each device runs the operation its cell names (F, B, W or nothing), then every device sends
its F output to the next (virtual) stage and its B output (the input's cotangent) to the previous one
with ``ppermute``. A value may arrive before it is used: the receiver keeps it in a **slot** until then
(:func:`plan` assigns the slots from the table: an input from its arrival to its last reader, B or W; a
cotangent from its arrival to B, or to W when the backward is split). B recomputes the chunk from its
stashed input under ``jax.vjp`` (as :func:`course_lib.pipeline.train` does).

The split backward (ZB-H1) runs in one of two ways, chosen by the stage:

- a plain ``stage_fn(x, chunk)``: B keeps the chunk's output cotangent ``dy``; W recomputes the chunk and
  runs a vjp with respect to the weights from ``dy``, so it runs the input-gradient chain again (about
  3 F of FLOPs, :func:`op_flops`);
- a **split stage** (:func:`is_split_stage`, e.g. ``pipeline_measure.residual_stage(split=True)``): B
  runs ``backward_input`` and keeps what it saves (each layer's input and matmul-output cotangent) in a
  third buffer of slots, from B to W; W runs ``backward_weight`` on them, the products ``h_lᵀ g_l``
  (about 1 F: Qi et al.'s W). The input and the cotangent then live only until B; the last stage's F
  computes the head's gradient and keeps the output's cotangent for its B.

Two ways to run a tick (``mode``):

- ``"masked"`` — SPMD lockstep: every device computes every operation some device runs at that tick and
  keeps its own with ``jnp.where`` (the form of :func:`course_lib.pipeline.train`). Idle cells cost work.
- ``"cond"`` — ``lax.switch`` on the device's own operation: an idle cell computes nothing, a device
  runs only its own operation. The bubble is then waiting (for the next tick's ``ppermute``), not work.

Taught in ``notebooks/11_pipeline_experts.ipynb``; ``tests/test_pipeline_ops.py`` checks every schedule
against one device in float64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from . import op_schedules as O
from .pipeline import _axes_of, _chunk, _vary, next_stage, stage_spec

__all__ = ["Plan", "plan", "is_split_stage", "run", "build_step", "MODES", "op_flops", "work"]

MODES = ("masked", "cond")
"""How a tick computes: every operation used at the tick, masked; or only the device's own (``lax.switch``)."""


class Plan(NamedTuple):
    """What the executor reads at every tick, built from a table by :func:`plan`.

    Attributes:
      rows: int32 [T, p, 8]: op, micro-batch, chunk, input slot, cotangent slot, slot for the input that
        arrives at the end of the tick, slot for the cotangent that arrives, slot of what B saves for W
        (a spare slot where none).
      n_x, n_dy: slots of inputs and of cotangents a stage needs (the spare one not counted).
      n_saved: slots of what a split stage's B saves for its W (:func:`is_split_stage`; 0 without one).
    """

    rows: np.ndarray
    n_x: int
    n_dy: int
    n_saved: int = 0


def is_split_stage(stage_fn: Any) -> bool:
    """True when ``stage_fn`` is a **split stage**: callable as ``stage_fn(x, chunk)`` and with
    ``backward_input(x, chunk, dy) -> (dx, saved)`` and ``backward_weight(saved, chunk) -> d_chunk``
    (e.g. :class:`course_lib.pipeline_measure.ResidualStage`). A split schedule's B then saves ``saved``
    and its W only finishes the weights' gradient from it."""
    return callable(getattr(stage_fn, "backward_input", None)) and callable(
        getattr(stage_fn, "backward_weight", None)
    )


def _colour(intervals: list[tuple]) -> tuple[dict, int]:
    """Lowest-free-slot assignment of ``(start, stop, key)`` intervals (inclusive, half-ticks)."""
    slot_of, busy_until, = {}, []  # fmt: skip
    for start, stop, key in sorted(intervals):
        free = [k for k, until in enumerate(busy_until) if until < start]
        k = free[0] if free else len(busy_until)
        if k == len(busy_until):
            busy_until.append(stop)
        busy_until[k] = stop
        slot_of[key] = k
    return slot_of, len(busy_until)


def _lifetimes(sched: O.OpSchedule, s: int, cells: dict, saving: bool) -> tuple[list, list, list]:
    """Intervals (in half-ticks: an op at ``2t``, an arrival stored at ``2t + 1``) of stage ``s``'s inputs,
    cotangents and (``saving``: a split stage under a split schedule) what B saves for W. Saving, the
    input and the cotangent live until B (the last stage's cotangent from its F, which makes it) and the
    saved values from B to W; else both live until the last operation that reads them, B or W."""
    p = sched.n_stages
    f, b = cells[O.F], cells[O.B]
    last = b if saving or not sched.split else cells[O.W]
    xs, dys, saved = [], [], []
    for (i, c, st), t in f.items():
        if st != s:
            continue
        prev = (i, c, s - 1) if s > 0 else (i, c - 1, p - 1)
        start = 2 * f[prev] + 1 if prev in f else 2 * t
        xs.append((start, 2 * last[(i, c, s)], (i, c)))
        if saving:
            saved.append((2 * b[(i, c, s)], 2 * cells[O.W][(i, c, s)], (i, c)))
        nxt = (i, c, s + 1) if s < p - 1 else (i, c + 1, 0)
        top = nxt not in b
        if top and not sched.split:
            continue  # the last virtual stage's fused B makes its cotangent and uses it at once
        start = (2 * t if saving else 2 * b[(i, c, s)]) if top else 2 * b[nxt] + 1
        dys.append((start, 2 * last[(i, c, s)], (i, c)))
    return xs, dys, saved


def plan(sched: O.OpSchedule, split_stage: bool = False) -> Plan:
    """The slots and arrivals of every cell of ``sched`` (:class:`Plan`); ``split_stage``: the stage is a
    split stage (:func:`is_split_stage`), so a split schedule's B saves for its W (a third buffer of slots,
    ``n_saved``; ignored for a fused schedule).

    Raises:
      ValueError: ``sched`` breaks :func:`course_lib.op_schedules.validate`.
    """
    O.validate(sched)
    p, v, T = sched.n_stages, sched.n_chunks, sched.ticks
    saving = bool(split_stage and sched.split)
    kinds = (O.F, O.B, O.W) if sched.split else (O.F, O.B)
    cells = {k: O._cells(sched.op, sched.mb, sched.chunk, k) for k in kinds}
    per_stage, n_x, n_dy, n_sv = [], 1, 1, 1 if saving else 0
    for s in range(p):
        xs, dys, saved = _lifetimes(sched, s, cells, saving)
        (x_slot, nx), (dy_slot, ndy), (sv_slot, nsv) = _colour(xs), _colour(dys), _colour(saved)
        per_stage.append((x_slot, dy_slot, sv_slot))
        n_x, n_dy, n_sv = max(n_x, nx), max(n_dy, ndy), max(n_sv, nsv)
    rows = np.zeros((T, p, 8), np.int32)
    rows[..., :3] = np.stack([sched.op, sched.mb, np.maximum(sched.chunk, 0)], -1)
    rows[..., 3:] = (n_x, n_dy, n_x, n_dy, n_sv)  # the spare slots, where a cell names none
    for t in range(T):
        for s in range(p):
            op, i, c = (int(a) for a in rows[t, s, :3])
            x_slot, dy_slot, sv_slot = per_stage[s]
            if op != O.IDLE and not (saving and op == O.W):  # a saving W reads only what B saved
                rows[t, s, 3] = x_slot[(i, c)]
                rows[t, s, 4] = dy_slot.get((i, c), n_dy)
            if op in (O.B, O.W):
                rows[t, s, 7] = sv_slot.get((i, c), n_sv)
            if op == O.F:  # the next (virtual) stage receives this input at the end of the tick
                to, cc = (s + 1, c) if s < p - 1 else (0, c + 1)
                if cc < v:
                    rows[t, to, 5] = per_stage[to][0][(i, cc)]
            if op == O.B:  # the previous one receives its cotangent
                to, cc = (s - 1, c) if s > 0 else (p - 1, c - 1)
                if cc >= 0:
                    rows[t, to, 6] = per_stage[to][1][(i, cc)]
    return Plan(rows, n_x, n_dy, n_sv)


class _Ctx(NamedTuple):
    stage_fn: Callable
    head_fn: Callable
    params: Any
    head_params: Any
    xs: jax.Array
    aux: Any
    sched: O.OpSchedule
    s: jax.Array
    axes: tuple
    saving: bool  # a split stage under a split schedule: B saves for W (:func:`is_split_stage`)


def _at(aux, mb):
    return jax.tree.map(lambda a: a[jnp.maximum(mb, 0)], aux)


def _add(grads, c, d, ok):
    return jax.tree.map(lambda g, dd: g.at[c].add(jnp.where(ok, dd, 0)), grads, d)


def _add_head(head_grads, d_head, ok):
    return jax.tree.map(lambda g, d: g + jnp.where(ok, d, 0), head_grads, d_head)


def _forward(ctx: _Ctx, st: dict, row, okf, chunk, top) -> jax.Array:
    """F: the chunk's forward; on the last virtual stage the loss (and, for a saving B, the head's
    gradients and the output's cotangent, put in the cotangent slot for B)."""
    mb, c, xslot, dyslot = row[1], row[2], row[3], row[4]
    x = jnp.where((ctx.s == 0) & (c == 0), ctx.xs[jnp.maximum(mb, 0)], st["xst"][xslot])
    st["xst"] = st["xst"].at[jnp.where(okf, xslot, st["xst"].shape[0] - 1)].set(x)
    y = ctx.stage_fn(x, chunk)
    if ctx.saving:
        loss, (d_head, dy) = jax.value_and_grad(ctx.head_fn, argnums=(0, 1))(
            ctx.head_params, y, _at(ctx.aux, mb)
        )
        st["dyst"] = st["dyst"].at[jnp.where(okf & top, dyslot, st["dyst"].shape[0] - 1)].set(dy)
        st["head_grads"] = _add_head(st["head_grads"], d_head, okf & top)
    else:
        loss = ctx.head_fn(ctx.head_params, y, _at(ctx.aux, mb))
    st["loss"] = st["loss"] + jnp.where(okf & top, loss, 0)
    return y


def _backward(ctx: _Ctx, st: dict, row, okb, chunk, top) -> jax.Array:
    """B: the input's cotangent (the weights' too when fused); returns the cotangent to send back."""
    mb, c, xslot, dyslot = row[1], row[2], row[3], row[4]
    x, n_dy = st["xst"][xslot], st["dyst"].shape[0] - 1
    if ctx.saving:  # the split stage's B: the input's cotangent, and what W needs
        dx, saved = ctx.stage_fn.backward_input(x, chunk, st["dyst"][dyslot])
        if "sv" in st:  # masked: in its slot, in place
            slot = jnp.where(okb, row[7], jax.tree.leaves(st["sv"])[0].shape[0] - 1)
            st["sv"] = jax.tree.map(lambda buf, a: buf.at[slot].set(a), st["sv"], saved)
        else:  # switched: _tick stores it
            st["sv_out"] = saved
        return dx
    if ctx.sched.split:
        y, vjp = jax.vjp(lambda h: ctx.stage_fn(h, chunk), x)
    else:
        y, vjp = jax.vjp(lambda prm, h: ctx.stage_fn(h, prm), chunk, x)
    d_head, dy_top = jax.grad(ctx.head_fn, argnums=(0, 1))(ctx.head_params, y, _at(ctx.aux, mb))
    dy = jnp.where(top, dy_top, st["dyst"][dyslot])
    st["head_grads"] = _add_head(st["head_grads"], d_head, okb & top)
    if ctx.sched.split:
        (dx,) = vjp(dy)
        st["dyst"] = st["dyst"].at[jnp.where(okb, dyslot, n_dy)].set(dy)  # for W
    else:
        d_params, dx = vjp(dy)
        st["grads"] = _add(st["grads"], c, d_params, okb)
    return dx


def _ops(ctx: _Ctx, st: dict, row, ok: dict) -> tuple[dict, jax.Array, jax.Array]:
    """Every operation of one cell, each applied only where ``ok[kind]`` (a bool array, or True):
    returns the new state, the F output to send on and the B output to send back."""
    sched, s = ctx.sched, ctx.s
    mb, c = row[1], row[2]
    chunk = _chunk(ctx.params, c, sched.n_chunks)
    top = (s == sched.n_stages - 1) & (c == sched.n_chunks - 1)
    zero = jnp.zeros_like(st["xst"][0])
    st, y_out, dx_out = dict(st), zero, zero
    if O.F in ok:
        y_out = _forward(ctx, st, row, ok[O.F], chunk, top)
    if O.B in ok:
        dx_out = _backward(ctx, st, row, ok[O.B], chunk, top)
        first = ok[O.B] & (s == 0) & (c == 0)
        st["dxs"] = st["dxs"].at[jnp.where(first, mb, st["dxs"].shape[0] - 1)].set(dx_out)
    if O.W in ok:
        if ctx.saving:  # only the products of what B saved
            saved = st["sv_in"] if "sv_in" in st else jax.tree.map(lambda b: b[row[7]], st["sv"])
            d_params = ctx.stage_fn.backward_weight(saved, chunk)
        else:  # recompute, then the vjp with respect to the weights from the output's cotangent
            x, dy = st["xst"][row[3]], st["dyst"][row[4]]
            (d_params,) = jax.vjp(lambda prm: ctx.stage_fn(x, prm), chunk)[1](dy)
        st["grads"] = _add(st["grads"], c, d_params, ok[O.W])
    return _vary((st, y_out, dx_out), ctx.axes)


def _tick(ctx: _Ctx, axis: str, kinds: tuple, mode: str, st: dict, row_all):
    """One tick: the device's operation (masked or switched), the sends, the arrivals stored."""
    row = row_all[ctx.s]
    op = row[0]
    # switched, the saved buffer stays out of lax.switch (which would copy it): one cell read before it
    if ctx.saving and mode == "cond":
        sv = st.pop("sv")
        st["sv_in"] = jax.tree.map(lambda buf: buf[row[7]], sv)
        st["sv_out"] = jax.tree.map(jnp.zeros_like, st["sv_in"])
    if mode == "masked":
        st, y, dx = _ops(ctx, st, row, {k: op == k for k in kinds})
        y, dx = jnp.where(op == O.F, y, 0), jnp.where(op == O.B, dx, 0)
    else:
        branches = [lambda a: _vary((a, a["xst"][0] * 0, a["xst"][0] * 0), ctx.axes)]
        branches += [lambda a, k=k: _ops(ctx, a, row, {k: True}) if k in kinds else branches[0](a)
                     for k in (O.F, O.B, O.W)]  # fmt: skip
        st, y, dx = lax.switch(op, branches, st)
    if ctx.saving and mode == "cond":
        del st["sv_in"]
        slot = jnp.where(op == O.B, row[7], jax.tree.leaves(sv)[0].shape[0] - 1)
        st["sv"] = jax.tree.map(lambda buf, a: buf.at[slot].set(a), sv, st.pop("sv_out"))
    ring = ctx.sched.n_chunks > 1
    p = ctx.sched.n_stages
    if O.F in kinds:
        st["xst"] = st["xst"].at[row[5]].set(lax.ppermute(y, axis, next_stage(p, +1, ring)))
    if O.B in kinds:
        st["dyst"] = st["dyst"].at[row[6]].set(lax.ppermute(dx, axis, next_stage(p, -1, ring)))
    return st, row[:3]


def _segments(op: np.ndarray) -> list[tuple[int, int, tuple]]:
    """Runs of ticks with the same operations in use on some stage: ``(start, stop, kinds)``."""
    used = [tuple(k for k in (O.F, O.B, O.W) if (op[t] == k).any()) for t in range(op.shape[0])]
    out, start = [], 0
    for t in range(1, len(used) + 1):
        if t == len(used) or used[t] != used[start]:
            out.append((start, t, used[start]))
            start = t
    return out


def run(stage_fn: Callable, head_fn: Callable, params: Any, head_params: Any, xs: jax.Array, aux: Any,
        sched: O.OpSchedule, axis: str, *, mode: str = "masked", the_plan: Plan | None = None,
        input_grads: bool = True):  # fmt: skip
    """Run ``sched`` inside ``shard_map`` over ``axis``: the loss and its gradients.

    Args:
      stage_fn: ``(x [b, S, D], chunk_params) -> [b, S, D]``, or a split stage (:func:`is_split_stage`:
        a split schedule's B then saves for its W, in ``the_plan.n_saved`` slots).
      head_fn: ``(head_params, y, aux_i) -> scalar``, micro-batch ``i``'s loss from the last virtual stage's
        output.
      params: this device's chunks, leaves ``[v, k, …]`` (:func:`course_lib.pipeline.chunked`).
      xs: ``[m, b, S, D]`` micro-batch inputs (stage 0 reads them); aux: pytree of ``[m, …]``.
      mode: one of :data:`MODES`.
      the_plan: :func:`plan` of ``sched`` (built here if not given).
      input_grads: keep the cotangent of every micro-batch's input (``dxs``, an ``[m, b, S, D]`` buffer);
        False returns a zero block of one activation in its place (what the memory measurement needs).

    Returns:
      ``(loss, grads, head_grads, dxs, trace)``: loss and ``head_grads`` nonzero on the last stage only
      (``psum`` them); ``grads`` like ``params``; ``dxs [m, b, S, D]`` the cotangent of ``xs`` (stage 0);
      ``trace`` int32 [T, 3]: the operation, micro-batch and chunk this device ran at each tick.

    Raises:
      ValueError: an unknown ``mode``, an axis whose size is not the schedule's stage count, or a
        ``the_plan`` built for the other kind of stage (``plan(sched, split_stage=...)``).
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    if lax.axis_size(axis) != sched.n_stages:
        raise ValueError(f"schedule {sched.name!r} has {sched.n_stages} stages but axis {axis!r} has "
                         f"{lax.axis_size(axis)} devices; build it with n_stages={lax.axis_size(axis)}")  # fmt: skip
    saving = bool(sched.split and is_split_stage(stage_fn))
    pl = the_plan or plan(sched, saving)
    if (pl.n_saved > 0) != saving:
        raise ValueError(f"the_plan has n_saved={pl.n_saved} for a stage that is {'' if saving else 'not '}"
                         f"split under {sched.name!r}: build it with plan(sched, split_stage={saving})")  # fmt: skip
    axes = _axes_of((xs, params), axis)
    params, head_params = _vary((params, head_params), axes)
    act, m = xs[0], sched.n_micro
    zeros = lambda t: jax.tree.map(jnp.zeros_like, t)  # noqa: E731
    st = dict(
        xst=jnp.zeros((pl.n_x + 1, *act.shape), act.dtype), dyst=jnp.zeros((pl.n_dy + 1, *act.shape), act.dtype),
        grads=zeros(params), head_grads=zeros(head_params), loss=jnp.zeros((), act.dtype),
        dxs=jnp.zeros((m + 1 if input_grads else 1, *act.shape), act.dtype),
    )  # fmt: skip
    if saving:  # n_saved slots (and a spare) of what B saves for W
        saved = jax.eval_shape(
            stage_fn.backward_input, act, _chunk(params, 0, sched.n_chunks), act
        )[1]
        st["sv"] = jax.tree.map(lambda a: jnp.zeros((pl.n_saved + 1, *a.shape), a.dtype), saved)
    st = _vary(st, axes)
    ctx = _Ctx(
        stage_fn, head_fn, params, head_params, xs, aux, sched, lax.axis_index(axis), axes, saving
    )
    traces = []
    # masked: a loop per run of ticks with the same operations in use (it computes only those); switched:
    # one loop (a device computes only its own operation anyway), one body to compile
    segments = _segments(sched.op)
    if mode == "cond":
        segments = [(0, sched.ticks, tuple(k for k in (O.F, O.B, O.W) if (sched.op == k).any()))]
    for start, stop, kinds in segments:
        body = lambda a, r, k=kinds: _tick(ctx, axis, k, mode, a, r)  # noqa: E731
        st, tr = lax.scan(body, st, jnp.asarray(pl.rows[start:stop]))
        traces.append(tr)
    dxs = st["dxs"][:m] if input_grads else st["dxs"]
    return st["loss"], st["grads"], st["head_grads"], dxs, jnp.concatenate(traces)


def _inner(_, y, r):  # the loss of one micro-batch: <y, r>, so its gradient is r
    return (y * r).sum()


def build_step(mesh: Any, axis: str, sched: O.OpSchedule, stage_fn: Callable, *, mode: str = "masked",
               input_grads: bool = True):  # fmt: skip
    """``step(params, xs, r) -> (loss, grads, dxs, trace)``, jitted: :func:`run` under ``shard_map`` with
    the loss ``Σ_i <y_i, r_i>`` (``xs``, ``r`` [m, N, D] replicated; ``params``
    :func:`~course_lib.pipeline.chunked` to ``sched.n_chunks``, placed with ``stage_spec(axis)``);
    ``trace`` int32 [T, 3, p], what every device ran (:func:`run`); ``dxs`` a zero block without
    ``input_grads``."""
    spec, the_plan = stage_spec(axis), plan(sched, is_split_stage(stage_fn))

    def body(params, xs, r):
        loss, grads, _, dxs, tr = run(stage_fn, _inner, params, {}, xs, r, sched, axis, mode=mode,
                                      the_plan=the_plan, input_grads=input_grads)  # fmt: skip
        return lax.psum(loss, axis), grads, lax.psum(dxs, axis), tr[..., None]

    out_specs = (P(), spec, P(), P(None, None, axis))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P(), P()), out_specs=out_specs))


# --- what the two modes cost, predicted from the table ------------------------------------------------------


def op_flops(stage_fn: Callable, chunk: Any, x: jax.Array) -> dict[str, float]:
    """FLOPs of one cell of each operation, each compiled alone on one device: ``"F"`` (the chunk's
    forward), ``"B"`` (the whole backward: recompute, then the vjp), ``"B_split"`` and ``"W"``, the split
    backward. For a split stage (:func:`is_split_stage`) as the executor runs it: B_split is
    ``backward_input`` (recompute, then the input-gradient chain, keeping each layer's input and matmul
    cotangent: about 2 ``"F"``) and W is ``backward_weight`` (one product per layer: about 1 ``"F"``, Qi et
    al.'s W). For a plain ``stage_fn``: B_split recomputes, then the input's cotangent only; W recomputes,
    then the weights' cotangent from the chunk's output cotangent alone, so it also runs the input-gradient
    chain back through the chunk's layers (about 3 ``"F"`` for a chunk of several layers)."""

    def flops(fn, *args):
        cost = jax.jit(fn).lower(*args).compile().cost_analysis()
        return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])

    def vjp_of(argnums):
        def cell(chunk, x, r):
            _, vjp = jax.vjp(lambda c, h: stage_fn(h, c), chunk, x)
            grads = vjp(r)
            return tuple(grads[a] for a in argnums)

        return cell

    out = {"F": flops(stage_fn, x, chunk), "B": flops(vjp_of((0, 1)), chunk, x, x)}
    if is_split_stage(stage_fn):
        saved = jax.eval_shape(stage_fn.backward_input, x, chunk, x)[1]
        return out | {"B_split": flops(stage_fn.backward_input, x, chunk, x),
                      "W": flops(stage_fn.backward_weight, saved, chunk)}  # fmt: skip
    return out | {"B_split": flops(lambda c, h, r: jax.vjp(lambda hh: stage_fn(hh, c), h)[1](r), chunk, x, x),
                  "W": flops(lambda c, h, r: jax.vjp(lambda cc: stage_fn(h, cc), c)[1](r), chunk, x, x)}  # fmt: skip


def work(sched: O.OpSchedule, cost: dict[str, float]) -> dict[str, float]:
    """The work of one device over the step, in units of ``cost`` (:func:`op_flops`, or any per-operation
    costs): ``"useful"``, its own cells (what ``mode="cond"`` computes; the same on every stage);
    ``"masked"``, every operation some stage runs at each tick (what ``mode="masked"`` computes)."""
    per = {O.F: cost["F"], O.B: cost["B_split" if sched.split else "B"], O.W: cost.get("W", 0.0)}
    useful = sum(per[k] * float((sched.op[:, 0] == k).sum()) for k in per)
    masked = sum(per[k] * float((sched.op == k).any(1).sum()) for k in per)
    return {"useful": useful, "masked": masked}

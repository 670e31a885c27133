"""Pipeline schedules with one operation per stage per tick: GPipe, PipeDream-Flush 1F1B, interleaved 1F1B
and ZB-H1 zero-bubble, as tables that :mod:`course_lib.pipeline_ops` runs and the pictures draw.

:mod:`course_lib.schedules` tables run two lanes in lockstep (every stage computes every lane some stage
uses at a tick). Here a tick is **one operation** on each stage, as on a real device: **F** (a chunk's
forward), **B** (its backward: in :data:`FUSED` schedules the whole backward, input and weight gradients;
in ZB-H1 only the input's gradient, what the previous stage waits for) or **W** (ZB-H1's weight gradient,
which nothing waits for), or nothing (the bubble). Every operation takes one tick (Qi et al.'s
``T_F = T_B = T_W`` for ZB-H1; for the fused schedules the bubble's *fraction* does not depend on how long
a backward takes). A value made at tick ``t`` can be used from tick ``t + 1``; it may wait longer (the
executor keeps it in a slot until then).

Each table is built the same way (:func:`_simulate`): every stage has an **order** of operations and
runs the next one as soon as what it needs has arrived (:func:`from_orders`: orders written by hand). The
schedules differ only in their orders:

- :func:`gpipe` — all forwards, then all backwards: bubble ``(p-1)/(m+p-1)`` of the step; ``m`` inputs held.
- :func:`pipedream_flush` — 1F1B (Narayanan et al. 2021, "PipeDream-Flush"): stage ``s`` runs ``p-1-s``
  warm-up forwards, then one forward, one backward, …, then the cool-down backwards. The same bubble as
  GPipe; at most ``min(m, p-s)`` micro-batches in flight on stage ``s``.
- :func:`interleaved` — interleaved 1F1B (Narayanan et al. 2021, §2.2): ``v`` chunks (virtual stages) per
  device, **depth-first**: a group of ``p`` micro-batches goes through chunk 0, then the same group through
  chunk 1, …; bubble ``(p-1)/(v·m)`` of the ideal step (``(p-1)/(v·m + p-1)`` of the step).
- :func:`zb_h1` — ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with each backward
  split into B and W; on stage ``s`` the W of micro-batch ``i`` runs after the B of micro-batch ``i + s``,
  in what were 1F1B's idle ticks, so every stage holds at most ``p`` micro-batches (1F1B's peak). Bubble
  ``(p-1)(T_F+T_B-T_W)`` per stage, a third of 1F1B's ``(p-1)(T_F+T_B+T_W)`` at ``T_F = T_B = T_W``:
  ``(p-1)/(3m+p-1)`` of the step.

:func:`predicted_bubble` and :func:`predicted_in_flight` are the closed forms; :func:`measured_bubble` and
:func:`measured_in_flight` read a table (or a run's trace); :func:`timed` replays one with
operations of unequal length (the bubble as time). Taught in ``notebooks/11_pipeline_experts.ipynb``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from . import held as _held  # noqa: F401 (the student package's stub calls it)

__all__ = ["NAMES", "IDLE", "F", "B", "W", "OpSchedule", "gpipe", "pipedream_flush", "interleaved", "zb_h1",
           "breadth_first", "from_orders", "OP_SCHEDULES", "make", "predicted_bubble", "predicted_in_flight",
           "measured_bubble", "measured_in_flight", "timed", "validate"]  # fmt: skip

IDLE, F, B, W = 0, 1, 2, 3
"""Operation codes of a cell: nothing, a forward, a backward (input gradient; the whole backward when the
schedule is fused), a weight gradient."""
NAMES = {IDLE: "idle", F: "F", B: "B", W: "W"}


@dataclasses.dataclass(frozen=True, eq=False)
class OpSchedule:
    """A table of ticks × stages, one operation per cell.

    Attributes:
      name: e.g. ``"1f1b"``; n_stages p, n_micro m, n_chunks v (chunks of layers per device).
      op: int32 [T, p], :data:`IDLE`, :data:`F`, :data:`B` or :data:`W`.
      mb, chunk: int32 [T, p], the cell's micro-batch and chunk (``-1`` where idle).
      split: True when the backward is split into B and W (ZB-H1); False: B is the whole backward.
    """

    name: str
    n_stages: int
    n_micro: int
    n_chunks: int
    op: np.ndarray
    mb: np.ndarray
    chunk: np.ndarray
    split: bool = False

    @property
    def ticks(self) -> int:
        """T, rows of the table."""
        return int(self.op.shape[0])


def _check_sizes(p, m, v=1) -> None:
    for name, value in (("n_stages", p), ("n_micro", m), ("n_chunks", v)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")


def _needs(op, i, c, s, p, v) -> list[tuple]:
    """The operations that must be done (at an earlier tick) before ``(op, i, c)`` on stage ``s``."""
    if op == F:
        if s > 0:
            return [(F, i, c, s - 1)]
        return [(F, i, c - 1, p - 1)] if c > 0 else []
    if op == B:
        after = [(F, i, c, s)]
        if s < p - 1:
            return after + [(B, i, c, s + 1)]
        return after + ([(B, i, c + 1, 0)] if c < v - 1 else [])
    return [(B, i, c, s)]


def _simulate(name, p, m, v, orders, split=False) -> OpSchedule:
    """Run every stage's ``orders[s]`` (a list of ``(op, mb, chunk)``) in order, each operation at the first
    tick when everything it needs was done at an earlier tick. Raises ``RuntimeError`` on a deadlock (a tick
    where no stage can run its next operation: none ever will), naming what each waiting stage waits for."""
    pending = [list(o) for o in orders]
    done: dict[tuple, int] = {}
    rows = []
    while any(pending):
        t = len(rows)
        row = []
        for s in range(p):
            nxt = pending[s][0] if pending[s] else None
            ok = nxt and all(done.get(d, t) < t for d in _needs(*nxt, s, p, v))
            row.append(pending[s].pop(0) if ok else (IDLE, -1, -1))
        if all(o == IDLE for o, _, _ in row):
            raise RuntimeError(_deadlock(name, t, pending, done, p, v))
        for s, (o, i, c) in enumerate(row):
            if o != IDLE:
                done[(o, i, c, s)] = t
        rows.append(row)
    arr = np.asarray(rows, np.int32)  # [T, p, 3]
    return OpSchedule(name, p, m, v, arr[..., 0], arr[..., 1], arr[..., 2], split)


def _said(o, i, c, v, s=None) -> str:
    chunk = f", chunk {c}" if v > 1 else ""
    return f"the {NAMES[o]} of micro-batch {i}{chunk}" + ("" if s is None else f" on stage {s}")


def _deadlock(name, t, pending, done, p, v) -> str:
    """Why no stage can run at tick ``t``: what each stage with operations left waits for."""
    out = []
    for s, order in enumerate(pending):
        if order:
            o, i, c, r = next(d for d in _needs(*order[0], s, p, v) if d not in done)
            out.append(f"stage {s} waits to run {_said(*order[0], v)}, which needs {_said(o, i, c, v, r)}")  # fmt: skip
    return f"{name}: the orders deadlock at tick {t}: " + "; ".join(out)


def gpipe(n_stages: int, n_micro: int) -> OpSchedule:
    """GPipe: every stage runs the ``m`` forwards, then the ``m`` backwards (last micro-batch first, the
    mirror of the forward). ``2(m+p-1)`` ticks, bubble ``(p-1)/(m+p-1)`` (Huang et al. 2019); every
    stage holds all ``m`` micro-batches' inputs at once.

    Raises:
      ValueError: a size that is not a positive integer.
    """
    _check_sizes(n_stages, n_micro)
    p, m = n_stages, n_micro
    order = [(F, i, 0) for i in range(m)] + [(B, i, 0) for i in reversed(range(m))]
    return _simulate("gpipe", p, m, 1, [order] * p)


def _one_f_one_b(fwd: list, bwd: list, warm: int) -> list:
    """``warm`` forwards, then alternately one forward and one backward, then the remaining backwards."""
    order = list(fwd[:warm])
    for k in range(len(fwd) - warm):
        order += [fwd[warm + k], bwd[k]]
    return order + list(bwd[len(fwd) - warm :])


def pipedream_flush(n_stages: int, n_micro: int) -> OpSchedule:
    """PipeDream-Flush 1F1B (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training"):
    stage ``s`` runs ``min(m, p-1-s)`` warm-up forwards, then one forward and one backward in turn, then
    the cool-down backwards. ``2(m+p-1)`` ticks, bubble ``(p-1)/(m+p-1)`` like GPipe, but stage ``s`` holds
    at most ``min(m, p-s)`` micro-batches' inputs, whatever ``m``.

    Raises:
      ValueError: a size that is not a positive integer.
    """
    _check_sizes(n_stages, n_micro)
    p, m = n_stages, n_micro
    fwd = [(F, i, 0) for i in range(m)]
    bwd = [(B, i, 0) for i in range(m)]
    return _simulate("1f1b", p, m, 1, [_one_f_one_b(fwd, bwd, min(m, p - 1 - s)) for s in range(p)])


def _depth_first(p, m, v, op, reverse_chunks) -> list:
    """Megatron-LM's order of ``(op, mb, chunk)``: groups of ``p`` micro-batches, each group through every
    chunk (backwards: from the last chunk) before the next group starts."""
    out = []
    for g in range(m // p):
        for c in range(v):
            cc = v - 1 - c if reverse_chunks else c
            out += [(op, g * p + j, cc) for j in range(p)]
    return out


def interleaved(n_stages: int, n_micro: int, n_chunks: int = 2) -> OpSchedule:
    """Interleaved 1F1B (Narayanan et al. 2021, §2.2; Megatron-LM): device ``s`` holds chunks ``c = 0 … v-1``
    (virtual stage ``c·p + s``); the order is depth-first (:func:`_depth_first`), with
    ``min(v·m, 2(p-1-s) + (v-1)·p)`` warm-up forwards, then 1F1B. Each tick runs one chunk (``1/v`` of a
    stage), so the bubble is ``(p-1)/v`` stage-times: ``(p-1)/(v·m)`` of the ideal step. Stage ``s`` holds
    ``min(v·m, v·p + p - 1 - 2s)`` chunk inputs (each ``1/v`` of a stage's activations).

    Raises:
      ValueError: a size that is not a positive integer, or ``n_micro`` not a multiple of ``n_stages``.
    """
    _check_sizes(n_stages, n_micro, n_chunks)
    p, m, v = n_stages, n_micro, n_chunks
    if m % p:
        raise ValueError(
            f"interleaved 1F1B: n_micro={m} is not a multiple of n_stages={p}; use m = {p * max(1, m // p)}"
        )
    fwd, bwd = _depth_first(p, m, v, F, False), _depth_first(p, m, v, B, True)
    warm = [min(v * m, 2 * (p - 1 - s) + (v - 1) * p) for s in range(p)]
    return _simulate("interleaved", p, m, v, [_one_f_one_b(fwd, bwd, w) for w in warm])


def breadth_first(n_stages: int, n_micro: int, n_chunks: int = 2) -> OpSchedule:
    """Breadth-first interleaving (Lamy-Poirier 2023, "Breadth-First Pipeline Parallelism"; the looping
    pipeline): the virtual stages of :func:`interleaved`, but every micro-batch goes through chunk 0 before
    any goes through chunk 1, and all forwards come before the backwards (last chunk first). The same bubble
    ``(p-1)/(v·m + p-1)``; every stage holds all ``v·m`` chunk inputs, but a chunk's weight gradients are
    complete ``m`` backwards after they start, early in the backward, so a data-parallel all-reduce of
    them can overlap the remaining chunks' backwards (depth-first finishes every chunk at the end).

    Raises:
      ValueError: a size that is not a positive integer.
    """
    _check_sizes(n_stages, n_micro, n_chunks)
    p, m, v = n_stages, n_micro, n_chunks
    order = [(F, i, c) for c in range(v) for i in range(m)]
    order += [(B, i, c) for c in reversed(range(v)) for i in range(m)]
    return _simulate("breadth_first", p, m, v, [order] * p)


def zb_h1(n_stages: int, n_micro: int) -> OpSchedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §3.1): the backward split into **B** (the
    input's gradient, sent to the previous stage) and **W** (the weights' gradient, which nothing waits
    for). The order is 1F1B's (``p-1-s`` warm-up forwards, then F and B in turn), with the W of micro-batch
    ``i`` run on stage ``s`` after the B of micro-batch ``i + s`` (the last ``s`` W's at the end): the W's
    fill what were 1F1B's bubbles, and every stage holds at most ``p`` micro-batches (F done, W not), 1F1B's
    peak (stage 0's). Idle ``(p-1)(T_F+T_B-T_W)`` per stage instead of 1F1B's ``(p-1)(T_F+T_B+T_W)``: a
    third at ``T_F = T_B = T_W``, ``3m + p - 1`` ticks, bubble ``(p-1)/(3m+p-1)`` of the step (for
    ``m >= p``; fewer micro-batches than stages leave more idle). Lesson 11's exercise: the student package
    holds the orders out (:mod:`course_lib.held`). Raises ``ValueError``: a size not a positive integer.
    """
    _check_sizes(n_stages, n_micro)
    # BEGIN SOLUTION  # STUB: orders = _held.call("op_schedules.zb_h1", n_stages, n_micro)
    p, m = n_stages, n_micro
    orders = []
    for s in range(p):
        fwd, bwd = [(F, i, 0) for i in range(m)], [(B, i, 0) for i in range(m)]
        order = []
        for op in _one_f_one_b(fwd, bwd, min(m, p - 1 - s)):
            order.append(op)
            if op[0] == B and op[1] >= s:
                order.append((W, op[1] - s, 0))
        orders.append(order + [(W, i, 0) for i in range(max(0, m - s), m)])
    # END SOLUTION
    return from_orders("zb_h1", n_stages, n_micro, orders, split=True)


def _entry(where: str, entry, m: int, kinds: tuple) -> tuple[int, int]:
    """``(op, mb)`` of an entry ``(op, mb)`` or ``(op, mb, 0)`` of an order; ``ValueError`` naming it."""
    whole = lambda x: isinstance(x, (int, np.integer)) and not isinstance(x, bool)  # noqa: E731
    op, i, *chunk = entry if isinstance(entry, (tuple, list)) and len(entry) in (2, 3) else (0, 0, 1)  # fmt: skip
    if chunk not in ([], [0]) or not whole(op) or op not in kinds or not whole(i) or not 0 <= i < m:
        codes = ", ".join(f"{NAMES[k]} = {k}" for k in kinds)
        raise ValueError(f"{where} is not an (op, micro_batch) with op one of {codes} and 0 <= "
                         f"micro_batch < {m}" + ("" if W in kinds else " (W needs split=True)"))  # fmt: skip
    return int(op), int(i)


def _stage(name: str, s: int, order, m: int, kinds: tuple) -> list[tuple]:
    """Stage ``s``'s ``order`` as ``(op, mb, 0)``; each operation of each micro-batch once, F, B, W."""
    at: dict[tuple, int] = {}
    for k, entry in enumerate(order):
        cell = _entry(f"{name}: orders[{s}][{k}] = {entry!r}", entry, m, kinds)
        if cell in at:
            raise ValueError(f"{name}: stage {s} runs {_said(*cell, 0, 1)} twice ([{at[cell]}], [{k}])")  # fmt: skip
        at[cell] = k
    for i in range(m):
        for a, b in zip(kinds, kinds[1:] + (None,), strict=True):
            if (a, i) not in at:
                raise ValueError(f"{name}: stage {s}'s order has no {NAMES[a]} of micro-batch {i}: each stage runs "
                                 f"the {'/'.join(NAMES[k] for k in kinds)} of each micro-batch once")  # fmt: skip
            if (b, i) in at and at[(b, i)] < at[(a, i)]:
                raise ValueError(f"{name}: stage {s} runs {_said(b, i, 0, 1)} (orders[{s}][{at[(b, i)]}]) "
                                 f"before its {NAMES[a]} ([{at[(a, i)]}]), whose result it needs")  # fmt: skip
    return [(o, i, 0) for o, i in at]


def from_orders(name: str, n_stages: int, n_micro: int, orders, split: bool = True) -> OpSchedule:
    """The table of hand-written orders (one chunk): ``orders[s]`` lists stage ``s``'s operations in the
    order it runs them, each ``(op, micro_batch)``, ``op`` one of :data:`F`, :data:`B`, :data:`W` (no W
    unless ``split``: then B is the whole backward), each run at the first tick when what it needs has
    arrived (:func:`_simulate`, as every table here). Lesson 11's exercise 3 builds ZB-H1 with it.

    Raises:
      ValueError: not ``n_stages`` orders; an entry not ``(op, micro_batch)`` with a code and ``0 <=
        micro_batch < n_micro`` (named ``orders[s][k]``); a stage that runs an operation of a micro-batch
        twice or never, or a B before its F, a W before its B.
      RuntimeError: the stages wait on each other (each waiting stage's next operation and its need).
    """
    _check_sizes(n_stages, n_micro)
    p, kinds = n_stages, (F, B, W) if split else (F, B)
    listed = lambda x: isinstance(x, (list, tuple))  # noqa: E731
    if not listed(orders) or len(orders) != p or not all(map(listed, orders)):
        raise ValueError(
            f"{name}: orders must be a list of one list per stage ({p}), not {orders!r:.80}"
        )
    full = [_stage(name, s, order, n_micro, kinds) for s, order in enumerate(orders)]
    return _simulate(name, p, n_micro, 1, full, split)


OP_SCHEDULES = {"gpipe": gpipe, "1f1b": pipedream_flush, "interleaved": interleaved, "zb_h1": zb_h1,
                "breadth_first": breadth_first}  # fmt: skip
"""The one-operation-per-tick schedules by name (``make(name, p, m, v)``)."""


def make(name: str, n_stages: int, n_micro: int, n_chunks: int = 1) -> OpSchedule:
    """The schedule ``name`` (a key of :data:`OP_SCHEDULES`); ``n_chunks`` only for the interleaved two.

    Raises:
      ValueError: an unknown name, or ``n_chunks > 1`` for a schedule without chunks.
    """
    if name not in OP_SCHEDULES:
        raise ValueError(f"schedule {name!r} is not one of {sorted(OP_SCHEDULES)}")
    if name in ("interleaved", "breadth_first"):
        return OP_SCHEDULES[name](n_stages, n_micro, n_chunks)
    if n_chunks != 1:
        raise ValueError(
            f"schedule {name!r} has one chunk per stage; n_chunks={n_chunks} needs 'interleaved'"
        )
    return OP_SCHEDULES[name](n_stages, n_micro)


def predicted_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """The closed form of the bubble, as a fraction of the step (idle stage-ticks over all):
    GPipe and 1F1B ``(p-1)/(m+p-1)`` (Huang et al. 2019; Narayanan et al. 2021); interleaved 1F1B
    ``(p-1)/(v·m + p-1)``, i.e. ``(p-1)/(v·m)`` of the ideal step (Narayanan et al. 2021, §2.2); ZB-H1
    ``(p-1)/(3m + p-1)`` at ``T_F = T_B = T_W`` (Qi et al. 2023: ``(p-1)(T_F+T_B-T_W)`` per stage, a third
    of 1F1B's ``(p-1)(T_F+T_B+T_W)``)."""
    _check_sizes(p, m, v)
    if name not in OP_SCHEDULES:
        raise ValueError(f"schedule {name!r} is not one of {sorted(OP_SCHEDULES)}")
    if name == "zb_h1":
        return (p - 1) / (3 * m + p - 1)
    vm = v * m if name in ("interleaved", "breadth_first") else m
    return (p - 1) / (vm + p - 1)


def predicted_in_flight(name: str, p: int, m: int, v: int = 1) -> list[int]:
    """The most micro-batch inputs stage ``s`` holds at once (chunk inputs for the interleaved two): GPipe
    ``m``; breadth-first ``v·m``; 1F1B ``min(m, p-s)`` (Narayanan et al. 2021); ZB-H1 ``min(m, p)`` on
    every stage (1F1B's peak: a W runs up to ``s`` micro-batches late on stage ``s``); interleaved 1F1B
    ``min(v·m, 2(p-1-s) + (v-1)·p + 1)``, its warm-up plus one."""
    _check_sizes(p, m, v)
    if name in ("gpipe", "breadth_first"):
        return [m * (v if name == "breadth_first" else 1)] * p
    if name == "interleaved":
        return [min(v * m, 2 * (p - 1 - s) + (v - 1) * p + 1) for s in range(p)]
    if name == "zb_h1":
        return [min(m, p)] * p
    return [min(m, p - s) for s in range(p)]


def _cells(op: np.ndarray, mb: np.ndarray, chunk: np.ndarray, kind: int) -> dict:
    t, s = np.nonzero(op == kind)
    return {(int(mb[a, b]), int(chunk[a, b]), int(b)): int(a) for a, b in zip(t, s, strict=True)}


def measured_bubble(table) -> float:
    """Idle cells over all cells of a table or of a run's trace (``op`` [T, p]): the bubble as a fraction
    of the step, every operation one tick."""
    op = np.asarray(getattr(table, "op", table))
    return float((op == IDLE).mean())


def measured_in_flight(sched: OpSchedule) -> np.ndarray:
    """int [p]: the most micro-batches (chunk inputs) each stage has **in flight** at once, read from a table:
    from the tick of its F to the tick of the operation that last reads its input (B, or W when the
    backward is split). (The executor also keeps an input that has arrived before its F: its slots,
    :func:`course_lib.pipeline_ops.plan`, can be one more.)"""
    f = _cells(sched.op, sched.mb, sched.chunk, F)
    last = _cells(sched.op, sched.mb, sched.chunk, W if sched.split else B)
    held = np.zeros((sched.ticks + 1, sched.n_stages), int)
    for (i, c, s), t in f.items():
        held[t : last[(i, c, s)] + 1, s] += 1
    return held.max(0)


def timed(sched: OpSchedule, durations: dict[int, float]) -> dict:
    """Replay a table with operations of unequal length: each stage runs its operations in the table's
    order, each as soon as the stage is free and what it needs (:func:`validate`'s rules) has finished.

    Args:
      sched: a table (:func:`make`).
      durations: seconds (or any unit) of each operation kind, e.g. ``{F: 1, B: 2}`` for a fused backward
        of twice a forward, ``{F: 1, B: 1, W: 1}`` for ZB-H1 at ``T_F = T_B = T_W``.

    Returns:
      ``{"step": the step's length, "busy": [p] each stage's summed operations, "idle": [p] step - busy}``
      in the unit of ``durations``: the bubble as time, where a table counts ticks.

    Raises:
      ValueError: a kind the table uses has no duration.
    """
    p, v = sched.n_stages, sched.n_chunks
    missing = {NAMES[k] for k in np.unique(sched.op) if k != IDLE and k not in durations}
    if missing:
        raise ValueError(f"durations {durations} give no length for {sorted(missing)}: add them")
    order = [[(int(o), int(i), int(c)) for o, i, c in zip(sched.op[:, s], sched.mb[:, s], sched.chunk[:, s])
              if o != IDLE] for s in range(p)]  # fmt: skip
    end: dict[tuple, float] = {}
    free, busy, nxt = [0.0] * p, [0.0] * p, [0] * p
    while any(nxt[s] < len(order[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while nxt[s] < len(order[s]):
                o, i, c = order[s][nxt[s]]
                needs = _needs(o, i, c, s, p, v)
                if any(d not in end for d in needs):
                    break
                start = max([free[s], *(end[d] for d in needs)])
                free[s] = end[(o, i, c, s)] = start + durations[o]
                busy[s] += durations[o]
                nxt[s], moved = nxt[s] + 1, True
        if not moved:  # a table validate() accepts never gets here
            raise ValueError(f"{sched.name}: the table's orders wait on each other")
    step = max(free)
    return {"step": step, "busy": busy, "idle": [step - b for b in busy]}


def validate(sched: OpSchedule) -> None:
    """Check that every (micro-batch, chunk) passes every stage once per operation, and that each
    operation comes after what it needs (:func:`_needs`).

    Raises:
      ValueError: the first broken rule, naming the cell.
    """
    p, m, v = sched.n_stages, sched.n_micro, sched.n_chunks
    want = {(i, c, s) for i in range(m) for c in range(v) for s in range(p)}
    done = {}
    for kind in (F, B, W) if sched.split else (F, B):
        cells = _cells(sched.op, sched.mb, sched.chunk, kind)
        if set(cells) != want or (sched.op == kind).sum() != len(want):
            raise ValueError(
                f"{sched.name}: {NAMES[kind]} is not run once per (micro-batch, chunk, stage): missing "
                f"{sorted(want - set(cells))[:3]}"
            )
        done.update({(kind, *k): t for k, t in cells.items()})
    for (kind, i, c, s), t in sorted(done.items(), key=lambda kv: kv[1]):
        for need in _needs(kind, i, c, s, p, v):
            if done[need] >= t:
                raise ValueError(
                    f"{sched.name}: {NAMES[kind]} of micro-batch {i}, chunk {c} on stage {s} at tick {t} "
                    f"needs the {NAMES[need[0]]} of stage {need[3]} (chunk {need[2]}), done at tick "
                    f"{done[need]}: a value can be used from the tick after the one that made it"
                )

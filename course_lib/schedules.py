"""Pipeline schedules as data: a table of ticks × stages that the executor runs and the pictures draw.

A pipeline splits a model's layers into ``p`` **stages**, one per device of a ``stage`` mesh axis, and a
batch into ``m`` **micro-batches**. In one SPMD program every stage steps in lockstep: at each **tick** a
stage runs its **F** lane (the forward of one micro-batch through its layers) and/or its **B** lane (the
backward of one micro-batch), then every stage passes its F output to the next stage and its B output (the
input's cotangent) to the previous one with ``ppermute``. A :class:`Schedule` says, for every tick and
stage, which micro-batch each lane works on (``-1``: idle), through which **chunk** of the stage's layers
(interleaved schedules give a device ``v`` chunks, layers ``c·p + s``), and in which **slot** of the stage's
stash the F lane keeps its input until the B lane needs it.

- :func:`gpipe` — all forwards, then all backwards (the backward is the forward's mirror, which is what
  ``jax.grad`` of a forward-only pipeline runs). Bubble ``(p-1)/(m+p-1)``; every micro-batch in flight.
- :func:`one_f_one_b` — **lockstep 1F1B**, as an SPMD program with one F and one B lane per tick runs it:
  each stage starts a micro-batch's backward as soon as it comes back. The same bubble, at most
  ``2(p-1-s)+1`` micro-batches in flight on stage ``s``, whatever ``m``. (The 1F1B of the literature,
  PipeDream-Flush, runs one operation per tick and holds at most ``p-s``:
  :func:`course_lib.op_schedules.pipedream_flush`.)
- :func:`circular` — interleaved (circular) GPipe: ``v`` chunks per device (virtual stages), micro-batches
  go round the ring ``v`` times, all forwards then all backwards. Bubble ``(p-1)/(v·m+p-1)``, ``v·m`` chunk
  inputs in flight. (Megatron-LM's *interleaved 1F1B* uses the same virtual stages in a 1F1B order, which
  keeps the smaller bubble and a stash that does not grow with ``m``: :func:`course_lib.op_schedules.interleaved`,
  one operation per tick.)
- :func:`busy` — not a pipeline: every stage works at every tick (no stage waits for its input); the time
  of the useful work, a timing baseline.

The bubble and the stash are read from the table (:func:`bubble_fraction`, :meth:`Schedule.in_flight`);
``notebooks/11_pipeline_experts.ipynb`` measures both in the compiled program.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = [
    "Schedule",
    "gpipe",
    "one_f_one_b",
    "circular",
    "busy",
    "micro_batches",
    "SCHEDULES",
    "make",
    "validate",
    "bubble_fraction",
    "lockstep_cost",
    "gpipe_bubble",
]

IDLE = -1
"""A lane's micro-batch when it does nothing at that tick."""


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A table of ticks × stages: what each stage's F and B lanes do at each tick.

    Attributes:
      name: e.g. ``"gpipe"``.
      n_stages: p, devices on the stage axis.
      n_micro: m, micro-batches per step.
      n_chunks: v, chunks of layers per device (1 but for interleaved schedules).
      f_mb, f_chunk, f_slot: int32 [T, p]: the F lane's micro-batch (``-1`` idle), chunk and stash slot.
      b_mb, b_chunk, b_slot: int32 [T, p]: the B lane's micro-batch, chunk and the slot it reads.
      n_slots: stash slots a stage needs (the most micro-batch inputs one stage holds at once).
      is_pipeline: False for :func:`busy` (a timing baseline whose stages do not wait for their inputs).
    """

    name: str
    n_stages: int
    n_micro: int
    n_chunks: int
    f_mb: np.ndarray
    f_chunk: np.ndarray
    f_slot: np.ndarray
    b_mb: np.ndarray
    b_chunk: np.ndarray
    b_slot: np.ndarray
    n_slots: int
    is_pipeline: bool = True

    @property
    def ticks(self) -> int:
        """T, rows of the table."""
        return int(self.f_mb.shape[0])

    def forward_ticks(self) -> int:
        """Ticks before the first B cell (all of them hold F cells in a forward-then-backward schedule)."""
        has_b = (self.b_mb >= 0).any(1)
        return int(np.argmax(has_b)) if has_b.any() else self.ticks

    def in_flight(self) -> np.ndarray:
        """int [p]: the most micro-batch inputs each stage holds at once (F done, B not yet done)."""
        held = np.zeros(self.n_stages, int)
        peak = np.zeros(self.n_stages, int)
        for t in range(self.ticks):
            held += self.f_mb[t] >= 0
            peak = np.maximum(peak, held)
            held -= self.b_mb[t] >= 0
        return peak

    def lanes(self) -> np.ndarray:
        """bool [T, 2]: whether any stage uses the F lane (column 0) and the B lane (column 1) at each tick."""
        return np.stack([(self.f_mb >= 0).any(1), (self.b_mb >= 0).any(1)], axis=1)

    def segments(self) -> list[tuple[int, int, bool, bool]]:
        """Runs of consecutive ticks with the same lanes in use: ``(start, stop, has_f, has_b)``. The
        executor compiles one loop per run, computing only the lanes the run uses."""
        lanes, out, start = self.lanes(), [], 0
        for t in range(1, self.ticks + 1):
            if t == self.ticks or (lanes[t] != lanes[start]).any():
                out.append((start, t, bool(lanes[start, 0]), bool(lanes[start, 1])))
                start = t
        return out

    def mirrored(self) -> bool:
        """True when the B half is the F half run backwards (what ``jax.grad`` of the forward runs)."""
        tf = self.forward_ticks()
        if 2 * tf != self.ticks:
            return False
        return bool(
            (self.b_mb[tf:][::-1] == self.f_mb[:tf]).all()
            and (self.b_chunk[tf:][::-1] == self.f_chunk[:tf]).all()
        )


def _check_sizes(p, m, v=1) -> None:
    for name, value in (("n_stages", p), ("n_micro", m), ("n_chunks", v)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")


def _allocate(f_mb: np.ndarray, b_mb: np.ndarray, f_key, b_key) -> tuple:
    """Give each F cell the lowest free stash slot of its stage; a B cell frees its slot after its tick.

    ``f_key``/``b_key`` [T, p] identify a cell's work (micro-batch and chunk) so the B cell finds its slot.
    """
    t_count, p = f_mb.shape
    f_slot = np.zeros((t_count, p), np.int32)
    b_slot = np.zeros((t_count, p), np.int32)
    n_slots = 0
    for s in range(p):
        where, free = {}, []
        used = 0
        for t in range(t_count):
            if f_mb[t, s] >= 0:
                slot = min(free) if free else used
                if free:
                    free.remove(slot)
                else:
                    used += 1
                where[f_key[t, s]] = slot
                f_slot[t, s] = slot
            if b_mb[t, s] >= 0:
                b_slot[t, s] = where.pop(b_key[t, s])
            if b_mb[t, s] >= 0:
                free.append(int(b_slot[t, s]))
        n_slots = max(n_slots, used)
    return f_slot, b_slot, n_slots


def _table(name, p, m, v, f_cells, b_cells, ticks, is_pipeline=True) -> Schedule:
    """Build a :class:`Schedule` from ``{(tick, stage): (mb, chunk)}`` dicts for the two lanes."""
    arrays = {
        k: np.full((ticks, p), IDLE, np.int32) for k in ("f_mb", "f_chunk", "b_mb", "b_chunk")
    }
    for lane, cells in (("f", f_cells), ("b", b_cells)):
        for (t, s), (mb, c) in cells.items():
            arrays[f"{lane}_mb"][t, s], arrays[f"{lane}_chunk"][t, s] = mb, c
    key_f = arrays["f_mb"] * v + np.maximum(arrays["f_chunk"], 0)
    key_b = arrays["b_mb"] * v + np.maximum(arrays["b_chunk"], 0)
    f_slot, b_slot, n_slots = _allocate(arrays["f_mb"], arrays["b_mb"], key_f, key_b)
    for lane in ("f", "b"):
        arrays[f"{lane}_chunk"] = np.maximum(arrays[f"{lane}_chunk"], 0)
    return Schedule(
        name, p, m, v, arrays["f_mb"], arrays["f_chunk"], f_slot, arrays["b_mb"], arrays["b_chunk"],
        b_slot, max(n_slots, 1), is_pipeline,
    )  # fmt: skip


def gpipe(n_stages: int, n_micro: int) -> Schedule:
    """GPipe: stage ``s`` runs micro-batch ``i``'s forward at tick ``s + i``; after all ``m + p - 1``
    forward ticks, the backward mirrors them (micro-batch ``i``'s backward on stage ``s`` at tick
    ``2(m+p-1) - 1 - (s+i)``). Bubble ``(p-1)/(m+p-1)``; stage ``s`` holds all ``m`` inputs at once.

    Raises:
      ValueError: a size that is not a positive integer.
    """
    _check_sizes(n_stages, n_micro)
    p, m = n_stages, n_micro
    tf = m + p - 1
    f = {(s + i, s): (i, 0) for s in range(p) for i in range(m)}
    b = {(2 * tf - 1 - (s + i), s): (i, 0) for s in range(p) for i in range(m)}
    return _table("gpipe", p, m, 1, f, b, 2 * tf)


def one_f_one_b(n_stages: int, n_micro: int) -> Schedule:
    """Lockstep 1F1B, ``"1f1b_lockstep"`` (PipeDream-Flush's 1F1B is
    :func:`course_lib.op_schedules.pipedream_flush`): forwards as GPipe (tick ``s + i``); the last stage
    runs a micro-batch's backward in the tick of its forward, and the backward goes back one stage per
    tick (stage ``s`` at tick ``2p - 2 - s + i``).
    In the middle ticks each stage runs one F and one B. ``m + 2p - 2`` ticks; the lanes cost as much as
    GPipe's (bubble ``(p-1)/(m+p-1)``), and stage ``s`` holds at most ``min(m, 2(p-1-s)+1)`` inputs.

    Raises:
      ValueError: a size that is not a positive integer.
    """
    _check_sizes(n_stages, n_micro)
    p, m = n_stages, n_micro
    f = {(s + i, s): (i, 0) for s in range(p) for i in range(m)}
    b = {(2 * p - 2 - s + i, s): (i, 0) for s in range(p) for i in range(m)}
    return _table("1f1b_lockstep", p, m, 1, f, b, m + 2 * p - 2)


def circular(n_stages: int, n_micro: int, n_chunks: int = 2) -> Schedule:
    """Interleaved (circular) GPipe — virtual stages, all forwards then all backwards (not Megatron-LM's
    interleaved 1F1B: :func:`course_lib.op_schedules.interleaved`): device ``s`` holds chunks
    ``c = 0 … v-1`` (layers of virtual stage ``c·p + s``); micro-batches go round the ring of stages ``v``
    times, ``p`` at a time: stage ``s`` at tick ``s + k`` runs the ``k``-th item of the order (group of
    ``p`` micro-batches, chunk, micro-batch). ``v·m + p - 1`` forward ticks of one chunk each (bubble
    ``(p-1)/(v·m+p-1)``), then their mirror; a stage
    holds ``v·m`` chunk inputs at once.

    Raises:
      ValueError: a size that is not a positive integer, or ``n_micro`` not a multiple of ``n_stages`` (a
        micro-batch must come back to stage 0 exactly when stage 0 is free for it).
    """
    _check_sizes(n_stages, n_micro, n_chunks)
    p, m, v = n_stages, n_micro, n_chunks
    if m % p:
        raise ValueError(
            f"circular schedule: n_micro={m} is not a multiple of n_stages={p}; use m = {p * max(1, m // p)}"
        )
    tf = v * m + p - 1
    f, b = {}, {}
    for s in range(p):
        for k in range(v * m):
            g, r = divmod(k, v * p)
            c, j = divmod(r, p)
            f[(s + k, s)] = (g * p + j, c)
            b[(2 * tf - 1 - (s + k), s)] = (g * p + j, c)
    return _table("circular", p, m, v, f, b, 2 * tf)


def busy(n_stages: int, n_micro: int, n_chunks: int = 1) -> Schedule:
    """Not a pipeline: every stage runs the F of micro-batch (and chunk) ``t`` at tick ``t``, then every B,
    without waiting for its input. Its time is the useful work of any schedule of the same ``(p, m, v)``
    with no bubble: the baseline that times a bubble. Its outputs are not a model's.

    Raises:
      ValueError: a size that is not a positive integer.
    """
    _check_sizes(n_stages, n_micro, n_chunks)
    p, m, v = n_stages, n_micro, n_chunks
    n = v * m
    f = {(t, s): (t % m, t // m) for s in range(p) for t in range(n)}
    b = {(n + t, s): (t % m, t // m) for s in range(p) for t in range(n)}
    return _table("busy", p, m, v, f, b, 2 * n, is_pipeline=False)


SCHEDULES = {"gpipe": gpipe, "1f1b_lockstep": one_f_one_b, "circular": circular}
"""The pipeline schedules by name (``make(name, p, m, v)``)."""


def make(name: str, n_stages: int, n_micro: int, n_chunks: int = 1) -> Schedule:
    """The schedule ``name`` (a key of :data:`SCHEDULES`); ``n_chunks`` only for ``"circular"``.

    Raises:
      ValueError: an unknown name (the message lists the names), or ``n_chunks > 1`` for a schedule without chunks.
    """
    if name not in SCHEDULES:
        flush = (
            " (PipeDream-Flush's 1F1B is course_lib.op_schedules' '1f1b')" if name == "1f1b" else ""
        )
        raise ValueError(f"schedule {name!r} is not one of {sorted(SCHEDULES)}{flush}")
    if name == "circular":
        return circular(n_stages, n_micro, n_chunks)
    if n_chunks != 1:
        raise ValueError(
            f"schedule {name!r} has one chunk per stage; n_chunks={n_chunks} needs 'circular'"
        )
    return SCHEDULES[name](n_stages, n_micro)


def _cells(sched: Schedule, lane: str) -> dict:
    mb, ch = getattr(sched, f"{lane}_mb"), getattr(sched, f"{lane}_chunk")
    out = {}
    for t, s in zip(*np.nonzero(mb >= 0), strict=True):
        key = (int(mb[t, s]), int(ch[t, s]), int(s))
        if key in out:
            raise ValueError(f"{sched.name}: {lane.upper()} of micro-batch {key[0]}, chunk {key[1]} runs "
                             f"twice on stage {s} (ticks {out[key]} and {t})")  # fmt: skip
        out[key] = int(t)
    return out


def validate(sched: Schedule) -> None:
    """Check that the executor can run the table: every (micro-batch, chunk) passes every stage once in
    each lane, each F gets its input from the previous stage (or virtual stage) exactly one tick earlier,
    each B its cotangent from the next one exactly one tick earlier, and no B comes before its F.

    Raises:
      ValueError: the first broken rule, naming the cell.
    """
    p, m, v = sched.n_stages, sched.n_micro, sched.n_chunks
    f, b = _cells(sched, "f"), _cells(sched, "b")
    want = {(i, c, s) for i in range(m) for c in range(v) for s in range(p)}
    for lane, cells in (("F", f), ("B", b)):
        if set(cells) != want:
            missing = sorted(want - set(cells))[:3]
            raise ValueError(
                f"{sched.name}: {lane} cells missing for (micro-batch, chunk, stage) {missing}"
            )
    for (i, c, s), t in sorted(f.items(), key=lambda kv: kv[1]):
        prev = (i, c, s - 1) if s > 0 else (i, c - 1, p - 1)
        if (s > 0 or c > 0) and f[prev] != t - 1:
            raise ValueError(
                f"{sched.name}: F of micro-batch {i}, chunk {c} on stage {s} at tick {t} needs its input "
                f"from tick {t - 1}, but it was made at tick {f[prev]}"
            )
    for (i, c, s), t in sorted(b.items(), key=lambda kv: kv[1]):
        if t < f[(i, c, s)]:
            raise ValueError(
                f"{sched.name}: B of micro-batch {i}, chunk {c} on stage {s} comes before its F"
            )
        nxt = (i, c, s + 1) if s < p - 1 else (i, c + 1, 0)
        if (s < p - 1 or c < v - 1) and b[nxt] != t - 1:
            raise ValueError(
                f"{sched.name}: B of micro-batch {i}, chunk {c} on stage {s} at tick {t} needs its "
                f"cotangent from tick {t - 1}, but it was made at tick {b[nxt]}"
            )


def lockstep_cost(sched: Schedule, f_cost: float = 1.0, b_cost: float = 2.0) -> float:
    """Cost of the table per stage when every stage computes every lane that any stage uses at a tick:
    ``Σ_t has_F(t)·f_cost + has_B(t)·b_cost`` (in units of one chunk's forward)."""
    lanes = sched.lanes()
    return float(lanes[:, 0].sum() * f_cost + lanes[:, 1].sum() * b_cost)


def bubble_fraction(sched: Schedule, f_cost: float = 1.0, b_cost: float = 2.0) -> float:
    """Fraction of the computed work that is wasted: ``1 - useful / (p · lockstep_cost)``, useful being
    one F and one B of every (micro-batch, chunk) on every stage. GPipe: ``(p-1)/(m+p-1)`` whatever the
    costs; the lockstep 1F1B the same; circular ``(p-1)/(v·m+p-1)``."""
    useful = sched.n_micro * sched.n_chunks * (f_cost + b_cost)
    return 1.0 - useful / lockstep_cost(sched, f_cost, b_cost)


def gpipe_bubble(n_stages: int, n_micro: int, n_chunks: int = 1) -> float:
    """The closed form ``(p-1)/(v·m+p-1)`` (GPipe with ``v = 1``, circular with ``v`` chunks)."""
    _check_sizes(n_stages, n_micro, n_chunks)
    return (n_stages - 1) / (n_chunks * n_micro + n_stages - 1)


def micro_batches(n_micro: object, n_stages: int) -> int:
    """``n_micro`` as the count of micro-batches of a pipeline of ``n_stages`` stages: a positive whole
    multiple of ``n_stages`` (an int, or its text: papermill's ``-r`` passes ``"8"``).

    Raises:
      ValueError: anything else, naming the value and the nearest count to use.
    """
    m = int(n_micro) if str(n_micro).strip().isdigit() else n_micro
    if isinstance(m, bool) or not isinstance(m, int) or m < 1 or m % n_stages:
        near = n_stages * max(1, m // n_stages) if isinstance(m, int) else 2 * n_stages
        raise ValueError(
            f"n_micro={n_micro!r}: the pipeline needs a positive whole multiple of its {n_stages} stages; "
            f"use n_micro={near}"
        )
    return m

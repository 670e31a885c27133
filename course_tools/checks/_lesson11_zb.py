"""Lesson 11's exercise 3: ZB-H1 built from its orders, judged by the table they make.

The answer ``zb_h1_orders(p, m)`` returns each stage's operations in the order it runs them. The checker
builds the table with :func:`course_lib.op_schedules.from_orders` (the library's rule: each operation at the
first tick when what it needs has arrived) and judges it on ``(p, m)`` drawn afresh at every call, all
with ``m >= p``: ``p = 1``, ``p = 2`` and ``p = 4`` with ``m = p`` and ``m >= p + 2``, and one ``p`` of 3
to 6. It asks for what ZB-H1 promises, not for its table:

- every micro-batch's F, B and W once on every stage, each after what it needs
  (:func:`op_schedules.validate`);
- the bubble of ZB-H1's closed form ``(p-1)/(3m+p-1)``: ``3m + p - 1`` ticks, ``p - 1`` idle on each stage,
  the fewest any order can have (the last stage waits ``p - 1`` ticks for its first input);
- at most ``p`` micro-batches in flight on each stage (F run, W not yet:
  :func:`op_schedules.measured_in_flight`), 1F1B's peak: an order that runs each W one F later than it may
  keeps ZB-H1's bubble but holds ``p + 1``; one that keeps every W for the end holds all ``m``.

Any order meeting the three passes (several do). A wrong one is told which rule broke, on which stage, and
for which micro-batches. The answer runs with :func:`course_lib.op_schedules.zb_h1` replaced by a stub that
raises (:mod:`._unaided`): an answer that calls it, or ``make("zb_h1", …)``, is refused.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from course_lib import op_schedules as ops

from ._common import checker, fail, passed, registers
from ._unaided import call_unaided

__all__ = ["check_zb_h1_orders"]

_HINT = (
    "the exercise is to write ZB-H1's orders: build each stage's list of (op, micro_batch) yourself "
    "instead of reading them from op_schedules.zb_h1's table"
)

_FORM_HINT = (
    "return one list per stage, each holding (op, micro_batch) pairs with op one of op_schedules.F, B, W: "
    "every micro-batch 0 … m-1 once with each op, and on each stage a micro-batch's F before its B, its B "
    "before its W"
)

_DEADLOCK_HINT = (
    "the stages' orders must fit together: stage s's F of micro-batch i waits for stage s-1's F of i, its "
    "B for stage s+1's B of i, so an order that first asks for what another stage runs later waits forever "
    "(1F1B's order of F's and B's never does: p-1-s forwards, then one F and one B in turn)"
)

_BUBBLE_HINT = (
    "keep 1F1B's order of F's and B's (stage s: p-1-s forwards, then one F and one B in turn, then the last "
    "B's), so that every B is passed back as early as it can be; a W delays what comes after it on its "
    "stage, so run the W's where 1F1B's stages wait for a B"
)

_MEMORY_HINT = (
    "a stage holds a micro-batch from its F to its W (its input until B, then what B saved for W): before "
    "it takes a (p+1)-th micro-batch, run the W of one it holds — with the F's in order, the W of "
    "micro-batch i before the F of micro-batch i + p"
)


def _cases(rng: np.random.Generator) -> list[tuple[int, int]]:
    """``(p, m)`` with ``m >= p``, drawn anew: one stage (several micro-batches), 2 and 4 stages with
    ``m = p`` and ``m >= p + 2`` (a W one F later than it may be holds ``p + 1`` only there), and 3 to 6
    stages."""
    more = lambda p: int(rng.integers(p + 2, 3 * p + 4))  # noqa: E731
    p = int(rng.integers(3, 7))
    return [
        (1, more(1)),
        (2, 2),
        (2, more(2)),
        (4, 4),
        (4, more(4)),
        (p, int(rng.integers(p, 3 * p + 1))),
    ]


def _ops_of(orders) -> set:
    """The op codes the answer's entries start with (empty where it is not a list of lists of pairs)."""
    try:
        return {int(e[0]) for order in orders for e in order}
    except (TypeError, ValueError, IndexError):
        return set()


def _table(orders, what: str, p: int, m: int) -> ops.OpSchedule:
    if ops.B in _ops_of(orders) and ops.W not in _ops_of(orders):
        fail(
            f"{what} has no W: its orders run F's and B's only, as 1F1B's fused backward",
            "here the backward is split: B computes only the input's gradient (what the previous stage "
            "waits for), and every stage also runs each micro-batch's W (the weights' gradient) once, "
            "after its B",
        )
    try:
        table = ops.from_orders(what, p, m, orders, split=True)
    except ValueError as e:
        fail(str(e), _FORM_HINT)
    except RuntimeError as e:
        fail(str(e), _DEADLOCK_HINT)
    try:
        ops.validate(table)
    except ValueError as e:
        fail(str(e), _FORM_HINT)
    return table


def _bubble_problem(table: ops.OpSchedule, p: int, m: int) -> tuple[str, str] | None:
    got, want = ops.measured_bubble(table), ops.predicted_bubble("zb_h1", p, m)
    if got <= want + 1e-12:
        return None
    idle = (table.op == ops.IDLE).sum(0)
    s = int(np.argmax(idle))
    ticks = np.nonzero(table.op[:, s] == ops.IDLE)[0].tolist()
    return (
        f"the table takes {table.ticks} ticks with {idle.tolist()} idle on the stages (stage {s} at ticks "
        f"{ticks[:12]}{' …' if len(ticks) > 12 else ''}): a bubble of {got:.3f} of the step, where ZB-H1's "
        f"(p-1)/(3m+p-1) = {want:.3f} is {3 * m + p - 1} ticks, p - 1 = {p - 1} idle on each stage",
        _BUBBLE_HINT,
    )


def _memory_problem(table: ops.OpSchedule, p: int, m: int) -> tuple[str, str] | None:
    flight = ops.measured_in_flight(table)
    if flight.max() <= p:
        return None
    s = int(np.argmax(flight))
    col_op, col_mb = table.op[:, s], table.mb[:, s]
    f = {int(i): t for t, (o, i) in enumerate(zip(col_op, col_mb, strict=True)) if o == ops.F}
    w = {int(i): t for t, (o, i) in enumerate(zip(col_op, col_mb, strict=True)) if o == ops.W}
    held = [[i for i in range(m) if f[i] <= t <= w[i]] for t in range(table.ticks)]
    t = max(range(table.ticks), key=lambda k: len(held[k]))
    late = " (every W after the last F)" if min(w.values()) > max(f.values()) else ""
    return (
        f"stage {s} holds {len(held[t])} micro-batches at tick {t}, {held[t]} (F run, W not yet){late}: "
        f"more than p = {p}; ZB-H1 holds at most p on every stage, 1F1B's peak",
        _MEMORY_HINT,
    )


@registers("op_schedules.zb_h1")
@checker
def check_zb_h1_orders(zb_h1_orders: Callable, *, seed: int | None = None) -> bool:
    """``zb_h1_orders(p, m)`` → ``p`` lists, stage ``s``'s operations ``(op, micro_batch)`` in the order it
    runs them (``op`` one of ``op_schedules.F``, ``B``, ``W``), judged on ``(p, m)`` drawn afresh at every
    call (``seed``: for tests) by the table :func:`course_lib.op_schedules.from_orders` builds: every F, B
    and W once, ZB-H1's bubble ``(p-1)/(3m+p-1)``, at most ``p`` micro-batches in flight per stage (the
    module docstring). An answer that calls ``op_schedules.zb_h1`` is refused."""
    cases = _cases(np.random.default_rng(seed))
    first: dict[str, tuple[str, str]] = {}  # each rule: the first case that breaks it
    for p, m in cases:
        what = f"zb_h1_orders({p}, {m})"
        orders = call_unaided(what, zb_h1_orders, (ops.zb_h1,), _HINT, p, m)
        table = _table(orders, what, p, m)
        for rule, problem in (("bubble", _bubble_problem), ("memory", _memory_problem)):
            found = None if rule in first else problem(table, p, m)
            if found:
                first[rule] = (f"{what}: {found[0]}", found[1])
    if first:
        fail("; and ".join(w for w, _ in first.values()), "; ".join(h for _, h in first.values()))
    return passed(
        f"every F, B and W once per stage, ZB-H1's bubble (p-1)/(3m+p-1) and at most p micro-batches in "
        f"flight per stage at (p, m) = {', '.join(map(str, cases))} (drawn anew at every check)"
    )

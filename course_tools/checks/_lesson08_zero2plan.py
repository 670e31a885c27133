"""Lesson 08, exercise 3's first half: the learner's plan for ZeRO-2 (``notebooks/08_lab.ipynb``, section 10).

The plan names the collective for the gradients and for the parameters, what each device's optimizer update
covers, and predicts two ratios on 8 devices with every leaf split: the bytes each device sends per step
over B's (one all-reduce of the gradients) and the momentum each device holds over B's. The truths come from
the ring's bytes per collective (:func:`course_lib.comms.ring_bytes`) and the layout, not from a table. The
step itself is judged by ``check_zero2`` on its behaviour.
"""

from __future__ import annotations

import math
import numbers

from course_lib import comms

from . import _attempts
from ._common import checker, fail, passed, plain, require

N = 8
"""The device count the plan's ratios are predicted for."""

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather")
UPDATES = ("all parameters", "its slice")
ZERO2_PLAN = ("gradients", "parameters", "update", "sent / B's, n = 8", "momentum / B's, n = 8")
"""The keys of exercise 3's plan."""

PLAN_HINT = (
    "reconsider each entry from what a device holds: a reduce-scatter leaves each device one slice of the "
    "sum, an all-reduce the whole sum, an all-gather the devices' arrays side by side (no sum); the momentum "
    "a device holds decides what its optimizer.update can update; on a ring a reduce-scatter and an "
    "all-gather each send (n − 1)/n · S per device and an all-reduce 2 (n − 1)/n · S (S the whole array); "
    "the momentum is laid out like the FSDP specs, and B holds all of it on every device"
)
"""The one hint of a wrong plan, whichever entries are wrong: the physics of every entry, never which is off
(a hint naming the wrong entries lets a plan be found by trying values one key at a time)."""


def _truths() -> dict:
    """The plan's right values (ratios at :data:`N` devices from the ring's bytes, S = 1 byte)."""
    sent = comms.ring_bytes("reduce-scatter", 1.0, N) + comms.ring_bytes("all-gather", 1.0, N)
    return {
        "gradients": "reduce-scatter",
        "parameters": "all-gather",
        "update": "its slice",
        "sent / B's, n = 8": sent / comms.ring_bytes("all-reduce", 1.0, N),
        "momentum / B's, n = 8": 1 / N,
    }


@checker
def check_zero2_plan(plan) -> bool:
    """Judge exercise 3's plan: a dict with the keys :data:`ZERO2_PLAN`; the two collectives among
    :data:`COLLECTIVES`, the update among :data:`UPDATES`, the two ratios within 1 %.

    Raises:
      NotWritten: a value left ``...`` or ``None``.
      ExerciseError: missing keys, a value outside the choices, or wrong entries (how many, and the physics
        of every entry: never which entry, nor the right value). Every judged call is counted
        (:mod:`course_tools.checks._attempts`): a verdict after wrong attempts says on which attempt.
    """
    if not isinstance(plan, dict) or set(plan) != set(ZERO2_PLAN):
        got = sorted(plan) if isinstance(plan, dict) else type(plan).__name__
        fail(f"zero2_plan has keys {got}", f"a dict with the keys {list(ZERO2_PLAN)}")
    choices = {"gradients": COLLECTIVES, "parameters": COLLECTIVES, "update": UPDATES}
    for key in ZERO2_PLAN:
        value = require(f"zero2_plan[{key!r}]", plan[key], "write your plan's answer")
        if key in choices and value not in choices[key]:
            fail(f"zero2_plan[{key!r}] is {value!r}", f"one of {list(choices[key])}")
        if key not in choices and (
            isinstance(value, bool) or not isinstance(plain(value), numbers.Real)
        ):
            fail(f"zero2_plan[{key!r}] is {value!r}", "a number: the ratio on 8 devices")
    truths = _truths()
    wrong = sum(
        plan[key] != truths[key]
        if key in choices
        else not math.isclose(float(plan[key]), truths[key], rel_tol=0.01)
        for key in ZERO2_PLAN
    )
    verdict = _attempts.record("lesson08 zero2_plan", right=not wrong)
    if wrong:
        fail(
            f"{wrong} of {len(ZERO2_PLAN)} entries of the plan are off ({verdict}; the verdict of a later "
            "attempt says how many came before it)",
            PLAN_HINT,
        )
    return passed(
        "the plan: gradients and parameters by the right collectives, the update on this device's slice, "
        f"and both ratios on {N} devices, {verdict} — now write the step; its checker measures them"
    )

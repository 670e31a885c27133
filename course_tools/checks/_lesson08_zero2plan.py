"""Lesson 08, exercise 2's first half: the learner's plan for ZeRO-2 (``notebooks/08_lab.ipynb``, section 10).

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

from ._common import checker, fail, passed, plain, require

N = 8
"""The device count the plan's ratios are predicted for."""

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather")
UPDATES = ("all parameters", "its slice")
ZERO2_PLAN = ("gradients", "parameters", "update", "sent / B's, n = 8", "momentum / B's, n = 8")
"""The keys of exercise 2's plan."""

_HINTS = {
    ("gradients", "all-reduce"): (
        "an all-reduce hands every device the WHOLE summed gradient: ZeRO-2 keeps "
        "only 1/n of the reduced gradients, and the update of a slice needs only that slice of the sum"
    ),
    ("gradients", "all-gather"): (
        "an all-gather puts the devices' arrays side by side; it does not add "
        "them: the gradients of the devices' batches must be summed"
    ),
    ("parameters", "all-reduce"): (
        "each device updated a different slice: the replicated parameters are "
        "those slices put side by side; an all-reduce adds arrays, it does not concatenate slices"
    ),
    ("parameters", "reduce-scatter"): (
        "a reduce-scatter leaves each device a slice of a sum: the parameters "
        "must come back whole on every device, from slices, without adding"
    ),
    ("update", "all parameters"): (
        "each device holds the momentum of its slice only: the update it can "
        "compute is its slice's (updating everything would need the whole optimizer state: no saving)"
    ),
}


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


def _ratio_hint(key: str, value: float) -> str:
    if key.startswith("sent"):
        return (
            "per device a reduce-scatter sends (n − 1)/n · S and an all-gather (n − 1)/n · S (S the whole "
            "array); an all-reduce sends 2 (n − 1)/n · S: add the first two, divide by the third"
        )
    return (
        "the momentum is laid out like the FSDP specs: every split leaf leaves each device 1/n of it; B "
        "holds it all on every device"
    )


@checker
def check_zero2_plan(plan) -> bool:
    """Judge exercise 2's plan: a dict with the keys :data:`ZERO2_PLAN`; the two collectives among
    :data:`COLLECTIVES`, the update among :data:`UPDATES`, the two ratios within 1 %.

    Raises:
      NotWritten: a value left ``...`` or ``None``.
      ExerciseError: missing keys, a value outside the choices, or wrong entries (each named with what it
        gets wrong; the right value is not printed).
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
    truths, hints = _truths(), []
    for key in ZERO2_PLAN:
        value = plan[key]
        if key in choices:
            if value != truths[key]:
                hints.append(f"{key}: {_HINTS[(key, value)]}")
        elif not math.isclose(float(value), truths[key], rel_tol=0.01):
            hints.append(f"{key}: {_ratio_hint(key, float(value))}")
    if hints:
        fail(f"{len(hints)} of {len(ZERO2_PLAN)} entries of the plan are off", " | ".join(hints))
    return passed(
        "the plan: gradients and parameters by the right collectives, the update on this device's slice, "
        f"and both ratios on {N} devices — now write the step; its checker measures them"
    )

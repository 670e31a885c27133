"""Lesson 11's exercise 5, its prediction: the bytes one device sends in the expert exchange's dispatch.

The answer ``exchange_bytes(n_tokens, d_model, n_experts, k, capacity_factor, n_devices, itemsize)`` is
called on cases drawn afresh at every check (so a table of answers fitted to earlier verdicts does not pass)
and compared with the bytes that :func:`course_lib.comms.ring_bytes` gives for one ``all_to_all`` of the
``[E, C, D]`` buffer (``C`` from :func:`course_lib.moe.capacity`); section 9.4 of the notebook reads the same
bytes from a compiled program. The cases include capacities that round up, expert axes of one device (which
send nothing) and several dtypes, so each usual slip is wrong somewhere. The verdict says how many cases are
off, never which, and counts the attempts (:mod:`course_tools.checks._attempts`). An answer that calls
:mod:`course_lib.moe`, :mod:`course_lib.moe_layout` or :mod:`course_lib.comms` (their closed forms) is
refused.
"""

from __future__ import annotations

from collections.abc import Callable
from numbers import Number

import numpy as np

from course_lib import comms, moe, moe_layout

from . import _attempts
from ._common import checker, fail, passed
from ._unaided import call_outside

__all__ = ["check_exchange_bytes"]

CASES = 10
"""Cases drawn at each check."""

_LIBRARY = {
    module.__file__: module.__name__.rsplit(".", 1)[-1] for module in (moe, moe_layout, comms)
}
"""The modules whose closed forms give the answer (``moe.capacity``, ``comms.ring_bytes``,
``moe_layout.predict_transfers``): a prediction must not call into them."""

_ATTEMPT_NAME = "lesson11 exchange_bytes"


def cases(rng: np.random.Generator) -> list[tuple[int, int, int, int, float, int, int]]:
    """``(n_tokens, d_model, n_experts, k, capacity_factor, n_devices, itemsize)`` drawn afresh: experts a
    multiple of the devices, one case with an expert axis of one device, and at least one whose
    ``capacity_factor · k · n_tokens / n_experts`` is not a whole number (the capacity rounds up)."""
    out = []
    for i in range(CASES):
        n_dev = 1 if i == 0 else int(rng.choice([2, 4, 8]))
        n_exp = n_dev * int(rng.integers(1, 5))
        k = int(rng.integers(1, min(n_exp, 4) + 1))
        out.append((
            int(rng.integers(3, 200)),
            int(rng.choice([16, 64, 96, 256])),
            n_exp,
            k,
            float(rng.choice([0.5, 0.75, 1.0, 1.25, 1.5, 2.0])),
            n_dev,
            int(rng.choice([2, 4, 8])),
        ))  # fmt: skip
    if all((c[4] * c[3] * c[0] / c[2]).is_integer() for c in out):  # one capacity that rounds up
        n_tok, d, _, _, _, n_dev, item = out[-1]
        out[-1] = (n_tok | 1, d, 2 * n_dev, 1, 0.75, n_dev, item)
    return out


def truth(n_tokens, d_model, n_experts, k, capacity_factor, n_devices, itemsize) -> float:
    """The bytes one device sends in one ``all_to_all`` of its ``[E, C, D]`` buffer over ``n_devices``."""
    cap = moe.capacity(n_tokens, n_experts, k, capacity_factor)
    return comms.ring_bytes("all-to-all", n_experts * cap * d_model * itemsize, n_devices)


def _call_unaided(what: str, predict: Callable, *args):
    """``predict(*args)``, refused if it calls into the modules that hold the closed forms, or if it
    replaces the profile hook that watches those calls (``_unaided.call_outside``)."""
    return call_outside(
        what, predict, _LIBRARY,
        ("calls course_lib", ": the library's closed form is the answer, not a prediction"),
        "work it out from the sizes: the capacity C, the buffer E·C·D, and the share of it that leaves "
        "the device", *args,
    )  # fmt: skip


@checker
def check_exchange_bytes(exchange_bytes: Callable, *, seed: int | None = None) -> bool:
    """``exchange_bytes(n_tokens, d_model, n_experts, k, capacity_factor, n_devices, itemsize) -> bytes``:
    what one device sends in the dispatch ``all_to_all`` of its ``[E, C, D]`` buffer over an expert axis of
    ``n_devices`` (``itemsize`` bytes per element), within 1e-6 relative, on :data:`CASES` cases drawn
    afresh at every call (``seed``: for tests). Says how many cases are off, not which, and on which
    attempt a right answer came. Taught in ``notebooks/11_pipeline_experts.ipynb``, exercise 5.

    Returns:
      True (after printing ✓) when every case is right.

    Raises:
      ExerciseError: a case off, a value that is not a number, or a call into ``course_lib``'s
        ``moe``, ``moe_layout`` or ``comms``.
    """
    drawn = cases(np.random.default_rng(seed))
    wrong = 0
    for case in drawn:
        what = f"exchange_bytes{case}"
        got = _call_unaided(what, exchange_bytes, *case)
        if isinstance(got, bool) or not isinstance(got, Number | np.number):
            fail(f"{what} returned {got!r}, not a number", "return the bytes as a number")
        want = truth(*case)
        wrong += not abs(float(got) - want) <= 1e-6 * max(abs(want), 1.0)
    verdict = _attempts.record(_ATTEMPT_NAME, right=not wrong)
    if wrong:
        fail(
            f"{wrong} of {len(drawn)} cases are off ({verdict}; the cases are drawn anew at every check)",
            "the capacity C is a whole number of places per expert (round up); the buffer holds E·C·D "
            "elements; of its n groups of experts, the one this device holds stays here",
        )
    return passed(f"the dispatch's bytes right in all {len(drawn)} cases drawn, {verdict}")

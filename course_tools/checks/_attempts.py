"""Attempts at a prediction, counted per exercise in the running kernel: the one place every lesson's
prediction checkers count them (lab 12's: :mod:`course_tools.checks._lesson12_predict`).

A prediction is worth something only before the answer is known. A checker that can be called again and
again lets a learner guess until it says yes, so every judged call is counted here, and the verdict says so:
``"accepted on attempt 3, after 2 wrong"``, never a bare ✓ after two misses. Only judged calls count: an
unwritten dict or a misspelt name is not an attempt. The counts live in this module, so they last as long as
the kernel (a restart, or :func:`reset`, starts them again).
"""

from __future__ import annotations

_ATTEMPTS: dict[str, int] = {}
_WRONG: dict[str, int] = {}


def record(exercise: str, right: bool) -> str:
    """Count one judged attempt at ``exercise`` (a name, e.g. ``"crossing_predictions"``), right or not, and
    return the words its verdict carries: ``"on the first attempt"``; ``"on attempt 3, after 2 wrong"``;
    ``"again (attempt 2; none wrong)"`` for a right answer judged a second time; for a wrong one,
    ``"attempt 2 (2 wrong so far)"``."""
    n = _ATTEMPTS[exercise] = _ATTEMPTS.get(exercise, 0) + 1
    before = _WRONG.get(exercise, 0)
    if not right:
        _WRONG[exercise] = before + 1
        return f"attempt {n} ({before + 1} wrong so far)"
    if n == 1:
        return "on the first attempt"
    if before == 0:
        return f"again (attempt {n}; none wrong)"
    return f"on attempt {n}, after {before} wrong"


def attempts(exercise: str) -> tuple[int, int]:
    """``(judged attempts, wrong ones)`` at ``exercise`` in this kernel: ``(0, 0)`` before the first."""
    return _ATTEMPTS.get(exercise, 0), _WRONG.get(exercise, 0)


def reset(exercise: str | None = None) -> None:
    """Forget the attempts at ``exercise``, or at every exercise (``None``): for tests."""
    for counts in (_ATTEMPTS, _WRONG):
        if exercise is None:
            counts.clear()
        else:
            counts.pop(exercise, None)

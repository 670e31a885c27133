"""Exercise checkers, one module per notebook (``lesson01``, ``lesson02``, …).

A checker takes the learner's function or value, runs it against a reference on small inputs and either
prints a one-line confirmation or raises :class:`ExerciseError` (an ``AssertionError``) whose message says
*what* is wrong and gives a hint (wrong shape, wrong value, recompiles every call, not pure, …).
"""

from ._common import ExerciseError, fail, passed, show_error

__all__ = ["ExerciseError", "fail", "passed", "show_error"]

"""Exercise checkers, one module per notebook (``lesson01``, ``lesson02``, …).

A checker takes the learner's function or value, judges its behaviour on small random inputs and either
prints a one-line confirmation (and returns True) or raises :class:`ExerciseError` (an ``AssertionError``)
whose message says *what* is wrong and gives a hint (wrong shape, wrong value, recompiles every call, not
pure, …). An answer not written yet (the student version's stub) only prints its hint and returns False,
so a student notebook runs top to bottom.
"""

from ._common import ExerciseError, NotWritten, checker, fail, passed, show_error

__all__ = ["ExerciseError", "NotWritten", "checker", "fail", "passed", "show_error"]

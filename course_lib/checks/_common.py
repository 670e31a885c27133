"""Shared pieces of the exercise checkers."""

from __future__ import annotations


class ExerciseError(AssertionError):
    """An exercise answer is wrong; the message says what is wrong and how to fix it."""


def fail(what: str, hint: str) -> None:
    """Raise :class:`ExerciseError` with ``"✗ {what}\\n  hint: {hint}"``."""
    raise ExerciseError(f"✗ {what}\n  hint: {hint}")


def passed(message: str) -> bool:
    """Print ``"✓ {message}"`` and return True (so a notebook can ``assert check(...)``)."""
    print(f"✓ {message}")
    return True


def is_stub(fn) -> bool:
    """True when ``fn`` is the student stub (returns None / raises NotImplementedError) rather than an answer."""
    return getattr(fn, "__course_stub__", False)

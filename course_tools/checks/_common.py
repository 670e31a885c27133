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


def as_ints(what: str, value, hint: str) -> tuple[int, ...]:
    """``value`` as a tuple of ints (a shape, a ``(start, stop)`` pair), or an :class:`ExerciseError` that
    says ``what`` returned it and gives ``hint``."""
    try:
        return tuple(int(v) for v in value)
    except TypeError:
        fail(f"{what} returned {value!r}", hint)


def show_error(fn, *args, **kwargs) -> BaseException:
    """Call ``fn(*args, **kwargs)``, print the error it raises (type and first line, at most 400 characters)
    and return it, so a notebook can show a failure and ``assert isinstance(err, SomeError)`` on it.

    Notebooks show errors this way rather than with cells that raise: papermill stops a run at any error
    output, even in a cell tagged ``raises-exception``.

    Raises:
      AssertionError: the call succeeded although an error was expected.
    """
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - whatever JAX raises is what the lesson shows
        lines = str(e).strip().splitlines()
        print(f"{type(e).__name__}: {lines[0][:400] if lines else repr(e)}")
        return e
    raise AssertionError("expected an error, but the call succeeded")


def call_answer(what: str, fn, *args, explain=None, **kwargs):
    """Run the learner's ``fn(*args, **kwargs)``; turn the student stub and any error into a hint.

    Args:
      what: how to name the call in a message, e.g. ``"process_rows(32, 2, 0)"``.
      fn: the learner's function (or a transform of it, e.g. its ``shard_map``).
      explain: optional ``explain(error) -> (what, hint) | None``: a checker's own message for an error it
        recognises (a wrong axis name, a traced static argument, …); None falls back to the generic one.

    Raises:
      ExerciseError: ``fn`` raised (``NotImplementedError``: "not written yet"; an error ``explain``
        recognises: its message; anything else: its type and message, and advice to try it on a small input).
    """
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        fail(
            f"{what} is not written yet",
            "replace the `raise NotImplementedError` line with your answer",
        )
    except Exception as e:  # noqa: BLE001 - the learner's code may raise anything
        specific = explain(e) if explain is not None else None
        if specific:
            fail(*specific)
        fail(
            f"{what} raised {type(e).__name__}: {str(e)[:300]}",
            "run it on a small input in a cell and read the error",
        )

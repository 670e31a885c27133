"""Shared pieces of the exercise checkers.

Every checker is decorated with :func:`checker`. A written answer that is wrong raises
:class:`ExerciseError` (the notebook stops there, with the hint). An answer that is not written yet — the
student version's stub, ``raise NotImplementedError("Exercise: …")`` or a prediction left at ``None`` —
only prints "not written yet" and the hint, and the checker returns False, so the student version of a
lesson runs top to bottom. With ``COURSE_STRICT_CHECKS=1`` in the environment (the test suite sets it for
the solution notebooks) an unwritten answer raises too.
"""

from __future__ import annotations

import functools
import os

STUB_MESSAGE = "Exercise: write this part"
"""The message of the student version's stub (``course_tools.student.DEFAULT_STUB`` raises it)."""


class ExerciseError(AssertionError):
    """An exercise answer is wrong; the message says what is wrong and how to fix it."""


class NotWritten(ExerciseError):
    """The answer is still the student stub; :func:`checker` prints it instead of raising."""


def is_stub_error(e: BaseException) -> bool:
    """True for the student stub's ``NotImplementedError("Exercise: …")`` (not one JAX raises)."""
    return isinstance(e, NotImplementedError) and str(e).startswith("Exercise")


def not_written(what: str, hint: str) -> None:
    """Raise :class:`NotWritten`: ``what`` is not written yet; ``hint`` says what to write."""
    raise NotWritten(f"✗ {what} is not written yet\n  hint: {hint}")


def require(what: str, value, hint: str):
    """``value`` unless it is the stub's ``None`` / ``...`` (then :func:`not_written`)."""
    if value is None or value is Ellipsis:
        not_written(what, hint)
    return value


def checker(fn):
    """Decorate a checker: an unwritten answer prints its hint and returns False instead of raising
    (unless ``COURSE_STRICT_CHECKS=1``); a wrong answer still raises :class:`ExerciseError`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NotWritten as e:
            if os.environ.get("COURSE_STRICT_CHECKS") == "1":
                raise
            print(str(e))
            return False
        except NotImplementedError as e:
            if not is_stub_error(e):
                raise
            if os.environ.get("COURSE_STRICT_CHECKS") == "1":
                raise NotWritten(f"✗ the answer is not written yet ({e})") from None
            print("✗ the answer is not written yet\n  hint: replace the stub with your answer")
            return False

    return wrapper


def fail(what: str, hint: str) -> None:
    """Raise :class:`ExerciseError` with ``"✗ {what}\\n  hint: {hint}"``."""
    raise ExerciseError(f"✗ {what}\n  hint: {hint}")


def passed(message: str) -> bool:
    """Print ``"✓ {message}"`` and return True (so a notebook can ``assert check(...)``)."""
    print(f"✓ {message}")
    return True


def plain(value):
    """``value`` with NumPy scalars made Python numbers (``np.int64(8)`` → ``8``), inside tuples, lists and
    dicts too: what a message shows of an answer's return value (NumPy 2 writes ``np.float64(1.5)``)."""
    if (
        hasattr(value, "item") and getattr(value, "shape", None) == ()
    ):  # a NumPy scalar or 0-d array
        try:
            return value.item()
        except (TypeError, ValueError):
            return value
    if isinstance(value, tuple | list):
        return type(value)(plain(v) for v in value)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    return value


def as_ints(what: str, value, hint: str) -> tuple[int, ...]:
    """``value`` as a tuple of ints (a shape, a ``(start, stop)`` pair), or an :class:`ExerciseError` that
    says ``what`` returned it and gives ``hint``."""
    try:
        return tuple(int(v) for v in value)
    except TypeError:
        fail(f"{what} returned {plain(value)!r}", hint)


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
      NotWritten: ``fn`` is the student stub (:func:`checker` prints it).
      ExerciseError: ``fn`` raised (an error ``explain``
        recognises: its message; anything else: its type and message, and advice to try it on a small input).
    """
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as e:
        if not is_stub_error(e):
            raise ExerciseError(
                f"✗ {what} raised NotImplementedError: {str(e)[:300]}\n"
                "  hint: run it on a small input in a cell and read the error"
            ) from None
        not_written(what, "replace the `raise NotImplementedError` line with your answer")
    except Exception as e:  # noqa: BLE001 - the learner's code may raise anything
        specific = explain(e) if explain is not None else None
        if specific:
            fail(*specific)
        fail(
            f"{what} raised {type(e).__name__}: {str(e)[:300]}",
            "run it on a small input in a cell and read the error",
        )


def matmul_rtol(floor: float = 0.0) -> float:
    """The relative tolerance of a float32 comparison whose two sides compute matmuls or convolutions in
    different orders (a learner's answer against a checker's reference): ``course_lib.precision.float32_rtol()``
    on the platform and matmul precision in force — 1e-5 on XLA:CPU, 8 × 2^-9 ≈ 1.6e-2 on a TPU at JAX's
    default precision (its float32 matmuls multiply bfloat16 inputs) — or ``floor`` where that is larger (a
    checker's own tolerance for what else differs, e.g. a loop of steps against a scan). Read at every call,
    so that a test can force the loosest value and check that the wrong answers are still refused."""
    from course_lib import precision

    return max(floor, precision.float32_rtol())


def close(got, want, rtol: float | None = None) -> bool:
    """``np.allclose(got, want)`` at relative tolerance ``rtol`` (None: :func:`matmul_rtol`), with an absolute
    tolerance of ``rtol`` times the largest ``|want|``: a matmul's rounding scales with the sizes of what it
    adds, so entries near 0 of a result get the same absolute slack as its largest ones. Shapes that do not
    broadcast are not close."""
    import numpy as np

    rtol = matmul_rtol() if rtol is None else rtol
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    try:
        scale = float(np.max(np.abs(want))) if want.size else 0.0
        return bool(np.allclose(got, want, rtol=rtol, atol=rtol * scale))
    except ValueError:
        return False

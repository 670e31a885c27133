"""Shared pieces of the exercise checkers.

Every checker is decorated with :func:`checker`. A written answer that is wrong raises
:class:`ExerciseError` (the notebook stops there, showing its message and hint, not a traceback). An
answer that is not written yet — the student version's stub, ``raise NotImplementedError("Exercise: …")``
or a prediction left at ``None`` — only prints "not written yet" and the hint, and the checker returns
False, so the student version of a lesson runs top to bottom. With ``COURSE_STRICT_CHECKS=1`` in the
environment (the test suite sets it for the solution notebooks) an unwritten answer raises too.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
import types

STUB_MESSAGE = "Exercise: write this part"
"""The message of the student version's stub (``course_tools.student.DEFAULT_STUB`` raises it)."""


class ExerciseError(AssertionError):
    """An exercise answer is wrong; the message says what is wrong and how to fix it.

    In a notebook (IPython) it shows as its message alone, ``ExerciseError: ✗ … hint: …``: the checker's
    own frames and a learner's error it wraps would bury the hint under their source lines (the hint of
    such an error says to run the answer in a cell, where its traceback is the learner's). The cell still
    fails, so a run (papermill) stops there as before; outside IPython the traceback is Python's.
    """

    def _render_traceback_(self) -> list[str]:
        """What IPython shows for this error instead of its traceback: the message, hint last."""
        return f"{type(self).__name__}: {self}".splitlines()


class NotWritten(ExerciseError):
    """The answer is still the student stub; :func:`checker` prints it instead of raising."""


class NotJudged(NotWritten):
    """The devices present cannot tell this answer right from wrong, and it cannot be judged elsewhere:
    :func:`checker` prints why and how to have it judged, and returns False (raises under
    ``COURSE_STRICT_CHECKS=1``)."""


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


def registers(name: str):
    """Decorate a checker whose exercise writes a function the student package holds out (``name`` in
    :data:`course_lib.held.EXERCISES`): an answer it accepts (its first argument, when it returns True) is
    registered with :func:`course_lib.held.register`, so the later cells that call the library function
    run the learner's answer there. Outermost, above :func:`checker`."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(answer, *args, **kwargs):
            ok = fn(answer, *args, **kwargs)
            if ok is True:
                from course_lib import held

                held.register(name, answer)
            return ok

        wrapper.registers = name  # the held function its accepted answer stands in for
        return wrapper

    return decorate


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


JUDGE_DEVICES = 8
"""How many simulated CPU devices the fresh process of :func:`judge_on` has."""


def judge_on(check, answer, devices, *, need: int, why: str, **kwargs) -> bool | None:
    """Where fewer than ``need`` devices are present, the checker's verdict on ``answer`` from a fresh
    Python with :data:`JUDGE_DEVICES` simulated CPU devices; None where enough are present (the checker
    then judges here, on ``devices``).

    A checker ``check(answer, devices, **kwargs)`` (decorated with :func:`checker`) calls it first. The
    answer travels as source text (:func:`course_tools.checks._ship.ship`: a plain top-level ``def`` of
    the notebook and what it reads, or a function of an importable module, by name); ``kwargs`` must be
    plain Python values. The fresh process runs ``check(answer, jax.devices(), **kwargs)``; what it
    prints is printed here under a line that says where it was judged, and its wrong answer raises here.

    Args:
      need: the fewest devices on which the checker tells every wrong answer it knows from a right one.
      why: what goes unseen on fewer, e.g. ``"on one device a bias summed n times equals the bias"``.

    Raises:
      ExerciseError: the answer is wrong (the fresh process's message).
      NotWritten: the answer is the student stub (read from its code, no process started).
      NotJudged: the answer cannot be sent (the message names what blocks it and how to have it judged).
      RuntimeError: the fresh process failed (its standard error).
    """
    n = len(devices)
    if n >= need:
        return None
    if isinstance(answer, types.FunctionType) and _holds_stub(answer.__code__):
        not_written(getattr(answer, "__name__", "the answer"), "replace the stub with your answer")
    from ._ship import CannotShip, ship
    from ._simulated import run_json

    here = f"{n} device{'s' if n != 1 else ''}"
    try:
        source = ship(answer)
        if any(not _plain_kwarg(v) for v in kwargs.values()):
            raise CannotShip(f"the checker's arguments {sorted(kwargs)} are not plain values")
    except CannotShip as e:
        raise NotJudged(
            f"✗ not judged: this run has {here}, too few ({why}); the answer cannot be sent to a "
            f"process with {JUDGE_DEVICES} simulated CPU devices either: {e}\n"
            f"  hint: to have it judged, re-run this notebook with n_devices={JUDGE_DEVICES}, "
            "platform='cpu' (simulated devices), or on a machine with that many devices"
        ) from None
    folder = tempfile.mkdtemp(prefix="course_answer_")
    try:
        with open(os.path.join(folder, "notebook_answer.py"), "w") as f:
            f.write(source)
        held = _ship_held(folder)
        got = run_json(
            _JUDGE.format(
                folder=folder,
                module=check.__module__,
                name=check.__name__,
                kwargs=repr(kwargs),
                held=repr(held),
            ),
            JUDGE_DEVICES,
            timeout_s=900,
            path=[p for p in sys.path if p and os.path.isdir(p)],
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    where = (
        f"judged in a fresh process on {JUDGE_DEVICES} simulated CPU devices, since this run has "
        f"{here}: {why}"
    )
    error = got.get("error")
    if error:
        print(got["out"], end="")  # what the checker printed before it refused
    if error and error[0] == "not_written":
        raise NotWritten(error[1])
    if error:
        raise ExerciseError(f"{error[1]}\n  ({where})")
    print(f"({where})")
    print(got["out"], end="")
    return got["ok"]


def judged_on(need: int, why: str):
    """Decorate a checker ``check(answer, devices, *args, **kwargs)`` (under :func:`checker`) so that on
    fewer than ``need`` devices it returns :func:`judge_on`'s verdict instead of judging on ``devices``."""

    def wrap(check):
        @functools.wraps(check)
        def judged(answer, devices, *args, **kwargs):
            if len(devices) < need and args:
                raise TypeError(f"{check.__name__}: pass its options by name: {args!r}")
            verdict = judge_on(check, answer, devices, need=need, why=why, **kwargs)
            return check(answer, devices, *args, **kwargs) if verdict is None else verdict

        return judged

    return wrap


def _holds_stub(code) -> bool:
    return any(
        c == STUB_MESSAGE or (isinstance(c, types.CodeType) and _holds_stub(c))
        for c in code.co_consts
    )


def _plain_kwarg(v) -> bool:
    if v is None or isinstance(v, bool | int | float | str):
        return True
    return type(v) in (tuple, list) and all(map(_plain_kwarg, v))


def _ship_held(folder: str) -> list[tuple[str, str]]:
    """The answers registered for held library functions (:mod:`course_lib.held`), written into ``folder``
    as modules for :func:`judge_on`'s fresh process to register again (a checker there may call a held
    function: lesson 10's ``check_ring_vjp`` measures ``splits.ring_attention``); ``(name, module)`` each.
    An answer that cannot be sent is left out (the held function then raises there, naming its exercise).
    """
    from course_lib import held

    from ._ship import CannotShip, ship

    shipped = []
    for i, name in enumerate(sorted(held.EXERCISES)):
        fn = held.registered(name)
        try:
            source = ship(fn) if fn is not None else None
        except CannotShip:
            source = None
        if source is not None:
            with open(os.path.join(folder, f"held_answer_{i}.py"), "w") as f:
                f.write(source)
            shipped.append((name, f"held_answer_{i}"))
    return shipped


_JUDGE = """
import contextlib, importlib, io, json, sys
sys.path.insert(0, {folder!r})
import notebook_answer
import jax
from course_lib import held
from course_tools.checks import _common
for held_name, held_module in {held}:
    held.register(held_name, importlib.import_module(held_module).answer)
check = getattr(importlib.import_module({module!r}), {name!r})
out, got = io.StringIO(), {{}}
try:
    with contextlib.redirect_stdout(out):
        ok = check(notebook_answer.answer, jax.devices(), **{kwargs})
    got["ok"] = ok if ok is None or isinstance(ok, bool) else bool(ok)
except _common.NotWritten as e:
    got["error"] = ["not_written", str(e)]
except _common.ExerciseError as e:
    got["error"] = ["wrong", str(e)]
got["out"] = out.getvalue()
print(json.dumps(got))
"""

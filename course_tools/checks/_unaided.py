"""Run a learner's answer with the functions its checker compares with out of reach.

An exercise that asks for a model built from its pieces compares the answer with the course's own function;
an answer that just calls that function would pass without doing the exercise. :func:`call_unaided` refuses
it three ways:

- while the answer runs, each forbidden function's ``__code__`` is a stub that raises: a call from any
  thread (a thread pool), under any alias, reaches the stub, and the call is refused even if the answer
  catches the error; the real code is put back in ``finally``;
- a profile hook on the calling thread refuses a call to a *copy* of the code
  (``types.FunctionType`` over ``f.__code__.replace(...)``, or the source compiled again unchanged
  beside its module's imports): the same bytecode and constants (source pasted into a cell without
  those imports compiles to other bytecode on CPython 3.12, and is judged as any other answer);
- the hook must still be in place when the answer returns: an answer that switches it off
  (``sys.setprofile(None)``) or replaces it is refused;
- a ``private`` function (a piece of the compared function that an allowed one calls too, such as
  ``lm_costs._param_bytes`` or ``lm_layouts.local_bytes`` under ``activation_bytes``) keeps its code: the
  hook refuses a call to it (or to a copy of its code) made from outside its library (the top-level package
  of its module, ``course_lib``), and lets the library's own calls through.

What it cannot catch: a copy of the source that is edited (or one run in another thread), or a result
computed beforehand and kept. The checkers are a self-test for the learner, not an exam.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager

from ._common import ExerciseError, call_answer, fail

__all__ = ["call_unaided", "unaided"]

_HOOK = "_course_refused_call_"
"""The name the stubs call, set in each forbidden function's module while an answer runs."""

_LOCK = threading.Lock()


def _stub_code(name: str):
    """A code object with no free variables (so it can replace a module function's) that hands the call to
    the module global :data:`_HOOK`."""
    namespace: dict = {}
    exec(f"def {name}(*args, **kwargs):\n    return {_HOOK}({name!r})\n", namespace)  # noqa: S102
    return namespace[name].__code__


_REFUSED = "a library function this checker refuses (its model, or a piece of it, is the exercise)"
"""Why a forbidden call is refused: true of each forbidden function, not only the one compared with."""


def _qualified(f: Callable) -> str:
    """``module.name`` of ``f`` by the module that defines it (``costs.collective_time``, not the module of
    another forbidden function)."""
    return f"{f.__module__.rsplit('.', 1)[-1]}.{f.__name__}"


def _library(module: str | None) -> str | None:
    """The top-level package of ``module`` (``course_lib`` of ``course_lib.lm_costs``), or None."""
    return module.split(".", 1)[0] if module else None


def _signature(code) -> tuple:
    return code.co_code, code.co_consts, code.co_names


@contextmanager
def unaided(what: str, forbidden: tuple, hint: str, private: tuple = ()):
    """While the ``with`` block runs, each of ``forbidden`` (module-level functions) raises when called, and a
    call to a copy of their code is seen (see the module docstring); so is a call to one of ``private``
    from outside the library (top-level package) that defines it. An :class:`ExerciseError` raised in the
    block after a forbidden call (the answer's error, wrapped by the checker) is replaced by the refusal.
    Used where a checker calls the answer through its own machinery (tracing under ``shard_map``).

    Raises:
      ExerciseError: on leaving the block, if a forbidden function (or a copy of its code) was called or the
        profile hook was switched off; an ``ExerciseError`` from the block when nothing forbidden was called.
    """
    signatures = {_signature(f.__code__): _qualified(f) for f in forbidden}
    by_name = {f.__name__: _qualified(f) for f in forbidden}
    inner = {_signature(f.__code__): (_library(f.__module__), _qualified(f)) for f in private}
    seen: list[str] = []

    def refuse(name):
        seen.append(by_name.get(name, name))
        raise RuntimeError(f"ExerciseError: {what} calls {seen[-1]}, {_REFUSED}: {hint}")

    def watch(frame, event, arg):
        if event == "call" and _signature(frame.f_code) in signatures:
            seen.append(signatures[_signature(frame.f_code)])
        elif event == "call" and _signature(frame.f_code) in inner:
            home, name = inner[_signature(frame.f_code)]
            caller = frame.f_back.f_globals.get("__name__") if frame.f_back else None
            if _library(caller) != home:  # the answer's call, not the library's own
                seen.append(name)

    with _LOCK:
        saved = [(f, f.__code__, f.__globals__.get(_HOOK)) for f in forbidden]
        old = sys.getprofile()
        intact = True
        try:
            for f, _, _ in saved:
                f.__globals__[_HOOK] = refuse
                f.__code__ = _stub_code(f.__name__)
            sys.setprofile(watch)
            try:
                yield seen
            except ExerciseError:
                if not seen:
                    raise
            intact = sys.getprofile() is watch
        finally:
            sys.setprofile(old)
            for f, code, hook in saved:
                f.__code__ = code
                if hook is None:
                    f.__globals__.pop(_HOOK, None)
    if seen:
        fail(f"{what} calls {seen[0]}: {_REFUSED}", hint)
    if not intact:
        fail(
            f"{what} switched off or replaced the checker's profile hook (sys.setprofile)",
            f"leave sys.setprofile alone; {hint}",
        )


def call_unaided(what: str, fn: Callable, forbidden: tuple, hint: str, *args, explain=None,
                 private: tuple = ()):  # fmt: skip
    """``fn(*args)`` (through :func:`course_tools.checks._common.call_answer`, ``explain`` passed on),
    refused with ``hint`` if it calls one of ``forbidden`` (module-level functions: the ones the checker
    compares with), a copy of their code, one of ``private`` from outside its library, or switches off the
    profile hook; see the module docstring for what cannot be caught.

    Raises:
      ExerciseError: the answer called a forbidden function, ran a copy of one, or removed the hook; or (as
        :func:`call_answer`) it raised.
    """
    with unaided(what, forbidden, hint, private):
        return call_answer(what, fn, *args, explain=explain)


def call_outside(
    what: str, fn: Callable, library: dict, refused: tuple[str, str], hint: str, *args
):
    """``fn(*args)`` (through :func:`course_tools.checks._common.call_answer`), refused if it calls any
    function of the modules in ``library`` (``{file name: module label}``) or switches off or replaces the
    profile hook that watches those calls (``sys.setprofile``). ``refused`` is the message's two parts
    around the first call seen (``f"{what} {refused[0]} ({call}){refused[1]}"``), ``hint`` the fix for both.

    Raises:
      ExerciseError: the answer called into ``library`` or removed the hook; or (as :func:`call_answer`)
        it raised.
    """
    seen: list[str] = []

    def watch(frame, event, arg):
        if event == "call" and frame.f_code.co_filename in library:
            seen.append(f"{library[frame.f_code.co_filename]}.{frame.f_code.co_name}")

    old = sys.getprofile()
    sys.setprofile(watch)
    try:
        got = call_answer(what, fn, *args)
        intact = sys.getprofile() is watch
    finally:
        sys.setprofile(old)
    if not intact:
        fail(
            f"{what} switched off or replaced the checker's profile hook (sys.setprofile)",
            f"leave sys.setprofile alone, and {hint}",
        )
    if seen:
        fail(f"{what} {refused[0]} ({seen[0]}){refused[1]}", hint)
    return got

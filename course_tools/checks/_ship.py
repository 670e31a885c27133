"""An answer written in a notebook, as Python source that defines it again in a fresh process: what
:func:`course_tools.checks._common.judge_on` sends to a process with 8 simulated CPU devices when the
notebook's devices are too few to tell a right answer from a wrong one.

Only what can be sent exactly is sent; anything else raises :class:`CannotShip` with the reason (the
checker then says it cannot judge). An object of an importable module (``jax.numpy``, ``course_lib``, a
test's answers module) is imported by name. A function of the notebook (``__main__``) is sent as its own
source text, and only when all of these hold: it is a plain ``def`` at the top level of a cell (not a
lambda, not nested, no closure; decorators allowed, they are sent with it); the source text compiles to
the same bytecode as the function the notebook holds (the cell was not edited after it ran); and every
global name it reads (its body, its defaults and its decorators) is a module, a constant of the plain
Python types (``None``, bool, int, float, complex, str, bytes, or tuples, lists, dicts and frozensets of
them, whose ``repr`` evaluates to an equal value), another such function of the notebook, or an object
of an importable module.
"""

from __future__ import annotations

import ast
import builtins
import dis
import importlib
import inspect
import sys
import textwrap
import types
from typing import Any

_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_SAME_OP = {"LOAD_METHOD": "LOAD_ATTR"}  # CPython 3.11 (no LOAD_METHOD in 3.12): see _same_code


class CannotShip(Exception):
    """The answer cannot be sent to another process exactly; the message says why (a clause: "it …")."""


def _plain(v: Any) -> bool:
    if isinstance(v, _PLAIN):
        return True
    if type(v) in (tuple, list, frozenset):
        return all(map(_plain, v))
    if type(v) is dict:
        return all(_plain(k) and _plain(x) for k, x in v.items())
    return False


def _reference(v: Any) -> tuple[str, str] | None:
    """``(module, name)`` that imports ``v`` itself, or None: ``v`` of an importable module (not the
    notebook's ``__main__``), at that module's top level under its own name."""
    mod, name = getattr(v, "__module__", None), getattr(v, "__qualname__", None)
    if not isinstance(mod, str) or not isinstance(name, str) or mod == "__main__" or "." in name:
        return None
    module = sys.modules.get(mod)
    if module is None or getattr(module, "__file__", None) is None:
        return None
    try:
        found = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError):
        return None
    return (mod, name) if found is v else None


def _global_names(fn: types.FunctionType, node: ast.FunctionDef) -> list[str]:
    """The global names ``fn`` reads: in its bytecode (nested functions included) and in its defaults
    and decorators (evaluated where it is defined)."""
    names: list[str] = []
    codes = [fn.__code__]
    while codes:
        code = codes.pop()
        for ins in dis.get_instructions(code):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval not in names:
                names.append(ins.argval)
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    outer = [*node.decorator_list, *node.args.defaults, *filter(None, node.args.kw_defaults)]
    for part in outer:
        names += [n.id for n in ast.walk(part) if isinstance(n, ast.Name) and n.id not in names]
    return names


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    """The same instructions on the same names and constants (nested functions compared alike). Not
    ``co_code`` itself: how CPython encodes a call ``module.attr(...)`` depends on whether ``module`` was
    imported in the code compiled with the function (a cell holds its imports; the ``def`` compiled again
    here does not). CPython 3.12 changes only an instruction's argument there (``LOAD_ATTR``'s method
    bit, ``LOAD_GLOBAL``'s push-NULL bit), not its ``argval``; CPython 3.11 emits ``LOAD_ATTR`` for an
    imported module and ``LOAD_METHOD`` otherwise, so ``LOAD_METHOD`` is compared as ``LOAD_ATTR``: both
    read the same attribute of the same object, and the call that follows is the same. ``PUSH_NULL`` is
    left out: a call such as ``jax.vmap(lambda c: ...)`` whose argument is a closure gets it as a separate
    instruction in one compilation and as ``LOAD_GLOBAL``'s push-NULL bit in the other (CPython 3.12)."""

    def steps(code):
        kept = [i for i in dis.get_instructions(code) if i.opname != "PUSH_NULL"]
        jumps = set(dis.hasjrel) | set(dis.hasjabs)

        def arg(i):  # a jump's target as an index among the kept instructions, not a byte offset
            if i.opcode in jumps:
                return ("to", sum(k.offset < i.argval for k in kept))
            return None if isinstance(i.argval, types.CodeType) else i.argval

        return [(_SAME_OP.get(i.opname, i.opname), arg(i)) for i in kept]

    ca = [c for c in a.co_consts if isinstance(c, types.CodeType)]
    cb = [c for c in b.co_consts if isinstance(c, types.CodeType)]
    return (
        a.co_varnames == b.co_varnames
        and steps(a) == steps(b)
        and len(ca) == len(cb)
        and all(map(_same_code, ca, cb))
    )


def _function_source(obj: Any, label: str) -> tuple[str, types.FunctionType, ast.FunctionDef]:
    """The ``def`` (decorators included) that made ``obj``, checked against its bytecode; ``label`` names
    it in a message."""
    fn = inspect.unwrap(obj)
    if not isinstance(fn, types.FunctionType):
        raise CannotShip(f"{label} is a {type(obj).__name__} made in the notebook, not a def")
    if fn.__name__ == "<lambda>" or "<locals>" in fn.__qualname__ or fn.__closure__:
        raise CannotShip(
            f"{label} is a lambda or a nested function (write it as a def at a cell's top level)"
        )
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        raise CannotShip(f"the source text of {label} cannot be read back") from None
    node = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(node, ast.FunctionDef) or node.name != fn.__name__:
        raise CannotShip(f"the source text of {label} is not one def")
    if obj is not fn and not node.decorator_list:
        raise CannotShip(f"{label} is a wrapped function (write the wrapper as a decorator)")
    bare = ast.Module(
        body=[ast.FunctionDef(**{**node.__dict__, "decorator_list": []})], type_ignores=[]
    )
    ns: dict = {}
    try:
        exec(compile(ast.fix_missing_locations(bare), fn.__code__.co_filename, "exec"), ns)  # noqa: S102
    except Exception:  # noqa: BLE001 - a default that cannot be evaluated alone
        ns = {}
        fake = [ast.Constant(None)] * len(node.args.defaults)
        kw = [None if d is None else ast.Constant(None) for d in node.args.kw_defaults]
        args = ast.arguments(**{**node.args.__dict__, "defaults": fake, "kw_defaults": kw})
        bare.body[0].args = args
        exec(compile(ast.fix_missing_locations(bare), fn.__code__.co_filename, "exec"), ns)  # noqa: S102
    if not _same_code(ns[fn.__name__].__code__, fn.__code__):
        raise CannotShip(
            f"the source text of {label} is not the code that ran (was its cell edited after it ran?)"
        )
    return source, fn, node


def ship(obj: Any, name: str = "answer") -> str:
    """Python source that binds ``name`` to ``obj`` when run as a fresh module (see the module's text
    for what can be sent).

    Raises:
      CannotShip: ``obj`` or something it reads cannot be sent exactly; the message says which.
    """
    lines: dict[str, str] = {}  # the name each line binds -> the line, in the order to run
    defining: set[str] = set()

    def label(n: str, v: Any) -> str:
        return (
            f"the answer ({getattr(v, '__name__', type(v).__name__)})"
            if n == name
            else f"{n}, which it uses,"
        )

    def bind(n: str, v: Any, owner: dict | None) -> None:
        if n in lines or n in defining:
            return
        if isinstance(v, types.ModuleType):
            if sys.modules.get(v.__name__) is not v or getattr(v, "__file__", None) is None:
                raise CannotShip(f"it uses {n}, a module that cannot be imported by name")
            lines[n] = f"import {v.__name__} as {n}" if n != v.__name__ else f"import {n}"
            return
        if _plain(v):
            try:
                same = eval(repr(v), {}) == v  # noqa: S307 - a repr of plain Python values only
            except Exception:  # noqa: BLE001
                same = False
            if not same:
                raise CannotShip(f"it uses {n} = {repr(v)[:60]}, whose text is not its value")
            lines[n] = f"{n} = {v!r}"
            return
        ref = _reference(v)
        if ref is not None:
            mod, qual = ref
            lines[n] = f"from {mod} import {qual}" + (f" as {n}" if n != qual else "")
            return
        fn = inspect.unwrap(v) if callable(v) else v
        if owner is not None and getattr(fn, "__globals__", None) is not owner:
            raise CannotShip(
                f"{label(n, v)} is a value of type {type(v).__name__} made in the notebook (only functions "
                "defined with def, modules, imported names and plain constants can be sent)"
            )
        source, fn, node = _function_source(v, label(n, v))
        defining.add(n)
        for g in _global_names(fn, node):
            if g in fn.__globals__:
                bind(g, fn.__globals__[g], fn.__globals__)
            elif not hasattr(builtins, g):
                raise CannotShip(f"{fn.__name__} reads {g}, which is not defined")
        lines[n] = source if n == fn.__name__ else f"{source}\n{n} = {fn.__name__}"
        defining.discard(n)

    bind(name, obj, None)
    return "\n".join(lines.values()) + "\n"

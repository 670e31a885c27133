"""Checkers for ``00_setup.ipynb``: XLA flags, placing arrays on devices, the parameters-cell convention."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ._common import checker, fail, passed

_DASHES = "\u2010\u2011\u2012\u2013\u2014\u2212"
FLAG = "--xla_force_host_platform_device_count"


@checker
def check_xla_flags(xla_flags_for: Callable[[int], str]) -> bool:
    """Exercise 1: ``xla_flags_for(n)`` returns the ``XLA_FLAGS`` text that simulates ``n`` CPU devices.

    Raises:
      ExerciseError: not a string, a typographic dash, a missing ``--``, a wrong flag name or count.
    """
    from course_lib.devices import DeviceSetupError, check_xla_flags

    for n in (1, 2, 8, 3):
        out = xla_flags_for(n)
        if not isinstance(out, str):
            fail(
                f"xla_flags_for({n}) returned {type(out).__name__}, not a string",
                "return the text of the variable, e.g. an f-string with n in it",
            )
        if any(ch in out for ch in _DASHES):
            fail(
                f"xla_flags_for({n}) = {out!r} contains a typographic dash",
                "type two ASCII hyphens '--'; XLA would abort the process on first use",
            )
        tokens = out.split()
        if not tokens or not all(t.startswith("--") for t in tokens):
            fail(
                f"xla_flags_for({n}) = {out!r}: every flag must start with '--'",
                f"write {FLAG}=N with the two leading hyphens",
            )
        try:
            check_xla_flags(out)
        except DeviceSetupError as e:
            fail(f"xla_flags_for({n}) = {out!r} is malformed", str(e).splitlines()[0])
        names = {t.split("=", 1)[0]: t.split("=", 1)[1] if "=" in t else None for t in tokens}
        if FLAG not in names:
            fail(
                f"xla_flags_for({n}) = {out!r} does not set {FLAG}",
                "the flag is --xla_force_host_platform_device_count=N (check the spelling)",
            )
        if names[FLAG] != str(n):
            fail(
                f"xla_flags_for({n}) sets the count to {names[FLAG]!r}, expected {n}",
                "use the argument n, not a constant, and no spaces around '='",
            )
    return passed("xla_flags_for(n) gives a well-formed flag for every n")


@checker
def check_one_array_per_device(
    one_array_per_device: Callable[[Sequence[Any]], list], devices: Sequence[Any]
) -> bool:
    """Exercise 2: ``one_array_per_device(devices)`` returns a list whose i-th item is ``[i, i, i]`` on ``devices[i]``.

    Raises:
      ExerciseError: wrong length, wrong values or shape, an array on the wrong device.
    """
    import numpy as np

    devices = list(devices)
    out = one_array_per_device(devices)
    if not isinstance(out, (list, tuple)):
        fail(
            f"returned {type(out).__name__}, expected a list of arrays",
            "build a list: one array per device",
        )
    if len(out) != len(devices):
        fail(
            f"returned {len(out)} arrays for {len(devices)} devices",
            "make one array for each device in the list",
        )
    for i, (a, d) in enumerate(zip(out, devices, strict=True)):
        if not hasattr(a, "devices"):
            fail(
                f"item {i} is a {type(a).__name__}, not a jax.Array",
                "use jnp.full(3, i) and jax.device_put",
            )
        if tuple(a.shape) != (3,) or not np.allclose(np.asarray(a), i):
            fail(
                f"item {i} is {np.asarray(a)!r} (shape {tuple(a.shape)}), expected [{i} {i} {i}]",
                "item i holds three copies of i: jnp.full(3, i)",
            )
        if a.devices() != {d}:
            fail(
                f"item {i} lives on {sorted(str(x) for x in a.devices())}, expected {d}",
                "jnp.full puts arrays on the default device; move each with jax.device_put(x, devices[i])",
            )
    return passed(f"{len(devices)} arrays, each on its own device")


_CASES = [
    ("n_devices = 8\nplatform = 'auto'\n", True, "two plain assignments"),
    (
        "# how many devices\nn_devices = 8  # eight\n\nsizes = [128, 256]\n",
        True,
        "comments, blank lines and a list literal",
    ),
    ("image_size = 32\nlearning_rate = -0.01\nname = None\n", True, "a negative number and None"),
    ("import jax\nn_devices = 8\n", False, "an import (the parameters cell must not start JAX)"),
    ("n_devices = jax.device_count()\n", False, "a call on the right-hand side (not a literal)"),
    ("n_devices = 8\nprint(n_devices)\n", False, "a statement that is not an assignment"),
    ("n_devices = 4 * 2\n", False, "an expression rather than a literal value"),
    ("if True:\n    n_devices = 8\n", False, "an assignment inside an if block"),
    ("n_devices =\n", False, "a syntax error (return False, do not raise)"),
    ("config.n_devices = 8\n", False, "an attribute target instead of a plain name"),
]


@checker
def check_parameters_cell(is_plain_parameters_cell: Callable[[str], bool]) -> bool:
    """Exercise 3: ``is_plain_parameters_cell(source)`` is True iff every statement is ``name = literal``.

    Raises:
      ExerciseError: naming the first source it misjudges and what is special about it.
    """
    for source, expected, what in _CASES:
        try:
            got = is_plain_parameters_cell(source)
        except SyntaxError:
            fail(
                f"raised SyntaxError on {source!r}",
                "catch SyntaxError from ast.parse and return False",
            )
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 - report any crash as a wrong answer
            fail(
                f"raised {type(e).__name__}: {e} on {source!r}",
                "return True or False for every source",
            )
        if got is not expected:
            fail(
                f"is_plain_parameters_cell({source!r}) returned {got!r}, expected {expected} ({what})",
                "parse with ast.parse; accept only ast.Assign with one ast.Name target whose value "
                "ast.literal_eval accepts",
            )
    return passed(f"all {len(_CASES)} parameter cells judged correctly")

"""The environment a notebook inherits, checked by :func:`course_lib.devices.setup_devices` before JAX starts.

A shell variable can break a lesson far from its cause or change its numbers without a word: JAX reads
``JAX_ENABLE_X64``, ``JAX_DISABLE_JIT``, ``JAX_DEFAULT_PRNG_IMPL`` … when it is imported, matplotlib reads
``MPLBACKEND``, Python reads ``PYTHONPATH`` and the locale. The checks here turn each of those into one
message in the setup cell that names the variable and the fix, or make the notebook work (the inline plot
backend in a kernel). ``notebooks/00_setup.ipynb`` is where the device setup is taught.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .devices import DeviceSetupError

INLINE_BACKEND = "module://matplotlib_inline.backend_inline"
"""The matplotlib backend that puts figures into the notebook (ipykernel's default when MPLBACKEND is unset)."""

_RANDOM = "other random numbers for the same key: other parameters and data than the course's runs"
COURSE_DEFAULTS = (
    ("jax_enable_x64", False, "JAX computes in float64; the lessons' values and bytes are float32"),
    ("jax_disable_jit", False, "nothing is compiled, and the lessons count and time compilations"),
    (
        "jax_debug_nans",
        False,
        "the lessons' deliberate NaNs raise (07_debugging turns it on locally)",
    ),
    ("jax_debug_key_reuse", False, "the lessons reuse a key on purpose, to show what that does"),
    (
        "jax_numpy_rank_promotion",
        "allow",
        "the course's CNN adds a bias over a batch (rank promotion)",
    ),
    ("jax_threefry_partitionable", True, _RANDOM),
    ("jax_default_prng_impl", "threefry2x32", _RANDOM),
    ("jax_default_matmul_precision", None, "every matrix product runs at another precision"),
)
"""``(JAX option, the value the course is written for, what another value does)``: an option that differs
stops the setup cell. Each is read from the environment variable of the same name in capitals."""

_INVALID_FLAG = re.compile(r"for JAX flag (\w+)|for environment '(\w+)'")


def import_jax() -> Any:
    """``import jax``, with an invalid value of a JAX environment variable named.

    JAX parses its ``JAX_*`` variables while it is imported; a bad value (``JAX_NUM_CPU_DEVICES=four``)
    raises a ``ValueError`` that names the internal option, not the variable, and leaves JAX half imported.

    Raises:
      DeviceSetupError: naming the variable, its value and the fix (the kernel must be restarted).
    """
    try:
        import jax
    except ValueError as e:
        found = _INVALID_FLAG.search(str(e))
        if not found:
            raise
        name = (found.group(1) or found.group(2)).upper()
        raise DeviceSetupError(
            f"{name}={os.environ.get(name, '')!r} in the environment is not a valid value ({e}). Fix it or "
            f"remove it (`unset {name}` in the shell that starts Jupyter or the course command), then restart "
            f"the kernel: JAX is now half imported in this one."
        ) from None
    return jax


def check_jax_options(config: Any, environ: Mapping[str, str] | None = None) -> list[str]:
    """Refuse JAX options that break the lessons or change their numbers (see :data:`COURSE_DEFAULTS`).

    Args:
      config: ``jax.config`` (or any object with the option attributes).
      environ: where the variables come from, for the message; default ``os.environ``.

    Returns:
      Notes to print (today: a persistent compilation cache makes compile times cache loads).

    Raises:
      DeviceSetupError: listing every option that differs, its variable and value, what it does and the fix.
    """
    environ = os.environ if environ is None else environ
    wrong = []
    for option, default, why in COURSE_DEFAULTS:
        value = getattr(config, option, default)
        if value != default:
            var = option.upper()
            source = (
                f"{var}={environ[var]!r}" if var in environ else f"{option}={value!r} (set in code)"
            )
            wrong.append(f"{source}: {why}")
    if wrong:
        names = " ".join(o.upper() for o, d, _ in COURSE_DEFAULTS if getattr(config, o, d) != d)
        raise DeviceSetupError(
            "JAX is configured differently from what the course is written for:\n  - "
            + "\n  - ".join(wrong)
            + f"\nUnset them in the shell that starts Jupyter or the course command (`unset {names}`), or "
            f"remove them from os.environ before JAX is imported, then restart the kernel."
        )
    cache = getattr(config, "jax_compilation_cache_dir", None)
    if cache:
        return [
            f"JAX_COMPILATION_CACHE_DIR={cache}: compile times measured here include persistent-cache hits"
        ]
    return []


def switch_off_persistent_cache(config: Any, jax_started: bool = False) -> list[str]:
    """For a lesson that measures compile times: switch a persistent compilation cache off in this process.

    A cache hit loads a compiled program instead of compiling it, so the lesson's compile times (and the
    asserts on them: a program unrolled 32 times compiles slower than one loop) would be load times. Call
    it before the first compilation (``setup_devices(..., measures_compiles=True)`` does): JAX decides once
    per process whether it uses the cache.

    Args:
      config: ``jax.config``.
      jax_started: JAX ran before this call (its backends started): it may have decided to use the cache.

    Returns:
      A note to print when a cache was configured (``JAX_COMPILATION_CACHE_DIR``), else nothing.
    """
    cache = getattr(config, "jax_compilation_cache_dir", None)
    if not cache:
        return []
    if jax_started and getattr(config, "jax_enable_compilation_cache", True):
        return [
            f"JAX_COMPILATION_CACHE_DIR={cache}: JAX ran before this setup and may use the cache already; "
            "restart the kernel and run the setup first to time real compiles"
        ]
    config.update("jax_enable_compilation_cache", False)
    return [
        f"JAX_COMPILATION_CACHE_DIR={cache}: switched off in this kernel (this lesson measures compile "
        "times; a cache hit would be a load, not a compile)"
    ]


def check_encoding(encoding: str | None = None, environ: Mapping[str, str] | None = None) -> None:
    """The lessons print and pass non-ASCII text (×, –, …): Python must encode file names and text as UTF-8.

    Raises:
      DeviceSetupError: the file-system encoding is not UTF-8, naming the locale variables and the fix.
    """
    encoding = sys.getfilesystemencoding() if encoding is None else encoding
    if encoding.lower().replace("-", "").replace("_", "") == "utf8":
        return
    environ = os.environ if environ is None else environ
    shown = {k: environ[k] for k in ("LC_ALL", "LC_CTYPE", "LANG", "PYTHONUTF8") if k in environ}
    raise DeviceSetupError(
        f"this Python encodes text as {encoding!r}, not UTF-8 (locale settings: {shown or 'none'}); the lessons "
        f"use non-ASCII text. Start Jupyter or the course command with PYTHONUTF8=1 (or LC_ALL=C.UTF-8), "
        f"then restart the kernel."
    )


def check_checkout(
    cwd: str | os.PathLike | None = None, package: str | os.PathLike | None = None
) -> None:
    """The ``course_lib`` imported must be the one of the checkout the notebook belongs to.

    A kernel starts in the notebook's folder (``<checkout>/notebooks``), where ``PYTHONPATH`` comes before
    the checkout's own package: a ``PYTHONPATH`` naming another copy of the course silently runs that
    copy's code.

    Args:
      cwd: the kernel's working folder; default ``os.getcwd()``.
      package: the folder of the imported ``course_lib``; default this module's folder.

    Raises:
      DeviceSetupError: naming both folders and ``PYTHONPATH``.
    """
    cwd = Path.cwd() if cwd is None else Path(cwd)
    package = Path(__file__).parent if package is None else Path(package)
    for root in (cwd, cwd.parent):
        if (root / "course_lib" / "__init__.py").is_file() and (root / "notebooks").is_dir():
            if (root / "course_lib").resolve() != package.resolve():
                raise DeviceSetupError(
                    f"this notebook belongs to the course in {root}, but `course_lib` is imported from "
                    f"{package} (PYTHONPATH={os.environ.get('PYTHONPATH', '')!r}): another copy's code would "
                    f"run. Remove that folder from PYTHONPATH (or run `make setup` in {root}), then restart "
                    f"the kernel."
                )
            return


def use_inline_plots(environ: dict | None = None) -> str | None:
    """In a Jupyter kernel, make figures appear in the notebook whatever ``MPLBACKEND`` the shell set.

    ipykernel selects the inline backend only when ``MPLBACKEND`` is unset; an inherited ``Agg`` (common in
    containers and CI) leaves every figure out of the notebook, a misspelt one breaks ``import
    matplotlib``. Outside a kernel nothing changes.

    Returns:
      A note to print when the variable was replaced, else None.
    """
    environ = os.environ if environ is None else environ
    before = environ.get("MPLBACKEND")
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if not hasattr(shell, "kernel") or before in (None, "", INLINE_BACKEND, "inline"):
        return None
    environ["MPLBACKEND"] = INLINE_BACKEND
    if "matplotlib" in sys.modules:  # imported before the setup cell, with the other backend
        shell.run_line_magic("matplotlib", "inline")
    return f"MPLBACKEND={before!r} from the environment replaced by the inline backend: plots show here"

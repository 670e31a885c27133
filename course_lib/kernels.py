"""What a compiled program launches: the kernels of its entry computation, the copies between memory spaces
kept apart from them, and a program compiled for XLA:CPU on any host.

Taught in ``notebooks/02_jit.ipynb`` (a compiled program read line by line; also used in ``01_grad.ipynb``)
and used for the memory comparisons of ``01_grad``, ``02_jit`` and ``03_vmap`` (:func:`cpu_compiled`,
:func:`compiled_on`).
:mod:`course_lib.programs` re-exports :func:`hlo_kernels` and :func:`hlo_memory_moves`.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable, Mapping
from typing import Any

_NOT_KERNELS = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast"})
_ASYNC_COPIES = frozenset({"copy-start", "copy-done"})
_ENTRY_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\([^=]*?\)|\S+)\s+([\w\-]+)\("
)  # (result shape with its layout, op)


def _entry_ops(hlo_text: str) -> list[tuple[str, str]]:
    """``[(result shape, op)]`` of the ``ENTRY`` computation's instructions; ValueError if there is none."""
    start = hlo_text.find("\nENTRY ")
    if start < 0:
        raise ValueError(
            "no ENTRY computation in this text; pass compiled.as_text() of a jitted function"
        )
    body = hlo_text[start:].split("\n}", 1)[0].splitlines()[1:]
    return [(m.group(1), m.group(2)) for m in map(_ENTRY_INSTR.match, body) if m]


def _moves_memory(shape: str, op: str) -> bool:
    """An async copy (``copy-start``/``copy-done``), or a ``copy`` whose result's layout names another memory
    space (``S(n)``, e.g. ``f32[]{:T(128)S(6)}``): XLA:TPU's memory-space assignment, not computation."""
    return op in _ASYNC_COPIES or (op == "copy" and "S(" in shape)


def hlo_kernels(hlo_text: str) -> collections.Counter:
    """Count the computing operations of a compiled program's entry computation, by kind.

    Args:
      hlo_text: ``jax.jit(f).lower(...).compile().as_text()`` (the optimised HLO).

    Returns:
      A ``Counter`` such as ``{"fusion": 6, "dot": 3}``: what the program launches, one entry per operation
      of its ``ENTRY`` computation. Left out: parameters, constants, tuples and bitcasts, which launch
      nothing, and copies between memory spaces (:func:`hlo_memory_moves`: XLA:TPU's ``copy-start`` /
      ``copy-done`` pairs and ``copy`` into another memory space), which move data and compute nothing.
      Taught in ``notebooks/02_jit.ipynb`` (and used in ``01_grad.ipynb``).

    Raises:
      ValueError: the text has no ``ENTRY`` computation (it is not HLO text).
    """
    ops = _entry_ops(hlo_text)
    return collections.Counter(
        op for shape, op in ops if op not in _NOT_KERNELS and not _moves_memory(shape, op)
    )


def hlo_memory_moves(hlo_text: str) -> collections.Counter:
    """Count the copies between memory spaces in a compiled program's entry computation, by kind.

    XLA:TPU moves arrays between its memory spaces (HBM and the core's on-chip memories, written ``S(n)`` in a
    layout) with asynchronous ``copy-start`` / ``copy-done`` pairs and with a ``copy`` whose result lives in
    another space. XLA:CPU has one memory space: its programs have none (``notebooks/02_jit.ipynb`` asserts
    it). A ``copy`` that stays in one memory space (a layout change) is a kernel, in :func:`hlo_kernels`.

    Args:
      hlo_text: ``compiled.as_text()`` of a jitted function.

    Returns:
      A ``Counter`` such as ``{"copy-start": 1, "copy-done": 1, "copy": 1}``; empty where nothing moves.

    Raises:
      ValueError: the text has no ``ENTRY`` computation (it is not HLO text).
    """
    return collections.Counter(op for shape, op in _entry_ops(hlo_text) if _moves_memory(shape, op))


def compiled_on(
    device: Any,
    fn: Callable[..., Any],
    *args: Any,
    compiler_options: Mapping[str, Any] | None = None,
) -> Any:
    """``jax.jit(fn)`` lowered for ``args`` placed on ``device`` (a ``jax.Device``) and compiled for its
    backend: that backend's program, whatever JAX's default backend is.

    Args:
      device: where the arguments go, e.g. ``jax.devices("cpu")[0]`` or ``jax.devices()[0]``.
      fn: a function of ``args`` (jitted or not).
      *args: its arguments (arrays or pytrees of arrays; copied to ``device``, not changed).
      compiler_options: passed to ``compile`` (e.g. ``{"xla_disable_hlo_passes": "..."}``).

    Returns:
      The ``jax.stages.Compiled`` program: ``memory_analysis()``, ``cost_analysis()``, ``as_text()``, and
      callable on arrays on ``device``.
    """
    import jax

    placed = jax.device_put(args, device)
    return jax.jit(fn).lower(*placed).compile(compiler_options=compiler_options)


def cpu_compiled(
    fn: Callable[..., Any], *args: Any, compiler_options: Mapping[str, Any] | None = None
) -> Any:
    """``jax.jit(fn)`` lowered for ``args`` placed on the first CPU device and compiled there: XLA:CPU's
    program on every host, also where the default backend is a TPU or a GPU.

    The lessons' memory comparisons (``temp_size_in_bytes`` of two programs) read XLA:CPU's numbers with it:
    XLA:TPU reports no or next to no temporaries for those small programs (TPU v5e, JAX 0.10.2), so there
    they would show no difference. Used in ``notebooks/01_grad.ipynb`` (section 7), ``02_jit.ipynb``
    (section 5) and ``03_vmap.ipynb`` (section 4); on a TPU v5e those lessons also compile the programs for
    the chip (:func:`compiled_on`) and assert how small its temporaries are.

    Args:
      fn: a function of ``args`` (jitted or not).
      *args: its arguments (arrays or pytrees of arrays; copied to the CPU device, not changed).
      compiler_options: passed to ``compile`` (e.g. ``{"xla_disable_hlo_passes": "..."}``).

    Returns:
      The ``jax.stages.Compiled`` program: ``memory_analysis()``, ``cost_analysis()``, ``as_text()``, and
      callable on arrays on the CPU device.
    """
    import jax

    return compiled_on(jax.devices("cpu")[0], fn, *args, compiler_options=compiler_options)

"""What XLA did to a program, read from its own dumps: the HLO after a pass, and where its temporaries go.

``Compiled.as_text()`` is the program after *every* pass, for this backend. Two questions need XLA's
intermediate records instead (``notebooks/08_lab.ipynb`` asks both):

- **What did the SPMD partitioner ask for?** The module right after the ``spmd-partitioning`` pass holds
  the collectives the partitioner inserted, before backend passes change them — XLA:CPU's
  ``AllReducePromotion`` turns every bfloat16 all-reduce into a float32 one; XLA:GPU keeps bfloat16.
  :func:`compile_with_dump` keeps that text (:attr:`Dump.after_spmd`).
- **What do the temporaries hold?** ``memory_analysis().temp_size_in_bytes`` is one number. XLA's buffer
  assignment lists every value placed in the temporary slab, with its shape and its offset, and its live
  ranges say when each is alive. :func:`peak_temporaries` finds the program point where the most temporary
  bytes are live and lists the values live there; :func:`bytes_by_dtype` sums them per element type.

Dumps are written by compiling with XLA's ``xla_dump_to`` option (``Lowered.compile(compiler_options=…)``)
into a fresh folder that is deleted once read. A program served from JAX's persistent compilation cache
writes no dumps, so the compile runs with that cache switched off (and switched on again after).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax

from . import programs

__all__ = [
    "Dump",
    "TempValue",
    "collective_dtypes",
    "bytes_by_dtype",
    "compile_with_dump",
    "occupied_bytes",
    "peak_temporaries",
]


@dataclasses.dataclass(frozen=True)
class Dump:
    """XLA's records of one compile (texts; the folder they were read from is gone).

    Attributes:
      after_spmd: the HLO module right after the ``spmd-partitioning`` pass ("" when the program has no
        partitioner pass: one device).
      buffer_assignment: ``*-buffer-assignment.txt``: every allocation and the values placed in it.
      live_range: ``*-live-range.txt``: the program order and each value's live range in it.
      after_optimizations: the final HLO (what ``Compiled.as_text()`` prints).
    """

    after_spmd: str
    buffer_assignment: str
    live_range: str
    after_optimizations: str


@contextlib.contextmanager
def _no_persistent_cache() -> Iterator[None]:
    """JAX's persistent compilation cache off for the block (a cached program would write no dumps)."""
    from jax.experimental.compilation_cache import compilation_cache

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()  # set up again, from the same settings, at the next compile


def _read(folder: Path, pattern: str) -> str:
    found = sorted(folder.glob(pattern))
    return found[-1].read_text() if found else ""


def compile_with_dump(lowered: Any) -> tuple[Any, Dump]:
    """Compile ``lowered`` (``jax.stages.Lowered``) with XLA's dumps on; return ``(compiled, Dump)``.

    The dump goes to a new temporary folder, is read into the :class:`Dump` and deleted. The compile does
    not use the persistent compilation cache, so it always runs (and takes a compile's time).

    Raises:
      RuntimeError: XLA wrote no buffer assignment (the dump did not happen).
    """
    folder = Path(tempfile.mkdtemp(prefix="xla-dump-"))
    try:
        options = {"xla_dump_to": str(folder), "xla_dump_hlo_pass_re": "spmd-partitioning"}
        with _no_persistent_cache():
            compiled = lowered.compile(compiler_options=options)
        dump = Dump(
            after_spmd=_read(folder, "*.after_spmd-partitioning.*.txt"),
            buffer_assignment=_read(folder, "*after_optimizations-buffer-assignment.txt"),
            live_range=_read(folder, "*after_optimizations-live-range.txt"),
            after_optimizations=_read(folder, "*after_optimizations.txt"),
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if not dump.buffer_assignment:
        raise RuntimeError(
            "XLA wrote no buffer assignment: was the program compiled before with the same dump folder?"
        )
    return compiled, dump


@dataclasses.dataclass(frozen=True)
class TempValue:
    """One value XLA placed in the program's temporary slab.

    Attributes:
      name: the HLO value, e.g. ``"wrapped_reduce-window{1}"`` (``{i}``: element ``i`` of a tuple result).
      dtype: its element type (``"s32"``), or ``"tuple"`` for a tuple's own (pointer) buffer.
      shape: its dimensions.
      size: bytes.
      start, end: its live range, as positions in the program order (inclusive).
      offset: where it sits in the slab, bytes from its start.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    size: int
    start: int
    end: int
    offset: int = 0


_VALUE = re.compile(
    r"^ value: <\d+ (?P<name>\S+?)(?P<index>\{[\d,]*\})? @\d+> "
    r"\(size=(?P<size>\d+),offset=(?P<offset>\d+)\)"
)
_RANGE = re.compile(r"^\s+(?P<name>\S+?\{[\d,]*\}):(?P<start>\d+)-(?P<end>\d+)$", re.MULTILINE)


def temp_values(dump: Dump) -> list[TempValue]:
    """Every value of the temporary slab (``preallocated-temp`` allocations), with its live range.

    Raises:
      ValueError: a temporary value has no live range in the dump (the two files do not match).
    """
    ranges = {m["name"]: (int(m["start"]), int(m["end"])) for m in _RANGE.finditer(dump.live_range)}
    out, in_temp = [], False
    for line in dump.buffer_assignment.splitlines():
        if line.startswith("allocation "):
            in_temp = "preallocated-temp" in line
            continue
        m = _VALUE.match(line) if in_temp else None
        if not m:
            continue
        name = m["name"] + (m["index"] or "{}")
        if name not in ranges:
            raise ValueError(f"temporary value {name} has no live range in the dump")
        shape = line.split("): ", 1)[1]
        arrays = programs.arrays(shape)
        dtype, dims = ("tuple", ()) if shape.startswith("(") or not arrays else arrays[0]
        out.append(
            TempValue(name, dtype, dims, int(m["size"]), *ranges[name], offset=int(m["offset"]))
        )
    return out


def occupied_bytes(values: list[TempValue]) -> int:
    """Bytes of the temporary slab that ``values`` cover; bytes two values share (an instruction that
    writes its result into its operand's buffer) count once."""
    total, reach = 0, 0
    for v in sorted(values, key=lambda v: v.offset):
        lo, hi = max(v.offset, reach), v.offset + v.size
        total += max(hi - lo, 0)
        reach = max(reach, hi)
    return total


def peak_temporaries(dump: Dump) -> tuple[int, list[TempValue]]:
    """``(position, values)``: the program point where the temporary values live at once cover the most of
    the slab (:func:`occupied_bytes`), and the values live there (largest first). A value is live from its
    definition to its last use."""
    values = temp_values(dump)
    if not values:
        return 0, []
    positions = sorted({v.start for v in values})
    best = max(
        positions, key=lambda t: occupied_bytes([v for v in values if v.start <= t <= v.end])
    )
    live = [v for v in values if v.start <= best <= v.end]
    return best, sorted(live, key=lambda v: -v.size)


def bytes_by_dtype(values: list[TempValue]) -> dict[str, int]:
    """Bytes of ``values`` per element type, largest first (``{"s32": …, "f32": …}``)."""
    out: dict[str, int] = {}
    for v in values:
        out[v.dtype] = out.get(v.dtype, 0) + v.size
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def collective_dtypes(
    hlo_text: str, kinds: tuple[str, ...] = ("all-reduce",), group_size: int | None = None
) -> list[str]:
    """The element type of every array that the collectives of ``kinds`` in ``hlo_text`` move, in program
    order (a combined collective contributes one per array): ``["bf16", "bf16", …, "f32"]``.

    Args:
      hlo_text: an HLO module (:attr:`Dump.after_spmd`, :attr:`Dump.after_optimizations`).
      kinds: HLO collectives to read (``"all-reduce"``, ``"reduce-scatter"``, …).
      group_size: only the collectives over groups of this many devices (e.g. the ``data`` axis of a
        ``data × model`` mesh); None: all of them.
    """
    return [
        dtype
        for op in programs.collective_ops(hlo_text)
        if op.op in kinds and (group_size is None or op.group_size == group_size)
        for dtype, _ in programs.arrays(op.shape)
    ]

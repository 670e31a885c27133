"""Lesson 00, exercise 3: every transfer the learner's ``split_and_sum`` makes, and the rule it must keep.

The rule (the exercise's "move only the partial sums, never the rows"): the only arrays that may leave x's
device are the blocks of rows, each going to its own device; after that only row-sized sums move, and
each moved sum is built from partial sums that are already where it is moved from (partial ``i`` lives on
``devices[i]``, and on every device it has been moved to). Nothing larger than one row goes to the host.

:class:`RecordMoves` sees every transfer while the answer runs:

- explicit ones with their values: ``jax.device_put`` under any name (``jax._src.api.device_put``, so also
  ``Array.to_device``), and ``jnp.asarray`` / ``jnp.array`` with ``device=`` (both end in
  ``lax._convert_element_type(..., sharding=)``);
- copies to the host, with their shapes and values: those that go through ``ArrayImpl._value``
  (``jax.device_get``, printing, ``np.asarray`` on a GPU) and those that read a CPU array's buffer directly
  (``np.asarray``, ``np.array`` on the CPU: ``ArrayImpl.__buffer__`` is wrapped on Python >= 3.12; on
  3.11, which has no ``__buffer__``, the buffer is withheld meanwhile, :mod:`._buffer311`). What comes back from the
  host (``device_put`` of a NumPy value) is judged like any other move, with the host as its source, where
  only the partial sums (and sums of them) are that were copied there;
- the copies an operation makes of its operands, with their values: an array on another device, or a
  NumPy value, added to (or otherwise combined with) an array committed to the target is copied to where
  the operation runs (``pxla.shard_args``; JAX's C++ fast path, which would skip it, is switched off and
  its cache cleared while the answer runs);
- every device-to-device copy, also the implicit ones (a jitted call with ``out_shardings``, an
  uncommitted array moved to a committed one's device) and any explicit path not named above: JAX's
  transfer guard at level ``"log_explicit"`` reports each one on the process's stderr (file descriptor 2),
  which is captured while the answer runs. A log line carries a shape and devices, not values: a
  multi-row copy it reports is judged by its shape; a row-sized one it alone reports is not judged (a
  zeros accumulator moves this way).

:func:`judge_moves` then applies the rule and raises an ExerciseError naming the move that breaks it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._buffer311 import NoBufferProtocol
from ._common import fail


@dataclass
class Move:
    """One transfer: ``kind`` is "explicit", "host" (to the host), "copied" (an operation copied its
    operand, value known) or "implicit" (from the log: no value known)."""

    kind: str
    shape: tuple[int, ...]
    src: Any  # a jax.Device, "host", or None when unknown
    dst: Any  # a jax.Device, a jax.sharding.Sharding, or "host"
    value: np.ndarray | None = None


def _device_of(leaf) -> Any:
    import jax

    if isinstance(leaf, jax.Array):
        devices = leaf.devices()
        return next(iter(devices)) if len(devices) == 1 else leaf.sharding
    return "host"


def _single(dst) -> Any:
    """A one-device sharding as its device; anything else unchanged."""
    import jax

    if isinstance(dst, jax.sharding.Sharding) and len(dst.device_set) == 1:
        (dst,) = dst.device_set
    return dst


_AVAL = re.compile(r"aval=ShapedArray\((\w+)\[([\d,]*)\]")
_SRC = re.compile(r"[ (]sharding=\w+\(device=\w+\(id=(\d+)\)")
_DST = re.compile(r"dst_sharding=\w+\(device=\w+\(id=(\d+)\)")


def parse_transfer_log(text: str, by_id: dict) -> list[Move]:
    """The implicit device-to-device transfers in JAX's transfer-guard log lines."""
    moves = []
    for line in text.splitlines():
        if "device-to-device transfer" not in line:
            continue
        aval, src, dst = _AVAL.search(line), _SRC.search(line), _DST.search(line)
        if not aval or not dst:
            continue
        shape = tuple(int(s) for s in aval.group(2).split(",") if s)
        source = by_id.get(int(src.group(1))) if src else None
        moves.append(Move("implicit", shape, source, by_id.get(int(dst.group(1)))))
    return moves


class RecordMoves:
    """Record every transfer made while the learner's function runs (see the module docstring)."""

    def __enter__(self):
        import jax
        from jax._src import api, array
        from jax._src.lax import lax as lax_internal

        self.moves: list[Move] = []
        self._saved = (api.device_put, jax.device_put, lax_internal._convert_element_type)
        self._value = array.ArrayImpl._value
        put, convert, value = self._saved[0], self._saved[2], self._value
        self._inside = (
            0  # > 0 while an explicit move runs: its own operand copies are not recorded again
        )

        def device_put(x, device=None, *args, **kwargs):
            self._inside += 1
            try:
                return _device_put(x, device, *args, **kwargs)
            finally:
                self._inside -= 1

        def _device_put(x, device=None, *args, **kwargs):
            if device is not None:
                leaves = jax.tree.leaves(x)
                # a list of devices matching a list of arrays: leaf i goes to device i
                paired = isinstance(device, list | tuple) and len(device) == len(leaves)
                for leaf, dst in zip(leaves, device if paired else [device] * len(leaves)):
                    self._explicit(leaf, dst)
            elif any(not isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(x)):
                for leaf in jax.tree.leaves(x):  # to the default device, from the host
                    if not isinstance(leaf, jax.Array):
                        self._explicit(leaf, jax.devices()[0])
            return put(x, device, *args, **kwargs)

        def convert_element_type(operand, *args, sharding=None, **kwargs):
            if sharding is None:
                return convert(operand, *args, **kwargs)
            self._explicit(operand, sharding)
            self._inside += 1
            try:
                with jax.transfer_guard_device_to_device("allow"):  # recorded here, not in the log
                    return convert(operand, *args, sharding=sharding, **kwargs)
            finally:
                self._inside -= 1

        def to_host(arr):
            out = value.fget(arr)
            self.moves.append(Move("host", tuple(arr.shape), _device_of(arr), "host", out))
            return out

        def buffer(arr, flags):  # NumPy reads a CPU array's buffer directly (np.asarray, np.array)
            view = self._buffer(arr, flags)
            self.moves.append(
                Move("host", tuple(arr.shape), _device_of(arr), "host", np.array(view))
            )
            return view

        # Python >= 3.12: NumPy's direct read of a CPU array is ArrayImpl.__buffer__ (PEP 688), wrapped
        # here; Python 3.11 has no __buffer__, so the C slot is emptied meanwhile (_buffer311) and NumPy
        # reads through __array__ and _value, which are recorded
        self._buffer = getattr(array.ArrayImpl, "__buffer__", None)
        self._no_buffer = None if self._buffer is not None else NoBufferProtocol(array.ArrayImpl)
        api.device_put = jax.device_put = device_put
        lax_internal._convert_element_type = convert_element_type
        self._operands = _OperandCopies(self)
        self._operands.__enter__()
        array.ArrayImpl._value = property(to_host)
        if self._buffer is not None:
            array.ArrayImpl.__buffer__ = buffer
        else:
            self._no_buffer.__enter__()
        self._log = _TransferLog()
        self._log.__enter__()
        return self

    def _explicit(self, leaf, dst) -> None:
        import jax

        if isinstance(leaf, jax.core.Tracer) or not hasattr(leaf, "shape"):
            return  # inside a trace, or a Python scalar: nothing to record
        with contextlib.suppress(Exception):
            value = np.array(self._value.fget(leaf) if isinstance(leaf, jax.Array) else leaf)
            self.moves.append(
                Move("explicit", tuple(np.shape(leaf)), _device_of(leaf), _single(dst), value)
            )

    def __exit__(self, *exc):
        import jax
        from jax._src import api, array
        from jax._src.lax import lax as lax_internal

        api.device_put, jax.device_put, lax_internal._convert_element_type = self._saved
        array.ArrayImpl._value = self._value
        if self._buffer is not None:
            array.ArrayImpl.__buffer__ = self._buffer
        else:
            self._no_buffer.__exit__(*exc)
        self._operands.__exit__(*exc)
        self._log.__exit__(*exc)
        by_id = {d.id: d for d in jax.devices()}
        logged = parse_transfer_log(self._log.text, by_id)
        for (
            move
        ) in self.moves:  # a recorded explicit copy also has its log line: keep one of the two
            dst = _single(move.dst)
            match = [m for m in logged if m.shape == move.shape and m.dst == dst]
            if move.kind in ("explicit", "copied") and move.src not in (dst, "host") and match:
                logged.remove(match[0])
        self.moves += logged


class _OperandCopies:
    """Record, with its value, every operand an operation copies to where it runs (an array from another
    device, a NumPy value from the host). Eager operations reach ``pxla.shard_args`` only off JAX's C++
    fast path, so that path is switched off (and its cache cleared) meanwhile."""

    def __init__(self, record: RecordMoves):
        self.record = record

    def __enter__(self):
        import jax
        from jax._src import pjit
        from jax._src.interpreters import pxla

        self._saved = (pxla.shard_args, pjit._get_fastpath_data)
        shard_args, record = self._saved[0], self.record

        def recording(shardings, layouts, copy_semantics, args, *rest, **kwargs):
            if not record._inside:
                for arg, sharding in zip(args, shardings):
                    self._copied(arg, _single(sharding))
            return shard_args(shardings, layouts, copy_semantics, args, *rest, **kwargs)

        jax.clear_caches()
        pxla.shard_args = recording
        pjit._get_fastpath_data = lambda *args, **kwargs: None
        return self

    def _copied(self, arg, dst) -> None:
        import jax

        if isinstance(arg, jax.core.Tracer) or not hasattr(arg, "shape"):
            return
        src = _device_of(arg)
        if src == dst:
            return
        with contextlib.suppress(Exception):
            value = np.array(self.record._value.fget(arg) if isinstance(arg, jax.Array) else arg)
            self.record.moves.append(Move("copied", tuple(np.shape(arg)), src, dst, value))

    def __exit__(self, *exc):
        import jax
        from jax._src import pjit
        from jax._src.interpreters import pxla

        pxla.shard_args, pjit._get_fastpath_data = self._saved
        jax.clear_caches()  # no entry without its fast path is left behind


class _TransferLog:
    """JAX's transfer guard at level "log_explicit" for device-to-device copies (every one, explicit or
    not); its C++ log lines go to file descriptor 2, which is redirected to a temporary file meanwhile
    (other lines are passed on)."""

    def __enter__(self):
        import jax

        self.text = ""
        sys.stderr.flush()
        self._file = tempfile.TemporaryFile()
        self._saved_fd = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        self._guard = jax.transfer_guard_device_to_device("log_explicit")
        self._guard.__enter__()
        return self

    def __exit__(self, *exc):
        self._guard.__exit__(*exc)
        sys.stderr.flush()
        os.dup2(self._saved_fd, 2)
        os.close(self._saved_fd)
        self._file.seek(0)
        self.text = self._file.read().decode(errors="replace")
        self._file.close()
        others = [line for line in self.text.splitlines() if "transfer:" not in line]
        if others:
            print("\n".join(others), file=sys.stderr)


# ---------------------------------------------------------------- the rule


def _blocks_of(dst, shape, devices) -> bool:
    """True when ``dst`` is a sharding that gives ``devices[i]`` the i-th block of rows (lesson 05's layout)."""
    import jax

    if not isinstance(dst, jax.sharding.Sharding) or set(dst.device_set) != set(devices):
        return False
    rows, k = shape[0], shape[0] // len(devices)
    index = dst.devices_indices_map(shape)
    return all(
        index[d][0] == slice(i * k, (i + 1) * k) if k < rows else True
        for i, d in enumerate(devices)
    )


class _Partials:
    """Which sums of partial sums are available on which device (partial i starts on devices[i])."""

    def __init__(self, partials, devices):
        self.values = [np.asarray(p, np.float64) for p in partials]
        self.dtype = np.asarray(partials[0]).dtype if len(partials) else None
        self.atoms = {d: [frozenset([i])] for i, d in enumerate(devices)}

    def decompose(self, value, where):
        """The index set of a sum of disjoint atoms available at ``where`` that equals ``value``, or None."""
        value = np.asarray(value, np.float64)
        if np.allclose(value, 0):
            return frozenset()
        atoms = self.atoms.get(where, [])[:12]
        for size in range(1, len(atoms) + 1):
            for combo in itertools.combinations(atoms, size):
                joined = frozenset().union(*combo)
                if sum(len(a) for a in combo) != len(joined):
                    continue
                if np.allclose(sum(self.values[i] for i in joined), value, rtol=1e-5, atol=1e-5):
                    return joined
        return None

    def arrive(self, indices, where) -> None:
        if indices:
            self.atoms.setdefault(where, []).append(indices)


def _judge_row(move: Move, partials: _Partials, devices, name) -> None:
    """A row-sized moved value must be a sum of partial sums available where it left."""
    found = partials.decompose(move.value, move.src)
    if found is not None:
        partials.arrive(found, move.dst)
        return
    got = getattr(move.value, "dtype", None)
    if got is not None and partials.dtype is not None and got != partials.dtype:
        want = partials.dtype
        fail(
            f"a row-sized {got} array was moved from {name(move.src)} to {name(move.dst)}; the partial "
            f"sums of this {want} x are {want}",
            f"add the partial sums as they are: the column sum of {want} rows is {want}",
        )
    whole = sum(partials.values)
    if np.allclose(np.asarray(move.value, np.float64), whole, rtol=1e-5, atol=1e-5):
        how = (
            f", implicitly: an operation on {name(move.dst)} took it as an operand"
            if move.kind == "copied"
            else ""
        )
        where = "before it was copied there" if move.src == "host" else "there"
        fail(
            f"a sum of all the rows was moved from {name(move.src)} to {name(move.dst)}{how}; it was "
            f"computed from x {where}, not from the partial sums",
            "build the total only from the partial sums: move each one to the target device, then add",
        )
    same = [
        i for i, v in enumerate(partials.values) if np.allclose(move.value, v, rtol=1e-5, atol=1e-5)
    ]
    if same:
        fail(
            f"partial sum {same[0]} was moved from {name(move.src)}: it was computed there (from x), not on "
            f"{name(devices[same[0]])} where part {same[0]} lives",
            "compute each partial sum from its committed part: part.sum(axis=0) runs on that part's "
            "device, with no move",
        )
    fail(
        f"a row-sized array that is no sum of partial sums was moved from {name(move.src)} to {name(move.dst)}",
        "move only the partial sums (or sums of them made on one device), never anything computed from x",
    )


def judge_moves(moves, x_np, parts, partials, devices) -> None:
    """Apply the rule of the module docstring to ``moves`` (a :class:`RecordMoves`' record), or fail."""
    rows, row_shape = x_np.shape[0], tuple(x_np.shape[1:])
    k, row_size = rows // len(devices), int(np.prod(row_shape, dtype=int))
    blocks = [x_np[i * k : (i + 1) * k] for i in range(len(devices))]
    available = _Partials(partials, devices)

    def name(where) -> str:
        return (
            str(where) if not hasattr(where, "device_set") else f"{len(where.device_set)} devices"
        )

    for move in moves:
        if move.kind != "host" and _single(move.dst) == move.src:
            continue  # already there: nothing moved
        size = int(np.prod(move.shape, dtype=int))
        if move.kind == "host":
            if size > row_size:
                fail(
                    f"an array of shape {move.shape} (more than one row) was copied from {name(move.src)} to "
                    "the host (np.asarray, jax.device_get or printing it)",
                    "keep the rows on the devices: slice x and device_put each block, sum each part where it is",
                )
            found = available.decompose(move.value, move.src) if move.shape == row_shape else None
            available.arrive(found or frozenset(), "host")
        elif move.shape == tuple(x_np.shape) and len(devices) > 1:
            if not (move.kind != "implicit" and _blocks_of(move.dst, move.shape, devices)):
                fail(
                    f"every row of x was moved to {name(move.dst)}",
                    "move each block of rows to its own device only; after that, move only partial sums",
                )
        elif move.shape == blocks[0].shape and k < rows:
            _judge_block(move, blocks, devices, name)
        elif move.shape == row_shape:
            if move.value is not None:
                _judge_row(move, available, devices, name)
        elif size > row_size:
            fail(
                f"an array of shape {move.shape} (more than one row of x) was moved to {name(move.dst)}",
                "only the blocks of rows travel, each to its own device; after that only partial sums move",
            )


def _judge_block(move: Move, blocks, devices, name) -> None:
    dst = _single(move.dst)
    if move.value is None:
        if dst not in devices:
            fail(
                f"a block of rows was copied to {name(dst)}, which holds no part",
                "move each block of rows to its own device only",
            )
        return
    which = [i for i, b in enumerate(blocks) if np.array_equal(move.value, b)]
    if not which:
        fail(
            f"an array shaped like a block of rows, but holding other rows, was moved to {name(dst)}",
            "device i gets the i-th contiguous block of rows",
        )
    if dst != devices[which[0]]:
        fail(
            f"the rows of part {which[0]} were moved to {name(dst)}, not only to {name(devices[which[0]])}",
            "move each block of rows to its own device; sum it there and move only the partial sum",
        )

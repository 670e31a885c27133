"""Lesson 09's exercise 3 (exported by :mod:`course_tools.checks.lesson09`): a loader that reads each
element of this process's blocks of a global batch once, from a source that records every read.

Judged in the notebook's one process (four layouts) and on stand-in devices of 2 processes (process 0's
being this process's), where a read of another process's elements shows.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import P
from jax.sharding import Mesh, NamedSharding

from course_lib.meshes import DATA, MODEL, choose_mesh_shape, data_mesh, data_model_mesh

from ._common import NotWritten, call_answer, fail, not_written
from ._lesson09_group import GroupDevice, fake_devices


def _call(what: str, fn: Callable, *args, hint: str):
    """``call_answer`` with this exercise's own "not written yet" hint."""
    try:
        return call_answer(what, fn, *args)
    except NotWritten:
        not_written(what, hint)


class RecordingSource:
    """A NumPy array stand-in (like a memory-mapped file) that records every read.

    Attributes:
      reads: the ``(start, stop)`` ranges of each read, one pair per dimension; a conversion of the whole
        array (``np.asarray(source)``) is recorded as the full range.
    """

    def __init__(self, data: np.ndarray):
        self._data = data
        self.shape, self.dtype, self.ndim = data.shape, data.dtype, data.ndim
        self.reads: list[tuple] = []

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        block = self._data[index]
        if any(
            i is Ellipsis for i in index
        ):  # as NumPy: one ... stands for the dimensions not named
            at = next(k for k, i in enumerate(index) if i is Ellipsis)
            fill = (slice(None),) * (self.ndim - len(index) + 1)
            index = index[:at] + fill + index[at + 1 :]
        spans = []
        for dim, size in enumerate(self.shape):
            s = index[dim] if dim < len(index) else slice(None)
            if isinstance(s, slice):
                start, stop, _ = s.indices(size)
            else:
                start, stop = int(s), int(s) + 1
            spans.append((start, stop))
        self.reads.append(tuple(spans))
        return np.array(block)

    def __array__(self, dtype=None, copy=None):
        self.reads.append(tuple((0, s) for s in self.shape))
        return np.array(self._data, dtype=dtype)

    def __len__(self):
        return self.shape[0]


def _blocks(sharding, shape) -> set[tuple]:
    out = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        out.add(
            tuple(
                ((s.start or 0), (size if s.stop is None else s.stop))
                for s, size in zip(index, shape)
            )
        )
    return out


def _loader_cases(devices):
    n_data, n_model = choose_mesh_shape(len(devices))
    grid = data_model_mesh(devices, (n_data, n_model), axis_type="explicit")
    flat = data_mesh(devices, axis_type="explicit")
    return [
        ("rows over data", NamedSharding(flat, P(DATA))),
        (f"rows over data, copies over model ({n_model})", NamedSharding(grid, P(DATA))),
        ("rows over data, columns over model", NamedSharding(grid, P(DATA, MODEL))),
        ("fully replicated", NamedSharding(grid, P())),
    ]


def _read_counts(reads: list, shape: tuple) -> np.ndarray:
    """How many times each element of the source was read."""
    counts = np.zeros(shape, np.int32)
    for spans in reads:
        counts[tuple(slice(a, b) for a, b in spans)] += 1
    return counts


def _judge_reads(what: str, reads: list, sharding, shape: tuple) -> None:
    """Every element this process's devices hold read once; nothing else read (in one process: nothing
    twice, and nothing missing)."""
    mine = np.zeros(shape, bool)
    for spans in _blocks(sharding, shape):
        mine[tuple(slice(a, b) for a, b in spans)] = True
    counts = _read_counts(reads, shape)
    if (counts[~mine] > 0).any():
        fail(
            f"{what}: {int((counts[~mine] > 0).sum())} element(s) read that no device of this process holds",
            "read only what sharding.addressable_devices_indices_map(global_shape) names (rows and "
            "columns): a contiguous range of rows is this process's data only when its devices hold whole "
            "rows",
        )
    if (counts > 1).any():
        fail(
            f"{what}: {int((counts > 1).sum())} element(s) read more than once ({len(reads)} reads)",
            "devices that hold copies of the same block (a replicated axis) need one read, not one each: "
            "jax.make_array_from_callback calls back once per device; read each distinct block (or one "
            "range covering exactly this process's blocks) once, then jax.device_put it to every device "
            "that needs it",
        )
    if (counts[mine] == 0).any():
        fail(f"{what}: some rows were never read", "read every block of the index map")


def _spans(index, shape) -> tuple:
    return tuple(
        (s.start or 0, size if s.stop is None else s.stop) for s, size in zip(index, shape)
    )


def _overlap(a: tuple, b: tuple) -> bool:
    return all(max(x[0], y[0]) < min(x[1], y[1]) for x, y in zip(a, b))


def _judge_other_process(fn: Callable) -> None:
    """In one process every block is this process's; on stand-in devices of 2 processes (2 each) only
    process 0's are. The loader cannot build an array there, so only what it read before failing counts."""
    # process 1's devices first: a loader that walks every device's block reads one of theirs first
    devices = np.array(
        [GroupDevice(d.id, d.process_index) for d in fake_devices(2, 2, False)][::-1]
    )
    shape = (8, 4)
    grid = devices.reshape(2, 2)
    interleaved = np.array(
        [GroupDevice(d.id, d.process_index) for d in fake_devices(2, 2, True, ids="interleaved")]
    )
    for what, sharding in (
        ("rows over data", NamedSharding(Mesh(devices, (DATA,)), P(DATA))),
        (
            "rows over data, the processes' devices alternating along the mesh",
            NamedSharding(Mesh(interleaved, (DATA,)), P(DATA)),
        ),
        (
            "a 2 x 2 grid, a process per data row",
            NamedSharding(Mesh(grid, (DATA, MODEL)), P(DATA, MODEL)),
        ),
        (
            "a 2 x 2 grid, a process per model column",
            NamedSharding(Mesh(grid.T, (DATA, MODEL)), P(DATA, MODEL)),
        ),
    ):
        source = RecordingSource(np.zeros(shape, np.float32))
        try:
            fn(source, sharding, shape)
        except Exception:  # noqa: BLE001 - stand-in devices hold no data; the reads are what is judged
            pass
        mine = _blocks(sharding, shape)
        theirs = {_spans(i, shape) for i in sharding.devices_indices_map(shape).values()} - mine
        extra = [r for r in source.reads if any(_overlap(r, b) for b in theirs)]
        if extra:
            fail(
                f"in a group of 2 processes ({what}), process 0 read rows/columns {extra[0]}, part of which "
                "only process 1's devices hold",
                "sharding.devices_indices_map (and np.asarray(source)) cover every process's devices; read "
                "only the blocks of sharding.addressable_devices_indices_map(global_shape), this process's "
                "own — one larger read (a range of rows, a bounding box) is this process's data only when "
                "its blocks are contiguous and its devices hold whole rows",
            )


def _judge_host_memory(fn: Callable) -> None:
    """On stand-in devices of 8 processes (one each) process 0 holds an eighth of the batch: the host
    memory the loader allocates (``tracemalloc``'s peak, NumPy's buffers included) must stay near that
    eighth, not the global batch's size."""
    devices = np.array([GroupDevice(p, p) for p in range(8)])
    shape = (64, 512)  # 128 KiB of float32; process 0's rows: 16 KiB
    sharding = NamedSharding(Mesh(devices, (DATA,)), P(DATA))
    source = RecordingSource(np.zeros(shape, np.float32))
    whole, mine = int(np.prod(shape)) * 4, int(np.prod(shape)) * 4 // 8
    tracemalloc.start()
    try:
        fn(source, sharding, shape)
    except Exception:  # noqa: BLE001 - stand-in devices hold no data; the allocation is what is judged
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    if peak > mine * 4 + 16 * 1024:
        fail(
            f"in a group of 8 processes, process 0 holds {mine // 1024} KiB of a {whole // 1024} KiB batch, "
            f"and the loader allocated {peak // 1024} KiB on the host",
            "a per-process loader never holds the global batch on a host: put each block read on its "
            "devices (jax.device_put(block, device)) and assemble the global array from them with "
            "jax.make_array_from_single_device_arrays",
        )


def check_block_loader(fn: Callable, devices: Sequence[Any]) -> int:
    """Judge a loader of a global batch from a memory-mapped source (exercise 3).

    Spec: ``fn(source, sharding, global_shape)`` returns the global ``jax.Array`` of ``global_shape`` laid
    out by ``sharding`` with the source's values, and reads from ``source`` every element this process's
    devices hold (``sharding.addressable_devices_indices_map``) exactly once and no other element — one read
    per distinct block, or fewer, larger reads that cover exactly the same elements. Judged on four layouts
    of the notebook's devices (rows over data; rows with copies over model; rows and columns; replicated),
    where the process holds everything, and on stand-in devices of 2 processes (:func:`_judge_other_process`:
    rows over data, the same with the processes' devices alternating so that a process's blocks are not
    contiguous, a 2 × 2 grid whose data rows are one process's, and one whose columns are), where a read of
    another process's elements shows; and on stand-in devices of 8 processes, where the host memory the
    loader allocates must stay near this process's share (:func:`_judge_host_memory`: no host copy of the
    global batch).
    """
    n_data, n_model = choose_mesh_shape(len(devices))
    shape = (4 * len(devices), 2 * n_model)
    data = np.random.default_rng(9).normal(size=shape).astype(np.float32)
    for what, sharding in _loader_cases(devices):
        source = RecordingSource(data)
        out = _call(
            f"load_global_batch(source, sharding, {shape}) with {what}",
            fn,
            source,
            sharding,
            shape,
            hint="read source[index] once per distinct index of sharding.addressable_devices_indices_map, "
            "put each block on the devices that need it, jax.make_array_from_single_device_arrays",
        )
        if not isinstance(out, jax.Array) or out.shape != shape:
            fail(
                f"{what}: returned {type(out).__name__} of shape {getattr(out, 'shape', None)}",
                f"return one global jax.Array of shape {shape}",
            )
        if not out.sharding.is_equivalent_to(sharding, len(shape)):
            fail(
                f"{what}: the result is laid out as {out.sharding}",
                "lay the result out by the sharding given",
            )
        if not np.array_equal(np.asarray(out), data):
            fail(
                f"{what}: the values differ from the source",
                "each device must hold source[index] for its own index; keep the device order of the index map "
                "when you assemble",
            )
        _judge_reads(what, source.reads, sharding, shape)
    _judge_other_process(fn)
    _judge_host_memory(fn)
    return len(_loader_cases(devices))

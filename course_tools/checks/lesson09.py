"""Checkers for ``09_multihost.ipynb``: which rows each process loads under three mesh layouts (predict, then
run), a process-aware device order for a ``data × model`` mesh, and a loader that reads each block of a
global batch once.

They run in the notebook's one process. Exercise 1 measures a group of processes by splitting the kernel's
devices into consecutive groups, one per process, the way ``jax.devices()`` orders a real group on CPU and
GPU; exercise 2 uses stand-in devices that carry a ``process_index``; exercise 3 hands the loader a source
that records what is read, also with a sharding over stand-in devices of 2 processes (process 0's are
this process's), where reading another process's blocks shows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import P
from jax.sharding import Mesh, NamedSharding

from course_lib.meshes import DATA, MODEL, choose_mesh_shape, data_mesh, data_model_mesh

from ._common import NotWritten, call_answer, checker, fail, not_written, passed


def _call(what: str, fn: Callable, *args, hint: str):
    """``call_answer`` with this exercise's own "not written yet" hint."""
    try:
        return call_answer(what, fn, *args)
    except NotWritten:
        not_written(what, hint)


# ---- exercise 1: predict each process's rows ---------------------------------------------------------------

LAYOUTS = ("a", "b", "c")
"""a: a ``data`` mesh over ``jax.devices()``; b: a ``data × model`` mesh over ``jax.devices()``; c: the same
``data × model`` mesh built from the devices in transposed order."""


def layout_mesh(name: str, devices: Sequence[Any]):
    """The mesh of layout ``name`` (see :data:`LAYOUTS`) on ``devices``."""
    if name == "a":
        return data_mesh(devices, axis_type="explicit")
    n_data, n_model = choose_mesh_shape(len(devices))
    if name == "b":
        return data_model_mesh(devices, (n_data, n_model), axis_type="explicit")
    order = np.array(list(devices), dtype=object).reshape(n_model, n_data).T.ravel()
    return data_model_mesh(list(order), (n_data, n_model), axis_type="explicit")


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [tuple(s) for s in out]


def measure_process_rows(
    name: str, devices: Sequence[Any], n_processes: int, global_batch: int
) -> list:
    """Rows of a ``global_batch`` split over ``data`` that each of ``n_processes`` processes holds under layout
    ``name``: ``[(start, stop), ...]`` per process (one pair when contiguous), read from JAX's own
    ``devices_indices_map``, process ``p`` owning the ``p``-th block of consecutive devices."""
    devices = list(devices)
    local = len(devices) // n_processes
    index_map = NamedSharding(layout_mesh(name, devices), P(DATA)).devices_indices_map(
        (global_batch,)
    )
    out = []
    for p in range(n_processes):
        spans = []
        for d in devices[p * local : (p + 1) * local]:
            s = index_map[d][0]
            spans.append((s.start or 0, global_batch if s.stop is None else s.stop))
        merged = _merge(spans)
        out.append(merged[0] if len(merged) == 1 else merged)
    return out


_WHY_ROWS = {
    "a": "the data axis runs over jax.devices(), process 0's devices first: each process holds one contiguous "
    "block of global_batch / n_processes rows",
    "b": "model varies fastest along jax.devices(), so a model group is neighbouring devices of one process and "
    "a process holds whole data rows of the mesh: with data >= n_processes, still one contiguous block per "
    "process",
    "c": "transposed, a model group takes one device from each process, so every process holds a device in each "
    "data block: each process must load every row it has a device for — here, all of them",
}


def _as_rows(value: Any):
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(v, (int, np.integer)) for v in value)
    ):
        return (int(value[0]), int(value[1]))
    if (
        isinstance(value, (tuple, list))
        and value
        and all(isinstance(v, (tuple, list)) for v in value)
    ):
        merged = _merge([(int(a), int(b)) for a, b in value])
        return merged[0] if len(merged) == 1 else merged
    raise ValueError


@checker
def check_process_rows(
    predictions: dict | None, devices: Sequence[Any], n_processes: int, global_batch: int
) -> bool:
    """``predictions[layout]`` must list, per process, the rows ``(start, stop)`` it holds under each layout."""
    if (
        predictions is None
        or isinstance(predictions, dict)
        and all(v is ... for v in predictions.values())
    ):
        not_written(
            "your predictions", "give each process's rows as (start, stop), e.g. [(0, 8), (8, 16)]"
        )
    if not isinstance(predictions, dict) or set(predictions) != set(LAYOUTS):
        fail(
            f"predictions has keys {sorted(predictions) if isinstance(predictions, dict) else type(predictions)}",
            f"give a dict with exactly the keys {list(LAYOUTS)}",
        )
    for name in LAYOUTS:
        want = measure_process_rows(name, devices, n_processes, global_batch)
        try:
            got = [_as_rows(v) for v in predictions[name]]
        except (TypeError, ValueError):
            fail(
                f"prediction {name!r} is {predictions[name]!r}",
                f"give a list of {n_processes} pair(s) (start, stop), one per process, stop exclusive",
            )
        if len(got) != n_processes:
            fail(
                f"prediction {name!r} has {len(got)} entries for {n_processes} process(es)",
                "one pair per process",
            )
        if got != want:
            fail(
                f"layout {name!r}: you predicted {got}, the processes hold {want} "
                f"({n_processes} x {len(devices) // n_processes} devices, batch {global_batch})",
                _WHY_ROWS[name],
            )
    note = (
        ""
        if n_processes > 1
        else " (one process holds every row: run with an even n_devices to see a split)"
    )
    return passed(f"the rows of all {len(LAYOUTS)} layouts match JAX's index maps{note}")


# ---- exercise 2: a device order that keeps every model group inside one process -------------------------


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """Stands for a ``jax.Device`` of a multi-process run: a global ``id`` and the ``process_index`` owning it."""

    id: int
    process_index: int
    platform: str = "cpu"
    device_kind: str = "cpu"

    def __repr__(self) -> str:
        return f"dev{self.id}@p{self.process_index}"


def fake_devices(
    n_processes: int, local: int, interleave: bool = True, seed: int = 0
) -> list[FakeDevice]:
    """``n_processes × local`` stand-in devices; ``interleave`` lists them round-robin over processes and
    shuffles each process's ids (a listing order a launcher or a sort by another key can give you)."""
    rng = np.random.default_rng(seed)
    per = [
        [FakeDevice(p * 1000 + int(k), p) for k in rng.permutation(local)]
        for p in range(n_processes)
    ]
    if not interleave:
        return [d for devs in per for d in sorted(devs, key=lambda d: d.id)]
    return [per[p][k] for k in range(local) for p in range(n_processes)]


_MESH_CASES = [(2, 4, 4, 2), (4, 2, 4, 2), (2, 4, 2, 4), (2, 2, 4, 1), (3, 2, 3, 2), (1, 4, 2, 2)]


@checker
def check_mesh_devices(fn: Callable) -> bool:
    """``fn(devices, n_data, n_model)`` must return a ``[n_data, n_model]`` array of the devices in which every
    model group (a row) lies inside one process, process 0's rows first, each process's devices in id order."""
    for P_, local, n_data, n_model in _MESH_CASES:
        devs = fake_devices(P_, local, seed=P_ * 10 + local)
        case = f"{P_} processes x {local} devices as [{n_data}, {n_model}]"
        got = _call(
            f"mesh_devices(devices, {n_data}, {n_model})",
            fn,
            list(devs),
            n_data,
            n_model,
            hint="order the devices so that each row of the [n_data, n_model] array is one process's",
        )
        got = np.asarray(got, dtype=object)
        if got.shape != (n_data, n_model):
            fail(
                f"{case}: shape {got.shape}, expected {(n_data, n_model)}",
                "reshape to (n_data, n_model)",
            )
        if sorted(d.id for d in got.ravel()) != sorted(d.id for d in devs):
            fail(
                f"{case}: not every device appears exactly once",
                "reorder the devices, don't drop or repeat any",
            )
        procs = np.vectorize(lambda d: d.process_index)(got)
        spans = [sorted(set(row)) for row in procs.tolist() if len(set(row)) > 1]
        if spans:
            fail(
                f"{case}: a model group spans processes {spans[0]} (rows of the mesh: {got.tolist()})",
                "the model axis communicates every layer: keep each row inside one process (host). Sort the "
                "devices by (process_index, id) before reshaping; reshaping to (n_model, n_data) and transposing "
                "puts neighbours on different rows",
            )
        firsts = procs[:, 0].tolist()
        if firsts != sorted(firsts):
            fail(
                f"{case}: rows are not in process order ({firsts})",
                "put process 0's devices first: each process then owns one contiguous block of the batch",
            )
        ids = [d.id for d in got.ravel()]
        if ids != sorted(ids):
            fail(
                f"{case}: inside a process the devices are not in id order",
                "sort by (process_index, id): neighbouring ids are usually the best-connected devices",
            )
    return passed(
        f"all {len(_MESH_CASES)} layouts keep every model group inside one process, in process order "
        "(JAX's mesh_utils.create_hybrid_device_mesh(..., process_is_granule=True) builds such meshes)"
    )


def exercise_group(devices: Sequence[Any], n_processes: int) -> tuple[list, int]:
    """The devices and process count exercise 1 is set on: the run's plan when it has 2 processes or more,
    else a simulated group of 2 processes x 2 devices (:class:`FakeDevice`; JAX's index maps accept them),
    so that the rows differ between processes whatever the kernel's device count."""
    if n_processes > 1:
        return list(devices), n_processes
    return fake_devices(2, 2, interleave=False), 2


# ---- exercise 3: read each block of a global batch once ----------------------------------------------------


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


@checker
def check_block_loader(fn: Callable, devices: Sequence[Any]) -> bool:
    """``fn(source, sharding, global_shape)`` must return the global array laid out by ``sharding``, reading
    from ``source`` exactly the distinct blocks this process's devices hold, each once."""
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
        blocks = _blocks(sharding, shape)
        reads = source.reads
        full = tuple((0, s) for s in shape)
        if full in reads and full not in blocks:
            fail(
                f"{what}: the whole source was read",
                "in a group of processes each reads only what its own devices hold: read source[index] for the "
                "blocks of sharding.addressable_devices_indices_map(global_shape), not np.asarray(source)",
            )
        extra = [r for r in reads if r not in blocks]
        if extra:
            fail(
                f"{what}: {len(extra)} read(s) are not blocks of this process's devices, e.g. rows/columns {extra[0]}",
                "read exactly the blocks the index map names (rows and columns): a contiguous range of local rows "
                "is not one when a process's devices hold non-neighbouring blocks",
            )
        if len(reads) > len(blocks):
            fail(
                f"{what}: {len(reads)} reads for {len(blocks)} distinct block(s)",
                "devices that hold copies of the same block (a replicated axis) need one read, not one each: "
                "jax.make_array_from_callback calls back once per device; read each distinct index once, "
                "then jax.device_put the block to every device that needs it",
            )
        if len(set(reads)) < len(blocks):
            fail(
                f"{what}: some blocks were never read", "read every distinct block of the index map"
            )
    _judge_other_process(fn)
    return passed(
        f"all {len(_loader_cases(devices))} layouts assembled with each distinct block read once, and "
        "only this process's blocks read in a simulated group of 2 processes"
    )


class _Client:
    def process_index(self) -> int:  # the process the check plays: 0
        return 0


@dataclasses.dataclass(frozen=True)
class _GroupDevice(FakeDevice):
    """A :class:`FakeDevice` JAX can ask for addressability: process 0's devices are this process's."""

    @property
    def client(self) -> _Client:
        return _Client()


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
        [_GroupDevice(d.id, d.process_index) for d in fake_devices(2, 2, False)][::-1]
    )
    shape = (8, 4)
    for what, sharding in (
        ("rows over data", NamedSharding(Mesh(devices, (DATA,)), P(DATA))),
        ("a 2 x 2 grid", NamedSharding(Mesh(devices.reshape(2, 2), (DATA, MODEL)), P(DATA, MODEL))),
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
                f"in a group of 2 processes ({what}), process 0 read rows/columns {extra[0]}, which only "
                "process 1's devices hold",
                "sharding.devices_indices_map covers every process's devices; read the blocks of "
                "sharding.addressable_devices_indices_map(global_shape), this process's own",
            )

"""Checkers for ``09_multihost.ipynb``: a process's rows of the global batch, a process-aware device order
for the mesh, and assembling a global batch from process-local data.

They run in one process (the notebook's kernel); the multi-process behaviour they stand for is exercised by
:mod:`course_lib.distributed` and ``tests/test_launcher.py``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any
from unittest import mock

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from course_lib.distributed import local_rows
from course_lib.meshes import DATA, data_mesh

from ._common import as_ints, checker, fail, passed
from ._common import call_answer as _call

# ---- exercise 1: which rows does a process load? ---------------------------------------------------------

_ROW_CASES = [(32, 2, 0), (32, 2, 1), (24, 3, 2), (8, 1, 0), (12, 4, 3), (64, 8, 5)]


def rows_held(global_batch: int, n_processes: int, process_index: int, devices: Sequence[Any]):
    """The rows the devices of process ``process_index`` hold when ``n_processes`` processes of k devices
    each split a batch over a ``data`` mesh, k as large as ``devices`` and the batch allow; None when
    ``devices`` are fewer than the processes. Read from the sharding itself (its ``devices_indices_map``)."""
    fits = [
        k
        for k in range(1, len(devices) // n_processes + 1)
        if global_batch % (n_processes * k) == 0
    ]
    if not fits:
        return None
    k = max(fits)
    group = list(devices)[: n_processes * k]
    sharding = NamedSharding(data_mesh(group), P(DATA))
    mine = group[process_index * k : (process_index + 1) * k]
    return local_rows(sharding, (global_batch,), devices=mine)


@checker
def check_process_rows(fn: Callable) -> bool:
    """``fn(global_batch, n_processes, process_index)`` must return ``(start, stop)``, stop exclusive, and raise
    ``ValueError`` when the batch does not split evenly over the processes.

    The expected rows are those a process's devices really hold under a data-parallel sharding
    (:func:`rows_held`), on this kernel's devices: a case needs at least as many devices as processes."""
    cases = [(case, rows_held(*case, jax.devices())) for case in _ROW_CASES]
    cases = [(case, want) for case, want in cases if want is not None]
    for case, want in cases:
        got = _call(f"process_rows{case}", fn, *case)
        got = as_ints(f"process_rows{case}", got, "return a pair of ints (start, stop)")
        if got == want:
            continue
        msg = f"process_rows{case} returned {got}, expected {want}"
        B, n, i = case
        if len(got) == 2 and got[1] == want[1] - 1:
            fail(msg, "stop is exclusive, like a Python slice: rows start, start+1, …, stop-1")
        if len(got) == 2 and got[1] - got[0] != B // n:
            fail(
                msg,
                f"a process loads global_batch // n_processes rows ({B // n} here), not one device's share",
            )
        fail(
            msg,
            "process p owns the p-th contiguous block: start = p * (global_batch // n_processes)",
        )
    try:
        bad = fn(30, 4, 0)
    except ValueError:
        pass
    except Exception as e:  # noqa: BLE001
        fail(
            f"process_rows(30, 4, 0) raised {type(e).__name__}",
            "raise ValueError naming the numbers",
        )
    else:
        fail(
            f"process_rows(30, 4, 0) returned {bad!r}: 30 rows do not split over 4 processes",
            "raise ValueError when global_batch % n_processes != 0; every process must load the same number of rows",
        )
    return passed(f"all {len(cases)} cases right, and an uneven split raises ValueError")


# ---- exercise 2: a device order for the mesh that respects processes ---------------------------------------


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """Stands for a ``jax.Device`` of a multi-process run: a global ``id`` and the ``process_index`` owning it."""

    id: int
    process_index: int

    def __repr__(self) -> str:
        return f"dev{self.id}@p{self.process_index}"


def fake_devices(n_processes: int, local: int, interleave: bool = True) -> list[FakeDevice]:
    """``n_processes × local`` fake devices; ``interleave`` lists them round-robin over processes (a listing
    order a launcher or a sort by another key can give you)."""
    devs = [FakeDevice(p * 1000 + k, p) for p in range(n_processes) for k in range(local)]
    if interleave:
        devs = [devs[p * local + k] for k in range(local) for p in range(n_processes)]
    return devs


def reference_mesh_devices(devices: Sequence[Any], n_data: int, n_model: int) -> np.ndarray:
    """Devices sorted by (process, id), laid out [n_data, n_model]: a model group never spans processes."""
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return np.array(ordered, dtype=object).reshape(n_data, n_model)


_MESH_CASES = [(2, 4, 4, 2), (4, 2, 4, 2), (2, 4, 2, 4), (2, 2, 4, 1)]


@checker
def check_mesh_devices(fn: Callable) -> bool:
    """``fn(devices, n_data, n_model)`` must return a ``[n_data, n_model]`` array of the devices in which every
    model group (a row) lies inside one process, and process 0's rows come first (process-major)."""
    for P_, local, n_data, n_model in _MESH_CASES:
        devs = fake_devices(P_, local)
        case = f"{P_} processes x {local} devices as [{n_data}, {n_model}]"
        got = _call(f"mesh_devices(devices, {n_data}, {n_model})", fn, list(devs), n_data, n_model)
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
                "the model axis communicates every layer: keep each row inside one process (host). Sort the devices "
                "by (process_index, id) before reshaping; reshaping to (n_model, n_data) and transposing puts "
                "neighbours on different rows",
            )
        firsts = procs[:, 0].tolist()
        if firsts != sorted(firsts):
            fail(
                f"{case}: rows are not in process order ({firsts})",
                "put process 0's devices first: each process then owns one contiguous block of the batch",
            )
    return passed(
        f"all {len(_MESH_CASES)} layouts keep every model group inside one process, in process order"
    )


# ---- exercise 3: a global batch from each process's rows ----------------------------------------------------


@checker
def check_to_global_batch(fn: Callable, devices: Sequence[Any]) -> bool:
    """``fn(local_batch, sharding, global_batch)`` must return ``(images, labels)`` as global ``jax.Array``s laid
    out by ``sharding``, built with ``jax.make_array_from_process_local_data`` (in this one-process kernel the
    local rows are the whole batch)."""
    mesh = data_mesh(devices, axis_type="explicit")
    n = len(devices)
    B = 4 * n
    rng = np.random.default_rng(0)
    local = (
        rng.normal(size=(B, 4, 4, 3)).astype(np.float32),
        rng.integers(0, 10, size=(B,)).astype(np.int32),
    )
    sharding = NamedSharding(mesh, P(DATA))
    real = jax.make_array_from_process_local_data
    with mock.patch.object(jax, "make_array_from_process_local_data", wraps=real) as spy:
        out = _call("to_global_batch(local_batch, sharding, global_batch)", fn, local, sharding, B)
    try:
        images, labels = out
    except (TypeError, ValueError):
        fail(f"returned {type(out).__name__}", "return the pair (images, labels)")
    for name, x, ref in (("images", images, local[0]), ("labels", labels, local[1])):
        if not isinstance(x, jax.Array):
            fail(
                f"{name} is a {type(x).__name__}, not a jax.Array",
                "build it with jax.make_array_from_process_local_data",
            )
        if x.shape != ref.shape or not np.array_equal(np.asarray(x), ref):
            fail(
                f"{name}: shape {x.shape} or values differ from the input ({ref.shape})",
                "pass the global shape (global_batch,) + local.shape[1:]; the data itself is not changed",
            )
        if isinstance(x.sharding, NamedSharding) and x.sharding.is_fully_replicated and n > 1:
            fail(
                f"{name}: every device holds the whole batch (replicated)",
                "lay it out by the sharding you were given: its rows are split over the data axis",
            )
        if not x.sharding.is_equivalent_to(sharding, x.ndim):
            fail(
                f"{name} is laid out as {x.sharding}, not by the sharding given",
                "pass the sharding argument to jax.make_array_from_process_local_data",
            )
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        source = ""
    if not spy.called and "make_array_from_process_local_data" not in source:
        fail(
            "the layout is right here, but the function does not use jax.make_array_from_process_local_data",
            "jax.device_put(x, sharding) treats x as the *global* value: across processes each one would claim its "
            "own rows are the whole batch. make_array_from_process_local_data(sharding, local, global_shape) "
            "says 'these are my rows of a bigger array'",
        )
    return passed(f"global batch {jax.typeof(images)} assembled from process-local rows")

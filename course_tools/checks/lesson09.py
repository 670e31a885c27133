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

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax import P
from jax.sharding import NamedSharding

from course_lib.meshes import DATA, choose_mesh_shape, data_mesh, data_model_mesh

from ._common import NotWritten, call_answer, checker, fail, judged_on, not_written, passed
from ._lesson09_group import FakeDevice, fake_devices
from ._lesson09_loader import RecordingSource
from ._lesson09_loader import check_block_loader as _check_block_loader


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


_HOW_ROWS = (
    "a device's rows follow from its coordinate on the data axis: the mesh's i-th data index holds rows "
    "[i·B/n_data, (i+1)·B/n_data), and every device along the model axis holds the same rows; a process "
    "holds the union of its devices' rows — one contiguous block when its devices share neighbouring data "
    "indices, every row it has a device for otherwise. Process p owns the p-th block of ex_local "
    "consecutive devices of the list; find each device's position in the mesh's device array"
)


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
    """Judge predicted rows per process under the layouts of :data:`LAYOUTS` (exercise 1).

    Spec: ``predictions[layout]`` lists, for each of ``n_processes`` processes (process ``p`` owning the
    ``p``-th block of consecutive ``devices``), the rows ``(start, stop)`` of a ``global_batch`` split over
    ``data`` that its devices hold (several pairs where they are not contiguous), equal to what JAX's own
    index map (``devices_indices_map``) gives. A wrong answer is told how many layouts are wrong, never which.
    """
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
    wrong = 0
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
        wrong += got != want
    if wrong:
        fail(
            f"{wrong} of your {len(LAYOUTS)} predictions differ from the rows the processes hold "
            f"({n_processes} x {len(devices) // n_processes} devices, batch {global_batch})",
            _HOW_ROWS,
        )
    note = (
        ""
        if n_processes > 1
        else " (one process holds every row: run with an even n_devices to see a split)"
    )
    return passed(f"the rows of all {len(LAYOUTS)} layouts match JAX's index maps{note}")


# ---- exercise 2: a device order that keeps every model group inside one process -------------------------


_MESH_CASES = [
    (2, 4, 4, 2, "grouped"),
    (4, 2, 4, 2, "interleaved"),
    (2, 4, 2, 4, "random"),
    (2, 2, 4, 1, "interleaved"),
    (3, 2, 3, 2, "random"),
    (1, 4, 2, 2, "random"),
]
"""``(processes, devices per process, n_data, n_model, ids)``: ids grouped by process, interleaved across
processes, or random (:func:`fake_devices`)."""


@checker
def check_mesh_devices(fn: Callable) -> bool:
    """Judge a process-aware device order for a ``data × model`` mesh (exercise 2).

    Spec: ``fn(devices, n_data, n_model)`` returns a ``[n_data, n_model]`` array holding every device once,
    in which every row (a model group) lies inside one process, the rows in process order (process 0's
    first) and each process's devices in id order, for every case of :data:`_MESH_CASES`: the devices
    arrive interleaved across processes and shuffled within each, the list starting with a device of the
    last process, and their ids are grouped by process in
    one case only (elsewhere interleaved or random, so sorting by id alone does not group the processes).
    """
    for P_, local, n_data, n_model, ids in _MESH_CASES:
        devs = fake_devices(P_, local, seed=P_ * 10 + local, ids=ids)
        if P_ > 1:  # the list starts with a device of the last process, not of process 0
            first = next(k for k, d in enumerate(devs) if d.process_index == P_ - 1)
            devs = [devs[first], *devs[:first], *devs[first + 1 :]]
        case = f"{P_} processes x {local} devices ({ids} ids) as [{n_data}, {n_model}]"
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
        in_order = all(
            (ids := [d.id for d in got.ravel() if d.process_index == q]) == sorted(ids)
            for q in range(P_)
        )
        if not in_order:
            fail(
                f"{case}: inside a process the devices are not in id order",
                "sort by (process_index, id): neighbouring ids are usually the best-connected devices",
            )
    return passed(
        f"all {len(_MESH_CASES)} layouts keep every model group inside one process, in process order "
        "(JAX's mesh_utils.create_hybrid_device_mesh(..., process_is_granule=True), given the devices "
        "sorted by id, builds such meshes)"
    )


def exercise_group(devices: Sequence[Any], n_processes: int) -> tuple[list, int]:
    """The devices and process count exercise 1 is set on: the run's plan when it has 2 processes or more,
    else a simulated group of 2 processes x 2 devices (:class:`FakeDevice`; JAX's index maps accept them),
    so that the rows differ between processes whatever the kernel's device count."""
    if n_processes > 1:
        return list(devices), n_processes
    return fake_devices(2, 2, interleave=False), 2


# ---- exercise 3: read each block of a global batch once ----------------------------------------------------


@checker
@judged_on(
    4,
    "below 4 devices no layout puts copies of a block on some devices but not all, where reading once "
    "per device instead of once per block shows, and one device shows no block put on a wrong device",
)
def check_block_loader(fn: Callable, devices: Sequence[Any]) -> bool:
    """Exercise 3; the spec is :func:`course_tools.checks._lesson09_loader.check_block_loader`'s."""
    n_layouts = _check_block_loader(fn, devices)
    return passed(
        f"all {n_layouts} layouts assembled with every element of this process's blocks read once, and "
        "only this process's elements read in a simulated group of 2 processes"
    )


__all__ = ["FakeDevice", "RecordingSource", "fake_devices"]

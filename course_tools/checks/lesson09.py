"""Checkers for ``09_multihost.ipynb``: which rows each process loads under three mesh layouts (predict, then
run), a process-aware device order for a ``data × model`` mesh (or a ``ValueError`` where no order keeps
the model groups off the network between processes), and a loader that reads each block of a
global batch once.

They run in the notebook's one process. Exercise 1 measures a simulated group of 4 processes x 2 stand-in
devices (:func:`exercise_group`), split into consecutive blocks, one per process, the way ``jax.devices()``
orders a real group on CPU and GPU; exercise 2 uses stand-in devices that carry a ``process_index``;
exercise 3 hands the loader a source that records what is read, also with a sharding over stand-in devices
of 2 processes (process 0's are this process's), where reading another process's blocks shows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax import P
from jax.sharding import NamedSharding

from course_lib.meshes import DATA, choose_mesh_shape, data_mesh, data_model_mesh

from . import _lesson09_mesh as _mesh
from ._common import checker, fail, judged_on, not_written, passed
from ._lesson09_group import FakeDevice, fake_devices
from ._lesson09_loader import RecordingSource
from ._lesson09_loader import check_block_loader as _check_block_loader

# ---- exercise 1: predict each process's rows ---------------------------------------------------------------

LAYOUTS = ("a", "b", "c")
"""a: a ``data`` mesh over ``jax.devices()``; b: a ``data × model`` mesh over ``jax.devices()``; c: the same
``data × model`` mesh built from the devices in transposed order."""


def layout_mesh(name: str, devices: Sequence[Any], mesh_shape: tuple[int, int] | None = None):
    """The mesh of layout ``name`` (see :data:`LAYOUTS`) on ``devices``; ``mesh_shape`` ``(n_data, n_model)``
    for b and c, default :func:`course_lib.meshes.choose_mesh_shape`."""
    if name == "a":
        return data_mesh(devices, axis_type="explicit")
    n_data, n_model = mesh_shape or choose_mesh_shape(len(devices))
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
    name: str,
    devices: Sequence[Any],
    n_processes: int,
    global_batch: int,
    mesh_shape: tuple[int, int] | None = None,
) -> list:
    """Rows of a ``global_batch`` split over ``data`` that each of ``n_processes`` processes holds under layout
    ``name``: ``[(start, stop), ...]`` per process (one pair when contiguous), read from JAX's own
    ``devices_indices_map``, process ``p`` owning the ``p``-th block of consecutive devices; ``mesh_shape`` as
    in :func:`layout_mesh`."""
    devices = list(devices)
    local = len(devices) // n_processes
    index_map = NamedSharding(layout_mesh(name, devices, mesh_shape), P(DATA)).devices_indices_map(
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


class _NotWhole(ValueError):
    """A row bound that is not an integer (the value is in ``args[0]``)."""


def _bound(v: Any) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise _NotWhole(v)
    return int(v)


def _as_rows(value: Any):
    """One process's prediction as ``(start, stop)``, or a list of such pairs (merged) where it holds several
    blocks; a NumPy array is read as the nested lists it holds. Raises ``_NotWhole`` for a bound that is not
    an integer (``8.0``, ``7.5``, ``True``), ``ValueError`` for any other form."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (tuple, list)) or not value:
        raise ValueError
    if all(isinstance(v, (tuple, list)) for v in value):
        if any(len(v) != 2 for v in value):
            raise ValueError
        merged = _merge([(_bound(a), _bound(b)) for a, b in value])
        return merged[0] if len(merged) == 1 else merged
    if len(value) == 2:
        return (_bound(value[0]), _bound(value[1]))
    raise ValueError


@checker
def check_process_rows(
    predictions: dict | None,
    devices: Sequence[Any],
    n_processes: int,
    global_batch: int,
    mesh_shape: tuple[int, int] | None = None,
) -> bool:
    """Judge predicted rows per process under the layouts of :data:`LAYOUTS` (exercise 1).

    Spec: ``predictions[layout]`` lists, for each of ``n_processes`` processes (process ``p`` owning the
    ``p``-th block of consecutive ``devices``), the rows ``(start, stop)`` of a ``global_batch`` split over
    ``data`` that its devices hold (several pairs where they are not contiguous), equal to what JAX's own
    index map (``devices_indices_map``) gives; layouts b and c use ``mesh_shape`` ``(n_data, n_model)``
    (default :func:`course_lib.meshes.choose_mesh_shape`). A pair is two integers (``int`` or a NumPy
    integer; a NumPy integer array of shape ``(n_processes, 2)`` is accepted for a layout). A wrong answer
    is told how many layouts are wrong, never which.

    Raises:
      ExerciseError: a missing layout, a bound that is not an integer (named), another form than pairs, a
        pair count other than ``n_processes``, or wrong rows (how many layouts, not which).
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
        want = measure_process_rows(name, devices, n_processes, global_batch, mesh_shape)
        try:
            got = [_as_rows(v) for v in predictions[name]]
        except _NotWhole as e:
            fail(
                f"prediction {name!r} holds the row bound {e.args[0]!r} ({type(e.args[0]).__name__})",
                "rows are counted in whole numbers: give each bound as an int, e.g. (0, 8), not 8.0",
            )
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
            f"({n_processes} x {len(devices) // n_processes} devices, data x model = "
            f"{mesh_shape or choose_mesh_shape(len(devices))}, batch {global_batch})",
            _HOW_ROWS,
        )
    note = (
        ""
        if n_processes > 1
        else " (one process holds every row: run with an even n_devices to see a split)"
    )
    return passed(f"the rows of all {len(LAYOUTS)} layouts match JAX's index maps{note}")


# ---- exercise 2: a device order that keeps model groups off the network between processes ---------------


@checker
def check_mesh_devices(fn: Callable) -> bool:
    """Judge a process-aware device order for a ``data × model`` mesh (exercise 2).

    Spec: with ``L`` devices per process, ``fn(devices, n_data, n_model)`` returns a ``[n_data, n_model]``
    array holding every device once in which every row (a model group) lies inside one process when
    ``n_model ≤ L``, or is ``n_model / L`` whole, consecutive processes when ``n_model > L``; read row by
    row, the devices are in process order (process 0's first) and each process's in id order. Where no
    such layout exists (``n_model`` neither divides ``L`` nor is a multiple of it) it raises ``ValueError``
    naming ``n_model`` and ``L``. Judged on the cases of
    :data:`course_tools.checks._lesson09_mesh.MESH_CASES` (1 to 8 processes of 1 to 6 devices, three of
    them without a layout): the devices arrive interleaved across processes and shuffled within each, the
    list starting with a device of the last process, their ids grouped by process, interleaved or random.

    Raises:
      ExerciseError: the first case answered wrongly, with a hint; or the answer called ``jax.make_mesh``,
        ``mesh_utils.create_hybrid_device_mesh``, ``mesh_utils.create_device_mesh`` or
        ``group_checkpoint.hybrid_mesh`` (they build such meshes: the exercise is to write one).
    """
    import jax
    from jax.experimental import mesh_utils

    from course_lib import group_checkpoint

    forbidden = (
        jax.make_mesh,
        mesh_utils.create_hybrid_device_mesh,
        mesh_utils.create_device_mesh,
        group_checkpoint.hybrid_mesh,
    )
    n_cases = _mesh.check_mesh_devices(fn, forbidden)
    ici, dcn = _mesh.hybrid_arguments(4, 2, 2, 4)
    return passed(
        f"all {n_cases} cases: every model group inside one process or on whole consecutive processes, in "
        "process order, and a ValueError where no layout exists. JAX's "
        "mesh_utils.create_hybrid_device_mesh(mesh_shape, dcn_mesh_shape, devices sorted by id, "
        "process_is_granule=True) builds the same meshes on these stand-in CPU devices once each axis is "
        "split into a part inside a process and a part across processes (on TPUs it also arranges each "
        f"process's devices by their physical coordinates): 4 processes x 2 devices as [2, 4] is "
        f"mesh_shape={ici}, dcn_mesh_shape={dcn}"
    )


EXERCISE_GROUP = (4, 2, (2, 4))
"""Exercise 1's group: 4 processes x 2 devices, and ``data × model = 2 × 4`` for layouts b and c."""


def exercise_group() -> tuple[list, int, tuple[int, int]]:
    """The group exercise 1 is set on, whatever the kernel's device count: ``(devices, n_processes,
    (n_data, n_model))`` — 8 stand-in devices (:class:`FakeDevice`, in process order; JAX's index maps accept
    them) of 4 simulated processes x 2, with ``data × model = 2 × 4``. A process's 2 devices are fewer than
    ``n_model``, so the three layouts give three different answers (on the kernel's own devices split in two
    processes, a and b coincide at 8 devices, and every layout is the whole batch with one process)."""
    n_processes, local, mesh_shape = EXERCISE_GROUP
    return fake_devices(n_processes, local, interleave=False), n_processes, mesh_shape


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

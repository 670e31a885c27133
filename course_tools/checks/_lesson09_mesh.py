"""Exercise 2 of ``09_multihost.ipynb``: a ``data × model`` device order that keeps model groups off the
network between hosts, or a ``ValueError`` where no order can.

With ``L`` devices per process, a model group of ``n_model`` devices stays inside one process when
``n_model ≤ L`` (then ``n_model`` must divide ``L``), and takes ``n_model / L`` whole, consecutive processes
when ``n_model > L`` (then ``L`` must divide ``n_model``). These are the layouts JAX's
``mesh_utils.create_hybrid_device_mesh`` builds from a per-process mesh (ICI) tiled over a mesh of
processes (DCN); the checker refuses a call to it, and prints the arguments it would take.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from ._common import NotWritten, call_answer, fail, not_written
from ._lesson09_group import fake_devices
from ._unaided import unaided

MESH_CASES = [
    (2, 4, 4, 2, "grouped"),
    (4, 2, 4, 2, "interleaved"),
    (2, 4, 2, 4, "random"),
    (2, 2, 4, 1, "interleaved"),
    (3, 2, 3, 2, "random"),
    (1, 4, 2, 2, "random"),
    (4, 2, 2, 4, "interleaved"),  # a model group of 2 whole processes
    (8, 1, 4, 2, "random"),
    (4, 2, 1, 8, "random"),  # one group of every process
    (3, 4, 4, 3, "random"),  # none: groups of 3 do not split 4 devices
    (3, 4, 2, 6, "interleaved"),  # none: groups of 6 do not take whole processes of 4
    (2, 6, 3, 4, "grouped"),  # none: groups of 4 do not split 6 devices
]
"""``(processes, devices per process L, n_data, n_model, ids)``: ids grouped by process, interleaved across
processes, or random (:func:`fake_devices`). The last three have no layout (``mesh_devices`` must raise
``ValueError``); a sort by ``(process_index, id)`` and a reshape gives a mesh there whose groups cross
processes."""


def layout_exists(local: int, n_model: int) -> bool:
    """Whether ``n_model``-device groups can stay inside one process (``n_model ≤ local``: ``n_model``
    divides ``local``) or take whole processes (``n_model > local``: ``local`` divides ``n_model``)."""
    return local % n_model == 0 if n_model <= local else n_model % local == 0


def hybrid_arguments(n_proc: int, local: int, n_data: int, n_model: int) -> tuple:
    """``(mesh_shape, dcn_mesh_shape)`` with which ``create_hybrid_device_mesh(..., process_is_granule=True)``
    builds the layout of a case that has one, given the devices sorted by id: each axis is split into a
    part inside a process (ICI) and a part across processes (DCN)."""
    if n_model <= local:
        return (local // n_model, n_model), (n_proc, 1)
    return (1, local), (n_data, n_model // local)


def _group_problem(procs: np.ndarray, local: int, n_model: int) -> str | None:
    """What is wrong with the model groups (rows of the process-index grid ``procs``), or None."""
    for row in procs.tolist():
        owners = sorted(set(row))
        if n_model <= local and len(owners) > 1:
            return f"a model group spans processes {owners}"
        if n_model > local:
            part = [q for q in owners if row.count(q) != local]
            if part:
                return (
                    f"a model group holds {row.count(part[0])} of process {part[0]}'s {local} devices "
                    f"(processes {owners}): the process serves two groups"
                )
            if owners != list(range(owners[0], owners[0] + len(owners))):
                return f"a model group takes processes {owners}, not consecutive ones"
    return None


_CONSECUTIVE_HINT = (
    "a group of whole processes takes consecutive ones (0 and 1, then 2 and 3): read row by row, the mesh "
    "lists process 0's devices, then process 1's, …, each process's in id order"
)


_GROUP_HINT = (
    "the model axis communicates in every layer: with L devices per process, keep each group inside one "
    "process (n_model ≤ L) or give it n_model / L whole, consecutive processes (n_model > L). Sort the devices "
    "by (process_index, id) before reshaping; reshaping to (n_model, n_data) and transposing puts "
    "neighbours on different rows"
)
_EXISTS_HINT = (
    "before ordering, compare n_model with L, the devices each process owns: groups of n_model must split a "
    "process's L devices exactly (n_model ≤ L) or take whole processes (n_model > L); when neither is "
    "possible, raise ValueError naming n_model and L"
)


def _attempt(fn: Callable, devices: list, n_data: int, n_model: int):
    """``("grid", value)`` or ``("raised", the ValueError)``; other errors propagate to ``call_answer``."""
    try:
        return "grid", fn(devices, n_data, n_model)
    except ValueError as e:
        return "raised", e


def _judge_raise(case: str, err: ValueError, exists: bool, local: int, n_model: int) -> None:
    if exists:
        how = (
            f"each group inside one process ({n_model} divides {local})"
            if n_model <= local
            else f"each group of {n_model // local} whole processes"
        )
        fail(
            f"{case}: raised ValueError({str(err)[:200]!r}) although a layout exists: {how}",
            "raise only when groups of n_model can neither split a process's L devices exactly (n_model ≤ L) "
            "nor take whole processes (n_model > L)",
        )
    named = [v for v in (n_model, local) if not re.search(rf"(?<!\d){v}(?!\d)", str(err))]
    if named:
        fail(
            f"{case}: the ValueError's message {str(err)[:200]!r} does not name n_model ({n_model}) and the "
            f"{local} devices per process",
            "a clear error names the values and the fix, e.g. an n_model that divides L or is a multiple of it",
        )


def _judge_grid(case: str, got, devs: list, shape: tuple, local: int, exists: bool) -> None:
    n_data, n_model = shape
    if got is None or hasattr(got, "axis_names"):
        what = "None" if got is None else "a Mesh"
        fail(
            f"{case}: mesh_devices returned {what}, not an array of devices",
            "return the [n_data, n_model] array of the device objects (a numpy array or nested lists)",
        )
    got = np.asarray(got, dtype=object)
    if got.shape != shape:
        fail(f"{case}: shape {got.shape}, expected {shape}", "reshape to (n_data, n_model)")
    given = {id(d) for d in devs}
    strays = [x for x in got.ravel() if id(x) not in given]
    if strays:
        stray = strays[0]
        fail(
            f"{case}: the mesh holds {stray!r} ({type(stray).__name__}), not one of the devices given",
            "fill the array with the device objects themselves (not their ids), each once",
        )
    if sorted(d.id for d in got.ravel()) != sorted(d.id for d in devs):
        fail(
            f"{case}: not every device appears exactly once",
            "reorder the devices, don't drop or repeat any",
        )
    procs = np.vectorize(lambda d: d.process_index)(got)
    problem = _group_problem(procs, local, n_model)
    if not exists:
        fail(
            f"{case}: no layout keeps the model groups off the network between processes, but mesh_devices "
            f"returned one{f' in which {problem}' if problem else ''}",
            _EXISTS_HINT,
        )
    if problem:
        hint = _CONSECUTIVE_HINT if problem.endswith("not consecutive ones") else _GROUP_HINT
        fail(f"{case}: {problem} (rows of the mesh: {got.tolist()})", hint)
    flat = procs.ravel().tolist()
    mixed = next((r for r in procs.tolist() if r != sorted(r)), None)
    if mixed is not None:
        fail(
            f"{case}: along a row the devices' processes run {mixed}: a group's devices are not listed "
            "process by process",
            _CONSECUTIVE_HINT,
        )
    if flat != sorted(flat):
        fail(
            f"{case}: rows are not in process order ({procs[:, 0].tolist()})",
            "put process 0's devices first: each process then owns one contiguous block of the batch",
        )
    ids = [d.id for d in got.ravel()]
    if any(a > b for a, b, p, q in zip(ids, ids[1:], flat, flat[1:]) if p == q):
        fail(
            f"{case}: inside a process the devices are not in id order",
            "sort by (process_index, id): neighbouring ids are usually the best-connected devices",
        )


def check_mesh_devices(fn: Callable, forbidden: tuple) -> int:
    """Judge ``fn(devices, n_data, n_model)`` on every case of :data:`MESH_CASES` (the spec:
    ``course_tools.checks.lesson09.check_mesh_devices``), refusing a call to any of ``forbidden``.

    Returns:
      The number of cases judged.

    Raises:
      ExerciseError: the first case answered wrongly, with a hint.
    """
    for n_proc, local, n_data, n_model, ids in MESH_CASES:
        devs = fake_devices(n_proc, local, seed=n_proc * 10 + local + n_model, ids=ids)
        if n_proc > 1:  # the list starts with a device of the last process, not of process 0
            first = next(k for k, d in enumerate(devs) if d.process_index == n_proc - 1)
            devs = [devs[first], *devs[:first], *devs[first + 1 :]]
        case = f"{n_proc} processes x {local} devices ({ids} ids) as [{n_data}, {n_model}]"
        what = f"mesh_devices(devices, {n_data}, {n_model})"
        exists = layout_exists(local, n_model)

        def explain(e, what=what):
            return (
                f"{what} raised {type(e).__name__}: {str(e)[:200]}",
                "where no layout exists raise ValueError (the error for a value that cannot work), "
                "naming n_model and L",
            )

        try:
            with unaided(
                what,
                forbidden,
                "build the order yourself from d.process_index and d.id and reshape it with numpy "
                "(jax.make_mesh and mesh_utils may reorder the devices they are given, by the chips' "
                "physical layout on TPUs); the check prints the create_hybrid_device_mesh arguments once "
                "you pass",
            ):
                kind, got = call_answer(
                    what,
                    _attempt,
                    fn,
                    list(devs),
                    n_data,
                    n_model,
                    explain=None if exists else explain,
                )
        except NotWritten:
            not_written(
                what,
                "find L, the devices per process, and whether groups of n_model fit it; then order the "
                "devices so that, read row by row, they run process by process",
            )
        if kind == "raised":
            _judge_raise(case, got, exists, local, n_model)
            continue
        _judge_grid(case, got, devs, (n_data, n_model), local, exists)
    return len(MESH_CASES)

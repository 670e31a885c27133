"""Exercise 2 of lesson 09 (course_tools.checks.lesson09.check_mesh_devices): a device order that keeps
model groups inside a process or on whole consecutive processes, and a ValueError where none can. The
checker accepts the reference and another correct form, refuses the typical wrong answers with a specific
hint, and refuses JAX's own helper, which builds every layout the spec asks for (asserted here)."""

import numpy as np
import pytest
from checking import not_written, rejects, stub

from course_lib.meshes import choose_mesh_shape
from course_tools.checks import lesson09


def _local(devices):
    return len(devices) // len({d.process_index for d in devices})


def mesh_ref(devices, n_data, n_model):
    local = _local(devices)
    fits = local % n_model == 0 if n_model <= local else n_model % local == 0
    if not fits:
        raise ValueError(
            f"model groups of n_model={n_model} neither split the {local} devices of a process nor "
            "take whole processes: choose an n_model that divides or is a multiple of it"
        )
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return np.array(ordered, dtype=object).reshape(n_data, n_model)


def mesh_by_process(devices, n_data, n_model):
    """Other correct form: each process's devices in id order, then chunks of them or runs of processes."""
    per = {}
    for d in devices:
        per.setdefault(d.process_index, []).append(d)
    local = len(devices) // len(per)
    if max(local, n_model) % min(local, n_model):
        raise ValueError(f"{n_model} devices per group vs {local} per process")
    flat = [d for p in sorted(per) for d in sorted(per[p], key=lambda d: d.id)]
    return [flat[i : i + n_model] for i in range(0, len(flat), n_model)]


def sort_only(devs, d, m):  # the exercise's earlier answer: never raises
    return np.array(sorted(devs, key=lambda x: (x.process_index, x.id)), dtype=object).reshape(d, m)


def raises_when_larger(devices, n_data, n_model):
    """Wrong: a model group larger than a process is refused, though whole processes can hold it."""
    if n_model > _local(devices) or _local(devices) % n_model:
        raise ValueError(f"n_model={n_model} does not fit in {_local(devices)} devices")
    return sort_only(devices, n_data, n_model)


def raises_only_when_smaller(devices, n_data, n_model):
    """Wrong: checks the split of one process only; groups of 6 on processes of 4 share a process."""
    if n_model <= _local(devices) and _local(devices) % n_model:
        raise ValueError(f"n_model={n_model} does not divide {_local(devices)}")
    return sort_only(devices, n_data, n_model)


def raises_without_numbers(devices, n_data, n_model):
    try:
        return mesh_ref(devices, n_data, n_model)
    except ValueError:
        raise ValueError("no such layout") from None


def processes_strided(devices, n_data, n_model):
    """Wrong: a group of whole processes takes every n_data-th process, not consecutive ones."""
    local = _local(devices)
    if n_model <= local:
        return mesh_ref(devices, n_data, n_model)
    grid = sort_only(devices, n_data * n_model // local, local)
    return grid.reshape(n_model // local, n_data, local).transpose(1, 0, 2).reshape(n_data, n_model)


def mesh_hybrid(devices, n_data, n_model):  # JAX's own helper: the layout, but refused by the check
    from jax.experimental import mesh_utils

    ici, dcn = lesson09._mesh.hybrid_arguments(
        len({d.process_index for d in devices}), _local(devices), n_data, n_model
    )
    ordered = sorted(devices, key=lambda d: d.id)
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, ordered, process_is_granule=True)


def mesh_course_helper(devices, n_data, n_model):
    from course_lib import group_checkpoint

    return group_checkpoint.hybrid_mesh(devices).devices.reshape(n_data, n_model)


def test_mesh_devices(monkeypatch, capsys):
    assert lesson09.check_mesh_devices(mesh_ref)
    assert lesson09.check_mesh_devices(mesh_by_process)
    assert lesson09.check_mesh_devices(lambda devs, d, m: [list(r) for r in mesh_ref(devs, d, m)])
    rejects(
        lesson09.check_mesh_devices,
        sort_only,
        match=r"3 processes x 4 devices .* as \[4, 3\]: no layout keeps.*returned one in which a model "
        "group spans processes.*raise ValueError naming n_model and L",
    )
    rejects(
        lesson09.check_mesh_devices,
        raises_when_larger,
        match=r"as \[2, 4\]: raised ValueError.*although a layout exists: each group of 2 whole processes",
    )
    rejects(
        lesson09.check_mesh_devices,
        raises_only_when_smaller,
        match=r"as \[2, 6\]: no layout keeps.*holds 2 of process 1's 4 devices.*serves two groups",
    )
    rejects(lesson09.check_mesh_devices, raises_without_numbers, match="does not name n_model")
    rejects(
        lesson09.check_mesh_devices,
        processes_strided,
        match="processes \\[0, 2\\], not consecutive",
    )
    rejects(
        lesson09.check_mesh_devices,
        mesh_hybrid,
        match="calls mesh_utils.create_hybrid_device_mesh.*build the order yourself",
    )
    rejects(
        lesson09.check_mesh_devices, mesh_course_helper, match="calls group_checkpoint.hybrid_mesh"
    )
    as_listed = lambda devs, d, m: np.array(devs, dtype=object).reshape(d, m)
    rejects(lesson09.check_mesh_devices, as_listed, match="spans processes")
    transposed = lambda devs, d, m: sort_only(devs, m, d).T
    rejects(lesson09.check_mesh_devices, transposed, match="spans processes.*Sort the devices")
    dropped = lambda devs, d, m: np.array(devs[:1] * len(devs), dtype=object).reshape(d, m)
    rejects(lesson09.check_mesh_devices, dropped, match="exactly once")
    by_process_only = lambda devs, d, m: np.array(
        sorted(devs, key=lambda x: x.process_index), dtype=object
    ).reshape(d, m)
    rejects(lesson09.check_mesh_devices, by_process_only, match="id order")
    by_id_only = lambda devs, d, m: np.array(
        sorted(devs, key=lambda x: x.id), dtype=object
    ).reshape(d, m)
    rejects(lesson09.check_mesh_devices, by_id_only, match="interleaved ids.*spans processes")
    reverse = lambda devs, d, m: np.array(
        sorted(devs, key=lambda x: (-x.process_index, x.id)), dtype=object
    ).reshape(d, m)
    rejects(lesson09.check_mesh_devices, reverse, match="process order")
    rejects(lesson09.check_mesh_devices, mesh_first_appearance, match="process order")
    not_written(lesson09.check_mesh_devices, stub, monkeypatch=monkeypatch, capsys=capsys)


def mesh_first_appearance(devices, n_data, n_model):
    """Wrong: processes ordered by where their first device appears in the list, not by index."""
    seen = []
    for d in devices:
        if d.process_index not in seen:
            seen.append(d.process_index)
    ordered = sorted(devices, key=lambda d: (seen.index(d.process_index), d.id))
    return np.array(ordered, dtype=object).reshape(n_data, n_model)


def _one_left_empty(devs, d, m):
    out = np.empty((d, m), dtype=object)
    for i, dev in enumerate(
        mesh_ref(devs, d, m).ravel()[:-1]
    ):  # off by one: the last cell stays None
        out[i // m, i % m] = dev
    return out


def _rows_by_id(devs, d, m):
    """Right groups of whole processes, but each row re-sorted by id: its processes alternate."""
    return np.array([sorted(r, key=lambda x: x.id) for r in mesh_ref(devs, d, m)], dtype=object)


def _through_make_mesh(devs, d, m):
    import jax

    ordered = np.asarray(mesh_ref(devs, d, m)).ravel().tolist()
    return jax.make_mesh((d, m), ("data", "model"), devices=ordered).devices


def test_mesh_devices_answers_that_are_not_a_mesh_of_the_devices_get_a_hint_not_a_crash():
    check = lesson09.check_mesh_devices
    ids = lambda devs, d, m: np.vectorize(lambda x: x.id)(mesh_ref(devs, d, m))
    rejects(check, ids, match=r"holds 0 \(int\), not one of the devices given.*not their ids")
    rejects(check, _one_left_empty, match=r"holds None \(NoneType\)")
    rejects(check, lambda devs, d, m: None, match="returned None, not an array of devices")
    rejects(check, _rows_by_id, match=r"along a row the devices' processes run \[0, 1, 0, 1\]")
    rejects(
        check, _through_make_mesh, match="calls sharding_impls.make_mesh.*may reorder the devices"
    )


def test_mesh_devices_success_message_names_the_hybrid_arguments(capsys):
    assert lesson09.check_mesh_devices(mesh_ref)
    out = capsys.readouterr().out
    assert "mesh_shape=(1, 2), dcn_mesh_shape=(2, 2)" in out and "devices sorted by id" in out


def test_mesh_devices_hybrid_helper_builds_every_layout_the_spec_asks_for():
    """JAX's helper, given the arguments the check prints, builds the reference's mesh in every case that
    has a layout: the spec is the layout real multi-host meshes use."""
    for n_proc, local, n_data, n_model, ids in lesson09._mesh.MESH_CASES:
        devs = lesson09.fake_devices(n_proc, local, ids=ids)
        if not lesson09._mesh.layout_exists(local, n_model):
            with pytest.raises(ValueError, match=f"n_model={n_model}.* {local} devices"):
                mesh_ref(devs, n_data, n_model)
            continue
        assert (mesh_hybrid(devs, n_data, n_model) == mesh_ref(devs, n_data, n_model)).all()


def test_mesh_devices_reference_on_real_devices(report):
    grid = mesh_ref(report.devices, *choose_mesh_shape(len(report.devices)))
    assert list(grid.ravel()) == list(report.devices)  # one process: jax.devices() order

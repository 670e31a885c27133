"""Exercise checkers of lesson 09 (course_tools.checks.lesson09): each accepts the reference answer and
rejects typical wrong ones with a specific hint (8 simulated CPU devices, from conftest.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from course_lib import distributed
from course_tools.checks import ExerciseError, lesson09


def rejects(check, *args, match):
    with pytest.raises(ExerciseError, match="(?s)" + match):
        check(*args)


def _rows_by_reshape(B, n, i):
    if B % n:
        raise ValueError(f"{B} rows do not split over {n} processes")
    block = np.arange(B).reshape(n, -1)[i]
    return int(block[0]), int(block[-1]) + 1


def test_process_rows():
    assert lesson09.check_process_rows(distributed.process_rows)  # the library's version
    assert lesson09.check_process_rows(_rows_by_reshape)  # another correct form
    per_device = lambda B, n, i: (i * (B // 8), (i + 1) * (B // 8))
    rejects(lesson09.check_process_rows, per_device, match="not one device's share")
    inclusive = lambda B, n, i: (i * (B // n), (i + 1) * (B // n) - 1)
    rejects(lesson09.check_process_rows, inclusive, match="stop is exclusive")
    no_check = lambda B, n, i: (i * (B // n), (i + 1) * (B // n))
    rejects(lesson09.check_process_rows, no_check, match="do not split over 4 processes")


def test_mesh_devices():
    assert lesson09.check_mesh_devices(lesson09.reference_mesh_devices)
    as_listed = lambda devs, d, m: np.array(devs, dtype=object).reshape(d, m)
    rejects(lesson09.check_mesh_devices, as_listed, match="spans processes")
    transposed = lambda devs, d, m: (
        np.array(sorted(devs, key=lambda x: (x.process_index, x.id)), dtype=object).reshape(m, d).T
    )
    rejects(lesson09.check_mesh_devices, transposed, match="spans processes.*Sort the devices")
    dropped = lambda devs, d, m: np.array(devs[:1] * len(devs), dtype=object).reshape(d, m)
    rejects(lesson09.check_mesh_devices, dropped, match="exactly once")


def test_mesh_devices_reference_on_real_devices(report):
    grid = lesson09.reference_mesh_devices(report.devices, 4, 2)
    assert grid.shape == (4, 2) and list(grid.ravel()) == list(
        report.devices
    )  # one process: jax.devices() order


def _good_to_global(local, sharding, global_batch):
    return tuple(
        jax.make_array_from_process_local_data(sharding, x, (global_batch,) + x.shape[1:])
        for x in local
    )


def test_to_global_batch(report):
    assert lesson09.check_to_global_batch(_good_to_global, report.devices)
    assert lesson09.check_to_global_batch(distributed.to_global_batch, report.devices)
    replicated = lambda local, sharding, B: tuple(
        jax.device_put(x, NamedSharding(sharding.mesh, P())) for x in local
    )
    rejects(lesson09.check_to_global_batch, replicated, report.devices, match="whole batch")
    one_device = lambda local, sharding, B: tuple(jnp.asarray(x) for x in local)
    rejects(
        lesson09.check_to_global_batch,
        one_device,
        report.devices,
        match="not by the sharding given",
    )
    device_put = lambda local, sharding, B: tuple(jax.device_put(x, sharding) for x in local)
    rejects(
        lesson09.check_to_global_batch,
        device_put,
        report.devices,
        match="treats x as the \\*global\\* value",
    )


def test_stub_is_rejected(report):
    def stub(*args):
        raise NotImplementedError("Exercise: write this part")

    rejects(lesson09.check_process_rows, stub, match="not written yet")
    rejects(lesson09.check_mesh_devices, stub, match="not written yet")
    rejects(lesson09.check_to_global_batch, stub, report.devices, match="not written yet")

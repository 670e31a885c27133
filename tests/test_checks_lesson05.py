"""Exercise checkers of lesson 05 (course_tools.checks.lesson05): each accepts the reference answer and
rejects typical wrong ones with a specific hint (8 simulated CPU devices, from conftest.py).
"""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from course_lib.meshes import DATA, MODEL
from course_tools.checks import ExerciseError, lesson05


def rejects(check, *args, match):
    with pytest.raises(ExerciseError, match="(?s)" + match):
        check(*args)


def test_place_batch(report):
    assert lesson05.check_place_batch(
        lambda x, mesh: jax.device_put(x, NamedSharding(mesh, P(DATA))), report.devices
    )
    rejects(
        lesson05.check_place_batch,
        lambda x, mesh: jax.device_put(x, NamedSharding(mesh, P())),
        report.devices,
        match="whole batch",
    )
    rejects(
        lesson05.check_place_batch,
        lambda x, mesh: jax.device_put(x, NamedSharding(mesh, P(DATA, MODEL))),
        report.devices,
        match="data only",
    )
    rejects(
        lesson05.check_place_batch,
        lambda x, mesh: jax.device_put(x, NamedSharding(mesh, P(MODEL))),
        report.devices,
        match="'model' axis",
    )


def test_shard_shape_reference_agrees_with_jax(report):
    from course_lib.meshes import data_model_mesh

    mesh = data_model_mesh(report.devices, (4, 2))
    for shape, spec in [
        ((8, 6), P(DATA)),
        ((8, 6), P(DATA, MODEL)),
        ((16, 4), P((DATA, MODEL))),
        ((8, 4), P(None, MODEL)),
    ]:
        want = NamedSharding(mesh, spec).shard_shape(shape)
        assert lesson05.reference_shard_shape(shape, spec, dict(mesh.shape)) == tuple(want)


def test_shard_shape():
    assert lesson05.check_shard_shape(lesson05.reference_shard_shape)

    def first_axis_only(shape, spec, mesh_shape):
        out = list(shape)
        for d, e in enumerate(tuple(spec)):
            if e is not None:
                out[d] //= mesh_shape[e[0] if isinstance(e, tuple) else e]
        return tuple(out)

    rejects(lesson05.check_shard_shape, first_axis_only, match="product of their sizes")

    def all_devices_on_dim0(shape, spec, mesh_shape):
        return (shape[0] // int(np.prod(list(mesh_shape.values()))),) + tuple(shape[1:])

    rejects(
        lesson05.check_shard_shape, all_devices_on_dim0, match="divide each dimension|not split"
    )


def test_no_comm_placement(report):
    def good(x, w, mesh):
        return jax.device_put(x, NamedSharding(mesh, P(DATA, None))), jax.device_put(
            w, NamedSharding(mesh, P(None, MODEL))
        )

    assert lesson05.check_no_comm_placement(good, report.devices)

    def rows(x, w, mesh):
        return jax.device_put(x, NamedSharding(mesh, P(DATA, None))), jax.device_put(
            w, NamedSharding(mesh, P(MODEL, None))
        )

    rejects(lesson05.check_no_comm_placement, rows, report.devices, match="all-reduce")

    def x_replicated(x, w, mesh):
        return jax.device_put(x, NamedSharding(mesh, P())), jax.device_put(
            w, NamedSharding(mesh, P(None, MODEL))
        )

    rejects(
        lesson05.check_no_comm_placement, x_replicated, report.devices, match="batch is not split"
    )

    def w_replicated(x, w, mesh):
        return jax.device_put(x, NamedSharding(mesh, P(DATA, None))), jax.device_put(
            w, NamedSharding(mesh, P())
        )

    rejects(
        lesson05.check_no_comm_placement,
        w_replicated,
        report.devices,
        match="columns are not split",
    )


# ---- the student version's stubs are rejected with a plain "not written yet" ------------------------------


def _stub(*args, **kwargs):
    raise NotImplementedError("Exercise: write this part")


@pytest.mark.parametrize(
    "check, needs_devices",
    [
        (lesson05.check_place_batch, True),
        (lesson05.check_shard_shape, False),
        (lesson05.check_no_comm_placement, True),
    ],
)
def test_stub_is_not_written_yet(report, check, needs_devices):
    args = (_stub, report.devices) if needs_devices else (_stub,)
    rejects(check, *args, match="not written yet")

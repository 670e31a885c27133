"""Meshes: shapes, axis types, the model axis's choices, clear errors."""

import jax
import pytest

from course_lib import meshes


def test_meshes():
    assert meshes.choose_mesh_shape(1) == (1, 1)
    assert meshes.choose_mesh_shape(8) == (4, 2)
    assert meshes.choose_mesh_shape(6) == (3, 2)
    assert meshes.choose_mesh_shape(5) == (5, 1)
    assert meshes.choose_mesh_shape(8, model=4) == (2, 4)
    with pytest.raises(
        ValueError,
        match="model axis of 3 does not divide 8 devices; choose one of \\[1, 2, 4, 8\\]",
    ):
        meshes.choose_mesh_shape(8, model=3)
    with pytest.raises(ValueError, match="n_devices=0"):
        meshes.choose_mesh_shape(0)
    devs = jax.devices()
    m = meshes.data_model_mesh(devs)
    assert dict(m.shape) == {"data": 4, "model": 2}
    assert all(t == jax.sharding.AxisType.Explicit for t in m.axis_types)
    assert meshes.data_mesh(devs, axis_type="auto").axis_types == (jax.sharding.AxisType.Auto,)
    with pytest.raises(ValueError, match="needs 6 devices but 8 were given"):
        meshes.data_model_mesh(devs, (3, 2))
    with pytest.raises(ValueError, match="axis_type='manual'"):
        meshes.data_mesh(devs, axis_type="manual")
    assert meshes.describe(m) == "data=4 x model=2"


@pytest.mark.parametrize("shape", [(2.0, 2), (-2, -2), (0, 8), (8,)])
def test_bad_mesh_shapes_are_named(shape):
    with pytest.raises(ValueError, match="must be two positive integers"):
        meshes.data_model_mesh(jax.devices()[:4], shape)


def test_mesh_of_names_any_axes_in_order(report):
    mesh = meshes.mesh_of({meshes.DATA: 2, meshes.STAGE: 2, meshes.MODEL: 2}, report.devices)
    assert mesh.axis_names == ("data", "stage", "model") and mesh.devices.shape == (2, 2, 2)
    assert [d.id for d in mesh.devices[0, 0]] == [report.devices[0].id, report.devices[1].id]
    with pytest.raises(ValueError, match="needs 6 devices but 8 were given"):
        meshes.mesh_of({meshes.DATA: 3, meshes.MODEL: 2}, report.devices)
    with pytest.raises(ValueError, match="axis 'model' has size 0"):
        meshes.mesh_of({meshes.DATA: 8, meshes.MODEL: 0}, report.devices)

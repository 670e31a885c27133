"""The synthetic data: shapes, determinism, generation on the devices, pmap's layout, clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from course_lib import data, meshes

TINY_PARAMS = 1690  # conv 3->4, 4->8, 8->8 (3x3), dense 8*2*2 -> 16 -> 10, with biases
CPU_PROFILE_PARAMS = 188_810  # CNNConfig() at 32x32: the lab's CPU profile


def test_batch_shapes_dtypes_and_determinism():
    ds = data.SyntheticImages(image_size=16)
    x, y = ds.batch(jax.random.key(3), 12)
    assert x.shape == (12, 16, 16, 3) and x.dtype == jnp.float32
    assert y.shape == (12,) and y.dtype == jnp.int32 and int(y.min()) >= 0 and int(y.max()) < 10
    x2, y2 = ds.batch(jax.random.key(3), 12)
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    x3, _ = ds.batch(jax.random.key(4), 12)
    assert not np.array_equal(x, x3)


def test_any_image_size():
    for s in (8, 24, 64):
        x, _ = data.SyntheticImages(image_size=s).batch(jax.random.key(0), 2)
        assert x.shape == (2, s, s, 3)


FLOAT_ATOL = 1e-6
"""Images drawn by two programs (other shapes, other shards) agree to a few ulp, not bit for bit: the same
random bits go through the float transform to normals (``erf_inv``) and the prototypes' resize, and XLA:CPU
vectorises those loops differently for other shapes; on some CPUs (2-core Intel Xeon and AMD EPYC machines
with AVX-512) the vectorised and the scalar remainder loop round differently, by one ulp (2.4e-7 at
|x| < 2). The bits and the labels, integer operations, are compared exactly."""


def test_sharded_generation_gives_the_same_values_on_the_devices(report):
    ds = data.SyntheticImages(image_size=16)
    mesh = meshes.data_mesh(report.devices)
    xs, ys = ds.batch(jax.random.key(5), 16, NamedSharding(mesh, P(meshes.DATA)))
    x, y = ds.batch(jax.random.key(5), 16)
    np.testing.assert_array_equal(np.asarray(ys), np.asarray(y))
    np.testing.assert_allclose(np.asarray(xs), np.asarray(x), rtol=0, atol=FLOAT_ATOL)
    assert len(xs.addressable_shards) == 8 and xs.addressable_shards[0].data.shape == (2, 16, 16, 3)


def test_indivisible_batch_names_the_numbers(report):
    mesh = meshes.data_mesh(report.devices)
    with pytest.raises(
        ValueError, match="global batch 100 is not divisible by 8 data shards; use a multiple of 8"
    ):
        data.check_divisible(100, 8)
    with pytest.raises(ValueError, match="batch 12 is not divisible by 8"):
        data.SyntheticImages(image_size=16).batch(
            jax.random.key(0), 12, NamedSharding(mesh, P(meshes.DATA))
        )
    with pytest.raises(ValueError, match="batch_size=0"):
        data.SyntheticImages(image_size=16).batch(jax.random.key(0), 0)


def test_pmap_layout(report):
    b = data.SyntheticImages(image_size=8).batch(jax.random.key(0), 16)
    x, y = data.to_pmap_layout(b, 4, report.devices)
    assert x.shape == (4, 4, 8, 8, 3) and y.shape == (4, 4)
    assert np.array_equal(x.reshape(16, 8, 8, 3), b[0])
    with pytest.raises(ValueError, match="16 is not divisible by 3"):
        data.to_pmap_layout(b, 3)


def test_noise_drawn_flat_equals_the_shaped_draw():
    from course_lib.data import _normal

    key = jax.random.key(11)
    for shape in [(10, 4, 4, 3), (16, 32, 32, 3)]:
        flat = jax.random.bits(key, (int(np.prod(shape)),), jnp.uint32).reshape(shape)
        np.testing.assert_array_equal(np.asarray(flat), np.asarray(jax.random.bits(key, shape)))
        np.testing.assert_allclose(  # the same bits; the float transform: see FLOAT_ATOL
            np.asarray(_normal(key, shape)),
            np.asarray(jax.random.normal(key, shape, jnp.float32)),
            rtol=0,
            atol=FLOAT_ATOL,
        )


def test_batches_transform_each_batch_as_made():
    """The cast is applied batch by batch (one made batch alive at a time) and gives the same values as a
    cast afterwards."""
    ds = data.SyntheticImages(image_size=8)
    key = jax.random.key(3)
    made = []

    def cast(b):
        made.append(b[0].dtype)
        return b[0].astype(jnp.bfloat16), b[1]

    cast_each = data.batches(ds, key, 3, 4, transform=cast)
    after = [(i.astype(jnp.bfloat16), lab) for i, lab in data.batches(ds, key, 3, 4)]
    assert made == [jnp.float32] * 3
    for (a, la), (b, lb) in zip(cast_each, after, strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        np.testing.assert_array_equal(la, lb)

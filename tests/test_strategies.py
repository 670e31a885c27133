"""Parity: every strategy trains exactly like single-device jit (float32 tolerance), on 1, 2, 4 and 8 devices.

Tolerance: losses within 1e-5 relative, parameters within 1e-5 absolute (|param| ~ 0.1-1), after 4 SGD steps
on the tiny config (measured: ~2e-7 and ~3e-8). A stable learning rate keeps rounding differences from growing.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from course_lib import data, meshes, model, parallel, steps, strategies

STEPS = 4
BATCH = 16
RTOL_LOSS = 1e-5
ATOL_PARAMS = 1e-5


def train(key, devices, n_steps=STEPS, mesh_shape=None):
    g, p = model.init_model(jax.random.key(0), model.TINY)
    opt = steps.make_optimizer(0.01)
    s = strategies.build(key, g, p, opt, devices, mesh_shape=mesh_shape)
    state = s.place_state(steps.init_state(p, opt))
    losses = []
    for b in s.batches(data.SyntheticImages(image_size=16), jax.random.key(1), n_steps, BATCH):
        state, m = s.step(state, b)
        losses.append(float(np.asarray(m["loss"]).ravel()[0]))
    return s, state, np.array(losses), s.host_params(state)


@functools.cache
def reference(n_steps=STEPS):
    _, _, losses, params = train("jit", jax.devices()[:1], n_steps)
    return losses, params


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("key", ["pmap", "shard_map", "sharded_jit", "shard_map_article"])
def test_parity_with_single_device_jit(report, key, n):
    ref_losses, ref_params = reference()
    s, _, losses, params = train(key, report.devices[:n])
    assert s.n_devices == n
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL_LOSS)
    assert strategies.max_param_diff(params, ref_params) < ATOL_PARAMS


def test_strategies_really_differ_from_each_other(report):
    # A guard for the parity test: a strategy that ignored its data would not match.
    ref_losses, ref_params = reference()
    _, _, losses, params = train("jit", report.devices[:1], STEPS + 1)
    assert not np.allclose(losses[-1], ref_losses[-1], rtol=1e-3)


def test_pmap_replicas_stay_identical(report):
    _, state, _, _ = train("pmap", report.devices)
    leaf = jax.tree.leaves(state.params)[0]
    assert leaf.shape[0] == 8
    assert strategies.replicas_identical(state)


def test_shard_map_shards_parameters_over_the_model_axis(report):
    s, state, _, _ = train("shard_map", report.devices, n_steps=1)
    assert s.mesh == "data=4 x model=2"
    shapes = parallel.shard_shapes(state.params)
    assert shapes["conv1"]["kernel"] == (3, 3, 3, 2)  # 4 output channels / 2
    assert shapes["conv2"]["kernel"] == (3, 3, 2, 8)  # input channels split
    assert shapes["dense1"]["kernel"] == (16, 16)  # 32 rows / 2
    assert shapes["dense2"]["kernel"] == (16, 10)  # replicated
    _, pstate, _, _ = train("pmap", report.devices, n_steps=1)
    assert parallel.bytes_per_device(state.params) < parallel.bytes_per_device(pstate.params)


def test_tensor_parallel_forward_equals_the_model(report):
    g, p = model.init_model(jax.random.key(0), model.TINY)
    x = jax.random.normal(jax.random.key(2), (8, 16, 16, 3))
    mesh = meshes.data_model_mesh(report.devices, (4, 2), axis_type="auto")
    specs = parallel.tp_param_specs(p)
    f = jax.shard_map(parallel.tp_apply, mesh=mesh, in_specs=(specs, P(meshes.DATA)), out_specs=P(meshes.DATA))
    np.testing.assert_allclose(jax.jit(f)(p, x), model.apply(g, p, x), rtol=1e-5, atol=1e-5)


def test_the_gradient_trap_is_real(report):
    # Inside shard_map (check_vma=True), pmean-ing the gradients of a local loss leaves them n_data x too big.
    g, p = model.init_model(jax.random.key(0), model.TINY)
    x, y = data.SyntheticImages(image_size=16).batch(jax.random.key(1), 16)
    apply = lambda p, x: model.apply(g, p, x)
    true = jax.grad(lambda p: steps.cross_entropy(apply(p, x), y))(p)
    mesh = meshes.data_mesh(report.devices, axis_type="auto")

    def grads(sync):
        def body(p, x, y):
            def loss(p):
                l = steps.cross_entropy(apply(p, x), y)
                return lax.pmean(l, meshes.DATA) if sync == "loss" else l
            gr = jax.grad(loss)(p)
            return lax.pmean(gr, meshes.DATA) if sync == "grads" else gr
        f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(meshes.DATA), P(meshes.DATA)), out_specs=P())
        return jax.jit(f)(p, x, y)

    right, wrong = grads("loss"), grads("grads")
    for t, r, w in zip(jax.tree.leaves(true), jax.tree.leaves(right), jax.tree.leaves(wrong)):
        np.testing.assert_allclose(r, t, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(w, 8 * t, rtol=1e-4, atol=1e-6)


def test_donation_never_deletes_the_callers_parameters(report):
    g, p = model.init_model(jax.random.key(0), model.TINY)
    opt = steps.make_optimizer()
    for key in strategies.STRATEGIES:
        s = strategies.build(key, g, p, opt, report.devices)
        state = s.place_state(steps.init_state(p, opt))
        b = s.batches(data.SyntheticImages(image_size=16), jax.random.key(1), 1, 16)[0]
        new, _ = s.step(state, b)
        assert jax.tree.leaves(state.params)[0].is_deleted()  # the placed copy was donated
        assert not any(x.is_deleted() for x in jax.tree.leaves(p))  # the caller's arrays were not


def test_build_errors(report):
    g, p = model.init_model(jax.random.key(0), model.TINY)
    opt = steps.make_optimizer()
    with pytest.raises(ValueError, match="unknown strategy 'ddp'"):
        strategies.build("ddp", g, p, opt, report.devices)
    with pytest.raises(ValueError, match="no devices"):
        strategies.build("jit", g, p, opt, [])
    with pytest.raises(ValueError, match="not divisible by a model axis of 8"):
        strategies.build("shard_map", g, p, opt, report.devices, mesh_shape=(1, 8))
    s = strategies.build("pmap", g, p, opt, report.devices)
    with pytest.raises(ValueError, match="global batch 12 is not divisible by 8"):
        s.batches(data.SyntheticImages(image_size=16), jax.random.key(0), 1, 12)


def test_data_shards():
    assert strategies.data_shards("jit", 8) == 1
    assert strategies.data_shards("pmap", 8) == 8
    assert strategies.data_shards("shard_map", 8) == 4
    assert strategies.data_shards("shard_map", 3) == 3


def test_meshes():
    assert meshes.choose_mesh_shape(1) == (1, 1)
    assert meshes.choose_mesh_shape(8) == (4, 2)
    assert meshes.choose_mesh_shape(6) == (3, 2)
    assert meshes.choose_mesh_shape(5) == (5, 1)
    assert meshes.choose_mesh_shape(8, model=4) == (2, 4)
    with pytest.raises(ValueError, match="model axis of 3 does not divide 8 devices; choose one of \\[1, 2, 4, 8\\]"):
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

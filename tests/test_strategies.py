"""Parity: every strategy trains exactly like single-device jit (float32 tolerance), on 1, 2, 4 and 8 devices.

Tolerance: losses within 1e-5 relative, parameters within 1e-5 absolute (|param| ~ 0.1-1), after 4 SGD steps
on the tiny config (measured: ~2e-7 and ~3e-8). A stable learning rate keeps rounding differences from growing.
"""

import functools

import jax
import numpy as np
import pytest

from course_lib import data, lm_costs, lm_layouts, model, parallel, steps, strategies, transformer

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


@pytest.mark.parametrize(
    "key, n",
    [
        (key, n)
        for key in ("pmap", "shard_map", "sharded_jit", "fsdp", "shard_map_article")
        for n in (1, 2, 4, 8)
    ]
    + [("shard_map_pairs", 8), ("fsdp_jit", 8), ("shard_map_pairs", 2), ("fsdp_jit", 2)],
)
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
    # C, the gather layout: conv1 and conv2 output-split, conv3 input-split, dense1 output-split, dense2 input-split
    s, state, _, _ = train("shard_map", report.devices, n_steps=1)
    assert s.mesh == "data=4 x model=2" and s.mesh_axes == {"data": 4, "model": 2}
    shapes = parallel.shard_shapes(state.params)
    assert shapes["conv1"]["kernel"] == (3, 3, 3, 2)  # 4 output channels / 2
    assert shapes["conv2"]["kernel"] == (3, 3, 4, 4)  # 8 output channels / 2
    assert shapes["conv3"]["kernel"] == (3, 3, 4, 8)  # 8 input channels / 2
    assert shapes["dense1"]["kernel"] == (32, 8)  # 16 hidden units / 2, every row
    assert shapes["dense2"]["kernel"] == (8, 10)  # 16 input rows / 2
    _, pstate, _, _ = train("pmap", report.devices, n_steps=1)
    assert parallel.bytes_per_device(state.params) < parallel.bytes_per_device(pstate.params)


def test_shard_map_pairs_is_lesson_06s_layout(report):
    s, state, _, _ = train("shard_map_pairs", report.devices, n_steps=1)
    shapes = parallel.shard_shapes(state.params)
    assert shapes["conv1"]["kernel"] == (3, 3, 3, 2)  # 4 output channels / 2
    assert shapes["conv2"]["kernel"] == (3, 3, 2, 8)  # input channels split
    assert shapes["dense1"]["kernel"] == (16, 16)  # 32 rows / 2
    assert shapes["dense2"]["kernel"] == (16, 10)  # replicated


def test_fsdp_shards_parameters_and_momentum_over_the_data_axis(report):
    s, state, _, _ = train("fsdp", report.devices, n_steps=1)
    shapes = parallel.shard_shapes(state.params)
    assert shapes["conv2"]["kernel"] == (3, 3, 4, 1)  # 8 output channels / 8 devices
    assert shapes["dense1"]["kernel"] == (4, 16)  # 32 rows / 8
    assert shapes["conv1"]["kernel"] == (3, 3, 3, 4)  # no dimension divisible by 8: replicated
    trace = state.opt_state[0].trace
    assert parallel.shard_shapes(trace) == shapes  # the momentum is laid out like the parameters
    _, pstate, _, _ = train("pmap", report.devices, n_steps=1)
    assert parallel.bytes_per_device(state.params) < parallel.bytes_per_device(pstate.params) / 2


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


def test_the_registry_is_the_one_description_of_a_strategy(report):
    from course_lib import distributed, lab

    assert list(strategies.REGISTRY) == [
        "jit",
        "pmap",
        "shard_map",
        "sharded_jit",
        "fsdp",
        "shard_map_pairs",
        "shard_map_article",
        "fsdp_jit",
        *lm_layouts.LAYOUTS,
    ]
    assert strategies.CNN_KEYS == tuple(strategies.REGISTRY)[:8]
    assert strategies.LAYOUT_KEYS == tuple(
        lm_layouts.LAYOUTS
    )  # the transformer lab's, in its order
    assert strategies.STRATEGIES == ("jit", "pmap", "shard_map", "sharded_jit", "fsdp")
    assert strategies.LABELS["shard_map_article"] == "C': shard_map, article's split"
    assert distributed.MULTIHOST_STRATEGIES == ("shard_map", "sharded_jit")
    assert lab.SCALING_STRATEGIES == ("pmap", "shard_map", "sharded_jit")
    assert (
        strategies.data_shards("shard_map", 8, mesh_shape=(2, 4)) == 2
    )  # a custom mesh shape counts
    g, p = model.init_model(jax.random.key(0), model.TINY)
    s = strategies.build(
        "shard_map", g, p, steps.make_optimizer(), report.devices, mesh_shape=(2, 4)
    )
    assert s.global_batch_divisor == 2 and s.label == strategies.REGISTRY["shard_map"].label
    with pytest.raises(ValueError, match="unknown strategy 'ddp'; choose one of \\['jit', 'pmap'"):
        strategies.data_shards("ddp", 8)


def test_the_registry_builds_the_transformer_layouts_and_keeps_them_apart_from_the_cnn(report):
    for key in strategies.LAYOUT_KEYS:
        entry = strategies.info(key)
        assert entry.model == "transformer" and entry.mesh_kind == "layout" and not entry.scaling
        assert (
            entry.marker == lm_layouts.LAYOUTS[key].marker
            and lm_layouts.LAYOUTS[key].label in entry.label
        )
    assert strategies.data_shards("3d", 8) == 4 and strategies.data_shards("tp_sp", 4) == 2
    built = strategies.build_layout("fsdp_tp", transformer.TINY, report.devices)
    assert built.key == "fsdp_tp" and built.sizes == {"fsdp": 4, "model": 2}
    sizes = lm_layouts.mesh_axes("dp_cp", 8)
    assert strategies.predict_comm("dp_cp", transformer.TINY, 16, 8) == lm_costs.predict_bytes(
        "dp_cp", transformer.TINY, 16, sizes
    )
    g, p = model.init_model(jax.random.key(0), model.TINY)
    with pytest.raises(ValueError, match="strategy 'dp' trains the transformer, not the cnn"):
        strategies.build("dp", g, p, steps.make_optimizer(), report.devices)
    with pytest.raises(ValueError, match="strategy 'pmap' trains the cnn, not the transformer"):
        strategies.build_layout("pmap", transformer.TINY, report.devices)
    with pytest.raises(ValueError, match="does not fit 2 devices"):
        strategies.data_shards("3d", 2)


def test_the_registry_names_which_strategies_reduce_partial_sums_and_what_e_is():
    # sharded jit lets the partitioner all-reduce the backward pass's partial sums (bfloat16 under
    # mixed precision); pmap and shard_map reduce float32 gradients themselves
    assert {k for k, i in strategies.REGISTRY.items() if i.reduces_partial_sums} == {
        "sharded_jit",
        "fsdp_jit",
    }
    # E gathers every parameter once and keeps them through the backward pass: ZeRO-2-like, not ZeRO-3
    assert "ZeRO-2" in strategies.LABELS["fsdp"] and "ZeRO-3" not in strategies.LABELS["fsdp"]

"""Parity rules (course_lib.parity), on the tiny profile and 8 simulated CPU devices:

- float64: every strategy's whole trajectory equals single-device jit's to 1e-10 at every step;
- float32: one step from A's own state matches A's loss and update within ``TOLERANCES["float32"]`` for ten
  seeds — and four typical bugs break that rule by far;
- bfloat16: the same rule with its looser tolerances;
- the pieces of the live demonstration: pool flips, the summation orders, the one-ulp nudge.
"""

from functools import partial

import jax
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from course_lib import builders, config, data, lab, model, parallel, parity, steps, strategies
from course_lib.meshes import DATA, MODEL, data_model_mesh
from course_lib.model import flatten_channel_major, max_pool
from course_lib.parallel import conv

TINY = config.resolve_profile("tiny", "cpu")


def test_float64_every_strategy_equals_a_at_every_step(report):
    ref = lab.run_strategy("jit", report.devices, TINY, precision="float64", progress=False)
    assert isinstance(ref.losses[0], float) and jax.tree.leaves(ref.params)[0].dtype == np.float64
    for key in strategies.CNN_KEYS:
        if key == "jit":
            continue
        run = lab.run_strategy(key, report.devices, TINY, precision="float64", progress=False)
        worst = parity.relative_diff(run.losses, ref.losses).max()
        assert worst < parity.TOLERANCES["float64"].trajectory, (key, worst)
    # a finished run's batches are made again when read: the same values, dtype and layout it trained on
    start = config.init_run(TINY, 0)
    made = data.batches(start.dataset, start.data_key, TINY.steps, TINY.global_batch)
    assert isinstance(run.batches, builders.RemadeBatches) and len(run.batches) == TINY.steps
    images, labels = run.batches[-1]
    assert images.dtype == np.float64 and len(images.sharding.device_set) == len(report.devices)
    np.testing.assert_array_equal(
        np.asarray(images).reshape(made[-1][0].shape), np.asarray(made[-1][0], np.float64)
    )
    np.testing.assert_array_equal(np.asarray(labels).ravel(), np.asarray(made[-1][1]))
    assert len(run.batches[1:3]) == 2
    with pytest.raises(IndexError, match=f"batch {TINY.steps} of a run of {TINY.steps} steps"):
        run.batches[TINY.steps]


def _reference_states(seed, n_steps):
    start = config.init_run(TINY, seed)
    opt = steps.make_optimizer(TINY.learning_rate)
    step = _a_step(start.graphdef)
    states, losses = [jax.device_get(steps.init_state(start.params, opt))], []
    batches = data.batches(start.dataset, start.data_key, n_steps, TINY.global_batch)
    for b in batches:
        new, m = step(states[-1], b)
        states.append(jax.device_get(new))
        losses.append(float(m["loss"]))
    return states, losses, batches


_STEPS = {}


def _a_step(graphdef):
    if "A" not in _STEPS:
        opt = steps.make_optimizer(TINY.learning_rate)
        _STEPS["A"] = jax.jit(
            partial(steps.train_step, apply_fn=partial(model.apply, graphdef), optimizer=opt)
        )
    return _STEPS["A"]


def _worst_one_step(step, place, unstack, to_batch, seed):
    states, losses, batches = _reference_states(seed, TINY.steps)
    worst_u = worst_l = 0.0
    for k, b in enumerate(batches):
        new, m = step(place(states[k]), to_batch(b))
        u, _ = parity.update_diff(
            jax.device_get(unstack(new).params), states[k + 1].params, states[k].params
        )
        loss = float(np.asarray(m["loss"]).ravel()[0])
        worst_u, worst_l = max(worst_u, u), max(worst_l, abs(loss / losses[k] - 1))
    return worst_u, worst_l


def _built(key, devices, precision="float32"):
    start = config.init_run(TINY, 0)
    s = strategies.build(key, start.graphdef, start.params, steps.make_optimizer(TINY.learning_rate), devices,
                         precision=precision)  # fmt: skip
    unstack = (lambda st: jax.tree.map(lambda x: x[0], st)) if key == "pmap" else (lambda st: st)
    to_batch = lambda b: s.to_step_batch(jax.device_put(b, s.batch_sharding))
    return s.step, s.place_state, unstack, to_batch


def test_float32_one_step_parity_holds_for_ten_seeds(report):
    tol = parity.TOLERANCES["float32"]
    built = {k: _built(k, report.devices) for k in ("shard_map_pairs", "pmap")}
    for seed in range(10):
        for key, b in built.items():
            u, loss = _worst_one_step(*b, seed)
            assert u <= tol.one_step_update and loss <= tol.one_step_loss, (key, seed, u, loss)


def test_bfloat16_one_step_parity(report):
    tol = parity.TOLERANCES["bfloat16"]
    ref = lab.run_strategy(
        "jit", report.devices, TINY, precision="bfloat16", keep_states=True, progress=False
    )
    for key in ("pmap", "shard_map", "sharded_jit", "fsdp"):
        run = lab.run_strategy(key, report.devices, TINY, precision="bfloat16", progress=False)
        rows = parity.one_step(run, ref, range(TINY.steps))
        assert max(r["update_rel"] for r in rows) <= tol.one_step_update, (key, rows)
        assert max(r["loss_rel"] for r in rows) <= tol.one_step_loss, (key, rows)


# ---- four typical bugs the one-step rule must catch ---------------------------------------------------


def _bias_before_psum(p, images, model_axis=MODEL):
    x = max_pool(jax.nn.relu(conv(images, p["conv1"]["kernel"], p["conv1"]["bias"])))
    x = max_pool(
        jax.nn.relu(lax.psum(conv(x, p["conv2"]["kernel"], p["conv2"]["bias"]), model_axis))
    )
    x = flatten_channel_major(
        max_pool(jax.nn.relu(conv(x, p["conv3"]["kernel"], p["conv3"]["bias"])))
    )
    x = jax.nn.relu(lax.psum(x @ p["dense1"]["kernel"], model_axis) + p["dense1"]["bias"])
    return x @ p["dense2"]["kernel"] + p["dense2"]["bias"]


def _row_major_flatten(p, images, model_axis=MODEL):
    x = max_pool(jax.nn.relu(conv(images, p["conv1"]["kernel"], p["conv1"]["bias"])))
    x = max_pool(
        jax.nn.relu(lax.psum(conv(x, p["conv2"]["kernel"]), model_axis) + p["conv2"]["bias"])
    )
    x = max_pool(jax.nn.relu(conv(x, p["conv3"]["kernel"], p["conv3"]["bias"])))
    x = x.reshape(x.shape[0], -1)
    x = jax.nn.relu(lax.psum(x @ p["dense1"]["kernel"], model_axis) + p["dense1"]["bias"])
    return x @ p["dense2"]["kernel"] + p["dense2"]["bias"]


def _pairs_program(devices, apply_fn, sync="loss"):
    start = config.init_run(TINY, 0)
    opt = steps.make_optimizer(TINY.learning_rate)
    mesh = data_model_mesh(devices, (4, 2), axis_type="explicit")
    specs = parallel.tp_param_specs(start.params)
    st = steps.TrainState(
        specs, parallel.specs_like(jax.eval_shape(opt.init, start.params), start.params, specs)
    )
    body = partial(steps.train_step, apply_fn=apply_fn, optimizer=opt, data_axis=DATA, sync=sync)
    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(st, (P(DATA), P(DATA))), out_specs=(st, P()))
    )
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), st, is_leaf=lambda x: isinstance(x, P)
    )
    return (
        step,
        lambda s: builders.put(s, shardings),
        lambda s: s,
        lambda b: jax.device_put(b, NamedSharding(mesh, P(DATA))),
    )


def _pmap_sync_loss(devices):
    start = config.init_run(TINY, 0)
    opt = steps.make_optimizer(TINY.learning_rate)
    body = partial(steps.train_step, apply_fn=partial(model.apply, start.graphdef), optimizer=opt, data_axis=DATA,
                   sync="loss")  # fmt: skip
    step = jax.pmap(body, axis_name=DATA, devices=devices)
    n = len(devices)
    place = lambda s: jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n, *np.shape(x))), s)
    return (
        step,
        place,
        lambda s: jax.tree.map(lambda x: x[0], s),
        partial(data.to_pmap_layout, n_devices=n),
    )


@pytest.mark.parametrize(
    "bug", ["n_data x gradients", "bias before psum", "row-major flatten", "pmap sync=loss"]
)
def test_one_step_rule_catches_typical_bugs(report, bug):
    devices = report.devices
    program = {
        "n_data x gradients": lambda: _pairs_program(
            devices, partial(parallel.tp_apply, model_axis=MODEL), "grads"
        ),
        "bias before psum": lambda: _pairs_program(devices, _bias_before_psum),
        "row-major flatten": lambda: _pairs_program(devices, _row_major_flatten),
        "pmap sync=loss": lambda: _pmap_sync_loss(devices),
    }[bug]()
    u, _ = _worst_one_step(*program, seed=0)
    assert u > 10 * parity.TOLERANCES["float32"].one_step_update, (bug, u)


# ---- the demonstration's pieces -----------------------------------------------------------------------


def test_summation_orders_compute_the_same_forward(report):
    start = config.init_run(TINY, 0)
    images = data.batches(start.dataset, start.data_key, 1, TINY.global_batch)[0][0]
    ref = model.apply(start.graphdef, start.params, images)
    for order in ("A", "pairs", "gather"):
        logits = parity.activations(start.params, images, order)["logits"]
        np.testing.assert_allclose(logits, ref, rtol=1e-5, atol=1e-5)


def test_pool_flips_finds_a_swapped_window():
    za = {k: np.zeros((1, 4, 4, 2), np.float32) for k in ("z1", "z2", "z3")}
    zb = {k: v.copy() for k, v in za.items()}
    za["z2"][0, 2, 3, 1], za["z2"][0, 3, 3, 1] = 1.0, np.nextafter(np.float32(1.0), np.float32(2.0))
    zb["z2"][0, 2, 3, 1], zb["z2"][0, 3, 3, 1] = (
        np.float32(1.0) + 2 * np.spacing(np.float32(1.0)),
        1.0,
    )
    (flip,) = parity.pool_flips(za, zb)
    assert flip.layer == "z2" and flip.where == (0, 1, 1, 1) and flip.gap_ulp == pytest.approx(1)
    assert parity.pool_flips(za, za) == []


def test_nudge_moves_every_entry_by_one_ulp():
    p = {"w": np.array([1.0, -2.0, 0.5], np.float32)}
    q = parity.nudge(p)
    assert np.all(q["w"] > p["w"]) and np.array_equal(
        q["w"], np.nextafter(p["w"], np.float32(np.inf))
    )


def test_nudge_by_a_bfloat16_ulp_changes_the_bfloat16_copy():
    import jax.numpy as jnp

    p = {"w": np.array([1.0, -0.2, 0.3001], np.float32)}
    assert np.array_equal(
        parity.nudge(p)["w"].astype(jnp.bfloat16), p["w"].astype(jnp.bfloat16)
    )  # a float32 ulp vanishes in the cast a bfloat16 run makes
    q = parity.nudge(p, ulp_of=jnp.bfloat16)
    assert q["w"].dtype == np.float32 and np.all(q["w"] > p["w"])
    low = p["w"].astype(jnp.bfloat16)
    assert np.array_equal(q["w"].astype(jnp.bfloat16), np.nextafter(low, jnp.bfloat16(np.inf)))


def test_pool_flips_of_a_window_all_zero_in_one_forward():
    # A's window is all zeros after the ReLU, b's has one small positive value: a flip, measured in ulp of
    # b's value (the spacing of 0 is a subnormal: the ratio overflowed to infinity before)
    za = {k: np.zeros((1, 2, 2, 1), np.float32) for k in ("z1", "z2", "z3")}
    zb = {k: v.copy() for k, v in za.items()}
    zb["z2"][0, 1, 1, 0] = 3e-6
    (flip,) = parity.pool_flips(za, zb)
    assert flip.layer == "z2" and flip.gap_ulp == 0 and flip.moved_ulp[:3] == (0, 0, 0)
    assert 0 < flip.moved_ulp[3] < 2**24

"""The mixture-of-experts MLP: routing rules, dense parity when nothing drops, expert parallelism equal to
one device (float64), the all-to-all bytes predicted = compiled."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from course_lib import moe, programs
from course_lib import transformer as T
from course_lib.meshes import EXPERT, mesh_of

E, D, F = 8, 16, 32
ONCE = {"xla_backend_optimization_level": 0}
"""Programs run once: compiled without LLVM's optimisations (half the compile)."""


@pytest.fixture(scope="module")
def layer():
    with jax.enable_x64(True):
        p = jax.jit(lambda k: moe.init_moe(k, D, F, E, jnp.float64))(jax.random.key(0))
        x = jax.random.normal(jax.random.key(1), (64, D), jnp.float64)
    return p, x


def test_route_follows_the_priority_rule():
    logits = jnp.array([[3.0, 2.0, 0.0], [3.0, 0.0, 2.0], [0.0, 3.0, 2.0], [3.0, 2.0, 1.0]])
    r = moe.route(logits, 2, 2)
    np.testing.assert_array_equal(r.expert, [[0, 1], [0, 2], [1, 2], [0, 1]])
    # first choices first: expert 0 gets tokens 0, 1 (slots 0, 1) and token 3 finds it full (slot 2)
    np.testing.assert_array_equal(r.slot, [[0, 1], [1, 0], [0, 1], [2, 2]])
    np.testing.assert_array_equal(
        r.keep, [[True, True], [True, True], [True, True], [False, False]]
    )
    np.testing.assert_allclose(r.gate.sum(-1), 1.0, rtol=1e-6)
    assert float(r.gate[0, 0]) == pytest.approx(1 / (1 + np.exp(-1.0)), rel=1e-6)


def test_capacity():
    assert moe.capacity(64, 8, 2, 1.0) == 16 and moe.capacity(64, 8, 2, 1.25) == 20
    assert moe.capacity(3, 8, 1, 0.1) == 1
    with pytest.raises(ValueError, match="k=3 experts per token but only n_experts=2"):
        moe.capacity(4, 2, 3, 1.0)
    with pytest.raises(ValueError, match="capacity_factor=0"):
        moe.capacity(4, 2, 1, 0)


def test_equals_dense_when_nothing_drops_and_not_when_it_does(layer):
    p, x = layer
    with jax.enable_x64(True):
        dense = jax.jit(moe.moe_dense)(x, p)
        roomy = jax.jit(
            lambda x, p, lim: moe.moe_mlp(x, p, capacity_factor=E / 2, limit=lim)
        )  # E/k: enough
        drops = jax.jit(
            lambda x, p, lim: moe.dropped_fraction(x, p, capacity_factor=E / 2, limit=lim)
        )
        assert float(drops(x, p, 10**6)) == 0.0
        np.testing.assert_allclose(roomy(x, p, 10**6), dense, rtol=0, atol=1e-12)
        half = moe.capacity(64, E, 2, 0.5)  # the places of capacity factor 0.5, in the same program
        np.testing.assert_allclose(
            roomy(x, p, half),
            jax.jit(moe.moe_mlp, static_argnames="capacity_factor")(x, p, capacity_factor=0.5),
            rtol=0,
            atol=1e-12,
        )
        dropped = float(drops(x, p, half))
        assert 0.4 < dropped < 0.6  # half the places of a perfectly balanced router, or fewer
        assert float(jnp.abs(roomy(x, p, half) - dense).max()) > 0.1
        load = moe.expert_load(x, p)
        assert int(load.sum()) == 2 * 64 and float(dropped) == pytest.approx(
            float(np.maximum(np.asarray(load) - half, 0).sum()) / 128
        )


@pytest.mark.parametrize("n, cf", [(8, 0.75), (4, 4.0), (2, 0.75), (1, 0.75)])
def test_expert_parallel_equals_one_device_grouped(report, layer, n, cf):
    p, x = layer
    mesh = mesh_of({EXPERT: n}, report.devices[:n], axis_type="auto")
    fn = jax.jit(
        jax.shard_map(
            lambda xx, pp: moe.moe_mlp_ep(xx, pp, axis=EXPERT, k=2, capacity_factor=cf),
            mesh=mesh,
            in_specs=(P(EXPERT), moe.expert_specs(p, EXPERT)),
            out_specs=P(EXPERT),
        )
    )
    with jax.enable_x64(True):
        compiled = fn.lower(x, p).compile()
        got = compiled(x, p)
        want = jax.jit(lambda x, p: moe.moe_mlp(x, p, k=2, capacity_factor=cf, n_groups=n))(x, p)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    ops = [o for o in programs.collective_ops(compiled.as_text(), mesh) if o.op == "all-to-all"]
    pred = moe.all_to_all_bytes(64 // n, E, 2, cf, D, n, itemsize=8)
    if n == 1:
        assert ops == []  # a group of one device exchanges nothing
    else:
        assert len(ops) == 2 and all(o.axes == (EXPERT,) for o in ops)
        assert [o.nbytes for o in ops] == [pred["buffer"]] * 2
        assert [o.bytes_sent for o in ops] == [pred["sent"]] * 2


def test_expert_parallel_gradients_equal_one_device(report, layer):
    p, x = layer
    n = 4
    mesh = mesh_of({EXPERT: n}, report.devices[:n], axis_type="auto")
    with jax.enable_x64(True):
        r = jax.random.normal(jax.random.key(3), x.shape, x.dtype)

    def ep(pp, xx):
        body = lambda a, b: moe.moe_mlp_ep(a, b, axis=EXPERT, capacity_factor=1.0)  # noqa: E731
        specs = (P(EXPERT), moe.expert_specs(p, EXPERT))
        return (
            jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(EXPERT))(xx, pp) * r
        ).sum()

    def one(pp, xx):
        return (moe.moe_mlp(xx, pp, capacity_factor=1.0, n_groups=n) * r).sum()

    with jax.enable_x64(True):
        g_ep = jax.jit(jax.grad(ep, argnums=(0, 1)), compiler_options=ONCE)(p, x)
        g_one = jax.jit(jax.grad(one, argnums=(0, 1)), compiler_options=ONCE)(p, x)
        assert (
            max(
                float(jnp.abs(a - b).max())
                for a, b in zip(jax.tree.leaves(g_ep), jax.tree.leaves(g_one))
            )
            < 1e-10
        )


def test_moe_transformer_expert_parallel_loss(report):
    cfg = dataclasses.replace(T.TINY, n_layers=1)
    n = 4
    mesh = mesh_of({EXPERT: n}, report.devices[:n], axis_type="auto")
    with jax.enable_x64(True):
        params = jax.tree.map(
            lambda a: a.astype(jnp.float64), moe.init_moe_model(jax.random.key(0), cfg, E)
        )
        assert params["blocks"]["moe"]["w1"]["kernel"].shape == (1, E, cfg.d_model, cfg.d_ff)
        assert "mlp" not in params["blocks"]
        tokens = jax.random.randint(jax.random.key(1), (8, cfg.seq_len), 0, cfg.vocab)
        targets = jnp.roll(tokens, -1, axis=1)
        grouped = lambda h, pm: moe.moe_mlp(h, pm, k=2, capacity_factor=1.0, n_groups=n)  # noqa: E731
        ref = jax.jit(
            lambda prm: moe.loss_fn(prm, tokens, targets, mlp_fn=grouped), compiler_options=ONCE
        )(params)
        got = jax.jit(moe.ep_loss(mesh, EXPERT, k=2, capacity_factor=1.0), compiler_options=ONCE)(
            params, tokens, targets
        )
        assert abs(float(ref - got)) < 1e-10 and 2.0 < float(got) < 4.0


def test_load_balancing_loss_is_one_when_balanced_and_grows_with_skew():
    n = 64
    # uniform probabilities: 1 exactly, whatever top_k picks among the ties
    assert float(moe.load_balancing_loss(jnp.zeros((n, E)), k=1)) == pytest.approx(1.0, abs=1e-6)
    assert float(moe.load_balancing_loss(jnp.zeros((n, E)), k=2)) == pytest.approx(1.0, abs=1e-6)
    # a balanced router: token t prefers expert t mod E (each expert n/E tokens): 1 (f uniform)
    balanced = 4.0 * jax.nn.one_hot(jnp.arange(n) % E, E)
    assert float(moe.load_balancing_loss(balanced)) == pytest.approx(1.0, abs=1e-6)
    # every token to expert 0: f = (1, 0, …), P_0 = e^4/(e^4 + E - 1); E·P_0
    skewed = 4.0 * jax.nn.one_hot(jnp.zeros(n, jnp.int32), E)
    p0 = np.exp(4.0) / (np.exp(4.0) + E - 1)
    assert float(moe.load_balancing_loss(skewed)) == pytest.approx(E * p0, rel=1e-5)
    assert float(moe.load_balancing_loss(100.0 * jax.nn.one_hot(jnp.zeros(n, jnp.int32), E))) == (
        pytest.approx(E, rel=1e-5)
    )
    # top-2, every token to experts 0 and 1: f = (1/2, 1/2, 0, …)
    two = 100.0 * (
        jax.nn.one_hot(jnp.zeros(n, jnp.int32), E) + jax.nn.one_hot(jnp.ones(n, jnp.int32), E)
    )
    assert float(moe.load_balancing_loss(two, k=2)) == pytest.approx(E / 2, rel=1e-5)


def test_load_balancing_loss_is_at_most_e_over_k_and_can_fall_below_one():
    """f_i <= 1/k (a token's k choices are distinct experts), so E·Σ f_i·P_i <= E/k, reached when one
    expert is certain for every token; f and P anti-correlated give a value below 1 with the load uneven."""
    n = 64
    certain = 100.0 * jax.nn.one_hot(jnp.zeros(n, jnp.int32), E)
    for k in (1, 2, 3):
        assert float(moe.load_balancing_loss(certain, k=k)) == pytest.approx(E / k, rel=1e-5)
    rng = np.random.default_rng(0)
    for k in (1, 2, 4):  # random routers never exceed the bound
        logits = jnp.asarray(3.0 * rng.standard_normal((n, E)), jnp.float32)
        assert float(moe.load_balancing_loss(logits, k=k)) <= E / k + 1e-5
    uneven = jnp.log(jnp.asarray([[0.51, 0.49]] * 90 + [[1e-9, 1.0]] * 10))  # E = 2: f = (0.9, 0.1)
    assert float(moe.load_balancing_loss(uneven, k=1)) == pytest.approx(
        2 * (0.9 * 0.459 + 0.1 * 0.541), rel=1e-5
    )
    assert float(moe.load_balancing_loss(uneven, k=1)) < 1


def test_load_balancing_loss_gradient_moves_probability_off_the_busy_expert():
    logits = jax.random.normal(jax.random.key(3), (32, E)) + 2.0 * jax.nn.one_hot(0, E)
    g = jax.grad(moe.load_balancing_loss)(logits)
    assert (
        float(g[:, 0].sum()) > 0
    )  # descending lowers expert 0's logits: it takes more than its share
    # f carries no gradient: the loss equals E·Σ f_i·P_i with f held fixed
    f = jax.nn.one_hot(jnp.argmax(logits, -1), E).mean(0)
    fixed = jax.grad(lambda z: E * jnp.sum(f * jax.nn.softmax(z, -1).mean(0)))(logits)
    np.testing.assert_allclose(g, fixed, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="k=0"):
        moe.load_balancing_loss(logits, k=0)

"""The CNN: shapes, an exact parameter count, agreement with the NNX module, FLOPs, learning."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from course_lib import data, model, steps

TINY_PARAMS = 1690  # conv 3->4, 4->8, 8->8 (3x3), dense 8*2*2 -> 16 -> 10, with biases
CPU_PROFILE_PARAMS = 188_810  # CNNConfig() at 32x32: the lab's CPU profile


def test_param_counts_are_exact():
    _, p = model.init_model(jax.random.key(0), model.TINY)
    assert model.param_count(p) == TINY_PARAMS
    assert model.param_bytes(p) == 4 * TINY_PARAMS
    _, p = model.init_model(jax.random.key(0), model.CNNConfig())
    assert model.param_count(p) == CPU_PROFILE_PARAMS


def test_params_are_a_plain_pytree_with_expected_shapes():
    _, p = model.init_model(jax.random.key(0), model.TINY)
    assert isinstance(p, dict) and sorted(p) == ["conv1", "conv2", "conv3", "dense1", "dense2"]
    assert p["conv1"]["kernel"].shape == (3, 3, 3, 4)
    assert p["dense1"]["kernel"].shape == (model.TINY.flat_features, 16) == (32, 16)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(p))


def test_apply_matches_the_nnx_module_and_is_deterministic():
    g, p = model.init_model(jax.random.key(0), model.TINY)
    x = jax.random.normal(jax.random.key(1), (5, 16, 16, 3))
    module = model.CNN(model.TINY, rngs=nnx.Rngs(params=jax.random.key(0)))
    np.testing.assert_allclose(model.apply(g, p, x), module(x), rtol=1e-6, atol=1e-6)
    assert model.apply(g, p, x).shape == (5, 10)
    _, p2 = model.init_model(jax.random.key(0), model.TINY)
    assert all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p2), strict=True)
    )


def test_flatten_is_channel_major():
    x = jnp.arange(2 * 2 * 3).reshape(1, 2, 2, 3)  # [B, H, W, C]
    assert model.flatten_channel_major(x).tolist() == [[0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8, 11]]


def test_analytic_flops_agree_with_the_compiler():
    cfg = model.CNNConfig(image_size=32)
    g, p = model.init_model(jax.random.key(0), cfg)
    x = jnp.zeros((4, 32, 32, 3))
    compiled = jax.jit(lambda p, x: model.apply(g, p, x)).lower(p, x).compile()
    flops = compiled.cost_analysis()["flops"]
    # XLA does not count the taps that fall on 'SAME' padding at the borders, so it reports a little less.
    assert 0.85 < flops / (4 * model.flops_per_example(cfg)) < 1.05


@pytest.mark.parametrize("bad", [12, 0, 7])
def test_config_rejects_image_sizes_not_multiple_of_8(bad):
    with pytest.raises(ValueError, match=f"image_size={bad}"):
        model.CNNConfig(image_size=bad)


def test_the_cnn_learns_the_synthetic_data():
    g, p = model.init_model(jax.random.key(0), model.TINY)
    opt = steps.make_optimizer(0.03)
    state = steps.init_state(p, opt)
    ds = data.SyntheticImages(image_size=16)
    step = jax.jit(
        lambda s, b: steps.train_step(
            s, b, apply_fn=lambda p, x: model.apply(g, p, x), optimizer=opt
        )
    )
    fixed = ds.batch(jax.random.key(9), 64)
    first = float(steps.cross_entropy(model.apply(g, state.params, fixed[0]), fixed[1]))
    for i in range(40):
        state, m = step(state, ds.batch(jax.random.fold_in(jax.random.key(1), i), 32))
    last = float(steps.cross_entropy(model.apply(g, state.params, fixed[0]), fixed[1]))
    assert last < 0.6 * first, (first, last)


@pytest.mark.parametrize("shape", [(3, 3, 3, 16), (512, 64)])
def test_the_flat_initializer_is_flax_lecun_normal(shape):
    # The same random bits (integer operations: exact) through the truncated normal's float transform,
    # which XLA:CPU vectorises differently for the flat and the shaped draw: equal to a few ulp, and bit for
    # bit only where both loops round alike (not on every CPU: AVX-512 machines differ by one ulp).
    key = jax.random.key(7)
    n = int(np.prod(shape))
    np.testing.assert_array_equal(
        np.asarray(jax.random.bits(key, (n,))).reshape(shape),
        np.asarray(jax.random.bits(key, shape)),
    )
    expected = nnx.initializers.lecun_normal()(key, shape)
    got = model.lecun_normal(key, shape)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-6, atol=1e-8)


def test_every_layer_draws_its_kernel_with_the_flat_initializer(monkeypatch):
    shapes = []

    def recording(key, shape, dtype=jnp.float32):
        shapes.append(tuple(shape))
        return jnp.zeros(shape, dtype)

    monkeypatch.setattr(model, "lecun_normal", recording)
    _, params = jax.eval_shape(lambda k: model.init_model(k, model.TINY), jax.random.key(0))
    kernels = [tuple(layer["kernel"].shape) for layer in params.values()]
    assert sorted(shapes) == sorted(kernels) and len(shapes) == 5

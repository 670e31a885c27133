"""The transformer of lessons 10–12: shapes, parameter count, the functional math equal to the NNX module."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from course_lib import transformer as T

CFG = T.TINY


@pytest.fixture(scope="module")
def model():
    return T.init_model(jax.random.key(0), CFG)


def test_parameter_shapes_and_count(model):
    _, params = model
    b = params["blocks"]
    L, D, H, K, F = CFG.n_layers, CFG.d_model, CFG.n_heads, CFG.d_head, CFG.d_ff
    assert b["attn"]["wq"]["kernel"].shape == (L, D, H, K)
    assert b["attn"]["wo"]["kernel"].shape == (L, H, K, D)
    assert b["mlp"]["w1"]["kernel"].shape == (L, D, F) and b["mlp"]["w2"]["bias"].shape == (L, D)
    assert params["pos"].shape == (CFG.seq_len, D) and params["unembed"]["kernel"].shape == (D, 16)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}
    count = sum(x.size for x in jax.tree.leaves(params))
    assert count == T.param_count(CFG) == 18432


def test_forward_equals_the_nnx_module_in_float64(model):
    graphdef, params = model
    tokens = jax.random.randint(jax.random.key(1), (3, CFG.seq_len), 0, CFG.vocab)
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
        ref = T.apply(graphdef, p64, tokens)
        got = T.forward(p64, tokens)
        assert ref.dtype == got.dtype == jnp.float64
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12)
    assert ref.shape == (3, CFG.seq_len, CFG.vocab)


def test_attention_is_causal(model):
    # Changing a later token must not change any earlier position's logits.
    _, params = model
    tokens = jax.random.randint(jax.random.key(2), (2, CFG.seq_len), 0, CFG.vocab)
    changed = tokens.at[:, 9].set((tokens[:, 9] + 1) % CFG.vocab)
    a, b = T.forward(params, tokens), T.forward(params, changed)
    np.testing.assert_array_equal(a[:, :9], b[:, :9])
    assert float(jnp.abs(a[:, 9:] - b[:, 9:]).max()) > 1e-4


def test_causal_attention_offsets_select_the_same_keys_as_one_block():
    # A query block at global offset 8 attending to the key block at 0 (all visible) and at 8 (causal):
    # together they equal the rows 8..15 of attention over the whole sequence.
    q, k, v = jax.random.normal(jax.random.key(3), (3, 1, 16, 2, 4))
    full = T.causal_attention(q, k, v)
    scores_full = T.causal_attention(q[:, 8:], k, v, q_offset=8)
    np.testing.assert_allclose(scores_full, full[:, 8:], atol=1e-6)
    nothing = T.causal_attention(q[:, :8], k[:, 8:], v[:, 8:], q_offset=0, k_offset=8)
    assert float(jnp.abs(nothing).max()) == 0.0  # no visible key: zeros, not NaN


def test_flops_per_token_counts_the_matmuls():
    d, f, s, v = CFG.d_model, CFG.d_ff, CFG.seq_len, CFG.vocab
    assert T.flops_per_token(CFG) == CFG.n_layers * (8 * d * d + 4 * d * f + 4 * s * d) + 2 * d * v


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"d_model": 30, "n_heads": 8}, "not divisible by n_heads=8"),
        ({"n_layers": 0}, "n_layers=0 must be a positive integer"),
        ({"vocab": 1}, "vocab=1 must be at least 2"),
    ],
)
def test_bad_configs_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        T.TransformerConfig(**kwargs)

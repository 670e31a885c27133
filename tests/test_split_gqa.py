"""Grouped- and multi-query attention under tensor parallelism (course_lib.split_gqa): values against one
device in float64 at 1, 2, 4 and 8 devices, what each device holds, and the errors for layouts that do not
split."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import P
from jax.sharding import NamedSharding

from course_lib import split_gqa as G
from course_lib import transformer as T
from course_lib.meshes import MODEL, mesh_of

D, H, DH = 16, 8, 4
HEADS = {"wq": P(None, MODEL), "wk": P(None, MODEL), "wv": P(None, MODEL), "wo": P(MODEL)}


def _params(h_kv):
    shapes = {"wq": (D, H, DH), "wk": (D, h_kv, DH), "wv": (D, h_kv, DH), "wo": (H, DH, D)}
    return {
        w: jax.random.normal(jax.random.key(i), s, jnp.float64) / 4
        for i, (w, s) in enumerate(shapes.items())
    }


def test_gqa_equals_attention_with_repeated_heads():
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(9), (2, 8, D), jnp.float64)
        p = _params(2)
        q = jnp.einsum("bsd,dhe->bshe", x, p["wq"])
        k, v = (jnp.repeat(jnp.einsum("bsd,dhe->bshe", x, p[w]), 4, axis=2) for w in ("wk", "wv"))
        want = jnp.einsum("bshe,hed->bsd", T.causal_attention(q, k, v), p["wo"])
        assert float(jnp.abs(G.gqa_attention(x, p) - want).max()) < 1e-12


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("h_kv", [1, 2, 8])
def test_tp_gqa_values_and_bytes_held(report, n, h_kv):
    with jax.enable_x64(True):
        mesh = mesh_of({MODEL: n}, list(report.devices[:n]), axis_type="auto")
        x = jax.random.normal(jax.random.key(9), (2, 8, D), jnp.float64)
        p = _params(h_kv)
        laid = {w: G.tp_kv_heads(a, n) if w in ("wk", "wv") else a for w, a in p.items()}
        laid = {w: jax.device_put(a, NamedSharding(mesh, HEADS[w])) for w, a in laid.items()}
        f = jax.shard_map(
            lambda x, p: G.tp_gqa_attention(x, p, MODEL),
            mesh=mesh,
            in_specs=(P(), HEADS),
            out_specs=P(),
        )
        got = jax.jit(f)(x, laid)
        assert float(jnp.abs(got - G.gqa_attention(x, p)).max()) < 1e-12
        held = sum(laid[w].addressable_shards[0].data.nbytes for w in ("wk", "wv"))
        assert held == G.kv_weight_bytes(D, h_kv, DH, n, 8) == 2 * D * max(h_kv // n, 1) * DH * 8
        shards = {np.asarray(s.data).tobytes() for s in laid["wk"].addressable_shards}
        assert len(shards) == min(h_kv, n)


def test_kv_weight_bytes_of_multi_head_attention():
    assert G.kv_weight_bytes(12288, 96, 128, 8, 2) == 2 * 12288 * 12 * 128 * 2


def test_bad_layouts_raise():
    with pytest.raises(ValueError, match="n_kv_heads=3 must divide n_heads=8"):
        G.check_layout(8, 3, 1)
    with pytest.raises(ValueError, match="n=5 devices must divide n_heads=12"):
        G.check_layout(12, 4, 5)
    with pytest.raises(ValueError, match="one must divide the other"):
        G.check_layout(12, 4, 6)
    with pytest.raises(ValueError, match="one must divide the other"):
        G.tp_kv_heads(jnp.zeros((4, 4, 2)), 6)
    with pytest.raises(ValueError, match="must divide n_heads"):
        G.gqa_attention(
            jnp.zeros((1, 2, 4)), {"wq": jnp.zeros((4, 4, 2)), "wk": jnp.zeros((4, 3, 2))}
        )

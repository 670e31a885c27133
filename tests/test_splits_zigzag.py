"""course_lib.splits_zigzag: the layouts, the ring given global positions, and the mask counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import P

from course_lib import splits_zigzag as zz
from course_lib import transformer
from course_lib.meshes import CONTEXT, mesh_of


def test_zigzag_order_pairs_chunk_r_with_chunk_2n_minus_1_minus_r():
    assert zz.zigzag_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert zz.zigzag_order(4, 1).tolist() == [0, 1, 2, 3]
    assert sorted(zz.zigzag_order(48, 4).tolist()) == list(range(48))


@pytest.mark.parametrize(
    "call", [lambda: zz.zigzag_order(12, 4), lambda: zz.contiguous_order(10, 4)]
)
def test_a_length_that_does_not_split_is_refused_by_value(call):
    with pytest.raises(ValueError, match="sequence of 1[02] positions on 4 device.*divisible by"):
        call()


@pytest.mark.parametrize("n", [2, 4, 8])
def test_counts_from_the_masks(n):
    s = 4 * n
    cont = zz.block_masks(zz.contiguous_order(s, n), n)
    zig = zz.block_masks(zz.zigzag_order(s, n), n)
    assert zz.visible_blocks(cont).tolist() == list(range(1, n + 1))
    assert zz.visible_blocks(zig).tolist() == [n] * n
    assert len(set(zz.visible_scores(zig).tolist())) == 1
    assert zz.visible_scores(cont).sum() == zz.visible_scores(zig).sum() == s * (s + 1) // 2
    assert set(zz.visible_chunks(zig)[:, 1:].ravel().tolist()) == {2}


def test_layout_counts_are_the_three_counts_of_the_masks():
    order = zz.zigzag_order(16, 4)
    got, masks = zz.layout_counts(order, 4), zz.block_masks(order, 4)
    assert set(got) == {"blocks", "scores", "quarters"}
    assert (got["blocks"] == zz.visible_blocks(masks)).all()
    assert (got["scores"] == zz.visible_scores(masks)).all()
    assert got["quarters"].shape == (4, 4) and (got["quarters"] == zz.visible_chunks(masks)).all()
    with pytest.raises(ValueError, match="do not halve"):
        zz.layout_counts(zz.contiguous_order(12, 4), 4)  # blocks of 3 positions


def test_ring_at_positions_equals_causal_attention_in_both_layouts(report):
    n, s = 4, 16
    mesh = mesh_of({CONTEXT: n}, report.devices[:n], axis_type="auto")
    seq = P(None, CONTEXT)
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.standard_normal((2, s, 3, 4))) for _ in range(3))
        want = np.asarray(transformer.causal_attention(q, k, v))
        f = jax.jit(
            jax.shard_map(
                lambda q, k, v, p: zz.ring_attention_at(q, k, v, p, CONTEXT),
                mesh=mesh, in_specs=(seq,) * 3 + (P(CONTEXT),), out_specs=seq,
            )
        )  # fmt: skip
        for order in (zz.contiguous_order(s, n), zz.zigzag_order(s, n)):
            got = f(q[:, order], k[:, order], v[:, order], jnp.asarray(order, jnp.int32))
            np.testing.assert_allclose(np.asarray(got)[:, np.argsort(order)], want, atol=1e-12)

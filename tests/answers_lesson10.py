"""Answers to lesson 10's exercises, right and wrong, for tests/test_checks_lesson10.py."""

import math

import jax
import jax.numpy as jnp
from jax import lax

from course_lib import splits, transformer

# ---- ring attention -----------------------------------------------------------------------------------------

ring_reference = splits.ring_attention


def _ring(q, k, v, axis, *, per_block=False, mask_wrapped=True, mask=True, send_q=False):
    n, me, blk = lax.axis_size(axis), lax.axis_index(axis), q.shape[1]
    qi = me * blk + jnp.arange(blk)[:, None]
    m = jnp.full((q.shape[0], q.shape[2], blk), -jnp.inf, q.dtype)
    denom = jnp.zeros_like(m)
    o = jnp.zeros((q.shape[0], q.shape[2], blk, q.shape[3]), q.dtype)
    ring = [(i, (i + 1) % n) for i in range(n)]
    for t in range(n):
        src = (me - t) % n
        kj = src * blk + jnp.arange(blk)[None, :]
        s = jnp.einsum("bqhk,bthk->bhqt", q, k) / math.sqrt(q.shape[-1])
        if mask:
            visible = qi >= kj
            if not mask_wrapped:
                visible = visible | (src < me)  # only the diagonal block is masked by position
                visible = jnp.where(t == 0, qi >= kj, jnp.ones_like(visible))
            s = jnp.where(visible, s, -jnp.inf)
        if per_block:
            w = jax.nn.softmax(s, -1)
            w = jnp.where(jnp.isnan(w), 0.0, w)
            o = o + jnp.einsum("bhqt,bthk->bhqk", w, v)
            denom = jnp.ones_like(denom)
        else:
            m_new = jnp.maximum(m, s.max(-1))
            safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            w = jnp.exp(s - safe[..., None])
            corr = jnp.exp(jnp.where(jnp.isfinite(m), m - safe, -jnp.inf))
            denom = denom * corr + w.sum(-1)
            o = o * corr[..., None] + jnp.einsum("bhqt,bthk->bhqk", w, v)
            m = m_new
        if t < n - 1:
            if send_q:
                k, v, _ = lax.ppermute((k, v, q), axis, ring)
            else:
                k, v = lax.ppermute((k, v), axis, ring)
    return (o / jnp.where(denom > 0, denom, 1.0)[..., None]).transpose(0, 2, 1, 3)


def ring_scan(q, k, v, axis):
    """Another correct form: lax.scan over the steps, the log-sum-exp carried; n sends (the last unused)."""
    n, me, blk = lax.axis_size(axis), lax.axis_index(axis), q.shape[1]
    qi = me * blk + jnp.arange(blk)[:, None]
    ring = [(i, (i + 1) % n) for i in range(n)]

    def step(carry, t):
        k, v, lse, o = carry
        kj = ((me - t) % n) * blk + jnp.arange(blk)[None, :]
        s = jnp.einsum("bqhk,bthk->bhqt", q, k) / math.sqrt(q.shape[-1])
        s = jnp.where(qi >= kj, s, -jnp.inf)
        blk_lse = jax.nn.logsumexp(s, -1)
        new = jnp.logaddexp(lse, blk_lse)
        safe = jnp.where(jnp.isfinite(new), new, 0.0)
        o = o * jnp.exp(lse - safe)[..., None] + jnp.einsum(
            "bhqt,bthk->bhqk", jnp.exp(s - safe[..., None]), v
        )
        k, v = lax.ppermute((k, v), axis, ring)
        return (k, v, new, o), None

    lse = jnp.full((q.shape[0], q.shape[2], blk), -jnp.inf, q.dtype)
    o = jnp.zeros((q.shape[0], q.shape[2], blk, q.shape[3]), q.dtype)
    lse, o = (lax.pcast(a, (axis,), to="varying") for a in (lse, o))  # carries vary over the ring
    (_, _, _, o), _ = lax.scan(step, (k, v, lse, o), jnp.arange(n))
    return o.transpose(0, 2, 1, 3)


def ring_per_block(q, k, v, axis):
    return _ring(q, k, v, axis, per_block=True)


def ring_no_wrap_mask(q, k, v, axis):
    return _ring(q, k, v, axis, mask_wrapped=False)


def ring_no_mask(q, k, v, axis):
    return _ring(q, k, v, axis, mask=False)


def ring_sends_q(q, k, v, axis):
    return _ring(q, k, v, axis, send_q=True)


def ring_gathered(q, k, v, axis):
    """Gathers the whole K and V: right values, memory of the full sequence."""
    me, blk = lax.axis_index(axis), q.shape[1]
    k_all = lax.all_gather(k, axis, axis=1, tiled=True)
    v_all = lax.all_gather(v, axis, axis=1, tiled=True)
    return transformer.causal_attention(q, k_all, v_all, q_offset=me * blk)


# ---- ZeRO-3 -----------------------------------------------------------------------------------------------

zero3_reference = splits.zero3_blocks


def zero3_loop(x, blocks, axis):
    """Another correct form: a Python loop over the layers, each gather + block checkpointed."""

    @jax.checkpoint
    def layer(h, shard):
        return transformer.block(
            h, jax.tree.map(lambda a: lax.all_gather(a, axis, tiled=True), shard)
        )

    for i in range(jax.tree.leaves(blocks)[0].shape[0]):
        x = layer(x, jax.tree.map(lambda a, i=i: a[i], blocks))
    return x


def zero3_upfront(x, blocks, axis):
    """Gathers every layer before the scan: the memory of data parallelism."""
    full = jax.tree.map(lambda a: lax.all_gather(a, axis, axis=1, tiled=True), blocks)
    return lax.scan(lambda h, p: (transformer.block(h, p), None), x, full)[0]


def zero3_no_checkpoint(x, blocks, axis):
    return splits.zero3_blocks(x, blocks, axis, policy=None)


def zero3_gather_outside(x, blocks, axis):
    """The gather outside the checkpoint: the gathered layer is saved for the backward pass."""
    body = jax.checkpoint(lambda h, p: transformer.block(h, p))

    def step(h, shard):
        return body(h, jax.tree.map(lambda a: lax.all_gather(a, axis, tiled=True), shard)), None

    return lax.scan(step, x, blocks)[0]


def zero3_double_grad(x, blocks, axis):
    """Runs the blocks right but scales the gradients n times (a psum of already-summed gradients)."""
    n = lax.axis_size(axis)
    y = splits.zero3_blocks(x, blocks, axis)
    return y + (n - 1) * (y - lax.stop_gradient(y))


# ---- predictions ----------------------------------------------------------------------------------------


def predict(kind, b, s, d, n):
    sent = 2 * 2 * (n - 1) / n * b * s * d * 4
    return sent, b * s * d // (n if kind == "sp" else 1)


def predict_dict(kind, b, s, d, n):
    return {
        "sent": 4 * b * s * d * (n - 1) / n * 4,
        "ln_elements": b * s * d / (1 if kind == "tp" else n),
    }


def predict_sp_half_bytes(
    kind, b, s, d, n
):  # all-gather and reduce-scatter counted as half an all-reduce each... twice
    sent, ln = predict(kind, b, s, d, n)
    return (sent / 2 if kind == "sp" else sent), ln


def predict_sp_full_ln(kind, b, s, d, n):
    return predict(kind, b, s, d, n)[0], b * s * d


def predict_one_allreduce(kind, b, s, d, n):
    sent, ln = predict(kind, b, s, d, n)
    return sent / 2, ln


# ---- the tensor-parallel MLP ------------------------------------------------------------------------------


def tp_mlp(x, p, axis):
    h = jax.nn.gelu(x @ p["w1"]["kernel"] + p["w1"]["bias"])
    return lax.psum(h @ p["w2"]["kernel"], axis) + p["w2"]["bias"]


def tp_mlp_bias_share(x, p, axis):
    """Another correct form: each device adds 1/n of the bias before the psum."""
    h = jax.nn.gelu(x @ p["w1"]["kernel"] + p["w1"]["bias"])
    return lax.psum(h @ p["w2"]["kernel"] + p["w2"]["bias"] / lax.axis_size(axis), axis)


def tp_mlp_bias_before(x, p, axis):
    h = jax.nn.gelu(x @ p["w1"]["kernel"] + p["w1"]["bias"])
    return lax.psum(h @ p["w2"]["kernel"] + p["w2"]["bias"], axis)


def tp_mlp_gelu_after(x, p, axis):
    h = x @ p["w1"]["kernel"] + p["w1"]["bias"]
    return (
        lax.psum(jax.nn.gelu(h) @ p["w2"]["kernel"] * 0 + h @ p["w2"]["kernel"], axis)
        + p["w2"]["bias"]
    )


def tp_mlp_no_b1(x, p, axis):
    h = jax.nn.gelu(x @ p["w1"]["kernel"])
    return lax.psum(h @ p["w2"]["kernel"], axis) + p["w2"]["bias"]

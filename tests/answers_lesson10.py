"""Answers to lesson 10's exercises, right and wrong, for tests/test_checks_lesson10.py."""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.lax import fori_loop

from course_lib import comms, split_time, splits, splits_zigzag, transformer

# ---- ring attention -----------------------------------------------------------------------------------------


def ring_reference(q, k, v, axis):
    """The notebook's solution: the first block folded, then lax.fori_loop(1, n, …) receiving and folding."""
    return _reference(q, k, v, axis)


def ring_short_rings_only(q, k, v, axis):
    """Wrong from rings of 5: step t's block taken for device (me - min(t, 3))'s, right on rings of
    2, 3 and 4 only (the reference otherwise)."""
    return _reference(q, k, v, axis, reach=3)


def _reference(q, k, v, axis, reach=None):
    n_dev, me, blk = lax.axis_size(axis), lax.axis_index(axis), q.shape[1]
    qi = me * blk + jnp.arange(blk)[:, None]
    ring = [(i, (i + 1) % n_dev) for i in range(n_dev)]

    def fold(t, k, v, m, denom, o):
        src = me - (t if reach is None else jnp.minimum(t, reach))
        kj = (src % n_dev) * blk + jnp.arange(blk)[None, :]
        s = jnp.einsum("bqhk,bthk->bhqt", q, k) / math.sqrt(q.shape[-1])
        s = jnp.where(qi >= kj, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        w = jnp.exp(s - safe[..., None])
        scale = jnp.exp(jnp.where(jnp.isfinite(m), m - safe, -jnp.inf))
        denom = denom * scale + w.sum(-1)
        return m_new, denom, o * scale[..., None] + jnp.einsum("bhqt,bthk->bhqk", w, v)

    def step(t, carry):
        k, v = lax.ppermute(carry[:2], axis, ring)
        return (k, v, *fold(t, k, v, *carry[2:]))

    m = jnp.full((q.shape[0], q.shape[2], blk), -jnp.inf, q.dtype)
    o = jnp.zeros((q.shape[0], q.shape[2], blk, q.shape[3]), q.dtype)
    m, o = lax.pcast((m, o), axis, to="varying")
    carry = (k, v, *fold(0, k, v, m, jnp.zeros_like(m), o))
    *_, denom, o = lax.fori_loop(1, n_dev, step, carry)
    return (o / jnp.where(denom > 0, denom, 1.0)[..., None]).transpose(0, 2, 1, 3)


def ring_unrolled(q, k, v, axis):
    """Right values and gradients, written unrolled (a Python for): XLA:CPU issues every ppermute early and
    holds every block, so the compiled temporaries grow with the ring."""
    return _ring(q, k, v, axis)


def ring_zigzag_library(q, k, v, axis):
    """Wrong (the library's ring): splits_zigzag.ring_attention_at with the contiguous positions."""
    blk = q.shape[1]
    pos = lax.axis_index(axis) * blk + jnp.arange(blk, dtype=jnp.int32)
    return splits_zigzag.ring_attention_at(q, k, v, pos, axis)


def ring_library(q, k, v, axis):
    """Calls the library's own ring attention."""
    return splits.ring_attention(q, k, v, axis)


def _ring(q, k, v, axis, *, per_block=False, mask_wrapped=True, mask=True, send_q=False, **how):
    n = how.get("n") or lax.axis_size(axis)  # n=4: a ring hard-coded for 4 devices
    me, blk = lax.axis_index(axis), q.shape[1]
    dt = how.get("dtype", q.dtype)  # float32: the running state made float32 whatever q is
    qi = me * blk + jnp.arange(blk)[:, None]
    m = jnp.full((q.shape[0], q.shape[2], blk), -jnp.inf, dt)
    if how.get("transposed"):  # the running state laid out [H, B, Sq]
        m = jnp.full((q.shape[2], q.shape[0], blk), -jnp.inf, dt)
    denom = jnp.zeros_like(m)
    o = jnp.zeros((q.shape[0], q.shape[2], blk, q.shape[3]), dt)
    ring = [(i, (i + 1) % n) for i in range(n)]
    for t in range(n):
        src = (me + t) % n if how.get("src_ahead") else (me - t) % n
        kj = src * blk + jnp.arange(blk)[None, :]
        s = jnp.einsum("bqhk,bthk->bhqt", q, k) / math.sqrt(q.shape[-1])
        if how.get("local"):  # positions within the block: the offset of the block forgotten
            qi, kj = jnp.arange(blk)[:, None], jnp.arange(blk)[None, :]
        if mask:
            visible = qi >= kj
            if not mask_wrapped:
                visible = visible | (src < me)  # only the diagonal block is masked by position
                visible = jnp.where(t == 0, qi >= kj, jnp.ones_like(visible))
            s = jnp.where(visible, s, how.get("fill", -jnp.inf))
        if per_block:
            w = jax.nn.softmax(s, -1)
            w = jnp.where(jnp.isnan(w), 0.0, w)
            o = o + jnp.einsum("bhqt,bthk->bhqk", w, v)
            denom = jnp.ones_like(denom)
        elif how.get("no_max"):  # exp of the raw scores: no running maximum subtracted
            w = jnp.exp(s)
            denom = denom + w.sum(-1)
            o = o + jnp.einsum("bhqt,bthk->bhqk", w, v)
        else:
            m_new = jnp.maximum(m, s.max(-1))
            safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            w = jnp.exp(s - safe[..., None])
            corr = jnp.exp(jnp.where(jnp.isfinite(m), m - safe, -jnp.inf))
            denom = denom * corr + w.sum(-1)
            o = o * corr[..., None] + jnp.einsum("bhqt,bthk->bhqk", w, v)
            m = m_new
        if t < n - 1 or how.get("send_last"):
            if send_q:
                k, v, _ = lax.ppermute((k, v, q), axis, ring)
            else:
                k, v = lax.ppermute((k, v), axis, ring)
    return (o / jnp.where(denom > 0, denom, 1.0)[..., None]).transpose(0, 2, 1, 3)


def ring_scan(q, k, v, axis):
    """Another correct form: lax.scan over n - 1 steps that score and send, the last block scored after;
    the log-sum-exp carried."""
    n, me, blk = lax.axis_size(axis), lax.axis_index(axis), q.shape[1]
    qi = me * blk + jnp.arange(blk)[:, None]
    ring = [(i, (i + 1) % n) for i in range(n)]

    def fold(k, v, lse, o, t):
        kj = ((me - t) % n) * blk + jnp.arange(blk)[None, :]
        s = jnp.einsum("bqhk,bthk->bhqt", q, k) / math.sqrt(q.shape[-1])
        s = jnp.where(qi >= kj, s, -jnp.inf)
        new = jnp.logaddexp(lse, jax.nn.logsumexp(s, -1))
        safe = jnp.where(jnp.isfinite(new), new, 0.0)
        o = o * jnp.exp(lse - safe)[..., None] + jnp.einsum(
            "bhqt,bthk->bhqk", jnp.exp(s - safe[..., None]), v
        )
        return new, o

    def step(carry, t):
        k, v, lse, o = carry
        lse, o = fold(k, v, lse, o, t)
        k, v = lax.ppermute((k, v), axis, ring)
        return (k, v, lse, o), None

    lse = jnp.full((q.shape[0], q.shape[2], blk), -jnp.inf, q.dtype)
    o = jnp.zeros((q.shape[0], q.shape[2], blk, q.shape[3]), q.dtype)
    lse, o = (lax.pcast(a, (axis,), to="varying") for a in (lse, o))  # carries vary over the ring
    (k, v, lse, o), _ = lax.scan(step, (k, v, lse, o), jnp.arange(n - 1))
    return fold(k, v, lse, o, n - 1)[1].transpose(0, 2, 1, 3)


def ring_flat(q, k, v, axis):
    """Another correct form: (batch, head) pairs flattened into one row axis, [B·H, Sq, Dh], in a scan."""
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    b, blk, h, dh = q.shape

    def rows(a):
        return a.transpose(0, 2, 1, 3).reshape(b * h, blk, dh)

    qf, qi = rows(q), me * blk + jnp.arange(blk)[:, None]

    def fold(t, k, v, m, denom, o):
        kj = ((me - t) % n) * blk + jnp.arange(blk)[None, :]
        s = jnp.where(qi >= kj, jnp.einsum("rqd,rtd->rqt", qf, rows(k)) / math.sqrt(dh), -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        w, corr = (
            jnp.exp(s - safe[..., None]),
            jnp.exp(jnp.where(jnp.isfinite(m), m - safe, -jnp.inf)),
        )
        return m_new, denom * corr + w.sum(-1), o * corr[..., None] + w @ rows(v)

    def step(carry, t):
        k, v, *state = carry
        state = fold(t, k, v, *state)
        return (*lax.ppermute((k, v), axis, [(i, (i + 1) % n) for i in range(n)]), *state), None

    m = lax.pcast(jnp.full((b * h, blk), -jnp.inf, q.dtype), (axis,), to="varying")
    start = (k, v, m, jnp.zeros_like(m), jnp.zeros_like(qf))  # qf varies over the ring already
    (k, v, *state), _ = lax.scan(step, start, jnp.arange(n - 1))
    _, denom, o = fold(n - 1, k, v, *state)
    return (o / denom[..., None]).reshape(b, h, blk, dh).transpose(0, 2, 1, 3)


def ring_no_max(q, k, v, axis):
    return _ring(q, k, v, axis, no_max=True)


def ring_sends_n(q, k, v, axis):
    """Sends K and V n times: the last block received is never used."""
    return _ring(q, k, v, axis, send_last=True)


def ring_four(q, k, v, axis):
    """Hard-coded for a ring of 4."""
    return _ring(q, k, v, axis, n=4)


def ring_src_ahead(q, k, v, axis):
    """Passes blocks to device r + 1 but takes the block held at step t for device r + t's (it is
    r - t's): the same on 2 devices, wrong on 3 or more."""
    return _ring(q, k, v, axis, src_ahead=True)


def ring_transposed(q, k, v, axis):
    """The running maximum and sum laid out [H, B, Sq]."""
    return _ring(q, k, v, axis, transposed=True)


def ring_local_mask(q, k, v, axis):
    """Masks by position within the block, not in the sequence."""
    return _ring(q, k, v, axis, local=True)


def ring_float32(q, k, v, axis):
    """Computes in float32 whatever the inputs' dtype."""
    return _ring(*(a.astype(jnp.float32) for a in (q, k, v)), axis)


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


def _fold(q, k, v, m, denom, o, t, axis, fill=-jnp.inf):
    """One online-softmax step: this device's queries against the block that started on device me - t."""
    n, me, blk = lax.axis_size(axis), lax.axis_index(axis), q.shape[1]
    qi, kj = me * blk + jnp.arange(blk)[:, None], ((me - t) % n) * blk + jnp.arange(blk)[None, :]
    s = jnp.einsum("bqhk,bthk->bhqt", q, k) / math.sqrt(q.shape[-1])
    s = jnp.where(qi >= kj, s, fill)
    m_new = jnp.maximum(m, s.max(-1))
    safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    w = jnp.exp(s - safe[..., None])
    corr = jnp.exp(jnp.where(jnp.isfinite(m), m - safe, -jnp.inf))
    return (
        m_new,
        denom * corr + w.sum(-1),
        o * corr[..., None] + jnp.einsum("bhqt,bthk->bhqk", w, v),
    )


def _start(q, axis):
    m = jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, q.dtype)
    o = jnp.zeros((q.shape[0], q.shape[2], q.shape[1], q.shape[3]), q.dtype)
    return tuple(lax.pcast(a, (axis,), to="varying") for a in (m, jnp.zeros_like(m), o))


def _finish(denom, o):
    return (o / jnp.where(denom > 0, denom, 1.0)[..., None]).transpose(0, 2, 1, 3)


def ring_while(q, k, v, axis):
    """Right values, no gradients: lax.while_loop over n - 1 steps (jax.grad cannot differentiate it)."""
    n = lax.axis_size(axis)
    ring = [(i, (i + 1) % n) for i in range(n)]

    def body(carry):
        t, k, v, m, denom, o = carry
        m, denom, o = _fold(q, k, v, m, denom, o, t, axis)
        k, v = lax.ppermute((k, v), axis, ring)
        return t + 1, k, v, m, denom, o

    t, k, v, m, denom, o = lax.while_loop(lambda c: c[0] < n - 1, body, (0, k, v, *_start(q, axis)))
    return _finish(*_fold(q, k, v, m, denom, o, n - 1, axis)[1:])


def ring_fori(q, k, v, axis):
    """Another correct form: lax.fori_loop with bounds known when traced (it becomes a scan)."""
    n = lax.axis_size(axis)
    ring = [(i, (i + 1) % n) for i in range(n)]

    def body(t, carry):
        k, v, m, denom, o = carry
        m, denom, o = _fold(q, k, v, m, denom, o, t, axis)
        return (*lax.ppermute((k, v), axis, ring), m, denom, o)

    k, v, m, denom, o = lax.fori_loop(0, n - 1, body, (k, v, *_start(q, axis)))
    return _finish(*_fold(q, k, v, m, denom, o, n - 1, axis)[1:])


def ring_carry_index(q, k, v, axis):
    """Another correct form: the block's origin (an int32 scalar, 4 bytes) travels with K and V."""
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    ring = [(i, (i + 1) % n) for i in range(n)]

    def body(t, carry):
        k, v, src, m, denom, o = carry
        m, denom, o = _fold(q, k, v, m, denom, o, me - src, axis)
        return (*lax.ppermute((k, v, src), axis, ring), m, denom, o)

    k, v, src, m, denom, o = lax.fori_loop(0, n - 1, body, (k, v, me, *_start(q, axis)))
    return _finish(*_fold(q, k, v, m, denom, o, me - src, axis)[1:])


def ring_while_count_down(q, k, v, axis):
    """A while_loop whose trip count comes from the device's position: the checker cannot read it."""
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    ring = [(i, (i + 1) % n) for i in range(n)]

    def body(carry):
        t, k, v, m, denom, o = carry
        m, denom, o = _fold(q, k, v, m, denom, o, t - me, axis)
        k, v = lax.ppermute((k, v), axis, ring)
        return t + 1, k, v, m, denom, o

    init = (me, k, v, *_start(q, axis))
    t, k, v, m, denom, o = lax.while_loop(lambda c: c[0] < me + n - 1, body, init)
    return _finish(*_fold(q, k, v, m, denom, o, n - 1, axis)[1:])


def ring_two_pass(q, k, v, axis):
    """Two passes and no online softmax: every K/V block kept, the global maximum and sum from the first
    pass, the output from the second. Right values, memory of the full sequence's K and V."""
    n, me, blk = lax.axis_size(axis), lax.axis_index(axis), q.shape[1]
    qi = me * blk + jnp.arange(blk)[:, None]
    ks, vs = [k], [v]
    for _ in range(n - 1):
        k, v = lax.ppermute((k, v), axis, [(i, (i + 1) % n) for i in range(n)])
        ks, vs = ks + [k], vs + [v]

    def scores(t):
        kj = ((me - t) % n) * blk + jnp.arange(blk)[None, :]
        s = jnp.einsum("bqhk,bthk->bhqt", q, ks[t]) / math.sqrt(q.shape[-1])
        return jnp.where(qi >= kj, s, -jnp.inf)

    m = functools.reduce(jnp.maximum, [scores(t).max(-1) for t in range(n)])
    w = [jnp.exp(scores(t) - m[..., None]) for t in range(n)]
    o = sum(jnp.einsum("bhqt,bthk->bhqk", w[t], vs[t]) for t in range(n))
    return (o / sum(x.sum(-1) for x in w)[..., None]).transpose(0, 2, 1, 3)


def ring_keeps_scores(q, k, v, axis):
    """Scores every block as it arrives and keeps the scores and V blocks; one softmax at the end."""
    n, me, blk = lax.axis_size(axis), lax.axis_index(axis), q.shape[1]
    qi = me * blk + jnp.arange(blk)[:, None]
    ss, vs = [], []
    for t in range(n):
        kj = ((me - t) % n) * blk + jnp.arange(blk)[None, :]
        s = jnp.einsum("bqhk,bthk->bhqt", q, k) / math.sqrt(q.shape[-1])
        ss, vs = ss + [jnp.where(qi >= kj, s, -jnp.inf)], vs + [v]
        if t < n - 1:
            k, v = lax.ppermute((k, v), axis, [(i, (i + 1) % n) for i in range(n)])
    m = functools.reduce(jnp.maximum, [s.max(-1) for s in ss])
    w = [jnp.exp(s - m[..., None]) for s in ss]
    o = sum(jnp.einsum("bhqt,bthk->bhqk", a, b) for a, b in zip(w, vs))
    return (o / sum(a.sum(-1) for a in w)[..., None]).transpose(0, 2, 1, 3)


def ring_two_rounds(q, k, v, axis):
    """Two passes round the ring, the blocks sent again for the second: memory of one block, twice the
    bytes."""
    n, me, blk = lax.axis_size(axis), lax.axis_index(axis), q.shape[1]
    qi = me * blk + jnp.arange(blk)[:, None]
    ring = [(i, (i + 1) % n) for i in range(n)]

    def scores(k, t):
        kj = ((me - t) % n) * blk + jnp.arange(blk)[None, :]
        s = jnp.einsum("bqhk,bthk->bhqt", q, k) / math.sqrt(q.shape[-1])
        return jnp.where(qi >= kj, s, -jnp.inf)

    m, k0, v0 = None, k, v
    for t in range(n):
        m = scores(k, t).max(-1) if m is None else jnp.maximum(m, scores(k, t).max(-1))
        k = lax.ppermute(k, axis, ring) if t < n - 1 else k
    k, v, denom, o = k0, v0, 0.0, 0.0
    for t in range(n):
        w = jnp.exp(scores(k, t) - m[..., None])
        denom, o = denom + w.sum(-1), o + jnp.einsum("bhqt,bthk->bhqk", w, v)
        if t < n - 1:
            k, v = lax.ppermute((k, v), axis, ring)
    return (o / denom[..., None]).transpose(0, 2, 1, 3)


def ring_fill_big(q, k, v, axis):
    """Another correct form: masked scores filled with -1e30 instead of -inf."""
    n = lax.axis_size(axis)
    ring = [(i, (i + 1) % n) for i in range(n)]
    fold = functools.partial(_fold, q, axis=axis, fill=-1e30)

    def body(t, carry):
        k, v, m, denom, o = carry
        return (*lax.ppermute((k, v), axis, ring), *fold(k, v, m, denom, o, t))

    k, v, m, denom, o = lax.fori_loop(0, n - 1, body, (k, v, *_start(q, axis)))
    return _finish(*fold(k, v, m, denom, o, n - 1)[1:])


def ring_max_from_zero(q, k, v, axis):
    """The running maximum starts at 0, not -inf: where every score is far below 0, exp underflows to 0
    and the result is 0/0."""
    n, me, blk = lax.axis_size(axis), lax.axis_index(axis), q.shape[1]
    qi = me * blk + jnp.arange(blk)[:, None]
    m = jnp.zeros((q.shape[0], q.shape[2], blk), q.dtype)
    denom, o = jnp.zeros_like(m), jnp.zeros((q.shape[0], q.shape[2], blk, q.shape[3]), q.dtype)
    for t in range(n):
        kj = ((me - t) % n) * blk + jnp.arange(blk)[None, :]
        s = jnp.einsum("bqhk,bthk->bhqt", q, k) / math.sqrt(q.shape[-1])
        s = jnp.where(qi >= kj, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        w, corr = jnp.exp(s - m_new[..., None]), jnp.exp(m - m_new)
        denom = denom * corr + w.sum(-1)
        o = o * corr[..., None] + jnp.einsum("bhqt,bthk->bhqk", w, v)
        m = m_new
        if t < n - 1:
            k, v = lax.ppermute((k, v), axis, [(i, (i + 1) % n) for i in range(n)])
    return (o / denom[..., None]).transpose(0, 2, 1, 3)


def ring_scan_cond_send(q, k, v, axis):
    """Right values: lax.scan over n steps, each receiving the next block under lax.cond(t > 0) first, so
    that it sends n - 1 times when run; the checker cannot tell how often a cond branch runs."""
    n = lax.axis_size(axis)
    ring = [(i, (i + 1) % n) for i in range(n)]

    def body(carry, t):
        k, v, m, denom, o = carry
        send = functools.partial(lax.ppermute, axis_name=axis, perm=ring)
        k, v = lax.cond(t > 0, send, lambda kv: kv, (k, v))
        return (k, v, *_fold(q, k, v, m, denom, o, t, axis)), None

    (k, v, m, denom, o), _ = lax.scan(body, (k, v, *_start(q, axis)), jnp.arange(n))
    return _finish(denom, o)


# ---- ZeRO-3 -----------------------------------------------------------------------------------------------


def zero3_reference(x, blocks, axis, policy=jax.checkpoint_policies.nothing_saveable, cast=None):
    """The notebook's solution (``policy=None``: no checkpoint; ``cast``: the dtype the shards travel in)."""

    def layer(h, shard):
        if cast is not None:
            shard = jax.tree.map(lambda a: a.astype(cast), shard)
        full = jax.tree.map(lambda a: lax.all_gather(a, axis, axis=0, tiled=True), shard)
        return transformer.block(h, jax.tree.map(lambda a: a.astype(h.dtype), full))

    if policy is not None:
        layer = jax.checkpoint(layer, policy=policy)
    return lax.scan(lambda h, s: (layer(h, s), None), x, blocks)[0]


def zero3_library(x, blocks, axis):
    return splits.zero3_blocks(x, blocks, axis)


def zero3_bf16(x, blocks, axis):
    """Gathers the shards in bfloat16."""
    return zero3_reference(x, blocks, axis, cast=jnp.bfloat16)


def zero3_psum_gather(x, blocks, axis):
    """Gathers by placing the shard in a zero array and summing over the devices (an all-reduce)."""
    n, me = lax.axis_size(axis), lax.axis_index(axis)

    def gather(a):
        full = jnp.zeros((n * a.shape[0],) + a.shape[1:], a.dtype)
        return lax.psum(lax.dynamic_update_slice_in_dim(full, a, me * a.shape[0], 0), axis)

    layer = jax.checkpoint(lambda h, s: transformer.block(h, jax.tree.map(gather, s)))
    return lax.scan(lambda h, s: (layer(h, s), None), x, blocks)[0]


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


def _gathered_block(h, shard, axis):
    return transformer.block(h, jax.tree.map(lambda a: lax.all_gather(a, axis, tiled=True), shard))


_checkpointed_once = jax.checkpoint(
    _gathered_block, static_argnums=(2,), policy=jax.checkpoint_policies.nothing_saveable
)


def zero3_checkpoint_made_once(x, blocks, axis):
    """Right in the repository, but its jax.checkpoint is made once, at import: the student package's
    splits.zero3_blocks(…, policy=None) cannot switch it off (the lesson's later cells compare it)."""
    return lax.scan(lambda h, s: (_checkpointed_once(h, s, axis), None), x, blocks)[0]


def zero3_upfront(x, blocks, axis):
    """Gathers every layer before the scan: the memory of data parallelism."""
    full = jax.tree.map(lambda a: lax.all_gather(a, axis, axis=1, tiled=True), blocks)
    return lax.scan(lambda h, p: (transformer.block(h, p), None), x, full)[0]


def zero3_no_checkpoint(x, blocks, axis):
    return zero3_reference(x, blocks, axis, policy=None)


def zero3_gather_outside(x, blocks, axis):
    """The gather outside the checkpoint: the gathered layer is saved for the backward pass."""
    body = jax.checkpoint(lambda h, p: transformer.block(h, p))

    def step(h, shard):
        return body(h, jax.tree.map(lambda a: lax.all_gather(a, axis, tiled=True), shard)), None

    return lax.scan(step, x, blocks)[0]


def zero3_dots(x, blocks, axis):
    """Another correct form: each layer checkpointed with dots_saveable (the matmuls' outputs saved; the
    gathers, not dots, are still redone in the backward pass)."""
    return zero3_reference(x, blocks, axis, policy=jax.checkpoint_policies.dots_saveable)


def zero3_save_everything(x, blocks, axis):
    """Each layer checkpointed with everything_saveable: the gathered layers are saved, not gathered again."""
    return zero3_reference(x, blocks, axis, policy=jax.checkpoint_policies.everything_saveable)


def zero3_gather_all_checkpointed(x, blocks, axis):
    """Gathers every layer (one gather per layer and leaf) before the first block, all in one checkpoint:
    the backward gathers again, but every layer is whole at once."""
    n_layers = jax.tree.leaves(blocks)[0].shape[0]

    @jax.checkpoint
    def run(x, blocks):
        full = [
            jax.tree.map(lambda a, i=i: lax.all_gather(a[i], axis, tiled=True), blocks)
            for i in range(n_layers)
        ]
        for p in full:
            x = transformer.block(x, p)
        return x

    return run(x, blocks)


def zero3_one_checkpoint(x, blocks, axis):
    """Gathers each layer just before it, but one jax.checkpoint around all the layers: the backward pass
    recomputes the whole forward and keeps every gathered layer for the layers' gradients."""
    n_layers = jax.tree.leaves(blocks)[0].shape[0]

    @jax.checkpoint
    def run(x, blocks):
        for i in range(n_layers):
            full = jax.tree.map(lambda a, i=i: lax.all_gather(a[i], axis, tiled=True), blocks)
            x = transformer.block(x, full)
        return x

    return run(x, blocks)


# ---- predictions ----------------------------------------------------------------------------------------


def predict(kind, compiler, b, s, d, n):
    act = b * s * d  # one [B, S, D] activation, elements
    all_reduce, gather = 2 * (n - 1) / n * act, (n - 1) / n * act  # ring costs, elements
    sent = (
        2 * all_reduce * 4
    )  # TP: two float32 all-reduces; SP on XLA:CPU: gather + scatter, the same
    if kind == "sp" and compiler == "XLA:TPU":
        sent += 2 * gather * 2  # the bfloat16 gathers, beside the float32 all-reduces
    return sent, act // (n if kind == "sp" else 1)


def predict_dict(kind, compiler, b, s, d, n):
    """Another correct form: a dict; XLA:TPU's SP at 1.25 × TP's bytes (a bfloat16 gather: 1/4 of the
    float32 all-reduce's bytes)."""
    tp = 4 * b * s * d * (n - 1) / n * 4
    return {
        "sent": tp * (1.25 if (kind, compiler) == ("sp", "XLA:TPU") else 1),
        "ln_elements": b * s * d / (1 if kind == "tp" else n),
    }


def predict_library(kind, compiler, b, s, d, n):
    return tuple(splits.predict_tp_sp(kind, b, s, d, n, compiler=compiler).values())


def predict_split_cost(kind, compiler, b, s, d, n):
    """Right values read from section 6's model (split_time.split_cost lists TP's and SP's collectives with
    their ring bytes): the model the exercise asks for, not a prediction."""
    if n == 1:
        return 0.0, b * s * d
    # n heads of width d (the split needs the heads divisible by n): every byte n times, divided back
    cfg = transformer.TransformerConfig(16, s, d * n, n, d * n, 1)

    def sent(split, itemsize):
        cost = split_time.split_cost(split, cfg, b, n, itemsize)
        return sum(t.sent_bytes for t in cost.transfers) / n

    if kind == "tp":
        return sent("tp", 4), b * s * d
    if compiler == "XLA:CPU":
        return sent("sp", 4), b * s * d // n
    return sent("tp", 4) + sent(
        "sp", 2
    ) / 2, b * s * d // n  # the all-reduces, and the bf16 gathers


def predict_comms_ring_bytes(kind, compiler, b, s, d, n):
    """Right, with comms.ring_bytes (the ring model the exercise names) for each collective's cost."""
    act = b * s * d
    sent = 2 * comms.ring_bytes("all-reduce", 4.0 * act, n)
    if kind == "sp" and compiler == "XLA:TPU":
        sent += 2 * comms.ring_bytes("all-gather", 2.0 * act, n)
    return sent, act // n if kind == "sp" else act


def predict_strings(kind, compiler, b, s, d, n):
    """Wrong form: the right values as text."""
    sent, ln = predict(kind, compiler, b, s, d, n)
    return str(sent), str(ln)


def predict_wrong_at_one(kind, compiler, b, s, d, n):
    """Wrong only at n = 1: the ring factor taken as 1 there instead of 0 (one device sends nothing)."""
    sent, ln = predict(kind, compiler, b, s, d, n)
    return (sent if n > 1 else 16 * b * s * d), ln


def predict_tpu_only_eight(kind, compiler, b, s, d, n):
    """XLA:TPU's gathers costed with 8 chips' (n-1)/n = 7/8 whatever n is."""
    sent, ln = predict(kind, compiler, b, s, d, n)
    if (kind, compiler) == ("sp", "XLA:TPU"):
        sent += 2 * (7 / 8 - (n - 1) / n) * b * s * d * 2
    return sent, ln


def predict_cpu_only(kind, compiler, b, s, d, n):
    """XLA:CPU's program on both compilers: the same bytes for SP as for TP everywhere."""
    return predict(kind, "XLA:CPU", b, s, d, n)


def predict_tpu_scatter_kept(kind, compiler, b, s, d, n):
    """XLA:TPU's bfloat16 gathers, but its all-reduces costed as the reduce-scatters they replaced."""
    sent, ln = predict(kind, compiler, b, s, d, n)
    if (kind, compiler) == ("sp", "XLA:TPU"):
        sent -= 2 * (n - 1) / n * b * s * d * 4
    return sent, ln


def predict_tpu_gathers_f32(kind, compiler, b, s, d, n):
    """XLA:TPU's all-reduces and gathers, the gathers costed in float32."""
    sent, ln = predict(kind, compiler, b, s, d, n)
    if (kind, compiler) == ("sp", "XLA:TPU"):
        sent += 2 * (n - 1) / n * b * s * d * 2
    return sent, ln


def predict_tpu_full_ln(kind, compiler, b, s, d, n):
    """XLA:TPU's all-reduce leaves every device the whole sum: a LayerNorm of the whole sequence."""
    sent, ln = predict(kind, compiler, b, s, d, n)
    return sent, (b * s * d if compiler == "XLA:TPU" else ln)


def predict_sp_half_bytes(kind, compiler, b, s, d, n):
    """All-gather and reduce-scatter counted as half an all-reduce together."""
    sent, ln = predict(kind, compiler, b, s, d, n)
    return (sent / 2 if kind == "sp" else sent), ln


def predict_sp_full_ln(kind, compiler, b, s, d, n):
    return predict(kind, compiler, b, s, d, n)[0], b * s * d


def predict_one_allreduce(kind, compiler, b, s, d, n):
    sent, ln = predict(kind, compiler, b, s, d, n)
    return sent / 2, ln


# ---- the tensor-parallel MLP ------------------------------------------------------------------------------


def tp_mlp(x, p, axis):
    h = jax.nn.gelu(x @ p["w1"]["kernel"] + p["w1"]["bias"])
    return lax.psum(h @ p["w2"]["kernel"], axis) + p["w2"]["bias"]


def tp_mlp_bias_share(x, p, axis):
    """Another correct form: each device adds 1/n of the bias before the psum."""
    h = jax.nn.gelu(x @ p["w1"]["kernel"] + p["w1"]["bias"])
    return lax.psum(h @ p["w2"]["kernel"] + p["w2"]["bias"] / lax.axis_size(axis), axis)


def tp_mlp_library(x, p, axis):
    return splits.tp_mlp(x, p, axis)


def tp_mlp_bias_eighth(x, p, axis):
    """Adds w2's bias divided by 8 on each device: right on 8 devices only."""
    h = jax.nn.gelu(x @ p["w1"]["kernel"] + p["w1"]["bias"])
    return lax.psum(h @ p["w2"]["kernel"] + p["w2"]["bias"] / 8, axis)


def tp_mlp_pmean(x, p, axis):
    h = jax.nn.gelu(x @ p["w1"]["kernel"] + p["w1"]["bias"])
    return lax.pmean(h @ p["w2"]["kernel"], axis) + p["w2"]["bias"]


def tp_mlp_pmean_bias(x, p, axis):
    """Right values, one extra collective: a pmean of w2's (already replicated) bias."""
    h = jax.nn.gelu(x @ p["w1"]["kernel"] + p["w1"]["bias"])
    return lax.psum(h @ p["w2"]["kernel"], axis) + lax.pmean(p["w2"]["bias"], axis)


def tp_mlp_no_return(x, p, axis):
    """Forgets the return."""
    h = jax.nn.gelu(x @ p["w1"]["kernel"] + p["w1"]["bias"])
    lax.psum(h @ p["w2"]["kernel"], axis) + p["w2"]["bias"]


def tp_mlp_dict(x, p, axis):
    h = jax.nn.gelu(x @ p["w1"]["kernel"] + p["w1"]["bias"])
    return {"out": lax.psum(h @ p["w2"]["kernel"], axis) + p["w2"]["bias"]}


def tp_mlp_hidden(x, p, axis):
    """Returns the hidden activations, [T, F/n], summed over the devices."""
    return lax.psum(jax.nn.gelu(x @ p["w1"]["kernel"] + p["w1"]["bias"]), axis)


def tp_mlp_float32(x, p, axis):
    h = jax.nn.gelu(x.astype(jnp.float32) @ p["w1"]["kernel"].astype(jnp.float32) + p["w1"]["bias"])
    return lax.psum(h @ p["w2"]["kernel"], axis) + p["w2"]["bias"]


def tp_mlp_bias_before(x, p, axis):
    h = jax.nn.gelu(x @ p["w1"]["kernel"] + p["w1"]["bias"])
    return lax.psum(h @ p["w2"]["kernel"] + p["w2"]["bias"], axis)


def tp_mlp_gelu_after(x, p, axis):
    h = x @ p["w1"]["kernel"] + p["w1"]["bias"]
    return (
        lax.psum(jax.nn.gelu(h) @ p["w2"]["kernel"] * 0 + h @ p["w2"]["kernel"], axis)
        + p["w2"]["bias"]
    )


def tp_mlp_gather_weights(x, p, axis):
    """Gathers the weight shards: every device computes the whole MLP (pmean makes it replicated)."""
    w1, b1, w2 = (
        lax.all_gather(w, axis, axis=a, tiled=True)
        for w, a in ((p["w1"]["kernel"], 1), (p["w1"]["bias"], 0), (p["w2"]["kernel"], 0))
    )
    return lax.pmean(jax.nn.gelu(x @ w1 + b1) @ w2 + p["w2"]["bias"], axis)


def tp_mlp_gather_plain(x, p, axis):
    """Gathers the weight shards and returns the product as it is: shard_map cannot tell it is replicated."""
    w1, b1, w2 = (
        lax.all_gather(w, axis, axis=a, tiled=True)
        for w, a in ((p["w1"]["kernel"], 1), (p["w1"]["bias"], 0), (p["w2"]["kernel"], 0))
    )
    return jax.nn.gelu(x @ w1 + b1) @ w2 + p["w2"]["bias"]


def tp_mlp_psum_weights(x, p, axis):
    """Rebuilds the whole weights by summing zero-padded shards over the devices (an all-reduce)."""
    n, me = lax.axis_size(axis), lax.axis_index(axis)

    def whole(a, dim):
        full = jnp.zeros(a.shape[:dim] + (n * a.shape[dim],) + a.shape[dim + 1 :], a.dtype)
        return lax.psum(lax.dynamic_update_slice_in_dim(full, a, me * a.shape[dim], dim), axis)

    h = jax.nn.gelu(x @ whole(p["w1"]["kernel"], 1) + whole(p["w1"]["bias"], 0))
    return h @ whole(p["w2"]["kernel"], 0) + p["w2"]["bias"]


def tp_mlp_gather_hidden(x, p, axis):
    """Gathers the hidden activation [T, F] and w2's rows, no psum."""
    h = jax.nn.gelu(x @ p["w1"]["kernel"] + p["w1"]["bias"])
    h, w2 = (
        lax.all_gather(h, axis, axis=1, tiled=True),
        lax.all_gather(p["w2"]["kernel"], axis, tiled=True),
    )
    return lax.pmean(h @ w2, axis) + p["w2"]["bias"]


def tp_mlp_scatter_gather(x, p, axis):
    """Right values, wrong traffic: the partial outputs reduce-scattered over D (padded to a multiple of
    n) and gathered again, instead of one psum. Activations are gathered, not weights."""
    h = jax.nn.gelu(x @ p["w1"]["kernel"] + p["w1"]["bias"])
    part = h @ p["w2"]["kernel"]
    n, d = lax.axis_size(axis), part.shape[1]
    part = jnp.pad(part, ((0, 0), (0, (-d) % n)))
    piece = lax.psum_scatter(part, axis, scatter_dimension=1, tiled=True)
    return lax.all_gather(piece, axis, axis=1, tiled=True)[:, :d] + p["w2"]["bias"]


def tp_mlp_two_psums(x, p, axis):
    """Splits this device's rows of w2 in two and sums each half's [T, D] product: two all-reduces."""
    h = jax.nn.gelu(x @ p["w1"]["kernel"] + p["w1"]["bias"])
    k, w2 = h.shape[1] // 2, p["w2"]["kernel"]
    return lax.psum(h[:, :k] @ w2[:k], axis) + lax.psum(h[:, k:] @ w2[k:], axis) + p["w2"]["bias"]


def tp_mlp_no_b1(x, p, axis):
    h = jax.nn.gelu(x @ p["w1"]["kernel"])
    return lax.psum(h @ p["w2"]["kernel"], axis) + p["w2"]["bias"]


# ---- the notebook's axis name written in instead of the axis argument -------------------------------------


def tp_mlp_axis_written_in(x, p, axis):
    """Sums over "model", the notebook's axis, whatever ``axis`` is: right on the notebook's mesh only."""
    h = jax.nn.gelu(x @ p["w1"]["kernel"] + p["w1"]["bias"])
    return lax.psum(h @ p["w2"]["kernel"], "model") + p["w2"]["bias"]


def tp_mlp_size_written_in(x, p, axis):
    """Reads the device count from "model" (``lax.axis_size`` is a Python int, no equation in the
    program): on a mesh without that axis it raises an unbound-axis NameError."""
    h = jax.nn.gelu(x @ p["w1"]["kernel"] + p["w1"]["bias"])
    return lax.psum(h @ p["w2"]["kernel"] + p["w2"]["bias"] / lax.axis_size("model"), axis)


def tp_mlp_name_dependent(x, p, axis):
    """Right only where the axis is called "model": elsewhere it adds w2's bias n times."""
    h = jax.nn.gelu(x @ p["w1"]["kernel"] + p["w1"]["bias"])
    if axis == "model":
        return lax.psum(h @ p["w2"]["kernel"], axis) + p["w2"]["bias"]
    return lax.psum(h @ p["w2"]["kernel"] + p["w2"]["bias"], axis)


def ring_axis_written_in(q, k, v, axis):
    return ring_reference(q, k, v, "context")


def zero3_axis_written_in(x, blocks, axis):
    return zero3_reference(x, blocks, "data")


def ring_fori_imported(q, k, v, axis):
    """Right in the repository, but its loop is a name imported from jax.lax: the student package's
    splits.ring_attention(…, unroll=True) cannot write it out (the lesson's later cells compare it)."""
    n = lax.axis_size(axis)
    ring = [(i, (i + 1) % n) for i in range(n)]

    def body(t, carry):
        k, v, m, denom, o = carry
        m, denom, o = _fold(q, k, v, m, denom, o, t, axis)
        return (*lax.ppermute((k, v), axis, ring), m, denom, o)

    k, v, m, denom, o = fori_loop(0, n - 1, body, (k, v, *_start(q, axis)))
    return _finish(*_fold(q, k, v, m, denom, o, n - 1, axis)[1:])

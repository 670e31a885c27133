"""Answers to lesson 10's optional project (a ring backward pass with jax.custom_vjp), right and wrong, for
tests/test_checks_lesson10_vjp.py."""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from course_lib import splits


def _scores(q, k, me, t, n, scale, *, mask=True):
    """This device's queries against the block of device (me - t) mod n, causal by global position."""
    blk = q.shape[1]
    s = jnp.einsum("bqhk,bthk->bhqt", q, k) * scale
    if not mask:
        return s
    qi = me * blk + jnp.arange(blk)[:, None]
    kj = ((me - t) % n) * blk + jnp.arange(blk)[None, :]
    return jnp.where(qi >= kj, s, -jnp.inf)


def _forward(q, k, v, axis, reach=None):
    """The online-softmax ring: the output [B, Sq, H, Dh] and log-sum-exp [B, H, Sq] of each query.
    ``reach``: a wrong answer's bug, step t's block taken for device (me - min(t, reach))'s."""
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    scale = 1 / math.sqrt(q.shape[-1])
    ring = [(i, (i + 1) % n) for i in range(n)]

    def fold(t, k, v, m, denom, o):
        s = _scores(q, k, me, t if reach is None else jnp.minimum(t, reach), n, scale)
        m_new = jnp.maximum(m, s.max(-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        w = jnp.exp(s - safe[..., None])
        corr = jnp.exp(jnp.where(jnp.isfinite(m), m - safe, -jnp.inf))
        denom = denom * corr + w.sum(-1)
        return m_new, denom, o * corr[..., None] + jnp.einsum("bhqt,bthk->bhqk", w, v)

    def step(t, carry):
        k, v = lax.ppermute(carry[:2], axis, ring)
        return (k, v, *fold(t, k, v, *carry[2:]))

    m = jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, q.dtype)
    o = jnp.zeros((q.shape[0], q.shape[2], q.shape[1], q.shape[3]), q.dtype)
    m, o = lax.pcast((m, o), axis, to="varying")
    *_, m, denom, o = lax.fori_loop(1, n, step, (k, v, *fold(0, k, v, m, jnp.zeros_like(m), o)))
    out = (o / denom[..., None]).transpose(0, 2, 1, 3)
    return out, m + jnp.log(denom)


def _backward(q, k, v, out, lse, dout, axis, *, home=True, mask=True):
    """dq, dk, dv: K, V and their partial dK, dV passed round the ring; dK, dV sent home at the end."""
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    scale = 1 / math.sqrt(q.shape[-1])
    ring = [(i, (i + 1) % n) for i in range(n)]
    delta = jnp.einsum("bqhd,bqhd->bhq", dout, out)

    def grads(t, k, v, dq, dk, dv):
        p = jnp.exp(_scores(q, k, me, t, n, scale, mask=mask) - lse[..., None])
        dv = dv + jnp.einsum("bhqt,bqhd->bthd", p, dout)
        ds = p * (jnp.einsum("bqhd,bthd->bhqt", dout, v) - delta[..., None]) * scale
        return (
            dq + jnp.einsum("bhqt,bthd->bqhd", ds, k),
            dk + jnp.einsum("bhqt,bqhd->bthd", ds, q),
            dv,
        )

    def step(t, carry):
        k, v, dk, dv = lax.ppermute(carry[:4], axis, ring)
        dq, dk, dv = grads(t, k, v, carry[4], dk, dv)
        return k, v, dk, dv, dq

    dq, dk, dv = grads(0, k, v, jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v))
    *_, dk, dv, dq = lax.fori_loop(1, n, step, (k, v, dk, dv, dq))
    if home:  # the block of device me + 1 is here: one more step takes each dK, dV home
        dk, dv = lax.ppermute((dk, dv), axis, ring)
    return dq, dk, dv


def vjp_reference(q, k, v, axis_name):
    """The notebook's solution: residuals q, k, v, the output and the log-sum-exp (no stack of blocks)."""

    @jax.custom_vjp
    def attend(q, k, v):
        return _forward(q, k, v, axis_name)[0]

    def fwd(q, k, v):
        out, lse = _forward(q, k, v, axis_name)
        return out, (q, k, v, out, lse)

    def bwd(res, dout):
        return _backward(*res, dout, axis_name)

    attend.defvjp(fwd, bwd)
    return attend(q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def vjp_nondiff(q, k, v, axis_name):
    """Another correct form: a module-level custom_vjp, the axis a non-differentiable argument, and a
    backward ring written as a Python for."""
    return _forward(q, k, v, axis_name)[0]


def _nondiff_fwd(q, k, v, axis_name):
    out, lse = _forward(q, k, v, axis_name)
    return out, (q, k, v, out, lse)


def _nondiff_bwd(axis_name, res, dout):
    q, k, v, out, lse = res
    n, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    scale = 1 / math.sqrt(q.shape[-1])
    ring = [(i, (i + 1) % n) for i in range(n)]
    delta = (dout * out).sum(-1).transpose(0, 2, 1)  # [B, H, Sq]
    dq, dk, dv = jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
    for t in range(n):
        if t:
            k, v, dk, dv = lax.ppermute((k, v, dk, dv), axis_name, ring)
        p = jnp.exp(_scores(q, k, me, t, n, scale) - lse[..., None])
        dv = dv + jnp.einsum("bhqt,bqhd->bthd", p, dout)
        ds = p * (jnp.einsum("bqhd,bthd->bhqt", dout, v) - delta[..., None]) * scale
        dq = dq + jnp.einsum("bhqt,bthd->bqhd", ds, k)
        dk = dk + jnp.einsum("bhqt,bqhd->bthd", ds, q)
    return (dq, *lax.ppermute((dk, dv), axis_name, ring))


vjp_nondiff.defvjp(_nondiff_fwd, _nondiff_bwd)


def _custom(forward, backward, axis_name, q, k, v):
    attend = jax.custom_vjp(lambda q, k, v: forward(q, k, v)[0])
    attend.defvjp(forward, backward)
    return attend(q, k, v)


def vjp_not_home(q, k, v, axis_name):
    """Wrong: the backward ring stops after n - 1 steps; each dK, dV stays one device past its block's."""

    def fwd(q, k, v):
        out, lse = _forward(q, k, v, axis_name)
        return out, (q, k, v, out, lse)

    return _custom(
        fwd, lambda res, g: _backward(*res, g, axis_name, home=False), axis_name, q, k, v
    )


def vjp_unmasked_backward(q, k, v, axis_name):
    """Wrong: the forward is causal, the backward forgets the mask."""

    def fwd(q, k, v):
        out, lse = _forward(q, k, v, axis_name)
        return out, (q, k, v, out, lse)

    return _custom(
        fwd, lambda res, g: _backward(*res, g, axis_name, mask=False), axis_name, q, k, v
    )


def vjp_saves_blocks(q, k, v, axis_name):
    """Wrong: a custom_vjp whose forward keeps every K and V block it sees as residuals (a stack of n)."""
    n = lax.axis_size(axis_name)
    ring = [(i, (i + 1) % n) for i in range(n)]

    def fwd(q, k, v):
        out, lse = _forward(q, k, v, axis_name)
        seen = [(k, v)]
        for _ in range(n - 1):
            seen.append(lax.ppermute(seen[-1], axis_name, ring))
        stack = jnp.stack([jnp.stack(kv) for kv in seen])  # [n, 2, B, Sk, H, Dh]
        return out, (q, stack, out, lse)

    def bwd(res, dout):
        q, stack, out, lse = res
        return _backward(q, stack[0, 0], stack[0, 1], out, lse, dout, axis_name)

    return _custom(fwd, bwd, axis_name, q, k, v)


def vjp_plain_autodiff(q, k, v, axis_name):
    """Wrong: right values and gradients, but JAX's autodiff of the forward ring (no custom_vjp)."""
    return _forward(q, k, v, axis_name)[0]


def vjp_library(q, k, v, axis_name):
    """Wrong: the forward calls the library's ring attention."""

    def fwd(q, k, v):
        out = splits.ring_attention(q, k, v, axis_name)
        return out, (q, k, v, out, _forward(q, k, v, axis_name)[1])

    return _custom(fwd, lambda res, g: _backward(*res, g, axis_name), axis_name, q, k, v)


def vjp_leaks(q, k, v, axis_name):
    """Wrong: the device's index traced outside the custom_vjp and closed over by its backward pass."""
    me = lax.axis_index(axis_name)

    def fwd(q, k, v):
        out, lse = _forward(q, k, v, axis_name)
        return out, (q, k, v, out, lse)

    def bwd(res, dout):
        dq, dk, dv = _backward(*res, dout, axis_name)
        return dq + 0 * me, dk, dv

    return _custom(fwd, bwd, axis_name, q, k, v)


def vjp_autodiff_backward(q, k, v, axis_name):
    """Wrong: a custom_vjp saving only q, k, v whose backward is jax.vjp of the forward ring: it re-runs
    the ring in the backward pass and stacks every step's K, V and scores there."""

    def fwd(q, k, v):
        return _forward(q, k, v, axis_name)[0], (q, k, v)

    def bwd(res, dout):
        return jax.vjp(lambda q, k, v: _forward(q, k, v, axis_name)[0], *res)[1](dout)

    return _custom(fwd, bwd, axis_name, q, k, v)


def vjp_short_rings_only(q, k, v, axis_name):
    """Wrong from rings of 5: the forward takes step t's block for device (me - min(t, 3))'s, right
    on rings of 2, 3 and 4 only; the backward is the reference's."""

    @jax.custom_vjp
    def attend(q, k, v):
        return _forward(q, k, v, axis_name, reach=3)[0]

    def fwd(q, k, v):
        out, lse = _forward(q, k, v, axis_name, reach=3)
        return out, (q, k, v, out, lse)

    def bwd(res, dout):
        return _backward(*res, dout, axis_name)

    attend.defvjp(fwd, bwd)
    return attend(q, k, v)

"""Lesson 10's optional project (``notebooks/10_transformers.ipynb``, section 3): ring attention's backward
pass written with ``jax.custom_vjp``, K, V and the partial dK, dV passed round the ring again instead of
keeping the forward loop's stack of blocks.

The checker holds no answer. It judges, on rings of 2 and 8 devices (on fewer than 8 in a fresh
process with 8 simulated CPU devices): the values and ``jax.grad`` with respect to q, k and v
against single-device causal attention (float64 where it runs, else the platform's float32
tolerance, as exercise 3); that the answer is a custom VJP (its jaxpr holds a ``custom_vjp_call``);
and what its pullback keeps: the residuals ``jax.vjp`` closes over, per device, read from the traced
program on abstract rings of 8 and 32 devices (no devices needed), against JAX's autodiff of
:func:`course_lib.splits.ring_attention` at the same sizes; and what the backward pass itself holds
at once (:func:`backward_blocks`), so that a backward that re-runs the ring under ``jax.vjp`` (and
stacks every K/V block there) is refused too. An answer calling :mod:`course_lib.splits` is
refused."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from course_lib import splits, transformer
from course_lib.meshes import CONTEXT, mesh_of
from course_lib.programs import jaxpr_equations

from ._common import checker, fail, judged_on, passed
from ._lesson10_ring import RING_B, RING_DH, RING_H, RING_S, attention_mapped, close, precise
from ._spmd import abstract

__all__ = ["check_ring_vjp", "residual_blocks", "backward_blocks", "VJP_ALLOWANCE", "BWD_ALLOWANCE"]

VJP_ALLOWANCE = 8
"""The most residual bytes a custom-VJP ring may keep per device, in blocks (one block: B·(S/n)·H·Dh
float32): q, k, v, the output and each query's log-sum-exp are 4 blocks and a fraction, whatever the ring's
length; JAX's autodiff of the ``fori_loop`` ring keeps every step's K, V and scores (2n blocks and more)."""

BWD_ALLOWANCE = 32
"""The most bytes the backward pass may hold at once per device, in blocks, on rings of 8 and 32 (see
:func:`backward_blocks`): the reference holds about 18.5 (q, k, v, dK, dV, dQ, the output, the incoming
cotangent, the blocks in flight and one block's [H, S/n, S/n] scores and their gradient), whatever the ring's
length; a backward that differentiates the forward ring with ``jax.vjp`` holds every step's K, V and scores
(about 87 blocks on a ring of 8, 277 on a ring of 32)."""

_RES_RINGS, _RES_BLK = (8, 32), 8
"""The abstract rings whose residuals are read, every device holding ``_RES_BLK`` positions."""


def _unaided(what, fn, *args, explain=None):
    from .lesson10 import _call_unaided  # lesson10 imports this module

    return _call_unaided(what, fn, *args, name="ring_attention_vjp", explain=explain)


def _spec_args(shape):
    return (jax.ShapeDtypeStruct(shape, jnp.float32),) * 3


def residual_blocks(fn: Callable, c: int) -> float:
    """What ``jax.vjp`` of ``fn(q, k, v, axis)`` keeps for the backward pass on one device of an abstract
    ring of ``c`` (float32, ``_RES_BLK`` positions a device): the bytes of its pullback's residuals, in
    blocks of B·_RES_BLK·H·Dh float32."""
    found = []

    def body(q, k, v):
        out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, CONTEXT), q, k, v)
        found.append(sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(pullback)))
        return out

    spec = P(None, CONTEXT)
    mapped = jax.shard_map(
        body, mesh=abstract((c,), (CONTEXT,)), in_specs=(spec,) * 3, out_specs=spec
    )
    jax.make_jaxpr(mapped)(*_spec_args((RING_B, _RES_BLK * c, RING_H, RING_DH)))
    return found[0] / (RING_B * _RES_BLK * RING_H * RING_DH * 4)


def _bytes(var) -> int:
    aval = var.aval
    return int(np.prod(aval.shape)) * aval.dtype.itemsize if hasattr(aval, "shape") else 0


def _inner(eqn):
    """The jaxprs nested in an equation (loop bodies, cond branches, pjit, custom calls)."""
    for value in eqn.params.values():
        for x in value if isinstance(value, (list, tuple)) else (value,):
            if hasattr(x, "eqns"):
                yield x
            elif hasattr(getattr(x, "jaxpr", None), "eqns"):
                yield x.jaxpr


def peak_bytes(jaxpr) -> int:
    """The most bytes a jaxpr's values hold at once, run in program order: its inputs while used, each
    equation's outputs from where they are made to their last use, and, while an equation with a nested
    jaxpr runs, that jaxpr's own peak (a loop body counts once: a stack across the ring is a loop's
    output, so it is counted whole). Constants (residuals closed over) are not counted."""
    last = {}
    for i, eqn in enumerate(jaxpr.eqns):
        last.update({v: i for v in eqn.invars if not hasattr(v, "val")})
    last.update({v: len(jaxpr.eqns) for v in jaxpr.outvars if not hasattr(v, "val")})
    live = {v: _bytes(v) for v in jaxpr.invars if v in last}
    top = sum(live.values())
    for i, eqn in enumerate(jaxpr.eqns):
        outs = {v: _bytes(v) for v in eqn.outvars if not hasattr(v, "val")}
        inner = max((peak_bytes(j) for j in _inner(eqn)), default=0)
        top = max(top, sum(live.values()) + max(inner, sum(outs.values())))
        live.update({v: b for v, b in outs.items() if v in last})
        live = {v: b for v, b in live.items() if last[v] > i}
    return top


def backward_blocks(fn: Callable, c: int) -> float:
    """What the backward pass of ``fn(q, k, v, axis)`` holds at once on one device of an abstract ring of
    ``c`` (float32, ``_RES_BLK`` positions a device): :func:`peak_bytes` of its pullback's jaxpr, traced
    inside ``shard_map`` (no devices needed), in blocks of B·_RES_BLK·H·Dh float32. The residuals are
    counted by :func:`residual_blocks`, not here."""
    found = []

    def body(q, k, v):
        out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, CONTEXT), q, k, v)
        found.append(jax.make_jaxpr(pullback)(out).jaxpr)
        return out

    spec = P(None, CONTEXT)
    mapped = jax.shard_map(
        body, mesh=abstract((c,), (CONTEXT,)), in_specs=(spec,) * 3, out_specs=spec
    )
    jax.make_jaxpr(mapped)(*_spec_args((RING_B, _RES_BLK * c, RING_H, RING_DH)))
    return peak_bytes(found[0]) / (RING_B * _RES_BLK * RING_H * RING_DH * 4)


def _is_custom_vjp(fn) -> bool:
    mapped = attention_mapped(fn, abstract((2,), (CONTEXT,)))
    jaxpr = _unaided("ring_attention_vjp traced on 2 devices", jax.make_jaxpr(mapped),
                     *_spec_args((RING_B, RING_S, RING_H, RING_DH)))  # fmt: skip
    return any(e.primitive.name.startswith("custom_vjp_call") for e, _ in jaxpr_equations(jaxpr))


def _leak(e):
    if not isinstance(e, jax.errors.UnexpectedTracerError):
        return None
    return (
        "jax.grad of ring_attention_vjp: a value traced outside the backward pass reached it "
        "(UnexpectedTracerError)",
        "fwd and bwd are traced separately: compute lax.axis_index (and anything else traced) inside "
        "each of them, or pass it through the residuals; only Python values may be closed over",
    )


def _grad_hint(name: str, right: dict) -> str:
    if right["q"] and not (right["k"] and right["v"]):
        return (
            "dq is right, dk and dv are not: each block's dK, dV travel with it; after the n - 1 "
            "steps of the ring device r holds the gradient of device r + 1's block, so one more "
            "ppermute takes each home"
        )
    return (
        "in the backward pass score each block with the forward's causal mask (global positions), "
        "recompute p = exp(s - logsumexp) from what the forward saved, and use "
        "dS = p (dP - rowsum(dO * O)) / sqrt(Dh)"
    )


def _values_and_grads(fn, devices, c: int, rng) -> None:
    """Forward values and jax.grad w.r.t. q, k, v on a ring of ``c`` against causal attention."""
    mesh = mesh_of({CONTEXT: c}, list(devices)[:c], axis_type="auto")
    shape = (RING_B, RING_S, RING_H, RING_DH)
    with precise():
        q, k, v, cot = (jnp.asarray(rng.standard_normal(shape)) for _ in range(4))
        mapped = attention_mapped(fn, mesh)
        what = f"ring_attention_vjp on {c} device(s)"
        got = np.asarray(_unaided(what, jax.jit(mapped), q, k, v))
        want = np.asarray(transformer.causal_attention(q, k, v))

        def grads(attention):
            loss = lambda q, k, v: jnp.sum(attention(q, k, v) * cot)  # noqa: E731
            return jax.grad(loss, argnums=(0, 1, 2))

        got_g = _unaided(f"jax.grad of {what}", jax.jit(grads(mapped)), q, k, v, explain=_leak)
        want_g = grads(transformer.causal_attention)(q, k, v)
    if got.shape != want.shape or not close(got, want, 1e-10):
        fail(
            f"{what}: the forward values differ from single-device causal attention"
            + (f" by {np.abs(got - want).max():.2e}" if got.shape == want.shape else ""),
            "the forward is exercise 3's ring (an online softmax); keep it, and save what the "
            "backward needs as residuals",
        )
    right = {n: close(np.asarray(g), np.asarray(w), 1e-9) for n, g, w in zip("qkv", got_g, want_g)}
    for name, g, w in zip("qkv", got_g, want_g):
        if not right[name]:
            fail(
                f"jax.grad of {what}: the values are right but the gradient with respect to {name} is "
                f"off by {float(np.abs(np.asarray(g) - np.asarray(w)).max()):.2e} against single-device "
                "causal attention",
                _grad_hint(name, right),
            )


@checker
@judged_on(
    8,
    "one device has no ring: its backward pass passes nothing round it; and the rings of 2 and 4 "
    "that fewer than 8 devices hold miss a block index right on short rings only (such as "
    "min(t, 3) for step t)",
)
def check_ring_vjp(ring_attention_vjp: Callable, devices: Sequence[Any]) -> bool:
    """Optional project: ring attention's backward pass with ``jax.custom_vjp``.

    ``ring_attention_vjp(q, k, v, axis_name)``, q/k/v [B, S/n, H, Dh] split over ``axis_name``, returns
    causal attention's output for this device's queries (as exercise 3) and is a ``jax.custom_vjp``
    whose backward pass passes K, V and the partial dK, dV round the ring again. Judged: values and
    gradients (q, k, v) on rings of 2 and 8 devices (float64 where it runs, else the
    platform's float32 tolerance); a ``custom_vjp_call`` in its jaxpr; its residuals per device on
    abstract rings of 8 and 32 at most :data:`VJP_ALLOWANCE` blocks and under a quarter of JAX's
    autodiff ring's (:func:`residual_blocks`); what its backward pass holds at once on the same rings at
    most :data:`BWD_ALLOWANCE` blocks (:func:`backward_blocks`). An answer calling :mod:`course_lib.splits` is refused.
    On fewer than 8 devices the checker judges in a fresh process with 8 simulated devices
    (``judged_on``), as exercise 3's does: on rings of 2 and 4 a block index right only on short
    rings (such as min(t, 3) for step t) would pass."""
    rng = np.random.default_rng(11)
    rings = sorted({2, max(c for c in (2, 4, 8) if c <= len(devices))})
    for c in rings:
        _values_and_grads(ring_attention_vjp, devices, c, rng)
    if not _is_custom_vjp(ring_attention_vjp):
        fail(
            "ring_attention_vjp has right values and gradients, but its jaxpr holds no custom_vjp_call: "
            "the backward pass is JAX's autodiff of the forward ring, which keeps every step's K and V",
            "wrap the ring in jax.custom_vjp and write its backward (defvjp(fwd, bwd)) yourself",
        )
    kept = {}
    for c in _RES_RINGS:
        mine = _unaided(f"jax.vjp of ring_attention_vjp on an abstract ring of {c}",
                        residual_blocks, ring_attention_vjp, c)  # fmt: skip
        auto = residual_blocks(splits.ring_attention, c)
        kept[c] = (mine, auto)
        if mine > VJP_ALLOWANCE or mine > auto / 4:
            fail(
                f"on a ring of {c} devices (blocks of {_RES_BLK} positions, float32) the backward pass "
                f"keeps {mine:.1f} blocks of residuals per device, JAX's autodiff ring {auto:.1f}; the "
                f"allowance is {VJP_ALLOWANCE} blocks and a quarter of autodiff's: the forward saves "
                "something that grows with the ring (such as every K/V block it receives)",
                "save only this device's q, k, v, the output and each query's log-sum-exp; the "
                "backward receives the other blocks round the ring again",
            )
        held = _unaided(f"the backward pass of ring_attention_vjp on an abstract ring of {c}",
                        backward_blocks, ring_attention_vjp, c)  # fmt: skip
        if held > BWD_ALLOWANCE:
            fail(
                f"on a ring of {c} devices (blocks of {_RES_BLK} positions, float32) the backward pass "
                f"holds {held:.1f} blocks at once per device; the allowance is {BWD_ALLOWANCE} blocks, "
                "whatever the ring's length: the backward keeps something that grows with the ring "
                "(differentiating the forward ring with jax.vjp there stacks every step's K, V and scores)",
                "in bwd pass K, V and the partial dK, dV round the ring yourself (a fori_loop of "
                "ppermutes), recomputing each block's p = exp(s - logsumexp) from the saved "
                "log-sum-exp: nothing is stacked",
            )
    return passed(
        f"the custom-VJP ring's values and gradients equal causal attention's on {' and '.join(map(str, rings))} "
        "devices; residuals per device, in blocks: "
        + "; ".join(f"ring of {c}: {m:.2f} (JAX's autodiff ring {a:.2f})" for c, (m, a) in kept.items()))  # fmt: skip

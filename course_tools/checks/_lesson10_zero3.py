"""ZeRO-3's judge for :func:`course_tools.checks.lesson10.check_zero3`: the blocks' setup, data
parallelism's step with each block under ``jax.checkpoint`` saving nothing, and the values, gathers, wire
bytes of a compiled ZeRO-3 step (``notebooks/10_transformers.ipynb``, exercise 4)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from course_lib import precision, transformer
from course_lib.meshes import DATA, mesh_of
from course_lib.programs import collective_ops, jaxpr_equations

from ._axis_names import OTHER, judge_other_axis
from ._common import call_answer, close, fail
from ._lesson01_blocks import KEEP_BARRIERS, barriers_merged

__all__ = [
    "Z_CONFIG",
    "dp_compiled",
    "policy_name",
    "z_held",
    "z_other_axis",
    "z_policy_obeyed",
    "z_setup",
    "z_step",
    "z_upfront",
    "z_values",
    "z_wire",
]


def _jit(fn):
    """``jax.jit`` with the checker's compiler options. Under JAX 0.10.2 XLA:CPU removes the
    optimization barriers around a checkpoint's recomputation (pass ``cse_barrier_expander``) and a CSE
    pass then merges the backward pass's second gather into the forward's, so a right answer would gather
    once and a checkpoint around everything would hold no less; JAX 0.12's XLA:CPU keeps the barriers.
    Under JAX < 0.11 that pass is disabled (:data:`._lesson01_blocks.KEEP_BARRIERS`)."""
    options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else {}
    if barriers_merged():
        options.update(KEEP_BARRIERS)
    return jax.jit(fn, compiler_options=options or None)


def _rounded(got, want, rtol) -> bool:
    return bool(np.allclose(got, want, rtol=rtol, atol=rtol))


Z_CONFIG = transformer.TransformerConfig(
    vocab=16, seq_len=8, d_model=32, n_heads=4, d_ff=64, n_layers=3
)
_NOTHING = jax.checkpoint_policies.nothing_saveable


@functools.cache
def z_setup(n):
    cfg = Z_CONFIG
    blocks = _jit(lambda k: transformer.init_model(k, cfg)[1]["blocks"])(jax.random.key(3))
    x = (
        np.random.default_rng(4)
        .standard_normal((2 * n, cfg.seq_len, cfg.d_model))
        .astype(np.float32)
    )
    return blocks, x, cfg


def z_step(blocks_fn, mesh, n, specs):
    def step(b, x):
        value, grads = jax.value_and_grad(lambda b: jnp.sum(jnp.sin(blocks_fn(x, b))) / n)(b)
        return lax.psum(value, DATA), grads

    return _jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, P(DATA)), out_specs=(P(), specs)))


@functools.cache
def dp_compiled(devices: tuple):
    """Data parallelism's compiled step on ``devices``, each block under ``jax.checkpoint`` with
    ``nothing_saveable`` (ZeRO-3's policy): the memory ZeRO-3 is compared with (compiled once)."""
    n = len(devices)
    blocks, x, _ = z_setup(n)
    mesh = mesh_of({DATA: n}, list(devices), axis_type="auto")
    layer = jax.checkpoint(transformer.block, policy=_NOTHING)

    def dense(x, b):
        return lax.scan(lambda h, p: (layer(h, p), None), x, b)[0]

    rep = jax.tree.map(lambda _: P(), blocks)
    return z_step(dense, mesh, n, rep).lower(blocks, x).compile()


def z_values(dpc, zc, blocks, x, n):
    (lw, gw), (lz, gz) = dpc(blocks, x), call_answer("the compiled ZeRO-3 step", zc, blocks, x)
    worst = max(
        float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(gw), jax.tree.leaves(gz))
    )
    # float32: 1e-5 (gradients 1e-4) where matmuls compute in float32; the platform's relative tolerance
    # where they round their inputs (XLA:TPU: ~1.6e-2 of the largest gradient)
    rtol = precision.float32_rtol()
    scale = max(float(jnp.abs(a).max()) for a in jax.tree.leaves(gw))
    grad_tol = 1e-4 if rtol <= precision.FLOAT32_RTOL_FLOOR else rtol * scale
    if np.allclose(lw, lz, rtol=rtol, atol=rtol) and worst <= grad_tol:
        return
    if np.allclose(lw, lz, rtol=2e-2, atol=2e-2) and all(
        _rounded(a, b, 5e-2) for a, b in zip(jax.tree.leaves(gw), jax.tree.leaves(gz))
    ):
        fail(
            f"on {n} devices the loss ({float(lz):.6f}) and gradients are near data parallelism's "
            f"({float(lw):.6f}) but not equal: the values are rounded somewhere",
            "gather and compute in the parameters' dtype (float32): a narrower dtype (a bf16 gather, a "
            "cast) loses digits",
        )
    if not np.allclose(lw, lz, rtol=rtol, atol=rtol):
        fail(
            f"on {n} device(s) the loss is {float(lz):.6f}; the blocks run in order give {float(lw):.6f}",
            "gather each layer's shards along their first axis (the one split over the devices) into the "
            "whole layer, and run transformer.block on it, the layers in order",
        )
    fail(
        f"on {n} device(s) the loss is right but the gradients differ from data parallelism's by "
        f"{worst:.2e}",
        "let jax.grad transpose lax.all_gather (it reduce-scatters each layer's gradient); do not sum, "
        "average or stop the gradients yourself",
    )


def z_upfront(jaxpr, blocks, n):
    """An all_gather whose result has the size of a whole stacked leaf (every layer at once)."""
    stacked = {a.size for a in jax.tree.leaves(blocks)}
    layer = {a.size // a.shape[0] for a in jax.tree.leaves(blocks)}
    for eqn, _ in jaxpr_equations(jaxpr):
        if eqn.primitive.name.startswith("all_gather"):
            sizes = {int(v.aval.size) for v in eqn.outvars}
            if sizes & (stacked - layer):
                fail(
                    f"on {n} devices an all_gather returns a leaf of all {Z_CONFIG.n_layers} layers at "
                    "once: every layer's parameters are whole on every device before the layers run",
                    "gather inside the step over the layers, one layer's shards at a time, so a device "
                    "holds one gathered layer, not all of them",
                )


def z_held(ma) -> int:
    """Bytes a compiled step's ``memory_analysis()`` lists as arguments + temporaries: what it holds
    beside its outputs, a sum of allocations, not a timed peak. The outputs (the loss and gradients,
    ``(n-1)/n`` of the block gradients smaller under ZeRO-3) are left out: counted, they hide a layer
    kept whole too long (an answer with one checkpoint around every layer would pass)."""
    return ma.argument_size_in_bytes + ma.temp_size_in_bytes


def z_wire(text, mesh, n, p_bytes):
    """Bytes per device of each collective kind in the compiled step, each instruction weighted by how
    often it runs (the trip counts XLA wrote on the loops around it; an unknown count as 1)."""
    out: dict[str, float] = {}
    for op in collective_ops(text, mesh):
        out[op.op] = out.get(op.op, 0.0) + (op.runs or 1) * op.bytes_sent
    f = (n - 1) / n
    if out.get("all-reduce", 0.0) > 64:  # more than the loss's scalar
        fail(
            f"on {n} devices the step all-reduces {out['all-reduce']:,.0f} bytes per device: parameters "
            "or gradients travel whole through a psum",
            "gather with lax.all_gather (its transpose reduce-scatters the gradient, so each device "
            "receives only its shard's sum); a psum sends every device the whole sum",
        )
    if not np.isclose(out.get("reduce-scatter", 0.0), f * p_bytes, rtol=1e-3):
        fail(
            f"on {n} devices the gradients leave the layers as {out.get('reduce-scatter', 0.0):,.0f} "
            f"bytes of reduce-scatters per device; the float32 gradient of the block parameters "
            f"({p_bytes:,} bytes) reduce-scattered is {f * p_bytes:,.0f}",
            "gather the float32 shards with lax.all_gather(…, tiled=True) and let jax.grad transpose it",
        )
    gathered = out.get("all-gather", 0.0)
    if gathered < 1.5 * f * p_bytes:
        fail(
            f"on {n} devices the step all-gathers {gathered:,.0f} bytes per device, the parameters "
            f"({f * p_bytes:,.0f} bytes gathered) about once: the backward pass does not gather again, "
            "it keeps the gathered layers from the forward",
            "put the gather and the block together in one jax.checkpoint'ed function (policy: save "
            "nothing), so the backward pass gathers each layer again",
        )
    if gathered > 2.01 * f * p_bytes:
        fail(
            f"on {n} devices the step all-gathers {gathered:,.0f} bytes per device, more than the "
            f"parameters twice ({2 * f * p_bytes:,.0f}: once forward, once backward)",
            "gather each layer once in the forward and once in its backward, nothing more",
        )
    return out


def policy_name(policy) -> str:
    """A checkpoint policy's name in ``jax.checkpoint_policies`` (under JAX 0.12 ``dots_saveable`` is a
    function with that ``__name__``; under JAX 0.10.2 it is an instance of a class ``DotsSaveable``,
    with no ``__name__``), or "a custom policy"."""
    name = getattr(policy, "__name__", None)
    if name is None:
        found = [n for n, p in vars(jax.checkpoint_policies).items() if p is policy]
        name = found[0] if found else None
    return name or "a custom policy"


def _blocks_in_order(x, blocks):
    return lax.scan(lambda h, p: (transformer.block(h, p), None), x, blocks)[0]


def z_other_axis(zero3_blocks, devices, n: int, specs_of) -> None:
    """Refuse a ZeRO-3 that names the mesh axis itself: its forward (the blocks on :func:`z_setup`'s batch)
    on ``n`` devices of an axis called :data:`OTHER`, against the blocks run in order on one device
    (:func:`._axis_names.judge_other_axis`; the step on ``n`` devices of a ``"data"`` axis was right).
    ``specs_of(blocks, axis)``: the shards' specs (:func:`course_lib.splits.zero3_specs`)."""
    blocks, x, _ = z_setup(n)

    def mapped(mesh, check_vma=True):
        return jax.shard_map(
            lambda x, b: zero3_blocks(x, b, OTHER),
            mesh=mesh,
            in_specs=(P(OTHER), specs_of(blocks, OTHER)),
            out_specs=P(OTHER),
            check_vma=check_vma,
        )

    mesh = mesh_of({OTHER: n}, list(devices)[:n], axis_type="auto")
    want = np.asarray(_jit(_blocks_in_order)(x, blocks))
    judge_other_axis(
        "zero3_blocks",
        DATA,
        lambda abstract: jax.make_jaxpr(mapped(abstract, False))(x, blocks),
        lambda: np.asarray(_jit(mapped(mesh))(x, blocks)),
        lambda got: None if close(got, want) else f"by {np.abs(got - want).max():.2e}",
        f"{n} devices, the forward pass",
    )


def _gathers(jaxpr) -> int:
    """``all_gather`` equations in ``jaxpr`` and its inner jaxprs (a loop body counted once)."""
    return sum(eqn.primitive.name.startswith("all_gather") for eqn, _ in jaxpr_equations(jaxpr))


def z_policy_obeyed(zero3_blocks, mesh, n: int, specs, jaxpr) -> None:
    """Refuse an answer whose ``jax.checkpoint`` ignores the policy the library asks for: the student
    package runs the accepted answer in ``splits.zero3_blocks``' place, and the lesson's later cells call
    it with ``policy=None`` (no checkpoint), which :func:`course_lib.held.checkpoint_policy` gives to the
    ``jax.checkpoint`` calls the answer makes while it runs. Traced so, the step must gather less than
    ``jaxpr`` (the answer's own step): without the checkpoint the backward pass gathers no layer again."""
    from course_lib import held

    blocks, x, _ = z_setup(n)
    with held.checkpoint_policy(None):
        step = z_step(lambda x, b: zero3_blocks(x, b, DATA), mesh, n, specs)
        unchecked = call_answer(f"zero3_blocks on {n} device(s)", step.trace, blocks, x).jaxpr
    if _gathers(unchecked) >= _gathers(jaxpr):
        fail(
            f"on {n} devices, with jax.checkpoint switched off while zero3_blocks runs, the step still "
            "gathers each layer again in the backward pass: the checkpoint is made once, outside the "
            "call, so no policy reaches it (the student package runs your function for "
            "splits.zero3_blocks, and the lesson's later cells ask it for policy=None: no checkpoint)",
            "call jax.checkpoint inside zero3_blocks, on the function that gathers a layer and runs its "
            "block, so that each call makes its own",
        )

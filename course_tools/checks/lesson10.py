"""Checkers for ``10_transformers.ipynb``: ring attention built from ``ppermute`` (a project), per-layer
ZeRO-3 on the transformer's blocks, the bytes and activation memory of tensor vs sequence parallelism
predicted before the measurement, and a tensor-parallel MLP whose silent bug hides behind zero biases.

None of them holds an answer: ring attention is compared with single-device causal attention in float64
on random inputs on the devices present, and its sends and largest intermediate are read from its jaxpr
on a 4-device mesh traced without devices; ZeRO-3 is compiled and its gradients, collectives and
``memory_analysis()`` compared with data parallelism's; the predictions with
:func:`course_lib.splits.predict_tp_sp`; the MLP with :func:`course_lib.transformer.mlp`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from course_lib import splits, transformer
from course_lib.meshes import CONTEXT, DATA, MODEL, mesh_of
from course_lib.programs import jaxpr_equations

from ._common import call_answer, checker, fail, passed, require
from ._spmd import abstract

__all__ = ["check_ring_attention", "check_zero3", "check_predict_tp_sp", "check_tp_mlp"]

_ONCE = {"xla_backend_optimization_level": 0}


def _jit(fn):
    cpu = jax.default_backend() == "cpu"
    return jax.jit(fn, compiler_options=_ONCE if cpu else None)


def _ring_size(devices) -> int:
    return max(c for c in (4, 2, 1) if c <= len(devices))


# ---- exercise 1 (project): ring attention ------------------------------------------------------------------

_B, _S, _H, _DH = (
    2,
    40,
    2,
    4,
)  # S = 40 is no other dimension, so a full-sequence array is recognisable


def _attention_mapped(fn, mesh):
    def body(q, k, v):
        return fn(q, k, v, CONTEXT)

    spec = P(None, CONTEXT)
    return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)


def _ring_values(fn, devices, rng):
    c = _ring_size(devices)
    mesh = mesh_of({CONTEXT: c}, list(devices)[:c], axis_type="auto")
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(rng.standard_normal((_B, _S, _H, _DH))) for _ in range(3))
        want = np.asarray(transformer.causal_attention(q, k, v))
        got = call_answer(
            f"ring_attention on {c} device(s)", _jit(_attention_mapped(fn, mesh)), q, k, v
        )
        got = np.asarray(got)
        if got.shape != want.shape:
            fail(
                f"on {c} device(s) the result has shape {got.shape}; want {want.shape}",
                "return this device's queries' outputs, [B, S/n, H, Dh], like q",
            )
        if np.allclose(got, want, rtol=0, atol=1e-10):
            return c
        if np.allclose(got, _full_attention(q, k, v), atol=1e-8):
            fail(
                "every query attends to every key: the causal mask is missing",
                "mask key j for query i where i < j, with the blocks' global positions "
                "(device index × block length + position in the block)",
            )
        block = _S // c
        right = [np.allclose(got[:, r * block : (r + 1) * block], want[:, r * block : (r + 1) * block],
                             atol=1e-10) for r in range(c)]  # fmt: skip
        if c > 1 and right[-1] and not right[0]:
            fail(
                f"on {c} devices the last device's queries are right but the first device's are not",
                "the blocks that reach a device by wrapping round the ring (from later devices) are in "
                "its future: mask them entirely, not only the diagonal block",
            )
        if c > 1 and right[0] and not all(right[1:]):
            fail(
                f"on {c} devices the first device's queries (one visible block) are right, later ones not",
                "combine the blocks with one softmax over all keys: keep a running maximum and a running "
                "sum across blocks, rescale what you have when the maximum grows, divide once at the end",
            )
        fail(
            f"on {c} device(s) the values differ from single-device causal attention by "
            f"{float(np.abs(got - want).max()):.2e}",
            "check the scale 1/sqrt(Dh), the mask and the running softmax on a 2-device mesh",
        )


def _full_attention(q, k, v):
    s = jnp.einsum("bqhk,bthk->bhqt", q, k) / np.sqrt(q.shape[-1])
    return np.asarray(jnp.einsum("bhqt,bthk->bqhk", jax.nn.softmax(s, -1), v))


def _ring_structure(fn) -> tuple[float, float, tuple, str | None]:
    """Bytes sent by ppermute, the largest intermediate, and any gathering collective; 4-device jaxpr."""
    c = 4
    mapped = _attention_mapped(fn, abstract((c,), (CONTEXT,)))
    arg = jax.ShapeDtypeStruct((_B, _S, _H, _DH), jnp.float32)
    jaxpr = call_answer("ring_attention on a 4-device mesh", jax.make_jaxpr(mapped), arg, arg, arg)
    sent, sends, gathers, biggest = 0.0, 0.0, None, ()
    for eqn, times in jaxpr_equations(jaxpr):
        name = eqn.primitive.name
        if name == "shard_map":
            continue
        if name.startswith(("all_gather", "all_to_all", "psum")) and gathers is None:
            gathers = name
        if name == "ppermute":
            sends += times
            sent += times * sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.invars)
        for v in eqn.outvars:
            shape = tuple(getattr(v.aval, "shape", ()))
            if _S in shape:
                biggest = shape
    return sent, sends, biggest, gathers


@checker
def check_ring_attention(ring_attention: Callable, devices: Sequence[Any]) -> bool:
    """``ring_attention(q, k, v, axis_name)`` with q/k/v [B, S/n, H, Dh] (sequence split over
    ``axis_name``) must return causal attention's output for this device's queries, [B, S/n, H, Dh],
    sending only key/value blocks round the ring and holding nothing of the full sequence's length."""
    c = _ring_values(ring_attention, list(devices), np.random.default_rng(10))
    sent, sends, biggest, gathers = _ring_structure(ring_attention)
    kv = 2 * _B * (_S // 4) * _H * _DH * 4  # one K and one V block, float32
    if gathers:
        fail(
            f"on 4 devices the program calls {gathers}: every device gets the whole sequence",
            "keep one key/value block at a time and pass it to the next device with lax.ppermute",
        )
    if biggest:
        fail(
            f"on 4 devices an intermediate has shape {biggest}: memory grows with the full sequence "
            f"(S = {_S})",
            "score this device's queries against one key/value block at a time",
        )
    if sent < 3 * kv:
        fail(
            f"on 4 devices each device sends {sent:.0f} bytes; the other 3 key/value blocks are "
            f"{3 * kv} bytes",
            "every device must see every earlier block: n - 1 ppermute steps of K and V round the ring",
        )
    if sent > 4 * kv:
        fail(
            f"on 4 devices each device sends {sent:.0f} bytes; n - 1 = 3 steps of K and V are {3 * kv}",
            "send only the key and value blocks (not the queries or outputs), once per step",
        )
    return passed(
        f"ring attention equals causal attention in float64 on {c} device(s); on 4 devices it sends "
        f"{sent:.0f} bytes per device ({sends:.0f} ppermutes) and holds no array of the full sequence"
    )


# ---- exercise 2: ZeRO-3 ---------------------------------------------------------------------------------

_Z_CONFIG = transformer.TransformerConfig(
    vocab=16, seq_len=8, d_model=32, n_heads=4, d_ff=64, n_layers=3
)


@functools.cache
def _z_setup(n):
    cfg = _Z_CONFIG
    blocks = _jit(lambda k: transformer.init_model(k, cfg)[1]["blocks"])(jax.random.key(3))
    x = (
        np.random.default_rng(4)
        .standard_normal((2 * n, cfg.seq_len, cfg.d_model))
        .astype(np.float32)
    )
    return blocks, x, cfg


def _z_step(blocks_fn, mesh, n, specs):
    def step(b, x):
        value, grads = jax.value_and_grad(lambda b: jnp.sum(jnp.sin(blocks_fn(x, b))) / n)(b)
        return lax.psum(value, DATA), grads

    return _jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, P(DATA)), out_specs=(P(), specs)))


@functools.cache
def _dp_compiled(devices: tuple):
    """Data parallelism's compiled step on ``devices`` (compiled once per device set)."""
    n = len(devices)
    blocks, x, _ = _z_setup(n)
    mesh = mesh_of({DATA: n}, list(devices), axis_type="auto")

    def dense(x, b):
        return lax.scan(lambda h, p: (transformer.block(h, p), None), x, b)[0]

    rep = jax.tree.map(lambda _: P(), blocks)
    return _z_step(dense, mesh, n, rep).lower(blocks, x).compile()


@checker
def check_zero3(zero3_blocks: Callable, devices: Sequence[Any]) -> bool:
    """``zero3_blocks(x, blocks, axis_name)``: x [B, S, D] this device's batch, ``blocks`` this device's
    shards (each leaf [L, d/n, …], :func:`course_lib.splits.zero3_specs`); run the L blocks gathering each
    layer's parameters just before it, and gathering them again in the backward pass. Judged on the
    devices present (up to 4): values and gradients against data parallelism, all-gathers and
    reduce-scatters per layer in the compiled gradient, and its peak temporaries below data parallelism's."""
    from course_lib.splits import loop_sent

    n = _ring_size(devices)
    blocks, x, cfg = _z_setup(n)
    mesh = mesh_of({DATA: n}, list(devices)[:n], axis_type="auto")
    zf = _z_step(lambda x, b: zero3_blocks(x, b, DATA), mesh, n, splits.zero3_specs(blocks, DATA))
    zc = call_answer(f"zero3_blocks on {n} device(s)", lambda: zf.lower(blocks, x).compile())
    dpc = _dp_compiled(tuple(list(devices)[:n]))
    (lw, gw), (lz, gz) = dpc(blocks, x), call_answer("the compiled ZeRO-3 step", zc, blocks, x)
    if not np.allclose(lw, lz, rtol=1e-5, atol=1e-5):
        fail(
            f"on {n} device(s) the loss is {float(lz):.6f}; the blocks run in order give {float(lw):.6f}",
            "gather each layer's leaves along their first axis (lax.all_gather(a, axis, axis=0, "
            "tiled=True)) and run transformer.block on them, layer by layer (lax.scan over the layers)",
        )
    worst = max(
        float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(gw), jax.tree.leaves(gz))
    )
    if worst > 1e-4:
        fail(
            f"on {n} device(s) the gradients differ from data parallelism's by {worst:.2e}",
            "let jax.grad transpose the all-gather (it reduce-scatters the gradient); do not sum or "
            "average the gradients yourself",
        )
    if n == 1:
        return passed(
            "ZeRO-3 blocks equal the blocks in order on 1 device (no collectives to judge)"
        )
    text = zc.as_text()
    got = loop_sent(text, {DATA: n}, cfg.n_layers)
    leaves = len(jax.tree.leaves(blocks))
    gathers = got.get("all-gather", {}).get("count", 0)
    if gathers < 1.5 * leaves * cfg.n_layers:
        fail(
            f"on {n} devices the gradient program gathers {gathers:.0f} layer leaves; a forward gathers "
            f"{leaves * cfg.n_layers} ({leaves} leaves × {cfg.n_layers} layers) and the backward gathers "
            "them again",
            "wrap the gather and the block together in jax.checkpoint (policy: save nothing), so the "
            "backward pass gathers each layer again instead of keeping it",
        )
    mem_dp = dpc.memory_analysis().temp_size_in_bytes
    mem_z = zc.memory_analysis().temp_size_in_bytes
    if mem_z >= mem_dp:
        fail(
            f"on {n} devices the ZeRO-3 step's temporaries are {mem_z:,} bytes, data parallelism's "
            f"{mem_dp:,}: gathered parameters are kept",
            "gather one layer inside the scan step (not every layer before the scan), inside the "
            "jax.checkpoint'ed function",
        )
    return passed(
        f"ZeRO-3 on {n} devices: gradients equal data parallelism's; {gathers:.0f} all-gathers and "
        f"{got.get('reduce-scatter', {}).get('count', 0):.0f} reduce-scatters per step; temporaries "
        f"{mem_z:,} bytes vs data parallelism's {mem_dp:,}"
    )


# ---- exercise 3 (predict): TP vs SP -----------------------------------------------------------------------

_CASES = (
    ("tp", 4, 16, 32, 2),
    ("sp", 4, 16, 32, 2),
    ("tp", 2, 64, 64, 4),
    ("sp", 2, 64, 64, 4),
    ("tp", 8, 128, 16, 8),
    ("sp", 8, 128, 16, 8),
    ("sp", 1, 32, 128, 8),
    ("tp", 1, 32, 128, 8),
    ("sp", 3, 24, 8, 1),
    ("tp", 3, 24, 8, 1),
    ("sp", 16, 8, 64, 4),
    ("tp", 16, 8, 64, 2),
)


@checker
def check_predict_tp_sp(predict: Callable) -> bool:
    """``predict(kind, B, S, D, n)`` → ``(bytes_sent, ln_elements)`` for one block's forward in float32 on
    a model axis of ``n``: bytes each device sends, and the elements of one LayerNorm's input a device
    holds. Compared on 12 cases; reports how many are wrong."""
    wrong = 0
    for kind, b, s, d, n in _CASES:
        got = call_answer(f"predict({kind!r}, {b}, {s}, {d}, {n})", predict, kind, b, s, d, n)
        got = require("predict", got, "return (bytes_sent, ln_elements)")
        if isinstance(got, dict):
            got = (got.get("sent"), got.get("ln_elements"))
        want = splits.predict_tp_sp(kind, b, s, d, n)
        try:
            ok = np.isclose(float(got[0]), want["sent"]) and np.isclose(
                float(got[1]), want["ln_elements"]
            )
        except (TypeError, ValueError, IndexError):
            fail(f"predict returned {got!r}", "return a pair of numbers: (bytes_sent, ln_elements)")
        wrong += not ok
    if wrong:
        fail(
            f"{wrong} of {len(_CASES)} cases are wrong",
            "per block: two sub-layers, each one all-reduce (TP) or one all-gather + one reduce-scatter "
            "(SP) of the B·S·D activation; a ring all-reduce sends 2(n-1)/n of it, the others (n-1)/n",
        )
    return passed(f"all {len(_CASES)} predictions match")


# ---- exercise 4 (debug): the tensor-parallel MLP ------------------------------------------------------------


@checker
def check_tp_mlp(tp_mlp: Callable, devices: Sequence[Any]) -> bool:
    """``tp_mlp(x, p, axis_name)``: x [T, D] replicated, ``p`` this device's MLP shard (``w1`` columns and
    bias split, ``w2`` rows split, ``w2``'s bias whole) must equal :func:`course_lib.transformer.mlp` on
    the whole parameters, with random (not zero) biases."""
    n = max(c for c in (8, 4, 2, 1) if c <= len(devices))
    mesh = mesh_of({MODEL: n}, list(devices)[:n], axis_type="auto")
    rng = np.random.default_rng(4)
    d, f = 16, 32
    with jax.enable_x64(True):
        p = {
            "w1": {"kernel": rng.standard_normal((d, f)), "bias": rng.standard_normal(f)},
            "w2": {"kernel": rng.standard_normal((f, d)), "bias": rng.standard_normal(d)},
        }
        p = jax.tree.map(jnp.asarray, p)
        x = jnp.asarray(rng.standard_normal((6, d)))
        spec = {
            "w1": {"kernel": P(None, MODEL), "bias": P(MODEL)},
            "w2": {"kernel": P(MODEL), "bias": P()},
        }
        mapped = jax.shard_map(
            lambda x, p: tp_mlp(x, p, MODEL), mesh=mesh, in_specs=(P(), spec), out_specs=P()
        )
        got = np.asarray(call_answer(f"tp_mlp on {n} device(s)", _jit(mapped), x, p))
        want = np.asarray(transformer.mlp(x, p))
        if np.allclose(got, want, atol=1e-10):
            return passed(
                f"the tensor-parallel MLP equals the MLP on {n} device(s) with random biases"
            )
        if n > 1 and np.allclose(got, want + (n - 1) * p["w2"]["bias"], atol=1e-8):
            fail(
                f"on {n} devices the output has w2's bias {n} times",
                "the partial sums are added by the psum; add w2's (replicated) bias once, after it",
            )
        diff = float(np.abs(got - want).max())
        fail(
            f"on {n} device(s) the output differs from the MLP by {diff:.2e} (biases not zero here)",
            "w1's bias belongs to this device's columns; gelu is applied before the row-parallel w2",
        )

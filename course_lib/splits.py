"""The transformer split every way inside ``shard_map``: tensor, sequence and context parallelism, per-layer
ZeRO-3 and a collective matmul (``notebooks/10_transformers.ipynb``).

Every function here is the body of a ``jax.shard_map`` (it names a mesh axis and calls collectives) and
works on one layer's parameters as :mod:`course_lib.transformer` lays them out (``wq``/``wk``/``wv``:
[D, H, Dh], ``wo``: [H, Dh, D], ``w1``: [D, F], ``w2``: [F, D]); the ``*_specs`` functions give the
``PartitionSpec`` of each stacked leaf (leading layer axis ``L``), so ``transformer.forward(…, block_fn=)``
runs any of them over the layers.

- **Tensor parallelism** (Megatron): :func:`tp_block` on an axis of ``n`` devices holds ``H/n`` heads and
  ``F/n`` MLP columns; each sub-layer starts with :func:`megatron_f` (identity forward, one ``psum`` of
  the input's cotangent backward) and ends in one ``psum`` (the *g* collective; its transpose moves
  nothing): one all-reduce per sub-layer forward and one backward, as in Megatron.
- **Sequence parallelism** (Megatron-SP): :func:`sp_block` keeps the residual stream and the LayerNorms
  split along the sequence; each sub-layer starts with an ``all_gather`` and ends with a ``psum_scatter``
  (reduce-scatter) instead of the all-reduce (what that costs and saves: lesson 10's exercise 2).
- **Context parallelism**: :func:`ring_attention` passes key/value blocks round a ring with ``ppermute``
  and combines them with an online softmax; :func:`ulysses_attention` swaps sequence for heads with two
  ``all_to_all``.
- **ZeRO-3**: :func:`zero3_blocks` gathers one layer's parameters just before it runs, inside a
  ``jax.checkpoint`` so the backward pass gathers them again; the gradients leave each layer
  reduce-scattered.
- **Overlap**: :func:`collective_matmul` computes ``all_gather(x) @ w`` as a ring of ``ppermute`` steps,
  one block's matmul per step; :func:`collective_matmul_bidirectional` sends half of each block each way;
  :func:`matmul_reduce_scatter` computes ``psum_scatter(x @ w)`` passing partial sums round the ring.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from . import held, transformer  # noqa: F401 (held: the student package's stubs call it)

__all__ = [
    "tp_specs",
    "megatron_f",
    "tp_attention",
    "tp_mlp",
    "tp_block",
    "sp_block",
    "ring_attention",
    "ulysses_attention",
    "zero3_specs",
    "zero3_blocks",
    "collective_matmul",
    "collective_matmul_bidirectional",
    "matmul_reduce_scatter",
    "block_bytes",
    "predict_tp_sp",
]


# --- tensor parallelism --------------------------------------------------------------------------------------


def tp_specs(axis: str) -> dict:
    """``PartitionSpec`` of every leaf of ``params["blocks"]`` (leading layer axis) for :func:`tp_block`:
    heads of ``wq``/``wk``/``wv``/``wo`` and the MLP's hidden columns split over ``axis``; the LayerNorms
    and ``w2``'s bias replicated."""
    rep = P()
    qkv = {"kernel": P(None, None, axis)}  # [L, D, H, Dh]: heads
    return {
        "ln1": {"scale": rep, "bias": rep},
        "ln2": {"scale": rep, "bias": rep},
        "attn": {
            "wq": qkv,
            "wk": qkv,
            "wv": qkv,
            "wo": {"kernel": P(None, axis)},
        },  # wo [L, H, Dh, D]
        "mlp": {
            "w1": {
                "kernel": P(None, None, axis),
                "bias": P(None, axis),
            },  # column-parallel [L, D, F]
            "w2": {"kernel": P(None, axis), "bias": rep},  # row-parallel [L, F, D]
        },
    }


def megatron_f(x: jax.Array, axis: str) -> jax.Array:
    """Megatron's *f*: a replicated x (any shape) marked device-varying over ``axis`` — identity in the
    forward pass, one ``psum`` of the cotangent in the backward pass (its transpose).

    Without it, ``shard_map`` (``check_vma=True``) inserts the same ``pvary`` at **each** use of ``x`` by
    device-varying work: attention uses its input three times (``wq``, ``wk``, ``wv``), so the backward
    pass would sum three cotangents over ``axis`` instead of one (``notebooks/10_transformers.ipynb``).
    """
    return lax.pcast(x, axis, to="varying")


def tp_attention(x: jax.Array, p: dict, axis: str) -> jax.Array:
    """Attention on this device's ``H/n`` heads, summed over ``axis``: x [B, S, D] (replicated) → [B, S, D].

    Each device computes its heads' output projected by its rows of ``wo`` (a partial sum of the full
    output); one ``psum`` (all-reduce of B·S·D) adds them.
    """
    return lax.psum(transformer.attention(x, p), axis)


def tp_mlp(x: jax.Array, p: dict, axis: str) -> jax.Array:
    """Megatron MLP: ``w1`` column-parallel (no communication), ``w2`` row-parallel (a partial sum), one
    ``psum``, then ``w2``'s bias once: x [.., D] replicated → [.., D]."""
    h = jax.nn.gelu(x @ p["w1"]["kernel"] + p["w1"]["bias"])
    return lax.psum(h @ p["w2"]["kernel"], axis) + p["w2"]["bias"]


def tp_block(x: jax.Array, p: dict, axis: str, eps: float = 1e-5) -> jax.Array:
    """A block on one layer's tensor-parallel parameters (:func:`tp_specs`): [B, S, D] → [B, S, D], the
    residual stream replicated over ``axis``; each sub-layer's input passes :func:`megatron_f` once, so a
    block sends two all-reduces of B·S·D forward (*g*) and two backward (*f*)."""
    h = megatron_f(transformer.layer_norm(x, p["ln1"], eps), axis)
    x = x + tp_attention(h, p["attn"], axis)
    return x + tp_mlp(megatron_f(transformer.layer_norm(x, p["ln2"], eps), axis), p["mlp"], axis)


def sp_block(x: jax.Array, p: dict, axis: str, eps: float = 1e-5) -> jax.Array:
    """Megatron-SP block: x [B, S/n, D] split along the sequence over ``axis`` → [B, S/n, D].

    The LayerNorms and residual adds run on the local ``S/n`` tokens; before each sub-layer an
    ``all_gather`` along the sequence gives the full [B, S, D] input of the tensor-parallel sub-layer
    (:func:`tp_specs` parameters), and a ``psum_scatter`` (reduce-scatter) along the sequence replaces the
    all-reduce. Per block: two all-gathers and two reduce-scatters of B·S·D, the bytes of two all-reduces.
    """

    def gather(h):
        return lax.all_gather(h, axis, axis=1, tiled=True)

    def scatter(h):
        return lax.psum_scatter(h, axis, scatter_dimension=1, tiled=True)

    x = x + scatter(
        transformer.attention(gather(transformer.layer_norm(x, p["ln1"], eps)), p["attn"])
    )
    mp = p["mlp"]
    h = jax.nn.gelu(
        gather(transformer.layer_norm(x, p["ln2"], eps)) @ mp["w1"]["kernel"] + mp["w1"]["bias"]
    )
    return x + scatter(h @ mp["w2"]["kernel"]) + mp["w2"]["bias"]


# --- context parallelism -------------------------------------------------------------------------------------


def ring_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, axis: str, *, unroll: bool = False
) -> jax.Array:
    """Causal attention with the sequence split over ``axis``: q/k/v [B, S/n, H, Dh] → [B, S/n, H, Dh].

    Device ``r`` holds query block ``r`` and starts with key/value block ``r``. At step ``t`` it holds
    block ``(r - t) mod n``; it scores its queries against it (the causal mask from the blocks' global
    positions: a block after ``r`` is masked entirely, the diagonal block by position) and folds the
    scores into an online softmax (running maximum ``m``, normaliser ``denom``, unnormalised output
    ``o``). Steps ``1 … n-1`` are one ``lax.fori_loop`` whose body first receives the next block from
    device ``r - 1`` with ``ppermute``: ``n - 1`` sends of K and V, each ``2·B·(S/n)·H·Dh`` elements. A
    loop body holds one step, so what the program allocates does not grow with ``n``; ``unroll=True``
    writes the steps out one after the other (a Python ``for``), and XLA:CPU's temporaries then grow by
    more than a block per device (both measured with ``memory_analysis()`` in
    ``notebooks/10_transformers.ipynb``).
    Equal to :func:`course_lib.transformer.causal_attention` on the whole sequence (float64: to 1e-10).
    Lesson 10's exercise 3: the student package holds this body out (:mod:`course_lib.held`).
    """
    # BEGIN SOLUTION  # STUB: return held.call("splits.ring_attention", q, k, v, axis, unroll=unroll)
    n = lax.axis_size(axis)
    me = lax.axis_index(axis)
    block = q.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    qi = me * block + jnp.arange(block)[:, None]  # global query positions
    ring = [(i, (i + 1) % n) for i in range(n)]

    def fold(t, k, v, m, denom, o):  # one step: block (me - t) mod n folded into the softmax
        kj = ((me - t) % n) * block + jnp.arange(block)[None, :]
        s = jnp.einsum("bqhk,bthk->bhqt", q, k) * scale
        s = jnp.where(qi >= kj, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        w = jnp.exp(s - safe[..., None])
        corr = jnp.exp(jnp.where(jnp.isfinite(m), m - safe, -jnp.inf))
        denom = denom * corr + w.sum(-1)
        o = o * corr[..., None] + jnp.einsum("bhqt,bthk->bhqk", w, v)
        return m_new, denom, o

    def step(t, carry):
        k, v = lax.ppermute(carry[:2], axis, ring)
        return (k, v, *fold(t, k, v, *carry[2:]))

    m = jnp.full(q.shape[:1] + (q.shape[2], block), -jnp.inf, q.dtype)  # [B, H, Sq]
    o = jnp.zeros(q.shape[:1] + (q.shape[2], block, q.shape[3]), q.dtype)  # [B, H, Sq, Dh]
    # the carries vary over the ring (scores of this device's queries)
    m, o = lax.pcast((m, o), axis, to="varying")
    carry = (k, v, *fold(0, k, v, m, jnp.zeros_like(m), o))
    # unrolled: written out step by step, as a Python for (fori_loop's own unroll=True is version-dependent)
    if unroll:
        for t in range(1, n):
            carry = step(t, carry)
    else:
        carry = lax.fori_loop(1, n, step, carry)
    _, _, _, denom, o = carry
    out = o / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.transpose(0, 2, 1, 3)
    # END SOLUTION


def ulysses_attention(q: jax.Array, k: jax.Array, v: jax.Array, axis: str) -> jax.Array:
    """Causal attention with the sequence split over ``axis`` (DeepSpeed-Ulysses): q/k/v [B, S/n, H, Dh] →
    [B, S/n, H, Dh]. An ``all_to_all`` gives each device the whole sequence for ``H/n`` heads; attention
    runs there; a second ``all_to_all`` swaps back. Three all-to-alls of ``B·S/n·H·Dh`` in, one out; ``H``
    must divide by ``n``."""

    def to_heads(x):  # [B, S/n, H, Dh] -> [B, S, H/n, Dh]
        return lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)

    out = transformer.causal_attention(to_heads(q), to_heads(k), to_heads(v))
    return lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)


# --- ZeRO-3 ---------------------------------------------------------------------------------------------------


def zero3_specs(blocks: dict, axis: str) -> dict:
    """``P(None, axis)`` for every leaf of ``params["blocks"]``: each layer's leaf split along its first
    axis after the layer axis (D, H or F: every one divides by the devices in the course's configs)."""
    return jax.tree.map(lambda _: P(None, axis), blocks)


def zero3_blocks(
    x: jax.Array,
    blocks: dict,
    axis: str,
    *,
    eps: float = 1e-5,
    policy: Callable | None = jax.checkpoint_policies.nothing_saveable,
    block_fn: Callable | None = None,
) -> jax.Array:
    """Run the blocks ZeRO-3 style: x [B, S, D] (this device's batch) → [B, S, D].

    ``blocks`` are this device's shards (:func:`zero3_specs`: each leaf [L, d/n, …]). A ``lax.scan`` over
    the layers ``all_gather``s one layer's leaves just before the block runs; the gather and the block are
    one ``jax.checkpoint`` with ``policy`` (default: save nothing), so the backward pass gathers the layer
    again instead of keeping it, and the transpose of each all-gather reduce-scatters that layer's gradient.
    ``policy=None`` drops the checkpoint (the gathered layers are kept for the backward pass).
    Lesson 10's exercise 4: the student package holds this body out (:mod:`course_lib.held`; there
    ``policy`` applies to the answer's ``jax.checkpoint``, and ``eps`` and ``block_fn`` are the answer's).
    """
    # BEGIN SOLUTION  # STUB: return held.call("splits.zero3_blocks", x, blocks, axis, checkpoint=policy)
    block_fn = block_fn or (lambda h, p: transformer.block(h, p, eps))

    def layer(h, shard):
        full = jax.tree.map(lambda a: lax.all_gather(a, axis, axis=0, tiled=True), shard)
        return block_fn(h, full)

    if policy is not None:
        layer = jax.checkpoint(layer, policy=policy)
    x, _ = lax.scan(lambda h, s: (layer(h, s), None), x, blocks)
    return x
    # END SOLUTION


# --- overlap ----------------------------------------------------------------------------------------------------


def collective_matmul(x: jax.Array, w: jax.Array, axis: str) -> jax.Array:
    """``all_gather(x, axis) @ w`` without the all-gather: x [M/n, K] (rows split), w [K, N'] → [M, N'].

    ``n`` steps: multiply the block held, pass it to the next device with ``ppermute`` (``n - 1`` sends of
    one block each: the all-gather's bytes). Each step's matmul does not depend on that step's send, so a
    GPU scheduler can overlap them.
    """
    n = lax.axis_size(axis)
    me = lax.axis_index(axis)
    rows = x.shape[0]
    out = jnp.zeros((n * rows, w.shape[1]), jnp.result_type(x, w))
    ring = [(i, (i + 1) % n) for i in range(n)]
    for t in range(n):
        out = lax.dynamic_update_slice_in_dim(out, x @ w, ((me - t) % n) * rows, axis=0)
        if t < n - 1:
            x = lax.ppermute(x, axis, ring)
    return out


def matmul_reduce_scatter(x: jax.Array, w: jax.Array, axis: str) -> jax.Array:
    """``psum_scatter(x @ w, axis, tiled=True)`` without the reduce-scatter: x [M, K/n] (this device's slice
    of the contraction), w [K/n, N] → this device's rows of the sum, [M/n, N].

    ``n`` steps round the ring: multiply the x rows of one output block, add the partial sum received from
    the next device, pass the sum on to the previous one with ``ppermute`` (``n − 1`` sends of one
    ``[M/n, N]`` block: the reduce-scatter's bytes). Step ``t``'s matmul does not need step ``t``'s
    send, so a compiler can overlap them (SP's reduce-scatter after the row-parallel matmul).
    """
    n = lax.axis_size(axis)
    me = lax.axis_index(axis)
    rows = x.shape[0] // n
    left = [(i, (i - 1) % n) for i in range(n)]

    def part(t):  # the partial sum of the output block that ends on device me - (n - 1 - t)
        block = (me + t + 1) % n
        return lax.dynamic_slice_in_dim(x, block * rows, rows, axis=0) @ w

    acc = part(0)
    for t in range(1, n):
        acc = lax.ppermute(acc, axis, left) + part(t)
    return acc


def collective_matmul_bidirectional(x: jax.Array, w: jax.Array, axis: str) -> jax.Array:
    """:func:`collective_matmul` with each block cut in two halves sent opposite ways round the ring:
    x [M/n, K] (rows split, M/n even), w [K, N'] → [M, N'].

    The top halves travel to ``r + 1``, the bottom halves to ``r − 1``: ``n − 1`` steps of two sends of
    half a block, one each way, so on a bidirectional ring (a TPU's ICI) both directions of every link
    carry data and each step's sends take half the time of :func:`collective_matmul`'s; the bytes are the
    all-gather's. Each step's two matmuls do not need that step's sends.
    """
    n = lax.axis_size(axis)
    me = lax.axis_index(axis)
    rows = x.shape[0]
    half = rows // 2
    top, bottom = x[:half], x[half:]
    out = jnp.zeros((n * rows, w.shape[1]), jnp.result_type(x, w))
    right = [(i, (i + 1) % n) for i in range(n)]
    left = [(i, (i - 1) % n) for i in range(n)]
    for t in range(n):  # top half of block me - t, bottom half of block me + t
        out = lax.dynamic_update_slice_in_dim(out, top @ w, ((me - t) % n) * rows, axis=0)
        out = lax.dynamic_update_slice_in_dim(out, bottom @ w, ((me + t) % n) * rows + half, axis=0)
        if t < n - 1:
            top, bottom = lax.ppermute(top, axis, right), lax.ppermute(bottom, axis, left)
    return out


# --- predictions -------------------------------------------------------------------------------------------------


def block_bytes(blocks: dict) -> int:
    """Bytes of the stacked block parameters (every layer)."""
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(blocks))


def predict_tp_sp(
    kind: str, b: int, s: int, d: int, n: int, itemsize: int = 4, compiler: str = "XLA:CPU"
) -> dict[str, float]:
    """One block's forward on a model axis of ``n``: bytes each device sends (ring model), and the
    elements of one LayerNorm's input it holds. The answer of exercise 2 of
    ``notebooks/10_transformers.ipynb``, so its arithmetic is the exercise's: the lesson measures it on
    XLA:CPU's programs and reads it from XLA:TPU's 8-chip program (``lesson10.tp_forward`` and
    ``lesson10.sp_forward`` in ``data/tpu_reference/programs/``; at other sizes and chip counts the same
    compiler choices are assumed); ``tests/test_splits.py`` holds it against both.

    Returns:
      ``{"sent": bytes per device, "ln_elements": elements}``; ``b``, ``s``, ``d``: the activation
      ``[B, S, D]``; ``n``: devices on the model axis (``s`` divisible by ``n`` for ``"sp"``).

    Args:
      itemsize: bytes per activation element (4 for float32, 8 for float64 on XLA:CPU).
      compiler: ``"XLA:CPU"`` or ``"XLA:TPU"`` (float32 only: ``itemsize`` 4).

    Raises:
      ValueError: another ``kind`` or ``compiler``, or XLA:TPU with an ``itemsize`` other than 4.
    """
    full = b * s * d
    if kind not in ("tp", "sp"):
        raise ValueError(f"kind={kind!r}: 'tp' or 'sp'")
    if compiler not in ("XLA:CPU", "XLA:TPU"):
        raise ValueError(f"compiler={compiler!r}: 'XLA:CPU' or 'XLA:TPU'")
    if compiler == "XLA:TPU" and itemsize != 4:
        raise ValueError(f"itemsize={itemsize} on XLA:TPU: its programs are float32 (itemsize=4)")
    sent = (
        4 * (n - 1) / n * full * itemsize
    )  # two all-reduces, or two (all-gather + reduce-scatter)
    if kind == "sp" and compiler == "XLA:TPU":
        sent += 2 * (n - 1) / n * full * 2  # the bfloat16 gathers, beside TP's all-reduces
    return {"sent": sent, "ln_elements": full if kind == "tp" else full // n}


def loop_sent(hlo_text: str, mesh, trips: int | None = None) -> dict[str, dict[str, float]]:
    """Collectives of a compiled program, each counted as often as it runs:
    ``{kind: {"count": …, "sent": bytes per device}}``. An instruction inside a ``while`` body counts
    once per iteration, by the ``known_trip_count`` XLA wrote on the loop (the HLO lists a body once,
    and ``cost_analysis()`` counts it once); a body XLA unrolled holds each copy and runs fewer trips.

    Args:
      hlo_text: ``compiled.as_text()``.
      mesh: the mesh it runs on (or ``dict(mesh.shape)``).
      trips: the trip count of every loop that states none (XLA:TPU writes no ``known_trip_count``):
        the caller's own knowledge, e.g. the layer count ``L`` of a ``scan`` over layers (the length of
        the jaxpr's ``scan``). None: such a loop raises. Taught in ``notebooks/10_transformers.ipynb``.

    Raises:
      ValueError: a collective inside a loop whose trip count the program does not state, and no ``trips``.
    """
    from .programs import collective_ops, computation_runs

    runs = computation_runs(hlo_text, trips)
    out: dict[str, dict[str, float]] = {}
    for op in collective_ops(hlo_text, mesh):
        n_runs = runs.get(op.computation, 1) if op.runs is None else op.runs
        if n_runs is None:
            raise ValueError(
                f"{op.op} {op.name} is in a while loop of unknown trip count (XLA:TPU writes none): "
                "pass trips=, e.g. the number of layers the loop runs"
            )
        row = out.setdefault(op.op, {"count": 0, "sent": 0.0})
        row["count"] += n_runs
        row["sent"] += n_runs * op.bytes_sent
    return out

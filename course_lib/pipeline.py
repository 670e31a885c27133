"""Pipeline parallelism in ``shard_map``: a stage per device of a ``stage`` axis, micro-batches passed on
with ``ppermute``, any :class:`~course_lib.schedules.Schedule` run from its table.

Layout: the blocks (leading layer axis ``L``) are cut into ``v·p`` chunks of ``k = L/(v·p)`` layers; virtual
stage ``c·p + s`` (chunk ``c`` of device ``s``) holds layers ``(c·p + s)·k …``. :func:`chunked` reshapes each
leaf ``[L, …]`` to ``[v, p·k, …]`` and :func:`stage_spec` splits its second axis over the stage axis: a device
sees ``[v, k, …]``, its chunks. A **stage function** ``stage_fn(x, chunk_params) -> y`` runs one chunk;
:func:`scan_stage` makes one from any ``block_fn`` (dense, tensor-parallel, ZeRO-3: any layer).

Two executors, called inside ``shard_map`` with the stage axis's name as an argument:

- :func:`forward` — the F lanes of a forward-then-backward schedule (GPipe, circular); ``jax.grad`` through
  it runs the mirrored backward (the scan's transpose).
- :func:`train` — both lanes of any schedule (the lockstep 1F1B included), the backward written with ``jax.vjp``: an F
  lane stashes its input in the table's slot, a B lane recomputes the chunk from it and sends the input's
  cotangent back. In SPMD every stage computes every lane a tick uses: the bubble is real work.

:func:`transformer_loss` and :func:`transformer_grads` put the embedding and the head around them. Taught in
``notebooks/11_pipeline_experts.ipynb``; ``tests/test_pipeline.py`` checks them against one device in float64.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from . import transformer
from .schedules import Schedule

__all__ = [
    "chunked",
    "unchunked",
    "stage_spec",
    "scan_stage",
    "micro_batches",
    "forward",
    "train",
    "next_stage",
    "vary_like",
    "cross_entropy_sum",
    "transformer_loss",
    "transformer_grads",
]


def chunked(blocks: Any, n_chunks: int = 1) -> Any:
    """Each leaf ``[L, …]`` reshaped to ``[v, L/v, …]`` (chunk-major), for :func:`stage_spec`.

    Raises:
      ValueError: ``L`` not divisible by ``n_chunks``.
    """

    def one(a):
        if a.shape[0] % n_chunks:
            raise ValueError(
                f"{a.shape[0]} layers do not split into {n_chunks} chunks; use n_chunks dividing {a.shape[0]}"
            )
        return a.reshape(n_chunks, a.shape[0] // n_chunks, *a.shape[1:])

    return jax.tree.map(one, blocks)


def unchunked(blocks: Any) -> Any:
    """The inverse of :func:`chunked`: ``[v, L/v, …]`` → ``[L, …]``."""
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), blocks)


def stage_spec(axis: str) -> P:
    """``P(None, axis)``: the spec of a :func:`chunked` leaf, so device ``s`` holds ``[v, k, …]``."""
    return P(None, axis)


def vary_like(x: jax.Array, tree: Any) -> jax.Array:
    """``x`` cast to varying over every manual axis some leaf of ``tree`` varies over (inside
    ``shard_map``; a no-op outside). A stage's layers vary over the stage axis; an input every stage holds
    (the micro-batches) does not, and a ``lax.scan`` whose carry starts invariant and comes out varying is
    an error: cast the input first."""
    return _vary(x, _axes_of(tree))


def scan_stage(
    block_fn: Callable | None = None, *, eps=1e-5, unroll=False, remat=False
) -> Callable:
    """A stage function ``(x [b, S, D], chunk_params) -> [b, S, D]``: ``lax.scan`` of ``block_fn`` over the
    chunk's ``k`` layers (leading axis of every leaf).

    Args:
      block_fn: ``(x, layer_params) -> x``; default :func:`course_lib.transformer.block`.
      eps: LayerNorm epsilon of the default block.
      unroll: unroll the layer loop (``cost_analysis`` counts a loop body once; unrolled, every layer).
      remat: wrap the stage in ``jax.checkpoint``: autodiff keeps only its input and recomputes the rest.
    """
    block_fn = block_fn or (lambda x, p: transformer.block(x, p, eps))

    def stage(x, chunk_params):
        x = vary_like(x, chunk_params)
        y, _ = lax.scan(lambda h, p: (block_fn(h, p), None), x, chunk_params, unroll=unroll)
        return y

    return jax.checkpoint(stage) if remat else stage


def micro_batches(x: jax.Array, n_micro: int) -> jax.Array:
    """``[B, …]`` → ``[m, B/m, …]`` (micro-batch ``i`` = rows ``i·B/m …``).

    Raises:
      ValueError: ``B`` not divisible by ``n_micro``.
    """
    if x.shape[0] % n_micro:
        raise ValueError(
            f"batch {x.shape[0]} does not split into {n_micro} micro-batches; use a multiple of {n_micro}"
        )
    return x.reshape(n_micro, x.shape[0] // n_micro, *x.shape[1:])


def next_stage(n_stages: int, step: int = 1, ring: bool = False) -> list[tuple[int, int]]:
    """The ``ppermute`` pairs that send stage ``s``'s value to stage ``s + step`` (``step = -1``: back);
    with ``ring``, the ends wrap round (circular schedules); without, the end that has no neighbour sends
    nothing and the other end receives zeros."""
    pairs = [(s, (s + step) % n_stages) for s in range(n_stages)]
    return pairs if ring else [(a, b) for a, b in pairs if 0 <= a + step < n_stages]


def _chunk(params, c, n_chunks):
    if n_chunks == 1:
        return jax.tree.map(lambda a: a[0], params)
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, c, 0, keepdims=False), params)


def _vary(tree, axes: Sequence[str]):
    """``tree`` cast to varying over each of ``axes`` it does not vary over already."""

    def one(a):
        missing = tuple(ax for ax in axes if ax not in jax.typeof(a).manual_axis_type.varying)
        return lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(one, tree)


def _axes_of(tree: Any, *axes: str) -> tuple[str, ...]:
    """``axes`` and every manual axis a leaf of ``tree`` varies over: what a loop's carry must vary over."""
    found = set(axes)
    for leaf in jax.tree.leaves(tree):
        found |= set(jax.typeof(leaf).manual_axis_type.varying)
    return tuple(sorted(found))


def _check_axis(sched: Schedule, axis: str) -> None:
    n = lax.axis_size(axis)
    if n != sched.n_stages:
        raise ValueError(
            f"schedule {sched.name!r} has {sched.n_stages} stages but axis {axis!r} has {n} devices; "
            f"build the schedule with n_stages={n}"
        )


def forward(
    stage_fn: Callable,
    params: Any,
    xs: jax.Array,
    sched: Schedule,
    axis: str,
    *,
    unroll: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Run the F lanes of ``sched`` (inside ``shard_map`` over ``axis``); differentiate it for the backward.

    Args:
      stage_fn: ``(x [b, S, D], chunk_params) -> [b, S, D]``.
      params: this device's chunks, leaves ``[v, k, …]`` (:func:`chunked` with :func:`stage_spec`).
      xs: ``[m, b, S, D]``, the micro-batches' inputs; only stage 0 reads them.
      sched: a forward-then-backward schedule (GPipe, circular): its first :meth:`~Schedule.forward_ticks`
        rows are run.
      axis: the stage axis's name.
      unroll: unroll the tick loop.

    Returns:
      ``(ys, trace)``: ``ys [m, b, S, D]``, each micro-batch's output on the last stage (zeros on the others,
      which never write it); ``trace`` int32 [T_f, 2], the micro-batch (``-1``: idle) and chunk this
      device's F lane ran at each tick, for the picture of the run.
    """
    _check_axis(sched, axis)
    p, m, v = sched.n_stages, sched.n_micro, sched.n_chunks
    tf = sched.forward_ticks()
    rows = jnp.asarray(np.stack([sched.f_mb[:tf], sched.f_chunk[:tf]], -1))  # [T_f, p, 2]
    s = lax.axis_index(axis)
    perm = next_stage(p, +1, ring=v > 1)

    def tick(carry, row):
        fwd_in, ys = carry  # fwd_in: [b, S, D], what the previous stage sent last tick
        mb, c = row[s, 0], row[s, 1]
        x = jnp.where((s == 0) & (c == 0), xs[jnp.maximum(mb, 0)], fwd_in)
        y = stage_fn(x, _chunk(params, c, v))
        done = (mb >= 0) & (s == p - 1) & (c == v - 1)
        ys = ys.at[jnp.where(done, mb, m)].set(y)  # row m: where idle ticks write
        return (lax.ppermute(y, axis, perm), ys), jnp.stack([mb, c])

    start = _vary(
        (jnp.zeros_like(xs[0]), jnp.zeros((m + 1, *xs.shape[1:]), xs.dtype)),
        _axes_of((xs, params), axis),
    )
    (_, ys), trace = lax.scan(tick, start, rows, unroll=unroll)
    return ys[:m], trace


class _Run(NamedTuple):
    """What every tick of :func:`train` reads (its arguments and the device's place on the axis)."""

    stage_fn: Callable
    head_fn: Callable
    params: Any
    head_params: Any
    xs: jax.Array
    aux: Any
    sched: Schedule
    axis: str
    s: jax.Array  # this device's stage
    input_grads: bool


def _at(aux, mb):
    return jax.tree.map(lambda a: a[jnp.maximum(mb, 0)], aux)


def _f_lane(run: _Run, st: dict, mb, c, slot):
    """One F cell: choose the input, stash it at its slot (idle cells: the spare slot), run the chunk; on
    the last virtual stage add the micro-batch's loss."""
    sched, s = run.sched, run.s
    p, v = sched.n_stages, sched.n_chunks
    x = jnp.where((s == 0) & (c == 0), run.xs[jnp.maximum(mb, 0)], st["fwd_in"])
    st["stash"] = st["stash"].at[jnp.where(mb >= 0, slot, sched.n_slots)].set(x)
    y = run.stage_fn(x, _chunk(run.params, c, v))
    top = (mb >= 0) & (s == p - 1) & (c == v - 1)
    st["loss"] = st["loss"] + jnp.where(top, run.head_fn(run.head_params, y, _at(run.aux, mb)), 0)
    return y


def _b_lane(run: _Run, st: dict, mb, c, slot):
    """One B cell: recompute the chunk from its stashed input, then its vjp with the cotangent that came
    from the next stage (on the last virtual stage: the loss's gradient); add the gradients."""
    sched, s = run.sched, run.s
    p, m, v = sched.n_stages, sched.n_micro, sched.n_chunks
    ok = mb >= 0
    x = st["stash"][jnp.where(ok, slot, sched.n_slots)]
    y, vjp = jax.vjp(lambda prm, h: run.stage_fn(h, prm), _chunk(run.params, c, v), x)
    d_head, dy = jax.grad(run.head_fn, argnums=(0, 1))(run.head_params, y, _at(run.aux, mb))
    top = ok & (s == p - 1) & (c == v - 1)
    d_params, dx = vjp(jnp.where(top, dy, st["bwd_in"]))
    st["head_grads"] = jax.tree.map(lambda g, d: g + jnp.where(top, d, 0), st["head_grads"], d_head)
    st["grads"] = jax.tree.map(lambda g, d: g.at[c].add(jnp.where(ok, d, 0)), st["grads"], d_params)
    if run.input_grads:
        st["dxs"] = st["dxs"].at[jnp.where(ok & (s == 0) & (c == 0), mb, m)].set(dx)
    return dx


def _tick(run: _Run, st: dict, row, has_f: bool, has_b: bool):
    """One tick of :func:`train`: the lanes this run of ticks uses, then the sends (F on, B back)."""
    f_mb, f_c, f_slot, b_mb, b_c, b_slot = (row[run.s, i] for i in range(6))
    st = dict(st)
    ring = run.sched.n_chunks > 1
    y = _f_lane(run, st, f_mb, f_c, f_slot) if has_f else None
    dx = _b_lane(run, st, b_mb, b_c, b_slot) if has_b else None
    if has_f:
        st["fwd_in"] = lax.ppermute(y, run.axis, next_stage(run.sched.n_stages, +1, ring))
    if has_b:
        st["bwd_in"] = lax.ppermute(dx, run.axis, next_stage(run.sched.n_stages, -1, ring))
    return st, jnp.stack([f_mb, f_c, b_mb, b_c])


def train(
    stage_fn: Callable,
    head_fn: Callable,
    params: Any,
    head_params: Any,
    xs: jax.Array,
    aux: Any,
    sched: Schedule,
    axis: str,
    *,
    unroll: bool = False,
    vary_axes: Sequence[str] = (),
    input_grads: bool = True,
):
    """Run both lanes of ``sched`` (inside ``shard_map`` over ``axis``): the loss and its gradients.

    Args:
      stage_fn: ``(x [b, S, D], chunk_params) -> [b, S, D]``.
      head_fn: ``(head_params, y [b, S, D], aux_i) -> scalar``: micro-batch ``i``'s loss from the last
        virtual stage's output (sum the losses of all micro-batches to get the step's).
      params: this device's chunks, leaves ``[v, k, …]``.
      head_params: the head's parameters (any pytree; every stage holds them, the last one uses them).
        Every stage *computes* ``head_fn`` (and its gradient) at every tick of an F (B) lane and masks the
        result with ``jnp.where``: only the last virtual stage's is used, the rest is waste that grows
        with the head's size (``notebooks/11_pipeline_experts.ipynb`` measures it).
      xs: ``[m, b, S, D]`` micro-batch inputs (stage 0 reads them); aux: pytree of ``[m, …]`` (e.g. targets).
      sched: any :class:`Schedule` (:func:`~course_lib.schedules.validate` passes for a pipeline).
      axis: the stage axis's name.
      unroll: unroll each segment's tick loop.
      vary_axes: other manual axes the parameters are replicated over (e.g. a data axis): they are cast to
        varying there too, so every gradient comes back as this device's own sum (reduce it yourself).
      input_grads: keep the cotangent of every micro-batch's input (``dxs``, an ``[m, b, S, D]`` buffer,
        for an embedding before the pipeline); False returns zeros of size 1 in its place.

    Returns:
      ``(loss, grads, head_grads, dxs, trace)``: loss and ``head_grads`` are this device's part (nonzero on
      the last stage only: ``psum`` them over ``axis``); ``grads`` like ``params``; ``dxs [m, b, S, D]``
      the cotangent of ``xs`` (stage 0 only); ``trace`` int32 [T, 4], the micro-batch and chunk of this
      device's F lane, then of its B lane, at each tick (micro-batch ``-1``: idle), for the picture.
    """
    _check_axis(sched, axis)
    axes = _axes_of((xs, params), axis, *vary_axes)
    params, head_params = _vary((params, head_params), axes)
    act, m = xs[0], sched.n_micro
    zero = lambda t: jax.tree.map(jnp.zeros_like, t)  # noqa: E731
    state = dict(
        fwd_in=act * 0, bwd_in=act * 0, stash=jnp.zeros((sched.n_slots + 1, *act.shape), act.dtype),
        grads=zero(params), head_grads=zero(head_params), loss=jnp.zeros((), act.dtype),
        dxs=jnp.zeros((m + 1 if input_grads else 1, *act.shape), act.dtype),
    )  # fmt: skip
    state = _vary(state, axes)
    run = _Run(
        stage_fn,
        head_fn,
        params,
        head_params,
        xs,
        aux,
        sched,
        axis,
        lax.axis_index(axis),
        input_grads,
    )
    table = np.stack(
        [sched.f_mb, sched.f_chunk, sched.f_slot, sched.b_mb, sched.b_chunk, sched.b_slot], -1
    )
    traces = []
    for start, stop, has_f, has_b in sched.segments():
        body = partial(_tick, run, has_f=has_f, has_b=has_b)
        state, tr = lax.scan(body, state, jnp.asarray(table[start:stop]), unroll=unroll)
        traces.append(tr)
    dxs = state["dxs"][:m] if input_grads else state["dxs"]
    return state["loss"], state["grads"], state["head_grads"], dxs, jnp.concatenate(traces)


# --- the transformer around a pipeline -------------------------------------------------------------------


def cross_entropy_sum(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Σ over tokens of ``-log softmax(logits)[target]``: logits [.., V], targets int [..] → scalar."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).sum()


def _head_loss(eps, n_tokens):
    def head_fn(rest, y, targets):
        return cross_entropy_sum(transformer.head(rest, y, eps), targets) / n_tokens

    return head_fn


def _split(params):
    return params["blocks"], {k: v for k, v in params.items() if k != "blocks"}


def _specs(axis, data_axis):
    batch = P(data_axis) if data_axis else P()
    return (stage_spec(axis), P(), batch, batch)


def transformer_loss(
    mesh: Any, sched: Schedule, *, axis: str, data_axis: str | None = None, stage_fn: Callable | None = None,
    eps: float = 1e-5, unroll: bool = False,
) -> Callable:  # fmt: skip
    """``loss(params, tokens, targets)``: the transformer's mean cross-entropy through :func:`forward`.

    Differentiate it with ``jax.grad`` (the backward is the schedule's mirror). ``params`` as
    :func:`course_lib.transformer.init_model` returns them but with ``params["blocks"]`` :func:`chunked` to
    ``sched.n_chunks`` (placed with :func:`stage_spec`); tokens and targets int32 [B, S], ``B`` a multiple
    of ``sched.n_micro`` (per ``data_axis`` shard). The embedding runs on every stage (stage 0's is used),
    and so does the head, on every stage's outputs (the last stage's is used: the rest is waste). With
    ``data_axis`` (a mesh axis beside ``axis``) the batch is split over it too and the loss is its mean over
    the shards (so ``jax.grad`` sums the shards' gradients).
    """
    stage_fn = stage_fn or scan_stage(eps=eps, remat=True)

    def body(blocks, rest, tokens, targets):
        m = sched.n_micro
        ys, _ = forward(
            stage_fn,
            blocks,
            micro_batches(transformer.embed(rest, tokens), m),
            sched,
            axis,
            unroll=unroll,
        )
        local = (
            cross_entropy_sum(transformer.head(rest, ys, eps), micro_batches(targets, m))
            / targets.size
        )
        loss = lax.psum(jnp.where(lax.axis_index(axis) == sched.n_stages - 1, local, 0.0), axis)
        return lax.pmean(loss, data_axis) if data_axis else loss

    def loss(params, tokens, targets):
        mapped = jax.shard_map(body, mesh=mesh, in_specs=_specs(axis, data_axis), out_specs=P())
        return mapped(*_split(params), tokens, targets)

    return loss


def transformer_grads(
    mesh: Any, sched: Schedule, *, axis: str, data_axis: str | None = None, stage_fn: Callable | None = None,
    eps: float = 1e-5, unroll: bool = False,
) -> Callable:  # fmt: skip
    """``grads(params, tokens, targets) -> (loss, grads)`` through :func:`train` (any schedule, lockstep 1F1B too).

    Same arguments and layout as :func:`transformer_loss`; ``grads`` is laid out like ``params`` (blocks
    chunked and stage-split). The head's and the embedding's gradients are ``psum``-ed over ``axis``; with
    ``data_axis``, the loss and every gradient are averaged over its shards (``pmean``).
    """
    stage_fn = stage_fn or scan_stage(eps=eps)
    extra = (data_axis,) if data_axis else ()

    def body(blocks, rest, tokens, targets):
        m = sched.n_micro
        embed = lambda r: micro_batches(transformer.embed(r, tokens), m)  # noqa: E731
        xs, embed_vjp = jax.vjp(embed, _vary(rest, (axis, *extra)))
        loss, grads, d_rest, dxs, _ = train(stage_fn, _head_loss(eps, targets.size), blocks, rest, xs,
                                            micro_batches(targets, m), sched, axis, unroll=unroll,
                                            vary_axes=extra)  # fmt: skip
        d_rest = jax.tree.map(jnp.add, d_rest, embed_vjp(dxs)[0])
        out = (lax.psum(loss, axis), grads, lax.psum(d_rest, axis))
        return lax.pmean(out, data_axis) if data_axis else out

    def grads(params, tokens, targets):
        out_specs = (P(), stage_spec(axis), P())
        mapped = jax.shard_map(
            body, mesh=mesh, in_specs=_specs(axis, data_axis), out_specs=out_specs
        )
        loss, g_blocks, g_rest = mapped(*_split(params), tokens, targets)
        return loss, {**g_rest, "blocks": g_blocks}

    return grads

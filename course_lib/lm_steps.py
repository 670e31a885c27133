"""The transformer lab's layouts written by hand in ``jax.shard_map``: every collective is in the code.

:func:`grads_fn` is the per-device loss-and-gradients of one layout (:class:`course_lib.lm_layouts.Layout`)
on its mesh, with ``check_vma=True``, so the backward pass's collectives are the transposes of the forward
pass's (an ``all_gather``'s is a ``psum_scatter`` and back; an implicit ``pvary``'s is a ``psum``):

- FSDP (``fsdp`` axis): every parameter is all-gathered over ``fsdp`` once, before the forward pass, and
  kept through the backward pass (PyTorch's ``SHARD_GRAD_OP``); its gradient comes back reduce-scattered.
  The shard is made to vary over the other batch axes *before* the gather, so the gradient is
  reduce-scattered first and only the shard is then all-reduced over them.
- TP (``model`` axis, Megatron): each sub-layer's output is ``psum``-ed over ``model`` forward, its
  input's gradient backward: 4 all-reduces per layer.
- TP+SP (``model`` splits the sequence too): each sub-layer's input is all-gathered over the sequence and
  its output reduce-scattered back: 4 all-gathers and 4 reduce-scatters per layer (forward and backward);
  the gradients of the parameters not split over ``model`` are all-reduced over the batch axes and
  ``model`` at once (they see other tokens on every device).
- CP (``context`` splits the sequence): the keys and values are all-gathered over ``context`` (and their
  gradients reduce-scattered), the queries stay local (causal mask with the block's offset).
- DP: each parameter is made to vary (``lax.pcast``) over the data axes (batch and sequence) that its spec
  does not split it over, before use: its gradient is all-reduced over exactly those axes, in one
  collective over all of them (``data,model`` names the group of both).

Every layout's loss is the global mean, ``psum``-ed over the batch and sequence axes.
:func:`course_lib.lm_costs.predict_bytes` predicts exactly these collectives. Taught in
``notebooks/12_transformer_lab.ipynb``; tested in ``tests/test_lm_layouts.py``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from . import pipeline, transformer

__all__ = ["grads_fn"]


def _spec_axes(spec) -> set:
    out = set()
    for entry in spec:
        out |= set(entry) if isinstance(entry, tuple) else ({entry} if entry else set())
    return out


def _prepare(params: Any, specs: Any, axes: tuple[str, ...], fsdp: str | None) -> Any:
    """Each parameter made to vary over the data axes ``axes`` its spec does not split it over (so its
    gradient's all-reduce, the transpose, sums over exactly those), then whole over ``fsdp`` (tiled
    ``all_gather`` along the dimension it splits: its gradient comes back reduce-scattered, before that
    all-reduce runs on the shard)."""

    def one(x, spec):
        split = _spec_axes(spec)
        missing = tuple(a for a in axes if a not in split)
        x = lax.pcast(x, missing, to="varying") if missing else x
        for d, entry in enumerate(spec):
            if fsdp is not None and entry == fsdp:
                return lax.all_gather(x, fsdp, axis=d, tiled=True)
        return x

    return jax.tree.map(one, params, specs)


def grads_fn(lay, mesh, specs: Any, config):
    """``(params, tokens, targets) -> (loss, grads)`` of layout ``lay`` on ``mesh``, in ``shard_map``.

    Args:
      lay: a :class:`course_lib.lm_layouts.Layout` without a stage axis.
      mesh: its mesh; specs: the parameters' ``PartitionSpec`` tree (:func:`course_lib.lm_layouts.param_specs`).
      config: the transformer's shape.

    Returns:
      A function of global arrays (parameters laid out by ``specs``, tokens and targets int32
      ``[B, S]`` split by the batch and sequence axes): the mean loss (replicated) and the
      gradients (laid out by ``specs``).
    """
    tp, seq, fsdp = lay.model_axis, lay.seq_axis, lay.fsdp_axis
    sp, cp = seq is not None and seq == tp, seq is not None and seq != tp
    batch = lay.batch_axes[0] if len(lay.batch_axes) == 1 else lay.batch_axes
    loss_axes = tuple(a for a in lay.axes if a in lay.batch_axes or a == seq)  # mesh order
    eps = config.ln_eps
    n_shards = math.prod(mesh.shape[a] for a in loss_axes)

    def sublayer(h, f):  # Megatron: f computes a partial sum over model (its output bias left out)
        if sp:
            h = lax.all_gather(h, tp, axis=1, tiled=True)
        elif (
            tp
        ):  # Megatron's f: identity forward, one all-reduce of the input's gradient backward (left
            # implicit, each of q, k, v would all-reduce its own)
            h = lax.pcast(h, tp, to="varying")
        out = f(h)
        if sp:
            return lax.psum_scatter(out, tp, scatter_dimension=1, tiled=True)
        return lax.psum(out, tp) if tp else out

    def attn(h, p, offset):
        q = jax.numpy.einsum("bsd,dhk->bshk", h, p["wq"]["kernel"])
        k = jax.numpy.einsum("bsd,dhk->bshk", h, p["wk"]["kernel"])
        v = jax.numpy.einsum("bsd,dhk->bshk", h, p["wv"]["kernel"])
        q_offset = 0
        if cp:  # context parallelism: whole keys and values, local queries
            k = lax.all_gather(k, seq, axis=1, tiled=True)
            v = lax.all_gather(v, seq, axis=1, tiled=True)
            q_offset = offset
        o = transformer.causal_attention(q, k, v, q_offset=q_offset)
        return jax.numpy.einsum("bshk,hkd->bsd", o, p["wo"]["kernel"])

    def mlp(h, p):
        return jax.nn.gelu(h @ p["w1"]["kernel"] + p["w1"]["bias"]) @ p["w2"]["kernel"]

    def local_loss(params, tokens, targets):
        whole = _prepare(params, specs, loss_axes, fsdp)
        offset = lax.axis_index(seq) * tokens.shape[1] if seq else 0
        x = transformer.embed(whole, tokens, offset)
        for i in range(config.n_layers):
            p = jax.tree.map(lambda a, i=i: a[i], whole["blocks"])
            h = transformer.layer_norm(x, p["ln1"], eps)
            x = x + sublayer(h, lambda h, p=p: attn(h, p["attn"], offset))
            h = transformer.layer_norm(x, p["ln2"], eps)
            x = x + sublayer(h, lambda h, p=p: mlp(h, p["mlp"])) + p["mlp"]["w2"]["bias"]
        logits = transformer.head(whole, x, eps)
        loss = pipeline.cross_entropy_sum(logits, targets) / (targets.size * n_shards)
        return lax.psum(loss, loss_axes)

    mapped = jax.shard_map(
        jax.value_and_grad(local_loss),
        mesh=mesh,
        in_specs=(specs, P(batch, seq), P(batch, seq)),
        out_specs=(P(), specs),
        check_vma=True,
    )
    return mapped

"""A tensor-parallel block inside a pipeline stage: a 2-D mesh ``stage × model``, run and read.

Each stage of :func:`course_lib.pipeline.forward` holds its layers (the ``stage`` axis) and splits each
layer Megatron's way over the ``model`` axis (:func:`course_lib.splits.tp_specs`: heads and the MLP's
hidden columns; ``w1`` column-parallel, ``w2`` row-parallel). The executor's tick loop carries the residual
stream typed as varying over every axis its parameters vary over — ``model`` too — so lesson 10's
:func:`course_lib.splits.tp_block` (whose *f* casts an invariant stream to varying) does not apply as it
is. :func:`tp_stage_block` is the same block for a stream of either type: in the forward pass one
all-reduce per sub-layer (*g*) as before; in the backward pass *g*'s ``psum`` transposes to a cast that
moves nothing, and the all-reduce sits where its replicated result joins the varying stream (the transpose
of that implicit cast to varying) instead of at *f*'s: the same count and bytes. The LayerNorms' parameters,
replicated over ``model`` and used on the varying stream, get
their gradients summed over ``model`` too (four ``[D]`` vectors per layer application).

:func:`pp_tp_loss` runs GPipe's forward with this block and a sum of squares as the head; its gradient
program's collectives per axis are predicted from the schedule and the shapes by :func:`predict` and read
by :func:`measured` (each instruction times its loop's trip count). Taught in
``notebooks/11_pipeline_experts.ipynb`` (section 8); ``tests/test_pipeline_tp.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from . import comms, pipeline, programs, splits, transformer

__all__ = [
    "mesh_shape",
    "tp_stage_block",
    "block_specs",
    "pp_tp_loss",
    "predict",
    "measured",
    "same",
]


def mesh_shape(n_devices: int, n_layers: int) -> tuple[int, int]:
    """``(stages, model)``: 2 on ``model`` once there are 2 devices, the rest (at most 4, dividing the
    layers) on ``stage``: 8 → (4, 2), 4 → (2, 2), 2 → (1, 2), 1 → (1, 1)."""
    n_model = 2 if n_devices >= 2 else 1
    stages = max(s for s in (4, 2, 1) if s <= n_devices // n_model and n_layers % s == 0)
    return stages, n_model


def tp_stage_block(x: jax.Array, p: dict, axis: str, eps: float = 1e-5) -> jax.Array:
    """:func:`course_lib.splits.tp_block` for a residual stream x [b, S, D] that may already vary over
    ``axis`` (a pipeline executor's carry): each sub-layer's input is cast to varying only where it is not
    (Megatron's *f*), and ends in one ``psum`` (*g*). Parameters as :func:`course_lib.splits.tp_specs`
    lays out one layer."""

    def f(h):
        varying = jax.typeof(h).manual_axis_type.varying
        return h if axis in varying else lax.pcast(h, axis, to="varying")

    x = x + splits.tp_attention(f(transformer.layer_norm(x, p["ln1"], eps)), p["attn"], axis)
    return x + splits.tp_mlp(f(transformer.layer_norm(x, p["ln2"], eps)), p["mlp"], axis)


def block_specs(stage_axis: str, model_axis: str) -> dict:
    """Specs of :func:`course_lib.pipeline.chunked` blocks (leaves ``[v, L/v, …]``): the layers over
    ``stage_axis`` (:func:`course_lib.pipeline.stage_spec`), each leaf's own dimensions as
    :func:`course_lib.splits.tp_specs` splits them over ``model_axis``."""
    return jax.tree.map(
        lambda s: P(None, stage_axis, *tuple(s)[1:]),
        splits.tp_specs(model_axis),
        is_leaf=lambda s: isinstance(s, P),
    )


def pp_tp_loss(
    mesh: Any, sched: Any, *, stage_axis: str, model_axis: str, eps: float = 1e-5
) -> Callable:
    """``loss(blocks, xs)``: GPipe's forward (:func:`course_lib.pipeline.forward`, the table ``sched``) of
    the transformer's blocks, each stage's layers run by :func:`tp_stage_block`; the head is a sum of
    squares of the last stage's outputs.

    Args:
      mesh: a mesh with ``stage_axis`` (``sched.n_stages`` devices) and ``model_axis``.
      blocks: ``params["blocks"]`` :func:`course_lib.pipeline.chunked` to one chunk, laid out by
        :func:`block_specs`.
      xs: float [m, b, S, D], the micro-batches' inputs, replicated.

    Returns:
      A function returning a float scalar: ``Σ (the blocks applied in order to xs)²``, equal to the same on
      one device with :func:`course_lib.transformer.block`; differentiate it with ``jax.grad``.
    """
    stage_fn = pipeline.scan_stage(lambda x, lp: tp_stage_block(x, lp, model_axis, eps))
    last = sched.n_stages - 1

    def body(blocks, xs):
        ys, _ = pipeline.forward(stage_fn, blocks, xs, sched, stage_axis)
        mine = jnp.where(lax.axis_index(stage_axis) == last, jnp.sum(ys**2), 0.0)
        # the stream varies over model (equal values): pmean makes the scalar replicated
        return lax.pmean(lax.psum(mine, stage_axis), model_axis)

    def loss(blocks, xs):
        specs = (block_specs(stage_axis, model_axis), P())
        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P())(blocks, xs)

    return loss


def predict(sched: Any, layers_per_stage: int, act_shape: tuple[int, ...], n_model: int,
            itemsize: int = 4) -> dict[str, dict[str, float]]:  # fmt: skip
    """The gradient program of :func:`pp_tp_loss`, per axis: ``{axis: {"count": collectives run,
    "sent": bytes the busiest device sends}}`` (axes of one device left out).

    Every stage runs its ``k`` layers at each of GPipe's ``T = m + p - 1`` forward ticks (idle ticks
    compute too, masked), and the backward pass mirrors them:

    - ``model``: per layer application, two all-reduces of the activation ``A = b·S·D`` forward (*g*) and
      two backward, and one of the four LayerNorm ``[D]`` gradients; plus the loss's ``pmean``;
    - ``stage``: one ``ppermute`` of ``A`` per tick forward and one back (the busiest device sends ``A``
      each time); plus the loss's ``psum``.
    """
    p, t = sched.n_stages, sched.forward_ticks()
    a = itemsize
    for d in act_shape:
        a *= d
    ring = comms.ring_bytes
    out = {}
    if n_model > 1:
        runs = t * layers_per_stage
        sent = 4 * runs * ring("all-reduce", a, n_model)
        sent += runs * ring("all-reduce", 4 * act_shape[-1] * itemsize, n_model)
        out["model"] = {"count": 5 * runs + 1, "sent": sent + ring("all-reduce", itemsize, n_model)}
    if p > 1:
        sent = 2 * t * a + ring("all-reduce", itemsize, p)
        out["stage"] = {"count": 2 * t + 1, "sent": sent}
    return out


def measured(hlo_text: str, mesh: Any) -> dict[str, dict[str, float]]:
    """A compiled program's collectives per mesh axis, ``{axis: {"count", "sent"}}`` as :func:`predict`:
    each instruction counted as often as its loop runs (:attr:`course_lib.programs.CollectiveOp.runs`),
    a ``ppermute`` by what its busiest device sends.

    Raises:
      ValueError: a collective in a loop whose trip count the program does not state, or over several
        axes at once.
    """
    out: dict[str, dict[str, float]] = {}
    for op in programs.collective_ops(hlo_text, mesh):
        if op.group_size <= 1:  # a group of one device, or a ppermute without pairs: nothing moves
            continue
        if op.runs is None or not op.axes or len(op.axes) != 1:
            raise ValueError(
                f"{op.op} {op.name}: runs={op.runs}, axes={op.axes}; cannot attribute it"
            )
        row = out.setdefault(op.axes[0], {"count": 0, "sent": 0.0})
        row["count"] += op.runs
        row["sent"] += op.runs * op.bytes_sent
    return out


def same(measured_: dict, predicted: dict) -> bool:
    """True when a program's collectives (:func:`measured`) match :func:`predict`: the same axes, every
    axis's bytes equal (:func:`course_lib.comms.same_bytes`) and at most the predicted count (XLA's
    all-reduce combiner may merge several all-reduces into one instruction: the same bytes, fewer ops)."""
    return set(measured_) == set(predicted) and all(
        comms.same_bytes(measured_[a]["sent"], predicted[a]["sent"])
        and 1 <= measured_[a]["count"] <= predicted[a]["count"]
        for a in predicted
    )

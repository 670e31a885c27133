"""Bytes, memory and step time of the transformer lab's layouts (:mod:`course_lib.lm_layouts`), from shapes.

- :func:`predict_bytes`: every collective of a layout's step, the textbook algorithm of each mesh axis
  (:class:`course_lib.comms.Transfer` each; :func:`course_lib.comms.sent_by_axis` sums them per axis).
- :func:`predict_memory`: bytes per device by kind (parameters, optimizer state, gradients, batch,
  activations) and the two figures ``memory_analysis()`` reports exactly (arguments, outputs).
- :func:`step_time`, :func:`rank_layouts`, :func:`largest_layers`: a step-time MODEL of the programs the lab
  runs (the pipeline's stash and recompute as lesson 11's executor does them; ``remat`` for every layout)
  on a fabric (:data:`FABRICS`: 8 GPUs of one NVLink server, a TPU v5e slice; datasheet figures), through
  the course's one time model :func:`course_lib.costs.step_time` (a roofline over :func:`flops_per_device`
  and :func:`hbm_bytes`, :func:`course_lib.costs.collective_time` per transfer, with and without overlap),
  not a measurement.
- :func:`by_kind`, :func:`plot_bytes`, :func:`plot_step_times`: the lab's tables and plots.

Taught in ``notebooks/12_transformer_lab.ipynb``; tested in ``tests/test_lm_layouts.py``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import comms
from .lm_layouts import _path, layout, local_bytes, param_specs
from .lm_plots import by_kind, plot_bytes, plot_step_times, plot_time_breakdown, time_breakdown
from .meshes import DATA, MODEL, STAGE

__all__ = [
    "param_bytes",
    "transfer_of",
    "predict_bytes",
    "activation_bytes",
    "gathered_bytes",
    "predict_memory",
    "hbm_bytes",
    "flops_per_device",
    "FABRICS",
    "OVERLAPS",
    "step_time",
    "rank_layouts",
    "splits",
    "largest_layers",
    "by_kind",
    "plot_step_times",
    "plot_bytes",
    "time_breakdown",
    "plot_time_breakdown",
]


# ---- bytes on the wire, predicted from shapes ---------------------------------------------------------------


def _shapes(config) -> dict:
    """The parameters' shapes as :func:`course_lib.transformer.init_model` makes them (no model built)."""
    d, h, k, f, v, s, n = (config.d_model, config.n_heads, config.d_head, config.d_ff, config.vocab,
                           config.seq_len, config.n_layers)  # fmt: skip
    ln = lambda *lead: {"bias": (*lead, d), "scale": (*lead, d)}  # noqa: E731
    return {
        "blocks": {
            "attn": {"wk": {"kernel": (n, d, h, k)}, "wo": {"kernel": (n, h, k, d)},
                     "wq": {"kernel": (n, d, h, k)}, "wv": {"kernel": (n, d, h, k)}},
            "ln1": ln(n), "ln2": ln(n),
            "mlp": {"w1": {"bias": (n, f), "kernel": (n, d, f)}, "w2": {"bias": (n, d), "kernel": (n, f, d)}},
        },
        "embed": {"embedding": (v, d)}, "ln_f": ln(), "pos": (s, d), "unembed": {"kernel": (d, v)},
    }  # fmt: skip


def _abstract_params(config, key: str):
    shapes = _shapes(config)
    if layout(key).stage_axis:
        shapes["blocks"] = jax.tree.map(lambda sh: (1, *sh), shapes["blocks"], is_leaf=_is_shape)
    return jax.tree.map(lambda sh: jax.ShapeDtypeStruct(sh, jnp.float32), shapes, is_leaf=_is_shape)


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def param_bytes(key: str, config, sizes: dict[str, int], itemsize: int = 4, where=None) -> int:
    """Bytes of one device's parameters under layout ``key`` (``where(path_names, spec)`` selects leaves)."""
    return _param_bytes(key, config, sizes, itemsize, where)


def _param_bytes(key: str, config, sizes: dict[str, int], itemsize: int, where) -> int:
    # param_bytes' count, which gathered_bytes (and so activation_bytes) calls: lab 12's exercise 2 refuses
    # an answer that calls param_bytes, not one that calls activation_bytes
    abstract = _abstract_params(config, key)
    specs = param_specs(key, abstract, sizes)
    total = 0
    for (path, leaf), spec in zip(
        jax.tree_util.tree_leaves_with_path(abstract),
        jax.tree.leaves(specs, is_leaf=_is_spec),
        strict=True,
    ):
        if where is None or where(_path(path), spec):
            total += local_bytes(leaf.shape, spec, sizes, itemsize)
    return total


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _t(kind, axis, n, size, what, times=1):
    return [transfer_of(kind, axis, n, size, what)] * times


def transfer_of(kind: str, axis: str, n: int, size_bytes: float, what: str):
    """A predicted collective (:class:`course_lib.comms.Transfer`); a ``collective-permute`` sends ``S`` from
    ``(n-1)/n`` of the devices (a shift that stops at the last stage): its mean per device."""
    if kind == "collective-permute":
        return comms.Transfer(kind, axis, n, int(size_bytes), size_bytes * (n - 1) / n, what)
    return comms.transfer(kind, axis, n, size_bytes, what)


def predict_bytes(
    key: str,
    config,
    global_batch: int,
    sizes: dict[str, int],
    *,
    itemsize: int = 4,
    n_micro: int = 2,
) -> list:
    """The collectives of one step of layout ``key``, from shapes — the textbook algorithm of each axis.

    Args:
      key: a key of :data:`LAYOUTS`.
      config: the transformer's shape.
      global_batch: sequences per step over all devices.
      sizes: the mesh's axis sizes (:func:`mesh_axes`).
      itemsize: bytes per value (4 float32, 8 float64, 2 bfloat16 on a GPU).
      n_micro: the pipeline's micro-batches per data shard (``pp_dp``).

    Returns:
      :class:`course_lib.comms.Transfer` per collective (:func:`course_lib.comms.sent_by_axis` sums them by
      axis). The model (the algorithm :func:`course_lib.lm_steps.grads_fn` writes in ``shard_map``): each
      gradient is all-reduced over the data axes (batch, sequence) its spec does not split it over, in one
      collective over all of them (axis ``"data,model"`` names the group of both), and the loss over all
      of them; FSDP all-gathers the parameters once and reduce-scatters the gradients; TP all-reduces
      each sub-layer's output forward and its input's gradient backward (4 per layer), TP+SP replaces each
      of those by an all-gather and a reduce-scatter of the sequence-split residual (8 per layer); CP
      all-gathers the keys and values forward and reduce-scatters their gradients backward; PP (GPipe)
      sends one micro-batch activation per tick that a later tick reads, forward and backward, and
      all-reduces the embedding's and the head's gradients over the stages. On XLA:CPU every layout's
      compiled program sends exactly these bytes per mesh axis (the lab asserts it); the same step under
      the partitioner (``lm_layouts.build(..., partitioner=True)``) sends other collectives. ``ep_dp`` (the
      MoE transformer): :func:`course_lib.lm_experts.predict_bytes`.
    """
    lay = layout(key)
    if lay.expert_axis:  # the MoE transformer's own (course_lib.lm_experts)
        from . import lm_experts

        return lm_experts.predict_bytes(config, global_batch, sizes, itemsize=itemsize)
    b = global_batch // math.prod(sizes[a] for a in lay.batch_axes)
    act = b * config.seq_len * config.d_model * itemsize  # a local batch's residual stream
    if lay.stage_axis:
        out = _pipeline_transfers(key, config, sizes, itemsize, n_micro, act)
    else:
        out = _gradient_transfers(key, config, sizes, itemsize)
        out += _activation_transfers(lay, config.n_layers, sizes, act, key, config, itemsize)
    return [t for t in out if t.group_size > 1]


def _pipeline_transfers(key, config, sizes, itemsize, n_micro, act) -> list:
    p, n_d = sizes[STAGE], sizes[DATA]
    sends = 2 * (n_micro + p - 2)  # forward and backward: a tick sends when a later tick reads it
    out = _t("collective-permute", STAGE, p, act // n_micro, "a micro-batch's activation", sends)
    rest = param_bytes(key, config, sizes, itemsize, lambda names, spec: names[0] != "blocks")
    out += _t("all-reduce", STAGE, p, rest + itemsize, "embedding and head gradients (+ loss)")
    local = param_bytes(key, config, sizes, itemsize)
    out += _t("all-reduce", DATA, n_d, local + itemsize, "gradients (+ loss)")
    return out if p > 1 else out[sends:]


def _gradient_transfers(key, config, sizes, itemsize) -> list:
    """FSDP's gather and reduce-scatter per parameter, then each gradient all-reduced over the data axes its
    spec does not split it over (:func:`course_lib.lm_steps.grads_fn`), and the loss over all of them."""
    lay = layout(key)
    data_axes = tuple(
        a for a in lay.axes if (a in lay.batch_axes or a == lay.seq_axis) and sizes[a] > 1
    )
    abstract = _abstract_params(config, key)
    specs = param_specs(key, abstract, sizes)
    gathered, reduced = 0, {}
    for leaf, spec in zip(
        jax.tree.leaves(abstract), jax.tree.leaves(specs, is_leaf=_is_spec), strict=True
    ):
        split = {a for e in spec for a in ((e,) if isinstance(e, str) else (e or ()))}
        local = local_bytes(leaf.shape, spec, sizes, itemsize)
        if lay.fsdp_axis in split:
            gathered += local * sizes[lay.fsdp_axis]
        group = ",".join(a for a in data_axes if a not in split)
        reduced[group] = reduced.get(group, 0) + local
    out = []
    if gathered:
        f = sizes[lay.fsdp_axis]
        out += _t("all-gather", lay.fsdp_axis, f, gathered, "parameters gathered")
        out += _t("reduce-scatter", lay.fsdp_axis, f, gathered, "gradients reduce-scattered")
    for group, size in reduced.items():
        if group:
            n_g = math.prod(sizes[a] for a in group.split(","))
            out += _t("all-reduce", group, n_g, size, "gradients")
    n_l = math.prod(sizes[a] for a in data_axes)
    out += _t("all-reduce", ",".join(data_axes), n_l, itemsize, "loss")
    return out


def _activation_transfers(lay, n_layers, sizes, act, key, config, itemsize) -> list:
    out = []
    if lay.model_axis and lay.seq_axis == lay.model_axis:  # TP + SP
        m = sizes[MODEL]
        out += _t("all-gather", MODEL, m, act, "residual gathered over the sequence", 4 * n_layers)
        out += _t(
            "reduce-scatter", MODEL, m, act, "sub-layer output reduce-scattered", 4 * n_layers
        )
    elif lay.model_axis:  # TP
        out += _t(
            "all-reduce",
            MODEL,
            sizes[MODEL],
            act,
            "sub-layer output / input gradient",
            4 * n_layers,
        )
    if lay.seq_axis and lay.seq_axis != lay.model_axis:  # CP
        c = sizes[lay.seq_axis]
        out += _t("all-gather", lay.seq_axis, c, act, "keys and values gathered", 2 * n_layers)
        out += _t("reduce-scatter", lay.seq_axis, c, act, "key and value gradients", 2 * n_layers)
    return out


# ---- memory by kind -----------------------------------------------------------------------------------------


def _layer_values(lay, config, b: int, sizes: dict[str, int]) -> int:
    """Values one layer of one device keeps for its backward pass at ``b`` sequences: the residual stream and
    the two LayerNorm outputs (split over the sequence axis, if any), q, k, v, the attention output and the
    MLP's two hidden values (split over the model axis), the scores and weights ``[b, H, S, S]`` (heads over
    model, queries over the sequence axis); under SP the residual split, the rest whole-sequence."""
    t = sizes[lay.model_axis] if lay.model_axis else 1
    c = sizes[lay.seq_axis] if lay.seq_axis else 1
    s, d, f, h = config.seq_len, config.d_model, config.d_ff, config.n_heads
    if lay.model_axis and lay.seq_axis == lay.model_axis:  # SP
        return b * (s // t) * 3 * d + b * s * (4 * d // t + 2 * f // t) + 2 * b * (h // t) * s * s
    return b * (s // c) * (3 * d + 4 * d // t + 2 * f // t) + 2 * b * (h // t) * (s // c) * s


def _local_batch(lay, global_batch: int, sizes: dict[str, int]) -> int:
    return global_batch // math.prod(sizes[a] for a in lay.batch_axes)


def activation_bytes(key: str, config, global_batch: int, sizes: dict[str, int], itemsize: int = 4,
                     n_micro: int = 2, *, remat: bool = False, compiled: bool = False) -> int:  # fmt: skip
    """Bytes of the activations one device keeps for the backward pass — an estimate of the program's
    temporaries (``memory_analysis().temp_size_in_bytes``), as the lab's programs run.

    Every layout but the pipeline: per layer :func:`_layer_values` at the local batch, and the logits once.
    ``remat=True`` (activation recomputation, ``jax.checkpoint`` per layer): each layer keeps only its input
    (the residual stream, split as the layout splits it), and one layer's values are live at a time while
    the backward pass recomputes it. The pipeline (``pp_dp``) as lesson 11's executor
    (:func:`course_lib.pipeline.train`) runs it — it always recomputes: the F lane stashes each micro-batch's
    stage *input* (``m + 1`` slots), the B lane recomputes the stage from it under ``jax.vjp``; the program
    also holds the embedded micro-batches ``xs`` (``m``), their input cotangents ``dxs`` (``m + 1``) and the
    two tick buffers: ``3m + 4`` micro-batch activations ``[b/m, S, D]``, plus one micro-batch's stage values
    and logits. ``remat`` changes nothing there. ``compiled=True``: what the program XLA:CPU compiles from
    it holds — XLA:CPU's schedule of the unrolled tick loop keeps every one of the ``m + p − 1`` B ticks'
    recomputed stage values and logits (idle ticks too: masked, not skipped) beside the ``3m + 4`` buffers
    (measured, not explained: tying the stash to the arriving cotangent does not change it;
    ``notebooks/12_transformer_lab.ipynb`` asserts it within 20 % of ``temp_size_in_bytes``).
    Under FSDP the gathered parameters too: the step gathers
    each one once and keeps it through the backward pass (``SHARD_GRAD_OP``, :mod:`course_lib.lm_steps`),
    so a device holds every parameter as the model axis splits it, beside its shard (:func:`gathered_bytes`).
    ``notebooks/12_transformer_lab.ipynb`` compares the estimate with ``memory_analysis()`` per layout.
    """
    lay = layout(key)
    b = _local_batch(lay, global_batch, sizes)
    c = sizes[lay.seq_axis] if lay.seq_axis else 1
    s, d = config.seq_len, config.d_model
    if lay.stage_axis:
        if b % n_micro:
            raise ValueError(
                f"a local batch of {b} does not split into n_micro={n_micro} micro-batches"
            )
        p = sizes[lay.stage_axis]
        b_mb, layers = b // n_micro, config.n_layers // p
        values = layers * _layer_values(lay, config, b_mb, sizes) + b_mb * s * config.vocab
        recomputed = n_micro + p - 1 if compiled else 1  # stage values and logits held at once
        return int(((3 * n_micro + 4) * b_mb * s * d + recomputed * values) * itemsize)
    logits = b * (s // c) * config.vocab
    if remat:
        t = sizes[lay.model_axis] if lay.seq_axis and lay.seq_axis == lay.model_axis else c
        values = config.n_layers * b * (s // t) * d + _layer_values(lay, config, b, sizes)
    else:
        values = config.n_layers * _layer_values(lay, config, b, sizes)
    return int((values + logits) * itemsize) + gathered_bytes(key, config, sizes, itemsize)


def gathered_bytes(key: str, config, sizes: dict[str, int], itemsize: int = 4) -> int:
    """Bytes of the parameters one device holds whole over the fsdp axis during the step (gathered once and
    kept through the backward pass: ``SHARD_GRAD_OP``); 0 for a layout without one."""
    lay = layout(key)
    if not lay.fsdp_axis:
        return 0
    f = sizes[lay.fsdp_axis]
    split = _param_bytes(
        key, config, sizes, itemsize, lambda names, spec: lay.fsdp_axis in tuple(spec)
    )
    return split * f


def predict_memory(key: str, config, global_batch: int, sizes: dict[str, int], itemsize: int = 4,
                   n_micro: int = 2, *, remat: bool = False) -> dict[str, int]:  # fmt: skip
    """Bytes per device by kind: ``params``, ``optimizer`` (momentum: one value per parameter),
    ``gradients`` (laid out as the parameters), ``batch`` (tokens and targets, int32), ``activations``
    (:func:`activation_bytes`, an estimate; ``remat`` passed on), and what the compiled step's
    ``memory_analysis()`` reports exactly: ``arguments`` (params + optimizer + batch) and ``outputs`` (params
    + optimizer + gradients + the loss, + 8 bytes per output array on XLA:CPU: the output tuple's table of
    buffer pointers). ``ep_dp`` (the MoE transformer): :func:`course_lib.lm_experts.predict_memory`
    (``n_micro`` unused; ``remat`` not modelled there: ValueError)."""
    lay = layout(key)
    if lay.expert_axis:
        from . import lm_experts

        if remat:
            raise ValueError(f"remat is not modelled for layout {key!r}; pass remat=False")
        return lm_experts.predict_memory(config, global_batch, sizes, itemsize)
    prm = param_bytes(key, config, sizes, itemsize)
    n_leaves = len(jax.tree.leaves(_abstract_params(config, key)))
    b = _local_batch(lay, global_batch, sizes)
    c = sizes[lay.seq_axis] if lay.seq_axis else 1
    batch = 2 * b * (config.seq_len // c) * 4
    acts = activation_bytes(key, config, global_batch, sizes, itemsize, n_micro, remat=remat)
    return {
        "params": prm,
        "optimizer": prm,
        "gradients": prm,
        "batch": batch,
        "activations": acts,
        "arguments": 2 * prm + batch,
        "outputs": 3 * prm + itemsize + 8 * (3 * n_leaves + 1),
    }


# the step-time model (course_lib.lm_times), re-exported: lm_costs.step_time, lm_costs.rank_layouts, ...
from .lm_times import (  # noqa: E402
    FABRICS,
    OVERLAPS,
    flops_per_device,
    hbm_bytes,
    largest_layers,
    rank_layouts,
    splits,
    step_time,
)

"""Bytes, memory and step time of the transformer lab's layouts (:mod:`course_lib.lm_layouts`), from shapes.

- :func:`predict_bytes`: every collective of a layout's step, the textbook algorithm of each mesh axis
  (:class:`course_lib.comms.Transfer` each; :func:`course_lib.comms.sent_by_axis` sums them per axis).
- :func:`predict_memory`: bytes per device by kind (parameters, optimizer state, gradients, batch,
  activations) and the two figures ``memory_analysis()`` reports exactly (arguments, outputs).
- :func:`step_time`, :func:`rank_layouts`, :func:`largest_layers`: a step-time MODEL for 8 GPUs of one NVLink
  server (H100, H200: datasheet figures), not a measurement — what the lab's exercises ask the learner to
  predict; its compute part is a roofline over :func:`hbm_bytes` (HBM traffic; ``roofline=False``: FLOPs only).
- :func:`by_kind`, :func:`plot_bytes`, :func:`plot_step_times`: the lab's tables and plots.

Taught in ``notebooks/12_transformer_lab.ipynb``; tested in ``tests/test_lm_layouts.py``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import comms, costs, transformer
from .lm_layouts import LAYOUTS, _path, layout, local_bytes, mesh_axes, param_specs
from .lm_plots import by_kind, plot_bytes, plot_step_times
from .meshes import DATA, MODEL, STAGE

__all__ = [
    "param_bytes",
    "transfer_of",
    "predict_bytes",
    "activation_bytes",
    "gathered_bytes",
    "predict_memory",
    "hbm_bytes",
    "H200",
    "PROFILES",
    "MEMORY_BYTES",
    "step_time",
    "rank_layouts",
    "splits",
    "largest_layers",
    "by_kind",
    "plot_step_times",
    "plot_bytes",
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
      the partitioner (``lm_layouts.build(..., partitioner=True)``) sends other collectives.
    """
    lay = layout(key)
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


def activation_bytes(key: str, config, global_batch: int, sizes: dict[str, int], itemsize: int = 4,
                     n_micro: int = 2) -> int:  # fmt: skip
    """Bytes of the activations one device keeps for the backward pass — an estimate, per layer: the
    residual stream and the two LayerNorm outputs (split over the sequence axis, if any), q, k, v, the
    attention output and the MLP's two hidden values (split over the model axis), the scores and weights
    ``[b, H, S, S]`` (heads over model, queries over the sequence axis); the logits once. A pipeline stage
    holds its layers' values for all its micro-batches (GPipe). Under FSDP the gathered parameters too: the
    step gathers each one once and keeps it through the backward pass (``SHARD_GRAD_OP``,
    :mod:`course_lib.lm_steps`), so a device holds every parameter as the model axis splits it, beside its
    shard (:func:`gathered_bytes`)."""
    lay = layout(key)
    b = global_batch // math.prod(sizes[a] for a in lay.batch_axes)
    t = sizes[lay.model_axis] if lay.model_axis else 1
    c = sizes[lay.seq_axis] if lay.seq_axis else 1
    s, d, f, h = config.seq_len, config.d_model, config.d_ff, config.n_heads
    layers = config.n_layers // (sizes[lay.stage_axis] if lay.stage_axis else 1)
    per_layer = b * (s // c) * (3 * d + 4 * d // t + 2 * f // t) + 2 * b * (h // t) * (s // c) * s
    if (
        lay.model_axis and lay.seq_axis == lay.model_axis
    ):  # SP: residual split, the rest whole-sequence
        per_layer = (
            b * (s // t) * 3 * d + b * s * (4 * d // t + 2 * f // t) + 2 * b * (h // t) * s * s
        )
    logits = b * (s // c) * config.vocab
    return int((layers * per_layer + logits) * itemsize) + gathered_bytes(
        key, config, sizes, itemsize
    )


def gathered_bytes(key: str, config, sizes: dict[str, int], itemsize: int = 4) -> int:
    """Bytes of the parameters one device holds whole over the fsdp axis during the step (gathered once and
    kept through the backward pass: ``SHARD_GRAD_OP``); 0 for a layout without one."""
    lay = layout(key)
    if not lay.fsdp_axis:
        return 0
    f = sizes[lay.fsdp_axis]
    split = param_bytes(
        key, config, sizes, itemsize, lambda names, spec: lay.fsdp_axis in tuple(spec)
    )
    return split * f


def predict_memory(key: str, config, global_batch: int, sizes: dict[str, int], itemsize: int = 4,
                   n_micro: int = 2) -> dict[str, int]:  # fmt: skip
    """Bytes per device by kind: ``params``, ``optimizer`` (momentum: one value per parameter),
    ``gradients`` (laid out as the parameters), ``batch`` (tokens and targets, int32), ``activations``
    (:func:`activation_bytes`, an estimate), and what the compiled step's ``memory_analysis()`` reports
    exactly: ``arguments`` (params + optimizer + batch) and ``outputs`` (params + optimizer + gradients +
    the loss, + 8 bytes per output array on XLA:CPU: the output tuple's table of buffer pointers)."""
    lay = layout(key)
    prm = param_bytes(key, config, sizes, itemsize)
    n_leaves = len(jax.tree.leaves(_abstract_params(config, key)))
    b = global_batch // math.prod(sizes[a] for a in lay.batch_axes)
    c = sizes[lay.seq_axis] if lay.seq_axis else 1
    batch = 2 * b * (config.seq_len // c) * 4
    return {
        "params": prm,
        "optimizer": prm,
        "gradients": prm,
        "batch": batch,
        "activations": activation_bytes(key, config, global_batch, sizes, itemsize, n_micro),
        "arguments": 2 * prm + batch,
        "outputs": 3 * prm + itemsize + 8 * (3 * n_leaves + 1),
    }


# ---- a step-time model for GPUs (a model, not a measurement) ------------------------------------------------

H200 = costs.device_profile("H200 SXM 141GB, NVLink 4", "H200")  # the table's bandwidths
PROFILES = {"H100": costs.DEVICE_PROFILES["H100"], "H200": H200}
"""The device profiles of the lab's step-time model (8 GPUs of one NVLink server)."""
MEMORY_BYTES = {"H100": 80e9, "H200": 141e9}
"""HBM per GPU (datasheets)."""


def hbm_bytes(key: str, config, global_batch: int, sizes: dict[str, int], itemsize: int = 2,
              n_micro: int = 2) -> int:  # fmt: skip
    """Bytes one device reads and writes in HBM per training step of layout ``key`` — a MODEL, no caches, no
    fusion, every value in ``itemsize`` bytes (2: bfloat16). With ``W`` the parameter bytes the device's
    matmuls read (its shard ``p``, :func:`param_bytes`, plus under FSDP the gathered copy ``G``,
    :func:`gathered_bytes`) and ``A`` its activations (:func:`activation_bytes`, which holds ``G`` too):
    parameters read forward and backward ``2·W``; gradients written ``p``; the update reads gradients,
    parameters and momentum and writes parameters and momentum ``5·p``; activations written forward and read
    backward ``2·(A - G)``. Total ``2·W + 6·p + 2·(A - G) = 8·p + 2·A`` (:func:`predict_memory`'s
    ``params`` and ``activations``)."""
    return _hbm(predict_memory(key, config, global_batch, sizes, itemsize, n_micro))


def _hbm(mem: dict[str, int]) -> int:
    return 8 * mem["params"] + 2 * mem["activations"]


def step_time(key: str, config, global_batch: int, profile: costs.DeviceProfile, n_devices: int = 8, *,
              precision: str = "bfloat16", n_micro: int | None = None, roofline: bool = True,
              mfu: float = 1.0) -> dict[str, Any]:  # fmt: skip
    """Layout ``key``'s step time on ``profile`` — a MODEL: the training FLOPs (3 × the forward's,
    :func:`course_lib.transformer.flops_per_token`) split over the devices at ``mfu`` (the fraction of the
    peak a step reaches; 1.0: the datasheet's peak, an upper bound of the speed), stretched by the
    pipeline's bubble ``(m + p - 1)/m``, plus per mesh axis the predicted bytes (:func:`predict_bytes`) at
    the link bandwidth and a fixed latency (:data:`course_lib.costs.COLLECTIVE_LATENCY_S`) per predicted
    transfer (a line of :func:`predict_bytes`; FSDP's gathers of all parameters count as one), not per
    collective the program runs; no overlap of compute and communication. The
    compute part is a roofline, ``max(FLOPs / peak, HBM bytes / HBM bandwidth)`` (:func:`hbm_bytes` at
    ``profile.hbm_bytes_per_s``), stretched by the bubble: the H200's faster HBM counts where a step is
    memory-bound (``roofline=False``: the FLOPs' time only).

    Returns:
      ``{"layout", "sizes", "compute_s", "comm_s" (per axis), "step_s", "sent_bytes" (per device),
      "memory_bytes" (per device: parameters, optimizer, gradients, activations)}``; with ``roofline``
      also ``"flop_s"``, ``"hbm_s"`` (each before the bubble) and ``"hbm_bytes"`` (per device).
    """
    sizes = mesh_axes(key, n_devices)
    if sizes is None:
        raise ValueError(f"layout {key!r} does not fit {n_devices} devices")
    itemsize = 2 if precision == "bfloat16" else (8 if precision == "float64" else 4)
    lay = layout(key)
    m = n_micro or (4 * sizes[lay.stage_axis] if lay.stage_axis else 1)
    flops = 3 * transformer.flops_per_token(config) * global_batch * config.seq_len / n_devices
    peak = costs.rate(profile.peak, precision)
    mem = predict_memory(key, config, global_batch, sizes, itemsize, m)
    compute, extra = flops / (peak * mfu), {}
    if roofline:
        moved = _hbm(mem)
        extra = {"flop_s": compute, "hbm_s": moved / profile.hbm_bytes_per_s, "hbm_bytes": moved}
        compute = max(compute, extra["hbm_s"])
    if lay.stage_axis:
        compute *= (m + sizes[lay.stage_axis] - 1) / m
    transfers = predict_bytes(key, config, global_batch, sizes, itemsize=itemsize, n_micro=m)
    comm: dict[str, float] = {}
    for t in transfers:
        comm[t.axis] = (
            comm.get(t.axis, 0.0)
            + t.sent_bytes / profile.link_bytes_per_s
            + costs.COLLECTIVE_LATENCY_S
        )
    memory = mem["params"] + mem["optimizer"] + mem["gradients"] + mem["activations"]
    return {
        "layout": key, "sizes": sizes, "compute_s": compute, "comm_s": comm,
        "step_s": compute + sum(comm.values()), "sent_bytes": comms.total_sent(transfers),
        "memory_bytes": memory, **extra,
    }  # fmt: skip


def rank_layouts(config, global_batch: int, profile: costs.DeviceProfile, n_devices: int = 8, *,
                 memory_limit: float | None = None, precision: str = "bfloat16",
                 roofline: bool = True, mfu: float = 1.0) -> list[dict]:  # fmt: skip
    """Every layout that fits ``n_devices`` (and, given ``memory_limit``, whose predicted memory per device
    is at most it), fastest first by :func:`step_time` (``roofline`` and ``mfu`` passed on) — the model's ranking, not a
    measurement. A layout whose batch or heads do not split is left out."""
    rows = []
    for key in LAYOUTS:
        sizes = mesh_axes(key, n_devices)
        if sizes is None or not splits(key, config, global_batch, sizes):
            continue
        row = step_time(key, config, global_batch, profile, n_devices, precision=precision,
                        roofline=roofline, mfu=mfu)  # fmt: skip
        if memory_limit is None or row["memory_bytes"] <= memory_limit:
            rows.append(row)
    return sorted(rows, key=lambda r: r["step_s"])


def splits(key: str, config, global_batch: int, sizes: dict[str, int]) -> bool:
    """True when layout ``key`` on axes ``sizes`` splits the model and the batch evenly: the batch by its
    batch axes (and the pipeline's ``4 × stages`` micro-batches), heads and MLP width by ``model``, the
    sequence by its sequence axis, the layers by ``stage``."""
    lay = layout(key)
    n_batch = math.prod(sizes[a] for a in lay.batch_axes)
    m = 4 * sizes[lay.stage_axis] if lay.stage_axis else 1
    ok = global_batch % (n_batch * m) == 0
    if lay.model_axis:
        ok &= (
            config.n_heads % sizes[lay.model_axis] == 0 and config.d_ff % sizes[lay.model_axis] == 0
        )
    if lay.seq_axis:
        ok &= config.seq_len % sizes[lay.seq_axis] == 0
    if lay.stage_axis:
        ok &= config.n_layers % sizes[lay.stage_axis] == 0
    return bool(ok)


def largest_layers(key: str, config, global_batch: int, memory_limit: float, n_devices: int = 8, *,
                   precision: str = "bfloat16", max_layers: int = 4096) -> int:  # fmt: skip
    """The most layers (``config`` otherwise unchanged) whose predicted memory per device
    (:func:`step_time`'s ``memory_bytes``) is at most ``memory_limit``; 0 when not even one fits. For
    ``pp_dp`` the count is a multiple of the stage axis."""
    sizes = mesh_axes(key, n_devices)
    if sizes is None:
        raise ValueError(f"layout {key!r} does not fit {n_devices} devices")
    step = sizes.get(STAGE, 1)

    def fits(n):
        cfg = dataclasses.replace(config, n_layers=n * step)
        row = step_time(key, cfg, global_batch, PROFILES["H100"], n_devices, precision=precision)
        return row["memory_bytes"] <= memory_limit

    lo, hi = 0, max_layers // step  # fits(lo) (or lo == 0); the memory grows with the layers
    if fits(hi):
        return hi * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step

"""A step-time model of the transformer lab's layouts (:mod:`course_lib.lm_layouts`) as the lab runs them.

The course's one time model (:func:`course_lib.costs.step_time`: a roofline of FLOPs and HBM bytes,
:func:`course_lib.costs.collective_time` per collective on its axis's link, with and without overlap) fed
with the lab's predictions (:mod:`course_lib.lm_costs`: bytes per transfer, memory by kind), for a fabric of
:mod:`course_lib.chips` (8 H100s or H200s on NVLink, a TPU v5e slice; InfiniBand between nodes with
:meth:`~course_lib.chips.Fabric.with_axis`). A MODEL, not a measurement: nothing here ran on a GPU.
Re-exported by :mod:`course_lib.lm_costs`; taught in ``notebooks/12_transformer_lab.ipynb``; tested in
``tests/test_lm_layouts.py``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from . import comms, costs, lm_costs, transformer
from .lm_layouts import LAYOUTS, layout, mesh_axes
from .meshes import STAGE


def _itemsize(precision: str) -> int:
    """Bytes of one element the time model moves at ``precision`` (bfloat16 2, float64 8, else 4)."""
    return 2 if precision == "bfloat16" else (8 if precision == "float64" else 4)


# ---- a step-time model for 8 GPUs or a TPU slice (a model, not a measurement) -------------------------------

FABRICS = {name: costs.FABRICS[name] for name in ("H100", "H200", "TPU v5e")}
"""The fabrics of the lab's step-time model (:data:`course_lib.chips.FABRICS`: 8 GPUs of one NVLink server,
a TPU v5e slice on ICI); :meth:`course_lib.chips.Fabric.with_axis` puts an axis on another link (InfiniBand
between nodes)."""

OVERLAPS = ("none", "data", "all")
"""How :func:`step_time` adds communication to compute: ``"none"`` the sum (the scaling book's upper bound);
``"all"`` their maximum (perfect overlap, the lower bound); ``"data"`` the middle: the gradients',
parameters' and pipeline's transfers hide behind compute, the TP/SP/CP collectives (the next matmul waits for
them) stay on the critical path."""

_CRITICAL = ("sub-layer", "residual", "keys and values", "key and value")
"""Transfers on the critical path under ``overlap="data"`` (``what`` starts so): TP, SP and CP's."""


def hbm_bytes(key: str, config, global_batch: int, sizes: dict[str, int], itemsize: int = 2,
              n_micro: int = 2, *, remat: bool = False) -> int:  # fmt: skip
    """Bytes one device reads and writes in HBM per training step of layout ``key`` — a MODEL, no caches, no
    fusion, every value in ``itemsize`` bytes (2: bfloat16). With ``W`` the parameter bytes the device's
    matmuls read (its shard ``p``, :func:`~course_lib.lm_costs.param_bytes`, plus under FSDP the gathered
    copy ``G``, :func:`~course_lib.lm_costs.gathered_bytes`) and ``A`` its activations
    (:func:`~course_lib.lm_costs.activation_bytes`, which holds ``G`` too): parameters read forward and
    backward ``2·W``; gradients written ``p``; the update reads gradients, parameters and momentum and writes
    parameters and momentum ``5·p``; activations written forward and read backward ``2·(A - G)``. Total
    ``2·W + 6·p + 2·(A - G) = 8·p + 2·A`` (:func:`~course_lib.lm_costs.predict_memory`'s ``params`` and
    ``activations``)."""
    mem = lm_costs.predict_memory(key, config, global_batch, sizes, itemsize, n_micro, remat=remat)
    return 8 * mem["params"] + 2 * mem["activations"]


def flops_per_device(key: str, config, global_batch: int, sizes: dict[str, int], n_micro: int = 1, *,
                     remat: bool = False) -> float:  # fmt: skip
    """FLOPs one device runs per training step of layout ``key`` (a model: the matmuls and scores of
    :func:`course_lib.transformer.flops_per_token`, blocks ``F_b`` and head ``F_h`` per token): forward and
    backward ``3·(F_b + F_h)`` per token over the devices; ``remat`` recomputes the blocks' forward,
    ``4·F_b + 3·F_h``. The pipeline as lesson 11's executor runs it: every stage, at every one of its
    ``m + p − 1`` F ticks and as many B ticks (idle ones too: masked, not skipped), runs its ``L/p`` layers
    and the head on a micro-batch — F once, B recomputes the stage and the head and runs both backward:
    ``(4·F_b/p + 4·F_h) × (b/m)·S × (m + p − 1)``, the bubble and the head on every stage included."""
    lay = layout(key)
    fb = transformer.flops_per_token(config) - 2 * config.d_model * config.vocab
    fh = 2 * config.d_model * config.vocab
    n_devices = math.prod(sizes.values())
    if lay.stage_axis:
        p = sizes[lay.stage_axis]
        b = lm_costs._local_batch(lay, global_batch, sizes)
        return (4 * fb / p + 4 * fh) * (b / n_micro) * config.seq_len * (n_micro + p - 1)
    per_token = (4 if remat else 3) * fb + 3 * fh
    return per_token * global_batch * config.seq_len / n_devices


def step_time(key: str, config, global_batch: int, fabric, n_devices: int = 8, *,
              precision: str = "bfloat16", n_micro: int | None = None, roofline: bool = True,
              mfu: float = 1.0, remat: bool = False, overlap: str = "none") -> dict[str, Any]:  # fmt: skip
    """Layout ``key``'s step time on ``fabric`` (:data:`FABRICS`, a :class:`course_lib.chips.Fabric`) — a
    MODEL, through the course's one time model :func:`course_lib.costs.step_time`: the FLOPs
    (:func:`flops_per_device`, at ``mfu`` of the peak; 1.0: the datasheet's peak) and, with ``roofline``,
    the HBM bytes (:func:`hbm_bytes`) give the compute time (the roofline's maximum); every predicted
    transfer (:func:`~course_lib.lm_costs.predict_bytes`, a line each) costs
    :func:`course_lib.costs.collective_time` on its axes' link; ``overlap`` (:data:`OVERLAPS`) says how the
    two add up. The pipeline's micro-batches default to ``4 × stages``.

    Returns:
      ``{"layout", "sizes", "compute_s" (the roofline), "flop_s", "hbm_s", "hbm_bytes", "comm_s" (per axis),
      "critical_s" (TP/SP/CP's part), "no_overlap_s", "data_overlap_s", "overlap_s", "step_s" (the one
      ``overlap`` names), "overlap", "bubble_s" (the pipeline's idle ticks' share of the compute,
      ``(p − 1)/(m + p − 1)`` of it: its executor computes them masked; 0 for the other layouts),
      "sent_bytes", "memory_bytes" (parameters, optimizer, gradients, activations)}``.
      :func:`course_lib.lm_plots.time_breakdown` splits ``step_s`` into its parts.

    ``ep_dp`` trains the MoE transformer: :func:`course_lib.lm_experts.step_time` (the same time model,
    the same keys; ``n_micro`` and ``remat`` not used there).

    Raises:
      ValueError: the layout does not fit ``n_devices``, or an unknown ``overlap``.
    """
    if layout(key).expert_axis:
        from . import lm_experts

        return lm_experts.step_time(config, global_batch, fabric, n_devices, precision=precision,
                                    roofline=roofline, mfu=mfu, overlap=overlap)  # fmt: skip
    sizes = mesh_axes(key, n_devices)
    if sizes is None:
        raise ValueError(f"layout {key!r} does not fit {n_devices} devices")
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap={overlap!r}; one of {OVERLAPS}")
    itemsize = _itemsize(precision)
    lay = layout(key)
    m = n_micro or (4 * sizes[lay.stage_axis] if lay.stage_axis else 1)
    mem = lm_costs.predict_memory(key, config, global_batch, sizes, itemsize, m, remat=remat)
    flops = flops_per_device(key, config, global_batch, sizes, m, remat=remat) / mfu
    moved = 8 * mem["params"] + 2 * mem["activations"]
    transfers = lm_costs.predict_bytes(
        key, config, global_batch, sizes, itemsize=itemsize, n_micro=m
    )
    t = costs.step_time(flops, moved if roofline else None, transfers, fabric, precision)
    critical = sum(
        costs.collective_time(x.kind, x.group_size, x.size_bytes, fabric.link_of(x.axis))
        for x in transfers
        if x.what.startswith(_CRITICAL)
    )
    roof = t["roofline_s"]
    bounds = {
        "no_overlap_s": t["no_overlap_s"],
        "data_overlap_s": max(roof, t["comm_s"] - critical) + critical,
        "overlap_s": t["overlap_s"],
    }
    step = bounds[{"none": "no_overlap_s", "data": "data_overlap_s", "all": "overlap_s"}[overlap]]
    memory = mem["params"] + mem["optimizer"] + mem["gradients"] + mem["activations"]
    p = sizes[lay.stage_axis] if lay.stage_axis else 1
    return {
        "layout": key, "sizes": sizes, "compute_s": roof, "flop_s": t["compute_s"], "hbm_s": t["memory_s"],
        "hbm_bytes": moved, "comm_s": t["comm_by_axis"], "critical_s": critical, **bounds, "step_s": step,
        "overlap": overlap, "bubble_s": roof * (p - 1) / (m + p - 1) if p > 1 else 0.0,
        "sent_bytes": comms.total_sent(transfers), "memory_bytes": memory,
    }  # fmt: skip


def rank_layouts(config, global_batch: int, fabric, n_devices: int = 8, *,
                 memory_limit: float | None = None, **options) -> list[dict]:  # fmt: skip
    """Every layout that fits ``n_devices`` (and, given ``memory_limit``, whose predicted memory per device
    is at most it), fastest first by :func:`step_time` (``options`` passed on: ``precision``, ``roofline``,
    ``mfu``, ``remat``, ``overlap``) — the model's ranking, not a measurement. A layout whose batch or heads
    do not split is left out, and so is ``ep_dp``: it trains another model (the MoE transformer, ``E``
    times the MLP's parameters), so its time is not a way to run this one; :func:`step_time` gives its row
    (the lab shows it beside the ranking)."""
    rows = []
    for key in LAYOUTS:
        if LAYOUTS[key].expert_axis:
            continue
        sizes = mesh_axes(key, n_devices)
        if sizes is None or not splits(key, config, global_batch, sizes):
            continue
        row = step_time(key, config, global_batch, fabric, n_devices, **options)
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
                   precision: str = "bfloat16", max_layers: int = 4096, remat: bool = False,
                   n_micro: int | None = None) -> int:  # fmt: skip
    """The most layers (``config`` otherwise unchanged) whose predicted memory per device
    (:func:`step_time`'s ``memory_bytes``; ``remat`` passed on) is at most ``memory_limit``; 0 when not even
    one fits. For ``pp_dp`` the count is a multiple of the stage axis, at ``n_micro`` micro-batches (None:
    the lab's 4 per stage)."""
    sizes = mesh_axes(key, n_devices)
    if sizes is None:
        raise ValueError(f"layout {key!r} does not fit {n_devices} devices")
    step = sizes.get(STAGE, 1)
    itemsize = _itemsize(precision)

    def fits(n):  # step_time's memory_bytes, without the time
        cfg = dataclasses.replace(config, n_layers=n * step)
        m = n_micro if n_micro is not None else 4 * step if step > 1 else 1
        mem = lm_costs.predict_memory(key, cfg, global_batch, sizes, itemsize, m, remat=remat)
        return (
            mem["params"] + mem["optimizer"] + mem["gradients"] + mem["activations"] <= memory_limit
        )

    lo, hi = 0, max_layers // step  # fits(lo) (or lo == 0); the memory grows with the layers
    if fits(hi):
        return hi * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step

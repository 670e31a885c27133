"""What a training step costs, from shapes and datasheets: memory by kind, MFU and HFU, a step-time model.

- **Memory per device by kind** (:func:`residual_activation_bytes`; parameters, gradients and optimizer
  state from the layout, :func:`course_lib.comms.local_param_count`): parameters, the reduced gradients the
  update reads and the optimizer state follow exactly from the parameter layout; the activations the
  backward pass keeps follow from the layer shapes, the per-device batch and the tensor-parallel layout. The
  compiled program's temporaries (``memory_analysis().temp_size_in_bytes``) hold more than those
  activations — the backward pass's own intermediates, the gradients before their reduction, the max-pools'
  index tensors, layout copies — so the prediction is a lower bound of the temporaries;
  ``notebooks/08_lab.ipynb`` attributes them with XLA's buffer assignment (:mod:`course_lib.xla_dump`). The
  input images are kept too, but the program holds them as an argument, so they are not counted here.
- **Peak FLOP/s** (:data:`PEAKS`, :func:`peak_flops`: the one table of accelerators, kept in
  :mod:`course_lib.chips` with HBM and link figures) per TPU or GPU kind and precision, dense (no
  sparsity), from the vendors' pages, for the utilisation (:func:`mfu`): of the *model's* FLOPs (MFU: the work a
  training step needs, :func:`model_flops_per_step`), or of the FLOPs the compiled program runs (HFU:
  everything it computes, work computed twice included). MFU ≤ HFU: the model's count leaves out what the
  step does not need, the lab asserts model ≤ compiled FLOPs for every strategy. None on simulated CPU
  devices: no peak is claimed.
- **Time beside bytes** (:func:`step_time`): a compiled program's FLOPs, HBM bytes and collectives on a named
  fabric (:data:`FABRICS`): compute, memory (the roofline's two terms) and each collective's time, with and
  without overlap; the critical size below which communication binds (:func:`critical_size`, and
  :func:`critical_batch` where part of the traffic grows with the batch). A model, not a measurement.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# the one table of accelerators (TPUs and GPUs), re-exported: costs.PEAKS, costs.peak_flops, costs.rate
from .chips import (  # noqa: F401
    FABRICS,
    LINKS,
    PEAKS,
    SWITCH_LATENCY_S,
    TF32_PRECISIONS,
    Fabric,
    Link,
    Peak,
    chip_for,
    peak_flops,
    rate,
)

# ---- memory by kind ----------------------------------------------------------------------------------


def residual_activation_bytes(
    layout: str | None, cfg: Any, local_batch: int, n_model: int = 1, value_bytes: int = 4
) -> int:
    """Bytes of the activations one device keeps for the backward pass (a lower bound of its temporaries).

    Counted per conv block: its output before the pool and after it; the dense outputs. Not the input
    images: the backward pass keeps them too, but the compiled program holds them as an argument
    (``memory_analysis().argument_size_in_bytes``), not among its temporaries.
    A tensor-parallel layout (``"gather"``, ``"pairs"``, ``"article"``; :mod:`course_lib.parallel`) keeps
    split layers at ``channels / n_model`` and holds a psum'd or gathered output twice (the per-shard part
    and the full result).

    Args:
      layout: None for strategies whose devices keep whole activations (A, B, D, E).
      cfg: the CNN's shape (:class:`course_lib.model.CNNConfig`).
      local_batch: images per device (global batch / data shards).
      n_model: the model axis size.
      value_bytes: bytes per activation value (4 float32, 8 float64, 2 bfloat16).

    Raises:
      ValueError: an unknown layout.
    """
    s, (c1, c2, c3), m = cfg.image_size, cfg.channels, n_model
    px = [s * s, (s // 2) ** 2, (s // 4) ** 2, (s // 8) ** 2]
    h, k = cfg.hidden, cfg.num_classes
    # (pre-pool, pooled, extra full copies at the pooled size) per conv, then the dense outputs
    if layout is None:
        per = [(c1, c1, 0), (c2, c2, 0), (c3, c3, 0)]
        dense = h + k
    elif layout == "gather":
        per = [(c1 // m, c1 // m, c1), (c2 // m, c2 // m, 0), (2 * c3, c3, 0)]
        dense = h // m + 2 * k
    elif layout == "pairs":
        per = [(c1 // m, c1 // m, 0), (2 * c2, c2, 0), (c3 // m, c3 // m, 0)]
        dense = 2 * h + k
    elif layout == "article":
        per = [(c1 // m + c1, c1, 0), (c2, c2, 0), (c3, c3, 0)]
        dense = h + k
    else:
        raise ValueError(f"unknown layout {layout!r}; one of None, 'gather', 'pairs', 'article'")
    values = sum(
        pre * px[i] + (pool + extra) * px[i + 1] for i, (pre, pool, extra) in enumerate(per)
    )
    values += dense
    return int(values * local_batch * value_bytes)


# ---- peak FLOP/s and MFU -----------------------------------------------------------------------------


def valid_taps(size: int, kernel: int = 3) -> int:
    """(output pixel, kernel tap) pairs of a ``kernel`` × ``kernel`` 'SAME' convolution, stride 1, on a
    ``size`` × ``size`` image that fall inside the image: the multiply-adds per (input, output) channel
    pair. The taps on the zero padding are left out, as XLA's cost analysis leaves them out:
    ``(3·size − 2)²`` for a 3 × 3 kernel, against ``9·size²`` with the padding.
    """
    half = kernel // 2
    per_row = sum(min(i + half, size - 1) - max(i - half, 0) + 1 for i in range(size))
    return per_row * per_row


def model_flops_breakdown(cfg: Any) -> dict[str, float]:
    """FLOPs per image of the work a training step needs, per layer and pass (2 per multiply-add).

    Forward: each conv's valid taps (:func:`valid_taps`) and each dense layer's matmul. Backward: the weight
    gradient of every layer (as many multiply-adds as its forward) and the input gradient of every layer but
    the first — nothing needs the gradient of the images. Bias adds, ReLUs, pools, the loss and the optimizer
    are left out (a few per cent here); the compiled program counts them (``cost_analysis()["flops"]``).

    Returns:
      ``{"conv1 forward": …, "conv1 weight gradient": …, "conv2 input gradient": …, …}``.
    """
    out: dict[str, float] = {}
    s, c_in = cfg.image_size, cfg.in_channels
    layers = []
    for i, c_out in enumerate(cfg.channels, start=1):
        layers.append((f"conv{i}", 2.0 * valid_taps(s) * c_in * c_out))
        c_in, s = c_out, s // 2
    layers.append(("dense1", 2.0 * cfg.flat_features * cfg.hidden))
    layers.append(("dense2", 2.0 * cfg.hidden * cfg.num_classes))
    for i, (name, flops) in enumerate(layers):
        out[f"{name} forward"] = flops
        out[f"{name} weight gradient"] = flops
        if i > 0:  # the first layer's input gradient is the images' gradient: never needed
            out[f"{name} input gradient"] = flops
    return out


def model_flops_per_step(cfg: Any, global_batch: int) -> float:
    """The model's FLOPs per training step: :func:`model_flops_breakdown` summed, × the global batch.

    The numerator of MFU: the same for every strategy, whatever work a layout repeats or the compiler adds,
    and never more than the compiled program runs (``notebooks/08_lab.ipynb`` asserts it for every
    strategy). The "3 × forward" rule overcounts it: by the padding taps and by the first layer's input
    gradient (``notebooks/08_lab.ipynb`` prints both).
    """
    return float(sum(model_flops_breakdown(cfg).values())) * global_batch


def mfu(flops_per_device: float, step_time_s: float, peak: float | None) -> float:
    """FLOP utilisation: FLOPs per device per step / step time / peak FLOP/s; NaN without a peak.

    Given the model's FLOPs per device (:func:`model_flops_per_step` / devices) it is the model FLOP
    utilisation (MFU); given the compiled program's (``cost_analysis()["flops"]``), the hardware FLOP
    utilisation (HFU), which counts work a layout computes twice as useful.
    """
    if not peak or not step_time_s or not math.isfinite(flops_per_device):
        return float("nan")
    return flops_per_device / step_time_s / peak


# ---- time beside bytes: collectives on a named fabric, the roofline, overlap -------------------------


def collective_time(kind: str, group_size: int, size_bytes: float, link: Link) -> float:
    """Seconds one collective takes on ``link``: ``steps × α + bytes crossing the busiest link ÷ bandwidth``.

    Args:
      kind: ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``, ``"all-to-all"`` or
        ``"collective-permute"`` (:data:`course_lib.comms.KINDS`).
      group_size: devices per group, n.
      size_bytes: ``S`` of the ring formula (:class:`course_lib.comms.Collective`/``Transfer``.size_bytes):
        the result for an all-gather, all-reduce, all-to-all, ppermute; the full operand for a reduce-scatter.
      link: the axis's fabric.

    Returns:
      Seconds; 0 for a group of one device.

    Raises:
      ValueError: an unknown kind or topology.
    """
    n = group_size
    if n <= 1:
        return 0.0
    from .comms import ring_bytes

    ring = link.topology == "ring"
    if link.topology not in ("ring", "switch"):
        raise ValueError(f"{link.name}: topology {link.topology!r} is not 'ring' or 'switch'")
    if kind == "collective-permute":
        return link.latency_s + size_bytes / link.bytes_per_s
    if kind == "all-to-all":
        if ring:  # block j goes min(j, n - j) links, the shorter way round; 2n directed links share the load
            hops = sum(min(j, n - j) for j in range(1, n))
            return (n - 1) * link.latency_s + size_bytes / n * hops / (2 * link.bytes_per_s)
        return (n - 1) * link.latency_s + ring_bytes(kind, size_bytes, n) / link.bytes_per_s
    steps = 2 * (n - 1) if kind == "all-reduce" else n - 1
    sent = ring_bytes(kind, size_bytes, n)  # raises on an unknown kind
    return steps * link.latency_s + sent / (link.bytes_per_s * (2 if ring else 1))


def step_time(
    flops: float,
    bytes_accessed: float | None,
    transfers: Any,
    fabric: Fabric,
    precision: str = "bfloat16",
    *,
    matmul_precision: str = "default",
) -> dict[str, Any]:
    """A step's time on ``fabric``, from what the compiled program says it does (per device).

    Compute time = FLOPs ÷ peak; memory time = bytes accessed ÷ HBM bandwidth; their maximum is the
    roofline's time (the term that binds is named). Each collective costs :func:`collective_time` on the link
    of its axes. Two bounds (the scaling book's T_lower and T_upper): with perfect **overlap** the step takes
    ``max(roofline, communication)``; with **none**, their sum. A model, not a measurement.

    Args:
      flops: FLOPs per device per step (``cost_analysis()["flops"]``; a loop body counts once there: multiply
        by the trip count where the program scans over layers).
      bytes_accessed: HBM traffic per device (``cost_analysis()["bytes accessed"]``), or None to leave out
        the memory term.
      transfers: the collectives, each with ``kind``, ``group_size``, ``size_bytes`` and ``axes``/``axis``
        (measured :class:`course_lib.comms.Collective` or predicted :class:`course_lib.comms.Transfer`);
        an item with a ``times`` attribute counts that many times.
      fabric: the chip and its links (:data:`FABRICS`).
      precision: which peak applies (:func:`rate`).
      matmul_precision: ``jax_default_matmul_precision`` (float32's rate depends on it).

    Returns:
      ``{"compute_s", "memory_s", "roofline_s", "bound" ("compute" or "HBM"), "comm_s", "comm_by_axis"
      {axis: s}, "overlap_s" (T_lower), "no_overlap_s" (T_upper), "comm_bound" (communication exceeds the
      roofline)}``.

    Raises:
      ValueError: the chip has no rate for ``precision``, or no HBM bandwidth while ``bytes_accessed`` is given.
    """
    peak = rate(fabric.chip, precision, matmul_precision)
    if peak is None:
        raise ValueError(f"{fabric.chip.name} has no peak rate for precision={precision!r}")
    compute = flops / peak
    memory = 0.0
    if bytes_accessed is not None:
        if not fabric.chip.hbm_bytes_per_s:
            raise ValueError(f"{fabric.chip.name} has no HBM bandwidth in course_lib.chips.PEAKS")
        memory = bytes_accessed / fabric.chip.hbm_bytes_per_s
    by_axis: dict[str, float] = {}
    for t in transfers:
        axes = getattr(t, "axes", None) or (getattr(t, "axis", "?"),)
        seconds = collective_time(t.kind, t.group_size, t.size_bytes, fabric.link_of(axes))
        key = ",".join(axes)
        by_axis[key] = by_axis.get(key, 0.0) + seconds * getattr(t, "times", 1)
    roofline, comm = max(compute, memory), sum(by_axis.values())
    return {
        "compute_s": compute,
        "memory_s": memory,
        "roofline_s": roofline,
        "bound": "compute" if compute >= memory else "HBM",
        "comm_s": comm,
        "comm_by_axis": by_axis,
        "overlap_s": max(roofline, comm),
        "no_overlap_s": roofline + comm,
        "comm_bound": comm > roofline,
    }


def comm_split(transfers: Any, fabric: Fabric) -> tuple[float, float]:
    """The communication time of :func:`step_time` split into its two parts: ``steps × α`` and ``bytes ÷
    bandwidth``.

    Each collective's :func:`collective_time` is taken on the link of its axes, once as it is and once with
    that link's latency set to 0; the difference is the latency part. Taught in
    ``notebooks/11_pipeline_experts.ipynb`` (section 9.4: at a few kB per collective, α dominates);
    ``tests/test_costs.py``.

    Args:
      transfers: the collectives, as for :func:`step_time` (``kind``, ``group_size``, ``size_bytes``,
        ``axes``/``axis``, an optional ``times``).
      fabric: the chip and its links (:data:`FABRICS`).

    Returns:
      ``(latency_s, bandwidth_s)`` in seconds per device and step; their sum is ``step_time(...)["comm_s"]``.

    Raises:
      ValueError: an unknown collective kind or link topology (from :func:`collective_time`).
    """
    latency = bandwidth = 0.0
    for t in transfers:
        link = fabric.link_of(getattr(t, "axes", None) or (getattr(t, "axis", "?"),))
        whole = collective_time(t.kind, t.group_size, t.size_bytes, link)
        no_alpha = collective_time(
            t.kind, t.group_size, t.size_bytes, dataclasses.replace(link, latency_s=0.0)
        )
        latency += getattr(t, "times", 1) * (whole - no_alpha)
        bandwidth += getattr(t, "times", 1) * no_alpha
    return latency, bandwidth


def critical_size(size: float, timing: dict[str, Any]) -> float:
    """The size (per-device batch, tokens …) at which compute time equals communication time, when compute
    grows in proportion to the size and communication does not (data parallelism's gradients, FSDP's
    gathers): ``size × comm_s ÷ roofline_s``. Below it the step is communication-bound even with perfect
    overlap (How to Scale Your Model: per-device batch > C / W_ici).

    Args:
      size: the size :func:`step_time`'s ``timing`` was computed at.
      timing: :func:`step_time`'s result at that size.

    Returns:
      The critical size (same unit as ``size``); ``inf`` when the roofline time is 0.
    """
    if timing["roofline_s"] <= 0:
        return math.inf
    return size * timing["comm_s"] / timing["roofline_s"]


def scaled_step_time(
    factor: float,
    flops: float,
    bytes_accessed: float | None,
    transfers: Any,
    fabric: Fabric,
    precision: str = "bfloat16",
    *,
    grows: Any = None,
    matmul_precision: str = "default",
) -> dict[str, Any]:
    """:func:`step_time` of the same step with its batch multiplied by ``factor``: FLOPs and HBM bytes scale
    with it, and so do the collectives marked in ``grows`` (activations: a tensor-parallel layout's); the others
    (gradients, parameters) keep their size. Each collective's latency α stays fixed.

    Args:
      factor: the batch's multiple (> 0).
      grows: one bool per item of ``transfers`` (True: its bytes grow with the batch); None: none grows.

    Raises:
      ValueError: ``factor`` ≤ 0, or ``grows`` of another length than ``transfers``.
    """
    transfers = list(transfers)
    grows = [False] * len(transfers) if grows is None else list(grows)
    if not factor > 0 or len(grows) != len(transfers):
        raise ValueError(
            f"factor={factor!r} must be > 0 and grows ({len(grows)} flags) one per transfer ({len(transfers)})"
        )
    scaled = [
        dataclasses.replace(t, size_bytes=t.size_bytes * factor) if g else t
        for t, g in zip(transfers, grows, strict=True)
    ]
    hbm = None if bytes_accessed is None else bytes_accessed * factor
    return step_time(
        flops * factor, hbm, scaled, fabric, precision, matmul_precision=matmul_precision
    )


def critical_batch(
    batch: float,
    flops: float,
    bytes_accessed: float | None,
    transfers: Any,
    fabric: Fabric,
    precision: str = "bfloat16",
    *,
    grows: Any = None,
    matmul_precision: str = "default",
) -> float:
    """The per-device batch at which the roofline time equals the communication time, when part of the
    traffic grows with the batch (:func:`scaled_step_time`'s rule). The roofline time is ``r × b`` and the
    communication ``a + c × b`` (α and the fixed collectives in ``a``, the growing ones' bandwidth in ``c``),
    so ``b* = a / (r − c)``: ``inf`` when ``c ≥ r`` (communication-bound at every batch), 0 without traffic.
    With nothing growing it is :func:`critical_size`.

    Args:
      batch: the per-device batch the program was compiled for (images, tokens …).
      flops, bytes_accessed, transfers, fabric, precision, matmul_precision: as :func:`step_time`.
      grows: as :func:`scaled_step_time`.

    Returns:
      The critical per-device batch, same unit as ``batch``.
    """
    args = (flops, bytes_accessed, transfers, fabric, precision)
    one = scaled_step_time(1.0, *args, grows=grows, matmul_precision=matmul_precision)
    two = scaled_step_time(2.0, *args, grows=grows, matmul_precision=matmul_precision)
    per_batch = two["comm_s"] - one["comm_s"]  # c: the growing collectives' bandwidth time
    fixed = one["comm_s"] - per_batch  # a
    roofline = one["roofline_s"]  # r (at factor 1)
    if fixed <= 0 and per_batch <= 0:
        return 0.0
    if per_batch >= roofline:
        return math.inf
    return batch * fixed / (roofline - per_batch)

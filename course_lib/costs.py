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
- **Peak FLOP/s** (:data:`PEAKS`, :func:`peak_flops`) per GPU kind and precision, dense (no sparsity), from
  the vendor's datasheets, for the utilisation (:func:`mfu`): of the *model's* FLOPs (MFU: the work a
  training step needs, :func:`model_flops_per_step`), or of the FLOPs the compiled program runs (HFU:
  everything it computes, work computed twice included). MFU ≤ HFU: the model's count leaves out what the
  step does not need, the lab asserts model ≤ compiled FLOPs for every strategy. None on CPUs: no peak is
  claimed.
- **A step-time model** (:func:`step_time_model`): FLOPs at 100 % of a stated peak, plus bytes sent at a
  stated link bandwidth, plus an ASSUMED fixed latency per collective (:data:`COLLECTIVE_LATENCY_S`), for
  the device profiles in :data:`DEVICE_PROFILES`. A model, not a measurement.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

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


@dataclasses.dataclass(frozen=True)
class Peak:
    """Dense peak throughput of one GPU kind, TFLOP/s (None: the precision has no tensor-core path).

    Attributes:
      name: the product (``"H100 SXM"``).
      pattern: a regular expression matched against ``jax.Device.device_kind`` (the CUDA device name,
        e.g. ``"NVIDIA H100 80GB HBM3"``).
      fp32, tf32, bf16, fp16: TFLOP/s without sparsity (datasheets print tensor-core figures *with* 2:4
        sparsity; these are half of those).
      source: the datasheet the figures come from.
    """

    name: str
    pattern: str
    fp32: float
    tf32: float | None
    bf16: float | None
    fp16: float | None
    source: str


PEAKS = (
    Peak("H100 SXM", r"H100 80GB HBM3|H100 SXM", 67.0, 494.7, 989.4, 989.4,
         "NVIDIA H100 Tensor Core GPU datasheet, SXM column"),
    Peak("H100 PCIe", r"H100 PCIe", 51.0, 378.0, 756.0, 756.0,
         "NVIDIA H100 Tensor Core GPU datasheet, PCIe column"),
    Peak("H100 NVL", r"H100 NVL", 60.0, 417.5, 835.5, 835.5,
         "NVIDIA H100 Tensor Core GPU datasheet, H100 NVL column"),
    Peak("H200 NVL", r"H200 NVL", 60.0, 417.5, 835.5, 835.5,
         "NVIDIA H200 Tensor Core GPU datasheet, H200 NVL column"),
    Peak("H200", r"H200(?!\s*NVL)", 67.0, 494.7, 989.4, 989.4,
         "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column"),
    Peak("A100", r"A100", 19.5, 156.0, 312.0, 312.0,
         "NVIDIA A100 Tensor Core GPU datasheet (SXM4 and PCIe, 40 and 80 GB: the same peaks)"),
    Peak("L40S", r"L40S", 91.6, 183.0, 362.05, 362.05, "NVIDIA L40S datasheet"),
    Peak("A40", r"\bA40\b", 37.4, 74.8, 149.7, 149.7, "NVIDIA A40 datasheet"),
    Peak("A10", r"\bA10\b", 31.2, 62.5, 125.0, 125.0, "NVIDIA A10 Tensor Core GPU datasheet"),
    Peak("RTX 4090", r"RTX 4090", 82.6, 82.6, 165.2, 165.2,
         "NVIDIA Ada Lovelace GPU architecture whitepaper (FP32-accumulate tensor rates)"),
    Peak("V100 SXM2", r"V100-SXM2|V100 SXM2", 15.7, None, None, 125.0, "NVIDIA Tesla V100 datasheet, SXM2"),
    Peak("V100 PCIe", r"V100-PCIE|V100 PCIe", 14.0, None, None, 112.0, "NVIDIA Tesla V100 datasheet, PCIe"),
)  # fmt: skip
"""Dense peak TFLOP/s of the GPUs a workshop server is likely to have. Match order matters: the first
pattern that matches wins (``\\bA10\\b`` is written so that it does not match ``A100``)."""

TF32_PRECISIONS = ("default", "high", "tensorfloat32", "TF32_TF32_F32")
"""``jax_default_matmul_precision`` values under which float32 convolutions may use TF32 tensor cores."""


def peak_flops(
    device_kind: str, precision: str, matmul_precision: str = "default"
) -> tuple[float | None, Peak | None]:
    """``(peak FLOP/s, its Peak entry)`` for a device kind and the lab's precision; ``(None, …)`` when
    unknown (a CPU, an unlisted GPU, or a precision the device has no rate for).

    ``float32`` uses the TF32 rate when ``matmul_precision`` allows TF32 (the default: JAX "leans toward
    speed", docs.jax.dev/en/latest/201/precision.html) on a device that has it, else the FP32 rate;
    ``bfloat16`` the BF16 rate; ``float64`` is not rated here.
    """
    for peak in PEAKS:
        if re.search(peak.pattern, device_kind or ""):
            return rate(peak, precision, matmul_precision), peak
    return None, None


def rate(peak: Peak, precision: str, matmul_precision: str = "default") -> float | None:
    """FLOP/s of ``peak`` for the lab's precision (the rules of :func:`peak_flops`), or None."""
    if precision == "bfloat16":
        tflops = peak.bf16
    elif precision == "float32":
        tf32 = matmul_precision in TF32_PRECISIONS and peak.tf32 is not None
        tflops = peak.tf32 if tf32 else peak.fp32
    else:
        tflops = None
    return None if tflops is None else tflops * 1e12


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


# ---- a step-time model -------------------------------------------------------------------------------

COLLECTIVE_LATENCY_S = 10e-6
"""ASSUMPTION, not a measurement: a fixed cost of 10 µs per collective (launch and synchronisation), the
order of magnitude NCCL collectives take on small messages within one NVLink server. :func:`step_time_model`
adds it ``n_collectives`` times (the count its caller gives); the transformer lab's model
(:func:`course_lib.lm_costs.step_time`) once per predicted transfer (a line of ``predict_bytes``; FSDP's
gathers of all parameters count as one), not per collective the compiled program runs."""


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """A GPU and its links, for :func:`step_time_model` (per device; bandwidths per direction).

    Attributes:
      name: e.g. ``"H100 SXM5 80GB, NVLink 4"``.
      peak: the :class:`Peak` whose rates the model uses.
      hbm_bytes_per_s: memory bandwidth.
      link_bytes_per_s: GPU-to-GPU bandwidth in one direction (NVLink 4: 900 GB/s both ways, 450 one way).
      source: where the bandwidths come from.
    """

    name: str
    peak: Peak
    hbm_bytes_per_s: float
    link_bytes_per_s: float
    source: str


_PEAK = {peak.name: peak for peak in PEAKS}

DEVICE_PROFILES = {
    "A100": DeviceProfile("A100 SXM4 80GB, NVLink 3", _PEAK["A100"], 2.039e12, 300e9,
                          "A100 datasheet: 2,039 GB/s HBM2e; NVLink 3: 600 GB/s (300 GB/s each way)"),
    "H100": DeviceProfile("H100 SXM5 80GB, NVLink 4", _PEAK["H100 SXM"], 3.35e12, 450e9,
                          "H100 datasheet: 3.35 TB/s HBM3; NVLink 4: 900 GB/s (450 GB/s each way)"),
}  # fmt: skip
"""The profiles the lab's step-time model is drawn for (the source article used 8 × A100 80 GB)."""


def step_time_model(
    flops_per_device: float,
    sent_bytes_per_device: float,
    profile: DeviceProfile,
    precision: str = "float32",
    bytes_accessed: float | None = None,
    *,
    n_collectives: int = 0,
    latency_s: float = COLLECTIVE_LATENCY_S,
    matmul_precision: str = "default",
) -> dict[str, float]:
    """Seconds per step on ``profile``, as a model: compute at 100 % of the peak + bytes at link speed +
    a fixed latency per collective.

    Args:
      flops_per_device: FLOPs each device runs per step (``cost_analysis()["flops"]``).
      sent_bytes_per_device: bytes each device sends per step (:mod:`course_lib.comms`).
      profile: the device and its links.
      precision: which peak applies (:func:`peak_flops` rules: TF32 for float32 under the default matmul
        precision, applied to every FLOP — an upper bound of the speed).
      bytes_accessed: memory traffic per device (``cost_analysis()["bytes accessed"]``); given, the compute
        term becomes ``max(FLOPs / peak, bytes / HBM bandwidth)`` (a roofline). XLA:GPU fuses differently
        from the CPU compiler that measured it: an indication only.
      n_collectives: collectives per step; each costs ``latency_s`` on top of its bytes.
      latency_s: the per-collective latency (default :data:`COLLECTIVE_LATENCY_S`, an assumption).
      matmul_precision: ``jax_default_matmul_precision`` of the run (``"float32"``/``"highest"``: FP32 rate).

    Returns:
      ``{"compute_s", "bandwidth_s", "latency_s", "comm_s", "step_s"}`` (``comm_s`` = bandwidth + latency),
      no overlap of compute and communication assumed.

    Raises:
      ValueError: the profile has no rate for ``precision``.
    """
    peak = rate(profile.peak, precision, matmul_precision)
    if peak is None:
        raise ValueError(f"{profile.name} has no peak for precision={precision!r}")
    compute = flops_per_device / peak
    if bytes_accessed is not None:
        compute = max(compute, bytes_accessed / profile.hbm_bytes_per_s)
    bandwidth = sent_bytes_per_device / profile.link_bytes_per_s
    latency = n_collectives * latency_s
    comm = bandwidth + latency
    return {
        "compute_s": compute,
        "bandwidth_s": bandwidth,
        "latency_s": latency,
        "comm_s": comm,
        "step_s": compute + comm,
    }

"""The accelerators the course knows, described by data: peak FLOP/s, HBM, HBM and link bandwidth, sources.

One table, :data:`PEAKS` (re-exported by :mod:`course_lib.costs`, which computes MFU and the step-time model
from it): one :class:`Peak` per chip, matched against ``jax.Device.device_kind`` by a regular expression.
Every figure comes from the vendor's page named in the entry's ``source`` (``url``); a figure the source
does not give is None, never guessed. :func:`course_lib.devices.setup_devices` reports the chip it runs on
from here (``notebooks/00_setup.ipynb``); ``notebooks/08_lab.ipynb`` and ``notebooks/12_transformer_lab.ipynb``
divide their FLOP/s by its peak (MFU). Simulated CPU devices have no entry: no fabric, no peak is claimed.

Units: FLOP/s fields in TFLOP/s (``bf16`` = 197 means 197e12 FLOP/s, dense: datasheets print tensor-core
figures *with* 2:4 sparsity as well; these are half of those); ``hbm_bytes`` in bytes, the vendor's "GB" of
HBM read as GiB (HBM comes in powers of two: a TPU v5e's XLA ``bytes_limit`` is 15.7 GiB, more than 16e9
bytes); bandwidths in bytes per second; ``link_bytes_per_s`` is **one direction, all of a chip's links
together** (the vendors print both directions: NVLink 4's 900 GB/s is 450 GB/s each way).
"""

from __future__ import annotations

import dataclasses
import re

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Peak:
    """One accelerator: dense peak throughput, memory and links (None: the source gives no figure).

    Attributes:
      name: the product (``"H100 SXM"``, ``"TPU v5e"``).
      pattern: a regular expression matched against ``jax.Device.device_kind`` (``"NVIDIA H100 80GB HBM3"``,
        ``"TPU v5 lite"``).
      fp32, tf32, bf16, fp16: dense TFLOP/s; None where the chip has no such rate (a TPU's matrix units
        multiply bfloat16: its float32 rate is derived, see :func:`rate`).
      source: the vendor's page or datasheet, and how a figure was read from it.
      hbm_bytes: HBM capacity per chip, bytes.
      hbm_bytes_per_s: HBM bandwidth per chip, bytes/s.
      link_bytes_per_s: chip-to-chip bandwidth per chip, ONE direction, all links together (ICI on a TPU,
        NVLink on a GPU), bytes/s.
      links: chip-to-chip ports per chip, where the source gives them.
      platform: ``"gpu"`` or ``"tpu"``.
      url: the source's address.
    """

    name: str
    pattern: str
    fp32: float | None
    tf32: float | None
    bf16: float | None
    fp16: float | None
    source: str
    hbm_bytes: float | None = None
    hbm_bytes_per_s: float | None = None
    link_bytes_per_s: float | None = None
    links: int | None = None
    platform: str = "gpu"
    url: str = ""

    @property
    def peak_bf16_flops_per_s(self) -> float | None:
        """Dense bfloat16 peak, FLOP/s (``bf16 * 1e12``); None without a bfloat16 rate."""
        return None if self.bf16 is None else self.bf16 * 1e12

    def describe(self) -> str:
        """One line: ``"TPU v5e: 197 TFLOP/s dense bf16, 16 GiB HBM at 819 GB/s, links 200 GB/s one way"``."""
        parts = [f"{self.bf16:g} TFLOP/s dense bf16" if self.bf16 else "no bf16 rate"]
        if self.hbm_bytes:
            at = f" at {self.hbm_bytes_per_s / 1e9:,.0f} GB/s" if self.hbm_bytes_per_s else ""
            parts.append(f"{self.hbm_bytes / GIB:g} GiB HBM{at}")
        if self.link_bytes_per_s:
            parts.append(f"links {self.link_bytes_per_s / 1e9:g} GB/s one way (all links)")
        return f"{self.name}: " + ", ".join(parts)


_V5E = "https://cloud.google.com/tpu/docs/v5e"
_V5P = "https://cloud.google.com/tpu/docs/v5p"
_V6E = "https://cloud.google.com/tpu/docs/v6e"
_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_H100 = "https://www.nvidia.com/en-us/data-center/h100/"
_H200 = "https://www.nvidia.com/en-us/data-center/h200/"

PEAKS = (
    # Google Cloud TPU pages, "key chip specifications": bf16 peak, HBM capacity and bandwidth, bidirectional ICI
    # bandwidth per chip (halved here: one direction).
    Peak("TPU v5e", r"TPU v5 ?lite|TPU v5e", None, None, 197.0, None,
         "Cloud TPU v5e page: 197 TFLOPs bf16 per chip; HBM2 16 GB, 819 GBps; ICI 400 GBps bidirectional "
         "per chip, 4 ports", 16 * GIB, 819e9, 200e9, 4, "tpu", _V5E),
    Peak("TPU v5p", r"TPU v5p|TPU v5\s*$", None, None, 459.0, None,
         "Cloud TPU v5p page: 459 TFLOPs bf16 per chip; HBM 95 GiB, 2765 GBps; ICI 1200 GBps bidirectional "
         "per chip", 95 * GIB, 2765e9, 600e9, None, "tpu", _V5P),
    Peak("TPU v6e", r"TPU v6 ?lite|TPU v6e", None, None, 918.0, None,
         "Cloud TPU v6e (Trillium) page: 918 TFLOPs bf16 per chip; HBM 32 GB, 1638 GBps; ICI 800 GBps "
         "bidirectional per chip, 4 ports", 32 * GIB, 1638e9, 400e9, 4, "tpu", _V6E),
    # NVIDIA datasheets: dense tensor-core rates (half the sparse figures), HBM, NVLink (both directions: halved).
    Peak("H100 SXM", r"H100 80GB HBM3|H100 SXM", 67.0, 494.7, 989.4, 989.4,
         "NVIDIA H100 datasheet, SXM column: BF16 1,979 TFLOPS with sparsity; 80 GB HBM3, 3.35 TB/s; "
         "NVLink 900 GB/s", 80 * GIB, 3.35e12, 450e9, None, "gpu", _H100),
    Peak("H100 PCIe", r"H100 PCIe", 51.0, 378.0, 756.0, 756.0,
         "NVIDIA H100 Tensor Core GPU datasheet, PCIe column", url=_H100),
    Peak("H100 NVL", r"H100 NVL", 60.0, 417.5, 835.5, 835.5,
         "NVIDIA H100 Tensor Core GPU datasheet, H100 NVL column", url=_H100),
    Peak("H200 NVL", r"H200 NVL", 60.0, 417.5, 835.5, 835.5,
         "NVIDIA H200 Tensor Core GPU datasheet, H200 NVL column", url=_H200),
    Peak("H200", r"H200(?!\s*NVL)", 67.0, 494.7, 989.4, 989.4,
         "NVIDIA H200 datasheet, H200 SXM column: BF16 1,979 TFLOPS with sparsity; 141 GB HBM3e, 4.8 TB/s; "
         "NVLink 900 GB/s", 141 * GIB, 4.8e12, 450e9, None, "gpu", _H200),
    Peak("A100 SXM4 80GB", r"A100-SXM4-80GB|A100 SXM4 80GB", 19.5, 156.0, 312.0, 312.0,
         "NVIDIA A100 datasheet, 80GB SXM column: BF16 312 TFLOPS (624 with sparsity); 80 GB HBM2e, "
         "2,039 GB/s; NVLink 600 GB/s", 80 * GIB, 2.039e12, 300e9, None, "gpu", _A100),
    Peak("A100 PCIe 80GB", r"A100 80GB PCIe|A100-PCIE-80GB", 19.5, 156.0, 312.0, 312.0,
         "NVIDIA A100 datasheet, 80GB PCIe column: BF16 312 TFLOPS; 80 GB HBM2e, 1,935 GB/s (NVLink only "
         "through a bridge: no link figure)", 80 * GIB, 1.935e12, None, None, "gpu", _A100),
    Peak("A100 40GB", r"A100", 19.5, 156.0, 312.0, 312.0,
         "NVIDIA A100 datasheet (40 GB, SXM4 and PCIe): BF16 312 TFLOPS; 40 GB HBM2, 1,555 GB/s",
         40 * GIB, 1.555e12, None, None, "gpu", _A100),
    Peak("L40S", r"L40S", 91.6, 183.0, 362.05, 362.05, "NVIDIA L40S datasheet"),
    Peak("A40", r"\bA40\b", 37.4, 74.8, 149.7, 149.7, "NVIDIA A40 datasheet"),
    Peak("A10", r"\bA10\b", 31.2, 62.5, 125.0, 125.0, "NVIDIA A10 Tensor Core GPU datasheet"),
    Peak("RTX 4090", r"RTX 4090", 82.6, 82.6, 165.2, 165.2,
         "NVIDIA Ada Lovelace GPU architecture whitepaper (FP32-accumulate tensor rates)"),
    Peak("V100 SXM2", r"V100-SXM2|V100 SXM2", 15.7, None, None, 125.0, "NVIDIA Tesla V100 datasheet, SXM2"),
    Peak("V100 PCIe", r"V100-PCIE|V100 PCIe", 14.0, None, None, 112.0, "NVIDIA Tesla V100 datasheet, PCIe"),
)  # fmt: skip
"""The accelerators a Colab or Kaggle TPU or a workshop GPU server is likely to have. Match order matters:
the first pattern that matches wins (``\\bA10\\b`` does not match ``A100``; ``A100`` alone, last of the A100s,
catches the 40 GB parts). HBM and link figures are filled for the chips whose sources were checked (the TPUs,
A100, H100 SXM, H200 SXM); the others keep their FLOP/s rates only."""

TF32_PRECISIONS = ("default", "high", "tensorfloat32", "TF32_TF32_F32")
"""``jax_default_matmul_precision`` values under which float32 convolutions may use TF32 tensor cores."""

TPU_F32_PASSES = {
    "default": 1, "fastest": 1, "bfloat16": 1,
    "high": 3, "bfloat16_3x": 3, "tensorfloat32": 3,
    "highest": 6, "float32": 6,
}  # fmt: skip
"""bfloat16 passes XLA:TPU spends on a float32 matmul per ``jax_default_matmul_precision`` (the rounding of
:data:`course_lib.precision.MATMUL_UNIT_ROUNDOFF` follows from them): a TPU's float32 rate is its bf16 peak
divided by these, a derived figure, not the vendor's."""


def chip_for(device_kind: str) -> Peak | None:
    """The :data:`PEAKS` entry whose pattern matches ``device_kind``; None for a CPU or an unlisted chip."""
    for peak in PEAKS:
        if re.search(peak.pattern, device_kind or ""):
            return peak
    return None


def peak_flops(
    device_kind: str, precision: str, matmul_precision: str = "default"
) -> tuple[float | None, Peak | None]:
    """``(peak FLOP/s, its Peak entry)`` for a device kind and the lab's precision; ``(None, …)`` when
    unknown (a CPU, an unlisted chip, or a precision the chip has no rate for). The rules: :func:`rate`."""
    peak = chip_for(device_kind)
    return (None, None) if peak is None else (rate(peak, precision, matmul_precision), peak)


def rate(peak: Peak, precision: str, matmul_precision: str = "default") -> float | None:
    """FLOP/s of ``peak`` for the lab's precision, or None.

    ``bfloat16``: the BF16 rate. ``float32`` on a GPU: the TF32 rate when ``matmul_precision`` allows TF32
    (the default: JAX "leans toward speed", docs.jax.dev/en/latest/201/precision.html) and the GPU has it, else
    the FP32 rate; on a TPU: the bf16 peak over the passes of :data:`TPU_F32_PASSES` (1 at the default
    precision: the bf16 peak itself). ``float64`` is rated nowhere.
    """
    if precision == "bfloat16":
        tflops = peak.bf16
    elif precision == "float32" and peak.platform == "tpu":
        passes = TPU_F32_PASSES.get((matmul_precision or "default").lower())
        tflops = None if peak.bf16 is None or passes is None else peak.bf16 / passes
    elif precision == "float32":
        tf32 = matmul_precision in TF32_PRECISIONS and peak.tf32 is not None
        tflops = peak.tf32 if tf32 else peak.fp32
    else:
        tflops = None
    return None if tflops is None else tflops * 1e12


# ---- fabrics: the links of a mesh's axes, for the time model of course_lib.costs ----------------------

SWITCH_LATENCY_S = 10e-6
"""ASSUMPTION: α = 10 µs per step of a collective over NVLink, a pessimistic one: NCCL's tuning model
(``src/graph/tuning.cc``) takes about 0.5–3.4 µs per NVLink ring step, by protocol, plus a base of about
4–14 µs per collective, by NCCL version and protocol (``notebooks/08_lab.ipynb``, section 6.6, checks its
verdicts at 1 µs)."""


@dataclasses.dataclass(frozen=True)
class Link:
    """The fabric one mesh axis runs its collectives over (per device).

    Attributes:
      name: e.g. ``"ICI (TPU v5e)"``, ``"NVLink 4 (NVSwitch)"``, ``"InfiniBand NDR (across nodes)"``.
      bytes_per_s: bandwidth in ONE direction. ``topology="ring"``: to one neighbour on the axis (one ICI
        port); ``"switch"``: the device's whole injection bandwidth (every peer is one hop away).
      latency_s: α, the fixed cost of each step of a collective (a ring all-gather over n devices takes n−1
        steps). An ASSUMPTION of the right order, not a measurement: see ``source``.
      topology: ``"ring"`` — the axis is a bidirectional ring of neighbours (a TPU torus axis, or the 8
        chips of a v5e:2x4 slice round their cycle of full-duplex neighbour links: the course's model of
        how XLA:TPU's collectives use the links, not a measurement; a line of chips is not described): ring
        collectives send half their data each way, so they run at ``2 × bytes_per_s``; an all-to-all's
        blocks cross on average about n/4 links each way (the scaling book: "cheaper than an all-gather by a
        factor of ¼"); a ``ppermute`` to a neighbour uses one direction. ``"switch"`` — every device reaches
        every other at ``bytes_per_s`` (NVSwitch, a network): a ring collective's sends at that bandwidth.
      source: where the figures come from.
    """

    name: str
    bytes_per_s: float
    latency_s: float
    topology: str
    source: str


@dataclasses.dataclass(frozen=True)
class Fabric:
    """A chip and the links of its mesh axes: what :func:`step_time` turns FLOPs and bytes into seconds with.

    Attributes:
      name: e.g. ``"TPU v5e, 2x4 slice (ICI)"``.
      chip: the :class:`Peak` entry (peak FLOP/s, HBM bandwidth) of :mod:`course_lib.chips`.
      link: the link of every mesh axis not in ``axis_links``.
      axis_links: links of named axes, e.g. ``{"data": <InfiniBand>}`` for an axis that crosses nodes.
    """

    name: str
    chip: Peak
    link: Link
    axis_links: tuple[tuple[str, Link], ...] = ()

    def link_of(self, axes: str | tuple[str, ...]) -> Link:
        """The link a collective over ``axes`` runs on: the slowest of its axes' links."""
        named = dict(self.axis_links)
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        links = [named.get(a, self.link) for a in axes for a in a.split(",")] or [self.link]
        return min(links, key=lambda link: link.bytes_per_s)

    def with_latency(self, latency_s: float) -> Fabric:
        """This fabric with every link's α (``latency_s``, seconds per collective step) replaced, e.g. 0 to
        keep only the bandwidth terms."""
        named = tuple(
            (a, dataclasses.replace(lk, latency_s=latency_s)) for a, lk in self.axis_links
        )
        link = dataclasses.replace(self.link, latency_s=latency_s)
        return dataclasses.replace(self, link=link, axis_links=named)

    def with_axis(self, axis: str, link: Link) -> Fabric:
        """This fabric with ``axis`` on ``link`` (e.g. the data axis across nodes)."""
        named = dict(self.axis_links) | {axis: link}
        return dataclasses.replace(self, axis_links=tuple(named.items()))


def _chip(name: str) -> Peak:
    return next(p for p in PEAKS if p.name == name)


ICI_LATENCY_S = 1e-6
"""ASSUMPTION: α = 1 µs per step of a collective on a TPU's ICI (the scaling book's order of magnitude for one
hop); the course measures no multi-chip latency (one chip is lent to it)."""

LINKS = {
    "ICI v5e": Link("ICI (TPU v5e), one port", 50e9, ICI_LATENCY_S, "ring",
                    "Cloud TPU v5e page: ICI 400 GB/s bidirectional per chip over 4 ports -> 50 GB/s one way per "
                    "port; 1 µs per step assumed"),
    "ICI v5p": Link("ICI (TPU v5p), one port", 100e9, ICI_LATENCY_S, "ring",
                    "Cloud TPU v5p page: ICI 1,200 GB/s bidirectional per chip over 6 ports -> 100 GB/s one way "
                    "per port; 1 µs per step assumed"),
    "NVLink 4": Link("NVLink 4 (NVSwitch)", 450e9, SWITCH_LATENCY_S, "switch",
                     "H100/H200 datasheets: NVLink 900 GB/s -> 450 GB/s one way; 10 µs per step assumed"),
    "NVLink 3": Link("NVLink 3 (NVSwitch)", 300e9, SWITCH_LATENCY_S, "switch",
                     "A100 datasheet: NVLink 600 GB/s -> 300 GB/s one way; 10 µs per step assumed"),
    "InfiniBand NDR": Link("InfiniBand NDR, one 400 Gb/s NIC per GPU", 50e9, 2 * SWITCH_LATENCY_S,
                           "switch", "NVIDIA ConnectX-7: 400 Gb/s = 50 GB/s one way per GPU (DGX H100: one "
                           "NIC per GPU); 20 µs per step assumed"),
    "DCN": Link("data-centre network between TPU slices", 12.5e9, 10 * ICI_LATENCY_S, "switch",
                "ASSUMPTION: 100 Gb/s per chip between slices (the order of a TPU host's NICs shared by its "
                "chips); 10 µs per step"),
}  # fmt: skip
"""The links the course's time model uses, each with its source; latencies are assumptions (stated)."""

FABRICS = {
    "TPU v5e": Fabric("TPU v5e slice (ICI)", _chip("TPU v5e"), LINKS["ICI v5e"]),
    "TPU v5p": Fabric("TPU v5p slice (ICI)", _chip("TPU v5p"), LINKS["ICI v5p"]),
    "H100": Fabric("8 × H100 SXM, NVLink 4", _chip("H100 SXM"), LINKS["NVLink 4"]),
    "H200": Fabric("8 × H200, NVLink 4", _chip("H200"), LINKS["NVLink 4"]),
    "A100": Fabric("8 × A100 SXM4 80GB, NVLink 3", _chip("A100 SXM4 80GB"), LINKS["NVLink 3"]),
}
"""Named fabrics. Simulated CPU devices are not a fabric: they share one machine's memory, so no time on a
fabric is claimed for them (:func:`step_time` is always given one of these)."""

"""Lab 08's time model: each strategy's compiled program turned into time on a named fabric.

Every input is read from the program the lab compiled (:class:`course_lib.measure.CompiledStats`): its FLOPs
and ``bytes accessed`` per device (``cost_analysis()``) and its collectives with their groups, axes and sizes
(:func:`course_lib.comms.collectives`). :func:`course_lib.costs.step_time` turns them into compute time
(FLOPs ÷ peak), memory time (bytes ÷ HBM bandwidth), their roofline maximum and each collective's time on
its axis's link; :func:`course_lib.costs.critical_batch` gives the per-device batch below which the step is
communication-bound. ``notebooks/08_lab.ipynb`` records them in every results row (:func:`time_columns`).

On an accelerator the fabric is the chip the lab runs on. Simulated CPU devices are not a fabric (their
collectives are copies in one process's memory): there the times are a PREDICTION for a named target
(:data:`DEFAULT_TARGET`), never a CPU time; ``model_is_prediction`` says which. The lab's committed run on
one TPU v5e chip (:data:`TPU_LAB_RESULTS`) is the model's test on any machine: :func:`against_measured`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from . import comms, costs

DEFAULT_TARGET = "TPU v5e"
"""The fabric (a key of :data:`course_lib.costs.FABRICS`) the lab predicts for where it runs on no chip of
the table (simulated CPU devices, an unlisted GPU): a TPU v5e slice, whose axes are ICI rings."""

TIME_COLUMNS = (
    "model_fabric", "model_is_prediction", "model_compute_s", "model_memory_s", "model_roofline_s",
    "model_bound", "model_comm_s", "model_step_overlap_s", "model_step_no_overlap_s",
    "model_critical_batch", "local_batch", "arithmetic_intensity", "ridge_flops_per_byte", "model_error",
)  # fmt: skip
"""The columns :func:`time_columns` adds to a results row (seconds per step, per device)."""


def fabric_for(
    device_kind: str, platform: str, target: str = DEFAULT_TARGET
) -> tuple[str, costs.Fabric, bool]:
    """``(key, fabric, is_prediction)``: the :data:`course_lib.costs.FABRICS` entry of the chip the lab runs
    on, ``is_prediction=False``; on a CPU or a chip no fabric describes, ``target``'s, ``is_prediction=True``.

    Raises:
      ValueError: ``target`` is not a key of :data:`course_lib.costs.FABRICS`.
    """
    if target not in costs.FABRICS:
        raise ValueError(f"target={target!r} is not a fabric; one of {sorted(costs.FABRICS)}")
    chip = costs.chip_for(device_kind) if platform != "cpu" else None
    for key, fabric in costs.FABRICS.items():
        if chip is not None and fabric.chip.name == chip.name:
            return key, fabric, False
    return target, costs.FABRICS[target], True


def grows_with_batch(transfers: Sequence[Any], shapes: Mapping) -> list[bool]:
    """One flag per collective: True where its bytes grow with the per-device batch.

    Every collective over the ``model`` axis carries activations (tensor parallelism: they grow); over the
    ``data`` axis of a 2-D mesh, the gradients (fixed by the model). On a data-only mesh
    :func:`course_lib.comms.what_moves` reads each from its shapes: parameters and gradients stay (a gradient
    also when XLA adds size-1 dimensions, a bias's ``[1, 10]``), anything else (an activation the partitioner
    gathers) grows.

    Args:
      transfers: the program's collectives (:attr:`course_lib.measure.CompiledStats.transfers`).
      shapes: the parameters' shapes (:func:`course_lib.comms.param_shapes`).
    """
    if any("model" in t.axes for t in transfers):
        return ["model" in t.axes for t in transfers]
    leaves = {_squeezed(shape) for layer in shapes.values() for shape in layer.values()}
    return [
        what == comms.ACTIVATIONS and not all(_squeezed(d) in leaves | {()} for _, d in t.shapes)
        for t, what in zip(transfers, comms.what_moves(transfers, shapes), strict=True)
    ]


def _squeezed(dims) -> tuple[int, ...]:
    """A shape without its size-1 dimensions, sorted: XLA may reduce a bias's gradient as ``[1, 10]`` or a
    kernel's transposed."""
    return tuple(sorted(d for d in dims if d != 1))


def time_columns(
    stats: Any,
    local_batch: int,
    shapes: Mapping,
    precision: str,
    matmul_precision: str,
    device_kind: str,
    platform: str,
    measured_step_s: float,
    target: str = DEFAULT_TARGET,
) -> dict[str, Any]:
    """The model's columns of one results row (:data:`TIME_COLUMNS`), from the compiled program.

    ``model_critical_batch``: images per device at which the roofline time equals the communication time
    (:func:`course_lib.costs.critical_batch`, the collectives of :func:`grows_with_batch` growing with the
    batch); 0 without collectives, ``inf`` when communication binds at every batch. ``arithmetic_intensity``:
    FLOPs per HBM byte of the program; ``ridge_flops_per_byte``: the chip's peak ÷ HBM bandwidth (above it
    the roofline is compute-bound). ``model_error``: measured step ÷ the model's step without overlap − 1, on
    the chip the model describes only (NaN when it is a prediction: a CPU time is no test of a TPU model).
    A precision the chip has no peak for (float64) leaves the times NaN.

    Args:
      stats: the strategy's :class:`course_lib.measure.CompiledStats`.
      local_batch: images per device the program was compiled for.
      shapes: the parameters' shapes (:func:`course_lib.comms.param_shapes`).
      precision, matmul_precision: the run's (:func:`course_lib.costs.rate`).
      device_kind, platform: of the devices the lab ran on (:func:`fabric_for`).
      measured_step_s: the measured median step, seconds.
      target: the fabric predicted for on a CPU (:func:`fabric_for`).
    """
    key, fabric, prediction = fabric_for(device_kind, platform, target)
    out: dict[str, Any] = dict.fromkeys(TIME_COLUMNS, math.nan)
    out.update(model_fabric=fabric.name, model_is_prediction=prediction, local_batch=local_batch)
    hbm = stats.bytes_accessed if math.isfinite(stats.bytes_accessed) else None
    peak = costs.rate(fabric.chip, precision, matmul_precision)
    if peak is None:
        out["model_bound"] = f"no {precision} peak"
        return out
    transfers = list(stats.transfers)
    grows = grows_with_batch(transfers, shapes)
    args = (stats.flops_per_device, hbm, transfers, fabric, precision)
    t = costs.step_time(*args, matmul_precision=matmul_precision)
    out.update(
        model_compute_s=t["compute_s"],
        model_memory_s=t["memory_s"],
        model_roofline_s=t["roofline_s"],
        model_bound=t["bound"],
        model_comm_s=t["comm_s"],
        model_step_overlap_s=t["overlap_s"],
        model_step_no_overlap_s=t["no_overlap_s"],
        model_critical_batch=costs.critical_batch(
            local_batch, *args, grows=grows, matmul_precision=matmul_precision
        ),
        ridge_flops_per_byte=peak / fabric.chip.hbm_bytes_per_s,
    )
    if hbm:
        out["arithmetic_intensity"] = stats.flops_per_device / hbm
    if not prediction and t["no_overlap_s"] > 0:
        out["model_error"] = measured_step_s / t["no_overlap_s"] - 1
    return out


def matmul_widths(cfg: Any) -> dict[str, int]:
    """The output width of the matmul behind each term of :func:`course_lib.costs.model_flops_breakdown`:
    a conv's forward and weight gradient produce its output channels, its input gradient its input channels;
    a dense layer's likewise (its features)."""
    widths: dict[str, int] = {}
    c_in = cfg.in_channels
    layers = [(f"conv{i}", c_in if i == 1 else cfg.channels[i - 2], c) for i, c in
              enumerate(cfg.channels, start=1)]  # fmt: skip
    layers += [("dense1", cfg.flat_features, cfg.hidden), ("dense2", cfg.hidden, cfg.num_classes)]
    for name, k, n in layers:
        widths[f"{name} forward"] = widths[f"{name} weight gradient"] = n
        widths[f"{name} input gradient"] = k
    return widths


def narrow_matmul_s(cfg: Any, global_batch: int, peak_flops_per_s: float, mxu: int = 128) -> float:
    """Seconds the model's FLOPs take when each matmul runs at the share of a ``mxu`` × ``mxu`` matrix unit
    its output width fills (``min(width, mxu) / mxu``): an ESTIMATE of what narrow channels cost a TPU
    (``notebooks/08_lab.ipynb`` prints it beside the measured step; the contraction's width and the pools,
    ReLUs and optimizer on the vector unit are left out).

    Args:
      cfg: the CNN (:class:`course_lib.model.CNNConfig`); global_batch: images per step;
      peak_flops_per_s: the chip's rate; mxu: the matrix unit's width (128 on TPU v5e, 256 on v6e).
    """
    widths = matmul_widths(cfg)
    flops = costs.model_flops_breakdown(cfg)
    return sum(
        f * global_batch / (peak_flops_per_s * min(widths[k], mxu) / mxu) for k, f in flops.items()
    )


TPU_LAB_RESULTS = (
    Path(__file__).resolve().parents[1]
    / "data/tpu_reference/2026-12-06-tpu-v5-lite-x1-3/lab/bf16/lab_results.csv"
)
"""The lab run on one TPU v5e chip (``"TPU v5 lite"``) at the gpu profile, global batch 512, bfloat16: every
strategy's measured step and its compiled program's FLOPs and bytes accessed (that run's ``summary.txt``)."""


def against_measured(rows: Any) -> Any:
    """The model's step beside the measured one, for results rows made on a chip (e.g. :data:`TPU_LAB_RESULTS`
    read with ``pandas.read_csv``): per row, :func:`course_lib.costs.step_time` of its compiled FLOPs and
    bytes accessed per device on the fabric of its ``device_kind`` (:func:`fabric_for`), at its precision.

    Returns:
      A pandas DataFrame indexed by ``strategy``: ``measured_s`` (the median step), ``compute_s`` (FLOPs ÷
      the chip's peak), ``memory_s`` (bytes accessed ÷ HBM bandwidth), ``model_s`` (their maximum, the
      roofline; one chip: no collectives), ``bound`` (``"compute"`` or ``"HBM"``), ``error`` (measured ÷
      model − 1), ``mfu`` (the row's model-FLOPs utilisation), ``mfu_roofline`` (the MFU the same model
      FLOPs would reach in ``model_s``: ``mfu · measured_s / model_s``, the most the roofline allows; the
      compute term's ``compute_s / model_s`` counts the compiled FLOPs, so it bounds HFU, not MFU).

    Raises:
      ValueError: a row made on simulated CPU devices or a chip no fabric describes (a CPU time is no test of
        a chip's model), or a row with collectives (more than one device: the link is not modelled here).
    """
    import pandas as pd

    out = {}
    for _, row in pd.DataFrame(rows).iterrows():
        key, fabric, prediction = fabric_for(str(row["device_kind"]), str(row["platform"]))
        if prediction:
            raise ValueError(
                f"{row['strategy']}: ran on {row['device_kind']!r} ({row['platform']}), no chip of "
                "course_lib.costs.FABRICS: its time is no test of the model; pass a chip's results"
            )
        if int(row["n_devices"]) != 1:
            raise ValueError(
                f"{row['strategy']}: {row['n_devices']} devices; against_measured models one chip "
                "(no collectives): pass one-device rows"
            )
        flops, hbm = float(row["flops_per_device"]), float(row["bytes_accessed_per_device"])
        t = costs.step_time(flops, hbm, [], fabric, str(row["precision"]),
                            matmul_precision=str(row["matmul_precision"]))  # fmt: skip
        measured = float(row["step_time_s"])
        out[row["strategy"]] = dict(
            measured_s=measured, compute_s=t["compute_s"], memory_s=t["memory_s"],
            model_s=t["roofline_s"], bound=t["bound"], error=measured / t["roofline_s"] - 1,
            mfu=float(row["mfu"]), mfu_roofline=float(row["mfu"]) * measured / t["roofline_s"],
        )  # fmt: skip
    return pd.DataFrame.from_dict(out, orient="index").rename_axis("strategy")


def mxu_width(device_kind: str) -> int:
    """The width of a TPU's matrix unit (MXU, a systolic array): 256 on a v6e (``device_kind`` containing
    ``"v6"``), else 128 (TPU v4, v5e, v5p). ``notebooks/08_lab.ipynb`` sets the CNN's channels against it."""
    return 256 if "v6" in device_kind else 128


def explain_step(
    row: Mapping[str, Any],
    cfg: Any,
    global_batch: int,
    peak_flops_per_s: float,
    hbm_bytes_per_s: float,
    device_kind: str,
    platform: str,
    precision: str,
) -> str:
    """The roofline of one measured step set beside it, in words (section 6.5 of ``notebooks/08_lab.ipynb``).

    Prints compute (FLOPs ÷ peak), memory (bytes accessed ÷ HBM bandwidth), the roofline and its error
    against the measured median. Outside 30 % on a TPU it adds the narrow-channel estimate
    (:func:`narrow_matmul_s` at :func:`mxu_width`); on another chip it says the estimate is a TPU's.

    Args:
      row: a results row of one chip (a ``pandas.Series`` or dict) with ``flops_per_device``,
        ``bytes_accessed_per_device`` (bytes), ``model_compute_s``, ``model_memory_s``, ``model_roofline_s``,
        ``step_time_s`` (seconds), ``model_bound`` and ``model_error`` (measured ÷ model − 1).
      cfg: the CNN (:class:`course_lib.model.CNNConfig`); global_batch: images per step.
      peak_flops_per_s: the chip's rate at this precision; hbm_bytes_per_s: its HBM bandwidth.
      device_kind, platform, precision: as the run's report and parameters name them.

    Returns:
      Lines of text, ``\\n``-joined, times in ms.
    """
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    lines = [
        f"A on one {device_kind} ({precision}, batch {global_batch}):",
        f"  compute  {row['flops_per_device'] / 1e9:.1f} GFLOP / {peak_flops_per_s / 1e12:.0f} TFLOP/s = "
        + ms(row["model_compute_s"]),
        f"  memory   {row['bytes_accessed_per_device'] / 1e9:.2f} GB / {hbm_bytes_per_s / 1e9:.0f} GB/s = "
        + ms(row["model_memory_s"]),
        f"  model (roofline, {row['model_bound']}-bound): {ms(row['model_roofline_s'])}; measured median "
        f"{ms(row['step_time_s'])}: error {row['model_error']:+.0%}",
    ]
    if abs(row["model_error"]) <= 0.3:
        lines.append("  within 30 %: the roofline explains A's step")
    elif platform != "tpu":  # the estimate models a TPU's matrix unit, no GPU's
        lines.append("  outside 30 %: not explained here (the narrow-matmul estimate is a TPU's)")
    else:
        mxu = mxu_width(device_kind)
        narrow = narrow_matmul_s(cfg, global_batch, peak_flops_per_s, mxu)
        lines.append(
            f"  outside 30 %. Narrow channels: the model FLOPs at the share of a {mxu}-wide matrix unit "
            f"each matmul's output width fills ({cfg.channels} channels) take {ms(narrow)} (an estimate); "
            f"with the HBM term, max = {ms(max(narrow, row['model_memory_s']))} of the measured "
            f"{ms(row['step_time_s'])}; the rest is the pools, ReLUs, loss and optimizer on the vector unit "
            "and the contraction's own narrowness (3 input channels in conv1)"
        )
    return "\n".join(lines)


def describe_mfu(
    row: Mapping[str, Any],
    ceiling_flops_per_s: float,
    bf16_peak_flops_per_s: float | None,
    device_kind: str,
    platform: str,
    precision: str,
    channels: Sequence[int],
) -> str:
    """A's MFU beside the chip's matmul ceiling, in words (section 6.3 of ``notebooks/08_lab.ipynb``).

    Args:
      row: A's results row with ``model_flops_per_step`` (FLOPs), ``step_time_s`` (s), ``mfu`` (0–1),
        ``peak_flops_per_device`` (FLOP/s) and ``matmul_precision``.
      ceiling_flops_per_s: what a large bfloat16 matmul reaches on the chip
        (:func:`course_lib.measure.matmul_ceiling`).
      bf16_peak_flops_per_s: the chip's datasheet bf16 peak, or None where no table names the chip.
      device_kind, platform, precision: as the run's report and parameters name them.
      channels: the CNN's conv output channels (``cfg.channels``); on a TPU set against :func:`mxu_width`.

    Returns:
      Lines of text, ``\\n``-joined (TFLOP/s; shares in %).
    """
    flops, step = row["model_flops_per_step"], row["step_time_s"]
    lines = [
        f"A: {flops / 1e9:.1f} GFLOP of model FLOPs per step in {step * 1e3:.2f} ms = "
        f"{flops / step / 1e12:.1f} TFLOP/s; MFU {row['mfu']:.1%} of "
        f"{row['peak_flops_per_device'] / 1e12:.0f} TFLOP/s ({precision}, matmul precision "
        f"{row['matmul_precision']!r})",
        f"matmul ceiling on {device_kind}: a 4096 x 4096 bfloat16 matmul runs at "
        f"{ceiling_flops_per_s / 1e12:.0f} TFLOP/s"
        + (
            f", {ceiling_flops_per_s / bf16_peak_flops_per_s:.0%} of the "
            f"{bf16_peak_flops_per_s / 1e12:.0f} TFLOP/s bf16 peak"
            if bf16_peak_flops_per_s
            else ""
        ),
    ]
    if platform == "tpu":
        mxu = mxu_width(device_kind)
        fill = ", ".join(f"{min(c, mxu) / mxu:.0%}" for c in channels)
        lines.append(
            f"why A's MFU is low: a conv is a matmul as wide as its output channels, {list(channels)} "
            f"here: they fill {fill} of a {mxu} x {mxu} matrix unit's columns; the pools, ReLUs and the "
            "optimizer run on the vector unit"
        )
    return "\n".join(lines)


def repeat_steps(run: Any, state: Any, batch: Any, calls: int = 1):
    """A callable that runs ``calls`` training steps of ``run``'s compiled program in a row, from ``state``.

    Each step donates its state, so the callable feeds every new state back (the first call starts from
    ``state`` placed by the run's strategy; a later call continues from where the last one stopped). It is
    what ``notebooks/08_lab.ipynb`` times with :func:`course_lib.measure.alternating` (sections 6.1, 6.5).

    Args:
      run: a :class:`course_lib.lab.StrategyRun` (:func:`course_lib.lab.run_strategy`).
      state: a host :class:`course_lib.steps.TrainState` with ``run``'s shapes (e.g. ``A.states[-1]``).
      batch: one global batch ``(images, labels)`` placed as ``run``'s batches are (``run.batches[0]``):
        images ``(global_batch, size, size, 3)``, labels ``(global_batch,)`` int32.
      calls: steps per call, at least 1.

    Returns:
      A function of no arguments returning the last step's metrics (``{"loss": ...}``, not blocked on).

    Raises:
      ValueError: ``calls`` below 1.
    """
    if calls < 1:
        raise ValueError(f"calls={calls}: at least one step per call")
    holder = [run.strategy.place_state(state)]

    def call():
        metrics = None
        for _ in range(calls):
            holder[0], metrics = run.compiled(holder[0], batch)
        return metrics

    return call


def critical_batch_figure(
    batch: int,
    stats: Any,
    fabric: costs.Fabric,
    precision: str,
    *,
    grows: Sequence[bool],
    matmul_precision: str = "default",
    ax: Any = None,
    title: str = "",
):
    """Draw one strategy's roofline time ``r × b`` and communication time ``a + c × b`` against the
    per-device batch ``b`` (both axes logarithmic), with the fabric's α and with α = 0: each pair crosses
    at its critical batch ``b* = a / (r − c)`` (:func:`course_lib.costs.critical_batch`;
    ``notebooks/08_lab.ipynb``, section 6.4). The batch axis spans 1/4 of the smallest of ``batch`` and
    the finite b* to 4 times the largest.

    Args:
      batch: the per-device batch (images) the program was compiled for; drawn as a vertical line.
      stats: the program's :class:`course_lib.measure.CompiledStats` (``flops_per_device``,
        ``bytes_accessed``, ``transfers``).
      fabric: the :class:`course_lib.chips.Fabric` whose chip and links give the times.
      precision, matmul_precision: as :func:`course_lib.costs.step_time`.
      grows: one bool per transfer, True where its bytes grow with the batch (:func:`grows_with_batch`).
      ax: the matplotlib axes to draw on; None: a new figure.
      title: the axes' title.

    Returns:
      The matplotlib ``Figure``. Its axes hold three lines, in µs per step: ``"roofline r·b"``,
      ``"communication a + c·b"`` and ``"communication, α = 0"``, then one vertical line per finite,
      nonzero b* (labelled ``"b* …"``) and one at ``batch`` (``"this run's batch"``).
    """
    no_alpha = fabric.with_latency(0.0)
    args = (stats.flops_per_device, stats.bytes_accessed, stats.transfers)
    kw = {"grows": grows, "matmul_precision": matmul_precision}
    lines = {}
    for name, fab in (("communication a + c·b", fabric), ("communication, α = 0", no_alpha)):
        one = costs.scaled_step_time(1.0, *args, fab, precision, **kw)
        two = costs.scaled_step_time(2.0, *args, fab, precision, **kw)
        c = (two["comm_s"] - one["comm_s"]) / batch  # seconds per image of the growing collectives
        b_star = costs.critical_batch(batch, *args, fab, precision, **kw)
        lines[name] = (one["comm_s"] - c * batch, c, b_star)
    r = one["roofline_s"] / batch  # seconds per image: the slower of compute and HBM
    finite = [b for _, _, b in lines.values() if 0 < b < math.inf]
    b = np.geomspace(min([batch, *finite]) / 4, 4 * max([batch, *finite]), 200)
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4.2))
    ax.plot(b, r * b * 1e6, color="tab:blue", label="roofline r·b")
    for (name, (a, c, _)), style in zip(lines.items(), ("-", "--"), strict=True):
        ax.plot(b, (a + c * b) * 1e6, color="tab:red", linestyle=style, label=name)
    for (name, (_, _, b_star)), style in zip(lines.items(), (":", "-."), strict=True):
        if 0 < b_star < math.inf:
            what = "α = 0" if "α = 0" in name else "with α"
            ax.axvline(b_star, color="grey", linestyle=style, label=f"b* {what}: {b_star:.1f}")
    ax.axvline(batch, color="black", linewidth=0.8, label=f"this run's batch: {batch}")
    ax.set(xscale="log", yscale="log", title=title)
    ax.set(xlabel="per-device batch b (images, log scale)", ylabel="µs per step (log scale)")
    ax.set_xlim(b[0], b[-1])
    ax.legend(fontsize=8)
    return ax.figure

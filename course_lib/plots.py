"""Plots of lab results. Each function takes data and an optional ``ax``/figure, returns what it drew,
never calls ``plt.show()`` and never changes global matplotlib style."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import MaxNLocator


def _marker(key: str) -> str:
    """The strategy's marker from the registry (imported here, so that importing plots stays light)."""
    from .strategies import REGISTRY

    entry = REGISTRY.get(key)
    return entry.marker if entry else "."


def loss_curves(
    curves: pd.DataFrame, ax=None, title: str = "Training loss per step (same data, same init)"
):
    """Overlay the loss curves of ``loss_curves.csv`` (columns ``strategy, step, loss``).

    Parity shows as curves that lie on top of each other. Returns the Axes.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    styles = ["-", "--", ":", "-."]
    for i, (key, g) in enumerate(curves.groupby("strategy", sort=False)):
        ax.plot(
            g["step"],
            g["loss"],
            styles[i % len(styles)],
            marker=_marker(key),
            markersize=3,
            label=key,
        )
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("cross-entropy loss (nats)")
    ax.set_title(title)
    ax.legend()
    return ax


def comparison(
    results: pd.DataFrame,
    reference: pd.DataFrame | None = None,
    simulated: bool | None = None,
    reference_label: str = "reference",
    label: str = "this run",
):
    """Four panels, one bar per strategy: samples/s, median step time, bytes per device, achieved FLOP/s.

    Args:
      results: rows of ``lab_results.csv``.
      reference: optional rows of a reference run (same columns), drawn as hatched bars beside; pass only a
        comparable one (same profile and platform).
      reference_label: legend text for the reference bars, e.g. its device kind and profile.
      label: legend text for ``results``' bars (the TPU reference's: its device kind).
      simulated: label the timing panels as relative (simulated CPU devices); default read from the rows.

    Returns:
      The Figure.
    """
    if simulated is None:
        simulated = bool(
            results.get("simulated", pd.Series([False])).astype(str).str.lower().eq("true").any()
        )
    panels = [
        ("samples_per_s", "samples / s"),
        ("step_time_s", "median step time (s)"),
        ("bytes_per_device", "compiled bytes per device (MiB)"),
        ("achieved_flops_per_s", "achieved GFLOP/s (all devices)"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.4))
    keys = list(results["strategy"])
    x = np.arange(len(keys))
    width = 0.38 if reference is not None else 0.7
    for ax, (col, name) in zip(axes, panels, strict=True):
        scale = (
            1 / 2**20 if col == "bytes_per_device" else 1e-9 if col == "achieved_flops_per_s" else 1
        )
        vals = results[col].astype(float).to_numpy() * scale
        ax.bar(x - (width / 2 if reference is not None else 0), vals, width, label=label)
        if reference is not None and col in reference.columns:
            ref = reference.set_index("strategy")
            rvals = [float(ref.loc[k, col]) * scale if k in ref.index else np.nan for k in keys]
            ax.bar(x + width / 2, rvals, width, hatch="//", alpha=0.6, label=reference_label)
        ax.set_xticks(x, keys, rotation=20)
        rel = (
            " (relative: simulated devices)"
            if simulated and col in ("samples_per_s", "step_time_s", "achieved_flops_per_s")
            else ""
        )
        ax.set_title(name + rel, fontsize=9)
    fig.tight_layout()
    if reference is not None:
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(
            handles, labels, loc="upper center", ncol=2, fontsize=8, bbox_to_anchor=(0.5, 1.08)
        )
    return fig


def scaling(rows: pd.DataFrame, ax=None, simulated: bool | None = None):
    """Throughput against device count per strategy, with the ideal line (linear from 1 device).

    Args:
      rows: scaling rows (``strategy, n_devices, samples_per_s``).
      simulated: label the axis as relative when the devices are simulated; default read from the rows.

    Returns:
      The Axes.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.8))
    if simulated is None:
        simulated = bool(
            rows.get("simulated", pd.Series([False])).astype(str).str.lower().eq("true").any()
        )
    ns = sorted(rows["n_devices"].unique())
    for key, g in rows.groupby("strategy", sort=False):
        g = g.sort_values("n_devices")
        ax.plot(g["n_devices"], g["samples_per_s"], marker=_marker(key), label=key)
        base = g.loc[g["n_devices"] == g["n_devices"].min(), "samples_per_s"]
        if len(base) and key == rows["strategy"].iloc[0]:
            b = float(base.iloc[0]) / float(g["n_devices"].min())
            ax.plot(ns, [b * n for n in ns], "k:", label=f"ideal (linear from {key} at 1 device)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("devices")
    ax.set_ylabel("samples / s" + (" (relative, simulated devices)" if simulated else ""))
    ax.set_title("Strong scaling at a fixed global batch")
    ax.legend(fontsize=8)
    return ax


def collective_bytes(results: pd.DataFrame, ax=None):
    """Bytes each device sends per step, per strategy: measured from the compiled program (bars, split by
    mesh axis) and predicted from shapes (black ticks). Rows of ``lab_results.csv``. Returns the Axes."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.6))
    keys = list(results["strategy"])
    x = np.arange(len(keys))
    bottom = np.zeros(len(keys))
    for axis, colour in (
        ("data", "tab:blue"),
        ("model", "tab:orange"),
        ("data,model", "tab:green"),
    ):
        vals = np.array(
            [_axis_bytes(str(v), axis) for v in results["collective_bytes_by_axis"]], dtype=float
        )
        if vals.any():
            ax.bar(x, vals / 2**20, 0.6, bottom=bottom / 2**20, color=colour, label=f"over {axis}")
            bottom += vals
    pred = results["collective_bytes_predicted"].astype(float).to_numpy() / 2**20
    ax.scatter(x, pred, marker="_", s=600, color="k", zorder=3, label="predicted from shapes")
    ax.set_xticks(x, keys, rotation=20)
    ax.set_ylabel("MiB sent per device per step")
    ax.set_title("Bytes on the wire: measured (bars) and predicted (ticks)")
    ax.legend(fontsize=8)
    return ax


def _axis_bytes(text: str, axis: str) -> float:
    """The bytes of ``axis`` in a ``collective_bytes_by_axis`` cell (``"data:566658 model:852608"``)."""
    for part in text.split():
        name, _, value = part.rpartition(":")
        if name == axis:
            return float(value)
    return 0.0


def memory_by_kind(results: pd.DataFrame, ax=None):
    """Per strategy, bytes per device: parameters, gradients (reduced, as the update reads them), optimizer
    state and the activations the backward pass keeps (stacked, predicted from shapes), and the compiled
    program's temporaries (dots). A results table without ``grad_bytes_per_device`` (an older run) draws
    no gradients. Returns the Axes."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.6))
    keys = list(results["strategy"])
    x = np.arange(len(keys))
    bottom = np.zeros(len(keys))
    for col, name in (
        ("param_bytes_per_device", "parameters"),
        ("grad_bytes_per_device", "gradients, reduced (predicted)"),
        ("opt_state_bytes_per_device", "optimizer state"),
        ("activation_bytes_per_device", "activations kept (predicted)"),
    ):
        if col not in results:
            continue
        vals = results[col].astype(float).to_numpy()
        ax.bar(x, vals / 2**20, 0.6, bottom=bottom / 2**20, label=name)
        bottom += vals
    temp = results["temp_bytes_per_device"].astype(float).to_numpy() / 2**20
    ax.scatter(x, temp, color="k", zorder=3, label="temporaries (memory_analysis)")
    ax.set_xticks(x, keys, rotation=20)
    ax.set_ylabel("MiB per device")
    ax.set_yscale("log")
    ax.set_title("Memory per device, by kind")
    ax.legend(fontsize=8)
    return ax


def drift(relative: dict, ax=None, reference: str = "float64 A"):
    """Relative loss difference per step of each run against a reference run (log scale).

    Args:
      relative: ``{label: [|loss − reference| / reference per step]}``; zeros are drawn at 1e-17.
      reference: what the differences are taken against, for the title.

    Returns:
      The Axes.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    for label, values in relative.items():
        v = np.maximum(np.asarray(values, dtype=float), 1e-17)
        ax.plot(np.arange(len(v)), v, marker=_marker(label), markersize=3, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("|loss − reference| / reference")
    ax.set_title(f"How far each run drifts from {reference}")
    ax.legend(fontsize=7)
    return ax


def time_breakdown(timings: dict, ax=None, title: str = "Step time on a fabric (a model)"):
    """Horizontal bars of each row's modelled step: compute, HBM and each axis's communication, with the
    two bounds marked (``|`` perfect overlap, ``▶`` no overlap).

    Args:
      timings: ``{label: course_lib.costs.step_time(...) result}``, e.g. one per fabric or per layout.
      ax: the Axes to draw on (a new figure when None).

    Returns:
      The Axes. Times are drawn in milliseconds on a log scale (the terms differ by orders of magnitude).
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.6 + 0.7 * len(timings)))
    labels = list(timings)
    axes_names = sorted({a for t in timings.values() for a in t["comm_by_axis"]})
    terms = ["compute", "HBM"] + [f"comm: {a}" for a in axes_names]
    height = 0.8 / len(terms)
    for k, term in enumerate(terms):
        values = []
        for t in timings.values():
            if term == "compute":
                values.append(t["compute_s"])
            elif term == "HBM":
                values.append(t["memory_s"])
            else:
                values.append(t["comm_by_axis"].get(term.removeprefix("comm: "), 0.0))
        y = np.arange(len(labels)) + (k - (len(terms) - 1) / 2) * height
        ax.barh(y, np.asarray(values) * 1e3, height=height, label=term)
    for i, t in enumerate(timings.values()):
        ax.plot(t["overlap_s"] * 1e3, i, "k|", markersize=14)
        ax.plot(t["no_overlap_s"] * 1e3, i, "k>", markersize=6)
    ax.set_yticks(np.arange(len(labels)), labels)
    ax.set_xscale("log")
    ax.set_xlabel("ms per step  (|: compute and communication overlapped,  ▶: one after the other)")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="lower right")
    return ax


def notebook_runs(runs: pd.DataFrame, title: str = "", ax=None):
    """Two panels, one bar per notebook of a run on an accelerator (``notebooks.csv`` of a TPU reference,
    :func:`course_tools.tpu_reference.notebooks`): its seconds, and the allocator's peak
    (``memory_stats()["peak_bytes_in_use"]``, MiB) against the chip's limit (``bytes_limit``, named in the
    title). Bars of notebooks that failed are hatched and labelled with their failing cell.

    Args:
      runs: columns ``notebook``, ``ok`` (bool), ``seconds``, ``failed_cell``, ``peak_bytes_in_use``,
        ``bytes_limit`` (bytes).
      title: the figure's title (the run and its chip).
      ax: two matplotlib Axes to draw on (default a new figure).

    Returns:
      The Figure.
    """
    if ax is None:
        fig, ax = plt.subplots(1, 2, figsize=(12, 0.35 * len(runs) + 1.4), sharey=True)
    else:
        fig = ax[0].figure
    y = np.arange(len(runs))[::-1]
    ok = runs["ok"].astype(bool).to_numpy()
    limit = float(runs["bytes_limit"].max()) / 2**20  # NaN where the run did not record it
    of = f" (limit {limit:,.0f} MiB)" if limit == limit else ""
    panels = (
        ("seconds", "seconds (cells run in order, in-process)", 1.0),
        ("peak_bytes_in_use", f"peak MiB in use{of}", 1 / 2**20),
    )
    for a, (col, name, scale) in zip(ax, panels, strict=True):
        vals = runs[col].astype(float).to_numpy() * scale
        a.barh(y[ok], vals[ok], color="tab:green", label="ran clean")
        a.barh(y[~ok], vals[~ok], color="tab:red", hatch="//", alpha=0.6, label="failed")
        a.set_title(name, fontsize=9)
    for yi, v, cell in zip(y[~ok], runs["seconds"].to_numpy()[~ok], runs["failed_cell"][~ok]):
        ax[0].annotate(f" cell {int(cell)}" if cell == cell else " failed", (v, yi), va="center",
                       fontsize=7)  # fmt: skip
    ax[0].set_yticks(y, runs["notebook"])
    ax[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def roofline(
    results: pd.DataFrame,
    peak_flops_per_s: float,
    hbm_bytes_per_s: float,
    ax=None,
    title: str = "Roofline (a model)",
    measured: bool = False,
):
    """Log-log roofline of one chip, each strategy a point from its compiled program.

    The roof: attainable FLOP/s = ``min(peak, intensity × HBM bandwidth)``, bending at the ridge point
    ``peak / HBM bandwidth`` (FLOPs per byte; dotted). Each row is drawn at its ``arithmetic_intensity``
    (``cost_analysis()`` FLOPs ÷ bytes accessed) and the model's FLOP/s, ``flops_per_device /
    model_roofline_s`` (on the roof). With ``measured=True`` (a run on that chip) each strategy's measured
    ``flops_per_device / step_time_s`` is drawn hollow beneath it.

    Args:
      results: rows with ``strategy``, ``arithmetic_intensity``, ``flops_per_device``, ``model_roofline_s``
        and ``step_time_s`` (:data:`course_lib.lab_time.TIME_COLUMNS`).
      peak_flops_per_s, hbm_bytes_per_s: the chip's (:func:`course_lib.costs.rate`, ``Peak.hbm_bytes_per_s``).

    Returns:
      The Axes.

    Raises:
      ValueError: no row has a finite intensity and roofline time.
    """
    rows = results[
        np.isfinite(results["arithmetic_intensity"]) & np.isfinite(results["model_roofline_s"])
    ]
    if rows.empty:
        raise ValueError("no row has a finite arithmetic_intensity and model_roofline_s to draw")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.2))
    ridge = peak_flops_per_s / hbm_bytes_per_s
    lo = min(rows["arithmetic_intensity"].min(), ridge) / 4
    hi = max(rows["arithmetic_intensity"].max(), ridge) * 4
    x = np.geomspace(lo, hi, 200)
    ax.plot(x, np.minimum(peak_flops_per_s, x * hbm_bytes_per_s), "k-", lw=1.5, label="roof")
    ax.axvline(ridge, color="gray", ls=":", label=f"ridge {ridge:.0f} FLOP/byte")
    for _, r in rows.iterrows():
        y = r["flops_per_device"] / r["model_roofline_s"]
        (line,) = ax.plot(r["arithmetic_intensity"], y, _marker(r["strategy"]), ms=8,
                          label=f"{r['strategy']} (model)")  # fmt: skip
        if measured and r["step_time_s"] > 0:
            ax.plot(r["arithmetic_intensity"], r["flops_per_device"] / r["step_time_s"],
                    _marker(r["strategy"]), ms=8, mfc="none", color=line.get_color())  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity: FLOPs per HBM byte (compiled program)")
    ax.set_ylabel("FLOP/s per device" + ("  (hollow: measured)" if measured else ""))
    ax.set_title(title)
    ax.legend(fontsize=7, loc="lower right")
    return ax


def save(fig, path) -> str:
    """Save a Figure (or the Figure of an Axes) as PNG at 110 dpi; returns the path as a string.

    The PNG is written to a temporary file beside ``path`` and moved into place (``os.replace``), so a
    full disk or an interrupted run leaves the previous picture (or none), never a truncated one; the
    ``OSError`` of a failed write is raised as it is, and the temporary file is removed."""
    fig = getattr(fig, "figure", fig)
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return str(path)


def save_lab_plots(
    out_dir,
    table: pd.DataFrame,
    curves: pd.DataFrame,
    *,
    scaling_rows=(),
    reference: pd.DataFrame | None = None,
    reference_label: str = "reference",
    simulated: bool | None = None,
) -> list[str]:
    """Save the lab's pictures in ``out_dir`` (``notebooks/08_lab.ipynb``, section 11) and close them.

    Writes ``scaling.png`` (only with ``scaling_rows``), ``loss_curves.png``, ``comparison.png``,
    ``collective_bytes.png`` and ``memory_by_kind.png``, each whole or not at all (:func:`save`).

    Args:
      out_dir: the results folder (``course_tools.results.prepare_results_dir``).
      table: the results rows, one per strategy (``lab_results.csv``'s columns).
      curves: ``{strategy, step, loss}`` rows (``course_tools.results.curves_rows``).
      scaling_rows: the scaling sweep's rows (:func:`course_lib.lab.scaling_sweep`), or none.
      reference, reference_label: a reference run drawn beside ``table`` in ``comparison.png``, or None.
      simulated: whether the devices were simulated (relative times, labelled so).

    Returns:
      The paths written, in that order.

    Raises:
      OSError: a picture could not be written (a full disk, a read-only folder).
    """
    out_dir = Path(out_dir)
    figures = []
    if len(scaling_rows):
        figures.append(("scaling.png", scaling(pd.DataFrame(scaling_rows), simulated=simulated)))
    figures += [
        ("loss_curves.png", loss_curves(curves)),
        (
            "comparison.png",
            comparison(
                table, reference=reference, simulated=simulated, reference_label=reference_label
            ),
        ),
        ("collective_bytes.png", collective_bytes(table)),
        ("memory_by_kind.png", memory_by_kind(table)),
    ]
    try:
        return [save(fig, out_dir / name) for name, fig in figures]
    finally:
        plt.close("all")

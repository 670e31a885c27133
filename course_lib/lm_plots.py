"""The transformer lab's tables and plots: collectives predicted beside read from the program, a step-time
model's stacked bars, its time breakdown per layout (compute, bubble, exposed and overlapped communication)
and the bytes predicted beside measured.

Re-exported by :mod:`course_lib.lm_costs` (``lm_costs.by_kind``, ``lm_costs.plot_step_times``,
``lm_costs.plot_bytes``, ``lm_costs.time_breakdown``, ``lm_costs.plot_time_breakdown``). Taught in
``notebooks/12_transformer_lab.ipynb``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["by_kind", "plot_step_times", "plot_bytes", "time_breakdown", "plot_time_breakdown"]


def plot_step_times(rows: Sequence[dict], ax=None, title: str = ""):
    """Stacked bars of a step-time model (:func:`step_time` rows): compute, then each mesh axis's
    communication; labelled as a model. Returns the axes."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7, 3))[1]
    axes = sorted({a for r in rows for a in r["comm_s"]})
    names = [r["layout"] for r in rows]
    bottom = np.zeros(len(rows))
    parts = [("compute", [r["compute_s"] for r in rows])]
    parts += [(f"comm: {a}", [r["comm_s"].get(a, 0.0) for r in rows]) for a in axes]
    for label, values in parts:
        values = np.asarray(values) * 1e3
        ax.bar(names, values, bottom=bottom, label=label)
        bottom += values
    ax.set_ylabel("ms per step (model)")
    ax.set_title(title or "step-time MODEL (not a measurement)")
    ax.legend(fontsize=7)
    return ax


def plot_bytes(rows: Sequence[dict], ax=None):
    """Bytes per device per step of each layout, predicted (hollow) beside measured from the compiled program
    (filled), from the lab's run (``rows``: ``{"layout", "predicted_bytes", "measured_bytes"}``)."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7, 3))[1]
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["predicted_bytes"] / 1e3 for r in rows], 0.4, label="predicted from shapes",
           fill=False, edgecolor="C0")  # fmt: skip
    ax.bar(
        x + 0.2,
        [r["measured_bytes"] / 1e3 for r in rows],
        0.4,
        label="compiled program",
        color="C1",
    )
    ax.set_xticks(x, [r["layout"] for r in rows])
    ax.set_ylabel("kB sent per device per step")
    ax.legend(fontsize=7)
    return ax


def by_kind(predicted: Sequence, measured: Sequence) -> list[dict]:
    """Predicted and measured collectives side by side, one row per (mesh axis, kind): how many and the
    bytes each device sends (:class:`course_lib.comms.Transfer` / :class:`course_lib.comms.Collective`)."""
    rows: dict[tuple[str, str], dict] = {}
    for source, items in (("predicted", predicted), ("measured", measured)):
        for t in items:
            row = rows.setdefault(
                (t.axis, t.kind),
                {"axis": t.axis, "kind": t.kind, "predicted_n": 0, "predicted_bytes": 0.0,
                 "measured_n": 0, "measured_bytes": 0.0},
            )  # fmt: skip
            row[f"{source}_n"] += 1
            row[f"{source}_bytes"] += t.sent_bytes
    return sorted(rows.values(), key=lambda r: (r["axis"], r["kind"]))


BREAKDOWN = ("compute", "bubble", "exposed communication", "overlapped communication")
"""The parts of :func:`time_breakdown`, in the order the bars stack them."""


def time_breakdown(row: dict) -> dict[str, float]:
    """One layout's predicted step split into its parts, seconds (a :func:`course_lib.lm_times.step_time`
    row, at the ``overlap`` it was computed with): ``compute`` (the roofline's time of the work, bubble
    left out), ``bubble`` (the pipeline's idle ticks, computed masked: its ``bubble_s``), ``exposed
    communication`` (what the step waits for: ``step_s − compute_s``) and ``overlapped communication`` (the
    rest of the collectives' time, hidden behind compute). The first three sum to ``step_s``; exposed and
    overlapped to the communication time.

    Raises:
      ValueError: a row without ``bubble_s`` (not a :func:`~course_lib.lm_times.step_time` row).
    """
    if "bubble_s" not in row:
        raise ValueError(f"{row.get('layout')!r}: not a lm_costs.step_time row (no 'bubble_s')")
    comm = sum(row["comm_s"].values())
    exposed = row["step_s"] - row["compute_s"]
    return {
        "compute": row["compute_s"] - row["bubble_s"],
        "bubble": row["bubble_s"],
        "exposed communication": exposed,
        "overlapped communication": comm - exposed,
    }


def plot_time_breakdown(rows: Sequence[dict], ax=None, title: str = ""):
    """Stacked bars per layout of :func:`time_breakdown`: compute, bubble and exposed communication stack
    to the predicted step time; the overlapped communication is drawn hatched above it (hidden: it adds no
    time). Labelled as a model. Returns the axes."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7, 3))[1]
    names = [r["layout"] for r in rows]
    parts = [time_breakdown(r) for r in rows]
    bottom = np.zeros(len(rows))
    for i, label in enumerate(BREAKDOWN):
        values = np.array([p[label] for p in parts]) * 1e3
        hidden = label == "overlapped communication"
        ax.bar(names, values, bottom=bottom, label=label + (" (hidden)" if hidden else ""),
               color=f"C{i}", alpha=0.35 if hidden else 1.0, hatch="//" if hidden else None)  # fmt: skip
        bottom += values
    steps = [r["step_s"] * 1e3 for r in rows]
    ax.plot(names, steps, "k_", markersize=18, label="predicted step")
    ax.set_ylabel("ms per step (model)")
    ax.set_title(title or "step-time MODEL: where the time goes (not a measurement)")
    ax.legend(fontsize=7)
    return ax

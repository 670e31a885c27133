"""The transformer lab's tables and plots: collectives predicted beside read from the program, a step-time
model's stacked bars and the bytes predicted beside measured.

Re-exported by :mod:`course_lib.lm_costs` (``lm_costs.by_kind``, ``lm_costs.plot_step_times``,
``lm_costs.plot_bytes``). Taught in
``notebooks/12_transformer_lab.ipynb``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["by_kind", "plot_step_times", "plot_bytes"]


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

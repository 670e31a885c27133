"""The transformer lab's plots: a step-time model's stacked bars and the bytes predicted beside measured.

Re-exported by :mod:`course_lib.lm_costs` (``lm_costs.plot_step_times``, ``lm_costs.plot_bytes``). Taught in
``notebooks/12_transformer_lab.ipynb``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["plot_step_times", "plot_bytes"]


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

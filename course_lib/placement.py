"""Where each kind of array lives under each strategy: a grid of "whole" or "1/n" per device (08_lab).

Read from a run's results table (:func:`course_lib.lab.run_strategy`'s rows), each entry one device's
share of what the single-device run A holds: the parameters and optimizer state from the placed arrays
(``parallel.bytes_per_device``), the reduced gradients from the strategy's parameter layout, the residual
activations from the per-device batch and tensor-parallel split, the batch from the images per device.
ZeRO-1 and ZeRO-2 are composed from two measured rows: B's (data parallel) with E's (FSDP) optimizer
state, and with E's optimizer state and gradients.
"""

from __future__ import annotations

import matplotlib as mpl
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

KINDS = {
    "parameters": "param_bytes_per_device",
    "gradients": "grad_bytes_per_device",
    "optimizer state": "opt_state_bytes_per_device",
    "activations": "activation_bytes_per_device",
    "batch": "local_batch",
}
"""Row label → the results column of one device's share (bytes, or images for the batch)."""

COLUMNS = {
    "pmap": "DP (B)",
    "zero1": "ZeRO-1\n(B + E's optimizer state)",
    "zero2": "ZeRO-2\n(B + E's gradients\nand optimizer state)",
    "fsdp": "ZeRO-3 at rest,\nFSDP (E)",
    "shard_map": "DP × TP (C)",
    "shard_map_pairs": "DP × TP,\nlayer pairs (C2)",
    "shard_map_article": "DP × TP,\nconv1 only (C′)",
}
"""Column key → label: the strategies the grid shows, the ZeRO stages first, then the tensor-parallel
layouts (C, C2, C′)."""


def shares(table: pd.DataFrame, reference: str = "jit") -> pd.DataFrame:
    """One device's share of each kind (rows :data:`KINDS`) under each strategy of :data:`COLUMNS`.

    Args:
      table: the lab's results (one row per strategy, column ``strategy``); it must hold ``reference``
        (the one-device run), ``pmap`` and ``fsdp``; ``shard_map``, ``shard_map_pairs`` and
        ``shard_map_article`` are shown when present.
      reference: the strategy that holds everything (A).

    Returns:
      A float DataFrame, rows :data:`KINDS`, columns the keys of :data:`COLUMNS` present: per-device
      value ÷ the reference's (1.0: whole; 0.125: 1/8).

    Raises:
      KeyError: ``table`` lacks ``reference``, ``pmap`` or ``fsdp``.
    """
    rows = table.set_index("strategy")
    missing = [k for k in (reference, "pmap", "fsdp") if k not in rows.index]
    if missing:
        raise KeyError(f"the results table has no row for {missing}: run those strategies first")
    whole = rows.loc[reference, list(KINDS.values())].astype(float)
    frac = {k: rows.loc[k, list(KINDS.values())].astype(float) / whole for k in rows.index}
    out = {"pmap": frac["pmap"].copy(), "fsdp": frac["fsdp"]}
    for stage, from_e in (("zero1", ["opt_state"]), ("zero2", ["opt_state", "grad"])):
        out[stage] = frac["pmap"].copy()
        for kind in from_e:
            out[stage][f"{kind}_bytes_per_device"] = frac["fsdp"][f"{kind}_bytes_per_device"]
    for key in ("shard_map", "shard_map_pairs", "shard_map_article"):
        if key in frac:
            out[key] = frac[key]
    grid = pd.DataFrame({k: out[k] for k in COLUMNS if k in out})
    grid.index = list(KINDS)
    return grid


def label(share: float, tol: float = 0.01) -> str:
    """``"whole"`` for 1, ``"1/n"`` for a share within ``tol`` of one over an integer, else a percentage
    with its ``1/x`` (some leaves kept whole, a layer split on one axis only)."""
    if abs(share - 1) <= tol:
        return "whole"
    if share > 0 and abs(1 / share - round(1 / share)) <= tol * (1 / share):
        return f"1/{round(1 / share)}"
    return f"{share:.0%} (1/{1 / share:.1f})" if share > 0 else "none"


def grid(shares_df: pd.DataFrame, n_devices: int, ax=None, title: str | None = None):
    """Draw :func:`shares` as a grid: a cell per kind and strategy, shaded by the share one device holds,
    written as :func:`label` gives it (08_lab; 12_transformer_lab draws its layouts' parameters with it).

    Args:
      shares_df: one device's share (1.0: whole; 0.125: 1/8) per row (a kind of array) and column (a
        strategy); a column named in :data:`COLUMNS` is labelled from it, any other by its own name.
      n_devices: the devices the shares are of (named in the default title).
      ax: the Axes to draw on; a new Figure where None.
      title: the title; None gives "What one device holds of each kind, on n devices".

    Returns:
      The Figure.
    """
    if ax is None:
        fig, ax = plt.subplots(
            figsize=(2.3 * shares_df.shape[1] + 1.6, 0.55 * len(shares_df) + 1.2)
        )
    else:
        fig = ax.figure
    values = shares_df.to_numpy(dtype=float)
    ax.imshow(np.clip(values, 0, 1), cmap=mpl.colormaps["Blues"], vmin=0, vmax=1.6, aspect="auto")
    for (i, j), v in np.ndenumerate(values):
        ax.text(j, i, label(v), ha="center", va="center", fontsize=8)
    ax.set_xticks(
        range(values.shape[1]), [COLUMNS.get(k, k) for k in shares_df.columns], fontsize=8
    )
    ax.set_yticks(range(values.shape[0]), list(shares_df.index), fontsize=8)
    ax.set_title(
        title
        or f"What one device holds of each kind, on {n_devices} devices (this run's shardings)",
        fontsize=9,
        loc="left",
    )
    return fig

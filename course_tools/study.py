"""Scaling study: aggregate lab runs made at different device counts, refusing runs that do not compare.

``python -m course_tools.run scaling --counts 1 2 4 8`` runs the lab once per device count (separate
processes: the count is fixed per process) and then calls :func:`aggregate` and :func:`plot_study` here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from course_lib.measure import scaling_efficiency

from . import folders, results

COMPARABLE = ("profile", "platform", "device_kind", "jax_version", "global_batch", "image_size")
"""Columns that must be equal across runs for their throughputs to be compared."""


class IncomparableRuns(ValueError):
    """Runs differ in a column of :data:`COMPARABLE`; the message names the column and the values."""


def aggregate(run_dirs: Sequence[str | os.PathLike]) -> pd.DataFrame:
    """Concatenate the ``lab_results.csv`` of several runs, with a ``run`` column naming each folder.

    Raises:
      FileNotFoundError: a folder has no results.
      IncomparableRuns: the runs differ in profile, platform, device kind, JAX version, batch or image size.
    """
    frames = []
    for d in run_dirs:
        df = results.load_results(d)["results"].copy()
        df.insert(0, "run", Path(d).name)
        frames.append(df)
    if not frames:
        raise ValueError("no runs given")
    allrows = pd.concat(frames, ignore_index=True)
    check_comparable(allrows)
    for note in commit_notes(run_dirs):
        print(f"note: {note}")
    return allrows


def commit_notes(run_dirs: Sequence[str | os.PathLike]) -> list[str]:
    """A note when the runs were made by different commits of the course (their ``run.json``, in the
    folder or the one above it: ``make scaling`` keeps its runs in one claimed folder): their code differs,
    so a difference in their numbers may be the code's."""
    commits = {}
    for d in run_dirs:
        d = Path(d)
        claim = next((p for p in (d, d.parent) if (p / folders.CLAIM_FILE).exists()), None)
        if claim is not None and (commit := folders.read_run(claim).commit):
            commits[d.name] = commit[:7]
    if len(set(commits.values())) > 1:
        return [f"the runs are of different commits of the course: {commits}"]
    return []


def check_comparable(rows: pd.DataFrame) -> None:
    """Raise :class:`IncomparableRuns` when ``rows`` mix values of a :data:`COMPARABLE` column."""
    for col in COMPARABLE:
        if col in rows.columns and rows[col].astype(str).nunique() > 1:
            by_run = (
                rows.groupby("run")[col].first().to_dict()
                if "run" in rows.columns
                else rows[col].unique().tolist()
            )
            raise IncomparableRuns(
                f"runs differ in {col!r}: {by_run}. Throughputs of different {col}s do not compare; "
                f"study them separately (one scaling study per {col})."
            )


STUDY_COLUMNS = ("step_time_s", "bytes_per_device")
"""Columns the study keeps beside throughput and efficiency."""


def efficiency(rows: pd.DataFrame) -> pd.DataFrame:
    """The study's table: :func:`course_lib.measure.scaling_efficiency` of the parallel strategies (a
    single-device one, A, does not scale), with step time and bytes per device; 1.0 is ideal scaling."""
    from course_lib.strategies import REGISTRY

    single = [k for k, info in REGISTRY.items() if info.mesh_kind == "single"]
    return scaling_efficiency(rows[~rows["strategy"].isin(single)], STUDY_COLUMNS)


def plot_study(table: pd.DataFrame, reference: pd.DataFrame | None = None, simulated: bool = False):
    """Four panels against device count, per strategy: throughput (with the ideal line), step time,
    bytes per device, efficiency. ``reference`` (an :func:`efficiency` table) is drawn dashed. Returns the Figure."""
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    panels = [
        ("samples_per_s", "samples / s"),
        ("step_time_s", "median step time (s)"),
        ("bytes_per_device", "compiled bytes per device"),
        ("efficiency", "scaling efficiency"),
    ]
    for ax, (col, name) in zip(axes, panels, strict=True):
        for key, g in table.groupby("strategy", sort=False):
            ax.plot(g["n_devices"], g[col], marker="o", label=key)
            if col == "samples_per_s" and (g["n_devices"] == 1).any():
                b = float(g.loc[g["n_devices"] == 1, col].iloc[0])
                ax.plot(g["n_devices"], b * g["n_devices"], ":", color="gray")
        if reference is not None and col in reference.columns:
            for key, g in reference.groupby("strategy", sort=False):
                ax.plot(g["n_devices"], g[col], "--", alpha=0.5, label=f"{key} (reference)")
        if col == "efficiency":
            ax.axhline(1.0, color="gray", ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices")
        rel = (
            " (relative, simulated)"
            if simulated and col in ("samples_per_s", "step_time_s", "efficiency")
            else ""
        )
        ax.set_title(name + rel, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig

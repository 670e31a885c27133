"""The committed TPU reference runs as the course book's lab report shows them, beside the CPU reference.

Each run of ``tools/tpu_check.sh`` on a TPU host is committed as ``data/tpu_reference/<date>-<chip>-x<n>/``
(:data:`ROOT`; e.g. ``2026-12-06-tpu-v5-lite-x1``: one TPU v5e chip): ``notebooks.csv`` (which notebooks
ran on the chip, their failing cell, the allocator's peak), ``summary.txt``, ``device.txt`` (the device
report: the chip, its memory), ``versions.txt`` and, where the run measured the lab, its results folder(s)
(a ``lab_results.csv`` anywhere below, e.g. ``lab/bf16/``). :func:`runs` lists the folders newest first;
:func:`newest` picks the newest one, or the newest one with lab results; :func:`context` is what
``docs/book/pages/lab-report.md.jinja`` renders (tables formatted by :mod:`course_tools.book`, figures drawn
by :mod:`course_lib.plots`). Used by :mod:`course_tools.site`; taught by none of the notebooks.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pandas as pd

from . import results

ROOT = results.DATA_DIR / "tpu_reference"
"""Where the TPU reference runs are committed."""
FOLDER = re.compile(r"^(?P<date>\d{4}-\d{2}-\d{2})-(?P<chip>.+)-x(?P<count>\d+)(?:-(?P<k>\d+))?$")
"""A run folder's name: ``<date>-<chip>-x<number of chips>``, then ``-2``, ``-3`` … for a later run of the
same day (``tools/tpu_check.sh`` never overwrites one); ``programs/`` and others do not match."""


@dataclasses.dataclass(frozen=True)
class Run:
    """One committed TPU run: its ``folder``, ``date`` (``YYYY-MM-DD``), ``chip`` (the name's middle,
    ``tpu-v5-lite``), ``count`` (chips used) and ``lab`` (its ``lab_results.csv`` files, sorted)."""

    folder: Path
    date: str
    chip: str
    count: int
    lab: tuple[Path, ...]


def runs(root: str | Path | None = None) -> list[Run]:
    """Every run folder under ``root`` (default :data:`ROOT`), newest first (by date, then the day's run
    number: ``-x1-10`` after ``-x1-9``)."""
    root = Path(root) if root is not None else ROOT
    found = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        m = FOLDER.match(path.name)
        if m and path.is_dir():
            lab = tuple(sorted(path.rglob(results.RESULTS_FILE)))
            found.append((int(m["k"] or 1), Run(path, m["date"], m["chip"], int(m["count"]), lab)))
    return [run for _, run in sorted(found, key=lambda kr: (kr[1].date, kr[0]), reverse=True)]


def newest(root: str | Path | None = None, *, with_lab: bool = False) -> Run | None:
    """The newest run (with ``with_lab``: the newest that has lab results), or None where there is none."""
    return next((r for r in runs(root) if r.lab or not with_lab), None)


def notebooks(folder: Path) -> pd.DataFrame:
    """``notebooks.csv``: the last run of each notebook on the chip, sorted by notebook (columns ``run``,
    ``notebook``, ``ok``, ``seconds``, ``failed_cell``, ``error``, ``peak_bytes_in_use``, ``bytes_limit``;
    ``#`` lines are comments). Raises FileNotFoundError where the folder has none."""
    df = pd.read_csv(folder / "notebooks.csv", comment="#")
    df["ok"] = df["ok"].astype(str).str.lower().eq("true")
    return df.groupby("notebook", sort=True).tail(1).sort_values("notebook").reset_index(drop=True)


def device(folder: Path) -> dict[str, str]:
    """``device.txt``'s ``key : value`` lines (the device report: ``platform``, ``devices``, ``chip``,
    ``memory``, ``jax / jaxlib``, ``python``); warnings and other lines are skipped."""
    out = {}
    for line in _text(folder, "device.txt").splitlines():
        key, sep, value = line.partition(" : ")
        if sep and key.strip() and not key.startswith(" "):
            out[key.strip()] = value.strip()
    return out


def versions(folder: Path) -> dict[str, str]:
    """``versions.txt``'s ``name  version`` lines (pip's list: ``jax``, ``jaxlib``, ``libtpu``, …)."""
    out = {}
    for line in _text(folder, "versions.txt").splitlines():
        parts = line.split()
        if len(parts) == 2 and re.match(r"^[A-Za-z0-9_.-]+$", parts[0]) and parts[1][:1].isdigit():
            out[parts[0]] = parts[1]
    return out


def _text(folder: Path, name: str) -> str:
    path = folder / name
    return path.read_text(errors="replace") if path.exists() else ""


def _notebook_table(df: pd.DataFrame) -> dict:
    from .book import _table

    mib = lambda v: f"{v / 2**20:,.0f}"  # noqa: E731
    return _table(
        df.assign(status=["ran clean" if ok else "failed" for ok in df["ok"]]),
        [
            ("notebook", "notebook", str),
            ("last run", "run", str),
            ("status", "status", str),
            ("seconds", "seconds", lambda v: f"{v:.1f}"),
            ("failed cell", "failed_cell", lambda v: f"{int(v)}"),
            ("error", "error", lambda v: f"`{str(v).strip()[:80]}`"),
            ("peak MiB (memory_stats)", "peak_bytes_in_use", mib),
        ],
    )


def _lab(path: Path, staging: Path, index: int) -> dict:
    from course_lib import plots

    from .book import _results_tables, _table, _workload

    rows = results.load_results(path.parent)["results"]
    figure = f"tpu/lab-{index}.png"
    kind = str(rows["device_kind"].iloc[0]) if "device_kind" in rows.columns else "TPU"
    plots.save(plots.comparison(rows, label=kind), staging / figure)
    tables = _results_tables(rows)
    if "mfu" in rows.columns:
        pct = lambda v: f"{v:.1%}"  # noqa: E731
        tables.append(_table(rows, [("strategy", "label", str), ("MFU", "mfu", pct)]))
    return {
        "file": str(_shown(path)),
        "summary": _workload(rows),
        "results": tables,
        "figure": figure,
    }


def context(staging: Path, root: str | Path | None = None) -> dict | None:
    """What the lab report shows of the TPU reference (None: no run committed under ``root``).

    Returns:
      ``folder`` (the newest run's, as committed), ``chip`` (device.txt's chip line), ``versions``
      (``"JAX 0.10.2, jaxlib 0.10.2, libtpu 0.0.42.1, Python 3.11.7"``), ``summary`` (summary.txt's
      first line), ``notebooks`` (a table of each notebook's last run), ``passed`` (``"9 of 13"``),
      ``figure`` (the notebooks' seconds and memory peaks, drawn into ``staging/tpu/``), ``lab_folder``
      (the newest run with lab results, None if none) and ``labs`` (one per ``lab_results.csv`` there:
      ``file``, ``summary``, ``results`` tables, ``figure``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_lib import plots

    run = newest(root)
    if run is None:
        return None
    shown = _shown(run.folder)
    (staging / "tpu").mkdir(exist_ok=True)
    nbs = notebooks(run.folder)
    dev, ver = device(run.folder), versions(run.folder)
    plots.save(plots.notebook_runs(nbs, title=f"{shown}: {dev.get('devices', run.chip)}"),
               staging / "tpu" / "notebooks.png")  # fmt: skip
    python = dev.get("python", "").split(" on ")[0]
    names = [("JAX", "jax"), ("jaxlib", "jaxlib"), ("libtpu", "libtpu")]
    lab_run = newest(root, with_lab=True)
    labs = []
    for i, path in enumerate(lab_run.lab if lab_run else ()):
        labs.append(_lab(path, staging, i))
    plt.close("all")
    return {
        "folder": str(shown),
        "chip": dev.get("chip", run.chip),
        "devices": dev.get("devices", f"{run.count} × {run.chip}"),
        "versions": ", ".join(
            [f"{label} {ver[k]}" for label, k in names if k in ver]
            + ([f"Python {python}"] if python else [])
        ),
        "summary": _text(run.folder, "summary.txt").split("\n")[0].strip(),
        "notebooks": _notebook_table(nbs),
        "passed": f"{int(nbs['ok'].sum())} of {len(nbs)}",
        "figure": "tpu/notebooks.png",
        "lab_folder": str(_shown(lab_run.folder)) if lab_run else None,
        "labs": labs,
    }


def _shown(path: Path) -> Path:
    return (
        path.relative_to(results.PROJECT_ROOT)
        if path.is_relative_to(results.PROJECT_ROOT)
        else path
    )

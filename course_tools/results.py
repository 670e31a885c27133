"""Results files of the lab: CSVs with metadata, never silently overwritten.

Files in a results folder (the contract the lab, notebooks/08_lab.ipynb, writes and the tests check):

- ``lab_results.csv`` — one row per strategy: ``strategy, n_devices, mesh, global_batch, image_size, steps,
  step_time_s, samples_per_s, compile_s, bytes_per_device, flops_per_step, collectives, final_loss,
  platform, device_kind, jax_version``, the costs ``collective_bytes_per_device`` (measured from the
  compiled program), ``collective_bytes_predicted`` (from shapes), ``param_bytes_per_device``,
  ``opt_state_bytes_per_device``, ``activation_bytes_per_device``, ``mfu`` (model FLOP
  utilisation: the model's analytic FLOPs, not the compiled program's; empty on CPU) and the run's
  ``precision``, and more (see :data:`RESULT_COLUMNS`).
- ``loss_curves.csv`` — ``strategy, step, loss``.
- ``scaling.csv`` — the scaling sweep, the same columns as ``lab_results.csv``.
- PNG plots beside them.

The transformer lab (``notebooks/12_transformer_lab.ipynb``) writes, through the same :func:`write_csv`, to its
own fresh folder (``build/lab12[-k]``; :func:`write_lm_results`):

- ``lm_results.csv`` — one row per layout: mesh, parity errors (float64, float32), bytes sent per device
  predicted and measured, compile and CPU step time (:data:`LM_RESULT_COLUMNS`).
- ``lm_bytes.csv`` — per layout, mesh axis and collective kind: how many and the bytes, predicted and
  measured (:data:`LM_BYTES_COLUMNS`).
- ``lm_memory.csv`` — per layout, memory by kind predicted and ``memory_analysis()`` measured
  (:data:`LM_MEMORY_COLUMNS`).
- ``lm_step_model.csv`` — the step-time MODEL for 8 GPUs (``is_model`` is True in every row: no GPU ran it;
  :data:`LM_MODEL_COLUMNS`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import pandas as pd

from .folders import (
    WRITES_MB,
    FolderError,
    WriteFailed,
    check_folder,
    write_atomic,
    write_error,
)

RESULTS_FILE = "lab_results.csv"
CURVES_FILE = "loss_curves.csv"
SCALING_FILE = "scaling.csv"

RESULT_COLUMNS = (
    "strategy",
    "n_devices",
    "mesh",
    "global_batch",
    "image_size",
    "steps",
    "step_time_s",
    "samples_per_s",
    "compile_s",
    "bytes_per_device",
    "flops_per_step",
    "collectives",
    "final_loss",
    "platform",
    "device_kind",
    "jax_version",
    "precision",
    "collective_bytes_per_device",
    "collective_bytes_predicted",
    "param_bytes_per_device",
    "opt_state_bytes_per_device",
    "activation_bytes_per_device",
    "mfu",
    "grad_bytes_per_device",
)
"""Columns every ``lab_results.csv`` has (the contract); rows may carry more."""

LM_FILES = {
    "results": "lm_results.csv",
    "bytes": "lm_bytes.csv",
    "memory": "lm_memory.csv",
    "model": "lm_step_model.csv",
}
"""The transformer lab's results files, by table."""
LM_RESULT_COLUMNS = (
    "layout", "n_devices", "mesh", "parity_f64", "parity_f32", "predicted_bytes", "measured_bytes",
    "collectives", "compile_s", "cpu_step_s", "final_loss", "platform", "jax_version", "mfu",
)  # fmt: skip
LM_BYTES_COLUMNS = (
    "layout", "n_devices", "axis", "kind", "predicted_n", "predicted_bytes", "measured_n",
    "measured_bytes",
)  # fmt: skip
LM_MEMORY_COLUMNS = (
    "layout", "n_devices", "params", "optimizer", "gradients", "batch", "activations_est",
    "arguments_predicted", "argument_size", "outputs_predicted", "output_size", "temp_size",
)  # fmt: skip
LM_MODEL_COLUMNS = (
    "layout", "profile", "step_s", "compute_s", "comm_s", "sent_bytes", "memory_bytes", "is_model",
)  # fmt: skip
LM_COLUMNS = {
    "results": LM_RESULT_COLUMNS,
    "bytes": LM_BYTES_COLUMNS,
    "memory": LM_MEMORY_COLUMNS,
    "model": LM_MODEL_COLUMNS,
}
"""Columns each of the transformer lab's files has (the contract); rows may carry more."""

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
"""The repository's ``data/`` folder: reference runs and the source article's reported figures."""


PROJECT_ROOT = DATA_DIR.parent


def build_dir() -> Path:
    """The build folder: ``$COURSE_BUILD_DIR`` if set (tests point it at a temporary folder), else
    ``<project>/build``."""
    env = os.environ.get("COURSE_BUILD_DIR", "").strip()
    return Path(env).expanduser() if env else PROJECT_ROOT / "build"


def resolve_results_dir(results_dir: str | os.PathLike, name: str = "lab") -> Path:
    """``"auto"`` → ``build_dir() / name``; a relative path is taken relative to the project root (so a
    notebook run from ``notebooks/`` and a papermill run from the root write to the same place)."""
    if str(results_dir).strip().lower() == "auto":
        return build_dir() / name
    path = Path(results_dir).expanduser()
    return path if path.is_absolute() else PROJECT_ROOT / path


RESULTS_FIX = "give another results_dir (papermill: -p results_dir DIR; make: BUILD=DIR)"


def prepare_results_dir(
    results_dir: str | os.PathLike,
    overwrite: bool = False,
    writes_mb: float = WRITES_MB["lab"],
    what: str = "results folder",
    fix: str = RESULTS_FIX,
    name: str = "lab",
) -> Path:
    """The folder this run writes to, checked writable and with room; an earlier run's results are never
    silently replaced.

    ``results_dir`` goes through :func:`resolve_results_dir` first (``"auto"``: ``build/<name>``, relative
    paths).

    If ``results_dir`` does not exist or is empty, it is used (created). If it holds anything (an earlier
    run, or files of the reader's): with ``overwrite=True`` it is used and the results files written
    later replace theirs; otherwise a new sibling folder ``<results_dir>-2`` (``-3``, …) is created and returned,
    and one line says so (the folder that was in use, and where this run writes instead).
    The folder is then checked (:func:`course_tools.folders.check_folder`): a file is written and removed
    in it, and at least ``max(MIN_FREE_MB, writes_mb)`` MB must be free — so that the lab's setup cell
    (``notebooks/08_lab.ipynb`` calls this) stops before any training when its results could not be saved.

    ``what`` and ``fix`` name the folder and the remedy in messages (the book: "book folder").

    Raises:
      ValueError: ``results_dir`` is empty or names an existing file, not a folder.
      FolderError (a ``ValueError``): the folder cannot be created or written, or has too little room;
        the message names it and the fix.
    """
    if results_dir is None or str(results_dir).strip() == "":
        raise ValueError("results_dir is empty; give a folder such as 'build/lab', or 'auto'")
    path = resolve_results_dir(results_dir, name)
    if path.exists() and not path.is_dir():
        raise ValueError(f"results_dir={str(path)!r} is a file, not a folder; give a folder path")
    try:
        held = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        chosen = path if overwrite or not held else _sibling(path)
    except OSError as e:
        raise FolderError(f"cannot write the {what} {path} ({e.strerror or e}): {fix}") from None
    checked = check_folder(chosen, what, fix, writes_mb)
    earlier = [n for n in held if Path(n).suffix in (".csv", ".png")]  # what the labs write
    if overwrite and earlier:
        print(
            f"overwrite=True: {path} already holds results files or plots ({_names(earlier)}); those "
            "this run writes again are replaced"
        )
    elif checked != path:
        print(
            f"the {what} {path} already holds files ({_names(held)}); nothing there is overwritten: "
            f"this run writes to {checked} instead",
            flush=True,
        )
    return checked


def _names(names: list[str]) -> str:
    """The first four of ``names``, and how many there are when more."""
    return ", ".join(names[:4]) + (f", … ({len(names)} in all)" if len(names) > 4 else "")


def _sibling(path: Path) -> Path:
    """A new, empty folder ``<path>-k`` (the first free k from 2), created."""
    k = 2
    while True:
        candidate = path.with_name(f"{path.name}-{k}")
        try:
            candidate.mkdir(parents=True, exist_ok=False)
            return candidate
        except FileExistsError:
            k += 1


def write_csv(
    rows: Iterable[dict] | pd.DataFrame,
    path: str | os.PathLike,
    required: Sequence[str] = (),
    *,
    may_be_empty: bool = False,
) -> Path:
    """Write rows to a CSV and return its path.

    Args:
      may_be_empty: no rows is a result (written as the ``required`` columns' header alone), not an error.

    Raises:
      ValueError: no rows (unless ``may_be_empty``), or a required column is missing (named).
      OSError: the file cannot be written (a full disk): the message names the file and the folder; the
        previous version of the file, if any, is kept and no temporary file is left.
    """
    df = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    if df.empty and may_be_empty and not len(df.columns):
        df = pd.DataFrame(columns=list(required))
    elif df.empty and not may_be_empty:
        raise ValueError(f"no rows to write to {path}")
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise ValueError(f"results for {path} lack the columns {missing}")
    path = Path(path)
    try:  # never a half-written results file, and no temporary file left
        write_atomic(path, df.to_csv(index=False))
    except OSError as e:  # a full disk, a folder made read-only since: one sentence
        raise WriteFailed(e.errno, write_error(e, path, RESULTS_FIX)) from None
    return path


def write_lm_results(out_dir: str | os.PathLike, tables: dict) -> list[Path]:
    """Write the transformer lab's tables (``{"results": …, "bytes": …, "memory": …, "model": …}``, rows
    or DataFrames) to their files in ``out_dir`` (:data:`LM_FILES`); return the paths.

    The ``bytes`` table may have no rows: a run whose every mesh axis has one device, on a compiler that
    removes such collectives (XLA:TPU), has no collective to list; its file then holds the header alone.

    Raises:
      ValueError: a table missing or unknown (named), no rows (but in ``bytes``), or a required column
        missing (:data:`LM_COLUMNS`); a ``model`` table whose ``is_model`` is not True in every row.
    """
    if set(tables) != set(LM_FILES):
        raise ValueError(
            f"the transformer lab writes the tables {sorted(LM_FILES)}; got {sorted(tables)}"
        )
    model = (
        pd.DataFrame(list(tables["model"]))
        if not isinstance(tables["model"], pd.DataFrame)
        else tables["model"]
    )
    if "is_model" in model and not model["is_model"].eq(True).all():
        raise ValueError(
            "every row of the step-time table is a model (is_model=True): no GPU measured it"
        )
    return [
        write_csv(
            tables[k],
            Path(out_dir) / LM_FILES[k],
            required=LM_COLUMNS[k],
            may_be_empty=k == "bytes",
        )
        for k in LM_FILES
    ]


def curves_rows(curves: dict[str, Sequence[float]]) -> list[dict]:
    """``{strategy: [loss per step]}`` → rows ``{strategy, step, loss}`` for ``loss_curves.csv``."""
    return [
        {"strategy": k, "step": i, "loss": float(v)}
        for k, losses in curves.items()
        for i, v in enumerate(losses)
    ]


def load_results(results_dir: str | os.PathLike) -> dict[str, pd.DataFrame]:
    """Read a results folder: ``{"results": …, "curves": …, "scaling": …}`` (missing files are absent).

    Raises:
      FileNotFoundError: the folder has no ``lab_results.csv``.
    """
    path = Path(results_dir)
    if not (path / RESULTS_FILE).exists():
        raise FileNotFoundError(
            f"{path / RESULTS_FILE} does not exist; run notebooks/08_lab.ipynb with results_dir={str(path)!r}"
        )
    out = {"results": pd.read_csv(path / RESULTS_FILE)}
    for key, name in (("curves", CURVES_FILE), ("scaling", SCALING_FILE)):
        if (path / name).exists():
            out[key] = pd.read_csv(path / name)
    return out


REFERENCE_FILES = {
    "cpu": "reference_cpu_8sim.csv",
    "cpu_scaling": "reference_cpu_8sim_scaling.csv",
    "article": "article_reported.csv",
    "gpu": "reference_gpu.csv",
}


def reference_note(name: str = "cpu") -> str:
    """Which reference file ``name`` is and when it was recorded (its ``# recorded …`` header line):
    ``data/reference_cpu_8sim.csv (recorded 2026-12-01T13:27:44+00:00)``."""
    path = DATA_DIR / REFERENCE_FILES.get(name, name)
    recorded = "date not recorded"
    try:
        for line in path.read_text().splitlines()[:5]:
            if line.startswith("# recorded "):
                recorded = "recorded " + line.removeprefix("# recorded ").split(";")[0].strip()
    except OSError:
        recorded = "missing"
    shown = path.relative_to(PROJECT_ROOT) if path.is_relative_to(PROJECT_ROOT) else path
    return f"{shown} ({recorded})"


def load_reference(name: str = "cpu") -> pd.DataFrame:
    """A committed reference table from ``data/``.

    Args:
      name: ``"cpu"`` (this project's reference lab run on 8 simulated CPU devices), ``"cpu_scaling"`` (its
        scaling sweep), ``"article"`` (the source
        article's figures, *reported, not measured*), ``"gpu"`` (a GPU reference run, when one is committed),
        or a CSV file name in ``data/``.

    Raises:
      FileNotFoundError: no such reference file (the message lists the ones present).
    """
    fname = REFERENCE_FILES.get(name, name)
    path = DATA_DIR / fname
    if not path.exists():
        have = sorted(p.name for p in DATA_DIR.glob("*.csv"))
        raise FileNotFoundError(f"no reference {name!r} ({path}); present in data/: {have}")
    return pd.read_csv(path, comment="#")

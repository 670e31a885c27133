"""Command-line runs of the course's notebooks with papermill.

``python -m course_lib.run lab --n-devices 8`` executes ``notebooks/08_lab.ipynb`` into a new run folder
under the build folder (``build/lab``, or ``build/lab-2``, … when an earlier run is there: nothing is
overwritten) and leaves in it the executed notebook, the results CSVs and the plots.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .devices import PLATFORMS, parse_n_devices
from .results import PROJECT_ROOT, prepare_results_dir, resolve_results_dir

NOTEBOOKS = PROJECT_ROOT / "notebooks"


class NotebookFailed(RuntimeError):
    """A notebook raised; the message names the notebook, the cell and the error."""


def execute(notebook: Path, output: Path, parameters: dict, progress: bool = True) -> float:
    """Execute ``notebook`` into ``output`` with papermill; return the seconds it took.

    Raises:
      NotebookFailed: a cell raised (the message names the notebook, the cell number and the error; the
        partly executed notebook is at ``output``).
    """
    import papermill as pm

    t0 = time.perf_counter()
    try:
        pm.execute_notebook(
            str(notebook), str(output), parameters=parameters, kernel_name="python3",
            cwd=str(notebook.parent), progress_bar=progress, log_output=False,
        )
    except pm.PapermillExecutionError as e:
        raise NotebookFailed(
            f"{notebook.name} failed in cell [{e.exec_count}] with {e.ename}: {e.evalue}\n"
            f"the executed notebook, up to the failing cell, is {output}"
        ) from None
    return time.perf_counter() - t0


def run_lab(n_devices, platform: str = "auto", profile: str = "auto", build: str = "build",
            extra: dict | None = None, progress: bool = True) -> Path:
    """Run the lab into a fresh folder ``<build>/lab[-k]``; return that folder.

    Raises:
      ValueError: a bad ``n_devices`` or ``platform`` (checked before anything starts).
      NotebookFailed: the lab raised.
    """
    n = parse_n_devices(n_devices)
    if platform not in PLATFORMS:
        raise ValueError(f"platform={platform!r} must be one of {PLATFORMS}")
    run_dir = prepare_results_dir(resolve_results_dir(Path(build) / "lab"))
    params = {"n_devices": n, "platform": platform, "profile": profile, "results_dir": str(run_dir), "overwrite": True}
    params.update(extra or {})
    print(f"running 08_lab.ipynb with {params}")
    seconds = execute(NOTEBOOKS / "08_lab.ipynb", run_dir / "08_lab.ipynb", params, progress)
    print(f"lab done in {seconds:.0f} s; executed notebook, results and plots in {run_dir}:")
    for p in sorted(run_dir.iterdir()):
        print(f"  {p.name}")
    return run_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.run", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    lab = sub.add_parser("lab", help="run notebooks/08_lab.ipynb into a new run folder")
    lab.add_argument("--n-devices", default="8", help="devices to use (default 8)")
    lab.add_argument("--platform", default="auto", choices=PLATFORMS)
    lab.add_argument("--profile", default="auto", choices=("auto", "cpu", "gpu", "tiny"))
    lab.add_argument("--build", default="build", help="build folder (relative paths start at the project root)")
    args = parser.parse_args(argv)
    try:
        run_lab(args.n_devices, args.platform, args.profile, args.build)
    except (ValueError, NotebookFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Command-line runs of the course's notebooks with papermill.

``python -m course_tools.run lab --n-devices 8`` executes ``notebooks/08_lab.ipynb`` into a new run folder
under the build folder (``build/lab``, or ``build/lab-2``, … when an earlier run is there: nothing is
overwritten) and leaves in it the executed notebook, the results CSVs and the plots.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from course_lib.config import LAB_PARAMS, N_DEVICES, PLATFORM, arg_type, coerce

from . import results
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
            str(notebook),
            str(output),
            parameters=parameters,
            kernel_name="python3",
            cwd=str(notebook.parent),
            progress_bar=progress,
            log_output=False,
        )
    except pm.PapermillExecutionError as e:
        raise NotebookFailed(
            f"{notebook.name} failed in cell [{e.exec_count}] with {e.ename}: {e.evalue}\n"
            f"the executed notebook, up to the failing cell, is {output}"
        ) from None
    return time.perf_counter() - t0


def run_lab(
    n_devices,
    platform: str = "auto",
    profile: str = "auto",
    build: str = "build",
    extra: dict | None = None,
    progress: bool = True,
) -> Path:
    """Run the lab into a fresh folder ``<build>/lab[-k]``; return that folder.

    Raises:
      ValueError: a bad ``n_devices``, ``platform`` or ``profile`` (checked before anything starts).
      NotebookFailed: the lab raised.
    """
    n, platform = coerce(N_DEVICES, n_devices), coerce(PLATFORM, platform)
    profile = coerce(LAB_PARAMS["profile"], profile)
    run_dir = prepare_results_dir(resolve_results_dir(Path(build) / "lab"))
    params = _lab_params(n, platform, profile, run_dir, **(extra or {}))
    shown = ", ".join(
        f"{k}={v!r}" for k, v in params.items() if k not in ("results_dir", "overwrite")
    )
    print(f"running 08_lab.ipynb ({shown}) into the new folder {run_dir}")
    seconds = execute(NOTEBOOKS / "08_lab.ipynb", run_dir / "08_lab.ipynb", params, progress)
    print(f"lab done in {seconds:.0f} s; executed notebook, results and plots in {run_dir}:")
    for p in sorted(run_dir.iterdir()):
        print(f"  {p.name}")
    return run_dir


def _lab_params(n: int, platform: str, profile: str, run_dir: Path, **more) -> dict:
    """The lab's papermill parameters for a run into its own fresh folder."""
    params = {"n_devices": n, "platform": platform, "profile": profile, "results_dir": str(run_dir)}
    return {**params, "overwrite": True, **more}


def course_notebooks() -> list[Path]:
    """The course's notebooks in order (``NN_name.ipynb``)."""
    return sorted(p for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def run_course(
    n_devices,
    platform: str = "auto",
    build: str = "build",
    only: Sequence[str] | None = None,
    progress: bool = True,
    lab_params: dict | None = None,
) -> Path:
    """Execute every notebook in order into a fresh folder ``<build>/course[-k]``; print a time table.

    Stops at the first failing notebook (:class:`NotebookFailed` names it and the cell). Writes
    ``timings.csv`` (notebook, seconds, status) beside the executed notebooks. ``lab_params`` adds
    parameters for the lab only (e.g. ``{"profile": "tiny"}``); its results go to ``<folder>/lab``.
    """
    n, platform = coerce(N_DEVICES, n_devices), coerce(PLATFORM, platform)
    notebooks = course_notebooks()
    if only:
        notebooks = [p for p in notebooks if any(p.name.startswith(o) for o in only)]
        if not notebooks:
            raise ValueError(f"no notebook matches {list(only)}; names start with 00 … 09")
    out = prepare_results_dir(resolve_results_dir(Path(build) / "course"))
    rows = []
    try:
        for nb in notebooks:
            params = {"n_devices": n, "platform": platform}
            if nb.name == "08_lab.ipynb":
                params.update(results_dir=str(out / "lab"), overwrite=False, **(lab_params or {}))
            print(
                f"[{len(rows) + 1}/{len(notebooks)}] {nb.name} (n_devices={n}, platform={platform})",
                flush=True,
            )
            try:
                seconds = execute(nb, out / nb.name, params, progress)
            except NotebookFailed:
                rows.append({"notebook": nb.name, "seconds": float("nan"), "status": "FAILED"})
                raise
            rows.append({"notebook": nb.name, "seconds": round(seconds, 1), "status": "ok"})
    finally:
        import pandas as pd

        if rows:
            table = pd.DataFrame(rows)
            table.to_csv(out / "timings.csv", index=False)
            print("\n" + table.to_string(index=False))
            print(f"total {table['seconds'].sum():.0f} s; executed notebooks in {out}")
            if (out / "lab").is_dir():
                print(f"the lab's results files and plots: {out / 'lab'}")
    return out


def run_scaling(
    counts: Sequence,
    platform: str = "auto",
    profile: str = "auto",
    build: str = "build",
    progress: bool = True,
) -> Path:
    """Run the lab once per device count (a separate kernel each) and aggregate into ``<build>/scaling[-k]``.

    Writes ``study.csv`` (per strategy and count: samples/s, step time, bytes per device, efficiency) and
    ``study.png``, with the committed reference study from ``data/`` beside it when profile and platform match.

    Raises:
      ValueError: an invalid count, platform or profile; :class:`course_tools.study.IncomparableRuns` when
        runs do not compare.
    """
    from . import study

    ns = sorted({coerce(N_DEVICES, c) for c in counts})
    platform, profile = coerce(PLATFORM, platform), coerce(LAB_PARAMS["profile"], profile)
    out = prepare_results_dir(resolve_results_dir(Path(build) / "scaling"))
    run_dirs = []
    for n in ns:
        run_dir = out / f"n{n}"
        run_dir.mkdir()
        params = _lab_params(n, platform, profile, run_dir, scaling=False)
        print(f"lab at n_devices={n} ...", flush=True)
        execute(NOTEBOOKS / "08_lab.ipynb", run_dir / "08_lab.ipynb", params, progress)
        run_dirs.append(run_dir)
    rows = study.aggregate(run_dirs)
    table = study.efficiency(rows)
    table.to_csv(out / "study.csv", index=False)
    simulated = bool(rows["platform"].eq("cpu").all())
    ref = None
    try:
        ref_rows = results.load_reference("cpu_scaling")
        same = set(ref_rows["profile"]) == set(rows["profile"]) and set(
            ref_rows["platform"]
        ) == set(rows["platform"])
        ref = study.efficiency(ref_rows.assign(run="reference")) if same else None
    except FileNotFoundError:
        pass
    from course_lib import plots

    plots.save(study.plot_study(table, ref, simulated=simulated), out / "study.png")
    print(table.to_string(index=False))
    print(f"scaling study in {out}")
    return out


def _parser() -> argparse.ArgumentParser:
    """The command line; values are typed by the notebooks' own rule (:func:`course_lib.config.coerce`)."""
    parser = argparse.ArgumentParser(
        prog="python -m course_tools.run", description=__doc__.splitlines()[0], exit_on_error=False
    )
    sub = parser.add_subparsers(dest="what", required=True)
    n_devices, platform = arg_type(N_DEVICES), arg_type(PLATFORM)
    profile = arg_type(LAB_PARAMS["profile"])
    root = "build folder (relative paths start at the project root)"
    lab = sub.add_parser(
        "lab", help="run notebooks/08_lab.ipynb into a new run folder", exit_on_error=False
    )
    lab.add_argument("--n-devices", type=n_devices, default=8, help="devices to use (default 8)")
    lab.add_argument("--platform", type=platform, default="auto", help="auto | cpu | gpu")
    lab.add_argument("--profile", type=profile, default="auto", help="auto | cpu | gpu | tiny")
    lab.add_argument("--build", default="build", help=root)
    course = sub.add_parser(
        "course",
        help="run every notebook in order into a new folder, with a time table",
        exit_on_error=False,
    )
    course.add_argument("--n-devices", type=n_devices, default=8)
    course.add_argument("--platform", type=platform, default="auto")
    course.add_argument("--build", default="build", help=root)
    course.add_argument("--only", nargs="*", help="notebook name prefixes, e.g. 00 08")
    course.add_argument("--profile", type=profile, default="auto", help="the lab's profile")
    scaling = sub.add_parser(
        "scaling", help="run the lab at several device counts and aggregate", exit_on_error=False
    )
    scaling.add_argument("--counts", nargs="+", type=n_devices, default=[1, 2, 4, 8])
    scaling.add_argument("--platform", type=platform, default="auto")
    scaling.add_argument("--profile", type=profile, default="auto")
    scaling.add_argument("--build", default="build", help=root)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        if args.what == "lab":
            run_lab(args.n_devices, args.platform, args.profile, args.build)
        elif args.what == "course":
            run_course(
                args.n_devices,
                args.platform,
                args.build,
                args.only,
                lab_params={"profile": args.profile},
            )
        else:
            run_scaling(args.counts, args.platform, args.profile, args.build)
    except (argparse.ArgumentError, ValueError, NotebookFailed, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "interrupted: the partly executed notebook is in the run folder printed above; a new run uses a "
            "new folder",
            file=sys.stderr,
        )
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Command-line runs of the course's notebooks with papermill.

``python -m course_tools.run lab --n-devices 8`` executes ``notebooks/08_lab.ipynb`` into a new run folder
under the build folder (``build/lab``, or ``build/lab-2``, … when an earlier run is there: nothing is
overwritten) and leaves in it the executed notebook, the results CSVs and the plots.

Every run folder is claimed before anything starts (:func:`course_tools.processes.claim_run_dir`: two runs
started at the same moment get two folders), after the build folder was checked writable and with room. A
Ctrl-C, a SIGTERM or a kernel that dies (killed by the system, out of memory) ends the command within
seconds with one message naming the notebook and the cell and listing what the run folder keeps; the kernel
and its processes are stopped (see :mod:`course_tools.execution`). Exit status: 0 done, 1 an error, 130
Ctrl-C, 143 SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from course_lib.config import LAB_PARAMS, N_DEVICES, PLATFORM, arg_type, coerce

from . import params as nb_params
from . import results
from .execution import (
    KernelDied,
    NotebookFailed,
    RunInterrupted,
    RunRefused,
    check_kernel,
    check_parameters,
    execute,
)
from .folders import (
    CLAIM_FILE,
    WRITES_MB,
    FolderError,
    WriteFailed,
    check_folder,
    claim_run_dir,
    finish_run,
    write_error,
)
from .processes import Terminated, ignoring_sigint, terminate_as_interrupt
from .results import PROJECT_ROOT, prepare_results_dir, resolve_results_dir

__all__ = [
    "KernelDied",
    "NotebookFailed",
    "RunInterrupted",
    "RunRefused",
    "course_notebooks",
    "execute",
    "main",
    "run_course",
    "run_lab",
    "run_scaling",
]

NOTEBOOKS = PROJECT_ROOT / "notebooks"
BUILD_FIX = "give a writable folder with --build DIR (make: BUILD=DIR)"


def run_folder(build: str | os.PathLike, name: str, writes_mb: float = WRITES_MB["lab"]) -> Path:
    """A new run folder ``<build>/<name>[-k]`` that this run alone owns, in a build folder checked
    writable and with room for ``writes_mb`` MB (:func:`course_tools.folders.check_folder`).

    Raises:
      FolderError: an empty build path, a build folder that cannot be written or has no room (named).
    """
    if not str(build).strip():
        raise FolderError(f"the build folder is empty: {BUILD_FIX}")
    base = resolve_results_dir(Path(build) / name)
    check_folder(base.parent, "build folder", BUILD_FIX, writes_mb)
    return claim_run_dir(lambda: prepare_results_dir(base, writes_mb=writes_mb))


def kept(folder: Path) -> str:
    """What a stopped run leaves in ``folder``, for the message: its notebooks and results files."""
    files = sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file() and p.name != CLAIM_FILE and not p.name.startswith(".")
    )
    shown = [f for f in files if not f.endswith(".kernel.log")]
    ended = f"; {CLAIM_FILE} there records how the run ended"
    if not any(f.endswith((".csv", ".png")) for f in shown):
        return (
            f"kept in {folder}: {', '.join(shown) or 'nothing'} (no results were saved yet){ended}"
        )
    return f"kept in {folder}: {', '.join(shown)}{ended}"


def _with_kept(error: BaseException, folder: Path) -> BaseException:
    error.args = (f"{error}\n{kept(folder)}",)
    return error


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
      ValueError: a bad ``n_devices``, ``platform``, ``profile`` or parameter name, a build folder that
        cannot be used, a Jupyter kernel of another Python (checked before anything starts).
      NotebookFailed: the lab raised, or its kernel died (:class:`KernelDied`); RunInterrupted: Ctrl-C or
        SIGTERM. Their messages list what the run folder keeps.
    """
    n, platform = coerce(N_DEVICES, n_devices), coerce(PLATFORM, platform)
    profile = coerce(LAB_PARAMS["profile"], profile)
    lab = NOTEBOOKS / "08_lab.ipynb"
    check_parameters(lab, nb_params.lab_params(n, platform, profile, Path(), **(extra or {})))
    check_kernel()
    run_dir = run_folder(build, "lab", WRITES_MB["lab"])
    params = nb_params.lab_params(n, platform, profile, run_dir, **(extra or {}))
    shown = ", ".join(
        f"{k}={v!r}" for k, v in params.items() if k not in ("results_dir", "overwrite")
    )
    print(f"running 08_lab.ipynb ({shown}) into the new folder {run_dir}", flush=True)
    try:
        seconds = execute(lab, run_dir / "08_lab.ipynb", params, progress)
    except (NotebookFailed, RunInterrupted) as e:
        finish_run(run_dir, _status(e))
        raise _with_kept(e, run_dir) from None
    finish_run(run_dir, "ok")
    print(f"lab done in {seconds:.0f} s; executed notebook, results and plots in {run_dir}:")
    for p in sorted(run_dir.iterdir()):
        print(f"  {p.name}")
    return run_dir


def course_notebooks() -> list[Path]:
    """The course's notebooks in order (``NN_name.ipynb``)."""
    return sorted(p for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def chosen_notebooks(notebooks: Sequence[Path], only: Sequence[str]) -> list[Path]:
    """The notebooks of ``notebooks`` that ``only`` names (``make course ONLY="10 11"`` or ``ONLY="10,11"``):
    number or name prefixes of two characters or more.

    Raises:
      ValueError: a prefix names no notebook (``"0"`` or ``"88"`` would silently run others or fewer).
    """
    only = [part.strip() for o in only for part in str(o).split(",") if part.strip()]
    numbers = sorted({p.name[:2] for p in notebooks})
    for o in only:
        if len(o) < 2 or not any(p.name.startswith(o) for p in notebooks):
            raise ValueError(
                f"--only {o!r} names no notebook: give their numbers ({' '.join(numbers)}) or names, "
                'separated by spaces or commas (ONLY="10 11")'
            )
    return [p for p in notebooks if any(p.name.startswith(o) for o in only)]


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
        notebooks = chosen_notebooks(notebooks, only)
    with contextlib.redirect_stdout(
        io.StringIO()
    ):  # checked here; their notes print when each runs
        plan = [
            (nb, nb_params.course_params(nb, n, platform, Path(), lab_params)) for nb in notebooks
        ]
    for nb, params in plan:
        check_parameters(nb, params)
    check_kernel()
    out = run_folder(build, "course", WRITES_MB["course"])
    rows = []
    try:
        for i, (nb, params) in enumerate(plan):
            params = nb_params.course_params(nb, n, platform, out, lab_params)
            print(
                f"[{i + 1}/{len(plan)}] {nb.name} (n_devices={n}, platform={platform})", flush=True
            )
            try:
                seconds = execute(nb, out / nb.name, params, progress)
            except (NotebookFailed, RunInterrupted) as e:
                rows.append({"notebook": nb.name, "seconds": float("nan"), "status": _status(e)})
                raise _with_kept(e, out) from None
            rows.append({"notebook": nb.name, "seconds": round(seconds, 1), "status": "ok"})
    finally:
        with ignoring_sigint():
            _write_timings(out, rows, [nb.name for nb, _ in plan])
            whole = "ok" if len(rows) == len(plan) else "unfinished"
            finish_run(out, next((r["status"] for r in rows if r["status"] != "ok"), whole))
    return out


def _status(error: BaseException) -> str:
    if isinstance(error, RunInterrupted):
        return "stopped by SIGTERM" if error.exit_code == 143 else "interrupted"
    return "kernel died" if isinstance(error, KernelDied) else "FAILED"


def _write_timings(out: Path, rows: list[dict], planned: Sequence[str] = ()) -> None:
    """``timings.csv`` (every notebook that started, the stopped one included, its seconds empty) and the
    printed table, which also lists the ``planned`` notebooks that never started as "not run"."""
    import pandas as pd

    if rows:
        table = pd.DataFrame(rows)
        try:
            results.write_csv(table, out / "timings.csv")
        except OSError as e:
            # a full disk: the table is printed below, and the run's own error is the message
            print(f"timings.csv not written: {e}", file=sys.stderr)
    if rows or planned:
        print("\n" + timings_table(rows, planned))
        print(f"executed notebooks in {out}")
        if (out / "lab").is_dir():
            print(f"the lab's results files and plots: {out / 'lab'}")


def timings_table(rows: list[dict], planned: Sequence[str] = ()) -> str:
    """The time table of a course run: one line per notebook (its seconds, or "-" where it did not finish;
    its status: ok, FAILED, interrupted, …, or "not run" for a notebook of ``planned`` that never started)
    and a total of the notebooks that finished, naming those that did not."""
    started = {r["notebook"] for r in rows}
    lines = [(r["notebook"], r["seconds"], r["status"]) for r in rows]
    lines += [(name, None, "not run") for name in planned if name not in started]
    width = max([len("notebook"), *(len(name) for name, _, _ in lines)])
    out = [f"{'notebook':<{width}}  {'seconds':>8}  status"]
    for name, seconds, status in lines:
        done = status == "ok" and seconds == seconds and seconds is not None  # NaN != NaN
        out.append(f"{name:<{width}}  {f'{seconds:.1f}' if done else '-':>8}  {status}")
    finished = [s for _, s, status in lines if status == "ok"]
    total = f"total {sum(finished):.0f} s for the {len(finished)} notebook(s) that finished"
    unfinished = [
        f"{name} {status}" for name, _, status in lines if status not in ("ok", "not run")
    ]
    never = [name for name, _, status in lines if status == "not run"]
    if never:
        unfinished.append(f"{len(never)} not run")
    return "\n".join(out + [total + (f"; {', '.join(unfinished)}" if unfinished else "")])


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
    The transformer lab (``12_transformer_lab.ipynb``) runs at each count too, after the CNN lab, into
    ``n<k>/lab12``; its ``lm_results.csv`` rows (per layout and count: parity, bytes predicted and measured,
    CPU step time) are gathered in ``lm_study.csv`` (layouts that do not fit a count are absent there).

    Raises:
      ValueError: an invalid count, platform or profile; :class:`course_tools.study.IncomparableRuns` when
        runs do not compare.
    """
    ns = sorted({coerce(N_DEVICES, c) for c in counts})
    platform, profile = coerce(PLATFORM, platform), coerce(LAB_PARAMS["profile"], profile)
    lab, lab12 = NOTEBOOKS / "08_lab.ipynb", NOTEBOOKS / nb_params.LAB12
    check_parameters(lab, nb_params.lab_params(ns[0], platform, profile, Path(), scaling=False))
    check_parameters(lab12, nb_params.lab12_params(ns[0], platform, Path()))
    check_kernel()
    _draw_with_agg()
    from . import study

    out = run_folder(build, "scaling", WRITES_MB["lab"] * len(ns))
    run_dirs = []
    for n in ns:
        run_dir = out / f"n{n}"
        run_dir.mkdir()
        params = nb_params.lab_params(n, platform, profile, run_dir, scaling=False)
        print(f"lab at n_devices={n} ...", flush=True)
        try:
            execute(lab, run_dir / "08_lab.ipynb", params, progress)
            print(f"transformer lab at n_devices={n} ...", flush=True)
            execute(
                lab12,
                run_dir / nb_params.LAB12,
                nb_params.lab12_params(n, platform, run_dir / "lab12"),
                progress,
            )
        except (NotebookFailed, RunInterrupted) as e:
            finish_run(out, _status(e))
            done = ", ".join(str(d) for d in run_dirs) or "none"
            e.args = (f"{e}\ncompleted runs kept: {done}; no study was written",)
            raise
        run_dirs.append(run_dir)
    rows = study.aggregate(run_dirs)
    table = study.efficiency(rows)
    results.write_csv(table, out / "study.csv")
    import pandas as pd

    lm_rows = [
        pd.read_csv(d / "lab12" / results.LM_FILES["results"]).assign(run=d.name) for d in run_dirs
    ]
    results.write_csv(pd.concat(lm_rows, ignore_index=True), out / "lm_study.csv")
    simulated = bool(rows["platform"].eq("cpu").all())
    ref = _reference_study(rows)
    from course_lib import plots

    try:
        plots.save(study.plot_study(table, ref, simulated=simulated), out / "study.png")
    except OSError as e:
        raise WriteFailed(e.errno, write_error(e, out / "study.png", BUILD_FIX)) from None
    finish_run(out, "ok")
    print(table.to_string(index=False))
    print(f"scaling study in {out}")
    return out


def _reference_study(rows):
    """The committed reference study's efficiency table when it is of the same profile and platform as
    ``rows`` (else None); says which file it is and when it was recorded, or why it is left out."""
    from . import study

    try:
        ref_rows = results.load_reference("cpu_scaling")
    except FileNotFoundError:
        return None
    which = results.reference_note("cpu_scaling")
    same = all(set(ref_rows[c]) == set(rows[c]) for c in ("profile", "platform"))
    if not same:
        print(f"the reference study {which} is of another profile or platform: not drawn")
        return None
    print(f"drawn beside the reference study {which}")
    return study.efficiency(ref_rows.assign(run="reference"))


def _draw_with_agg() -> None:
    """This process only writes PNG files: matplotlib with Agg, whatever ``MPLBACKEND`` the shell set (a
    misspelt one would otherwise fail at the end, after every run). The kernels keep the environment."""
    saved = os.environ.get("MPLBACKEND")
    os.environ["MPLBACKEND"] = "Agg"
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
    finally:
        if saved is None:
            os.environ.pop("MPLBACKEND")
        else:
            os.environ["MPLBACKEND"] = saved


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
    lab.add_argument("--platform", type=platform, default="auto", help=PLATFORM.help)
    lab.add_argument("--profile", type=profile, default="auto", help=LAB_PARAMS["profile"].help)
    lab.add_argument("--build", default="build", help=root)
    course = sub.add_parser(
        "course",
        help="run every notebook in order into a new folder, with a time table",
        exit_on_error=False,
    )
    course.add_argument("--n-devices", type=n_devices, default=8)
    course.add_argument("--platform", type=platform, default="auto", help=PLATFORM.help)
    course.add_argument("--build", default="build", help=root)
    course.add_argument("--only", nargs="*", help="notebook name prefixes, e.g. 00 08")
    course.add_argument("--profile", type=profile, default="auto", help="the lab's profile")
    scaling = sub.add_parser(
        "scaling", help="run the lab at several device counts and aggregate", exit_on_error=False
    )
    scaling.add_argument("--counts", nargs="+", type=n_devices, default=[1, 2, 4, 8])
    scaling.add_argument("--platform", type=platform, default="auto", help=PLATFORM.help)
    scaling.add_argument("--profile", type=profile, default="auto")
    scaling.add_argument("--build", default="build", help=root)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (0, 1 an error, 130 Ctrl-C, 143 SIGTERM)."""
    try:
        with terminate_as_interrupt():
            args = _parser().parse_args(argv)
            if args.what == "lab":
                run_lab(args.n_devices, args.platform, args.profile, args.build)
            elif args.what == "course":
                lab_params = {"profile": args.profile}
                run_course(
                    args.n_devices, args.platform, args.build, args.only, lab_params=lab_params
                )
            else:
                run_scaling(args.counts, args.platform, args.profile, args.build)
    except RunInterrupted as e:
        with ignoring_sigint():  # a second Ctrl-C must not cut the message short
            print(f"\n{e}", file=sys.stderr)  # on its own line, after a progress bar cut short
        return e.exit_code
    except (
        KeyboardInterrupt
    ) as e:  # outside a notebook: while choosing folders or drawing the study
        with ignoring_sigint():
            print(
                f"{e or 'interrupted'} before a notebook started or after the last one",
                file=sys.stderr,
            )
        return 143 if isinstance(e, Terminated) else 130
    except (argparse.ArgumentError, ValueError, NotebookFailed, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def command(argv: list[str] | None = None) -> None:
    """``python -m course_tools.run``: :func:`main`, then exit with its status; a second Ctrl-C while the
    command exits changes nothing."""
    code = main(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":
    command()

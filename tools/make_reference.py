"""Record a reference lab run in data/: run the lab with papermill and copy its results with a provenance header.

    python tools/make_reference.py [--n-devices 8] [--platform cpu] [--profile auto] [--name NAME] [--overwrite]
    make reference OVERWRITE=1          # the committed 8-device CPU reference, recorded again

Writes data/<name>.csv (one row per strategy) and data/<name>_scaling.csv (the scaling sweep); the lab run
itself goes to a new folder build/reference/lab[-k]. The default name, reference_cpu_8sim, is the reference
the lab and the book compare with: it is only written by a run at its settings (8 devices, CPU, profile
auto); other settings need --name. Refuses to replace existing files unless --overwrite is given, and
checks that data/ can be written (with room) before the lab runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

from course_tools import folders, results, run

DEFAULT_NAME = "reference_cpu_8sim"
DEFAULT_SETTINGS = ("8", "cpu", "auto")


def main(argv: list[str] | None = None) -> int:
    """The command line; 0 written, 1 the lab failed, 2 refused before anything ran."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-devices", default="8")
    ap.add_argument("--platform", default="cpu")
    ap.add_argument("--profile", default="auto")
    ap.add_argument(
        "--name", help=f"file name in data/ (default {DEFAULT_NAME}, at its settings only)"
    )
    ap.add_argument("--overwrite", action="store_true", help="replace the reference files in data/")
    args = ap.parse_args(argv)
    settings = (str(args.n_devices), args.platform, args.profile)
    if args.name is None and settings != DEFAULT_SETTINGS:
        print(
            f"error: {DEFAULT_NAME} is the 8-device CPU reference (--n-devices 8 --platform cpu --profile "
            f"auto); give --name for a reference of other settings",
            file=sys.stderr,
        )
        return 2
    name = args.name or DEFAULT_NAME
    targets = [results.DATA_DIR / f"{name}.csv", results.DATA_DIR / f"{name}_scaling.csv"]
    if not args.overwrite and any(t.exists() for t in targets):
        print(
            f"error: {targets[0].name} exists; pass --overwrite (make reference OVERWRITE=1) to replace "
            f"the reference",
            file=sys.stderr,
        )
        return 2
    try:
        folders.check_folder(results.DATA_DIR, "data folder", "make data/ writable")
        out = run.run_lab(
            args.n_devices,
            args.platform,
            args.profile,
            build="build/reference",
            extra={"scaling": True},  # the reference records the scaling sweep too
            progress=False,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except run.NotebookFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    write(out, targets, settings)
    return 0


def write(out: Path, targets: list[Path], settings: tuple[str, str, str]) -> None:
    """Copy the run's results and scaling CSVs to ``targets`` with a header saying how, when and of which
    commit they were recorded; each file is replaced atomically."""
    n, platform, profile = settings
    command = (
        f"python tools/make_reference.py --n-devices {n} --platform {platform} --profile {profile}"
    )
    stamp = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    version = folders.source_version()
    commit = (version["commit"] or "unknown")[:12] + (
        " with uncommitted changes" if version["dirty"] else ""
    )
    for src, dst in zip((results.RESULTS_FILE, results.SCALING_FILE), targets, strict=True):
        body = (Path(out) / src).read_text()
        header = (
            f"# Reference lab run MEASURED by this project: {command}\n# recorded {stamp}; commit {commit}; "
            f"lab run {out.name}; hardware and versions are in the columns (platform, device_kind, "
            f"simulated, host_cpus, cpu_model, jax_version).\n"
        )
        again = dst.exists()
        folders.write_atomic(dst, header + body)
        print(f"wrote {dst}" + (" (replaced the earlier reference file)" if again else ""))


if __name__ == "__main__":
    sys.exit(main())

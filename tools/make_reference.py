"""Record a reference lab run in data/: run the lab with papermill and copy its results with a provenance header.

    python tools/make_reference.py [--n-devices 8] [--platform cpu] [--name reference_cpu_8sim]

Writes data/<name>.csv (one row per strategy) and data/<name>_scaling.csv (the scaling sweep). Refuses to
replace existing files unless --overwrite is given.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

from course_tools import results, run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-devices", default="8")
    ap.add_argument("--platform", default="cpu")
    ap.add_argument("--profile", default="auto")
    ap.add_argument("--name", default="reference_cpu_8sim")
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args()
    targets = [results.DATA_DIR / f"{args.name}.csv", results.DATA_DIR / f"{args.name}_scaling.csv"]
    if not args.overwrite and any(t.exists() for t in targets):
        print(
            f"error: {targets[0].name} exists; pass --overwrite to replace the reference",
            file=sys.stderr,
        )
        return 2
    out = run.run_lab(
        args.n_devices,
        args.platform,
        args.profile,
        build="build/reference",
        extra={"scaling": True},  # the reference records the scaling sweep too
        progress=False,
    )
    command = (
        f"python tools/make_reference.py --n-devices {args.n_devices} --platform {args.platform} "
        f"--profile {args.profile}"
    )
    stamp = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    for src, dst in zip((results.RESULTS_FILE, results.SCALING_FILE), targets, strict=True):
        body = (Path(out) / src).read_text()
        header = (
            f"# Reference lab run MEASURED by this project: {command}\n# recorded {stamp}; hardware and versions "
            f"are in the columns (platform, device_kind, simulated, host_cpus, cpu_model, jax_version).\n"
        )
        dst.write_text(header + body)
        print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compile the course's parallel programs for an 8-chip TPU slice from a host with one chip, and read them.

    python tools/tpu_programs.py --out DIR [--topology v5e:2x4] [--profile cpu] [--only NAME ...]
    python tools/tpu_programs.py --out DIR --cpu        # the same programs on 8 simulated CPU devices

On a TPU host (libtpu present) every program of ``course_lib.aot_programs.PROGRAMS`` (lab 08's strategies,
lesson 10's splits, lab 12's layouts) is compiled for the compile-only devices of ``--topology``: XLA:TPU's
program for 8 chips, nothing placed or run. With ``--cpu`` the same programs are compiled for 8 simulated CPU
devices (XLA:CPU), as the tests do. Writes ``DIR/programs.json`` (every program's collectives with their
dtypes, bytes, axes, async pairs and loop placement, ``memory_analysis()`` and ``cost_analysis()``; a program
that fails records its error) and ``DIR/hlo/<name>.txt.gz``. The TPU output is kept in
``data/tpu_reference/programs/`` (``course_lib.aot.REFERENCE_DIR``), which the notebooks read.
Exit status: 0 every program compiled, 1 some failed (recorded in the JSON), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform as _platform
import sys
import time


def _meta(args, devs, started: float) -> dict:
    import jax
    import jaxlib

    meta = {
        "platform": devs[0].platform,
        "device_kind": devs[0].device_kind,
        "topology": None if args.cpu else args.topology,
        "n_devices": len(devs),
        # the chips of the host that compiled (one v5e chip compiles for the 8 of a 2x4 slice)
        "host_devices": len(jax.devices()),
        "profile": args.profile,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": _platform.python_version(),
        "recorded": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": "python tools/tpu_programs.py " + " ".join(sys.argv[1:]),
        "total_s": round(time.perf_counter() - started, 1),
    }
    try:
        from importlib.metadata import version

        meta["libtpu"] = version("libtpu")
    except Exception:  # noqa: BLE001 - not installed (CPU), or named otherwise
        meta["libtpu"] = None
    return meta


def _report(name: str, summary: dict) -> None:
    kinds = sorted({c["op"] for c in summary.get("collectives") or []})
    if summary["error"]:
        status = "ERROR " + summary["error"][:160]
    else:
        status = f"{summary['compile_s']:6.2f} s {kinds}"
    print(f"{name:32s} {status}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for programs.json and hlo/")
    ap.add_argument("--topology", default="v5e:2x4", help="TPU topology name (default v5e:2x4)")
    ap.add_argument(
        "--cpu", action="store_true", help="8 simulated CPU devices instead of a TPU topology"
    )
    ap.add_argument(
        "--profile", default="cpu", help="lab 08's CNN size: cpu (default), tiny or gpu"
    )
    ap.add_argument("--only", nargs="*", help="program names (default: all)")
    ap.add_argument(
        "--jobs", type=int, default=4, help="programs compiled at once (threads; default 4)"
    )
    args = ap.parse_args(argv)
    started = time.perf_counter()
    if args.cpu:  # before JAX starts: 8 simulated devices
        from course_lib.devices import setup_devices

        setup_devices(8, "cpu")
    from course_lib import aot, aot_programs
    from course_lib.config import PROFILES

    if args.profile not in PROFILES:
        print(f"error: --profile {args.profile!r} is not one of {list(PROFILES)}", file=sys.stderr)
        return 2
    unknown = [n for n in args.only or () if n not in aot_programs.PROGRAMS]
    if unknown:
        print(
            f"error: unknown programs {unknown}; choose from {list(aot_programs.PROGRAMS)}",
            file=sys.stderr,
        )
        return 2
    topology = None if args.cpu else args.topology
    devs = aot.devices(topology)
    names = args.only or list(aot_programs.PROGRAMS)
    results = aot.compile_all(
        devs, names, profile=args.profile, topology=topology, jobs=args.jobs, on_done=_report
    )
    path = aot.write(results, args.out, _meta(args, devs, started))
    failed = [n for n, (s, _) in results.items() if s["error"]]
    hlo_bytes = sum(f.stat().st_size for f in (path.parent / "hlo").glob("*.txt.gz"))
    print(
        f"wrote {path} ({len(results)} programs, {len(failed)} failed: {failed}; HLO "
        f"{hlo_bytes / 1e6:.2f} MB gzipped) in {time.perf_counter() - started:.0f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

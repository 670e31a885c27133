"""Measure the course's transformer training step on one chip in bfloat16: step time, MFU, memory.

    python tools/lm_mfu.py --out DIR [--batches 1 2 4 8] [--config gpu] [--remat both|on|off]
                           [--steps 5] [--warmup 2]

Runs :func:`course_lib.lm_mfu.sweep` on the first device JAX sees (a TPU host: one TPU v5e chip) at the
``gpu`` size (0.94 B parameters, sequence 2048) for each batch, with and without ``jax.checkpoint`` per block
(a batch that does not fit ends that setting's batches), then times a 4096 × 4096 bfloat16 matmul
(:func:`course_lib.measure.matmul_ceiling`) on the same chip for comparison (not on a CPU). Writes
``DIR/mfu.csv``: one row per run with the columns of :data:`course_lib.lm_mfu.FIELDS` plus ``ceiling_flops``,
``libtpu``, ``python`` and ``command``. The TPU run is committed as ``data/tpu_reference/lm_mfu/mfu.csv``
(``course_lib.lm_mfu.REFERENCE_CSV``), which ``notebooks/12_transformer_lab.ipynb`` reads.
``tools/tpu_check.sh --steps mfu`` runs it; its ``--rehearse`` runs it at ``--config tiny`` on a CPU.
Exit status: 0 at least one run fitted and was timed, 1 none did, 2 bad arguments or an existing mfu.csv.
"""

from __future__ import annotations

import argparse
import csv
import platform as _platform
import sys
from pathlib import Path


def _libtpu() -> str | None:
    try:
        from importlib.metadata import version

        return version("libtpu")
    except Exception:  # noqa: BLE001 - not installed (CPU, GPU), or named otherwise
        return None


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", required=True, help="folder for mfu.csv (created; mfu.csv must not exist)"
    )
    parser.add_argument(
        "--batches", type=int, nargs="+", default=[1, 2, 4, 8], help="sequences per step"
    )
    parser.add_argument("--config", default="gpu", help="a key of course_lib.transformer.CONFIGS")
    parser.add_argument("--remat", choices=("both", "on", "off"), default="both")
    parser.add_argument(
        "--steps", type=int, default=5, help="timed steps per run (the median is kept)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    args = parser.parse_args(argv)
    if any(b <= 0 for b in args.batches):
        parser.error(f"--batches {args.batches}: every batch must be a positive integer")
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps {args.steps} must be >= 1 and --warmup {args.warmup} >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = Path(args.out)
    if (out / "mfu.csv").exists():
        print(
            f"{out / 'mfu.csv'} exists: a measurement is never overwritten; name another --out",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # course_lib, run from anywhere
    import jax

    from course_lib import lm_mfu
    from course_lib import measure as measure_lib

    try:
        lm_mfu.resolve_config(args.config)
    except ValueError as error:
        print(f"--config: {error}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0]
    print(
        f"{device.platform} {device.device_kind}, jax {jax.__version__}, libtpu {_libtpu()}",
        flush=True,
    )
    remats = {"both": (True, False), "on": (True,), "off": (False,)}[args.remat]
    rows = lm_mfu.sweep(
        args.config,
        device,
        tuple(args.batches),
        remats,
        steps=args.steps,
        warmup=args.warmup,
        log=lambda line: print(line, flush=True),
    )
    ceiling = None if device.platform == "cpu" else measure_lib.matmul_ceiling(device)
    if ceiling is not None:
        print(f"matmul ceiling (4096 x 4096 bfloat16): {ceiling / 1e12:.1f} TFLOP/s", flush=True)
    extra = {
        "ceiling_flops": ceiling,
        "libtpu": _libtpu(),
        "python": _platform.python_version(),
        "command": "python tools/lm_mfu.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    with open(out / "mfu.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=[*lm_mfu.FIELDS, *extra])
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, **extra})
    print(f"wrote {out / 'mfu.csv'} ({len(rows)} rows)")
    return 0 if any(r["fits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

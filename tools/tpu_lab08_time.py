"""Lab 08's time model against one TPU chip: strategy A's predicted step beside its measured median.

Run on the TPU host from the repository root (one chip):

    python tools/tpu_lab08_time.py                              # bfloat16, batch 256 (the lab's fitted batch)
    python tools/tpu_lab08_time.py --precision float32 --batch 512

It trains A (``jax.jit`` on one chip) at the gpu profile (128 × 128 × 3 images), then prints the model's
terms read from the compiled program — compute = FLOPs ÷ peak, memory = ``bytes accessed`` ÷ HBM bandwidth,
their maximum (the roofline) — the measured median step, the error, and the narrow-matmul estimate
(:func:`course_lib.lab_time.narrow_matmul_s`). It asserts only what no chip can break: the measured step is
not shorter than 0.9 × FLOPs ÷ peak. Nothing here runs in CI (no accelerator there).
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", default="bfloat16", help="float32 or bfloat16")
    ap.add_argument("--batch", type=int, default=256, help="global batch (one chip)")
    ap.add_argument(
        "--platform", default="tpu", help="tpu; cpu only to try the script (a prediction)"
    )
    args = ap.parse_args()

    from course_lib.devices import setup_devices

    report = setup_devices(1, args.platform)
    from course_lib import lab, lab_time
    from course_lib.config import resolve_profile

    config = resolve_profile("gpu", args.platform, global_batch=args.batch)
    row = lab.run_strategy("jit", report.devices[:1], config, report=report, precision=args.precision,
                           progress=False).row  # fmt: skip
    peak = row["flops_per_device"] / row["model_compute_s"]
    mxu = 256 if "v6" in report.device_kind else 128
    narrow = lab_time.narrow_matmul_s(config.model, args.batch, peak, mxu)
    for key in ("model_fabric", "model_is_prediction", "flops_per_device", "bytes_accessed_per_device",
                "model_flops_per_step", "model_compute_s", "model_memory_s", "model_roofline_s",
                "model_bound", "step_time_s", "step_time_iqr_s", "model_error", "mfu"):  # fmt: skip
        print(f"{key:28s} {row[key]}")
    print(f"{'narrow-matmul estimate s':28s} {narrow}")
    print(f"{'max(narrow, memory) s':28s} {max(narrow, row['model_memory_s'])}")
    if args.platform != "cpu":
        assert not row["model_is_prediction"], "not on a chip of the fabrics' table"
        assert row["step_time_s"] >= 0.9 * row["model_compute_s"]  # no chip beats its peak


if __name__ == "__main__":
    main()

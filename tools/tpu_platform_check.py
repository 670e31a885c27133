"""Check the platform work on a real chip: the device report, the batch the lab fits, MFU and its ceiling.

Run on the TPU host from the repository root (one chip is enough):

    python tools/tpu_platform_check.py                 # report, fitted batches, ceiling, A's MFU
    python tools/tpu_platform_check.py --no-train      # without training A (about a minute less)

It prints what each step found and asserts what the course claims: the report names the chip from
``course_lib.chips`` with its ``bytes_limit``; ``platform="tpu"`` gives TPU devices; asking for more chips
than exist names the fix; the lab's fitted batch for bfloat16 is at most the article's 512 and its estimate
fits; a 4096² bf16 matmul stays under the bf16 peak; A's MFU at the fitted batch is in (0, 1]. Nothing here
runs in CI (no accelerator there).
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-train", action="store_true", help="skip training A at the fitted batch")
    ap.add_argument(
        "--precision", default="bfloat16", help="the lab's precision for the fit and A's run"
    )
    args = ap.parse_args()

    from course_lib.devices import DeviceSetupError, select_devices, setup_devices

    report = setup_devices(1, "tpu")
    print(report, flush=True)
    assert report.platform == "tpu" and not report.simulated
    assert report.chip is not None, f"{report.device_kind!r} is not in course_lib.chips.PEAKS"
    assert report.bytes_limit and report.bytes_limit <= 1.05 * report.chip.hbm_bytes
    print("as_dict:", {k: v for k, v in report.as_dict().items() if k != "devices"}, flush=True)
    import jax

    try:
        select_devices(len(jax.devices()) + 1, jax.devices(), "tpu")
    except DeviceSetupError as e:
        print("too many chips ->", e, flush=True)
        assert "platform='cpu'" in str(e)

    from course_lib import costs, lab, measure, sizing
    from course_lib.config import resolve_profile

    fitted = {}
    for precision in (args.precision, "float32"):
        config = resolve_profile("auto", report.platform, n_devices=report.n_devices)
        t0 = time.perf_counter()
        cfg, tried = sizing.fit_global_batch(
            config, report.devices, precision, simulated=False, chip=report.device_kind
        )
        fitted[precision] = cfg
        print(
            f"{precision}: fitted global batch {cfg.global_batch} in {time.perf_counter() - t0:.1f} s "
            f"(tried {[e.global_batch for e in tried]})",
            flush=True,
        )
        assert tried[-1].fits and cfg.global_batch <= 512

    ceiling = measure.matmul_ceiling(report.devices[0])
    peak = report.chip.peak_bf16_flops_per_s
    print(
        f"matmul ceiling {ceiling / 1e12:.1f} TFLOP/s = {ceiling / peak:.0%} of {peak / 1e12:.0f}",
        flush=True,
    )
    assert 0 < ceiling <= 1.05 * peak

    if not args.no_train:
        cfg = fitted[args.precision]
        run = lab.run_strategy(
            "jit", report.devices, cfg, report=report, precision=args.precision, progress=False
        )
        r = run.row
        print(
            f"A at batch {cfg.global_batch}, {args.precision}: median step {r['step_time_s'] * 1e3:.2f} ms, "
            f"{r['model_flops_per_step'] / 1e9:.1f} GFLOP -> MFU {r['mfu']:.1%} "
            f"(peak {r['peak_flops_per_device'] / 1e12:.0f} TFLOP/s), HFU {r['hfu']:.1%}",
            flush=True,
        )
        assert 0 < r["mfu"] <= r["hfu"] <= 1
        print(
            "peak rate used:", costs.peak_flops(report.device_kind, args.precision)[0], flush=True
        )


if __name__ == "__main__":
    main()

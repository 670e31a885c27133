"""Benchmark: step time of each strategy relative to single-device jit, and parameter bytes per device.

Runs on 8 simulated CPU devices (or --n-devices N) at the lab's CPU profile, in rounds that alternate the
strategies (so that load from elsewhere on the machine hits them alike), and prints the median over rounds
of each strategy's median step time. On simulated devices these are relative costs of the parallel
machinery on one machine, not speedups.

    python tools/bench_strategies.py [--n-devices 8] [--rounds 3] [--steps 12]
"""

from __future__ import annotations

import argparse
import statistics
import time

from course_lib.devices import PLATFORMS, setup_devices


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-devices", default="8")
    ap.add_argument("--platform", default="cpu", choices=PLATFORMS)
    ap.add_argument("--profile", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    report = setup_devices(args.n_devices, args.platform)
    print(report, flush=True)

    from course_lib import lab, strategies
    from course_lib.config import resolve_profile

    config = resolve_profile(args.profile, report.platform, steps=args.steps)
    print(
        f"profile {config.name}: images {config.image_size}x{config.image_size}x3, global batch {config.global_batch}, "
        f"{config.steps} steps ({config.warmup} warm-up), {args.rounds} rounds",
        flush=True,
    )
    medians: dict[str, list[float]] = {k: [] for k in strategies.STRATEGIES}
    rows = {}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for key in strategies.STRATEGIES:
            run = lab.run_strategy(key, report.devices, config, report=report, progress=False)
            medians[key].append(run.row["step_time_s"])
            rows[key] = run.row
        print(
            f"round {r + 1}: " + "  ".join(f"{k} {medians[k][-1] * 1e3:.1f} ms" for k in medians),
            flush=True,
        )
    base = statistics.median(medians["jit"])
    limits = {"pmap": 1.15, "sharded_jit": 1.15, "shard_map": 1.3}
    kind = "relative (simulated devices)" if report.simulated else "measured"
    print(f"\nmedian step time over rounds, {kind}:")
    print(
        f"{'strategy':12s} {'mesh':20s} {'step ms':>9s} {'x A':>6s} {'limit':>6s} "
        f"{'param bytes/device':>19s} {'collectives'}"
    )
    ok = True
    for key in strategies.STRATEGIES:
        m = statistics.median(medians[key])
        ratio = m / base
        lim = limits.get(key)
        ok &= lim is None or ratio <= lim
        print(
            f"{key:12s} {rows[key]['mesh']:20s} {m * 1e3:9.2f} {ratio:6.2f} {('<=' + str(lim)) if lim else '':>6s} "
            f"{rows[key]['param_bytes_per_device']:19,d} {rows[key]['collectives']}"
        )
    c_lt_b = rows["shard_map"]["param_bytes_per_device"] < rows["pmap"]["param_bytes_per_device"]
    print(f"\nC's parameter bytes per device below B's: {c_lt_b}")
    print(f"all step-time ratios within their limits: {ok}")
    print(f"benchmark took {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

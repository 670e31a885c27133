"""The capstone lab: profiles, one training run per strategy, and a scaling sweep.

``notebooks/08_lab.ipynb`` drives these functions; each returns plain rows (dicts) that
:mod:`course_tools.results` writes and :mod:`course_lib.plots` draws.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import platform as _platform
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from . import data as data_lib
from . import measure, parallel
from . import strategies as strategies_lib
from .config import LabConfig, init_run
from .steps import init_state, make_optimizer


def check_divisibility(
    config: LabConfig, n_devices: int, keys: Sequence[str] = strategies_lib.STRATEGIES
) -> None:
    """Fail fast, before anything runs, when a strategy cannot split ``config.global_batch`` on ``n_devices``.

    Raises:
      ValueError: naming the strategy that splits the batch into the most pieces among those that cannot
        (the strictest requirement), the batch, the shard count and a valid batch.
    """
    shards_of = {key: strategies_lib.data_shards(key, n_devices) for key in keys}
    for key, shards in sorted(shards_of.items(), key=lambda item: -item[1]):
        try:
            data_lib.check_divisible(config.global_batch, shards, "global batch")
        except ValueError as e:
            raise ValueError(
                f"strategy {key!r} on {n_devices} devices: {e} (set the global_batch parameter)"
            ) from None


SCALING_STRATEGIES = tuple(k for k, info in strategies_lib.REGISTRY.items() if info.scaling)
"""The strategies of the scaling sweep: B, C and D (A runs on one device only)."""


@dataclasses.dataclass
class StrategyRun:
    """The outcome of :func:`run_strategy`.

    Attributes:
      row: one results row (the columns of ``lab_results.csv``).
      losses: float loss per step, the global-batch mean before each update.
      step_times_s: seconds per step, every step (the first ``warmup`` included).
      params: final parameters as one global numpy copy, for parity checks.
      stats: the compiled program's :class:`course_lib.measure.CompiledStats`.
    """

    row: dict
    losses: list
    step_times_s: list
    params: Any
    stats: measure.CompiledStats


def run_strategy(
    key: str,
    devices: Sequence[Any],
    config: LabConfig,
    *,
    report: Any = None,
    seed: int = 0,
    steps: int | None = None,
    progress: bool = True,
) -> StrategyRun:
    """Train the CNN with strategy ``key`` on ``devices`` and measure it.

    Every call with the same ``config`` and ``seed`` starts from the same parameters and sees the same
    global batches, whatever the strategy or device count.

    Args:
      key: a key of :data:`course_lib.strategies.REGISTRY`.
      devices: devices to use (``report.devices`` or a prefix of it).
      config: the lab profile (:data:`course_lib.config.PROFILES`).
      report: the :class:`course_lib.devices.DeviceReport`, for the metadata columns.
      seed: fixes initial parameters and data (:func:`course_lib.config.init_run`).
      steps: overrides ``config.steps`` (the scaling sweep uses ``config.scaling_steps``).
      progress: show a tqdm progress bar.

    Raises:
      ValueError: the global batch is not divisible by the strategy's data shards (numbers named).
    """
    steps = config.steps if steps is None else steps
    warmup = min(config.warmup, steps - 1)
    start = init_run(config, seed)
    optimizer = make_optimizer(config.learning_rate)
    strat = strategies_lib.build(key, start.graphdef, start.params, optimizer, devices)
    state = strat.place_state(init_state(start.params, optimizer))
    batches = strat.batches(start.dataset, start.data_key, steps, config.global_batch)
    compiled, stats = measure.compile_and_analyse(lambda: strat.lower(state, batches[0]))

    desc = f"{strat.label} on {strat.n_devices} device(s)" if progress else None
    state, losses, times = _train(compiled, state, batches, desc)
    timing = measure.Timing.from_samples(times[warmup:])
    n = strat.n_devices
    flops_per_step = stats.flops_per_device * n
    row = {
        "strategy": key,
        "label": strat.label,
        "n_devices": n,
        "mesh": strat.mesh,
        "profile": config.name,
        "global_batch": config.global_batch,
        "image_size": config.image_size,
        "steps": steps,
        "step_time_s": timing.median_s,
        "step_time_iqr_s": timing.iqr_s,
        "step_time_min_s": timing.min_s,
        "samples_per_s": config.global_batch / timing.median_s,
        "compile_s": stats.compile_s,
        "bytes_per_device": stats.bytes_per_device,
        "param_bytes_per_device": parallel.bytes_per_device(state.params),
        "peak_device_bytes": measure.peak_device_memory(list(devices)[:n]),
        "flops_per_step": flops_per_step,
        "flops_per_device": stats.flops_per_device,
        "achieved_flops_per_s": flops_per_step / timing.median_s,
        "collectives": stats.collectives_str(),
        "final_loss": losses[-1],
        **_metadata(report, devices),
    }
    return StrategyRun(
        row=row, losses=losses, step_times_s=times, params=strat.host_params(state), stats=stats
    )


def _train(compiled, state, batches, desc: str | None) -> tuple[Any, list[float], list[float]]:
    """Run every batch through the compiled step, timing each step to completion (``block_until_ready``)."""
    losses_dev, times = [], []
    iterator = range(len(batches))
    if desc is not None:
        from tqdm.auto import tqdm

        iterator = tqdm(iterator, desc=desc, leave=False)
    for i in iterator:
        t0 = time.perf_counter()
        state, metrics = compiled(state, batches[i])
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
        losses_dev.append(metrics["loss"])
    losses = [float(np.asarray(x).ravel()[0]) for x in losses_dev]  # pmap: one copy per device
    return state, losses, times


def _metadata(report: Any, devices: Sequence[Any]) -> dict:
    d0 = list(devices)[0]
    return {
        "host_cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "platform": d0.platform if report is None else report.platform,
        "device_kind": d0.device_kind,
        "simulated": (d0.platform == "cpu") if report is None else report.simulated,
        "jax_version": jax.__version__,
        "timestamp": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or "unknown"


def scaling_sweep(
    devices: Sequence[Any],
    config: LabConfig,
    keys: Sequence[str] | None = None,
    counts: Sequence[int] | None = None,
    *,
    report: Any = None,
    seed: int = 0,
    progress: bool = True,
) -> list[dict]:
    """Throughput of each strategy on 1, 2, 4, … of ``devices`` at the same global batch (strong scaling).

    Counts whose data shards do not divide the global batch are skipped with a printed note.

    Args:
      keys: the strategies; default those the registry marks for the sweep (:data:`SCALING_STRATEGIES`).

    Returns:
      One row per (strategy, device count), with the columns of ``lab_results.csv``.
    """
    from .devices import device_subsets

    keys = SCALING_STRATEGIES if keys is None else tuple(keys)
    counts = list(counts) if counts is not None else device_subsets(devices)
    jobs = [(k, n) for n in counts for k in keys]
    rows = []
    iterator = jobs
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(jobs, desc="scaling sweep")
    for key, n in iterator:
        shards = strategies_lib.data_shards(key, n)
        if config.global_batch % shards:
            print(
                f"skipped {key} on {n} devices: global batch {config.global_batch} is not divisible by "
                f"{shards} data shards"
            )
            continue
        run = run_strategy(
            key,
            list(devices)[:n],
            config,
            report=report,
            seed=seed,
            steps=config.scaling_steps,
            progress=False,
        )
        rows.append(run.row)
    return rows

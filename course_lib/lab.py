"""The capstone lab: profiles, one training run per strategy, and a scaling sweep.

``notebooks/08_lab.ipynb`` drives these functions; each returns plain rows (dicts) that
:mod:`course_tools.results` writes and :mod:`course_lib.plots` draws.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import os
import platform as _platform
import time
from typing import Any, Sequence

import jax
import numpy as np

from . import data as data_lib
from . import measure
from . import model as model_lib
from . import parallel
from . import strategies as strategies_lib
from .steps import init_state, make_optimizer


@dataclasses.dataclass(frozen=True)
class LabConfig:
    """One lab setting.

    Attributes:
      name: profile name (recorded in results).
      image_size: pixels per side of the synthetic images.
      global_batch: images per step over all devices (the source article: 512).
      steps: training steps per strategy; the first ``warmup`` are not timed.
      warmup: untimed steps after compilation.
      learning_rate: SGD step size (momentum 0.9), the same for every strategy.
      channels, hidden: CNN shape (:class:`course_lib.model.CNNConfig`).
      scaling_steps: steps per run in the scaling sweep (short: it measures throughput only).
      signal: class-prototype amplitude of the synthetic data (:class:`course_lib.data.SyntheticImages`).
    """

    name: str
    image_size: int
    global_batch: int
    steps: int
    warmup: int = 2
    learning_rate: float = 0.01
    channels: tuple[int, int, int] = (32, 64, 64)
    hidden: int = 128
    scaling_steps: int = 8
    signal: float = 1.0

    def model_config(self) -> model_lib.CNNConfig:
        """The CNN shape of this profile."""
        return model_lib.CNNConfig(image_size=self.image_size, channels=self.channels, hidden=self.hidden)


PROFILES = {
    # Sized for a 2-core laptop or CI runner with 8 simulated devices: the whole lab in well under 2 minutes.
    "cpu": LabConfig("cpu", image_size=32, global_batch=64, steps=20),
    # The source article's setting: 128 x 128 x 3 images, global batch 512 (8 x 64 per device).
    "gpu": LabConfig("gpu", image_size=128, global_batch=512, steps=50, warmup=3, scaling_steps=12),
    # For tests and quick papermill checks.
    "tiny": LabConfig("tiny", image_size=16, global_batch=32, steps=6, channels=(8, 16, 16), hidden=32, scaling_steps=4),
}


def resolve_profile(profile: str, platform: str, steps: Any = None, global_batch: Any = None,
                    n_devices: int | None = None) -> LabConfig:
    """Pick a :class:`LabConfig`: ``"auto"`` → ``"gpu"`` on a GPU backend, else ``"cpu"``.

    With ``n_devices`` and no ``global_batch`` of the reader's, the profile's batch is rounded up to a
    multiple of every device count the lab uses (1, 2, 4, …, n), so that 3, 5, 6 or 7 devices work too:
    e.g. 64 → 66 on 3 devices, 72 on 6 (a printed note says so). A batch the reader gave is never changed.

    Args:
      profile: ``"auto"``, ``"cpu"``, ``"gpu"`` or ``"tiny"``.
      platform: ``report.platform`` (``"cpu"`` or ``"gpu"``).
      steps: overrides the profile's steps when given (None or 0 keeps it); ints or decimal strings.
      global_batch: overrides the profile's global batch likewise.
      n_devices: the device count, to fit the default batch to it.

    Raises:
      ValueError: unknown profile, or steps / global_batch that are not positive integers, or steps not
        greater than the warm-up.
    """
    key = str(profile).strip().lower()
    if key == "auto":
        key = "gpu" if platform == "gpu" else "cpu"
    if key not in PROFILES:
        raise ValueError(f"profile={profile!r} is not one of {['auto', *PROFILES]}")
    cfg = PROFILES[key]
    changes = {}
    for name, value in (("steps", steps), ("global_batch", global_batch)):
        if value is None or value == 0 or value == "0" or value == "":
            continue
        changes[name] = _positive_int(value, name)
    cfg = dataclasses.replace(cfg, **changes)
    if n_devices is not None and "global_batch" not in changes:
        from .devices import device_subsets

        multiple = math.lcm(*device_subsets(range(n_devices)))
        fitted = -(-cfg.global_batch // multiple) * multiple
        if fitted != cfg.global_batch:
            print(f"note: global batch {cfg.global_batch} -> {fitted}, a multiple of {multiple}, so that "
                  f"{n_devices} devices (and the scaling sweep's {device_subsets(range(n_devices))}) split it evenly")
            cfg = dataclasses.replace(cfg, global_batch=fitted)
    if cfg.steps <= cfg.warmup:
        raise ValueError(
            f"steps={cfg.steps} must exceed the {cfg.warmup} warm-up steps of profile {key!r}; use steps >= {cfg.warmup + 1}"
        )
    return cfg


def parse_bool(value: Any, name: str) -> bool:
    """A yes/no parameter: True/False, 1/0, or the strings "true"/"false"/"yes"/"no"/"1"/"0" (papermill ``-r``
    passes strings, and ``bool("False")`` is True).

    Raises:
      ValueError: anything else, naming the parameter and the value.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.strip().lower() in ("true", "yes", "1")
    raise ValueError(f"{name}={value!r} is not a yes/no value; use True or False")


def parse_seed(seed: Any) -> int:
    """A PRNG seed: a non-negative integer, or its decimal string (papermill ``-r``).

    Raises:
      ValueError: anything else, naming the value.
    """
    if isinstance(seed, str) and seed.strip().isdigit():
        return int(seed)
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) and seed >= 0:
        return int(seed)
    raise ValueError(f"seed={seed!r} must be a non-negative integer, e.g. 0")


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be a positive integer")
    if isinstance(value, str):
        if not value.strip().isdigit():
            raise ValueError(f"{name}={value!r} is not a positive integer")
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return int(value)


def check_divisibility(config: LabConfig, n_devices: int, keys: Sequence[str] = strategies_lib.STRATEGIES) -> None:
    """Fail fast, before anything runs, when a strategy cannot split ``config.global_batch`` on ``n_devices``.

    Raises:
      ValueError: naming the strategy, the batch, the shard count and a valid batch.
    """
    for key in keys:
        shards = strategies_lib.data_shards(key, n_devices)
        try:
            data_lib.check_divisible(config.global_batch, shards, "global batch")
        except ValueError as e:
            raise ValueError(f"strategy {key!r} on {n_devices} devices: {e} (set the global_batch parameter)") from None


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
      key: one of :data:`course_lib.strategies.STRATEGIES` (or ``"shard_map_article"``).
      devices: devices to use (``report.devices`` or a prefix of it).
      config: the lab profile.
      report: the :class:`course_lib.devices.DeviceReport`, for the metadata columns.
      seed: fixes initial parameters (key ``seed``) and data (key ``seed + 1``).
      steps: overrides ``config.steps`` (the scaling sweep uses ``config.scaling_steps``).
      progress: show a tqdm progress bar.

    Raises:
      ValueError: the global batch is not divisible by the strategy's data shards (numbers named).
    """
    steps = config.steps if steps is None else steps
    warmup = min(config.warmup, steps - 1)
    mcfg = config.model_config()
    graphdef, params = model_lib.init_model(jax.random.key(seed), mcfg)
    optimizer = make_optimizer(config.learning_rate)
    ds = data_lib.SyntheticImages(image_size=config.image_size, num_classes=mcfg.num_classes, signal=config.signal)
    strat = strategies_lib.build(key, graphdef, params, optimizer, devices)
    state = strat.place_state(init_state(params, optimizer))
    batches = strat.batches(ds, jax.random.key(seed + 1), steps, config.global_batch)
    compiled, stats = measure.compile_and_analyse(lambda: strat.lower(state, batches[0]))

    losses_dev, times = [], []
    iterator = range(steps)
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(iterator, desc=f"{strat.label} on {strat.n_devices} device(s)", leave=False)
    for i in iterator:
        t0 = time.perf_counter()
        state, metrics = compiled(state, batches[i])
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
        losses_dev.append(metrics["loss"])
    losses = [float(np.asarray(x).ravel()[0]) for x in losses_dev]  # pmap returns one copy per device
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
    return StrategyRun(row=row, losses=losses, step_times_s=times, params=strat.host_params(state), stats=stats)


def _metadata(report: Any, devices: Sequence[Any]) -> dict:
    d0 = list(devices)[0]
    return {
        "host_cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "platform": d0.platform if report is None else report.platform,
        "device_kind": d0.device_kind,
        "simulated": (d0.platform == "cpu") if report is None else report.simulated,
        "jax_version": jax.__version__,
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
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
    keys: Sequence[str] = ("pmap", "shard_map", "sharded_jit"),
    counts: Sequence[int] | None = None,
    *,
    report: Any = None,
    seed: int = 0,
    progress: bool = True,
) -> list[dict]:
    """Throughput of each strategy on 1, 2, 4, … of ``devices`` at the same global batch (strong scaling).

    Counts whose data shards do not divide the global batch are skipped with a printed note.

    Returns:
      One row per (strategy, device count), with the columns of ``lab_results.csv``.
    """
    from .devices import device_subsets

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
            print(f"skipped {key} on {n} devices: global batch {config.global_batch} is not divisible by {shards} data shards")
            continue
        run = run_strategy(
            key, list(devices)[:n], config, report=report, seed=seed, steps=config.scaling_steps, progress=False
        )
        rows.append(run.row)
    return rows

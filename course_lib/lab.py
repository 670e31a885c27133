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

from . import comms, costs, lab_time, measure, parallel
from . import data as data_lib
from . import precision as precision_lib
from . import strategies as strategies_lib
from .builders import RemadeBatches
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


repeat_steps = lab_time.repeat_steps  # the timed loop of sections 6.1 and 6.5 (lab_time)

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
      stats: the compiled program's :class:`course_lib.measure.CompiledStats` (its collectives sized).
      predicted: the collectives predicted from shapes (:func:`course_lib.strategies.predict_comm`);
        None for a strategy whose collectives are the compiler's choice.
      strategy: the built :class:`course_lib.strategies.Strategy`.
      compiled: its compiled step, to run it again (one-step parity, :func:`course_lib.parity.one_step`).
      batches: the run's batches, in the strategy's layout: a :class:`RemadeBatches`, which makes batch
        ``i`` again when read (the run's device copies are dropped when it ends).
      states: with ``keep_states=True``: the state before every step and after the last, as host copies
        (``len(states) == steps + 1``); else None.
    """

    row: dict
    losses: list
    step_times_s: list
    params: Any
    stats: measure.CompiledStats
    predicted: list | None = None
    strategy: Any = None
    compiled: Any = None
    batches: Sequence | None = None
    states: list | None = None


def _devices_platform(devices: Sequence[Any]) -> str | None:
    """The devices' platform (``"cpu"``, ``"tpu"``, ...), None for none: where a precision must run."""
    return getattr(devices[0], "platform", None) if len(devices) else None


def run_strategy(
    key: str,
    devices: Sequence[Any],
    config: LabConfig,
    *,
    report: Any = None,
    seed: int = 0,
    steps: int | None = None,
    progress: bool = True,
    precision: str = "float32",
    mesh_shape: tuple[int, int] | None = None,
    keep_states: bool = False,
    perturb: Any = None,
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
      precision: ``"float32"``, ``"float64"`` or ``"bfloat16"`` (:mod:`course_lib.precision`).
      mesh_shape: ``(n_data, n_model)`` for the ``data_model`` strategies.
      keep_states: keep a host copy of the state before every step (``StrategyRun.states``).
      perturb: optional ``params -> params`` applied to the initial parameters (e.g.
        :func:`course_lib.parity.nudge`).

    Raises:
      ValueError: the global batch is not divisible by the strategy's data shards (numbers named), an
        unknown precision, or ``"float64"`` on a TPU (:func:`course_lib.precision.check_runs`).
    """
    steps = config.steps if steps is None else steps
    warmup = min(config.warmup, steps - 1)
    precision_lib.check_runs(precision, _devices_platform(devices))
    with precision_lib.enabled(precision):
        before = measure.allocator_snapshot(
            list(devices)
        )  # this run's own peak is measured from here
        start = init_run(config, seed)
        params = precision_lib.cast_params(start.params, precision)
        params = params if perturb is None else perturb(params)
        optimizer = make_optimizer(config.learning_rate)
        strat = strategies_lib.build(
            key, start.graphdef, params, optimizer, devices, mesh_shape, precision=precision
        )
        state = strat.place_state(
            precision_lib.cast_params(init_state(params, optimizer), precision)
        )
        cast = lambda b: precision_lib.cast_batch(b, precision)  # noqa: E731
        batches = strat.batches(start.dataset, start.data_key, steps, config.global_batch, cast)
        compiled, stats = measure.compile_and_analyse(
            lambda: strat.lower(state, batches[0]), strat.mesh_axes
        )
        desc = f"{strat.label} on {strat.n_devices} device(s)" if progress else None
        state, losses, times, states = _train(compiled, state, batches, desc, keep_states)
        # the device copies go; reading a batch later makes it again (with the run's precision)
        batches = RemadeBatches(
            strat, start.dataset, start.data_key, steps, config.global_batch, precision
        )
        after = measure.allocator_snapshot(list(devices))
        host_params = strat.host_params(state)
    timing = measure.Timing.from_samples(times[warmup:])
    predicted = _predicted(key, config, strat, mesh_shape, precision, report, devices)
    row = _row(
        key, strat, config, steps, timing, stats, state, predicted, precision, report, devices
    )
    row["peak_device_bytes"] = measure.own_peak(before, after)
    row["final_loss"] = losses[-1]
    return StrategyRun(
        row=row, losses=losses, step_times_s=times, params=host_params, stats=stats,
        predicted=predicted, strategy=strat, compiled=compiled, batches=batches, states=states,
    )  # fmt: skip


def lower_strategy(
    key: str,
    devices: Sequence[Any],
    config: LabConfig,
    *,
    graphdef: Any = None,
    params: Any = None,
    seed: int = 0,
    precision: str = "float32",
    global_batch: int | None = None,
    mesh_shape: tuple[int, int] | None = None,
    optimizer: Any = None,
) -> Any:
    """Strategy ``key``'s step lowered for one batch (``jax.stages.Lowered``), nothing run: to read its
    program (e.g. :func:`course_lib.xla_dump.compile_with_dump`) without training.

    The batch is zeros of the right shape, dtype and sharding (the program does not depend on the values).

    Args:
      graphdef, params: the CNN (:func:`course_lib.model.init_model`), to skip making it again; default
        the run's own (:func:`course_lib.config.init_run` with ``seed``).
      global_batch: images of that one batch (default ``config.global_batch``); the program's collectives
        on the gradients do not depend on it.
      optimizer: an optax optimizer (default the lab's SGD with momentum, :func:`course_lib.steps.make_optimizer`),
        e.g. ``optax.adam`` to measure its two moments.

    Raises:
      ValueError: as :func:`run_strategy`.
    """
    precision_lib.check_runs(precision, _devices_platform(devices))
    with precision_lib.enabled(precision):
        if params is None:
            start = init_run(config, seed)
            graphdef, params = start.graphdef, start.params
        params = precision_lib.cast_params(params, precision)
        optimizer = make_optimizer(config.learning_rate) if optimizer is None else optimizer
        strat = strategies_lib.build(
            key, graphdef, params, optimizer, devices, mesh_shape, precision=precision
        )
        state = strat.place_state(
            precision_lib.cast_params(init_state(params, optimizer), precision)
        )
        b, m = global_batch or config.global_batch, config.model
        data_lib.check_divisible(b, strat.global_batch_divisor, "global batch")
        images = np.zeros((b, m.image_size, m.image_size, m.in_channels), np.float32)
        labels = np.zeros((b,), np.int32)
        batch = strat.to_step_batch(jax.device_put((images, labels), strat.batch_sharding))
        return strat.lower(state, precision_lib.cast_batch(batch, precision))


def _predicted(key, config, strat, mesh_shape, precision, report, devices) -> list | None:
    if (
        strategies_lib.info(key).mesh_kind != "single"
        and strategies_lib.info(key).comm_model is None
    ):
        return None
    platform = list(devices)[0].platform if report is None else report.platform
    return strategies_lib.predict_comm(
        key, config.model, config.global_batch, strat.n_devices, mesh_shape,
        precision=precision, platform=platform,
    )  # fmt: skip


def _row(
    key, strat, config, steps, timing, stats, state, predicted, precision, report, devices
) -> dict:
    """The results row of one run: what it did, what it cost, what it holds and sends per device."""
    n = strat.n_devices
    entry = strategies_lib.info(key)
    shape = (mesh_shape_of(strat)) if entry.mesh_kind == "data_model" else (entry.data_shards(n), 1)
    local_batch = config.global_batch // shape[0]
    value_bytes = 8 if precision == "float64" else 4
    act_bytes = 2 if precision == "bfloat16" else value_bytes
    kind = list(devices)[0].device_kind
    peak, _ = costs.peak_flops(kind, precision, precision_lib.matmul_precision())
    flops_per_step = stats.flops_per_device * n
    model_flops = costs.model_flops_per_step(config.model, config.global_batch)
    return {
        "strategy": key,
        "label": strat.label,
        "n_devices": n,
        "mesh": strat.mesh,
        "profile": config.name,
        "precision": precision,
        "matmul_precision": precision_lib.matmul_precision(),
        "global_batch": config.global_batch,
        "image_size": config.image_size,
        "steps": steps,
        "step_time_s": timing.median_s,
        "step_time_iqr_s": timing.iqr_s,
        "step_time_min_s": timing.min_s,
        "samples_per_s": config.global_batch / timing.median_s,
        "compile_s": stats.compile_s,
        "bytes_per_device": stats.bytes_per_device,
        "temp_bytes_per_device": stats.temp_bytes,
        "param_bytes_per_device": parallel.bytes_per_device(state.params),
        "opt_state_bytes_per_device": parallel.bytes_per_device(state.opt_state),
        "grad_bytes_per_device": grad_bytes_per_device(key, config.model, n, shape, precision),
        "activation_bytes_per_device": costs.residual_activation_bytes(
            entry.tp_layout, config.model, local_batch, shape[1], act_bytes
        ),
        "collective_bytes_per_device": stats.sent_bytes,
        "collective_bytes_predicted": np.nan if predicted is None else comms.total_sent(predicted),
        "collective_bytes_by_axis": _by_axis(stats.transfers),
        "flops_per_step": flops_per_step,
        "flops_per_device": stats.flops_per_device,
        "bytes_accessed_per_device": stats.bytes_accessed,
        "achieved_flops_per_s": flops_per_step / timing.median_s,
        "peak_flops_per_device": np.nan if peak is None else peak,
        "model_flops_per_step": model_flops,
        # MFU counts the model's FLOPs (the same for every strategy); HFU the compiled program's, where
        # work a layout computes twice counts twice
        "mfu": costs.mfu(model_flops / n, timing.median_s, peak),
        "hfu": costs.mfu(stats.flops_per_device, timing.median_s, peak),
        "collectives": stats.collectives_str(),
        # the time model on the chip it runs on, or a named fabric's PREDICTION on simulated devices
        **lab_time.time_columns(
            stats,
            local_batch,
            comms.param_shapes(config.model),
            precision,
            precision_lib.matmul_precision(),
            kind,
            _devices_platform(devices),
            timing.median_s,
        ),  # fmt: skip
        **_metadata(report, devices),
    }


def grad_bytes_per_device(
    key: str, model_config: Any, n_devices: int, mesh_shape: tuple[int, int], precision: str
) -> int:
    """Bytes of the reduced gradients one device holds for the optimizer update, predicted from the
    strategy's parameter layout (:data:`course_lib.strategies.REGISTRY`): the update reads the gradients
    laid out as the parameters (float32 in ``bfloat16`` runs: the master weights' dtype). A and the
    replicated layouts (B, D) hold all of them; C its model shard; E and E′ 1/n of each sharded leaf
    (after the reduce-scatter). Before its reduction each device computes its whole local gradient (E too:
    it differentiates the gathered parameters) — that lives among the temporaries.
    """
    entry = strategies_lib.info(key)
    shapes = comms.param_shapes(model_config)
    values = comms.local_param_count(shapes, _grad_specs(entry, shapes, n_devices, mesh_shape), {
        "data": mesh_shape[0], "model": mesh_shape[1]
    })  # fmt: skip
    return values * (8 if precision == "float64" else 4)


def _grad_specs(entry, shapes, n_devices, mesh_shape):
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, jnp.float32),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    if entry.layout is None:
        return jax.tree.map(lambda _: P(), abstract)
    return entry.layout(abstract, n_devices, mesh_shape)


def mesh_shape_of(strategy: Any) -> tuple[int, int]:
    """``(n_data, n_model)`` of a built strategy (``(n, 1)`` for a 1-D mesh, ``(1, 1)`` for one device)."""
    axes = strategy.mesh_axes
    return int(axes.get("data", 1)), int(axes.get("model", 1))


def _by_axis(transfers) -> str:
    """``"data:566658 model:852608"`` (bytes sent per device per step, per mesh axis); ``"none"``."""
    parts = [f"{axis}:{sent:.0f}" for axis, sent in sorted(comms.sent_by_axis(transfers).items())]
    return " ".join(parts) or "none"


def _train(compiled, state, batches, desc: str | None, keep_states: bool = False):
    """Run every batch through the compiled step, timing each step to completion (``block_until_ready``).

    Returns ``(state, losses, times, states)``; ``states`` (host copies before each step and after the last)
    only with ``keep_states``, else None.
    """
    losses_dev, times, states = [], [], [] if keep_states else None
    iterator = range(len(batches))
    if desc is not None:
        from tqdm.auto import tqdm

        iterator = tqdm(iterator, desc=desc, leave=False)
    for i in iterator:
        if keep_states:
            states.append(jax.device_get(state))
        t0 = time.perf_counter()
        state, metrics = compiled(state, batches[i])
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
        losses_dev.append(metrics["loss"])
    if keep_states:
        states.append(jax.device_get(state))
    losses = [float(np.asarray(x).ravel()[0]) for x in losses_dev]  # pmap: one copy per device
    return state, losses, times, states


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

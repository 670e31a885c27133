"""One chip at full size: the transformer's bfloat16 training step, timed, and its model FLOP utilisation.

The step (:func:`make_step`): :func:`course_lib.transformer.forward` on **bfloat16** parameters (bfloat16
activations and matmuls), the logits cast to float32 for the loss, and plain SGD (``optax.sgd``: no optimizer
state), the parameters donated. With ``remat=True`` every block runs under ``jax.checkpoint``: the backward
pass keeps each block's input ``[B, S, D]`` and recomputes its forward, instead of keeping its attention
scores ``[B, H, S, S]`` and MLP activations ``[B, S, F]``.

:func:`measure` compiles it once for one device, checks its ``memory_analysis()`` against the device's free
bytes, runs warm-up and timed steps (the median, each ended by ``jax.block_until_ready``) and returns a
:class:`Measurement`. Its MFU counts the **model's** FLOPs, 3 × the forward's
(:func:`course_lib.transformer.flops_per_token` × tokens), over the chip's dense bfloat16 peak
(:func:`course_lib.costs.peak_flops`); ``remat``'s recomputed forward counts in the HFU
(:func:`hardware_flops`) only. ``cost_analysis()`` is not used: it counts the layer scan's body once, not once
per layer. Simulated CPU devices have no peak: their MFU is None (the machinery runs, no figure is claimed).
``notebooks/12_transformer_lab.ipynb`` ("One chip at full size") measures the ``GPU`` size on a TPU or GPU
and shows the committed TPU v5e measurement (:func:`reference`, written by ``tools/lm_mfu.py``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

from . import costs, transformer
from . import lm_mfu_report as _report
from . import measure as _measure  # the module; this module's measure() is the function below
from .tokens import CopyWalk

REFERENCE_CSV = Path(__file__).resolve().parents[1] / "data/tpu_reference/lm_mfu/mfu.csv"
"""Where the committed measurement lives: ``tools/lm_mfu.py --out DIR`` run on a TPU, ``DIR/mfu.csv`` copied."""

LEARNING_RATE = 0.5
"""SGD's step size: large enough that a bfloat16 parameter (8 bits of mantissa) moves at the TINY size."""

FIELDS = (
    "config", "batch", "remat", "fits", "step_s", "step_iqr_s", "compile_s", "model_flops",
    "hardware_flops", "peak_flops", "mfu", "hfu", "peak_bytes", "own_peak_bytes", "argument_bytes",
    "output_bytes", "temp_bytes", "alias_bytes", "first_loss", "last_loss", "device_kind", "platform",
    "jax", "jaxlib", "date", "note",
)  # fmt: skip
"""The columns of :meth:`Measurement.row` and of ``mfu.csv`` (``tools/lm_mfu.py`` adds its versions)."""


class OutOfMemory(RuntimeError):
    """The step does not fit the device: its compiled memory exceeds what is free, or XLA said
    ``RESOURCE_EXHAUSTED`` compiling or running it. ``need_bytes``/``free_bytes``: None where unknown."""

    def __init__(self, message: str, need_bytes: int | None = None, free_bytes: int | None = None):
        super().__init__(message)
        self.need_bytes, self.free_bytes = need_bytes, free_bytes


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One timed configuration of :func:`measure`.

    Attributes:
      config_name: the key of :data:`course_lib.transformer.CONFIGS` (``"gpu"``, ``"tiny"``…) or ``"custom"``.
      config: the model's shape.
      batch: sequences per step (of ``config.seq_len`` tokens each).
      remat: whether every block ran under ``jax.checkpoint``.
      timing: the timed steps (seconds; :class:`course_lib.measure.Timing`).
      compile_s: seconds to compile the step.
      model_flops: the model's FLOPs per step (:func:`model_flops`).
      hardware_flops: the FLOPs the step computes, the recomputed forward included (:func:`hardware_flops`).
      peak_flops: the device's dense bfloat16 peak, FLOP/s; None on a CPU or an unlisted chip.
      mfu: ``model_flops / step_s / peak_flops`` (:func:`course_lib.costs.mfu`); None without a peak.
      hfu: the same with ``hardware_flops``; None without a peak.
      peak_bytes: the allocator's ``peak_bytes_in_use`` after the run — the process's peak so far
        (:func:`course_lib.measure.peak_device_memory`); None where ``memory_stats()`` is None (CPU).
      own_peak_bytes: this run's own peak above what was in use before it, where it raised the process's
        peak (:func:`course_lib.measure.own_peak`); else None.
      memory: the compiled program's ``memory_analysis()``, bytes: ``argument``, ``output``, ``temp``,
        ``alias`` (outputs written into donated arguments: the parameters).
      losses: the loss (float32, nats per token) of every step run, warm-up first, on one fixed batch.
      device_kind: ``jax.Device.device_kind``.
      platform: ``"cpu"``, ``"tpu"`` or ``"gpu"``.
    """

    config_name: str
    config: transformer.TransformerConfig
    batch: int
    remat: bool
    timing: _measure.Timing
    compile_s: float
    model_flops: float
    hardware_flops: float
    peak_flops: float | None
    mfu: float | None
    hfu: float | None
    peak_bytes: int | None
    own_peak_bytes: int | None
    memory: dict[str, int]
    losses: tuple[float, ...]
    device_kind: str
    platform: str

    @property
    def step_s(self) -> float:
        """Median seconds per step."""
        return self.timing.median_s

    @property
    def need_bytes(self) -> int:
        """Bytes the compiled step holds at once: arguments + outputs + temporaries − donated aliases."""
        return sum(self.memory[k] for k in ("argument", "output", "temp")) - self.memory["alias"]

    def row(self) -> dict[str, Any]:
        """One flat row with the columns :data:`FIELDS` (``fits`` True; the date in UTC)."""
        import jaxlib

        return {
            "config": self.config_name, "batch": self.batch, "remat": self.remat, "fits": True,
            "step_s": self.step_s, "step_iqr_s": self.timing.iqr_s, "compile_s": self.compile_s,
            "model_flops": self.model_flops, "hardware_flops": self.hardware_flops,
            "peak_flops": self.peak_flops, "mfu": self.mfu, "hfu": self.hfu, "peak_bytes": self.peak_bytes,
            "own_peak_bytes": self.own_peak_bytes, "argument_bytes": self.memory["argument"],
            "output_bytes": self.memory["output"], "temp_bytes": self.memory["temp"],
            "alias_bytes": self.memory["alias"], "first_loss": self.losses[0], "last_loss": self.losses[-1],
            "device_kind": self.device_kind, "platform": self.platform, "jax": jax.__version__,
            "jaxlib": getattr(jaxlib, "__version__", "unknown"),
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "note": "",
        }  # fmt: skip

    def describe(self) -> str:
        """One line: size, batch, remat, step time, TFLOP/s, MFU (or why none), memory."""
        rate = self.model_flops / self.step_s / 1e12
        util = (
            f"MFU {self.mfu:.1%}, HFU {self.hfu:.1%}"
            if self.mfu is not None
            else f"no MFU ({self.platform}: no peak)"
        )
        return (
            f"{self.config_name} batch {self.batch} remat={self.remat}: step {self.step_s * 1e3:.1f} ms, "
            f"{self.model_flops / 1e12:.3g} TFLOP of model FLOPs = {rate:.3g} TFLOP/s, {util}; "
            f"program holds {_measure.human_bytes(self.need_bytes)}, allocator peak "
            f"{_measure.human_bytes(self.peak_bytes)}"
        )


def resolve_config(config: str | transformer.TransformerConfig) -> tuple[str, Any]:
    """``(name, TransformerConfig)`` for a key of :data:`course_lib.transformer.CONFIGS` or a config.
    Raises ValueError for an unknown name or something that is not a config, naming the known ones."""
    if isinstance(config, transformer.TransformerConfig):
        names = [k for k, v in transformer.CONFIGS.items() if v == config]
        return (names[0] if names else "custom"), config
    if isinstance(config, str) and config.lower() in transformer.CONFIGS:
        return config.lower(), transformer.CONFIGS[config.lower()]
    raise ValueError(
        f"config={config!r} is not a transformer size: pass one of {sorted(transformer.CONFIGS)} "
        "or a course_lib.transformer.TransformerConfig"
    )


def _check_batch(batch: Any) -> int:
    if not isinstance(batch, int) or isinstance(batch, bool) or batch <= 0:
        raise ValueError(f"batch={batch!r} must be a positive integer (sequences per step), e.g. 1")
    return batch


def model_flops(config: transformer.TransformerConfig, batch: int) -> float:
    """The model's FLOPs per training step: ``3 × flops_per_token(config) × batch × seq_len`` (forward, and
    two matmuls per matmul backward; ``course_lib.transformer.flops_per_token``). Raises ValueError for a
    batch that is not a positive integer."""
    return 3.0 * transformer.flops_per_token(config) * _check_batch(batch) * config.seq_len


def hardware_flops(config: transformer.TransformerConfig, batch: int, remat: bool) -> float:
    """:func:`model_flops`, plus with ``remat`` the blocks' forward once more (recomputed in the backward
    pass; the head is not rematerialised): about 4× the blocks' forward instead of 3×. Analytic, like
    :func:`model_flops`."""
    blocks = transformer.flops_per_token(config) - 2 * config.d_model * config.vocab
    extra = blocks * batch * config.seq_len if remat else 0.0
    return model_flops(config, batch) + extra


def loss_fn(
    params: dict, tokens: jax.Array, targets: jax.Array, *, remat: bool, eps: float
) -> jax.Array:
    """Mean token cross-entropy, float32 nats: the forward in the parameters' dtype, logits cast to float32.

    ``tokens``/``targets``: int32 [B, S]. ``remat``: every block under ``jax.checkpoint``.
    """
    block = lambda x, p: transformer.block(x, p, eps)  # noqa: E731
    logits = transformer.forward(
        params, tokens, block_fn=jax.checkpoint(block) if remat else block, eps=eps
    )
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return ce.mean()


def make_step(
    config: transformer.TransformerConfig, remat: bool = True, learning_rate: float = LEARNING_RATE
):
    """The jitted step ``(params, tokens, targets) -> (params, loss)``: :func:`loss_fn`'s gradient, one
    ``optax.sgd(learning_rate)`` update (no momentum, so no optimizer state) applied in the parameters'
    dtype; ``params`` is donated (the update is written into it). Raises ValueError for a learning rate
    that is not positive."""
    if not learning_rate > 0:
        raise ValueError(f"learning_rate={learning_rate!r} must be > 0, e.g. {LEARNING_RATE}")
    sgd = optax.sgd(learning_rate)

    def step(params, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(
            params, tokens, targets, remat=remat, eps=config.ln_eps
        )
        updates, _ = sgd.update(grads, sgd.init(params), params)
        return optax.apply_updates(params, updates), loss

    return jax.jit(step, donate_argnums=0)


def init_params(
    config: transformer.TransformerConfig, key: jax.Array, device: Any, dtype=jnp.bfloat16
) -> dict:
    """:func:`course_lib.transformer.init_model`'s parameters cast to ``dtype`` (bfloat16), made on
    ``device`` in one jitted program (compiled once per size, dtype and device; the float32 draw is not
    kept): the nested dict of :func:`course_lib.transformer.init_model`, every leaf ``dtype``."""
    cache_key = (config, jnp.dtype(dtype).name, device)
    if cache_key not in _INIT:

        def cast(k):
            return jax.tree.map(lambda a: a.astype(dtype), transformer.init_model(k, config)[1])

        _INIT[cache_key] = jax.jit(cast, out_shardings=jax.sharding.SingleDeviceSharding(device))
    return _INIT[cache_key](key)


_INIT: dict[Any, Any] = {}


def _is_oom(error: BaseException) -> bool:
    text = str(error).lower()  # XLA: "RESOURCE_EXHAUSTED: ... Ran out of memory ..."
    return "resource_exhausted" in text or "out of memory" in text


def _raise_if_oom(error: BaseException, what: str) -> None:
    """Raise :class:`OutOfMemory` (``what``, then XLA's message) from ``error`` where it is XLA's
    out-of-memory error; return otherwise (the caller raises ``error`` again)."""
    if _is_oom(error):
        raise OutOfMemory(f"{what}: {str(error)[:300]}") from error


def _compile(step, where, tokens, targets, name: str, batch: int):
    """``(compiled, seconds, memory_analysis() as a dict)`` for the parameters of ``where``:
    ``(config, key, device)``; XLA's ``RESOURCE_EXHAUSTED`` becomes :class:`OutOfMemory`."""
    cfg, key, device = where
    sharding = jax.sharding.SingleDeviceSharding(device)
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
        jax.eval_shape(lambda k: init_params(cfg, k, device), key),
    )
    try:
        t0 = time.perf_counter()
        compiled = step.lower(abstract, tokens, targets).compile()
        seconds = time.perf_counter() - t0
        ma = compiled.memory_analysis()
        memory = {
            "argument": int(ma.argument_size_in_bytes), "output": int(ma.output_size_in_bytes),
            "temp": int(ma.temp_size_in_bytes), "alias": int(ma.alias_size_in_bytes),
        }  # fmt: skip
        return compiled, seconds, memory
    except Exception as error:  # noqa: BLE001 - XLA raises its own runtime error type
        _raise_if_oom(error, f"{name} at batch {batch} does not fit")
        raise


def _check_fit(memory: dict[str, int], device: Any, name: str, batch: int) -> None:
    """Raise :class:`OutOfMemory` before running when the program's new buffers exceed the free bytes."""
    snap = _measure.allocator_snapshot([device])
    if snap is None or not snap["bytes_limit"]:
        return
    free = snap["bytes_limit"] - snap["bytes_in_use"]
    need = memory["argument"] + memory["output"] + memory["temp"] - memory["alias"]
    if need > free:
        raise OutOfMemory(
            f"{name} at batch {batch} does not fit: its compiled step holds {_measure.human_bytes(need)} "
            f"(memory_analysis), {_measure.human_bytes(free)} free on {device.device_kind}; use a smaller "
            "batch or remat=True",
            need,
            free,
        )


def measure(
    config: str | transformer.TransformerConfig,
    batch: int,
    device: Any,
    steps: int = 5,
    *,
    warmup: int = 2,
    remat: bool = True,
    learning_rate: float = LEARNING_RATE,
    seed: int = 0,
) -> Measurement:
    """Compile the bfloat16 step once for ``device``, run ``warmup`` + ``steps`` steps, time them.

    One fixed batch of the course's copy-walk task (:class:`course_lib.tokens.CopyWalk`, int32
    ``[batch, seq_len]``) is made on the device first, so no input pipeline is timed; the parameters are
    :func:`init_params` (bfloat16). Before anything runs the compiled program's ``memory_analysis()`` is
    compared with the device's free bytes (where ``memory_stats()`` tells them).

    Args:
      config: a key of :data:`course_lib.transformer.CONFIGS` (``"gpu"``: 0.94 B parameters, sequence 2048;
        ``"tiny"``) or a ``TransformerConfig``.
      batch: sequences per step, a positive integer.
      device: a ``jax.Device`` (a TPU or GPU for an MFU; a CPU device runs the same machinery).
      steps: timed steps (≥ 1); the median is reported.
      warmup: untimed steps first (≥ 0).
      remat: every block under ``jax.checkpoint``.
      learning_rate: SGD's step size.
      seed: PRNG seed of the parameters and the batch.

    Returns:
      A :class:`Measurement` (``mfu`` None on a CPU).

    Raises:
      ValueError: an unknown config, a batch that is not a positive integer, ``steps`` < 1 or ``warmup`` < 0.
      OutOfMemory: the step does not fit the device (before running, or XLA's ``RESOURCE_EXHAUSTED``).
    """
    name, cfg = resolve_config(config)
    _check_batch(batch)
    if not isinstance(steps, int) or steps < 1 or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"steps={steps!r} must be >= 1 and warmup={warmup!r} >= 0 (integers)")
    sharding = jax.sharding.SingleDeviceSharding(device)
    key = jax.random.key(seed)
    before = _measure.allocator_snapshot([device])
    tokens, targets = CopyWalk(cfg.vocab, cfg.seq_len).batch(
        jax.random.fold_in(key, 1), batch, sharding
    )
    step = make_step(cfg, remat, learning_rate)
    compiled, compile_s, memory = _compile(step, (cfg, key, device), tokens, targets, name, batch)
    _check_fit(memory, device, name, batch)
    state = {"params": init_params(cfg, jax.random.fold_in(key, 0), device)}
    losses = []

    def one_step():
        state["params"], loss = compiled(state["params"], tokens, targets)
        losses.append(loss)
        return state["params"], loss

    try:
        timing = _measure.time_calls(one_step, repeats=steps, warmup=warmup)
    except Exception as error:  # noqa: BLE001 - XLA raises its own runtime error type
        _raise_if_oom(error, f"{name} at batch {batch} ran out of memory")
        raise
    after = _measure.allocator_snapshot([device])
    peak, _ = costs.peak_flops(device.device_kind, "bfloat16")
    flops, hw = model_flops(cfg, batch), hardware_flops(cfg, batch, remat)
    return Measurement(
        name, cfg, batch, remat, timing, compile_s, flops, hw, peak,
        costs.mfu(flops, timing.median_s, peak) if peak else None,
        costs.mfu(hw, timing.median_s, peak) if peak else None,
        None if after is None else after["peak_bytes_in_use"], _measure.own_peak(before, after),
        memory, tuple(float(x) for x in losses), device.device_kind, device.platform,
    )  # fmt: skip


def sweep(
    config: str | transformer.TransformerConfig,
    device: Any,
    batches: tuple[int, ...] = (1, 2, 4, 8),
    remats: tuple[bool, ...] = (True, False),
    *,
    log: Any = print,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """:func:`measure` at each batch (ascending) for each ``remat``: one row (:data:`FIELDS`) per run.

    A batch that does not fit (:class:`OutOfMemory`) gets a row with ``fits`` False, its reason in
    ``note`` and no timing; the larger batches of the same ``remat`` are not tried (they need more).
    ``log`` receives one line per row (None: silent); ``kwargs`` go to :func:`measure` (``steps``,
    ``warmup``, ``learning_rate``, ``seed``).

    Raises:
      ValueError: an unknown config, an empty or non-positive batch list, or no ``remat`` value.
    """
    name, cfg = resolve_config(config)
    if not batches or not remats:
        raise ValueError(f"batches={batches!r}, remats={remats!r}: each must name a value")
    for b in batches:
        _check_batch(b)
    rows = []
    for remat in remats:
        for batch in sorted(set(batches)):
            try:
                row = measure(cfg, batch, device, remat=remat, **kwargs).row()
            except OutOfMemory as error:
                row = dict.fromkeys(FIELDS) | dict(
                    batch=batch, remat=remat, fits=False, note=str(error)[:300],
                    model_flops=model_flops(cfg, batch), device_kind=device.device_kind,
                    platform=device.platform, jax=jax.__version__,
                    date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                )  # fmt: skip
            row["config"] = name
            rows.append(row)
            if log is not None:
                log(_row_line(row))
            if not row["fits"]:
                break
    return rows


def largest_batch(
    config: str | transformer.TransformerConfig,
    device: Any,
    batches: tuple[int, ...] = (1, 2, 4, 8),
    *,
    remat: bool = True,
    log: Any = print,
    **kwargs: Any,
) -> Measurement | None:
    """:func:`measure` at the largest of ``batches`` that fits ``device``, the largest tried first (each
    checked against the free memory before it runs); None when none fits. ``log`` gets one line per batch
    that does not fit (None: silent); ``kwargs`` go to :func:`measure`. Raises ValueError as :func:`measure`
    does, or for an empty ``batches``."""
    if not batches:
        raise ValueError(f"batches={batches!r} must name at least one batch, e.g. (1, 2, 4, 8)")
    for batch in sorted(set(map(_check_batch, batches)), reverse=True):
        try:
            return measure(config, batch, device, remat=remat, **kwargs)
        except OutOfMemory as error:
            if log is not None:
                log(f"batch {batch}, remat={remat}: does not fit ({str(error)[:160]})")
    return None


def _row_line(row: dict[str, Any]) -> str:
    head = f"{row['config']} batch {row['batch']} remat={row['remat']}"
    if not row["fits"]:
        return f"{head}: does not fit ({row['note'][:120]})"
    mfu = "no MFU (no peak)" if row["mfu"] is None else f"MFU {row['mfu']:.1%}"
    return f"{head}: step {row['step_s'] * 1e3:.1f} ms, {mfu}, loss {row['first_loss']:.3f} -> {row['last_loss']:.3f}"


# the committed measurement, read and shown: course_lib.lm_mfu_report
reference, describe_reference, program_bytes = (
    _report.reference,
    _report.describe_reference,
    _report.program_bytes,
)

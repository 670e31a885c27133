"""Measurement: compile time apart from run time, synchronised step timing, memory, FLOPs, collectives.

Methodology (taught in ``notebooks/02_jit.ipynb``): inputs are placed on their devices first; the step is
lowered and compiled explicitly, so compile time is measured on its own; every timed call ends with
``jax.block_until_ready`` (JAX dispatches asynchronously: without it a call "takes" microseconds); the
first calls are warm-up; the median and the spread of the rest are reported.

Memory and FLOPs come from the compiled program (``Compiled.memory_analysis()`` / ``cost_analysis()``),
which work on every backend; its collectives, sized, from its HLO text (:mod:`course_lib.comms`). On GPUs
the allocator's ``Device.memory_stats()`` is read beside them — and its ``peak_bytes_in_use`` is the
process's peak so far (no API resets it), so a strategy's own peak is known only when it raises that peak
(:func:`own_peak`). JAX preallocates 75 % of each GPU's memory at the first operation
(``XLA_PYTHON_CLIENT_PREALLOCATE``, ``XLA_CLIENT_MEM_FRACTION``; :func:`allocator_settings`), so what
``nvidia-smi`` shows is the pool, not what a program needs.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from . import comms, programs

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
"""HLO collective ops counted in compiled programs (async ``-start`` forms are counted once)."""


@dataclasses.dataclass(frozen=True)
class Timing:
    """Summary of repeated measurements, in seconds (wall time unless another clock was read).

    Attributes:
      median_s: median seconds per call (warm-up calls excluded).
      min_s, max_s: fastest and slowest call, seconds.
      iqr_s: interquartile range (75th - 25th percentile), seconds; 0 with fewer than 4 samples.
      n: number of timed calls.
    """

    median_s: float
    min_s: float
    max_s: float
    iqr_s: float
    n: int

    @classmethod
    def from_samples(cls, samples: Sequence[float]) -> Timing:
        """Summarise samples in seconds. Raises ValueError on an empty sequence."""
        xs = sorted(float(x) for x in samples)
        if not xs:
            raise ValueError(
                "no timing samples: run at least one timed call (steps must exceed warmup)"
            )
        iqr = 0.0
        if len(xs) >= 4:
            q = statistics.quantiles(xs, n=4)
            iqr = q[2] - q[0]
        return cls(statistics.median(xs), xs[0], xs[-1], iqr, len(xs))


def time_calls(
    fn: Callable[[], Any],
    repeats: int = 5,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> Timing:
    """Time ``fn()`` ``repeats`` times after ``warmup`` untimed calls, synchronising on its result.

    Args:
      fn: the call to time, with no arguments; its result is waited for (``jax.block_until_ready``).
      repeats: timed calls, at least 1.
      warmup: untimed calls before them (compiles, first-touch allocations), at least 0.
      clock: read before and after each timed call, in seconds. ``time.perf_counter`` (the default) is
        wall time. ``time.process_time`` is the CPU time of every thread of this process (XLA:CPU runs the
        computation on its worker threads, so ``time.thread_time`` would miss it): on simulated CPU
        devices it leaves out the time those threads wait for a core another program holds
        (``notebooks/07_debugging.ipynb``, the straggler); on GPUs it counts only host threads, not the
        device's work.

    Returns:
      :class:`Timing` of the ``repeats`` timed calls, in the clock's seconds.

    Raises:
      ValueError: ``repeats`` < 1 or ``warmup`` < 0.
      TypeError: ``fn`` or ``clock`` is not callable.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    if not callable(fn):
        raise TypeError(f"fn={fn!r} is not callable: pass the call to time, e.g. lambda: step(x)")
    if not callable(clock):
        raise TypeError(
            f"clock={clock!r} is not callable: pass a clock function, e.g. time.perf_counter or "
            "time.process_time (not its value, time.perf_counter())"
        )
    for _ in range(warmup):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        t0 = clock()
        jax.block_until_ready(fn())
        samples.append(clock() - t0)
    return Timing.from_samples(samples)


def alternating(
    calls: dict[str, Callable[[], Any]], rounds: int = 5, warmup: int = 1
) -> dict[str, dict[str, Timing]]:
    """Time several calls in alternating rounds, each in wall time and in CPU time.

    Each round times every call once, in order, so that a change in the machine's load between rounds
    reaches all of them alike; the median over rounds of each is reported, and ratios between calls are
    best taken from these medians. CPU time (``time.process_time``: every thread of this process, XLA:CPU's
    workers included) counts the work done and not the time spent waiting for a core another program holds.

    Args:
      calls: ``{name: fn}``, each ``fn()`` returning something to wait for (``jax.block_until_ready``).
      rounds: timed rounds, at least 1.
      warmup: untimed rounds before them.

    Returns:
      ``{name: {"wall": Timing, "cpu": Timing}}`` in seconds per call.

    Raises:
      ValueError: ``rounds`` < 1, ``warmup`` < 0 or no calls.
    """
    if rounds < 1 or warmup < 0 or not calls:
        raise ValueError(f"rounds={rounds} must be >= 1, warmup={warmup} >= 0, and calls not empty")
    samples = {name: ([], []) for name in calls}
    for r in range(warmup + rounds):
        for name, fn in calls.items():
            w0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn())
            if r >= warmup:
                samples[name][0].append(time.perf_counter() - w0)
                samples[name][1].append(time.process_time() - c0)
    return {
        name: {"wall": Timing.from_samples(w), "cpu": Timing.from_samples(c)}
        for name, (w, c) in samples.items()
    }


@dataclasses.dataclass(frozen=True)
class CompiledStats:
    """What the compiled step says about itself (all per device unless named otherwise).

    Attributes:
      compile_s: seconds to lower and compile (tracing included).
      argument_bytes, output_bytes, temp_bytes, alias_bytes: ``memory_analysis()`` fields, bytes per device.
      bytes_per_device: argument + output − alias (donated buffers reused) + temp: the program's footprint.
      flops_per_device: ``cost_analysis()["flops"]`` of the per-device (SPMD-partitioned) program.
      collectives: count of each op in ``COLLECTIVES`` in the compiled HLO text.
      bytes_accessed: ``cost_analysis()["bytes accessed"]``: memory traffic per device (not network bytes).
      transfers: every collective, sized (:func:`course_lib.comms.collectives`); empty when the mesh's axes
        were not given.
    """

    compile_s: float
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    bytes_per_device: int
    flops_per_device: float
    collectives: dict
    bytes_accessed: float = float("nan")
    transfers: tuple = ()

    @property
    def sent_bytes(self) -> float:
        """Bytes each device sends per step over all collectives (ring algorithms)."""
        return comms.total_sent(self.transfers)

    def collectives_str(self) -> str:
        """``"all-reduce:2 all-gather:1"`` (only ops that occur), or ``"none"``."""
        parts = [f"{k}:{v}" for k, v in self.collectives.items() if v]
        return " ".join(parts) if parts else "none"


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Count collective ops in compiled HLO text (``Compiled.as_text()``), one per instruction (an async
    ``-start``/``-done`` pair once), as :func:`course_lib.programs.collective_ops` reads them."""
    ops = [c.op for c in programs.collective_ops(hlo_text)]
    return {op: ops.count(op) for op in COLLECTIVES}


def compile_and_analyse(
    lower: Callable[[], Any], mesh_axes: dict | None = None
) -> tuple[Any, CompiledStats]:
    """Lower and compile (timed), then read memory, FLOPs and collectives from the compiled program.

    Args:
      lower: a zero-argument callable returning ``jax.stages.Lowered``, e.g. ``lambda: step.lower(state, batch)``.
      mesh_axes: the mesh's axis sizes in order (``Strategy.mesh_axes``); given, every collective is sized
        and its mesh axes named (``stats.transfers``).

    Returns:
      ``(compiled, stats)``; call ``compiled(state, batch)`` to run without re-tracing.
    """
    t0 = time.perf_counter()
    compiled = lower().compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older APIs returned one dict per device program
        cost = cost[0] if cost else {}
    text = compiled.as_text()
    arg = int(getattr(mem, "argument_size_in_bytes", 0))
    out = int(getattr(mem, "output_size_in_bytes", 0))
    tmp = int(getattr(mem, "temp_size_in_bytes", 0))
    alias = int(getattr(mem, "alias_size_in_bytes", 0))
    stats = CompiledStats(
        compile_s=compile_s,
        argument_bytes=arg,
        output_bytes=out,
        temp_bytes=tmp,
        alias_bytes=alias,
        bytes_per_device=arg + out - alias + tmp,
        flops_per_device=float((cost or {}).get("flops", float("nan"))),
        collectives=count_collectives(text),
        bytes_accessed=float((cost or {}).get("bytes accessed", float("nan"))),
        transfers=tuple(comms.collectives(text, mesh_axes)) if mesh_axes is not None else (),
    )
    return compiled, stats


def scaling_efficiency(rows: Any, columns: Sequence[str] = ()) -> Any:
    """Strong-scaling efficiency per strategy: ``samples_per_s(n) / (n × samples_per_s(1))``.

    1.0 is ideal linear scaling from one device; NaN where a strategy has no 1-device run.

    Args:
      rows: a ``pandas.DataFrame`` with ``strategy``, ``n_devices`` and ``samples_per_s`` (results rows).
      columns: further columns to keep beside them, e.g. ``("step_time_s", "bytes_per_device")``.

    Returns:
      A DataFrame ``strategy, n_devices, samples_per_s, *columns, efficiency``, strategies in the order
      they first appear, device counts increasing.
    """
    import pandas as pd

    keep = ["strategy", "n_devices", "samples_per_s", *columns]
    tables = []
    for _, g in rows.groupby("strategy", sort=False):
        g = g.sort_values("n_devices")
        base = g.loc[g["n_devices"] == 1, "samples_per_s"]
        one = float(base.iloc[0]) if len(base) else float("nan")
        t = g[keep].astype({"n_devices": int, "samples_per_s": float})
        t["efficiency"] = t["samples_per_s"] / (t["n_devices"] * one)
        tables.append(t)
    if not tables:
        return pd.DataFrame(columns=[*keep, "efficiency"])
    return pd.concat(tables, ignore_index=True)


def peak_device_memory(devices: Sequence[Any]) -> int | None:
    """Largest ``peak_bytes_in_use`` over ``devices`` from the allocator, or None where the backend has no
    ``memory_stats()`` (the CPU backend returns None). The process's peak *so far*: see :func:`own_peak`."""
    snap = allocator_snapshot(devices)
    return None if snap is None else snap["peak_bytes_in_use"]


def allocator_snapshot(devices: Sequence[Any]) -> dict[str, int] | None:
    """The allocator's counters, the largest over ``devices``: ``bytes_in_use``, ``peak_bytes_in_use``,
    ``bytes_limit``, ``pool_bytes`` (0 where a key is missing); None where ``memory_stats()`` is None (CPU)."""
    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "pool_bytes")
    snaps = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - a backend without allocator statistics
            stats = None
        if stats:
            snaps.append({k: int(stats.get(k, 0)) for k in keys})
    if not snaps:
        return None
    return {k: max(s[k] for s in snaps) for k in keys}


def own_peak(before: dict | None, after: dict | None) -> int | None:
    """The memory a run needed at its peak, beyond what was in use before it, from two
    :func:`allocator_snapshot` s — or None when it cannot be known.

    ``peak_bytes_in_use`` only ever grows. If the run raised it, its own peak is ``after["peak_bytes_in_use"]
    − before["bytes_in_use"]``. If it did not, the run needed at most the earlier peak; reporting that would
    repeat an earlier strategy's figure, so None (run the strategy in a fresh process to measure it).
    """
    if before is None or after is None:
        return None
    if after["peak_bytes_in_use"] <= before["peak_bytes_in_use"]:
        return None
    return after["peak_bytes_in_use"] - before["bytes_in_use"]


ALLOCATOR_ENV = {
    "XLA_PYTHON_CLIENT_PREALLOCATE": "true: preallocate at the first JAX operation",
    "XLA_CLIENT_MEM_FRACTION": "0.75 of each GPU's memory (old name: XLA_PYTHON_CLIENT_MEM_FRACTION)",
    "XLA_PYTHON_CLIENT_MEM_FRACTION": "deprecated name of XLA_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_ALLOCATOR": "default (BFC); 'platform' allocates exactly and frees (slow)",
}
"""The GPU allocator's environment variables and their defaults (docs.jax.dev/en/latest/gpu_memory_allocation.html)."""


def allocator_settings() -> dict[str, str]:
    """Each of :data:`ALLOCATOR_ENV` as set in this process, or ``"unset (default: …)"``."""
    import os

    return {k: os.environ.get(k, f"unset (default: {v})") for k, v in ALLOCATOR_ENV.items()}


def human_bytes(n: float | None) -> str:
    """``1536 → "1.5 KiB"``; None → ``"n/a"``."""
    if n is None or n != n:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def matmul_ceiling(device: Any, n: int = 4096, repeats: int = 10, chain: int = 8) -> float:
    """FLOP/s of an ``n`` × ``n`` bfloat16 matmul on ``device``: what the chip's matrix units reach on the
    kindest workload, to show beside a model's MFU (``notebooks/08_lab.ipynb``, ``12_transformer_lab``).

    ``chain`` matmuls run in one jitted call (each on the last's output, so none is skipped), timed
    ``repeats`` times after a warm-up (:func:`time_calls`); the median counts ``chain · 2n³`` FLOPs (XLA's
    ``cost_analysis()`` counts an n³ matmul as exactly 2n³ FLOPs). Measured on one TPU v5e chip (JAX 0.10.2):
    175 TFLOP/s at n = 4096, of a 197 TFLOP/s peak. Meant for accelerators; on simulated CPU devices it
    measures the host's cores and the course does not call it there.

    Args:
      device: a ``jax.Device``.
      n: the matrix side (≥ 1); inputs are bfloat16 ``[n, n]``, the output bfloat16.
      repeats: timed calls (≥ 1).
      chain: matmuls per call (≥ 1), so that dispatch overhead is small beside the work.

    Returns:
      FLOP/s, a float.

    Raises:
      ValueError: ``n``, ``repeats`` or ``chain`` below 1.
    """
    import jax.numpy as jnp

    if min(n, repeats, chain) < 1:
        raise ValueError(f"n={n}, repeats={repeats}, chain={chain}: each must be at least 1")
    scale = n**-0.5  # each product of unit normals has std sqrt(n): scaled back to 1 (no overflow)

    @jax.jit
    def chained(a, b):
        for _ in range(chain):
            a = (a @ b) * jnp.asarray(scale, a.dtype)
        return a

    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.device_put(jax.random.normal(key_a, (n, n), jnp.bfloat16), device)
    b = jax.device_put(jax.random.normal(key_b, (n, n), jnp.bfloat16), device)
    timing = time_calls(lambda: chained(a, b), repeats=repeats, warmup=1)
    return chain * 2.0 * n**3 / timing.median_s

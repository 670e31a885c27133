"""Sizes that fit the chip: the CNN lab's global batch chosen from a memory estimate, before anything runs.

On a TPU or GPU, ``profile="auto"`` in ``notebooks/08_lab.ipynb`` starts from the source article's setting
(128 × 128 × 3 images, global batch 512) and keeps it when it fits the chip's memory; otherwise it takes the
largest article-like batch (512 halved, 256, 128, …) that fits, and prints which and why. Measured on one
TPU v5e chip (16 GiB HBM, ``bytes_limit`` 15.7 GiB) when every run kept its batches: batch 512 in bfloat16
did not fit (XLA:TPU: ``RESOURCE_EXHAUSTED … reserve 2.06G … 1.65G free``), batch 128 ran.

The estimate for one device (the first: A, single-device ``jit``, holds the whole global batch there):

* **the step program**: A's step compiled for one device, ``memory_analysis()``: arguments + outputs +
  temporaries − the outputs that reuse (alias) argument buffers — the bytes the program needs at once;
* **the batches a run keeps**: a run keeps its ``steps`` batches on the devices while it trains, device 0
  all of A's; when it ends they are dropped (``StrategyRun.batches`` makes one again when a parity cell
  reads it: :class:`course_lib.builders.RemadeBatches`), so one run's batches are held at a time. (Kept for
  every run, eight runs' float32 batches at 256 images took the chip's 15.75 GiB at the seventh run.)
* against ``HEADROOM`` × the memory free on device 0 (``bytes_limit − bytes_in_use``), since XLA's
  allocator fragments and the lab's other cells hold a little more.

Simulated CPU devices have no memory limit to fit: the profile is returned unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

HEADROOM = 0.8
"""The fraction of the free device memory a chosen batch may fill (an allowance for fragmentation and the
lab's other cells, not a measurement)."""


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Bytes one device needs for the lab at one global batch (:func:`estimate`).

    Attributes:
      global_batch: images per step.
      program_bytes: A's compiled step on one device: arguments + outputs + temporaries − aliased bytes.
      batch_bytes: the batches the lab's runs keep on device 0.
      budget_bytes: ``HEADROOM`` × (``bytes_limit`` − ``bytes_in_use``) of device 0.
    """

    global_batch: int
    program_bytes: int
    batch_bytes: int
    budget_bytes: int

    @property
    def total_bytes(self) -> int:
        """``program_bytes + batch_bytes``."""
        return self.program_bytes + self.batch_bytes

    @property
    def fits(self) -> bool:
        """The total is within the budget."""
        return self.total_bytes <= self.budget_bytes

    def __str__(self) -> str:
        gib = 2**30
        return (
            f"global batch {self.global_batch}: {self.total_bytes / gib:.2f} GiB (step program "
            f"{self.program_bytes / gib:.2f} GiB + kept batches {self.batch_bytes / gib:.2f} GiB) "
            f"{'<=' if self.fits else '>'} budget {self.budget_bytes / gib:.2f} GiB"
        )


def program_bytes(compiled: Any) -> int:
    """Bytes a compiled program needs at once, from ``memory_analysis()``: arguments + outputs +
    temporaries − the outputs aliased to (donated) arguments."""
    m = compiled.memory_analysis()
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def kept_batch_bytes(config: Any, global_batch: int, precision: str) -> int:
    """Bytes of the batches one run keeps on device 0 while it trains (see the module's text): ``steps``
    batches of images in the parameters' dtype (:data:`course_lib.precision.PARAM_DTYPES`: float32 for
    ``"bfloat16"``, whose master weights and batches stay float32; 8 bytes a value in float64) and int32
    labels."""
    from .precision import PARAM_DTYPES, check

    itemsize = np.dtype(PARAM_DTYPES[check(precision)]).itemsize
    m = config.model
    one = global_batch * (m.image_size * m.image_size * m.in_channels * itemsize + 4)
    return int(config.steps * one)


def estimate(config: Any, devices: Sequence[Any], precision: str, global_batch: int) -> Estimate:
    """The :class:`Estimate` of the lab at ``global_batch`` on ``devices`` (A's step is compiled, not run).

    Raises:
      ValueError: the device keeps no allocator statistics (simulated CPU devices): nothing to fit.
    """
    from . import lab

    stats = devices[0].memory_stats()
    if not stats or "bytes_limit" not in stats:
        raise ValueError(
            f"{devices[0]} reports no memory_stats(): no memory limit to fit a batch to"
        )
    free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    lowered = lab.lower_strategy(
        "jit", list(devices)[:1], config, precision=precision, global_batch=global_batch
    )
    return Estimate(
        global_batch,
        program_bytes(lowered.compile()),
        kept_batch_bytes(config, global_batch, precision),
        int(HEADROOM * free),
    )


def fit_global_batch(
    config: Any,
    devices: Sequence[Any],
    precision: str,
    *,
    simulated: bool,
    chip: str = "",
) -> tuple[Any, list[Estimate]]:
    """The lab config at the largest article-like global batch that fits the chip, and the estimates tried.

    Starts at ``config.global_batch`` and halves it while the :func:`estimate` exceeds the budget, keeping
    a multiple of every device count the lab uses (1, 2, 4, …, n); prints each estimate and the choice.
    On simulated CPU devices nothing is estimated: ``(config, [])``.

    Args:
      config: the resolved profile (:func:`course_lib.config.resolve_profile`).
      devices: ``report.devices``.
      precision: the lab's precision.
      simulated: ``report.simulated``.
      chip: the chip's name, for the printed reason.

    Raises:
      ValueError: not even the smallest such batch fits (the message names the estimate and the fix: a
        smaller ``steps`` or ``global_batch``).
    """
    if simulated:
        return config, []
    from .devices import device_subsets

    multiple = math.lcm(*device_subsets(range(len(devices))))
    tried = []
    batch = config.global_batch
    while True:
        est = estimate(config, devices, precision, batch)
        tried.append(est)
        print(f"{chip or devices[0].device_kind}: {est}")
        smaller = batch // 2
        if est.fits or smaller < multiple or smaller % multiple:
            break
        batch = smaller
    if not tried[-1].fits:
        raise ValueError(
            f"no global batch from {config.global_batch} down to {batch} fits {devices[0].device_kind}: "
            f"{tried[-1]}. Give fewer steps (papermill: -p steps 10) or a smaller global_batch."
        )
    return dataclasses.replace(config, global_batch=batch), tried

"""Lab 08's time model at the source article's setting: each strategy's step on 8-GPU servers.

``notebooks/08_lab.ipynb`` (section 6.6) applies :func:`course_lib.costs.step_time` to the gpu profile (the
article's image size and global batch) on 8 GPUs of a named fabric (:data:`course_lib.costs.FABRICS`), with
each strategy's collectives predicted from the shapes (:func:`course_lib.strategies.predict_comm`), not
compiled. Every figure is a model, never a measurement.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from . import costs, strategies


def article_scale_steps(
    cfg: Any,
    fabric_names: Sequence[str],
    keys: Sequence[str],
    *,
    n_devices: int = 8,
    latency_s: float | None = None,
    precision: str = "float32",
) -> pd.DataFrame:
    """Each strategy's modelled step (no overlap) at ``cfg``'s global batch on ``n_devices`` GPUs, and
    how much of it is the link latency α.

    The compute is the model FLOPs per step (:func:`course_lib.costs.model_flops_per_step`) ÷
    ``n_devices`` at the chip's ``precision`` rate; no HBM term (the bytes accessed are not predicted).
    The α part is the communication time less its time with ``latency_s`` = 0.

    Args:
      cfg: a :class:`course_lib.config.LabConfig` (``model``, ``global_batch``), e.g. the gpu profile's.
      fabric_names: keys of :data:`course_lib.costs.FABRICS` ("A100", "H100").
      keys: strategy keys that :func:`course_lib.strategies.predict_comm` knows.
      n_devices: GPUs in the data group.
      latency_s: α per ring step, seconds; None: each fabric's own.
      precision: the compute precision of the step.

    Returns:
      A DataFrame indexed by ``keys``: ``collectives`` (how many the step runs), then per fabric
      ``"<name> step ms"`` (compute + communication, milliseconds) and ``"<name> α ms"``.

    Raises:
      KeyError: a fabric name not in :data:`course_lib.costs.FABRICS`.
    """
    compute_flops = costs.model_flops_per_step(cfg.model, cfg.global_batch) / n_devices
    table: dict[str, dict[str, float]] = {"collectives": {}}
    for name in fabric_names:
        fabric = costs.FABRICS[name]
        if latency_s is not None:
            fabric = fabric.with_latency(latency_s)
        no_alpha = fabric.with_latency(0.0)
        for key in keys:
            t = strategies.predict_comm(key, cfg.model, cfg.global_batch, n_devices, platform="gpu")
            step = costs.step_time(compute_flops, None, t, fabric, precision)
            bandwidth_only = costs.step_time(compute_flops, None, t, no_alpha, precision)["comm_s"]
            table["collectives"][key] = len(t)
            table.setdefault(f"{name} step ms", {})[key] = step["no_overlap_s"] * 1e3
            table.setdefault(f"{name} α ms", {})[key] = (step["comm_s"] - bandwidth_only) * 1e3
    return pd.DataFrame(table)

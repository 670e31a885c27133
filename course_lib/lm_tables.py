"""Lab 12's tables (``notebooks/12_transformer_lab.ipynb``): a step-time model's rows as a table, one row of
the results table, the model table of the results files. :mod:`course_lib.lm_lab` names them too."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import pandas as pd

from . import comms


def step_table(rows: Sequence[dict]) -> pd.DataFrame:
    """A step-time MODEL's rows (:func:`course_lib.lm_costs.step_time`) as a table: per layout the step in
    ms (``step_ms``: nothing overlapped; ``data_overlap_ms``, ``overlap_ms`` where the row has them), its
    ``compute_ms`` and ``comm_ms`` (all axes), ``sent_GB`` per device and ``memory_GB`` per device (1e9 B)."""
    out = []
    for r in rows:
        row = {"layout": r["layout"], "step_ms": r["step_s"] * 1e3}
        for key in ("data_overlap_s", "overlap_s"):
            if key in r:
                row[key.removesuffix("_s") + "_ms"] = r[key] * 1e3
        row.update(compute_ms=r["compute_s"] * 1e3, comm_ms=sum(r["comm_s"].values()) * 1e3,
                   sent_GB=r["sent_bytes"] / 1e9, memory_GB=r["memory_bytes"] / 1e9)  # fmt: skip
        out.append(row)
    return pd.DataFrame(out).round(2)


def results_row(
    key: str,
    run32: dict,
    run64: dict,
    predicted: Sequence,
    measured: Sequence,
    n_devices: int,
    flops_per_device: float,
    peak_flops: float | None,
    platform: str,
) -> dict:
    """One row of lab 12's results table (``lm_results.csv``) for layout ``key``.

    Args:
      key: the layout (``"dp"``, ``"tp_sp"``, ...).
      run32: :func:`course_lib.lm_lab.run_parity`'s float32 run of it: ``built`` (its mesh), ``compiled``, ``worst``,
        ``compile_s``, ``run_s`` (seconds per step) and ``losses``.
      run64: the float64 run's dict (only ``worst`` is read: NaN where float64 was not run).
      predicted: :func:`course_lib.lm_costs.predict_bytes`' transfers of the step.
      measured: :func:`course_lib.comms.collectives` read from ``run32["compiled"]``.
      n_devices: the devices of the run.
      flops_per_device: the model's FLOPs per device per step (for the MFU).
      peak_flops: the chip's FLOP/s at the run's precision, or None (simulated devices: the MFU is NaN).
      platform: ``"cpu"``, ``"tpu"`` or ``"gpu"``.

    Returns:
      ``layout``, ``mesh``, ``n_devices``, ``parity_f64`` and ``parity_f32`` (worst absolute difference),
      ``predicted_bytes`` and ``measured_bytes`` (bytes per device per step), ``collectives`` (how many the
      program runs), ``argument_bytes`` and ``temp_bytes`` (``memory_analysis()``, bytes per device),
      ``compile_s``, ``cpu_step_s`` (seconds), ``final_loss``, ``platform``, ``jax_version`` and ``mfu``
      (:func:`course_lib.costs.mfu`).

    Raises:
      KeyError: ``run32`` or ``run64`` lacks a field above.
    """
    from . import costs
    from .meshes import describe

    analysis = run32["compiled"].memory_analysis()
    return {
        "layout": key,
        "mesh": describe(run32["built"].mesh),
        "n_devices": n_devices,
        "parity_f64": run64["worst"],
        "parity_f32": run32["worst"],
        "predicted_bytes": comms.total_sent(predicted),
        "measured_bytes": comms.total_sent(measured),
        "collectives": len(measured),
        "argument_bytes": analysis.argument_size_in_bytes,
        "temp_bytes": analysis.temp_size_in_bytes,
        "compile_s": round(run32["compile_s"], 2),
        "cpu_step_s": round(run32["run_s"], 4),
        "final_loss": run32["losses"][-1],
        "platform": platform,
        "jax_version": jax.__version__,
        "mfu": costs.mfu(flops_per_device, run32["run_s"], peak_flops),
    }


def model_table(model_rows: dict[str, Sequence[dict]]) -> list[dict]:
    """Lab 12's step-time MODEL rows as the results' ``model`` table: per profile (``"H100"``, ...) and
    layout, ``step_s``, ``overlap_s``, ``compute_s`` and ``comm_s`` (all axes) in seconds, ``sent_bytes`` and
    ``memory_bytes`` per device, and ``is_model`` (True: nothing of it ran on a GPU).

    Args:
      model_rows: profile name -> :func:`course_lib.lm_costs.step_time` rows.

    Raises:
      KeyError: a row lacks one of those fields.
    """
    return [
        {
            "layout": r["layout"],
            "profile": name,
            "step_s": r["step_s"],
            "overlap_s": r["overlap_s"],
            "compute_s": r["compute_s"],
            "comm_s": sum(r["comm_s"].values()),
            "sent_bytes": r["sent_bytes"],
            "memory_bytes": r["memory_bytes"],
            "is_model": True,
        }
        for name, rows in model_rows.items()
        for r in rows
    ]

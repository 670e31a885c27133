"""What the one-operation pipelines (:mod:`course_lib.pipeline_ops`) hold in memory: the slots of each stage
counted from the table, the bytes of what a split stage's B saves for its W, and the compiled step's
temporary bytes beside them.

The counting rules (read from :func:`course_lib.pipeline_ops.plan`):

- an **input slot** holds a micro-batch's input from its arrival (which can come before its F) to its last
  reader: B, or W when the stage is not split;
- a **saved slot** (split stages only, :func:`course_lib.pipeline_ops.is_split_stage`) holds what B saves
  for W, from B to W;
- the program is SPMD: every device allocates the step's slots (the most any stage needs, and a spare),
  whatever its own stage uses.

Taught in ``notebooks/11_pipeline_experts.ipynb`` (section 6.4, "Memory held"); checked in
``tests/test_pipeline_memory.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from . import op_schedules as O
from . import pipeline_ops

__all__ = ["Slots", "slots", "saved_bytes", "temp_bytes", "temp_growth", "beside_saved_slots"]


class Slots(NamedTuple):
    """The slots of one table, per stage, as :func:`slots` counts them.

    Attributes:
      inputs: input slots stage ``s`` reads in its F and B cells (list of ``p`` ints).
      saved: slots of what B saved, waiting for W, on stage ``s`` (zeros without a split stage).
      in_flight: micro-batches stage ``s`` holds at once, from the table
        (:func:`course_lib.op_schedules.measured_in_flight`).
      step: ``(n_x, n_dy, n_saved)``, the slots of inputs, cotangents and saved values every device of the
        SPMD step allocates (:class:`course_lib.pipeline_ops.Plan`; the spare slot not counted).
    """

    inputs: list[int]
    saved: list[int]
    in_flight: list[int]
    step: tuple[int, int, int]


def slots(sched: O.OpSchedule, *, split_stage: bool) -> Slots:
    """The slots of ``sched`` per stage (:class:`Slots`); ``split_stage``: the stage has ZB-H1's split
    backward (:func:`course_lib.pipeline_ops.is_split_stage`), so a split schedule's B saves for its W.

    Raises:
      ValueError: ``sched`` breaks :func:`course_lib.op_schedules.validate`.
    """
    plan = pipeline_ops.plan(sched, split_stage=split_stage)
    op, p = plan.rows[..., 0], sched.n_stages
    reads_input = np.isin(op, (O.F, O.B))  # a split W reads what B saved, not the input
    inputs = [int(plan.rows[reads_input[:, s], s, 3].max()) + 1 for s in range(p)]
    is_w = op == O.W
    saved = [
        int(plan.rows[is_w[:, s], s, 7].max()) + 1 if plan.n_saved and is_w[:, s].any() else 0
        for s in range(p)
    ]
    held = O.measured_in_flight(sched).tolist()
    return Slots(inputs, saved, held, (plan.n_x, plan.n_dy, plan.n_saved))


def saved_bytes(stage_fn: Callable, chunk: Any, x: jax.Array | jax.ShapeDtypeStruct) -> int:
    """Bytes one micro-batch's B saves for its W on one device: the leaves of
    ``stage_fn.backward_input(x, chunk, x)[1]``, from their shapes (nothing is computed). For
    :func:`course_lib.pipeline_measure.residual_stage` ``(split=True)`` with a chunk of ``k`` layers that is
    ``2k`` activations (each layer's input ``h_l`` and matmul cotangent ``g_l``), ``2k · N · D · itemsize``.

    Args:
      stage_fn: a split stage; chunk: its parameters for one chunk (e.g. ``{"w": [k, D, D]}``);
      x: one micro-batch's input [N, D] (an array or its ``jax.ShapeDtypeStruct``); its dtype sets the bytes.

    Raises:
      ValueError: ``stage_fn`` is not a split stage (it saves nothing for W).
    """
    if not pipeline_ops.is_split_stage(stage_fn):
        raise ValueError(
            f"saved_bytes: {stage_fn!r} is not a split stage (no backward_input/backward_weight), so its B "
            "saves nothing for W; pass e.g. pipeline_measure.residual_stage(split=True)"
        )
    saved = jax.eval_shape(stage_fn.backward_input, x, chunk, x)[1]
    return int(sum(a.size * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(saved)))


def temp_bytes(compiled: Any) -> int:
    """``compiled.memory_analysis().temp_size_in_bytes``: the temporaries of a compiled program, in bytes.

    Raises:
      ValueError: the platform reports no memory analysis for it.
    """
    mem = compiled.memory_analysis()
    if mem is None:
        raise ValueError(
            "temp_bytes: this platform's compiled program has no memory_analysis(); "
            "count the slots instead (pipeline_memory.slots)"
        )
    return int(mem.temp_size_in_bytes)


def temp_growth(mesh: Any, axis: str, sched: O.OpSchedule, stage_fn: Callable, params: Any,
                xs: jax.Array, *, compiled: Any = None, compiler_options: dict | None = None) -> dict:  # fmt: skip
    """The switched step's (``mode="cond"``) temporary bytes at ``m`` and at ``2m`` micro-batches, and the
    slots at both: what grows with ``m``.

    Args:
      sched: the table at ``m`` micro-batches, one of :data:`course_lib.op_schedules` 's names (``make``
        rebuilds it at ``2m``); params: the stage parameters, already
        :func:`~course_lib.pipeline.chunked`; xs: the ``m`` micro-batches [m, N, D] (their dtype sets the
        bytes); compiled: the step at ``m`` if already compiled (saves a compile).

    Returns:
      ``{"temp": (bytes at m, bytes at 2m), "grown": bytes, "slots": (step slots at m, at 2m),
      "cotangents": bytes of the m more input cotangents the step returns at 2m}``.

    Raises:
      ValueError: ``xs`` does not hold ``sched.n_micro`` micro-batches.
    """
    m = sched.n_micro
    if xs.shape[0] != m:
        raise ValueError(
            f"temp_growth: xs holds {xs.shape[0]} micro-batches, the table {m}: pass xs[:{m}]"
        )
    twice = O.make(sched.name, sched.n_stages, 2 * m, sched.n_chunks)
    split = pipeline_ops.is_split_stage(stage_fn)
    spec = jax.ShapeDtypeStruct((2 * m, *xs.shape[1:]), xs.dtype)
    temps = []
    for t, x in ((sched, xs), (twice, spec)):
        done = compiled if t is sched else None
        if done is None:
            step = pipeline_ops.build_step(mesh, axis, t, stage_fn, mode="cond")
            done = step.lower(params, x, x).compile(compiler_options)
        temps.append(temp_bytes(done))
    act = int(np.prod(xs.shape[1:])) * np.dtype(xs.dtype).itemsize
    return {
        "temp": tuple(temps),
        "grown": temps[1] - temps[0],
        "slots": tuple(slots(t, split_stage=split).step for t in (sched, twice)),
        "cotangents": m * act,
    }


def beside_saved_slots(temp_zb: int, temp_1f1b: int, n_saved: int, slot_bytes: int) -> dict:
    """ZB-H1's temporary bytes beyond 1F1B's, beside the saved slots every device allocates.

    Args:
      temp_zb, temp_1f1b: the switched steps' temporaries (bytes, :func:`temp_bytes`) on the same stage,
        sizes and dtype; n_saved: ZB-H1's step's saved slots (``Slots.step[2]``); slot_bytes: one slot
        (:func:`saved_bytes`).

    Returns:
      ``{"extra": temp_zb - temp_1f1b, "buffer": (n_saved + 1) · slot_bytes`` (the slots and a spare),
      ``"beyond": extra - buffer}``, in bytes.

    Raises:
      ValueError: a negative count or size.
    """
    if min(temp_zb, temp_1f1b, n_saved, slot_bytes) < 0:
        raise ValueError(
            f"beside_saved_slots: bytes and slots are counts, got temp_zb={temp_zb}, temp_1f1b={temp_1f1b}, "
            f"n_saved={n_saved}, slot_bytes={slot_bytes}"
        )
    buffer = (n_saved + 1) * slot_bytes
    extra = temp_zb - temp_1f1b
    return {"extra": extra, "buffer": buffer, "beyond": extra - buffer}

"""Checkers for ``12_transformer_lab.ipynb``: the layout decision (the lab's main exercise), the largest
model that fits a memory limit under each layout, and the pipeline's bytes per mesh axis.

None of them holds an answer: each compares the learner's function, on hidden cases, with
:mod:`course_lib.lm_layouts` — the step-time model (:func:`~course_lib.lm_costs.rank_layouts`, itself
built on the byte and memory predictions that the notebook checks against the compiled programs), the memory
model (:func:`~course_lib.lm_costs.largest_layers`) and :func:`~course_lib.lm_costs.predict_bytes`,
which equals the compiled pipeline's bytes (asserted in the notebook). Each says how many cases are wrong,
never which.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from course_lib import lm_costs, transformer

from ._common import call_answer, checker, fail, passed

__all__ = ["check_layout_decision", "check_largest_model", "check_pipeline_bytes"]

_G = transformer.GPU
_REL = 0.01  # bytes and memory: within 1 %
_TIE = 0.005  # a layout within 0.5 % of the fastest step counts as first


def _decision_cases():
    """(config, global batch, profile name, memory limit): small and large batches, tight and roomy memory,
    long sequences, both profiles."""
    small = dataclasses.replace(_G, d_model=512, d_ff=2048, n_heads=8, n_layers=8)
    return (
        (_G, 64, "H100", 80e9),
        (_G, 8, "H100", 80e9),
        (_G, 32, "H200", 30e9),
        (_G, 32, "H200", 29.2e9),
        (small, 256, "H100", 80e9),
        (small, 16, "H200", 3.25e9),
        (dataclasses.replace(_G, seq_len=4096), 8, "H200", 25e9),
        (dataclasses.replace(_G, n_layers=32), 32, "H100", 58e9),
    )


def _close(a, b) -> bool:
    return math.isclose(float(a), float(b), rel_tol=_REL)


def _triple(got, what):
    try:
        key, sent, memory = got
        return str(key), float(sent), float(memory)
    except (TypeError, ValueError):
        fail(
            f"{what} returned {got!r}",
            "return (layout_key, sent_bytes, memory_bytes), e.g. ('dp', 1.2e9, 3e10)",
        )


@checker
def check_layout_decision(choose: Callable) -> bool:
    """``choose(cfg, global_batch, profile, memory_limit) -> (layout, sent_bytes, memory_bytes)``: the layout
    the step-time model ranks first among those that fit, the bytes one device sends per step and the memory
    it holds (within 1 %), compared with :func:`course_lib.lm_costs.rank_layouts` on hidden cases."""
    cases = _decision_cases()
    wrong_layout = wrong_numbers = 0
    for cfg, batch, name, limit in cases:
        profile = lm_costs.PROFILES[name]
        what = f"choose_layout(cfg, {batch}, PROFILES[{name!r}], {limit / 1e9:g}e9)"
        key, sent, memory = _triple(call_answer(what, choose, cfg, batch, profile, limit), what)
        rows = lm_costs.rank_layouts(cfg, batch, profile, 8, memory_limit=limit)
        firsts = {r["layout"]: r for r in rows if r["step_s"] <= rows[0]["step_s"] * (1 + _TIE)}
        if key not in firsts:
            wrong_layout += 1
        elif not (
            _close(sent, firsts[key]["sent_bytes"]) and _close(memory, firsts[key]["memory_bytes"])
        ):
            wrong_numbers += 1
    if wrong_layout or wrong_numbers:
        fail(
            f"{wrong_layout + wrong_numbers} of {len(cases)} cases are wrong ({wrong_layout} with another "
            f"layout first, {wrong_numbers} with the right layout but its bytes or memory off by more than 1 %)",
            "per layout: compute = 3 x forward FLOPs / 8 devices / the bfloat16 peak, times (m + p - 1)/m for "
            "the pipeline; plus the predicted bytes / link bandwidth and the latency of every collective; "
            "leave out the layouts whose memory (params + optimizer + gradients + activations) exceeds the "
            "limit and those whose batch or model does not split (lm_costs.splits)",
        )
    return passed(f"the layout, its bytes and its memory right in all {len(cases)} cases")


_FIT_CASES = (
    ("dp", _G, 16, 24e9),
    ("tp_sp", _G, 16, 24e9),
    ("fsdp_tp", _G, 16, 24e9),
    ("pp_dp", _G, 32, 24e9),
    ("dp_cp", _G, 16, 24e9),
    ("3d", _G, 16, 24e9),
    ("dp", _G, 64, 80e9),
    ("fsdp_tp", _G, 8, 8e9),
    ("pp_dp", _G, 64, 80e9),
    ("dp", _G, 64, 1e9),
)


@checker
def check_largest_model(largest: Callable) -> bool:
    """``largest(layout, cfg, global_batch, memory_limit) -> n_layers``: the most layers whose predicted memory
    per device fits (a multiple of the stages for the pipeline; 0 when none fits), compared with
    :func:`course_lib.lm_costs.largest_layers` on hidden cases."""
    wrong = 0
    for key, cfg, batch, limit in _FIT_CASES:
        what = f"largest_model({key!r}, cfg, {batch}, {limit / 1e9:g}e9)"
        got = call_answer(what, largest, key, cfg, batch, limit)
        try:
            got = int(got)
        except (TypeError, ValueError):
            fail(f"{what} returned {got!r}", "return the number of layers, an int")
        wrong += got != lm_costs.largest_layers(key, cfg, batch, limit)
    if wrong:
        fail(
            f"{wrong} of {len(_FIT_CASES)} cases are wrong",
            "count parameters, optimizer state, gradients and activations (bfloat16, 2 bytes); the memory grows "
            "by the same amount per layer; return the largest count that fits, a multiple of the stages for "
            "the pipeline, 0 when even one does not",
        )
    return passed(f"the largest model right in all {len(_FIT_CASES)} cases, every layout")


_BYTES_CASES = (
    (2, 4, 2, 16, 4),
    (2, 4, 4, 32, 2),
    (4, 2, 8, 64, 2),
    (8, 1, 8, 64, 4),
    (1, 8, 1, 16, 8),
    (4, 2, 4, 16, 4),
)
"""(stages, data, micro-batches, global batch, itemsize)."""


@checker
def check_pipeline_bytes(pipeline_bytes: Callable) -> bool:
    """``pipeline_bytes(n_stages, n_data, n_micro, cfg, global_batch, itemsize) -> {"stage", "data"}``: the
    bytes one device sends per step of ``pp_dp``, compared with :func:`course_lib.lm_costs.predict_bytes`
    (which the notebook checks against the compiled program) on hidden cases."""
    from course_lib import comms

    cfg = dataclasses.replace(transformer.TINY, n_layers=8)
    wrong = 0
    for p, d, m, batch, itemsize in _BYTES_CASES:
        what = f"pipeline_bytes({p}, {d}, {m}, cfg, {batch}, {itemsize})"
        got = call_answer(what, pipeline_bytes, p, d, m, cfg, batch, itemsize)
        if not isinstance(got, dict):
            fail(
                f"{what} returned {type(got).__name__}",
                'return a dict {"stage": bytes, "data": bytes}',
            )
        truth = comms.sent_by_axis(lm_costs.predict_bytes("pp_dp", cfg, batch, {"data": d, "stage": p},
                                                            itemsize=itemsize, n_micro=m))  # fmt: skip
        ok = all(math.isclose(float(got.get(a, 0.0)), truth.get(a, 0.0), rel_tol=1e-9, abs_tol=1e-6)
                 for a in ("stage", "data"))  # fmt: skip
        wrong += not ok
    if wrong:
        fail(
            f"{wrong} of {len(_BYTES_CASES)} cases are wrong",
            "forward and backward, a tick sends only when a later tick reads it (m + p - 2 sends each way); "
            "a mean over devices, the last stage sends nothing; the ring all-reduce sends 2(n-1)/n of its "
            "array; over data, a device's own stage's layers plus the embedding and head (and the loss)",
        )
    return passed(f"the pipeline's bytes per axis right in all {len(_BYTES_CASES)} cases")

"""Checker of lab 12's exercise 5: a layout's step time predicted by hand from its FLOPs, the bytes of its
collectives and the fabric's bandwidth and latency (``notebooks/12_transformer_lab.ipynb``; re-exported by
:mod:`course_tools.checks.lesson12`).

The answer is compared with :func:`course_lib.lm_costs.step_time` (``overlap="data"``, ``roofline=False``,
bfloat16, 8 devices), which it must not call (nor :func:`~course_lib.lm_costs.rank_layouts` or
:func:`~course_lib.lm_costs.flops_per_device`, which holds the 3 × forward). The cases are drawn afresh at
each call (``seed``: for tests): layouts, configurations, batches and fabrics (NVLink 4 and 3, the data or the
FSDP axis on InfiniBand), so that no constant passes and every call sees each part of the step: a compute part
at two chips' peaks (H100, A100), exposed collectives (TP, SP, CP) whose latency is more than the tolerance,
hidden ones larger than the compute (the gradients' all-reduce on InfiniBand beside the loss's: the max is
over their sum), FSDP's gathers over InfiniBand more than half the compute, and attention scores more than the
tolerance of the FLOPs (see :data:`_FAMILIES`). Judged within :data:`REL`; says how many cases are too slow
and too fast, never which (an answer that raises is shown the call, to rerun it); an answer off by 1000 in
every case is told its unit, one the same in every case that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from course_lib import costs, lm_costs, transformer

from ._common import checker, fail, passed, plain
from ._unaided import call_unaided

__all__ = ["check_step_time", "model_step"]

REL = 0.02
"""Relative tolerance: the loss's few bytes, FSDP's gathers counted per line or per parameter (hidden)."""
N_DEVICES = 8

_G = transformer.GPU
_FORBIDDEN = (lm_costs.step_time, lm_costs.rank_layouts, lm_costs.flops_per_device)
_CONFIGS = {
    "transformer.GPU": _G,
    "dataclasses.replace(transformer.GPU, n_layers=8)": dataclasses.replace(_G, n_layers=8),
    "dataclasses.replace(transformer.GPU, n_layers=32)": dataclasses.replace(_G, n_layers=32),
    "dataclasses.replace(transformer.GPU, seq_len=1024)": dataclasses.replace(_G, seq_len=1024),
}
_FABRICS = {
    'costs.FABRICS["H100"]': costs.FABRICS["H100"],
    'costs.FABRICS["A100"]': costs.FABRICS["A100"],
    'costs.FABRICS["H100"].with_axis("data", costs.LINKS["InfiniBand NDR"])': costs.FABRICS[
        "H100"
    ].with_axis("data", costs.LINKS["InfiniBand NDR"]),
    'costs.FABRICS["H100"].with_axis("fsdp", costs.LINKS["InfiniBand NDR"])': costs.FABRICS[
        "H100"
    ].with_axis("fsdp", costs.LINKS["InfiniBand NDR"]),
}
_NVLINK4 = tuple(name for name in _FABRICS if "H100" in name and "fsdp" not in name)
_IB = 'costs.FABRICS["H100"].with_axis("data", costs.LINKS["InfiniBand NDR"])'
_IB_FSDP = 'costs.FABRICS["H100"].with_axis("fsdp", costs.LINKS["InfiniBand NDR"])'
_ALL = tuple(_CONFIGS)
# (layouts, global batches, fabrics, configurations), one case each per call. TP and CP at small batches,
# where their exposed collectives are a large share; every layout at a larger one. The sixth: TP all-reduces
# at batch 8 on NVLink 4, whose α is more than twice the tolerance (an all-reduce's n-1 steps of α instead
# of 2(n-1) are seen every call). The seventh: the gradients' all-reduce on InfiniBand, more than the
# compute, beside the loss's (hidden traffic larger than the compute, as a sum; the data axis on a link that
# is not fabric.link). The eighth: FSDP's gathers over InfiniBand, more than half the compute. The ninth: the A100's
# peak (the others run on the H100's). The tenth: compute-bound steps whose attention scores are more than
# the tolerance (a 6N rule of FLOPs is seen)
_FAMILIES = (
    (("tp_sp", "3d"), (8, 16), tuple(_FABRICS), _ALL),
    (("dp_cp", "fsdp_tp"), (8, 16), tuple(_FABRICS), _ALL),
    (("tp_sp", "dp_cp", "3d", "fsdp_tp"), (32, 64), tuple(_FABRICS), _ALL),
    (("dp", "tp_sp"), (64, 128), tuple(_FABRICS), _ALL),
    (("tp_sp", "dp_cp"), (16, 32), tuple(_FABRICS), _ALL),
    (("3d", "fsdp_tp"), (8,), _NVLINK4, _ALL),
    (("tp_sp",), (8, 16), (_IB,), _ALL),
    (("fsdp_tp", "3d"), (8, 16), (_IB_FSDP,), _ALL),
    (("dp", "tp_sp", "dp_cp", "3d", "fsdp_tp"), (32, 64), ('costs.FABRICS["A100"]',), _ALL),
    (("dp", "tp_sp"), (32, 64), ('costs.FABRICS["H100"]', 'costs.FABRICS["A100"]'),
     ("transformer.GPU", "dataclasses.replace(transformer.GPU, n_layers=32)")),
)  # fmt: skip


def model_step(key: str, cfg, global_batch: int, fabric) -> float:
    """The step time the checker compares with: :func:`course_lib.lm_costs.step_time`'s ``step_s`` with the
    data-parallel traffic hidden and the FLOPs alone as the compute time."""
    return lm_costs.step_time(
        key, cfg, global_batch, fabric, N_DEVICES, overlap="data", roofline=False
    )["step_s"]


def _cases(rng) -> list[tuple[str, str, int, str]]:
    cases = []
    for keys, batches, fabrics, configs in _FAMILIES:
        key = keys[int(rng.integers(len(keys)))]
        cfg_name = configs[int(rng.integers(len(configs)))]
        batch = int(batches[int(rng.integers(len(batches)))])
        fabric_name = fabrics[int(rng.integers(len(fabrics)))]
        cases.append((key, cfg_name, batch, fabric_name))
    rng.shuffle(cases)
    return cases


@checker
def check_step_time(predict_step: Callable, *, seed: int | None = None) -> bool:
    """``predict_step(layout_key, cfg, global_batch, fabric) -> seconds``: layout ``layout_key``'s step on 8
    devices of ``fabric`` (bfloat16), compared with :func:`model_step` on cases drawn afresh (``seed``: for
    tests), within :data:`REL`. An answer that calls ``lm_costs.step_time``, ``rank_layouts`` or
    ``flops_per_device`` is refused."""
    cases = _cases(np.random.default_rng(seed))
    slow = fast = 0
    ratios, answers = [], []
    for key, cfg_name, batch, fabric_name in cases:
        cfg, fabric = _CONFIGS[cfg_name], _FABRICS[fabric_name]
        what = f"predict_step({key!r}, {cfg_name}, {batch}, {fabric_name})"
        got = call_unaided(
            what, predict_step, _FORBIDDEN,
            "build it from transformer.flops_per_token, the fabric's peak (costs.rate), "
            "lm_costs.predict_bytes and each collective's α + bytes / bandwidth: step_time is what the "
            "checker compares with",
            key, cfg, batch, fabric,
        )  # fmt: skip
        try:
            seconds = float(got)
        except (TypeError, ValueError):
            fail(f"{what} returned {plain(got)!r}", "return the step time in seconds, a float")
        truth = model_step(key, cfg, batch, fabric)
        ratios.append(seconds / truth)
        answers.append(seconds)
        if not abs(seconds - truth) <= REL * truth:
            slow += seconds > truth
            fast += seconds < truth
    if slow or fast:
        _fail_units(ratios, answers)
        hints = []
        if fast:
            hints.append(
                "too fast: something that takes time is missing — the backward pass (two matmuls for each "
                "of the forward's), each collective's latency (α per step: "
                "2(n-1) steps for an all-reduce, n-1 for an all-gather or a reduce-scatter), the "
                "all-reduce's two halves (2(n-1)/n of the array), the TP/SP/CP collectives, which are "
                "not hidden: the next matmul waits for them, or the hidden ones, which hide only as far as "
                "there is compute to hide behind; each collective on its own axis's link "
                "(fabric.link_of(t.axis)), the FLOPs at this fabric's chip's peak"
            )
        if slow:
            hints.append(
                "too slow: something is counted that the model hides or does not have — the gradients', "
                "the gathered parameters' and the loss's collectives hide behind the compute "
                "(they run while the GPU computes); the FLOPs are split over the 8 "
                "devices, at the chip's bfloat16 peak; an all-gather "
                "or a reduce-scatter sends (n-1)/n of its size_bytes, not all of it; size_bytes are bytes "
                "and bytes_per_s bytes per second (no factor 8 for bits)"
            )
        fail(
            f"{slow + fast} of {len(cases)} cases are wrong ({slow} too slow, {fast} too fast, by more "
            f"than {REL:.0%})",
            "; ".join(hints),
        )
    return passed(f"the step time right within {REL:.0%} in all {len(cases)} cases")


def _fail_units(ratios: list[float], answers: list[float]) -> None:
    """Refuses, naming it, an answer off by one factor in every case (a unit) or the same in every case."""
    for factor, unit in ((1e3, "milliseconds"), (1e6, "microseconds")):
        if all(abs(r / factor - 1) <= REL for r in ratios):
            fail(
                f"every case is {factor:g} x the step time",
                f"return seconds, not {unit}",
            )
    if max(answers) == min(answers):
        fail(
            f"the same answer, {answers[0]:g}, for every case",
            "a step time depends on the layout, the model, the batch and the fabric: compute it from them",
        )

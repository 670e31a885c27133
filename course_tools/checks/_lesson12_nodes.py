"""Checker of lab 12's exercise 1: which mesh axis crosses the nodes of a two-tier network, and the time its
collectives take (``notebooks/12_transformer_lab.ipynb``; re-exported by :mod:`course_tools.checks.lesson12`).

Two nodes of 8 devices (16 in all, :func:`course_lib.lm_layouts.mesh_axes` of the layout on 16): inside a
node every axis runs on the fabric's own link (NVLink, a TPU slice's ICI); the one axis that crosses the
nodes — and every collective whose group includes it — on the link between nodes (InfiniBand, the
data-centre network). The answer is compared with :func:`course_lib.lm_costs.step_time` on
:meth:`course_lib.chips.Fabric.with_axis`, which it must not call (nor :func:`~course_lib.lm_costs.rank_layouts`).
Judged: the axis (any axis within :data:`TIE` of the fastest placement is right: the model cannot tell
closer ones apart) and the communication time of that placement, within :data:`REL` plus whatever the
latency terms add (per predicted line, per collective the program runs, or none: bookkeeping, not the
lesson). Says how many cases are wrong in each part, never which.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from course_lib import costs, lm_costs, lm_layouts, transformer

from ._common import checker, fail, passed, plain
from ._unaided import call_unaided

__all__ = ["check_node_placement", "placement_times"]

TIE = 0.10
"""Placements within 10 % of the fastest are a tie: either axis is accepted."""
REL = 0.03
"""The time's relative tolerance (bytes of the loss, rounding), before the latency allowance."""
N_DEVICES = 16
"""Two nodes of 8."""

_G = transformer.GPU
_FORBIDDEN = (lm_costs.step_time, lm_costs.rank_layouts)
_CONFIGS = {
    "transformer.GPU": _G,
    "dataclasses.replace(transformer.GPU, n_layers=8)": dataclasses.replace(_G, n_layers=8),
    "dataclasses.replace(transformer.GPU, n_layers=32)": dataclasses.replace(_G, n_layers=32),
    "dataclasses.replace(transformer.GPU, seq_len=1024)": dataclasses.replace(_G, seq_len=1024),
    "dataclasses.replace(transformer.GPU, seq_len=4096)": dataclasses.replace(_G, seq_len=4096),
}
_TWO_TIER = {
    # (intra-node fabric, link between nodes), as code a learner can paste
    'costs.FABRICS["H100"], costs.LINKS["InfiniBand NDR"]': ("H100", "InfiniBand NDR"),
    'costs.FABRICS["H200"], costs.LINKS["InfiniBand NDR"]': ("H200", "InfiniBand NDR"),
    'costs.FABRICS["A100"], costs.LINKS["InfiniBand NDR"]': ("A100", "InfiniBand NDR"),
    'costs.FABRICS["TPU v5e"], costs.LINKS["DCN"]': ("TPU v5e", "DCN"),
}
# (layouts, global batches): small batches, where TP's activations are small beside the gradients; large
# ones, where they are not; the pipeline; context parallelism
_FAMILIES = (
    (("tp_sp", "fsdp_tp", "3d"), (8,)),
    (("tp_sp", "fsdp_tp", "3d"), (128, 256)),
    (("pp_dp",), (64, 128, 256)),
    (("dp_cp",), (16, 64)),
    (("tp_sp", "fsdp_tp", "3d", "dp_cp"), (16, 32, 64)),
    (("tp_sp", "fsdp_tp", "pp_dp", "dp_cp", "3d"), (64, 128)),
)


def placement_times(key: str, cfg, global_batch: int, fabric, inter_link) -> dict[str, float]:
    """Seconds of communication per step with each axis of ``key`` across the nodes (the model: the sum of
    :func:`course_lib.costs.collective_time` over the predicted transfers, bfloat16, ``4 × stages``
    micro-batches), per axis."""
    out = {}
    for axis in lm_layouts.mesh_axes(key, N_DEVICES):
        row = lm_costs.step_time(
            key, cfg, global_batch, fabric.with_axis(axis, inter_link), N_DEVICES
        )
        out[axis] = sum(row["comm_s"].values())
    return out


def _latency_allowance(key: str, cfg, global_batch: int, fabric, inter_link, axis: str) -> float:
    """The most the latency terms of ``axis``'s placement can differ by, however they are counted: every
    predicted line's ``steps × α``, times the parameter count for FSDP's lines (one collective per
    parameter in the program, one line in the prediction)."""
    sizes = lm_layouts.mesh_axes(key, N_DEVICES)
    m = 4 * sizes.get("stage", 1)
    two_tier = fabric.with_axis(axis, inter_link)
    n_leaves = (
        16 + 6
    )  # the blocks' leaves and the rest's (embeddings, positions, final LayerNorm, head)
    total = 0.0
    for t in lm_costs.predict_bytes(key, cfg, global_batch, sizes, itemsize=2, n_micro=m):
        alpha = costs.collective_time(t.kind, t.group_size, 0.0, two_tier.link_of(t.axis))
        total += alpha * (n_leaves if "gathered" in t.what or "reduce-scattered" in t.what else 2)
    return total


def _cases(rng) -> list[tuple]:
    cases = []
    for keys, batches in _FAMILIES:
        key = keys[int(rng.integers(len(keys)))]
        sizes = lm_layouts.mesh_axes(key, N_DEVICES)
        names = list(_CONFIGS)
        rng.shuffle(names)
        cfg_name = next(n for n in names if lm_costs.splits(key, _CONFIGS[n], max(batches), sizes))
        options = [b for b in batches if lm_costs.splits(key, _CONFIGS[cfg_name], b, sizes)]
        tier = list(_TWO_TIER)[int(rng.integers(len(_TWO_TIER)))]
        cases.append((key, cfg_name, int(options[int(rng.integers(len(options)))]), tier))
    rng.shuffle(cases)
    return cases


def _pair(got, what) -> tuple[str, float]:
    try:
        axis, seconds = got
        return str(axis), float(seconds)
    except (TypeError, ValueError):
        fail(f"{what} returned {plain(got)!r}", "return (axis, seconds), e.g. ('data', 0.042)")


@checker
def check_node_placement(across_nodes: Callable, *, seed: int | None = None) -> bool:
    """``across_nodes(layout_key, cfg, global_batch, fabric, inter_link) -> (axis, seconds)``: the mesh axis
    of ``layout_key`` on 16 devices (two nodes of 8) to put across the nodes, and the communication time per
    step of that placement, compared with :func:`placement_times` on cases drawn afresh (``seed``: for
    tests). An answer that calls ``lm_costs.step_time`` or ``lm_costs.rank_layouts`` is refused."""
    cases = _cases(np.random.default_rng(seed))
    wrong_axis = wrong_time = n_wrong = 0
    for key, cfg_name, batch, tier in cases:
        cfg = _CONFIGS[cfg_name]
        fabric_name, link_name = _TWO_TIER[tier]
        fabric, link = costs.FABRICS[fabric_name], costs.LINKS[link_name]
        what = f"across_nodes({key!r}, {cfg_name}, {batch}, {tier})"
        got = call_unaided(
            what, across_nodes, _FORBIDDEN,
            "time each placement from lm_costs.predict_bytes and costs.collective_time: step_time is what "
            "the checker compares with",
            key, cfg, batch, fabric, link,
        )  # fmt: skip
        axis, seconds = _pair(got, what)
        times = placement_times(key, cfg, batch, fabric, link)
        if axis not in times:
            fail(
                f"{what} returned the axis {axis!r}",
                f"one of this layout's axes on 16 devices: {list(times)}",
            )
        bad_axis = times[axis] > (1 + TIE) * min(times.values())
        # the time of the placement the answer chose (right or wrong), so that each count says one thing
        slack = REL * times[axis] + _latency_allowance(key, cfg, batch, fabric, link, axis)
        bad_time = not abs(seconds - times[axis]) <= slack
        wrong_axis, wrong_time = wrong_axis + bad_axis, wrong_time + bad_time
        n_wrong += bad_axis or bad_time
    if wrong_axis or wrong_time:
        hints = []
        if wrong_axis:
            hints.append(
                "the axis: the compute is the same wherever the axes go, so the placement with the least "
                "communication time wins; the axis across the nodes runs its collectives — and every "
                "collective over a group that includes it (e.g. 'data,model') — on inter_link, every other "
                "axis on the fabric's own link; which axis sends the most depends on the batch"
            )
        if wrong_time:
            hints.append(
                "the time (of the placement you return): sum costs.collective_time(t.kind, t.group_size, "
                "t.size_bytes, link) over "
                "lm_costs.predict_bytes(layout, cfg, batch, sizes, itemsize=2, n_micro=4 x stages) with "
                "sizes = lm_layouts.mesh_axes(layout, 16) and link = "
                "fabric.with_axis(axis, inter_link).link_of(t.axis)"
            )
        fail(
            f"{n_wrong} of {len(cases)} cases are wrong ({wrong_axis} with the wrong "
            f"axis, {wrong_time} with the time off by more than {REL:.0%} and the latency terms)",
            "; ".join(hints),
        )
    return passed(f"the axis across the nodes and its time right in all {len(cases)} cases")

"""Checker of lab 12's exercise 4: which mesh axis crosses the nodes of a two-tier network, and the time its
collectives take (``notebooks/12_transformer_lab.ipynb``; re-exported by :mod:`course_tools.checks.lesson12`).

Two nodes of 8 devices (16 in all, :func:`course_lib.lm_layouts.mesh_axes` of the layout on 16): inside a
node every axis runs on the fabric's own link (NVLink, a TPU slice's ICI); the one axis that crosses the
nodes — and every collective whose group includes it — on the link between nodes (InfiniBand, the
data-centre network). The answer is compared with :func:`course_lib.lm_costs.step_time` on
:meth:`course_lib.chips.Fabric.with_axis`, which it must not call (nor :func:`~course_lib.lm_costs.rank_layouts`).
Judged: the axis (any axis within :data:`TIE` of the fastest placement is right: the model cannot tell
closer ones apart) and the communication time of that placement, within :data:`REL` plus whatever the
latency terms add (per predicted line, per gather or reduce-scatter the program runs, or none: bookkeeping,
not the lesson; :func:`_latency_bounds`). Each call poses every layout at a batch on each side of its
crossover, every fabric and inter link, and two-axis groups (:func:`_cases`). Says how many cases are wrong
in each part, never which; where every wrong time is one slip (groups left on the fast link, no slow link at
all, 4-byte values: :data:`_SLIPS`), the hint names it.
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
_LAYOUTS = ("tp_sp", "fsdp_tp", "3d", "pp_dp", "dp_cp")
"""Every layout in every call, twice: a batch on each side of its crossover. ``tp_sp``, ``3d`` and ``dp_cp``
run collectives over two-axis groups (``"data,model"``, ``"data,fsdp"``, ``"data,context"``)."""
_BATCHES = (8, 16, 32, 64, 128, 256)


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


def _latency_bounds(
    key: str, cfg, global_batch: int, fabric, inter_link, axis: str
) -> tuple[float, float]:
    """How far below and above :func:`placement_times` the latency terms of ``axis``'s placement may take an
    answer, however they are counted: none at all (below: the model's every ``steps × α``), or a gather's or
    a reduce-scatter's once per collective the program runs (above: up to one per parameter leaf for each
    such predicted line, FSDP's parameters and SP's or CP's activations). Seconds, ``(below, above)``."""
    sizes = lm_layouts.mesh_axes(key, N_DEVICES)
    m = 4 * sizes.get("stage", 1)
    two_tier = fabric.with_axis(axis, inter_link)
    n_leaves = (
        16 + 6
    )  # the blocks' leaves and the rest's (embeddings, positions, final LayerNorm, head)
    below = above = 0.0
    for t in lm_costs.predict_bytes(key, cfg, global_batch, sizes, itemsize=2, n_micro=m):
        alpha = costs.collective_time(t.kind, t.group_size, 0.0, two_tier.link_of(t.axis))
        below += alpha
        if "gathered" in t.what or "reduce-scattered" in t.what:
            above += alpha * (n_leaves - 1)
    return below, above


_SLIPS = {
    "groups": "a collective over a group that includes the crossing axis (e.g. 'data,model') runs on the slow "
    "link too: a collective is as fast as the slowest link its group uses",
    "fast": "every collective was timed on the fast link: the crossing axis's collectives (and its groups') "
    "run on inter_link",
    "float32": "the times are those of 4-byte values: the lab trains in bfloat16, 2 bytes a value",
    "ms": "the times are 1000 x the model's: return seconds, not milliseconds",
}
"""Slips the time's hint names when every wrong time is one of them (:func:`_matching_slips`)."""


def _matching_slips(
    key: str, cfg, batch: int, fabric, inter_link, axis: str, seconds: float
) -> set[str]:
    """The slips of :data:`_SLIPS` whose time for ``axis``'s placement is within :data:`REL` of ``seconds``."""
    sizes = lm_layouts.mesh_axes(key, N_DEVICES)
    m = 4 * sizes.get("stage", 1)

    def total(itemsize: int, link_of) -> float:
        transfers = lm_costs.predict_bytes(key, cfg, batch, sizes, itemsize=itemsize, n_micro=m)
        return sum(
            costs.collective_time(t.kind, t.group_size, t.size_bytes, link_of(t.axis))
            for t in transfers
        )

    two_tier = fabric.with_axis(axis, inter_link)
    times = {
        "groups": total(2, lambda a: inter_link if a == axis else fabric.link_of(a)),
        "fast": total(2, fabric.link_of),
        "float32": total(4, two_tier.link_of),
    }
    right = total(2, two_tier.link_of)
    times["ms"] = right * 1e3
    return {
        name
        for name, t in times.items()
        if abs(t - right) > REL * right and abs(seconds - t) <= REL * t
    }


def _time_hint(matched: list[set[str]]) -> str:
    """The time's hint: the slip every wrong time shows, where one does; else what the time counts."""
    common = set.intersection(*matched) if matched else set()
    if common:
        return "the time (of the placement you return): " + "; ".join(
            _SLIPS[s] for s in sorted(common)
        )
    return (
        "the time (of the placement you return): every collective of one step on the 16-device mesh, "
        "bfloat16 values, the pipeline with 4 micro-batches per stage, each timed on the link its group "
        "uses (the crossing axis and every group that includes it on inter_link)"
    )


def _best(key: str, cfg, batch: int, fabric, inter_link) -> tuple[str, bool]:
    """The fastest axis across the nodes, and whether it beats every other by more than :data:`TIE`."""
    times = placement_times(key, cfg, batch, fabric, inter_link)
    best = min(times, key=times.get)
    return best, all(t > (1 + TIE) * times[best] for a, t in times.items() if a != best)


def _sides(key: str, cfg, fabric, inter_link) -> tuple[int, int]:
    """A batch on each side of ``key``'s crossover (the batch from which another axis belongs across the
    nodes), the nearest to it with a clear winner; the smallest and the largest batch where no axis takes
    over (the pipeline's stage, ``dp_cp``'s data)."""
    sizes = lm_layouts.mesh_axes(key, N_DEVICES)
    options = [b for b in _BATCHES if lm_costs.splits(key, cfg, b, sizes)]
    best = {b: _best(key, cfg, b, fabric, inter_link) for b in options}
    clear = [b for b in options if best[b][1]]
    first = best[clear[0]][0]
    after = [b for b in clear if best[b][0] != first]
    if not after:
        return clear[0], clear[-1]
    return max(b for b in clear if b < after[0]), after[0]


def _cases(rng) -> list[tuple]:
    """Every layout at a batch on each side of its crossover, every fabric and inter link (the four tiers
    over the five layouts), configurations drawn until no one batch threshold tells the tensor-parallel
    layouts' two sides apart (a rule "model across up to batch B" fails somewhere, whatever B)."""
    while True:
        tiers = list(_TWO_TIER)
        rng.shuffle(tiers)
        cases, pairs = [], set()
        for i, key in enumerate(_LAYOUTS):
            tier = tiers[i % len(tiers)]
            fabric, link = (costs.FABRICS[_TWO_TIER[tier][0]], costs.LINKS[_TWO_TIER[tier][1]])
            names = list(_CONFIGS)
            rng.shuffle(names)
            sizes = lm_layouts.mesh_axes(key, N_DEVICES)
            cfg_name = next(
                n for n in names if lm_costs.splits(key, _CONFIGS[n], max(_BATCHES), sizes)
            )
            small, large = _sides(key, _CONFIGS[cfg_name], fabric, link)
            if key not in ("pp_dp", "dp_cp"):
                pairs.add((small, large))
            cases += [(key, cfg_name, small, tier), (key, cfg_name, large, tier)]
        if max(p[0] for p in pairs) >= min(p[1] for p in pairs):
            break
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
    matched: list[set[str]] = []  # per case with a wrong time, the slips (_SLIPS) that explain it
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
        below, above = _latency_bounds(key, cfg, batch, fabric, link, axis)
        low, high = times[axis] * (1 - REL) - below, times[axis] * (1 + REL) + above
        bad_time = not low <= seconds <= high
        if bad_time:
            matched.append(_matching_slips(key, cfg, batch, fabric, link, axis, seconds))
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
            hints.append(_time_hint(matched))
        fail(
            f"{n_wrong} of {len(cases)} cases are wrong ({wrong_axis} with the wrong "
            f"axis, {wrong_time} with the time off by more than {REL:.0%} and the latency terms)",
            "; ".join(hints),
        )
    return passed(f"the axis across the nodes and its time right in all {len(cases)} cases")

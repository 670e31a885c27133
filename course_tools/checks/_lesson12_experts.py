"""Checker of lab 12's exercise 3: the seconds one ``ep_dp`` step spends in its all-to-alls over the
``expert`` axis (``notebooks/12_transformer_lab.ipynb``; re-exported by :mod:`course_tools.checks.lesson12`).

The answer is compared with :func:`model_seconds`: the course's one time model on the all-to-alls that
:func:`course_lib.lm_experts.predict_bytes` predicts (:func:`course_lib.costs.collective_time` on the
``expert`` axis's link: ``(n − 1)·α + (n − 1)/n · bytes ÷ bandwidth`` on a switch), which is
:func:`course_lib.lm_experts.step_time`'s ``critical_s`` (asserted in ``tests/test_checks_lesson12.py``).
An answer that calls ``lm_experts.predict_bytes`` or ``lm_experts.step_time`` is refused (:mod:`._unaided`).
The cases are drawn afresh at each call (``seed``: for tests): expert axes of 2 and 4 devices, data axes of
1 to 8, capacity factors 1.0, 1.25 and 2.0, several widths and batches, and four switch fabrics (NVLink 4
and 3, the expert axis or the data axis on InfiniBand). Judged within :data:`REL`; says how many cases are
too slow and too fast, never which (an answer that raises is shown the call, to rerun it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from course_lib import costs, lm_costs, lm_experts, transformer  # noqa: F401  (lm_costs first: imports)

from ._common import checker, fail, passed, plain
from ._unaided import call_unaided

__all__ = ["check_expert_a2a_seconds", "model_seconds"]

REL = 0.01
"""Relative tolerance: the model's own formula, in float64 (the capacity's rounding up is the learner's)."""

_G = transformer.GPU
_FORBIDDEN = (lm_experts.predict_bytes, lm_experts.step_time)
_CONFIGS = {
    "transformer.GPU": _G,
    "dataclasses.replace(transformer.GPU, n_layers=8)": dataclasses.replace(_G, n_layers=8),
    "dataclasses.replace(transformer.GPU, seq_len=1024)": dataclasses.replace(_G, seq_len=1024),
    "dataclasses.replace(transformer.GPU, d_model=1024, n_heads=8)": dataclasses.replace(
        _G, d_model=1024, n_heads=8
    ),
}
_IB = costs.LINKS["InfiniBand NDR"]
_FABRICS = {
    'costs.FABRICS["H100"]': costs.FABRICS["H100"],
    'costs.FABRICS["A100"]': costs.FABRICS["A100"],
    'costs.FABRICS["H100"].with_axis("expert", costs.LINKS["InfiniBand NDR"])': costs.FABRICS[
        "H100"
    ].with_axis("expert", _IB),
    'costs.FABRICS["H100"].with_axis("data", costs.LINKS["InfiniBand NDR"])': costs.FABRICS[
        "H100"
    ].with_axis("data", _IB),
}
# (expert axis, capacity factor) per case, None drawn: both expert axes and every factor at every call
_FAMILIES = ((2, 1.0), (4, 1.25), (2, 2.0), (4, None), (None, 1.25), (None, None))


def model_seconds(cfg, global_batch: int, sizes: dict, fabric, capacity_factor: float) -> float:
    """Seconds of one step's all-to-alls over ``expert`` in the course's time model: every all-to-all of
    :func:`course_lib.lm_experts.predict_bytes` (bfloat16) at :func:`course_lib.costs.collective_time` on
    its axis's link."""
    transfers = lm_experts.predict_bytes(
        cfg, global_batch, sizes, itemsize=2, capacity_factor=capacity_factor
    )
    return sum(
        costs.collective_time(t.kind, t.group_size, t.size_bytes, fabric.link_of(t.axis))
        for t in transfers
        if t.kind == "all-to-all"
    )


def _cases(rng) -> list[tuple[str, int, dict, str, float]]:
    """(config as code, global batch, sizes, fabric as code, capacity factor): every fabric at every call."""
    fabrics = [list(_FABRICS)[i] for i in rng.permutation(len(_FABRICS))]
    cases = []
    for i, (n_e, factor) in enumerate(_FAMILIES):
        n_e = n_e or int(rng.choice([2, 4]))
        factor = factor or float(rng.choice([1.0, 1.25, 2.0]))
        n_d = int(rng.choice([1, 2, 4, 8]))
        batch = n_d * n_e * int(rng.choice([1, 2, 4, 8]))
        cfg_name = list(_CONFIGS)[int(rng.integers(len(_CONFIGS)))]
        sizes = {"data": n_d, "expert": n_e}
        cases.append((cfg_name, batch, sizes, fabrics[i % len(fabrics)], factor))
    rng.shuffle(cases)
    return cases


@checker
def check_expert_a2a_seconds(expert_a2a_seconds: Callable, *, seed: int | None = None) -> bool:
    """``expert_a2a_seconds(cfg, global_batch, sizes, fabric, capacity_factor) -> seconds``: the time one
    ``ep_dp`` step spends in its all-to-alls over ``expert`` on ``fabric`` (bfloat16), compared with
    :func:`model_seconds` on cases drawn afresh (``seed``: for tests), within :data:`REL`. An answer that
    calls ``lm_experts.predict_bytes`` or ``lm_experts.step_time`` is refused."""
    cases = _cases(np.random.default_rng(seed))
    slow = fast = 0
    ratios = []
    for cfg_name, batch, sizes, fabric_name, factor in cases:
        cfg, fabric = _CONFIGS[cfg_name], _FABRICS[fabric_name]
        what = f"expert_a2a_seconds({cfg_name}, {batch}, {sizes!r}, {fabric_name}, {factor!r})"
        got = call_unaided(
            what, expert_a2a_seconds, _FORBIDDEN,
            "count the buffer from moe.capacity and the shapes, and each all-to-all's α and bytes on the "
            "expert axis's link: predict_bytes and step_time are what the checker compares with",
            cfg, batch, dict(sizes), fabric, factor,
        )  # fmt: skip
        try:
            seconds = float(got)
        except (TypeError, ValueError):
            fail(
                f"{what} returned {plain(got)!r}",
                "return the all-to-alls' time in seconds, a float",
            )
        truth = model_seconds(cfg, batch, sizes, fabric, factor)
        ratios.append(seconds / truth)
        if not abs(seconds - truth) <= REL * truth:
            slow += seconds > truth
            fast += seconds < truth
    if slow or fast:
        if all(abs(r / 1e3 - 1) <= REL for r in ratios):
            fail("every case is 1000 x the model's time", "return seconds, not milliseconds")
        hints = []
        if fast:
            hints.append(
                "too fast: the model charges more — 4 all-to-alls per layer (dispatch and return, forward "
                "and backward), each n_e - 1 steps of α, the buffer [E, C, D] with E all the experts "
                "(lm_experts.N_EXPERTS, not E / n_e) and C = moe.capacity(tokens, E, lm_experts.TOP_K, "
                "capacity_factor) (each token takes k places) at 2 bytes (bfloat16), and the expert axis's own "
                'link (fabric.link_of("expert"): it may be the slow one)'
            )
        if slow:
            hints.append(
                "too slow: the model charges less — C counts the places for the tokens ONE device routes "
                "(global_batch / (n_data x n_expert) sequences of seq_len), not the whole batch's; a value "
                "is 2 bytes (bfloat16), not 4; a device keeps 1/n_e of its buffer and sends (n_e - 1)/n_e; "
                "the expert axis's link (fabric.link_of(\"expert\")), not another axis's"
            )
        fail(
            f"{slow + fast} of {len(cases)} cases are wrong ({slow} too slow, {fast} too fast, by more "
            f"than {REL:.0%})",
            "; ".join(hints),
        )
    return passed(
        f"the expert axis's all-to-all time right within {REL:.0%} in all {len(cases)} cases"
    )

"""Lab 12's checkers against the wrong answers a red team found accepted by an earlier version (exercise 4:
a hard-coded rule, ``fabric`` or ``inter_link`` ignored, a two-axis group on one link, a switch formula on a
ring; exercise 5: hidden traffic never counted, one link for every axis, the max of the hidden collectives,
H100's peak, FSDP's gathers added, 6N FLOPs; exercise 2: a count that is not an int, a search capped at 64
or 100 layers): each refused on every seed of :data:`SEEDS`, the right answers accepted on the same seeds,
and the properties of the drawn cases that make it so asserted on their own."""

from functools import partial

import answers_lesson12 as a
import answers_lesson12_nodes as n
import answers_lesson12_redteam as r
import numpy as np
import pytest
from checking import rejects

from course_lib import costs, lm_costs, lm_layouts, transformer
from course_tools.checks import _lesson12_nodes as nodes
from course_tools.checks import _lesson12_time as timing
from course_tools.checks import lesson12

SEEDS = tuple(range(10))


# ---- exercise 4 ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_node_placement_right_answers_pass(seed):
    for answer in (n.reference, n.through_costs_step_time, n.latency_left_out):
        assert lesson12.check_node_placement(answer, seed=seed), answer.__name__


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "answer, part",
    [
        (r.across_rule_of_thumb, "the axis"),
        (r.across_h100_ib_hardcoded, "the time"),
        (r.across_h100_hardcoded, "the time"),
        (r.across_ib_hardcoded, "the time"),
        (r.across_group_first_axis, "hint: "),
        (r.across_switch_formula_on_a_ring, "the time"),
    ],
)
def test_node_placement_refuses(answer, part, seed):
    rejects(
        partial(lesson12.check_node_placement, seed=seed),
        answer,
        match=rf"\d+ of {2 * len(nodes._LAYOUTS)} cases are wrong.*{part}",
    )


def _tier(tier):
    fabric, link = nodes._TWO_TIER[tier]
    return costs.FABRICS[fabric], costs.LINKS[link]


@pytest.mark.parametrize("seed", range(4))
def test_node_cases_cover_every_tier_both_sides_and_a_group(seed):
    """Every fabric and inter link in each call; every layout twice, on both sides of its crossover where
    it has one in the batches drawn (the fastest axis at the smaller batch is not the one at the larger,
    and each is a clear winner); a collective over a two-axis group."""
    cases = nodes._cases(np.random.default_rng(seed))
    assert {t for *_, t in cases} == set(nodes._TWO_TIER)
    groups = set()
    for key in nodes._LAYOUTS:
        mine = sorted((b, c, t) for k, c, b, t in cases if k == key)
        assert len(mine) == 2 and mine[0][1:] == mine[1][1:]
        (small, cfg_name, tier), (large, *_) = mine
        cfg, fabric_link = nodes._CONFIGS[cfg_name], _tier(tier)
        below = nodes._best(key, cfg, small, *fabric_link)
        above = nodes._best(key, cfg, large, *fabric_link)
        assert below[1] and above[1], (key, small, large)
        sizes = lm_layouts.mesh_axes(key, 16)
        others = [b for b in nodes._BATCHES if lm_costs.splits(key, cfg, b, sizes)]
        if any(nodes._best(key, cfg, b, *fabric_link) == (not_first, True) for b in others
               for not_first in set(sizes) - {below[0]}):  # fmt: skip
            assert below[0] != above[0], (key, small, large)  # a crossover: both sides
        sizes = lm_layouts.mesh_axes(key, 16)
        groups |= {
            t.axis
            for t in lm_costs.predict_bytes(key, cfg, small, sizes, itemsize=2)
            if "," in t.axis
        }
    assert groups


def test_node_time_allowance_is_what_latency_counting_needs():
    """Below the model, the allowance is the α-free answer's time less 3 % (no more: an answer 5 % under
    the α-free time is refused); above, the gathers' and reduce-scatters' α once per parameter leaf."""
    for key in nodes._LAYOUTS:
        cfg, batch = transformer.GPU, 64
        fabric, link = costs.FABRICS["H100"], costs.LINKS["InfiniBand NDR"]
        times = nodes.placement_times(key, cfg, batch, fabric, link)
        axis, no_alpha = n.latency_left_out(key, cfg, batch, fabric, link)
        below, above = nodes._latency_bounds(key, cfg, batch, fabric, link, axis)
        low = times[axis] * (1 - nodes.REL) - below
        assert no_alpha >= low > 0.95 * no_alpha, key
        assert above >= 0.0


# ---- exercise 5 ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_step_time_right_answers_pass(seed):
    for answer in (a.predict_step, a.predict_step_by_collective_time, a.predict_step_by_costs):
        assert lesson12.check_step_time(answer, seed=seed), answer.__name__


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "answer, side",
    [
        (r.step_no_max, "too fast"),
        (r.step_fabric_link, "too fast"),
        (r.step_hidden_max, "too fast"),
        (r.step_h100_peak, "too fast"),
        (r.step_gathers_exposed, "too slow"),
        (r.step_six_n, "too fast"),
    ],
)
def test_step_time_refuses(answer, side, seed):
    rejects(
        partial(lesson12.check_step_time, seed=seed),
        answer,
        match=rf"\d+ of {len(timing._FAMILIES)} cases are wrong.*hint: .*{side}",
    )


def _parts(key, cfg, batch, fabric):
    sizes = lm_layouts.mesh_axes(key, 8)
    compute = (
        3
        * transformer.flops_per_token(cfg)
        * batch
        * cfg.seq_len
        / 8
        / costs.rate(fabric.chip, "bfloat16")
    )
    hidden = {}
    for t in lm_costs.predict_bytes(key, cfg, batch, sizes, itemsize=2):
        if t.what.startswith(("gradients", "parameters gathered", "loss")):
            s = costs.collective_time(t.kind, t.group_size, t.size_bytes, fabric.link_of(t.axis))
            hidden[t.what] = hidden.get(t.what, 0.0) + s
    return compute, hidden


@pytest.mark.parametrize("seed", range(4))
def test_step_time_cases_see_every_part(seed):
    """Each call: hidden traffic larger than the compute with several hidden collectives; a data axis on a
    link that is not ``fabric.link``; two chips' peaks; an FSDP case whose gathers are a large share."""
    cases = timing._cases(np.random.default_rng(seed))
    fabrics = [timing._FABRICS[f] for *_, f in cases]
    assert len({f.chip.bf16 for f in fabrics}) >= 2
    assert any(f.link_of("data") != f.link for f in fabrics)
    over = gathers = False
    for key, cfg_name, batch, fabric_name in cases:
        compute, hidden = _parts(
            key, timing._CONFIGS[cfg_name], batch, timing._FABRICS[fabric_name]
        )
        over |= len(hidden) >= 2 and sum(hidden.values()) > 1.5 * compute
        gathered = sum(s for w, s in hidden.items() if w.startswith("parameters gathered"))
        gathers |= gathered > 0.5 * compute
    assert over and gathers


def test_step_time_case_as_code_is_the_case():
    import dataclasses

    scope = {"dataclasses": dataclasses, "transformer": transformer, "costs": costs}
    for *_, fabric_names, config_names in timing._FAMILIES:
        assert set(fabric_names) <= set(timing._FABRICS) and set(config_names) <= set(
            timing._CONFIGS
        )
    for code, fabric in timing._FABRICS.items():
        assert eval(code, scope) == fabric


# ---- exercise 2 ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_largest_model_right_answers_pass(seed):
    assert lesson12.check_largest_model(a.largest_model, seed=seed)
    assert lesson12.check_largest_model(a.largest_model_search, seed=seed)
    assert lesson12.check_largest_model(lambda *args: np.int64(a.largest_model(*args)), seed=seed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "answer, match",
    [
        (r.largest_as_string, r"returned '\d+' \(str\).*as an int"),
        (r.largest_as_float, r"returned \d+\.0 \(float\).*as an int"),
        (r.largest_half_layer_more, r"returned \d+\.5 \(float\).*as an int"),
        (lambda *args: a.largest_model(*args) > 0, r"\(bool\).*as an int"),
        (r.largest_capped_at(64), r"\d+ of 14 cases are wrong.*too few"),
        (r.largest_capped_at(100), r"\d+ of 14 cases are wrong.*too few"),
    ],
)
def test_largest_model_refuses(answer, match, seed):
    rejects(partial(lesson12.check_largest_model, seed=seed), answer, match=match)


def test_largest_model_cases_reach_past_100_layers():
    for seed in range(10):
        cases = lesson12._fit_cases(np.random.default_rng(seed))
        assert max(lm_costs.largest_layers(k, c, b, m) for k, c, b, m in cases) > 100

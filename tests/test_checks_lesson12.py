"""Exercise checkers of lesson 12 (course_tools.checks.lesson12): each accepts the reference answer and
other correct forms, rejects typical wrong answers with its own hint (a lookup of the function the checker
compares with among them), and prints "not written yet" for the student stub. Every checker is analytic (no
compile) and draws its cases afresh; the tests fix the seed. The whole file runs in well under a minute."""

import dataclasses
import sys
from functools import partial

import answers_lesson12 as a
import answers_lesson12_experts as x
import answers_lesson12_nodes as n
import numpy as np
import pytest
from checking import not_written, rejects, stub, tpu_rules

from course_lib import costs, lm_costs, lm_experts, lm_layouts, transformer
from course_tools.checks import _lesson12_experts as experts
from course_tools.checks import _lesson12_nodes as nodes
from course_tools.checks import _lesson12_time as timing
from course_tools.checks import lesson12

SEEDS = (0, 1)
N_NODE_CASES = 2 * len(nodes._LAYOUTS)


def test_stubs_print_not_written(monkeypatch, capsys):
    not_written(lesson12.check_node_placement, stub, monkeypatch=monkeypatch, capsys=capsys)
    not_written(lesson12.check_largest_model, stub, monkeypatch=monkeypatch, capsys=capsys)
    not_written(lesson12.check_pipeline_bytes, stub, monkeypatch=monkeypatch, capsys=capsys)
    not_written(lesson12.check_step_time, stub, monkeypatch=monkeypatch, capsys=capsys)


@pytest.mark.parametrize("seed", SEEDS)
def test_node_placement_accepts_correct_forms(seed):
    assert lesson12.check_node_placement(n.reference, seed=seed)
    assert lesson12.check_node_placement(n.through_costs_step_time, seed=seed)
    # how the latency is counted is bookkeeping: none at all is accepted too
    assert lesson12.check_node_placement(n.latency_left_out, seed=seed)
    assert lesson12.check_node_placement(n.by_group_membership, seed=seed)  # the notebook's form


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "answer, part",
    [
        (n.first_axis_across, "the axis"),
        (n.all_on_the_fast_link, "the time"),
        (n.groups_left_inside, "the time"),
        (n.no_ring_factor, "the time"),
        (n.busiest_across, "the axis"),
    ],
)
def test_node_placement_rejects(answer, part, seed):
    rejects(
        partial(lesson12.check_node_placement, seed=seed),
        answer,
        match=rf"\d+ of {N_NODE_CASES} cases are wrong.*hint: .*{part}",
    )


@pytest.mark.parametrize(
    "answer, slip",
    [
        (n.float32_bytes, "4-byte values"),
        (n.groups_inside_best_axis, "runs on the slow link too"),
        (n.all_on_the_fast_link, "every collective was timed on the fast link"),
        (n.in_milliseconds, "return seconds, not milliseconds"),
    ],
)
def test_node_placement_names_a_slip_every_wrong_time_shows(answer, slip):
    rejects(
        partial(lesson12.check_node_placement, seed=0), answer, match=f"hint: .*the time.*{slip}"
    )


def test_node_placement_cases_pose_both_answers():
    """Every call has a case where the model axis belongs across the nodes (a small batch: TP's activations
    are smaller than the gradients) and one where it does not; and no case is a near-tie the checker would
    have to guess (the fastest placement beats the next by more than the tie margin, or is accepted)."""
    for seed in range(4):
        crossing = set()
        for key, cfg_name, batch, tier in nodes._cases(np.random.default_rng(seed)):
            fabric, link = (
                costs.FABRICS[nodes._TWO_TIER[tier][0]],
                costs.LINKS[nodes._TWO_TIER[tier][1]],
            )
            times = nodes.placement_times(key, nodes._CONFIGS[cfg_name], batch, fabric, link)
            crossing.add(min(times, key=times.get))
        assert "model" in crossing and crossing & {"data", "fsdp", "stage"}, (seed, crossing)


def test_the_case_as_code_is_the_case():
    scope = {"dataclasses": dataclasses, "transformer": transformer, "costs": costs}
    for code, cfg in nodes._CONFIGS.items():
        assert eval(code, scope) == cfg
    for code, (fabric, link) in nodes._TWO_TIER.items():
        assert eval(f"({code})", scope) == (costs.FABRICS[fabric], costs.LINKS[link])


def test_node_placement_refuses_the_library():
    rejects(
        lesson12.check_node_placement,
        n.by_the_library,
        match="calls lm_\\w+\\.step_time.*collective_time",
    )


@pytest.mark.parametrize(
    "answer, match",
    [
        (a.across_in_a_thread, "calls lm_\\w+\\.step_time"),
        (a.across_by_code_copy, "calls lm_\\w+\\.step_time"),
        (a.across_without_the_hook, "switched off or replaced the checker's profile hook"),
    ],
)
def test_node_placement_refuses_the_bypasses(answer, match):
    rejects(lesson12.check_node_placement, answer, match=match)
    # the real functions are back, and the profile hook the caller had
    assert lm_costs.step_time.__code__.co_name == "step_time"
    assert lm_costs.step_time("dp", transformer.TINY, 8, lm_costs.FABRICS["H100"])
    assert sys.getprofile() is None and not hasattr(lm_costs, "_course_refused_call_")


@pytest.mark.parametrize(
    "check, name",
    [
        (lesson12.check_node_placement, "across_nodes"),
        (lesson12.check_largest_model, "largest_model"),
        (lesson12.check_pipeline_bytes, "pipeline_bytes"),
        (lesson12.check_step_time, "predict_step"),
        (lesson12.check_expert_a2a_seconds, "expert_a2a_seconds"),
    ],
)
def test_an_answer_that_raises_is_told_its_case_as_code_it_can_rerun(check, name):
    seen = []

    def raises(*args):
        seen.append(args)
        raise ZeroDivisionError("my bug")

    with pytest.raises(AssertionError) as e:
        check(raises, seed=0)
    message = str(e.value)
    assert "raised ZeroDivisionError: my bug" in message and "hint: run " in message
    call = message.split("✗ ", 1)[1].split(" raised ", 1)[0]
    assert call.startswith(f"{name}(")
    scope = {"dataclasses": dataclasses, "transformer": transformer, "lm_costs": lm_costs,
             "costs": costs, name: lambda *args: args}  # fmt: skip
    assert eval(call, scope) == seen[0]  # the printed call is the case, exactly


def test_largest_model_refuses_a_lookup_in_a_thread():
    rejects(
        lesson12.check_largest_model, a.largest_in_a_thread, match="calls lm_\\w+\\.largest_layers"
    )


def test_the_guard_keeps_a_callers_profile_hook():
    def hook(frame, event, arg):
        pass

    sys.setprofile(hook)
    try:
        assert lesson12.check_node_placement(n.reference, seed=0)
    finally:
        restored = sys.getprofile()
        sys.setprofile(None)
    assert restored is hook


def test_node_placement_says_how_many_not_which():
    with pytest.raises(AssertionError) as e:
        lesson12.check_node_placement(n.first_axis_across, seed=0)
    message = str(e.value)
    assert f"of {N_NODE_CASES} cases are wrong" in message
    assert "H100" not in message and "transformer" not in message and "across_nodes(" not in message


def test_cases_are_drawn_afresh():
    assert nodes._cases(np.random.default_rng(0)) != nodes._cases(np.random.default_rng(1))
    assert lesson12._fit_cases(np.random.default_rng(0)) != lesson12._fit_cases(
        np.random.default_rng(1)
    )
    assert lesson12._bytes_cases(np.random.default_rng(0)) != lesson12._bytes_cases(
        np.random.default_rng(1)
    )


def test_node_placement_rejects_a_malformed_answer():
    rejects(lesson12.check_node_placement, lambda *args: "data", match="return \\(axis, seconds\\)")
    rejects(
        lesson12.check_node_placement,
        lambda *args: ("nodes", 1.0),
        match="one of this layout's axes",
    )


def test_a_returned_value_is_shown_with_plain_numbers():
    # NumPy 2 writes np.float64(1.5): the message shows what the learner would print, 1.5
    with pytest.raises(AssertionError) as e:
        lesson12.check_node_placement(lambda *args: (np.float64(1.5),), seed=0)
    assert "returned (1.5,)" in str(e.value) and "np." not in str(e.value)
    with pytest.raises(AssertionError) as e:
        lesson12.check_largest_model(lambda *args: [np.int64(8)], seed=0)
    assert "returned [8]" in str(e.value) and "np." not in str(e.value)


@pytest.mark.parametrize("seed", SEEDS)
def test_largest_model(seed):
    assert lesson12.check_largest_model(a.largest_model, seed=seed)
    assert lesson12.check_largest_model(a.largest_model_search, seed=seed)
    if seed:  # the wrong answers search a layer at a time: once is enough
        return
    for wrong, side in (
        (a.largest_no_optimizer, "too many"),
        (a.largest_any_count, "too many"),
        (a.largest_off_by_one, "too many"),
        (a.largest_gpu_always, "too"),
        (a.largest_below_limit, "too few"),
        (a.largest_by_line, "too"),
        (a.largest_per_device_batch, "too many"),
        (a.largest_limit_as_gib, "every wrong count is the one for the limit read as GiB"),
        (a.largest_float32, "every wrong count is the one of 4-byte values"),
        (a.largest_four_micro_batches, "only the pipeline's counts are wrong: it runs 4 micro"),
    ):
        rejects(
            partial(lesson12.check_largest_model, seed=seed),
            wrong,
            match=rf"\d+ of 14 cases are wrong.*hint: {side}",
        )


def test_largest_model_refuses_a_lookup():
    rejects(
        lesson12.check_largest_model,
        a.largest_by_lookup,
        match="calls lm_\\w+\\.largest_layers.*predict_memory",
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_pipeline_bytes(seed):
    assert lesson12.check_pipeline_bytes(a.pipeline_bytes, seed=seed)
    assert lesson12.check_pipeline_bytes(a.pipeline_bytes_by_parts, seed=seed)
    for wrong, axis in (
        (a.pipeline_every_tick, "stage"),
        (a.pipeline_forward_only, "stage"),
        (a.pipeline_every_device_sends, "stage"),
        (a.pipeline_half_ring, "stage"),
        (a.pipeline_no_loss, "data"),
        (a.pipeline_whole_batch, "stage"),
    ):
        rejects(
            partial(lesson12.check_pipeline_bytes, seed=seed),
            wrong,
            match=rf"\d of 8 cases are wrong.*hint: .*{axis}: ",
        )
    rejects(lesson12.check_pipeline_bytes, lambda *args: 3.0, match="return a dict")
    rejects(
        lesson12.check_pipeline_bytes, a.pipeline_by_lookup, match="calls lm_costs.predict_bytes"
    )


def test_tpu_rules_change_nothing(monkeypatch):
    """The checkers are analytic (NumPy on the host, no float64 program, no tolerance from the platform): on
    a TPU they accept the references and refuse the wrong answers as on CPU."""
    assert tpu_rules(monkeypatch) > 1e-3
    assert lesson12.check_node_placement(n.reference, seed=0)
    assert lesson12.check_largest_model(a.largest_model, seed=0)
    assert lesson12.check_pipeline_bytes(a.pipeline_bytes, seed=0)
    rejects(
        partial(lesson12.check_node_placement, seed=0),
        n.first_axis_across,
        match=rf"\d+ of {N_NODE_CASES} cases are wrong.*hint: .*the axis",
    )
    rejects(
        partial(lesson12.check_largest_model, seed=0),
        a.largest_off_by_one,
        match=r"\d+ of 14 cases are wrong.*hint: too many",
    )
    rejects(
        partial(lesson12.check_pipeline_bytes, seed=0),
        a.pipeline_no_loss,
        match=r"\d of 8 cases are wrong.*hint: .*data: ",
    )


# ---- exercise 5: a layout's step time, by hand ---------------------------------------------------------------

N_TIME_CASES = len(timing._FAMILIES)


@pytest.mark.parametrize("seed", SEEDS)
def test_step_time_accepts_correct_forms(seed):
    assert lesson12.check_step_time(a.predict_step, seed=seed)
    assert lesson12.check_step_time(a.predict_step_by_collective_time, seed=seed)
    assert lesson12.check_step_time(a.predict_step_by_costs, seed=seed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "answer, side",
    [
        (a.step_forward_only, "too fast"),
        (a.step_bytes_once, "too"),
        (a.step_no_latency, "too fast"),
        (a.step_no_overlap, "too slow"),
        (a.step_all_hidden, "too fast"),
        (a.step_all_reduce_alpha_once, "too fast: .*2\\(n-1\\) steps for an all-reduce"),
        (a.step_in_bits, "too slow: .*no factor 8 for bits"),
        (a.step_float32_peak, "too slow: .*bfloat16 peak"),
    ],
)
def test_step_time_rejects(answer, side, seed):
    rejects(
        partial(lesson12.check_step_time, seed=seed),
        answer,
        match=rf"\d of {N_TIME_CASES} cases are wrong.*hint: .*{side}",
    )


def test_step_time_refuses_the_library_and_odd_answers():
    rejects(lesson12.check_step_time, a.step_by_the_library, match="calls lm_\\w+\\.step_time")
    rejects(lesson12.check_step_time, lambda *args: "fast", match="return the step time in seconds")
    rejects(lesson12.check_step_time, a.step_in_milliseconds, match="1000 x.*not milliseconds")
    rejects(lesson12.check_step_time, a.step_constant, match="same answer.*depends on the layout")


def test_step_time_every_call_sees_an_all_reduces_latency():
    """Whatever the draw, one case's all-reduce α is over the tolerance: n-1 steps instead of 2(n-1) fail."""
    for seed in range(20):
        rejects(
            partial(lesson12.check_step_time, seed=seed),
            a.step_all_reduce_alpha_once,
            match="too fast",
        )


def test_step_time_no_constant_passes_and_cases_are_drawn_afresh():
    """The cases' step times differ by more than the tolerance (a constant cannot pass), and every case's
    exposed collectives' latency exceeds the tolerance somewhere (an answer without α cannot pass)."""
    for seed in range(3):
        cases = timing._cases(np.random.default_rng(seed))
        truths = sorted(
            timing.model_step(k, timing._CONFIGS[c], b, timing._FABRICS[f]) for k, c, b, f in cases
        )
        assert truths[-1] > (1 + 2 * timing.REL) * truths[0]
    assert timing._cases(np.random.default_rng(0)) != timing._cases(np.random.default_rng(1))


def test_step_time_case_as_code_is_the_case():
    scope = {"dataclasses": dataclasses, "transformer": transformer, "costs": costs}
    for code, cfg in timing._CONFIGS.items():
        assert eval(code, scope) == cfg
    for code, fabric in timing._FABRICS.items():
        assert eval(code, scope) == fabric


# ---- exercise 3: ep_dp's all-to-alls over the expert axis, in seconds -----------------------------------------

N_A2A_CASES = len(experts._FAMILIES)


@pytest.mark.parametrize("seed", SEEDS)
def test_expert_a2a_accepts_correct_forms(seed):
    assert lesson12.check_expert_a2a_seconds(x.reference, seed=seed)
    assert lesson12.check_expert_a2a_seconds(x.by_collective_time, seed=seed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "answer, hint",
    [
        (x.float32, "too slow: .*2 bytes \\(bfloat16\\), not 4"),
        (x.whole_buffer, "too slow: .*sends \\(n_e - 1\\)/n_e"),
        (x.two_per_layer, "too fast: .*4 all-to-alls per layer"),
        (x.whole_batch_capacity, "too slow: .*tokens ONE device routes"),
        (
            x.top_one,
            "too fast: .*lm_experts.TOP_K, capacity_factor\\) \\(each token takes k places\\)",
        ),
    ],
)
def test_expert_a2a_rejects(answer, hint, seed):
    rejects(
        partial(lesson12.check_expert_a2a_seconds, seed=seed),
        answer,
        match=rf"\d of {N_A2A_CASES} cases are wrong.*hint: .*{hint}",
    )


def test_expert_a2a_refuses_the_library_and_odd_answers(monkeypatch, capsys):
    not_written(lesson12.check_expert_a2a_seconds, stub, monkeypatch=monkeypatch, capsys=capsys)
    for answer in (x.by_the_library, x.by_the_step_time):
        rejects(
            lesson12.check_expert_a2a_seconds,
            answer,
            match="calls lm_experts\\.(predict_bytes|step_time).*moe.capacity",
        )
    assert lm_experts.predict_bytes.__code__.co_name == "predict_bytes"  # the real one is back
    rejects(lesson12.check_expert_a2a_seconds, lambda *args: "slow", match="in seconds, a float")
    rejects(lesson12.check_expert_a2a_seconds, x.in_milliseconds, match="1000 x.*not milliseconds")


def test_expert_a2a_model_is_the_step_times_all_to_alls():
    """The checker's truth is lm_experts.step_time's critical_s (its all-to-alls) wherever the layout's own
    mesh is drawn, on every fabric; and the cases cover both expert axes, every factor and every fabric."""
    for n_devices in (8, 16):
        sizes = lm_layouts.mesh_axes("ep_dp", n_devices)
        for fabric in experts._FABRICS.values():
            for factor in (1.0, 1.25, 2.0):
                row = lm_experts.step_time(
                    transformer.GPU, 64, fabric, n_devices, capacity_factor=factor
                )
                truth = experts.model_seconds(transformer.GPU, 64, sizes, fabric, factor)
                assert truth == pytest.approx(row["critical_s"], rel=1e-12)
    for seed in range(4):
        cases = experts._cases(np.random.default_rng(seed))
        assert {c[2]["expert"] for c in cases} == {2, 4}
        assert {c[4] for c in cases} == {1.0, 1.25, 2.0}
        assert {c[3] for c in cases} == set(experts._FABRICS)
    assert experts._cases(np.random.default_rng(0)) != experts._cases(np.random.default_rng(1))
    scope = {"dataclasses": dataclasses, "transformer": transformer, "costs": costs}
    for code, cfg in experts._CONFIGS.items():
        assert eval(code, scope) == cfg
    for code, fabric in experts._FABRICS.items():
        assert eval(code, scope) == fabric

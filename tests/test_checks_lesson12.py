"""Exercise checkers of lesson 12 (course_tools.checks.lesson12): each accepts the reference answer and
other correct forms, rejects typical wrong answers with its own hint (a lookup of the function the checker
compares with among them), and prints "not written yet" for the student stub. Every checker is analytic (no
compile) and draws its cases afresh; the tests fix the seed. The whole file runs in well under a minute."""

import dataclasses
import sys
from functools import partial

import answers_lesson12 as a
import numpy as np
import pytest
from checking import not_written, rejects, stub, tpu_rules

from course_lib import costs, lm_costs, lm_layouts, transformer
from course_tools.checks import lesson12

SEEDS = (0, 1)
N_CASES = len(lesson12._FAMILIES) + len(lesson12._WINNERS)


def test_stubs_print_not_written(monkeypatch, capsys):
    not_written(lesson12.check_layout_decision, stub, monkeypatch=monkeypatch, capsys=capsys)
    not_written(lesson12.check_largest_model, stub, monkeypatch=monkeypatch, capsys=capsys)
    not_written(lesson12.check_pipeline_bytes, stub, monkeypatch=monkeypatch, capsys=capsys)


@pytest.mark.parametrize("seed", SEEDS)
def test_layout_decision_accepts_correct_forms(seed):
    assert lesson12.check_layout_decision(a.choose_layout, seed=seed)
    assert lesson12.check_layout_decision(a.choose_layout_sorted, seed=seed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "answer, part",
    [
        (a.choose_no_memory_limit, "layout"),
        (a.choose_no_bubble, "layout"),
        (a.choose_fewest_bytes, "layout"),
        (a.choose_no_activations, "memory"),
        (a.choose_with_batch, "memory"),
        (a.choose_strict_limit, "layout"),
        (a.choose_two_micro, "layout"),
        (a.choose_any_split, "layout"),
        (a.choose_h100_always, "layout"),
        (a.choose_near_tie, "layout"),
        (a.choose_no_roofline, "layout"),
    ],
)
def test_layout_decision_rejects(answer, part, seed):
    rejects(
        partial(lesson12.check_layout_decision, seed=seed),
        answer,
        match=rf"\d+ of {N_CASES} cases are wrong.*hint: .*{part}: ",
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_layout_decision_does_not_grade_how_the_latency_is_counted(seed):
    # the model charges 10 µs per predicted transfer (a line of predict_bytes); no case is decided by that
    # bookkeeping: per mesh axis, per collective the program runs, or none at all pick the same layouts
    assert lesson12.check_layout_decision(a.choose_latency_per_axis, seed=seed)
    assert lesson12.check_layout_decision(a.choose_latency_per_program_collective, seed=seed)
    assert lesson12.check_layout_decision(a.choose_no_latency, seed=seed)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("omitted", list(lm_layouts.LAYOUTS))
def test_layout_decision_refuses_an_answer_that_leaves_a_layout_out(omitted, seed):
    rejects(
        partial(lesson12.check_layout_decision, seed=seed),
        a.choose_without(omitted),
        match=rf"\d+ of {N_CASES} cases are wrong \([1-9]\d* with another layout first.*hint: layout: ",
    )


def test_every_layout_is_first_in_a_case_of_every_call():
    for seed in range(4):
        firsts = set()
        for cfg, batch, profile, limit in lesson12._decision_cases(np.random.default_rng(seed)):
            rows = lm_costs.rank_layouts(cfg, batch, profile, 8, memory_limit=limit)
            firsts.add(rows[0]["layout"])
            # no ties: the second is slower by far more than the checker's tolerance for rounding
            if len(rows) > 1:
                assert rows[1]["step_s"] > rows[0]["step_s"] * (1 + 1e3 * lesson12._TIE)
        assert firsts == set(lm_layouts.LAYOUTS), seed


def test_every_winner_option_ranks_its_layout_first_across_its_window():
    profiles = lesson12._profiles(np.random.default_rng(0))
    for key, (options, names) in lesson12._WINNERS.items():
        for name, batches in options:
            for batch in batches:
                for profile_name in names:
                    cfg, profile = lesson12._CONFIGS[name], profiles[profile_name]
                    low, high = lesson12._winner_window(key, cfg, batch, profile)
                    assert low < high, (key, name, batch, profile_name)
                    for limit in (low, np.nextafter(min(high, 1.25 * low), 0)):
                        rows = lm_costs.rank_layouts(cfg, batch, profile, 8, memory_limit=limit)
                        assert rows[0]["layout"] == key, (key, name, batch, profile_name, limit)


@pytest.mark.parametrize(
    "check, name",
    [
        (lesson12.check_layout_decision, "choose_layout"),
        (lesson12.check_largest_model, "largest_model"),
        (lesson12.check_pipeline_bytes, "pipeline_bytes"),
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


def test_the_case_as_code_names_every_kind_of_profile_and_config():
    profiles = lesson12._profiles(np.random.default_rng(3))
    scope = {"dataclasses": dataclasses, "transformer": transformer, "lm_costs": lm_costs,
             "costs": costs}  # fmt: skip
    for profile in profiles.values():
        assert eval(lesson12._profile_expr(profile), scope) == profile
    for cfg in lesson12._CONFIGS.values():
        assert eval(lesson12._config_expr(cfg), scope) == cfg


def test_layout_decision_refuses_a_lookup():
    rejects(
        lesson12.check_layout_decision,
        a.choose_by_lookup,
        match="calls lm_costs.rank_layouts.*hint: build the step time from its pieces",
    )


@pytest.mark.parametrize(
    "answer, match",
    [
        (a.choose_in_a_thread, "calls lm_costs.rank_layouts.*hint: build the step time"),
        (a.choose_catching_the_refusal, "calls lm_costs.rank_layouts.*hint: build the step time"),
        (a.choose_by_code_copy, "calls lm_costs.step_time.*hint: build the step time"),
        (a.choose_without_the_hook, "switched off or replaced the checker's profile hook"),
    ],
)
def test_layout_decision_refuses_the_bypasses(answer, match):
    rejects(lesson12.check_layout_decision, answer, match=match)
    # the real functions are back, and the profile hook the caller had
    assert lm_costs.rank_layouts.__code__.co_name == "rank_layouts"
    assert lm_costs.step_time("dp", transformer.TINY, 8, lm_costs.PROFILES["H100"])
    assert sys.getprofile() is None and not hasattr(lm_costs, "_course_refused_call_")


def test_largest_model_refuses_a_lookup_in_a_thread():
    rejects(
        lesson12.check_largest_model, a.largest_in_a_thread, match="calls lm_costs.largest_layers"
    )


def test_the_guard_keeps_a_callers_profile_hook():
    def hook(frame, event, arg):
        pass

    sys.setprofile(hook)
    try:
        assert lesson12.check_layout_decision(a.choose_layout, seed=0)
    finally:
        restored = sys.getprofile()
        sys.setprofile(None)
    assert restored is hook


def test_layout_decision_says_how_many_not_which():
    with pytest.raises(AssertionError) as e:
        lesson12.check_layout_decision(a.choose_no_memory_limit, seed=0)
    message = str(e.value)
    assert f"of {N_CASES} cases are wrong" in message
    assert (
        "H200" not in message and "transformer" not in message and "choose_layout(" not in message
    )


def test_cases_are_drawn_afresh():
    assert lesson12._decision_cases(np.random.default_rng(0)) != lesson12._decision_cases(
        np.random.default_rng(1)
    )
    assert lesson12._fit_cases(np.random.default_rng(0)) != lesson12._fit_cases(
        np.random.default_rng(1)
    )
    assert lesson12._bytes_cases(np.random.default_rng(0)) != lesson12._bytes_cases(
        np.random.default_rng(1)
    )


def test_layout_decision_rejects_a_malformed_answer():
    rejects(lesson12.check_layout_decision, lambda *args: "dp", match="return \\(layout_key")


def test_a_returned_value_is_shown_with_plain_numbers():
    # NumPy 2 writes np.float64(1.5): the message shows what the learner would print, 1.5
    with pytest.raises(AssertionError) as e:
        lesson12.check_layout_decision(lambda *args: (np.str_("dp"), np.float64(1.5)), seed=0)
    assert "returned ('dp', 1.5)" in str(e.value) and "np." not in str(e.value)
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
    ):
        rejects(
            partial(lesson12.check_largest_model, seed=seed),
            wrong,
            match=rf"\d+ of 13 cases are wrong.*hint: {side}",
        )


def test_largest_model_refuses_a_lookup():
    rejects(
        lesson12.check_largest_model,
        a.largest_by_lookup,
        match="calls lm_costs.largest_layers.*predict_memory",
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
    assert lesson12.check_layout_decision(a.choose_layout, seed=0)
    assert lesson12.check_largest_model(a.largest_model, seed=0)
    assert lesson12.check_pipeline_bytes(a.pipeline_bytes, seed=0)
    rejects(
        partial(lesson12.check_layout_decision, seed=0),
        a.choose_no_bubble,
        match=rf"\d+ of {N_CASES} cases are wrong.*hint: .*layout: ",
    )
    rejects(
        partial(lesson12.check_largest_model, seed=0),
        a.largest_off_by_one,
        match=r"\d+ of 13 cases are wrong.*hint: too many",
    )
    rejects(
        partial(lesson12.check_pipeline_bytes, seed=0),
        a.pipeline_no_loss,
        match=r"\d of 8 cases are wrong.*hint: .*data: ",
    )

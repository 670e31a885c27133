"""Exercise checkers of lesson 11 (course_tools.checks.lesson11): each accepts the reference answer and
another correct form, rejects typical wrong answers with its own hint, and prints "not written yet" for
the student stub (8 simulated CPU devices from conftest.py; subsets for other device counts)."""

import math
from fractions import Fraction
from functools import partial

import answers_lesson11 as a
import answers_lesson11_experts as ax
import answers_lesson11_zb as az
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checking import not_written, rejects, stub, tpu_rules

from course_lib import moe, op_schedules
from course_tools.checks import ExerciseError, _attempts, lesson11
from course_tools.checks._lesson11_exchange import cases as _exchange_cases
from course_tools.checks._lesson11_zb import _cases


def test_stubs_print_not_written(report, monkeypatch, capsys):
    not_written(lesson11.check_gpipe, stub, report.devices, monkeypatch=monkeypatch, capsys=capsys)
    not_written(lesson11.check_predict_pipeline, stub, monkeypatch=monkeypatch, capsys=capsys)
    not_written(lesson11.check_zb_h1_orders, stub, monkeypatch=monkeypatch, capsys=capsys)
    not_written(lesson11.check_router, stub, monkeypatch=monkeypatch, capsys=capsys)


@pytest.mark.parametrize("n", [8, 2])  # 1: judged in a process of 8 (test_checks_devices.py)
def test_gpipe_accepts_correct_forms(report, n):
    assert lesson11.check_gpipe(a.gpipe_forward, report.devices[:n])
    assert lesson11.check_gpipe(a.gpipe_scan, report.devices[:n])
    assert lesson11.check_gpipe(a.gpipe_halves, report.devices[:n])
    # a micro-batch id sent with each activation (4 bytes a tick) is metadata, not a buffer: accepted
    assert lesson11.check_gpipe(a.gpipe_tagged, report.devices[:n])


def test_gpipe_judges_two_devices_on_four_stages(report):
    """On 2 devices the values at 2 stages cannot show a row off only on more stages: judged in a
    process of 8, where p = 4 shows it."""
    rejects(
        partial(lesson11.check_gpipe, devices=report.devices[:2]),
        a.gpipe_rows_of_two,
        match=r"p=4 stages.*judged in a fresh process on 8",
    )


def test_gpipe_names_the_invariant_scan_carry(report):
    """A scan whose carry starts from zeros (the same on every stage) does not trace under shard_map: the
    checker says to cast it to varying (lax.pcast), not just the type error."""
    rejects(
        partial(lesson11.check_gpipe, devices=report.devices),
        a.gpipe_scan_invariant_carry,
        match=r"carry starts the same.*lax\.pcast\(x, axis_name, to='varying'\)",
    )


def test_gpipe_accepts_lax_cond_without_collectives(report):
    """A cond that skips the bubble ticks holds no collective (nor does its gradient): accepted."""
    assert lesson11.check_gpipe(a.gpipe_cond_skip, report.devices)


@pytest.mark.parametrize(
    "answer, match",
    [
        (a.gpipe_no_send, "returns its own layers applied to the inputs.*lax.ppermute"),
        (a.gpipe_reversed, r"wrong rows.*\[7, 6, 5, 4, 3, 2, 1, 0\] \(the order reversed\).*row i"),
        (
            a.gpipe_late_read,
            r"wrong rows.*\(row i holds micro-batch i \+ 1\).*finishes micro-batch i at tick i \+ p - 1",
        ),
        (a.gpipe_feed_reversed, r"wrong rows.*\(the order reversed\).*enters stage 0 at tick i"),
        (
            a.gpipe_feed_skips,
            r"wrong rows.*\[1, 2, 3, 4, 5, 6, 7, 7\] \(micro-batch 7 in more than one row, 0 in none\).*"
            "starts micro-batch t at tick t",
        ),
        (
            a.gpipe_ring,
            r"last stage back to stage 0 \(the pair \(3, 0\)\): a ring.*without \(3, 0\)",
        ),
        (
            a.gpipe_backward_ring,
            r"sends to the previous stage: pairs \[\(0, 3\), \(1, 0\), \(2, 1\), \(3, 2\)\].*s -> s \+ 1",
        ),
        (a.gpipe_no_drain, r"rows \[5, 6, 7\] of the last stage's ys hold zeros.*m \+ p - 1 ticks"),
        (a.gpipe_short_chain, r"no ppermute sends 2 -> 3.*every stage but the last sends"),
        (
            a.gpipe_sequential,
            "applies its layers 32 times: each micro-batch crosses every stage.*11 ticks",
        ),
        (a.gpipe_twice, "applies its layers 22 times; GPipe needs m \\+ p - 1 = 11"),
        (a.gpipe_send_buffer, r"sends 9504 bytes per step, 99.00 activations.*not a buffer"),
        (a.gpipe_library, r"calls pipeline\.forward.*loop over the m \+ p - 1 ticks yourself"),
        (a.gpipe_backwards, r"sends to the previous stage: pairs \[\(1, 0\), \(2, 1\), \(3, 2\)\]"),
        (
            a.gpipe_broadcast,
            "also runs an all-reduce \\(psum\\).*traffic the pipeline does not need",
        ),
        (
            a.gpipe_tick_more,
            "applies its layers 12 times; GPipe needs.*a later tick's work fills no output",
        ),
        (a.gpipe_bf16_send, "values are rounded somewhere.*narrower dtype"),
        (
            a.gpipe_cond_input,
            r"with p=4, m=8 jax.grad of the pipeline holds psum_invariant inside a lax.cond branch.*"
            "transpose of a value that is the same on every device.*wait for it forever.*jnp.where",
        ),
        (
            a.gpipe_axis_written_in,
            "uses the axis name 'stage' instead of its axis_name argument.*axes 'other' and 'stage'.*"
            "pass axis_name to every collective",
        ),
    ],
)
def test_gpipe_rejects(report, answer, match):
    rejects(lesson11.check_gpipe, answer, report.devices, match=match)


def test_predict_pipeline():
    for seed in (0, 1, None):  # the cases are drawn anew at every call
        check = partial(lesson11.check_predict_pipeline, seed=seed)
        assert check(a.predict)
        assert check(a.predict_dict)
        assert check(a.predict_array)
        # the lockstep 1F1B's stash wrong wherever 1 < m: three of its four cases at least
        for wrong in (a.predict_classic_1f1b, a.predict_max_everywhere, a.predict_off_by_one):
            rejects(check, wrong, match=r"[3-9] of 12 cases are wrong \(0 bubbles, [3-9] stashes")
        # 2(p - s) - 1 not clipped by m: wrong where m < 2p - 1 (the "few" and "between" cases)
        rejects(check, a.predict_unclipped, match=r"[2-4] of 12 cases are wrong \(0 bubbles")
        rejects(check, a.predict_circular_like_gpipe, match=r"\d+ of 12 cases are wrong")
        rejects(check, a.predict_bubble_over_m, match=r"\d+ of 12 cases are wrong")
    check = partial(lesson11.check_predict_pipeline, seed=0)
    rejects(check, a.predict_classic_1f1b, match="4 of 12 cases are wrong")
    rejects(
        lesson11.check_predict_pipeline, lambda *args: 0.25, match="returned 0.25.*return \\(bubble"
    )
    # one stash for the whole pipeline: refused with the form asked for
    rejects(check, a.predict_scalar_stash, match="returned the stash .*one number per stage")


def test_predict_pipeline_draws_more_micro_batches_than_stages():
    """Every call draws a GPipe and a circular case with m > p: a circular stash v·p (right where m = p)
    is refused at every seed (seed 138 once drew every circular case with m = p)."""
    for seed in range(200):
        cases = lesson11._predict_cases(np.random.default_rng(seed))
        assert all(
            any(k == kind and m > p for k, p, m, _ in cases) for kind in ("gpipe", "circular")
        )
        rejects(
            partial(lesson11.check_predict_pipeline, seed=seed),
            a.predict_circular_stash_vp,
            match=r"[1-4] of 12 cases are wrong \(0 bubbles",
        )


def test_predict_pipeline_refuses_answers_that_read_or_fit_the_tables():
    check = lesson11.check_predict_pipeline
    rejects(check, a.predict_reads_tables, match="calls course_lib's schedules .*reads the tables")
    # the closed forms of the one-operation schedules give the same bubbles and stashes: refused too
    rejects(
        check,
        a.predict_closed_forms,
        match=r"calls course_lib's schedules \(op_schedules\.predicted_",
    )
    rejects(
        check, a.predict_reads_tables_unhooked, match=r"switched off or replaced .*sys\.setprofile"
    )
    # a table of the answers at the checker's old public cases: the cases are drawn anew
    for case in a.OLD_CASES:
        got, want = a.predict_table(*case), a.predict(*case)
        assert got[0] == pytest.approx(want[0]) and got[1] == want[1]
    rejects(partial(check, seed=0), a.predict_table, match=r"\d+ of 12 cases are wrong")
    # the hint names what is measured, not where the answers are
    with pytest.raises(ExerciseError) as e:
        check(a.predict_classic_1f1b, seed=0)
    assert "schedules.make" not in str(e.value) and "pipeline_diagrams" not in str(e.value)


def test_predict_pipeline_cannot_be_fitted_case_by_case():
    # guess one case at a time and keep a guess that lowers the count of wrong cases: with cases drawn
    # at every call the count says nothing about a fixed case, and the table found still fails
    import re

    table = {}

    def wrong(t):
        try:
            lesson11.check_predict_pipeline(lambda *c: t.get(c, (0.0, [0] * c[1])))
            return 0
        except ExerciseError as e:
            return int(re.search(r"(\d+) of \d+", str(e)).group(1))

    base = wrong(table)
    for case in a.OLD_CASES[:4]:
        for stash in range(12):
            trial = {**table, case: (a.predict(*case)[0], [stash] * case[1])}
            if (w := wrong(trial)) < base:
                table, base = trial, w
                break
    rejects(
        lesson11.check_predict_pipeline,
        lambda *c: table.get(c, (0.0, [0] * c[1])),
        match="of 12",
    )


# ---- exercise 3: ZB-H1's orders ----------------------------------------------------------------------------


def test_zb_h1_cases_are_drawn_with_one_two_four_stages_and_m_at_and_above_p():
    for seed in range(20):
        cases = _cases(np.random.default_rng(seed))
        assert {1, 2, 4} <= {p for p, _ in cases} and all(m >= p for p, m in cases)
        assert (2, 2) in cases and (4, 4) in cases
        assert any(p == 1 and m >= 3 for p, m in cases) and any(p == 4 and m >= 6 for p, m in cases)
    assert _cases(np.random.default_rng(0)) != _cases(np.random.default_rng(1))


@pytest.mark.parametrize("answer", [az.zb_h1_orders, az.zb_h1_tail_reversed, az.zb_h1_mirrored])
def test_zb_h1_orders_accepts_any_order_with_its_bubble_and_memory(answer):
    for seed in (0, 1, 2, None):  # cases drawn anew
        assert lesson11.check_zb_h1_orders(answer, seed=seed)
    # the three are different orders
    assert (
        len({str(f(4, 6)) for f in (az.zb_h1_orders, az.zb_h1_tail_reversed, az.zb_h1_mirrored)})
        == 3
    )


ZB_WRONG = [
    (az.fused_1f1b, r"zb_h1_orders\(1, \d\) has no W.*1F1B's fused backward.*backward is split"),
    (
        az.w_at_end,
        r"stage 0 holds (\d) micro-batches at tick \d+, \[0, 1, 2.*\(every W after the last F\): more than "
        r"p = 1.*zb_h1_orders\(2, 2\): the table takes 8 ticks with \[2, 2\] idle.*"
        r"before the F of micro-batch i \+ p; keep 1F1B's order",
    ),
    (
        az.w_before_b,
        r"stage 0 runs the W of micro-batch 0 \(orders\[0\]\[1\]\) before its B \(\[2\]\).*"
        "its B before its W",
    ),
    (
        az.gpipe_like,
        r"zb_h1_orders\(2, 2\): the table takes 8 ticks.*bubble of 0.250 of the step.*= 0.143",
    ),
    (
        az.warm_up_reversed,
        "deadlock at tick 2: stage 0 waits to run the B of micro-batch 0, which needs the B of micro-batch 0 "
        "on stage 1; stage 1 waits to run the F of micro-batch 1.*orders must fit together",
    ),
    (
        az.named_ops,
        r"orders\[0\]\[0\] = \('F', 0\) is not an \(op, micro_batch\) with op one of F = 1, B = 2, W = 3",
    ),
    (lambda p, m: None, r"orders must be a list of one list per stage \(1\), not None"),
    (
        az.from_the_table,
        r"calls op_schedules\.zb_h1.*instead of reading them from op_schedules\.zb_h1",
    ),
    (az.from_make, r"calls op_schedules\.zb_h1.*build each stage's list"),
]


@pytest.mark.parametrize(
    "answer, match", ZB_WRONG, ids=[getattr(w[0], "__name__", "none") for w in ZB_WRONG]
)
def test_zb_h1_orders_rejects(answer, match):
    rejects(lesson11.check_zb_h1_orders, answer, match=match)
    # the library's ZB-H1 works again after a refused call
    op_schedules.validate(op_schedules.zb_h1(4, 8))


def test_zb_h1_orders_names_only_the_rule_broken():
    # a W one F too late: ZB-H1's bubble everywhere, p + 1 held once m >= p + 2 (memory alone)
    for seed in (0, 1, None):
        with pytest.raises(ExerciseError) as e:
            lesson11.check_zb_h1_orders(az.w_late_by_one, seed=seed)
        text = str(e.value)
        assert "stage 0 holds 2 micro-batches" in text and "more than p = 1" in text
        assert "bubble" not in text and "(every W after the last F)" not in text
    # each W right after its B: 1F1B's memory or less, but the B's the previous stage waits for come late
    with pytest.raises(ExerciseError) as e:
        lesson11.check_zb_h1_orders(az.eager_w, seed=0)
    text = str(e.value)
    assert (
        "zb_h1_orders(2, 2): the table takes 8 ticks with [2, 2] idle" in text
        and "holds" not in text
    )


def test_router():
    assert lesson11.check_router(a.route)
    assert lesson11.check_router(a.route_tuple)
    assert lesson11.check_router(a.route_keep_int)
    assert lesson11.check_router(a.route_keep_float)


@pytest.mark.parametrize("answer", [a.route_library, a.route_library_alias])
def test_router_refuses_the_library_router(answer):
    """An answer that calls moe.route (the checker's reference), even one that catches the stub's error,
    is refused; the library's router works again afterwards."""
    rejects(lesson11.check_router, answer, match=r"calls moe\.route.*instead of calling moe\.route")
    assert lesson11.check_router(a.route)
    logits = jnp.zeros((4, 2))
    assert moe.route(logits, 1, 4).slot.shape == (4, 1)


@pytest.mark.parametrize("form", ["route_keep_int", "route_keep_float"])
def test_router_keep_as_numbers_runs_in_moe_output(form):
    """keep as 0/1 integers or floats, accepted, gives moe_output the reference router's values (a capacity
    that drops choices, so keep matters)."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, 16)), jnp.float32)
    p = moe.init_moe(jax.random.key(0), 16, 32, 4)
    want = lesson11.moe_output(a.route, x, p, k=2, capacity_factor=0.5)
    got = lesson11.moe_output(getattr(a, form), x, p, k=2, capacity_factor=0.5)
    assert np.allclose(got, want)


@pytest.mark.parametrize(
    "answer, match",
    [
        (a.route_from_one_le, r"first choice place 1 \(.*0 … capacity-1$"),
        (
            a.route_token_major,
            "token by token.*every token's first choice before any second choice",
        ),
        (
            a.route_per_choice,
            "k=2.*for each choice on its own.*after all of its first choices",
        ),
        (a.route_keep_all, r"keeps \d+ choice\(s\) the rule drops and drops 0 it keeps"),
        (a.route_raw_gates, "gates that do not sum to 1.*renormalise"),
        (a.route_keep_le, "keeps a choice whose place equals the capacity"),
        (a.route_softmax_tokens, "chooses other experts"),
        (lambda lg, k, c: (1, 2), "returned tuple"),
        (
            lambda lg, k, c: ("e", "s", "k", "g"),
            r"returned tuple \(ValueError.*an array of numbers",
        ),
        (a.route_slot_float, "returned slot as float32.*index.*integer"),
        (
            a.route_eight_experts,
            r"logits \[48, 12\].*expert\(s\) \[8, 9, 10, 11\] places.*E = 12 experts",
        ),
    ],
)
def test_router_rejects(answer, match):
    rejects(lesson11.check_router, answer, match=match)


def test_router_given_asks_where_to_look_then_names_the_mistake(monkeypatch):
    """The given router (places from 1): its first report is a question, a later one names the mistake."""
    monkeypatch.setattr(lesson11, "_ROUTER_REPORTS", {})
    question = r"keeps fewer choices than the rule.*which places do a full expert's choices get.*\?"
    rejects(lesson11.check_router, a.route_given, match=question)
    named = "lets a full expert keep capacity - 1 choices.*its places start at 1, not 0"
    for _ in range(2):
        rejects(lesson11.check_router, a.route_given, match=named)


# ---- on a TPU: float32 comparisons within the TPU's tolerance --------------------------------------------
# a.gpipe_bf16_send is refused on CPU only: a TPU's float32 matmul multiplies bfloat16 inputs itself, so a
# send rounded to bfloat16 is within its tolerance; every other wrong answer is refused as on CPU.


def test_tpu_rules_accept_the_references(report, monkeypatch):
    assert tpu_rules(monkeypatch) > 1e-3
    for n in (len(report.devices), 1):
        assert lesson11.check_gpipe(a.gpipe_forward, report.devices[:n])
    assert lesson11.check_router(a.route)


@pytest.mark.parametrize(
    "answer, match",
    [
        (a.gpipe_no_send, "returns its own layers applied to the inputs"),
        (a.gpipe_reversed, r"wrong rows.*\(the order reversed\)"),
        (a.gpipe_late_read, r"wrong rows.*\(row i holds micro-batch i \+ 1\)"),
        (a.gpipe_no_drain, r"rows \[5, 6, 7\] of the last stage's ys hold zeros"),
        (a.gpipe_twice, "applies its layers 22 times"),
    ],
)
def test_tpu_rules_still_refuse_wrong_answers(report, monkeypatch, answer, match):
    tpu_rules(monkeypatch)
    rejects(lesson11.check_gpipe, answer, report.devices, match=match)


@pytest.mark.parametrize(
    "answer, match",
    [
        (a.route_slot_float, "returned slot as float32"),
        (a.route_raw_gates, "gates that do not sum to 1"),
        (a.route_keep_le, "keeps a choice whose place equals the capacity"),
    ],
)
def test_tpu_rules_still_refuse_wrong_routers(monkeypatch, answer, match):
    tpu_rules(monkeypatch)
    rejects(lesson11.check_router, answer, match=match)


# ---- exercise 5: the all_to_all exchange of experts beside data ------------------------------------------


def test_expert_exchange_stub_prints_not_written(report, monkeypatch, capsys):
    not_written(
        lesson11.check_expert_exchange, stub, report.devices, monkeypatch=monkeypatch, capsys=capsys
    )


@pytest.mark.parametrize("answer", [a.moe_layer, a.moe_layer_transposed, a.moe_layer_untiled])
def test_expert_exchange_accepts_correct_forms(report, answer):
    assert lesson11.check_expert_exchange(answer, report.devices)


def test_expert_exchange_says_when_jax_cannot_differentiate_the_untiled_exchange(report, capsys):
    # JAX's transpose of an untiled all_to_all with split_axis != concat_axis raises: a right answer,
    # whose gradient the check says it does not judge; a tiled one's gradient it judges
    assert lesson11.check_expert_exchange(a.moe_layer_untiled, report.devices)
    assert "its gradient not judged" in capsys.readouterr().out
    assert lesson11.check_expert_exchange(a.moe_layer, report.devices)
    assert "and its gradient on the first" in capsys.readouterr().out


def test_expert_exchange_on_four_devices_judges_on_2x2_meshes(report, capsys):
    assert lesson11.check_expert_exchange(a.moe_layer, report.devices[:4])
    assert "data × expert = 2 × 2 mesh" in capsys.readouterr().out
    rejects(
        lesson11.check_expert_exchange,
        a.moe_layer_no_transpose,
        report.devices[:4],
        match="2 × 2 mesh.*outputs differ",
    )
    # the places of device j sent to j + 2's: right on an expert axis of 2, wrong on the 1 × 4 mesh
    rejects(
        lesson11.check_expert_exchange,
        a.moe_layer_places_rolled,
        report.devices[:4],
        match="1 × 4 mesh, 100% of the outputs differ",
    )


@pytest.mark.parametrize("n", [6, 7])
def test_expert_exchange_on_six_or_seven_devices_splits_the_experts(report, capsys, n):
    # an expert axis of 3 would leave the 8 experts unsplittable: a right answer is judged on 2 × 2
    assert lesson11.check_expert_exchange(a.moe_layer, report.devices[:n])
    assert "data × expert = 2 × 2 mesh, a 1 × 4" in capsys.readouterr().out


def test_expert_exchange_on_two_devices_is_judged_on_eight(report, capsys):
    assert lesson11.check_expert_exchange(a.moe_layer, report.devices[:2])
    assert "judged in a fresh process on 8 simulated CPU devices" in capsys.readouterr().out


EXCHANGE_WRONG = [
    (a.moe_layer_library, "calls moe_layout.moe_mlp_ep_dp"),
    (a.moe_layer_swapped, r"moe.experts is given an array of shape \(32, 1, 16\).*2 experts first"),
    (a.moe_layer_swapped_back, "all_to_all raised ValueError.*split_axis.*back undoes it"),
    (a.moe_layer_no_transpose, "73% of the outputs differ.*transpose the experts in front"),
    (a.moe_layer_no_reshape_back, r"moe.combine is given an array of shape \(4, 2, 4, 16\)"),
    (a.moe_layer_named, "names the mesh axis 'expert', which this mesh \\('rows' × 'ep'\\)"),
    (
        a.moe_layer_both_axes,
        r"outputs differ.*moe.experts is given an array of shape \(1, 32, 16\)",
    ),
    (a.moe_layer_gather, r"sends \{'expert': 18432.0\}.*send \{'expert': 3072.0\}"),
    (
        ax.moe_layer_ppermute,
        r"\{'expert': 3072.0\} bytes.*\(collective-permute\).*not by all-to-alls",
    ),
    (ax.moe_layer_bfloat16, "near the one-device MoE's.*cast to bfloat16"),
    (ax.moe_layer_psum, r"\(all-reduce\).*an all_gather or a psum"),
    (ax.moe_layer_weights_gathered, r"\(all-gather\).*the experts' weights"),
    (ax.moe_layer_double, r"\(all-to-all\).*carry more, or less, than the dispatch buffer"),
    (ax.moe_layer_four, r"shape \(2, 16, 16\).*4 experts first"),
    (
        ax.moe_layer_stop_gradient,
        r"outputs are right, but jax.grad.*the tokens x.*no lax.stop_gradient",
    ),
]


@pytest.mark.parametrize(
    "answer, match", EXCHANGE_WRONG, ids=[w[0].__name__ for w in EXCHANGE_WRONG]
)
def test_expert_exchange_rejects(report, answer, match):
    rejects(lesson11.check_expert_exchange, answer, report.devices, match=match)


def test_tpu_rules_expert_exchange(report, monkeypatch):
    tpu_rules(monkeypatch)
    assert lesson11.check_expert_exchange(a.moe_layer, report.devices)
    rejects(
        lesson11.check_expert_exchange, a.moe_layer_no_transpose, report.devices, match="differ"
    )


# ---- exercise 5, first: the dispatch's bytes predicted ----------------------------------------------------


def _bytes_reference(n_tokens, d_model, n_experts, k, capacity_factor, n_devices, itemsize):
    cap = math.ceil(capacity_factor * k * n_tokens / n_experts)
    return n_experts * cap * d_model * itemsize * (n_devices - 1) / n_devices


def _bytes_by_groups(n_tokens, d_model, n_experts, k, capacity_factor, n_devices, itemsize):
    # the n - 1 groups of E/n experts that leave the device, the capacity rounded up in whole numbers
    cap = -(-Fraction(capacity_factor) * k * n_tokens // n_experts)
    return (n_devices - 1) * (n_experts // n_devices) * int(cap) * d_model * itemsize


def _bytes_whole_buffer(n_tokens, d_model, n_experts, k, capacity_factor, n_devices, itemsize):
    return n_experts * math.ceil(capacity_factor * k * n_tokens / n_experts) * d_model * itemsize


def _bytes_not_rounded(n_tokens, d_model, n_experts, k, capacity_factor, n_devices, itemsize):
    cap = capacity_factor * k * n_tokens / n_experts
    return n_experts * cap * d_model * itemsize * (n_devices - 1) / n_devices


def _bytes_without_k(n_tokens, d_model, n_experts, k, capacity_factor, n_devices, itemsize):
    cap = math.ceil(capacity_factor * n_tokens / n_experts)
    return n_experts * cap * d_model * itemsize * (n_devices - 1) / n_devices


def _bytes_one_group(n_tokens, d_model, n_experts, k, capacity_factor, n_devices, itemsize):
    cap = math.ceil(capacity_factor * k * n_tokens / n_experts)
    return n_experts * cap * d_model * itemsize / n_devices


def _bytes_from_library(n_tokens, d_model, n_experts, k, capacity_factor, n_devices, itemsize):
    cap = moe.capacity(n_tokens, n_experts, k, capacity_factor)
    return n_experts * cap * d_model * itemsize * (n_devices - 1) / n_devices


def _bytes_text(*args):
    return "a lot"


def test_exchange_bytes_stub_prints_not_written(monkeypatch, capsys):
    not_written(lesson11.check_exchange_bytes, stub, monkeypatch=monkeypatch, capsys=capsys)


@pytest.mark.parametrize("seed", [0, 1, 2, None])
@pytest.mark.parametrize("answer", [_bytes_reference, _bytes_by_groups])
def test_exchange_bytes_accepts_correct_forms(answer, seed):
    assert lesson11.check_exchange_bytes(answer, seed=seed)


def test_exchange_bytes_cases_include_one_device_and_a_rounded_capacity():
    for seed in range(20):
        drawn = _exchange_cases(np.random.default_rng(seed))
        assert any(c[5] == 1 for c in drawn)
        assert any(not (c[4] * c[3] * c[0] / c[2]).is_integer() for c in drawn)
        assert all(c[2] % c[5] == 0 and c[3] <= c[2] for c in drawn)


@pytest.mark.parametrize(
    "answer, match",
    [
        (_bytes_whole_buffer, r"of 10 cases are off"),
        (_bytes_not_rounded, r"of 10 cases are off"),
        (_bytes_without_k, r"of 10 cases are off"),
        (_bytes_one_group, r"of 10 cases are off"),
        (_bytes_from_library, r"calls course_lib \(moe.capacity\)"),
        (_bytes_text, r"not a number"),
    ],
)
def test_exchange_bytes_rejects(answer, match):
    for seed in range(5):  # wrong on every draw
        rejects(partial(lesson11.check_exchange_bytes, seed=seed), answer, match=match)


def test_exchange_bytes_counts_attempts_and_names_no_case():
    _attempts.reset("lesson11 exchange_bytes")
    with pytest.raises(ExerciseError) as wrong:
        lesson11.check_exchange_bytes(_bytes_whole_buffer, seed=3)
    assert "attempt 1 (1 wrong so far)" in str(wrong.value)
    assert "exchange_bytes(" not in str(wrong.value)  # how many are off, never which
    assert lesson11.check_exchange_bytes(_bytes_reference, seed=3)
    assert _attempts.attempts("lesson11 exchange_bytes") == (2, 1)
    _attempts.reset("lesson11 exchange_bytes")

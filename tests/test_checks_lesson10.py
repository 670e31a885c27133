"""Exercise checkers of lesson 10 (course_tools.checks.lesson10): each accepts the reference answer and
another correct form, rejects typical wrong answers with its own hint (answers that call the library's
own version among them), and prints "not written yet" for the student stub (8 simulated CPU devices from
conftest.py; subsets for other device counts)."""

import math

import answers_lesson10 as a
import pytest
from checking import not_written, rejects, stub, tpu_rules

from course_lib import aot, comms
from course_lib.aot_programs import LESSON10_BATCH, LESSON10_CONFIG, N_DEVICES
from course_lib.programs import collective_ops
from course_tools.checks import ExerciseError, lesson10


def test_stubs_print_not_written(report, monkeypatch, capsys):
    not_written(
        lesson10.check_ring_attention, stub, report.devices, monkeypatch=monkeypatch, capsys=capsys
    )
    not_written(lesson10.check_zero3, stub, report.devices, monkeypatch=monkeypatch, capsys=capsys)
    not_written(lesson10.check_predict_tp_sp, stub, monkeypatch=monkeypatch, capsys=capsys)
    not_written(lesson10.check_tp_mlp, stub, report.devices, monkeypatch=monkeypatch, capsys=capsys)


@pytest.mark.parametrize("n", [8, 4])
def test_ring_accepts_correct_forms(report, n):
    assert lesson10.check_ring_attention(a.ring_reference, report.devices[:n])
    assert lesson10.check_ring_attention(a.ring_scan, report.devices[:n])


def test_ring_four_devices_are_judged_on_eight(report):
    """A block index right on rings of up to 4 devices only: on 4 devices (rings of 2 and 4 judged
    there) it passed; the checker sends it to a process of 8."""
    rejects(
        lesson10.check_ring_attention,
        a.ring_short_rings_only,
        report.devices[:4],
        match=r"on 8 device.*judged in a fresh process on 8",
    )


def test_ring_accepts_fori_loop(report):
    assert lesson10.check_ring_attention(a.ring_fori, report.devices)


def test_ring_accepts_a_carried_index(report):
    """The block's origin sent beside K and V (4 bytes a step) is metadata, not a second block."""
    assert lesson10.check_ring_attention(a.ring_carry_index, report.devices)


def test_ring_accepts_rows_flattened(report):
    assert lesson10.check_ring_attention(a.ring_flat, report.devices)


def test_ring_accepts_masked_scores_filled_finite(report):
    assert lesson10.check_ring_attention(a.ring_fill_big, report.devices)


@pytest.mark.parametrize(
    "answer, match",
    [
        (a.ring_library, "calls course_lib.splits.ring_attention.*without course_lib.splits"),
        (a.ring_fori_imported, "still holds a scan loop.*imported from jax.lax.*unroll=True"),
        (
            a.ring_zigzag_library,
            "calls course_lib.splits_zigzag.ring_attention_at.*without course_lib",
        ),
        (a.ring_no_max, "scores near 1,000 the result is not finite.*running maximum"),
        (
            a.ring_max_from_zero,
            "scores near \\+1,000, but where every score a query sees is near -1,000 the result is "
            "not finite.*running maximum started at a constant such as 0.*-inf",
        ),
        (
            a.ring_scan_cond_send,
            "on 2 devices a ppermute sits inside lax.cond.*13,440 bytes.*6,720 bytes.*n - 1 times",
        ),
        (a.ring_per_block, "first device's queries .* are right.*running maximum"),
        (a.ring_no_wrap_mask, "only the diagonal block is masked.*wrapping round the ring"),
        (a.ring_no_mask, "causal mask is missing"),
        (a.ring_local_mask, "positions within a block.*global positions"),
        (a.ring_src_ahead, "first device's queries.*later devices' are not"),
        (a.ring_float32, "near causal attention's.*float32.*q.dtype"),
        (a.ring_transposed, "raised TypeError.*order of each array's axes"),
        (a.ring_four, "on 2 device.*ppermute sources.*axis_size.*tries 2, 4 and 8"),
        (a.ring_gathered, "calls all_gather.*lax.ppermute"),
        (a.ring_sends_n, "on 2 devices each device sends 13,440 bytes.*more than.*never used"),
        (
            a.ring_two_pass,
            "ring of 32 devices .* holds [0-9,]+ bytes at once.*whole sequence's K and V are 16,384 "
            "bytes.*half of that \\(8,192\\).*online softmax",
        ),
        (
            a.ring_keeps_scores,
            "ring of 32 devices .* holds [0-9,]+ bytes at once.*every block's scores",
        ),
        (a.ring_two_rounds, "on 2 devices each device sends 10,080 bytes.*more than.*6,720 bytes"),
        # right values, but a lax.while_loop has no reverse-mode derivative: untrainable
        (a.ring_unrolled, "temporaries grow from .* K/V blocks more for every device.*fori_loop"),
        (a.ring_while, "jax.grad of ring_attention.*cannot differentiate.*trained.*fori_loop"),
        (a.ring_while_count_down, "jax.grad of ring_attention.*cannot differentiate.*lax.scan"),
        (
            a.ring_sends_q,
            "on 2 devices each device sends 10,080 bytes.*more than.*only K and V travel",
        ),
    ],
)
def test_ring_rejects(report, answer, match):
    rejects(lesson10.check_ring_attention, answer, report.devices, match=match)


def test_zero3_accepts_correct_forms(report):
    assert lesson10.check_zero3(a.zero3_reference, report.devices)
    assert lesson10.check_zero3(a.zero3_loop, report.devices)


def test_zero3_names_a_looser_policy(report, capsys):
    """dots_saveable still gathers again in the backward pass: accepted, and the message says that data
    parallelism here saves nothing while the answer saves with dots_saveable."""
    assert lesson10.check_zero3(a.zero3_dots, report.devices)
    out = capsys.readouterr().out
    assert (
        "each block under jax.checkpoint saving nothing" in out
        and "yours saves with dots_saveable" in out
    )


@pytest.mark.parametrize(
    "answer, match",
    [
        (a.zero3_library, "calls course_lib.splits.zero3_blocks"),
        (a.zero3_upfront, "all_gather returns a leaf of all 3 layers at once"),
        (a.zero3_no_checkpoint, "does not gather again.*jax.checkpoint"),
        (a.zero3_gather_outside, "does not gather again.*jax.checkpoint"),
        (a.zero3_save_everything, "does not gather again.*policy: save nothing"),
        (
            a.zero3_gather_all_checkpointed,
            "holds [0-9,]+ bytes .* no less than data parallelism's, each block under jax.checkpoint "
            "saving nothing.*more than one gathered layer is whole at once.*its own jax.checkpoint",
        ),
        (a.zero3_one_checkpoint, "no less than data parallelism's.*not one around all the layers"),
        (a.zero3_bf16, "near data parallelism's.*rounded.*bf16"),
        (a.zero3_psum_gather, "all-reduces .* bytes per device.*lax.all_gather"),
        (
            a.zero3_checkpoint_made_once,
            "jax.checkpoint switched off .* still gathers each layer again.*inside zero3_blocks",
        ),
    ],
)
def test_zero3_rejects(report, answer, match):
    rejects(lesson10.check_zero3, answer, report.devices, match=match)


def test_predict_tp_sp():
    for seed in (0, 1):
        assert lesson10.check_predict_tp_sp(a.predict, seed=seed)
        assert lesson10.check_predict_tp_sp(a.predict_dict, seed=seed)
        assert lesson10.check_predict_tp_sp(
            a.predict_comms_ring_bytes, seed=seed
        )  # the named model
    assert lesson10.check_predict_tp_sp(a.predict)  # cases drawn afresh


@pytest.mark.parametrize(
    "answer, match",
    [
        (a.predict_library, "calls splits.predict_tp_sp"),
        (a.predict_split_cost, "calls split_time.split_cost.*comms.ring_bytes"),
        # XLA:CPU's program taken for XLA:TPU's: SP's bytes equal to TP's there too
        (a.predict_cpu_only, r"4 of 20 cases are wrong \(0 TP bytes, 0 SP bytes on XLA:CPU, 4 SP "
         r"bytes on XLA:TPU, 0 LayerNorm.*hint: SP's bytes on XLA:TPU: cost the collectives XLA:TPU's"),
        (a.predict_tpu_scatter_kept, r"4 of 20 .*4 SP bytes on XLA:TPU.*its own kind's ring factor"),
        (a.predict_tpu_gathers_f32, r"4 of 20 .*4 SP bytes on XLA:TPU.*its own dtype's bytes an element"),
        (a.predict_tpu_full_ln, r"4 of 20 .*, 4 LayerNorm counts.*hint: LayerNorm under SP on XLA:TPU"),
        (a.predict_sp_half_bytes, r"9 of 20 .*\(0 TP bytes, 5 SP bytes on XLA:CPU, 4 SP bytes on "
         r"XLA:TPU.*hint: SP's bytes on XLA:CPU: .*ring all-reduce"),
        (a.predict_sp_full_ln, r"9 of 20 .*\(0 TP bytes, 0 .* 0 .* 9 LayerNorm counts.*hint: LayerNorm: "
         r"the elements.*; LayerNorm under SP on XLA:TPU"),
        (a.predict_one_allreduce, r"18 of 20 .*\(9 TP bytes, 5 SP bytes on XLA:CPU, 4 SP bytes.*"
         r"hint: TP's bytes: one all-reduce"),
        (a.predict_strings, r"returned \('0.0', .*return a pair of numbers"),
        (a.predict_wrong_at_one, r"2 of 20 cases are wrong, all at n = 1.*nothing is split"),
        # XLA:TPU's rule costed for 8 chips only: the other chip counts expose it
        (a.predict_tpu_only_eight, r"3 of 20 .*3 SP bytes on XLA:TPU"),
    ],
)  # fmt: skip
def test_predict_rejects(answer, match):
    """Each wrong answer fails on the cases that expose its part (n = 1 sends nothing: an XLA:CPU SP
    mistake shows on the five other counts), with that part's hint."""
    rejects(lesson10.check_predict_tp_sp, answer, match=match)


def test_predict_tpu_listing_answers_the_exercise():
    """The collectives exercise 2 lists for XLA:TPU (one layer of the committed 8-chip program: kind, dtype,
    shape) costed by the ring model are the checker's XLA:TPU bytes for SP at those sizes."""
    layer = [
        o for o in collective_ops(aot.hlo_text("lesson10.sp_forward"), {"model": 8}) if o.in_loop
    ]
    assert sorted(o.shape.split("[")[0] + " " + o.op for o in layer) == [
        "bf16 all-gather", "bf16 all-gather", "f32 all-reduce", "f32 all-reduce"
    ]  # fmt: skip
    sent = sum(comms.ring_bytes(o.op, o.nbytes, N_DEVICES) for o in layer)
    b, s, d = LESSON10_BATCH, LESSON10_CONFIG.seq_len, LESSON10_CONFIG.d_model
    assert math.isclose(sent, a.predict("sp", "XLA:TPU", b, s, d, N_DEVICES)[0])


def test_predict_hint_gives_no_formula():
    for answer in (a.predict_one_allreduce, a.predict_sp_full_ln):
        with pytest.raises(AssertionError) as e:
            lesson10.check_predict_tp_sp(answer, seed=0)
        assert (
            "(n-1)" not in str(e.value)
            and "(n - 1)" not in str(e.value)
            and "2(n" not in str(e.value)
        )
        assert "1.25" not in str(e.value)


def test_tp_mlp(report):
    for devices in (report.devices, report.devices[:3]):  # fewer: judged in a process with 8
        assert lesson10.check_tp_mlp(a.tp_mlp, devices)
        assert lesson10.check_tp_mlp(a.tp_mlp_bias_share, devices)
    check, devices = lesson10.check_tp_mlp, report.devices
    rejects(check, a.tp_mlp_library, devices, match="calls course_lib.splits.tp_mlp")
    rejects(
        check,
        a.tp_mlp_bias_eighth,
        devices,
        match="on 3 device.*bias 0.375 times.*once, on any number",
    )
    rejects(check, a.tp_mlp_bias_before, devices, match="bias 8 times.*once")
    rejects(check, a.tp_mlp_pmean, devices, match="average of the devices' partial sums.*not pmean")
    rejects(check, a.tp_mlp_float32, devices, match="near the MLP's.*float32")
    rejects(check, a.tp_mlp_gelu_after, devices, match="differs from the MLP")
    rejects(check, a.tp_mlp_no_b1, devices, match="differs from the MLP")
    moves = "sends one thing: the \\[T, D\\] partial output.*one lax.psum"
    rejects(
        check,
        a.tp_mlp_gather_weights,
        devices,
        match=r"on 8 devices the program calls all_gather\w* of \[16, 6\]; .*" + moves,
    )
    rejects(
        check,
        a.tp_mlp_gather_plain,  # refused by shard_map's out_specs first: the gathering's message still
        devices,
        match=r"not provably the same.*all-gathers \[16, 6\].*with gathered weights every device computes",
    )
    rejects(check, a.tp_mlp_psum_weights, devices, match=r"calls psum\w* of \[16, 48\];.*" + moves)
    rejects(check, a.tp_mlp_gather_hidden, devices, match=r"calls all_gather\w* of \[5, 6\];")
    rejects(  # activations gathered, not weights: the message says so
        check,
        a.tp_mlp_scatter_gather,
        devices,
        match=r"all-gathers \[5, 2\]: gathered activations: .*summed whole by one lax.psum",
    )
    rejects(check, a.tp_mlp_no_return, devices, match=r"returned None \(is a return missing\?\)")
    rejects(
        check, a.tp_mlp_dict, devices, match="returned a dict; want .* one \\[T, D\\] = \\[5, 16\\]"
    )
    rejects(check, a.tp_mlp_hidden, devices, match=r"returned an array of shape \(5, 6\)")
    with pytest.raises(ExerciseError, match=r"calls psum\w* of \[16\];.*moves no weights") as e:
        check(a.tp_mlp_pmean_bias, devices)  # a bias averaged: no gathered weights to speak of
    assert "gathered weights" not in str(e.value)
    rejects(check, a.tp_mlp_two_psums, devices, match="sums \\[T, D\\] arrays .* 2 times")


# ---- an axis name written in instead of the axis argument ----------------------------------------------------

_WRITTEN_IN = "uses the axis name '{}' instead of its axis_name argument.*{}.*pass axis_name to every collective"


@pytest.mark.parametrize(
    "check, answer, match",
    [
        (
            lesson10.check_tp_mlp,
            a.tp_mlp_axis_written_in,
            _WRITTEN_IN.format("model", "axes 'other' and 'model'.*psum names 'model'"),
        ),
        (
            lesson10.check_tp_mlp,
            a.tp_mlp_size_written_in,
            _WRITTEN_IN.format("model", "called 'other'.*unbound axis name: model"),
        ),
        (
            lesson10.check_tp_mlp,
            a.tp_mlp_name_dependent,
            "right on a mesh whose axis is called 'model', but on a mesh whose axis is called 'other' "
            r"\(axis_name='other', 3 devices\) its values differ by .*depends on the axis's name",
        ),
        (
            lesson10.check_ring_attention,
            a.ring_axis_written_in,
            _WRITTEN_IN.format("context", "axes 'other' and 'context'"),
        ),
        (
            lesson10.check_zero3,
            a.zero3_axis_written_in,
            _WRITTEN_IN.format("data", "axes 'other' and 'data'.*all_gather names 'data'"),
        ),
    ],
)
def test_an_axis_name_written_in_is_refused(report, check, answer, match):
    """Right on the notebook's mesh ("model", "context", "data"), each is run once more on an axis called
    "other"; the references (the accepted forms above) pass there."""
    rejects(check, answer, report.devices, match=match)


# ---- on a TPU: no float64, float32 within the TPU's tolerance ------------------------------------------------
# There the values are float32 (float64 is emulated), so an answer that computes in float32 is right there
# (a.ring_float32, a.tp_mlp_float32, a.zero3_bf16 are refused on CPU only: a TPU's float32 matmul multiplies
# bfloat16 inputs itself); every other wrong answer is refused as on CPU.


def test_tpu_rules_accept_the_references(report, monkeypatch):
    assert tpu_rules(monkeypatch) > 1e-3  # the TPU's tolerance, not XLA:CPU's
    for n in (len(report.devices), 1):
        assert lesson10.check_ring_attention(a.ring_reference, report.devices[:n])
        assert lesson10.check_tp_mlp(a.tp_mlp, report.devices[:n])
    assert lesson10.check_zero3(a.zero3_reference, report.devices)


@pytest.mark.parametrize(
    "check, answer, match",
    [
        (
            lesson10.check_ring_attention,
            a.ring_no_max,
            "scores near 1,000 the result is not finite",
        ),
        (
            lesson10.check_ring_attention,
            a.ring_max_from_zero,
            # float32's exp underflows below about -103 (float64's below -745): the scores near +1,000
            # already hold a query whose every score is far below a running maximum started at 0
            "the result is not finite",
        ),
        (lesson10.check_ring_attention, a.ring_per_block, "first device's queries .* are right"),
        (lesson10.check_ring_attention, a.ring_no_wrap_mask, "only the diagonal block is masked"),
        (lesson10.check_ring_attention, a.ring_no_mask, "causal mask is missing"),
        (lesson10.check_ring_attention, a.ring_local_mask, "positions within a block"),
        (lesson10.check_tp_mlp, a.tp_mlp_bias_before, "bias 8 times.*once"),
        (lesson10.check_tp_mlp, a.tp_mlp_pmean, "average of the devices' partial sums"),
        (lesson10.check_tp_mlp, a.tp_mlp_gelu_after, "differs from the MLP"),
        (lesson10.check_tp_mlp, a.tp_mlp_no_b1, "differs from the MLP"),
        (
            lesson10.check_zero3,
            a.zero3_upfront,
            "all_gather returns a leaf of all 3 layers at once",
        ),
        (lesson10.check_zero3, a.zero3_no_checkpoint, "does not gather again.*jax.checkpoint"),
    ],
)
def test_tpu_rules_still_refuse_wrong_answers(report, monkeypatch, check, answer, match):
    tpu_rules(monkeypatch)
    rejects(check, answer, report.devices, match=match)


# ---- exercise 5: the tensor-parallel degree beyond which a block is communication-bound ---------------------


def critical_ref(cfg, batch, fabric):
    ways = 2 if fabric.link.topology == "ring" else 1
    return 1 + (cfg.d_model + (cfg.seq_len + cfg.d_ff) / 2) * ways * fabric.link.bytes_per_s / (
        fabric.chip.bf16 * 1e12
    )


def critical_block_flops(cfg, batch, fabric):
    """Right values, but the block's FLOPs read from split_time.block_flops instead of counted."""
    from course_lib import split_time

    compute_s = split_time.block_flops(cfg, batch) / (fabric.chip.bf16 * 1e12)
    ways = 2 if fabric.link.topology == "ring" else 1
    comm_s = 2 * 2 * batch * cfg.seq_len * cfg.d_model * 2 / (ways * fabric.link.bytes_per_s)
    return 1 + compute_s / comm_s


def critical_from_times(cfg, batch, fabric):
    # solve compute(n) = comm(n) from the two times per device at n = 2 (both are a / n and b (n - 1) / n)
    t, d = batch * cfg.seq_len, cfg.d_model
    flops = t * (8 * d * d + 4 * cfg.seq_len * d + 4 * d * cfg.d_ff)
    compute_n1 = flops / (fabric.chip.bf16 * 1e12)  # compute(n) = compute_n1 / n
    ways = 2 if fabric.link.topology == "ring" else 1
    comm_per = (
        2 * 2 * t * d * 2 / (ways * fabric.link.bytes_per_s)
    )  # comm(n) = comm_per (n - 1) / n
    return 1 + compute_n1 / comm_per


def test_critical_degree_accepts_correct_forms(monkeypatch, capsys):
    assert lesson10.check_tp_critical_degree(critical_ref)
    assert lesson10.check_tp_critical_degree(critical_from_times)
    not_written(lesson10.check_tp_critical_degree, stub, monkeypatch=monkeypatch, capsys=capsys)


def test_critical_degree_wrong_answers():
    import dataclasses
    import math

    from course_lib import costs, split_time

    def switch(fab):
        return dataclasses.replace(fab, link=dataclasses.replace(fab.link, topology="switch"))

    def ring(fab):
        return dataclasses.replace(fab, link=dataclasses.replace(fab.link, topology="ring"))

    def no_scores(c, b, fab):
        ways = 2 if fab.link.topology == "ring" else 1
        return 1 + (c.d_model + c.d_ff / 2) * ways * fab.link.bytes_per_s / (fab.chip.bf16 * 1e12)

    cases = {
        "counts twice there": lambda c, b, fab: critical_ref(c, b, switch(fab)),
        "only a ring uses both": lambda c, b, fab: critical_ref(c, b, ring(fab)),
        "the degree is 1 \\+": lambda c, b, fab: critical_ref(c, b, fab) - 1,
        "scores and their product": no_scores,
        "factors of 2": lambda c, b, fab: 1 + (critical_ref(c, b, fab) - 1) / 2,  # float32 bytes
        "factors of 2:": lambda c, b, fab: 1 + 2 * (critical_ref(c, b, fab) - 1),  # 1 FLOP per MAC
        "1/n of the block": lambda c, b, fab: 1 / (2 - critical_ref(c, b, fab)),  # FLOPs not split
        "exact degree": lambda c, b, fab: math.ceil(critical_ref(c, b, fab)),
        "return a number": lambda c, b, fab: str(critical_ref(c, b, fab)),
        "compare two times": lambda c, b, fab: (
            critical_ref(c, b, fab) * (1 + b / 1e4)
        ),  # the batch kept
        "compare two times ": lambda c, b, fab: (
            1 + (critical_ref(c, b, fab) - 1) * 1e12
        ),  # TFLOP/s as FLOP/s
    }
    for hint, answer in cases.items():
        rejects(lesson10.check_tp_critical_degree, answer, match=hint)
    for library in (
        lambda c, b, fab: split_time.tp_critical_degree(c, fab),
        lambda c, b, fab: 1 + (c.d_model + (c.seq_len + c.d_ff) / 2) / split_time.fabric_ratio(fab),
        lambda c, b, fab: costs.critical_size(
            1, split_time.timing(split_time.split_cost("tp", c, b, 2), fab)
        ),
        critical_block_flops,  # the FLOPs, a piece of the model, read from split_time
    ):
        rejects(
            lesson10.check_tp_critical_degree, library, match="do not call course_lib.split_time"
        )


def test_critical_degree_red_team_answers():
    """Answers a learner wrote from the notebook's text: each refused with a hint true of its mistake."""
    from course_lib import costs

    def sent_as_all_gather(
        c, b, fab
    ):  # an all-reduce taken to send (n − 1) / n of its size, not 2 (n − 1) / n
        return 1 + 2 * (critical_ref(c, b, fab) - 1)

    rejects(
        lesson10.check_tp_critical_degree,
        sent_as_all_gather,
        match="each sending 2 \\(n − 1\\) / n",
    )

    def with_collective_time(c, b, fab):  # the library's collective time: named by its own module
        t, n = b * c.seq_len, 8
        comm = 2 * costs.collective_time("all-reduce", n, 2 * t * c.d_model, fab.link) * n / (n - 1)
        flops = t * (8 * c.d_model**2 + 4 * c.seq_len * c.d_model + 4 * c.d_model * c.d_ff)
        return 1 + flops / (fab.chip.bf16 * 1e12) / comm

    rejects(
        lesson10.check_tp_critical_degree, with_collective_time,
        match="calls costs.collective_time: a library function this checker refuses",
    )  # fmt: skip


def test_critical_degree_refuses_a_table_of_the_fixed_cases():
    """A lookup of the fixed cases' values (anything else: a guess) fails on the cases drawn afresh."""
    import functools

    from course_tools.checks._lesson10_time import CASES, DRAWN, FABRICS, reference

    table = {(c.d_model, c.seq_len, c.d_ff, b): reference(c, b, FABRICS[f]) for c, b, f in CASES}

    def lookup(c, b, fab):
        return table.get((c.d_model, c.seq_len, c.d_ff, b), 2.0)

    for seed in (0, 1, None):
        check = functools.partial(lesson10.check_tp_critical_degree, seed=seed)
        rejects(check, lookup, match=f"{DRAWN} of {len(CASES) + DRAWN} cases are off.*drawn")


def zero3_predict_ref(p_bytes, n):
    """Exercise 4's prediction: each layer gathered twice (forward, backward under the checkpoint); two
    gathers and one reduce-scatter of (n - 1)/n of P."""
    return 2, 3 * (n - 1) / n * p_bytes


def zero3_predict_dict(p_bytes, n):
    """Another correct form: a dict, the bytes summed collective by collective from a shard's size."""
    shard = p_bytes / n
    per_collective = shard * (n - 1)  # what a device receives of the others' shards
    return {"gathers_per_layer": 1 + 1, "sent": 2 * per_collective + per_collective}


def test_zero3_predict_accepts_correct_forms(monkeypatch, capsys):
    assert lesson10.check_predict_zero3(zero3_predict_ref)
    assert lesson10.check_predict_zero3(zero3_predict_dict, seed=3)
    not_written(lesson10.check_predict_zero3, stub, monkeypatch=monkeypatch, capsys=capsys)


@pytest.mark.parametrize(
    "answer, match",
    [
        (
            lambda p, n: (2, 2 * (n - 1) / n * p),
            "gathers each layer again",
        ),  # data parallelism's bytes
        (lambda p, n: (2, 3 * p), "already holds its own"),  # the ring's (n - 1)/n left out
        (lambda p, n: (1, 3 * (n - 1) / n * p), "count the gathers of a layer"),  # no re-gather
        (lambda p, n: (2, 4 * (n - 1) / n * p), "not an all-reduce"),  # gradient all-reduced
        (lambda p, n: (2, 3 * (n - 1) / n * p + (n == 1)), "all at n = 1"),
        (lambda p, n: (2, 2.5 * (n - 1) / n * p), "which collectives touch"),  # no named mistake
        (lambda p, n: "3(n-1)/n P", "return a pair of numbers"),
    ],
)
def test_zero3_predict_wrong_answers(answer, match):
    rejects(lesson10.check_predict_zero3, answer, match=match)


def test_zero3_predict_refuses_the_library():
    from course_lib import split_time, transformer

    def library(p_bytes, n):
        cost = split_time.split_cost("zero3", transformer.GPU, 16, max(n, 1))
        return 2, cost.sent_bytes / split_time.block_param_bytes(transformer.GPU, 2) * p_bytes

    rejects(lesson10.check_predict_zero3, library, match="split_cost")

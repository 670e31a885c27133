"""Exercise checkers of lesson 10 (course_tools.checks.lesson10): each accepts the reference answer and
another correct form, rejects typical wrong answers with its own hint, and prints "not written yet" for
the student stub (8 simulated CPU devices from conftest.py; subsets for other device counts)."""

import answers_lesson10 as a
import pytest
from checking import not_written, rejects, stub

from course_tools.checks import lesson10


def test_stubs_print_not_written(report, monkeypatch, capsys):
    not_written(
        lesson10.check_ring_attention, stub, report.devices, monkeypatch=monkeypatch, capsys=capsys
    )
    not_written(lesson10.check_zero3, stub, report.devices, monkeypatch=monkeypatch, capsys=capsys)
    not_written(lesson10.check_predict_tp_sp, stub, monkeypatch=monkeypatch, capsys=capsys)
    not_written(lesson10.check_tp_mlp, stub, report.devices, monkeypatch=monkeypatch, capsys=capsys)


@pytest.mark.parametrize("n", [8, 1])
def test_ring_accepts_correct_forms(report, n):
    assert lesson10.check_ring_attention(a.ring_reference, report.devices[:n])
    assert lesson10.check_ring_attention(a.ring_scan, report.devices[:n])


@pytest.mark.parametrize(
    "answer, match",
    [
        (a.ring_per_block, "first device's queries .* are right.*running maximum"),
        (a.ring_no_wrap_mask, "last device's queries are right.*wrapping round the ring"),
        (a.ring_no_mask, "causal mask is missing"),
        (a.ring_gathered, "calls all_gather.*lax.ppermute"),
        (a.ring_sends_q, "sends 5760 bytes.*only the key and value"),
    ],
)
def test_ring_rejects(report, answer, match):
    rejects(lesson10.check_ring_attention, answer, report.devices, match=match)


def test_zero3_accepts_correct_forms(report):
    assert lesson10.check_zero3(a.zero3_reference, report.devices)
    assert lesson10.check_zero3(a.zero3_loop, report.devices)


@pytest.mark.parametrize(
    "answer, match",
    [
        (a.zero3_upfront, "gathers .* layer leaves|temporaries"),
        (a.zero3_no_checkpoint, "gathers 36 layer leaves.*jax.checkpoint"),
        (a.zero3_gather_outside, "gathers 36 layer leaves.*jax.checkpoint"),
    ],
)
def test_zero3_rejects(report, answer, match):
    rejects(lesson10.check_zero3, answer, report.devices, match=match)


def test_predict_tp_sp():
    assert lesson10.check_predict_tp_sp(a.predict)
    assert lesson10.check_predict_tp_sp(a.predict_dict)
    rejects(lesson10.check_predict_tp_sp, a.predict_sp_half_bytes, match="5 of 12 cases are wrong")
    rejects(lesson10.check_predict_tp_sp, a.predict_sp_full_ln, match="5 of 12 cases are wrong")
    rejects(lesson10.check_predict_tp_sp, a.predict_one_allreduce, match="10 of 12 cases are wrong")


def test_tp_mlp(report):
    assert lesson10.check_tp_mlp(a.tp_mlp, report.devices)
    assert lesson10.check_tp_mlp(a.tp_mlp_bias_share, report.devices)
    rejects(lesson10.check_tp_mlp, a.tp_mlp_bias_before, report.devices, match="bias 8 times")
    rejects(
        lesson10.check_tp_mlp, a.tp_mlp_gelu_after, report.devices, match="differs from the MLP"
    )
    rejects(lesson10.check_tp_mlp, a.tp_mlp_no_b1, report.devices, match="differs from the MLP")

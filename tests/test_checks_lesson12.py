"""Exercise checkers of lesson 12 (course_tools.checks.lesson12): each accepts the reference answer and
another correct form, rejects typical wrong answers with its own hint, and prints "not written yet" for
the student stub. Every checker is analytic (no compile): the whole file runs in a few seconds."""

import answers_lesson12 as a
import pytest
from checking import not_written, rejects, stub

from course_tools.checks import lesson12


def test_stubs_print_not_written(monkeypatch, capsys):
    not_written(lesson12.check_layout_decision, stub, monkeypatch=monkeypatch, capsys=capsys)
    not_written(lesson12.check_largest_model, stub, monkeypatch=monkeypatch, capsys=capsys)
    not_written(lesson12.check_pipeline_bytes, stub, monkeypatch=monkeypatch, capsys=capsys)


def test_layout_decision_accepts_correct_forms():
    assert lesson12.check_layout_decision(a.choose_layout)
    assert lesson12.check_layout_decision(a.choose_layout_sorted)


@pytest.mark.parametrize(
    "answer",
    [a.choose_no_memory_limit, a.choose_no_bubble, a.choose_fewest_bytes, a.choose_no_activations],
)
def test_layout_decision_rejects(answer):
    rejects(lesson12.check_layout_decision, answer, match=r"\d of 8 cases are wrong.*hint")


def test_layout_decision_says_how_many_not_which():
    with pytest.raises(AssertionError) as e:
        lesson12.check_layout_decision(a.choose_no_memory_limit)
    message = str(e.value)
    assert "of 8 cases are wrong" in message and "H200" not in message and "cfg" not in message


def test_layout_decision_rejects_a_malformed_answer():
    rejects(lesson12.check_layout_decision, lambda *args: "dp", match="return \\(layout_key")


def test_largest_model():
    assert lesson12.check_largest_model(a.largest_model)
    assert lesson12.check_largest_model(a.largest_model_search)
    for wrong in (a.largest_no_optimizer, a.largest_any_count, a.largest_off_by_one):
        rejects(lesson12.check_largest_model, wrong, match=r"\d+ of 10 cases are wrong")


def test_pipeline_bytes():
    assert lesson12.check_pipeline_bytes(a.pipeline_bytes)
    assert lesson12.check_pipeline_bytes(a.pipeline_bytes_by_parts)
    for wrong in (
        a.pipeline_every_tick,
        a.pipeline_forward_only,
        a.pipeline_every_device_sends,
        a.pipeline_half_ring,
    ):
        rejects(lesson12.check_pipeline_bytes, wrong, match=r"\d of 6 cases are wrong")
    rejects(lesson12.check_pipeline_bytes, lambda *args: 3.0, match="return a dict")

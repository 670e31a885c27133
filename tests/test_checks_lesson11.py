"""Exercise checkers of lesson 11 (course_tools.checks.lesson11): each accepts the reference answer and
another correct form, rejects typical wrong answers with its own hint, and prints "not written yet" for
the student stub (8 simulated CPU devices from conftest.py; subsets for other device counts)."""

import answers_lesson11 as a
import pytest
from checking import not_written, rejects, stub

from course_tools.checks import lesson11


def test_stubs_print_not_written(report, monkeypatch, capsys):
    not_written(lesson11.check_gpipe, stub, report.devices, monkeypatch=monkeypatch, capsys=capsys)
    not_written(lesson11.check_predict_pipeline, stub, monkeypatch=monkeypatch, capsys=capsys)
    not_written(lesson11.check_router, stub, monkeypatch=monkeypatch, capsys=capsys)


@pytest.mark.parametrize("n", [8, 2, 1])
def test_gpipe_accepts_correct_forms(report, n):
    assert lesson11.check_gpipe(a.gpipe_forward, report.devices[:n])
    assert lesson11.check_gpipe(a.gpipe_scan, report.devices[:n])


@pytest.mark.parametrize(
    "answer, match",
    [
        (a.gpipe_no_send, "returns its own layers applied to the inputs.*lax.ppermute"),
        (a.gpipe_reversed, r"wrong rows.*keep micro-batch i's output in row i"),
        (a.gpipe_late_read, r"wrong rows.*finishes micro-batch i at tick i \+ p - 1"),
        (
            a.gpipe_sequential,
            "applies its layers 32 times: each micro-batch crosses every stage.*11 ticks",
        ),
        (a.gpipe_twice, "applies its layers 22 times; GPipe needs m \\+ p - 1 = 11"),
        (a.gpipe_send_buffer, "sends 99 activations' worth.*not a buffer"),
        (a.gpipe_backwards, "differ from applying the stages in order.*s -> s \\+ 1"),
    ],
)
def test_gpipe_rejects(report, answer, match):
    rejects(lesson11.check_gpipe, answer, report.devices, match=match)


def test_gpipe_on_one_device_still_catches_what_needs_stages(report):
    # with one device only p = 1 runs; the 4-stage jaxpr still shows a pipeline that never sends or
    # never overlaps
    one = report.devices[:1]
    rejects(lesson11.check_gpipe, a.gpipe_no_send, one, match="never calls lax.ppermute")
    rejects(lesson11.check_gpipe, a.gpipe_sequential, one, match="crosses every stage")
    rejects(lesson11.check_gpipe, a.gpipe_reversed, one, match="wrong rows")


def test_predict_pipeline():
    assert lesson11.check_predict_pipeline(a.predict)
    assert lesson11.check_predict_pipeline(a.predict_dict)
    rejects(
        lesson11.check_predict_pipeline, a.predict_classic_1f1b, match="4 of 12 cases are wrong"
    )
    rejects(
        lesson11.check_predict_pipeline,
        a.predict_circular_like_gpipe,
        match="6 of 12 cases are wrong",
    )
    rejects(
        lesson11.check_predict_pipeline, a.predict_bubble_over_m, match="11 of 12 cases are wrong"
    )
    rejects(
        lesson11.check_predict_pipeline, lambda *args: 0.25, match="returned 0.25.*return \\(bubble"
    )


def test_router():
    assert lesson11.check_router(a.route)
    assert lesson11.check_router(a.route_tuple)


@pytest.mark.parametrize(
    "answer, match",
    [
        (
            a.route_given,
            "first token place 1, so a full expert keeps capacity - 1.*exclusive count",
        ),
        (a.route_token_major, "places the choices in another order.*every token's first choice"),
        (a.route_raw_gates, "gates that do not sum to 1.*renormalise"),
        (a.route_keep_le, "keeps a choice whose place equals the capacity"),
        (a.route_softmax_tokens, "chooses other experts"),
        (lambda lg, k, c: (1, 2), "returned tuple"),
    ],
)
def test_router_rejects(answer, match):
    rejects(lesson11.check_router, answer, match=match)

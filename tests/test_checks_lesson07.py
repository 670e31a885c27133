"""Exercise checkers of lesson 07 (course_tools.checks.lesson07): each accepts the reference answer and
other correct forms, rejects typical wrong answers with its own hint, and prints "not written yet" for the
student stub (8 simulated CPU devices from conftest.py)."""

import answers_lesson07 as a
import pytest
from checking import rejects

from course_tools.checks import lesson07


def stub(*args, **kwargs):
    raise NotImplementedError("Exercise: write this part")


def test_stubs_print_not_written_and_return_false(report, monkeypatch, capsys):
    monkeypatch.delenv("COURSE_STRICT_CHECKS", raising=False)
    assert lesson07.check_memory_prediction(stub) is False
    assert lesson07.check_replicas(stub, report.devices) is False
    assert lesson07.check_train_loop(stub) is False
    out = capsys.readouterr().out
    assert out.count("not written yet") == 3 and out.count("hint:") == 3


def test_memory_prediction():
    assert lesson07.check_memory_prediction(a.predict_memory)
    assert lesson07.check_memory_prediction(a.predict_memory_lists)
    rejects(
        lesson07.check_memory_prediction,
        a.predict_memory_donated_not_counted,
        match=r"\(0,\), argument.*every input buffer",
    )
    rejects(
        lesson07.check_memory_prediction,
        a.predict_memory_three_aliases,
        match=r"\(0, 1, 2\), alias.*only two outputs",
    )
    rejects(
        lesson07.check_memory_prediction,
        a.predict_memory_one_output,
        match="output bytes are 2.*new velocity",
    )
    rejects(lesson07.check_memory_prediction, lambda: {(): (3, 2, 0)}, match="keys")


@pytest.mark.parametrize("n", [8, 3, 1])
def test_replicas(report, n):
    devs = report.devices[:n]
    assert lesson07.check_replicas(a.sgd_step, devs)
    assert lesson07.check_replicas(a.sgd_step_average_params, devs)
    rejects(lesson07.check_replicas, a.sgd_step_buggy, devs, match="different parameters.*pmean")
    rejects(
        lesson07.check_replicas,
        a.sgd_step_pmean_loss,
        devs,
        match="different parameters.*averaging the loss",
    )
    rejects(lesson07.check_replicas, a.sgd_step_psum, devs, match="agree, but not.*psum")


def test_train_loop_accepts_loops_that_keep_the_devices_busy():
    assert lesson07.check_train_loop(a.train_loop)
    assert lesson07.check_train_loop(a.train_loop_log_first)
    assert lesson07.check_train_loop(a.train_loop_prefetch_thread)


@pytest.mark.parametrize(
    "answer, match",
    [
        (a.train_loop_naive, r"log\(0\) ran before step 1 was dispatched"),
        (a.train_loop_forgets_last, r"missing: \[5\]"),
        (a.train_loop_wrong_loss, "from the step after"),
        (a.train_loop_blocks, "idle while the host made"),
        (a.train_loop_batch_first, "ran before step"),
    ],
)
def test_train_loop_rejects(answer, match):
    rejects(lesson07.check_train_loop, answer, match=match)

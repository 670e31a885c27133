"""Exercise 3's ZeRO-2 plan and exercise 2's moves of E's critical batch (``notebooks/08_lab.ipynb``):
the checkers accept the right answers in more than one form, refuse plausible wrong ones with a hint that
names what is wrong (never the value), and print a stub's hint; the ZeRO-2 step's checker says on 2 devices
that it cannot judge an answer it cannot send, and prints no ✓."""

import pytest
from checking import rejects
from test_checks_lesson08 import critical_ref, make_zero2

from course_tools.checks import ExerciseError, _attempts, lesson08
from course_tools.checks import _lesson08_critical as lesson08_critical
from course_tools.checks import _lesson08_zero2plan as lesson08_plan

PLAN = {
    "gradients": "reduce-scatter",
    "parameters": "all-gather",
    "update": "its slice",
    "sent / B's, n = 8": 1.0,
    "momentum / B's, n = 8": 1 / 8,
}
MOVES = {
    "link bandwidth x2": 0.5,
    "ring -> switch": 2.0,
    "8 -> 64 devices": (63 / 64) / (7 / 8),
    "FLOP peak x2": 1.0,
    "parameter bytes x2": 2.0,
}


def test_zero2_plan_accepts_the_plan_in_other_forms():
    assert lesson08.check_zero2_plan(PLAN)
    assert lesson08.check_zero2_plan(
        {**PLAN, "sent / B's, n = 8": 1, "momentum / B's, n = 8": 0.125}
    )


PLAN_MISTAKES = [
    {"gradients": "all-reduce"},  # ZeRO-1's gradients
    {"gradients": "all-gather"},
    {"parameters": "all-reduce"},  # the slices summed
    {"parameters": "reduce-scatter"},  # forgot to gather the parameters
    {"update": "all parameters"},  # updating unsharded moments
    {"sent / B's, n = 8": 2.0},  # counted as two all-reduces
    {"momentum / B's, n = 8": 1.0},  # the momentum replicated
]


@pytest.fixture(autouse=True)
def _fresh_attempts():
    _attempts.reset()
    yield
    _attempts.reset()


def _refusal(check, answer) -> tuple[str, str]:
    """(message, hint) of ``check``'s refusal of ``answer``."""
    with pytest.raises(ExerciseError) as e:
        check(answer)
    first, _, hint = str(e.value).partition("hint:")
    return first, hint


@pytest.mark.parametrize("change", PLAN_MISTAKES)
def test_zero2_plan_rejects_plausible_mistakes_without_naming_the_entry(change):
    first, hint = _refusal(lesson08.check_zero2_plan, {**PLAN, **change})
    assert "1 of 5 entries of the plan are off" in first and "attempt 1" in first, first
    assert hint.strip() == lesson08_plan.PLAN_HINT
    assert not any(key in first for key in lesson08.ZERO2_PLAN), first


def test_zero2_plan_and_moves_count_attempts(capsys):
    """Guessing shows: a pass after wrong tries says on which attempt, and the hint is the same whichever
    entry is wrong, so it does not lead a guess key by key."""
    _, hint = _refusal(lesson08.check_zero2_plan, {**PLAN, "gradients": "all-reduce"})
    first, other = _refusal(lesson08.check_zero2_plan, {**PLAN, "momentum / B's, n = 8": 1.0})
    assert "attempt 2 (2 wrong so far)" in first and hint == other
    assert lesson08.check_zero2_plan(PLAN)
    assert "on attempt 3, after 2 wrong" in capsys.readouterr().out
    assert lesson08.check_critical_batch_moves(MOVES)
    assert "on the first attempt" in capsys.readouterr().out
    _, hint = _refusal(lesson08.check_critical_batch_moves, {**MOVES, "link bandwidth x2": 2.0})
    first, other = _refusal(
        lesson08.check_critical_batch_moves, {**MOVES, "parameter bytes x2": 1.0}
    )
    assert "attempt 3 (2 wrong so far)" in first and hint == other


def test_zero2_plan_refuses_values_outside_the_choices_and_prints_a_stub_hint(capsys, monkeypatch):
    monkeypatch.delenv("COURSE_STRICT_CHECKS", raising=False)
    rejects(lesson08.check_zero2_plan, {**PLAN, "gradients": "psum"}, match="one of")
    rejects(lesson08.check_zero2_plan, {"gradients": "reduce-scatter"}, match="keys")
    assert lesson08.check_zero2_plan(dict.fromkeys(lesson08.ZERO2_PLAN, ...)) is False
    assert "not written" in capsys.readouterr().out


def test_critical_batch_moves_accept_the_model_and_other_forms():
    assert lesson08.check_critical_batch_moves(MOVES)
    assert lesson08.check_critical_batch_moves(
        {**MOVES, "8 -> 64 devices": 1.125, "ring -> switch": 2}
    )


@pytest.mark.parametrize(
    "change",
    [
        {"link bandwidth x2": 2.0},  # the direction reversed
        {"ring -> switch": 1.0},  # a ring taken as one direction
        {"8 -> 64 devices": 8.0},  # bytes taken to grow with n
        {"FLOP peak x2": 0.5},  # compute time taken as FLOPs only
        {"parameter bytes x2": 1.0},
    ],
)
def test_critical_batch_moves_reject_plausible_mistakes_without_naming_the_move(change):
    first, hint = _refusal(lesson08.check_critical_batch_moves, {**MOVES, **change})
    assert "1 of 5 predictions are off" in first and "attempt 1" in first, first
    assert hint.strip() == lesson08_critical.MOVES_HINT
    assert not any(key in first + hint for key in lesson08.CRITICAL_MOVES), first + hint


def test_critical_batch_moves_stub_prints_its_hint(capsys, monkeypatch):
    monkeypatch.delenv("COURSE_STRICT_CHECKS", raising=False)
    with pytest.raises(ExerciseError, match="2 of 5") as e:
        lesson08.check_critical_batch_moves({**MOVES, "link bandwidth x2": 2, "ring -> switch": 1})
    assert "0.5" not in str(e.value)
    assert lesson08.check_critical_batch_moves(dict.fromkeys(lesson08.CRITICAL_MOVES, ...)) is False
    assert "not written" in capsys.readouterr().out


def test_zero2_step_on_two_devices_prints_no_success_for_what_it_cannot_judge(
    report, capsys, monkeypatch
):
    """Two devices hide a device count written in: the checker sends a body to 8 devices, and says so
    where it cannot send one (a closure) — for a right and a wrong body alike, never a ✓."""
    monkeypatch.delenv("COURSE_STRICT_CHECKS", raising=False)
    for body in (make_zero2(), make_zero2(reduce="allreduce"), make_zero2(gather=False)):
        assert lesson08.check_zero2(body, report.devices[:2]) is False
        out = capsys.readouterr().out
        assert "✓" not in out and "not judged: this run has 2 devices, too few" in out, out


def test_fsdp_critical_batch_accepts_the_loss_bytes_and_refuses_the_checkers_own_answer():
    """The loss's 4 bytes counted in one leaf is a right answer; an answer that wraps the
    checker's own :func:`reference` (or a piece of it) is refused."""
    from course_tools.checks import _lesson08_critical as critical

    def with_loss_bytes(f, h, p, n, fab):
        return critical_ref(f, h, [p[0] + 4, *p[1:]], n, fab)

    assert lesson08.check_fsdp_critical_batch(with_loss_bytes)

    def wraps(piece):
        def answer(f, h, p, n, fab):
            critical.FABRICS["_mine"] = fab
            try:
                if piece == "reference":
                    return critical.reference((f, h, p, n, "_mine"))
                return (
                    critical_ref(f, h, p, n, fab)
                    * critical._bandwidth("_mine")
                    / critical._bandwidth("_mine")
                )
            finally:
                del critical.FABRICS["_mine"]

        return answer

    for piece in ("reference", "_bandwidth"):
        rejects(lesson08.check_fsdp_critical_batch, wraps(piece), match="checker refuses")


def test_zero2_refuses_bfloat16_gradient_slices_and_zeros_for_whole_leaves(report):
    """Two steps a loose tolerance and zero biases once let through: each reduce-scattered gradient slice
    rounded to bfloat16 before optimizer.update (off by ~1e-3), and zeros handed to optimizer.update for the
    leaves kept whole (their weight decay lost)."""
    four = report.devices[:4]
    rejects(lesson08.check_zero2, make_zero2(bf16=True), four, match="in float32")
    rejects(
        lesson08.check_zero2,
        make_zero2(update_params="zeros for whole leaves"),
        four,
        match="(?s)momentum of .*bias lacks the weight decay",
    )

"""Lab 12's prediction checkers (exercises 1 to 5's ``*_predictions``): each accepts the notebook's
predictions and other right forms (a layout tied with the best, NumPy numbers, a time worked without its
latency terms), refuses plausible wrong predictions with how many are wrong, and prints "not written yet" for
the student stub; every judged call is counted (``_attempts``), and a verdict after a wrong one says on which
attempt it came. Analytic: no compile."""

import numpy as np
import pytest
from checking import not_written, rejects

from course_tools.checks import _attempts, lesson12
from course_tools.checks._common import ExerciseError

CROSSING = {
    "tp_sp at batch 8": "model",
    "fsdp_tp at batch 128": "fsdp",
    "pp_dp at batch 128": "stage",
    "tp_sp: the smallest batch at which data crosses": 32,
}
FIT = {
    "the most layers, the pipeline aside": "tp_sp",
    "what fills most of dp's memory at its limit": "activations",
    "what fills most of dp's memory at its limit, with remat": "state",
    "the most layers with remat, the pipeline aside": "fsdp_tp",
    "the most layers with remat, the pipeline included": "fsdp_tp",
    "the most layers with remat at batch 64, the pipeline aside": "tp_sp",
}
PIPE = {
    "stage: 4 micro-batches / the lab's 2": 1.0,
    "stage: global batch 32 / the lab's 16": 22788 / 14596,
    "stage bytes: 4 stages, 8 micro-batches": 40326,
}
STEP = {"the fastest layout": "3d", "dp's step in ms": 66.1}
EXPERT = {
    "all-to-alls over expert per step": 64,
    "the all-to-alls' time per step, expert inside a node, in ms": 6.61,
    "their time with expert across the nodes / inside": 8.32,
}


CHECKS = (
    (lesson12.check_crossing_prediction, lesson12.CROSSING_QUESTIONS, CROSSING),
    (lesson12.check_fit_prediction, lesson12.FIT_QUESTIONS, FIT),
    (lesson12.check_pipe_prediction, lesson12.PIPE_QUESTIONS, PIPE),
    (lesson12.check_step_prediction, lesson12.STEP_QUESTIONS, STEP),
    (lesson12.check_expert_prediction, lesson12.EXPERT_QUESTIONS, EXPERT),
)


@pytest.fixture(autouse=True)
def _fresh_attempts():
    _attempts.reset()
    yield
    _attempts.reset()


@pytest.mark.parametrize("check, questions, right", CHECKS)
def test_the_stub_prints_not_written(check, questions, right, monkeypatch, capsys):
    assert set(questions) == set(right)
    not_written(check, dict.fromkeys(questions), monkeypatch=monkeypatch, capsys=capsys)


@pytest.mark.parametrize("check, questions, right", CHECKS)
def test_the_notebooks_predictions_pass(check, questions, right):
    assert check(right)


def test_other_right_forms_pass():
    # exercise 3: NumPy numbers, the time and the ratio rounded (6.5 ms, 8.0: within 5 %)
    assert lesson12.check_expert_prediction(
        {
            "all-to-alls over expert per step": np.int64(64),
            "the all-to-alls' time per step, expert inside a node, in ms": np.float64(6.5),
            "their time with expert across the nodes / inside": 8.0,
        }
    )
    # NumPy numbers; a layout tied with the best (the model cannot tell them apart)
    assert lesson12.check_crossing_prediction(
        {**CROSSING, "tp_sp: the smallest batch at which data crosses": np.int64(32)}
    )
    # the pipeline's bytes worked by hand: rounded, and as NumPy numbers
    assert lesson12.check_pipe_prediction(
        {
            "stage: 4 micro-batches / the lab's 2": np.float64(1),
            "stage: global batch 32 / the lab's 16": 1.56,
            "stage bytes: 4 stages, 8 micro-batches": np.int64(40_000),
        }
    )
    # dp's step as its all-reduce's bandwidth term alone (65.8 ms), within 5 %
    assert lesson12.check_step_prediction(
        {
            "the fastest layout": "3d",
            "dp's step in ms": np.float64(2 * 0.94e9 * 14 / 8 / 50e9 * 1e3),
        }
    )


@pytest.mark.parametrize(
    "check, wrong",
    [
        # the rule of thumb "TP inside the node" at every batch
        (lesson12.check_crossing_prediction, {**CROSSING, "tp_sp at batch 8": "data"}),
        # a batch too early: at batch 16 TP's activations are still the smaller traffic
        (
            lesson12.check_crossing_prediction,
            {**CROSSING, "tp_sp: the smallest batch at which data crosses": 16},
        ),
        # the pipeline's data axis across (the gradients are the larger traffic)
        (lesson12.check_crossing_prediction, {**CROSSING, "pp_dp at batch 128": "data"}),
        # the layout that splits the parameters the most (the activations decide at sequence 2048)
        (lesson12.check_fit_prediction, {**FIT, "the most layers, the pipeline aside": "fsdp_tp"}),
        # the weights as what fills dp's memory (the scores [b, H, S, S] outweigh them at sequence 2048)
        (
            lesson12.check_fit_prediction,
            {**FIT, "what fills most of dp's memory at its limit": "state"},
        ),
        # remat leaves the activations on top (a layer keeps its input: the state grows past them)
        (
            lesson12.check_fit_prediction,
            {**FIT, "what fills most of dp's memory at its limit, with remat": "activations"},
        ),
        # tp_sp again with remat (its state is split 2 ways, fsdp_tp's 8)
        (
            lesson12.check_fit_prediction,
            {**FIT, "the most layers with remat, the pipeline aside": "tp_sp"},
        ),
        # more micro-batches, more sends: x2 (each send is half the size)
        (lesson12.check_pipe_prediction, {**PIPE, "stage: 4 micro-batches / the lab's 2": 2.0}),
        # the sends counted as m + p - 1 ticks each way (one too many): 16,644 / 18,692 B = 0.89
        (lesson12.check_pipe_prediction, {**PIPE, "stage: 4 micro-batches / the lab's 2": 0.9}),
        # the activations alone double with the batch (the stage all-reduce of embedding and head left out)
        (lesson12.check_pipe_prediction, {**PIPE, "stage: global batch 32 / the lab's 16": 2.0}),
        # every device of 4 stages sending (no silent last stage): 40,960 + 9,606
        (lesson12.check_pipe_prediction, {**PIPE, "stage bytes: 4 stages, 8 micro-batches": 50566}),
        # the activations alone, the stage all-reduce of embedding and head left out
        (lesson12.check_pipe_prediction, {**PIPE, "stage bytes: 4 stages, 8 micro-batches": 30720}),
        # the pipeline, the most without remat: with remat for every layout fsdp_tp fits twice its layers
        (
            lesson12.check_fit_prediction,
            {**FIT, "the most layers with remat, the pipeline included": "pp_dp"},
        ),
        # fsdp_tp again at batch 64: tp_sp's split of the kept residual stream now outweighs fsdp's of
        # the state
        (
            lesson12.check_fit_prediction,
            {**FIT, "the most layers with remat at batch 64, the pipeline aside": "fsdp_tp"},
        ),
        # dp's compute alone: the hidden traffic taken as free though it outlasts the compute
        (lesson12.check_step_prediction, {**STEP, "dp's step in ms": 25.0}),
        # the gradients as float32 (4 bytes): twice the time
        (lesson12.check_step_prediction, {**STEP, "dp's step in ms": 132.0}),
        # seconds where milliseconds are asked
        (lesson12.check_step_prediction, {**STEP, "dp's step in ms": 0.0666}),
        # dp, the winner on NVLink alone
        (lesson12.check_step_prediction, {**STEP, "the fastest layout": "dp"}),
        # fsdp_tp, which ties 3d when only an axis named data crosses: its fsdp axis crosses too
        (lesson12.check_step_prediction, {**STEP, "the fastest layout": "fsdp_tp"}),
        # the forward's dispatch and return only (the backward's two left out)
        (lesson12.check_expert_prediction, {**EXPERT, "all-to-alls over expert per step": 32}),
        # one all-to-all per layer and direction of the whole step counted once per layer
        (lesson12.check_expert_prediction, {**EXPERT, "all-to-alls over expert per step": 16}),
        # the bandwidth ratio alone (9x): the alpha terms do not scale by it
        (
            lesson12.check_expert_prediction,
            {**EXPERT, "their time with expert across the nodes / inside": 9.0},
        ),
        # the alpha ratio alone (2x)
        (
            lesson12.check_expert_prediction,
            {**EXPERT, "their time with expert across the nodes / inside": 2.0},
        ),
        # the buffer in float32 (4 bytes): about twice the time
        (
            lesson12.check_expert_prediction,
            {**EXPERT, "the all-to-alls' time per step, expert inside a node, in ms": 12.6},
        ),
        # the capacity of the whole batch's tokens (16 x one device's): about 15 x the time
        (
            lesson12.check_expert_prediction,
            {**EXPERT, "the all-to-alls' time per step, expert inside a node, in ms": 96.1},
        ),
        # the alpha terms left out (64 x 10 us): 5.97 ms, 10 % short
        (
            lesson12.check_expert_prediction,
            {**EXPERT, "the all-to-alls' time per step, expert inside a node, in ms": 5.97},
        ),
    ],
)
def test_wrong_predictions_are_refused(check, wrong):
    rejects(
        check,
        wrong,
        match=r"1 of your \d predictions are not what the model says \(attempt 1 .*hint: ",
    )


def test_attempts_are_counted_per_exercise(capsys):
    # two wrong attempts at exercise 1, then the right one: the verdict says so; exercise 2 counts apart
    for _ in range(2):
        rejects(
            lesson12.check_pipe_prediction,
            {**PIPE, "stage: 4 micro-batches / the lab's 2": 2.0},
            match=r"attempt \d \(\d wrong so far\)",
        )
    assert _attempts.attempts("pipe_predictions") == (2, 2)
    assert lesson12.check_pipe_prediction(PIPE)
    assert "on attempt 3, after 2 wrong" in capsys.readouterr().out
    assert lesson12.check_fit_prediction(FIT)
    assert "on the first attempt" in capsys.readouterr().out
    # a right answer judged again is not called a guess; malformed ones are not attempts
    assert lesson12.check_fit_prediction(FIT)
    assert "again (attempt 2; none wrong)" in capsys.readouterr().out
    rejects(
        lesson12.check_fit_prediction,
        {**FIT, "the most layers, the pipeline aside": "ddp"},
        match="not one of",
    )
    assert _attempts.attempts("fit_predictions") == (2, 0)


def test_missing_and_malformed_predictions_are_refused():
    rejects(
        lesson12.check_fit_prediction,
        {**FIT, "the most layers, the pipeline aside": None},
        match="no prediction for 'the most layers, the pipeline aside'",
    )
    rejects(
        lesson12.check_crossing_prediction,
        {**CROSSING, "tp_sp at batch 8": 1},
        match="not one of the names it can be.*'data', 'model'",
    )
    rejects(
        lesson12.check_step_prediction,
        {**STEP, "dp's step in ms": "66 ms"},
        match="not a number",
    )
    rejects(
        lesson12.check_pipe_prediction,
        {**PIPE, "stage: 4 micro-batches / the lab's 2": True},
        match="not a number",
    )


def test_names_outside_the_choices_lists_and_units_get_their_own_hint():
    # a name in another case, or one that is not a choice, is named as such (not judged as physics)
    for wrong in ("Model", "context"):
        rejects(
            lesson12.check_crossing_prediction,
            {**CROSSING, "tp_sp at batch 8": wrong},
            match=f"is '{wrong}', not one of the names it can be.*spelled as here",
        )
    rejects(
        lesson12.check_fit_prediction,
        {**FIT, "the most layers, the pipeline aside": "PP_DP"},
        match="not one of the names it can be",
    )
    rejects(lesson12.check_step_prediction, list(STEP.items()), match="is a list, not a dict")
    rejects(
        lesson12.check_step_prediction,
        {**STEP, "dp's step in ms": 0.0666},
        match="asks for milliseconds: a time in seconds is 1000 x smaller",
    )


def test_the_pipeline_hint_names_every_leaf_all_reduced_over_stage():
    # the leaves outside the stages' layers: both embeddings, the final LayerNorm, the head, and the loss
    with pytest.raises(ExerciseError) as refused:
        lesson12.check_pipe_prediction({**PIPE, "stage: global batch 32 / the lab's 16": 2.0})
    hint = " ".join(str(refused.value).split())  # the message as one line, however it is wrapped
    for leaf in ("token and position embeddings", "final LayerNorm", "the head", "the loss"):
        assert leaf in hint, leaf

"""Exercise checkers of lesson 07 (course_tools.checks.lesson07): each accepts the reference answer and
other correct forms, rejects typical wrong answers with its own hint, and prints "not written yet" for the
student stub (8 simulated CPU devices from conftest.py)."""

import re

import answers_lesson07 as a
import jax
import pytest
from checking import rejects, use_tolerance

from course_tools.checks import ExerciseError, lesson07
from course_tools.checks import _lesson07_remat as _remat


def stub(*args, **kwargs):
    raise NotImplementedError("Exercise: write this part")


def test_stubs_print_not_written_and_return_false(monkeypatch, capsys):
    monkeypatch.delenv("COURSE_STRICT_CHECKS", raising=False)
    assert lesson07.check_memory_prediction(stub) is False
    assert lesson07.check_remat_loss(stub) is False
    assert lesson07.check_train_loop(stub) is False
    out = capsys.readouterr().out
    assert out.count("not written yet") == 3 and out.count("hint:") == 3


def test_memory_prediction():
    assert lesson07.check_memory_prediction(a.predict_memory)
    assert lesson07.check_memory_prediction(a.predict_memory_lists)
    for wrong, count in [
        (a.predict_memory_donated_not_counted, 3),
        (a.predict_memory_three_aliases, 1),
        (a.predict_memory_one_output, 6),
    ]:
        with pytest.raises(ExerciseError, match=f"{count} of your 12 numbers differ") as e:
            lesson07.check_memory_prediction(wrong)
        first = str(e.value).splitlines()[0]  # how many, never which
        assert "donate" not in first and "alias" not in first, first
    with pytest.raises(ExerciseError, match="(?s)1 of your 12 numbers.*reread section 4") as e:
        lesson07.check_memory_prediction(a.predict_memory_wrong_alias)
    assert "same shape and dtype" not in str(
        e.value
    )  # the hint points at the section, not the rule
    rejects(lesson07.check_memory_prediction, lambda: {(): (3, 2, 0)}, match="keys")


@pytest.mark.parametrize(
    "answer",
    [a.remat_loss, a.remat_loss_sqrt, a.remat_loss_scan_blocks],
    ids=lambda f: f.__name__,
)
def test_remat_loss_accepts(answer):
    """The scan over checkpointed √L blocks (the idiomatic form) is judged against the best scan."""
    assert lesson07.check_remat_loss(answer)


# XLA:CPU's temporaries for 4 layers, in activations: a checkpoint around each layer, and the best blocks
# (2 layers each, Python loop): 5.2 and 4.3 under JAX 0.12; 5.3 and 4.2 under JAX 0.10.2 (compiled without
# its cse_barrier_expander, _lesson07_remat.compiled_grad), whose scheduler places one buffer otherwise.
_GIVEN, _BLOCKS = ("5.2", "4.3") if jax.__version_info__ >= (0, 11) else ("5.3", "4.2")
_SCAN_AT = (
    9 if jax.__version_info__ >= (0, 11) else 4
)  # the depth where a per-layer scan is refused


@pytest.mark.parametrize(
    "answer, match",
    [
        (
            a.remat_loss_given,
            f"with 4 layers the gradient's temporaries are {_GIVEN}.*Around one layer",
        ),
        (a.remat_loss_whole, "with 4 layers .* without any checkpoint 5.2.*around the whole loss"),
        (
            a.remat_loss_dots,
            f"with 4 layers .* the best split into checkpointed blocks .* {_BLOCKS}",
        ),
        # a scan over per-layer checkpoints: as good as the best scan at 4 layers, not at 9
        # (JAX 0.10.2's XLA:CPU holds 7.1 against the best scan's 6.1 already at 4 layers)
        (
            a.remat_loss_scan,
            f"with {_SCAN_AT} layers .*blocks of consecutive layers in a loop like yours",
        ),
        (a.remat_loss_scan_whole, "with 4 layers .*in a loop like yours"),
        (a.remat_loss_fixed_3_dummy_scan, f"with 4 layers .*consecutive layers {_BLOCKS}"),
        (a.remat_loss_fixed_4, "with 4 layers .*as a function of k, and choose k from L"),
        (a.remat_loss_pairs, "with 25 layers .* the best split into checkpointed blocks"),
        (a.remat_loss_fixed_3, "with 25 layers .* the best split into checkpointed blocks"),
        (a.remat_loss_skips_a_layer, "loss or its gradient differs"),
    ],
)
def test_remat_loss_rejects(answer, match):
    rejects(lesson07.check_remat_loss, answer, match=match)


@pytest.mark.parametrize("depth", _remat.UNNAMED_DEPTHS)
def test_remat_loss_judges_a_depth_the_exercise_does_not_name(monkeypatch, depth):
    """A block size looked up for the named depths (4, 9, 25) is refused at any depth drawn; the
    reference and the refusal message name no block size."""
    monkeypatch.setattr(_remat, "unnamed_depth", lambda: depth)
    assert lesson07.check_remat_loss(a.remat_loss)
    with pytest.raises(ExerciseError, match=f"with {depth} layers") as e:
        lesson07.check_remat_loss(a.remat_loss_named_depths_only)
    assert "consecutive layers" in str(e.value) and "√" not in str(e.value)
    assert not re.search(r"blocks of \d", str(e.value)) and "L/k + k" not in str(e.value)


@pytest.mark.parametrize(
    "answer",
    [a.train_loop, a.train_loop_log_first, a.train_loop_prefetch_thread, a.train_loop_two_deep],
    ids=lambda f: f.__name__,
)
def test_train_loop_accepts_loops_that_keep_the_devices_busy(answer):
    assert lesson07.check_train_loop(answer)


@pytest.mark.parametrize(
    "answer, match",
    [
        (a.train_loop_naive, r"log\(0\) ran before step 1 was dispatched"),
        (a.train_loop_forgets_last, r"missing: \[5\]"),
        (a.train_loop_wrong_loss, "from the step after"),
        (a.train_loop_blocks, "devices computed during .* of them began with no step running"),
        (a.train_loop_batch_first, "ran before step"),
        (
            a.train_loop_batches_up_front,
            "devices computed during 0 ms.*5 of them began with no step",
        ),
        (a.train_loop_log_before_next, r"log\(0\) ran before step 1 was dispatched"),
        (a.train_loop_reads_loss_early, "[3-5] of the 5 steps .* after the loop waited"),
        (a.train_loop_syncs_state, "[3-5] of the 5 steps .* copying the state to the host"),
        (
            a.train_loop_logs_at_end,
            r"log\(0\) ran after step 5 was dispatched.*while training runs",
        ),
    ],
)
def test_train_loop_rejects(answer, match):
    rejects(lesson07.check_train_loop, answer, match=match)


def test_train_loop_measures_real_overlap():
    """The overlap is measured from when each step really ran: a good loop overlaps most of the host's
    batch-making, a loop that waits for each step overlaps (next to) none of it."""
    from course_tools.checks import _lesson07_loop as loop

    overlapped, total, _ = loop.check_train_loop(a.train_loop)
    assert overlapped >= 0.5 * total > 0
    h = loop.Harness()
    h.run(a.train_loop_blocks, h.warm_up())
    overlapped, total = h.overlap()
    assert overlapped < 0.1 * total and total > 0
    busy = h.busy_intervals()
    assert len(busy) == loop.N_STEPS and all(b > a_ for a_, b in busy)


def test_train_loop_on_a_fast_device(monkeypatch):
    """An accelerator runs the harness's base step in microseconds, less than dispatching it: simulated here
    with one matmul per step. The harness lengthens the steps to MIN_STEP_S, so the reference loop is still
    accepted and a loop that reads each loss before the next dispatch is still refused."""
    from course_tools.checks import _lesson07_loop as loop

    monkeypatch.setattr(loop, "_BASE_ITERS", 1)
    h = loop.Harness()
    assert h.iters[0] == 1
    h.warm_up()
    assert h.device_s >= loop.MIN_STEP_S and h.iters[0] > 1
    assert lesson07.check_train_loop(a.train_loop)
    rejects(
        lesson07.check_train_loop,
        a.train_loop_reads_loss_early,
        match="[3-5] of the 5 steps .* after the loop waited",
    )


def test_remat_loss_at_a_tpus_tolerance(monkeypatch):
    """At the loosest float32 tolerance (a TPU's, 1.6e-2) a loss that skips a layer is still refused."""
    use_tolerance(monkeypatch, "tpu")
    assert lesson07.check_remat_loss(a.remat_loss)
    rejects(
        lesson07.check_remat_loss, a.remat_loss_skips_a_layer, match="loss or its gradient differs"
    )

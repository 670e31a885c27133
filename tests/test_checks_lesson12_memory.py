"""Lab 12's exercise 2 checker (``device_memory``): the reference and another right form pass on fresh
cases; plausible wrong answers are refused, each with the hint its mistake calls for; the library's own
model (``predict_memory``, ``param_bytes``, its private count ``_param_bytes``) and the block of one
array (``lm_layouts.local_bytes``, the piece the exercise asks for) are refused. Analytic: no compile."""

import functools

import answers_lesson12_memory as a
import pytest
from checking import not_written, rejects

from course_tools.checks import lesson12

seeded = functools.partial(lesson12.check_device_memory, seed=0)


def test_the_stub_prints_not_written(monkeypatch, capsys):
    def stub(*args):
        raise NotImplementedError("Exercise: write device_memory")

    not_written(lesson12.check_device_memory, stub, monkeypatch=monkeypatch, capsys=capsys)


@pytest.mark.parametrize("seed", [0, 1])
def test_right_answers_pass(seed):
    assert lesson12.check_device_memory(a.reference, seed=seed)
    assert lesson12.check_device_memory(a.by_block_shape, seed=seed)


@pytest.mark.parametrize(
    "answer, match",
    [
        (a.float32, "of 4-byte values"),
        (a.no_gradients, "two copies of the state"),
        (a.unsplit, "whole model on each device"),
        (a.two_micro_batches, "only the pipeline's cases"),
        (a.remat_ignored, "only the cases with remat=True"),
        (a.fsdp_ignored, "only the FSDP layouts' cases"),
        (a.blocks_whole_per_stage, "whole model on each device"),
        (a.staged_everything, "only the pipeline's cases.*embedding and the head stay whole"),
    ],
)
def test_wrong_answers_are_refused_with_their_hint(answer, match):
    rejects(seeded, answer, match=r"\d+ of 12 cases are wrong.*" + match)


@pytest.mark.parametrize(
    "answer", [a.by_the_model, a.by_param_bytes, a.by_private_param_bytes, a.by_local_bytes]
)
def test_the_library_model_is_refused(answer):
    rejects(seeded, answer, match="calls lm_\\w+\\.(predict_memory|_?param_bytes|local_bytes)")

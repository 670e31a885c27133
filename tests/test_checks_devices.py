"""Checkers on too few devices: where the devices present cannot tell a wrong answer from a right one (one
device, two for some mistakes), a checker judges in a fresh process with 8 simulated CPU devices
(course_tools.checks._common.judge_on) or says it cannot judge, never printing ✓ for an answer it did not
test. Each test runs a process with 1 or 2 simulated devices that calls several checkers, as a notebook run
at that count would (the same answers pass at 8 in tests/test_checks_lessonNN.py); every call there that
judges starts one more process, so each answer here stands for its checker, once."""

import os
import re

import pytest

from course_tools.checks._simulated import run_json

TESTS = os.path.dirname(os.path.abspath(__file__))

CELLS = '''
import jax
from jax import lax


def tp_mlp(x, p, axis_name):
    """The notebook's answer, written in a cell: sent to the fresh process as its source text."""
    h = jax.nn.gelu(x @ p["w1"]["kernel"] + p["w1"]["bias"])
    return lax.psum(h @ p["w2"]["kernel"], axis_name) + p["w2"]["bias"]


ONES = jax.numpy.ones(3)


def tp_mlp_reads_an_array(x, p, axis_name):
    """Reads an array made in the notebook: cannot be sent, so not judged."""
    return tp_mlp(x, p, axis_name) + 0 * ONES.sum()
'''

CHILD = """
import contextlib, importlib, importlib.util, io, json, os, sys, tempfile
os.environ.pop("COURSE_STRICT_CHECKS", None)  # an answer not judged prints why, as in a learner's run
import jax
from course_tools.checks import ExerciseError
path = os.path.join(tempfile.mkdtemp(), "cells.py")
with open(path, "w") as f:
    f.write({cells!r})
spec = importlib.util.spec_from_file_location("notebook_cells", path)
cells = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cells)  # not importable by name, as a notebook's functions are not
got = {{}}
for key, module, check, source, answer in {calls!r}:
    fn = getattr(importlib.import_module(module), check)
    ans = getattr(cells if source == "cells" else importlib.import_module(source), answer)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            verdict = repr(fn(ans, jax.devices()))
    except ExerciseError as e:
        verdict = "refused"
        out.write(str(e))
    got[key] = [verdict, out.getvalue()]
print(json.dumps(got))
"""


def _run(n_devices: int, calls: list[tuple[str, str, str, str]]) -> dict:
    """``{answer: [verdict, printed]}`` for checker calls ``(module, check, answers module, answer)`` in
    a process with ``n_devices`` simulated CPU devices (verdict: the checker's return value's repr, or
    ``"refused"`` with the message printed)."""
    keyed = [(answer, f"course_tools.checks.{m}", c, s, answer) for m, c, s, answer in calls]
    return run_json(CHILD.format(cells=CELLS, calls=keyed), n_devices, timeout_s=1800, path=[TESTS])


WRONG_AT_ONE = [
    (
        "lesson05",
        "check_data_parallel_loop",
        "test_checks_lesson05",
        "train_own_mesh",
        "mesh argument",
    ),
    ("lesson06", "check_halo_stencil", "answers_lesson06", "halo_swapped", "which block each"),
    ("lesson08", "check_zero2", "test_checks_lesson08", "loss_summed_zero2", "8x the mean"),
    ("lesson10", "check_tp_mlp", "answers_lesson10", "tp_mlp_bias_before", "bias 8 times"),
    ("lesson10", "check_ring_attention", "answers_lesson10", "ring_per_block", "first device's"),
    ("lesson10", "check_zero3", "answers_lesson10", "zero3_no_checkpoint", "does not gather again"),
    ("lesson11", "check_gpipe", "answers_lesson11", "gpipe_bf16_send", "rounded.*narrower dtype"),
]
"""Wrong answers that a checker judging on one device accepted (tools/audit_checkers.py), each with what
the checker's message says at 8 devices."""

WRONG_AT_TWO = [
    ("lesson09", "check_block_loader", "test_checks_lesson09", "load_callback", "more than once"),
    ("lesson10", "check_ring_attention", "answers_lesson10", "ring_src_ahead", "later devices'"),
    ("lesson08", "check_zero2", "test_checks_lesson08", "loss_summed_zero2", "8x the mean"),
]
"""Wrong answers that a checker judging on two devices accepted (and ZeRO-2's, which two devices cannot
tell from a right one: its checker sends it to 8)."""


@pytest.mark.parametrize("n_devices", [1, 2])
def test_no_success_mark_for_an_answer_not_tested(n_devices):
    wrong = WRONG_AT_ONE if n_devices == 1 else WRONG_AT_TWO
    calls = [
        *(w[:4] for w in wrong),
        ("lesson10", "check_tp_mlp", "cells", "tp_mlp"),
        ("lesson10", "check_tp_mlp", "cells", "tp_mlp_reads_an_array"),
    ]
    got = _run(n_devices, calls)
    judged = f"judged in a fresh process on 8 simulated CPU devices, since this run has {n_devices} device"
    bad = [
        (answer, got[answer])
        for _, _, _, answer, match in wrong
        if got[answer][0] != "refused"
        or "✓" in got[answer][1]
        or judged not in got[answer][1]
        or not re.search(match, got[answer][1], re.S)
    ]
    assert not bad, bad
    verdict, printed = got["tp_mlp"]  # a right answer written in a cell: sent as its source, passed
    assert verdict == "True" and judged in printed, printed
    assert "✓ the tensor-parallel MLP" in printed, printed
    verdict, printed = got["tp_mlp_reads_an_array"]
    assert verdict == "False" and "✓" not in printed, printed
    assert f"✗ not judged: this run has {n_devices} device" in printed, printed
    assert "ONES, which it uses, is a value of type ArrayImpl" in printed, printed
    assert "n_devices=8, platform='cpu'" in printed, printed

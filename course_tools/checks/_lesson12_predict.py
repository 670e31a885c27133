"""Lab 12's predictions (``notebooks/12_transformer_lab.ipynb``; re-exported by
:mod:`course_tools.checks.lesson12`): exercises 1, 2, 4 and 5 open with a dict of questions (left ``None`` in the
student version) that the learner fills in before writing the exercise's function; a cell judges it, and the
exercise's check cell then prints what the model says. Exercise 3's (:data:`EXPERT_QUESTIONS`) is judged
the same way.

Each judge compares the dict with the cost model itself (:mod:`course_lib.lm_costs`, which the check cell's
printed table and asserts come from), never with the learner's function: a right prediction from a wrong
function, or the reverse, is judged for what it is. The cases are fixed (the ones the check cell prints);
the answers are the model's, computed at each call, not stored. A layout or axis within :data:`TIE` of the
best is right (the model cannot tell them apart); a number is judged within :data:`REL_NUMBER`; a count of
layers or a batch exactly. Says how many predictions are wrong, never which, and counts the attempts
(:mod:`course_tools.checks._attempts`): a verdict after a wrong one says "on attempt 3, after 2 wrong", so a
prediction found by guessing reads as such. Analytic: the same on every
device count and platform.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from numbers import Number

import numpy as np

from course_lib import comms, costs, lm_costs, lm_layouts, transformer

from . import _attempts
from ._common import checker, fail, not_written, passed, plain

__all__ = [
    "CROSSING_QUESTIONS",
    "EXPERT_QUESTIONS",
    "FIT_QUESTIONS",
    "PIPE_QUESTIONS",
    "STEP_QUESTIONS",
    "check_crossing_prediction",
    "check_expert_prediction",
    "check_fit_prediction",
    "check_pipe_prediction",
    "check_step_prediction",
    "step_fabric",
]

TIE = 0.10
"""A layout or an axis within 10 % of the best is as right as the best: the model cannot tell them apart."""
REL_NUMBER = 0.05
"""A predicted time within 5 %: worked by hand, its latency terms or the loss's bytes left out."""

_G = transformer.GPU
_H100, _IB = costs.FABRICS["H100"], costs.LINKS["InfiniBand NDR"]
_CROSS_BATCHES = (8, 16, 32, 64, 128)
FIT_BATCH, FIT_LIMIT = 32, 40e9
"""Exercise 2's question: the GPU configuration's width at batch 32 in 40 GB (40e9 bytes) per device."""
STEP_BATCH = 16


def step_fabric(key: str):
    """Exercise 5's machine, as the model sees it for layout ``key``: two servers of 4 × H100, the layout's
    outermost mesh axis (the first of ``lm_layouts.mesh_axes(key, 8)``: a launcher gives each server
    consecutive devices) spanning them, so its collectives run on InfiniBand NDR (as fast as the slowest link
    a group uses), its inner axes inside a server on NVLink."""
    return _H100.with_axis(next(iter(lm_layouts.mesh_axes(key, 8))), _IB)


CROSSING_QUESTIONS = (
    "tp_sp at batch 8",
    "fsdp_tp at batch 128",
    "pp_dp at batch 128",
    "tp_sp: the smallest batch at which data crosses",
)
"""Exercise 4, two nodes of 8 × H100 on InfiniBand, the ``GPU`` configuration: the axis across the nodes
(a name), and of 8, 16, 32, 64, 128 the first global batch where ``tp_sp`` puts ``data`` across."""
FIT_QUESTIONS = (
    "the most layers, the pipeline aside",
    "what fills most of dp's memory at its limit",
    "what fills most of dp's memory at its limit, with remat",
    "the most layers with remat, the pipeline aside",
    "the most layers with remat, the pipeline included",
    "the most layers with remat at batch 64, the pipeline aside",
)
"""Exercise 2, the ``GPU`` width at batch 32 (the last question: 64) in 40 GB: the layout that fits the
most layers (a name; the pipeline always recomputes, so ``remat`` leaves it unchanged) and, for ``dp`` at
its largest layer count, the larger of its two kinds of memory (:data:`KINDS`), without and with
recomputation."""
KINDS = ("state", "activations")
"""What a device holds, in two: ``state`` (parameters + momentum + gradients) and ``activations``."""
PIPE_QUESTIONS = (
    "stage: 4 micro-batches / the lab's 2",
    "stage: global batch 32 / the lab's 16",
    "stage bytes: 4 stages, 8 micro-batches",
)
"""Exercise 1, ``pp_dp`` at the ``TINY`` size in float32 (the lab's run: data=4 × stage=2, global batch 16,
2 micro-batches): the bytes one device sends over ``stage`` per step with 4 micro-batches (one sequence each), and at
global batch 32, each over the lab's (ratios); and in bytes with data=2 × stage=4 (``TINY`` with 4 layers, one a
stage), 8 micro-batches, global batch 16."""
PIPE_TINY4 = dataclasses.replace(transformer.TINY, n_layers=4)
"""Exercise 1's 4-stage pipeline: the ``TINY`` size with 4 layers (``TINY`` has 2)."""
EXPERT_QUESTIONS = (
    "all-to-alls over expert per step",
    "the all-to-alls' time per step, expert inside a node, in ms",
    "their time with expert across the nodes / inside",
)
"""Exercise 3, ``ep_dp`` on two nodes of 8 × H100 (``mesh_axes("ep_dp", 16)``: data=8 × expert=2), the
``GPU`` configuration (16 layers) at batch 64, capacity factor 1.25, bfloat16: how many all-to-alls over
``expert`` one step runs (a count), their time with ``data`` across the nodes on InfiniBand NDR and
``expert`` inside on NVLink 4 (milliseconds), and the ratio of their time with ``expert`` across to that."""
EXPERT_BATCH, EXPERT_CAPACITY = 64, 1.25
STEP_QUESTIONS = ("the fastest layout", "dp's step in ms")
"""Exercise 5, 8 × H100 with each layout's outermost axis across the servers on InfiniBand
(:func:`step_fabric`), batch 16, data-parallel traffic hidden: the fastest layout but the pipeline (a name)
and ``dp``'s step time in milliseconds."""


def _placements(key: str, batch: int) -> dict[str, float]:
    from ._lesson12_nodes import placement_times

    return placement_times(key, _G, batch, _H100, _IB)


def _near_best(times: Mapping[str, float]) -> set[str]:
    best = min(times.values())
    return {k for k, t in times.items() if t <= (1 + TIE) * best}


def _crossing_truth() -> dict:
    def first_data() -> int:
        return next(b for b in _CROSS_BATCHES if _near_best(_placements("tp_sp", b)) == {"data"})

    return {
        CROSSING_QUESTIONS[0]: _near_best(_placements("tp_sp", 8)),
        CROSSING_QUESTIONS[1]: _near_best(_placements("fsdp_tp", 128)),
        CROSSING_QUESTIONS[2]: _near_best(_placements("pp_dp", 128)),
        CROSSING_QUESTIONS[3]: first_data(),
    }


def fits(limit: float = FIT_LIMIT, batch: int = FIT_BATCH) -> dict[str, int]:
    """The dense layouts' largest layer counts (:func:`course_lib.lm_costs.largest_layers`) of the ``GPU``
    width at ``batch`` in ``limit`` bytes per device."""
    return {k: lm_costs.largest_layers(k, _G, batch, limit) for k in lm_layouts.DENSE_KEYS}


def _fit_truth() -> dict:
    def most(batch: int, pipeline: bool) -> set[str]:
        keys = [k for k in lm_layouts.DENSE_KEYS if pipeline or k != "pp_dp"]
        layers = {k: lm_costs.largest_layers(k, _G, batch, FIT_LIMIT, remat=True) for k in keys}
        return {k for k, v in layers.items() if v == max(layers.values())}

    layers = fits()
    rest = {k: v for k, v in layers.items() if k != "pp_dp"}
    dp_remat = lm_costs.largest_layers("dp", _G, FIT_BATCH, FIT_LIMIT, remat=True)
    return {
        FIT_QUESTIONS[0]: {k for k, v in rest.items() if v == max(rest.values())},
        FIT_QUESTIONS[1]: {_larger_kind("dp", layers["dp"], remat=False)},
        FIT_QUESTIONS[2]: {_larger_kind("dp", dp_remat, remat=True)},
        FIT_QUESTIONS[3]: most(FIT_BATCH, pipeline=False),
        FIT_QUESTIONS[4]: most(FIT_BATCH, pipeline=True),
        FIT_QUESTIONS[5]: most(2 * FIT_BATCH, pipeline=False),
    }


def _larger_kind(key: str, n_layers: int, *, remat: bool) -> str:
    """``"state"`` or ``"activations"``: the larger in layout ``key``'s memory per device (the ``GPU`` width
    with ``n_layers`` layers, batch :data:`FIT_BATCH`, bfloat16, 8 devices)."""
    mem = lm_costs.predict_memory(key, dataclasses.replace(_G, n_layers=n_layers), FIT_BATCH,
                                  lm_layouts.mesh_axes(key, 8), 2, remat=remat)  # fmt: skip
    return (
        "state"
        if mem["params"] + mem["optimizer"] + mem["gradients"] > mem["activations"]
        else KINDS[1]
    )


def _pipe_sent(stages: int, n_micro: int, batch: int = 16, cfg=transformer.TINY) -> float:
    """Bytes one device sends over ``stage`` per step of ``pp_dp`` on 8 devices (data = 8 / ``stages``), in
    float32, by :func:`course_lib.lm_costs.predict_bytes`: exercise 1's predictions' truth."""
    sizes = {"data": 8 // stages, "stage": stages}
    sent = lm_costs.predict_bytes("pp_dp", cfg, batch, sizes, itemsize=4, n_micro=n_micro)
    return comms.sent_by_axis(sent)["stage"]


def _pipe_truth() -> dict:
    lab = _pipe_sent(2, 2)
    return {
        PIPE_QUESTIONS[0]: _pipe_sent(2, 4) / lab,
        PIPE_QUESTIONS[1]: _pipe_sent(2, 2, batch=32) / lab,
        PIPE_QUESTIONS[2]: float(_pipe_sent(4, 8, cfg=PIPE_TINY4)),
    }


def _expert_truth() -> dict:
    from course_lib import lm_experts

    from ._lesson12_experts import model_seconds

    sizes = lm_layouts.mesh_axes("ep_dp", 16)
    sent = lm_experts.predict_bytes(_G, EXPERT_BATCH, sizes, itemsize=2,
                                    capacity_factor=EXPERT_CAPACITY)  # fmt: skip
    seconds = {
        across: model_seconds(
            _G, EXPERT_BATCH, sizes, _H100.with_axis(across, _IB), EXPERT_CAPACITY
        )
        for across in ("data", "expert")
    }
    return {
        EXPERT_QUESTIONS[0]: sum(t.kind == "all-to-all" for t in sent),
        EXPERT_QUESTIONS[1]: seconds["data"] * 1e3,
        EXPERT_QUESTIONS[2]: seconds["expert"] / seconds["data"],
    }


def _step_truth() -> dict:
    from ._lesson12_time import model_step

    keys = [k for k in lm_layouts.DENSE_KEYS if k != "pp_dp"]
    times = {k: model_step(k, _G, STEP_BATCH, step_fabric(k)) for k in keys}
    return {STEP_QUESTIONS[0]: _near_best(times), STEP_QUESTIONS[1]: times["dp"] * 1e3}


def _judge(name: str, predictions, questions: tuple, truth: Callable[[], dict], hint: str) -> bool:
    write = f"write an answer for every entry of {name}, then run this cell"
    if predictions is not None and not isinstance(predictions, Mapping):
        fail(
            f"{name} is a {type(predictions).__name__}, not a dict",
            f"keep {name} a dict and fill in its values: {{question: answer}}",
        )
    values = dict(predictions or {})
    if all(v is None or v is Ellipsis for v in values.values()):
        not_written(name, write)
    missing = [q for q in questions if values.get(q) is None or values.get(q) is Ellipsis]
    if missing:
        fail(f"no prediction for {missing[0]!r}", write)
    want = truth()
    wrong, units = 0, None
    for q in questions:
        got, right = plain(values[q]), want[q]
        if isinstance(right, set):
            if not isinstance(got, str) or got not in _names(q):
                fail(
                    f"the prediction for {q!r} is {got!r}, not one of the names it can be",
                    f"one of {sorted(_names(q))}, spelled as here",
                )
            wrong += got not in right
        else:
            if isinstance(got, bool) or not isinstance(got, Number | np.number):
                fail(f"the prediction for {q!r} is {got!r}, not a number", "write a number")
            if isinstance(right, int):
                wrong += got != right
            else:
                off = not abs(float(got) - right) <= REL_NUMBER * abs(right)
                if (
                    off
                    and q.endswith(" in ms")
                    and abs(float(got) * 1e3 - right) <= REL_NUMBER * right
                ):
                    units = q
                wrong += off
    verdict = _attempts.record(name, right=not wrong)  # every judged call counts (_attempts)
    if wrong:
        if units:
            hint = f"{units!r} asks for milliseconds: a time in seconds is 1000 x smaller; " + hint
        fail(
            f"{wrong} of your {len(questions)} predictions are not what the model says ({verdict}; the "
            "verdict of a later attempt says how many came before it)",
            hint,
        )
    return passed(f"all {len(questions)} predictions are what the model says, {verdict}")


def _names(question: str) -> set[str]:
    if question in CROSSING_QUESTIONS:
        key = question.split()[0]
        return set(lm_layouts.mesh_axes(key, 16))
    if question.startswith("what fills"):
        return set(KINDS)
    return set(lm_layouts.DENSE_KEYS)


@checker
def check_crossing_prediction(predictions: Mapping | None) -> bool:
    """Exercise 4's predictions (:data:`CROSSING_QUESTIONS`) against the two-tier model
    (:func:`course_tools.checks._lesson12_nodes.placement_times`: two nodes of 8 × H100 on InfiniBand
    NDR, the ``GPU`` configuration, bfloat16); an axis within :data:`TIE` of the fastest placement counts."""
    return _judge(
        "crossing_predictions", predictions, CROSSING_QUESTIONS, _crossing_truth,
        "the axis across the nodes runs its collectives, and every group that includes it, on the slow "
        "link, so it should be the axis that sends the least per step: the data (or fsdp) axis sends the "
        "gradients, the same bytes at every batch; the model and context axes send activations, which grow "
        "with the batch; the pipeline's stage axis sends one micro-batch's activations per tick. Compare "
        "their bytes (lm_costs.predict_bytes on 16 devices) at each batch",
    )  # fmt: skip


@checker
def check_fit_prediction(predictions: Mapping | None) -> bool:
    """Exercise 2's predictions (:data:`FIT_QUESTIONS`) against :func:`fits` and
    :func:`course_lib.lm_costs.predict_memory` (the memory model); a layout tied with the most (or the
    fewest) counts as right; a kind of memory is one of :data:`KINDS`."""
    return _judge(
        "fit_predictions", predictions, FIT_QUESTIONS, _fit_truth,
        "a device holds its share of the layers' parameters, momentum and gradients (what its specs split) "
        "and the activations its batch, heads or sequence share leave it. Ask per layer which of the two "
        "grows faster: at sequence 2048 the attention scores [b, H, S, S] outweigh a layer's weights, and "
        "every layout splits them 8 ways; with remat a layer keeps only its input [b, S, D]: set that "
        "beside the layer's state as each layout's specs split it, at each batch; the pipeline always "
        "recomputes (remat changes nothing there): it holds its stage's layers and one micro-batch's "
        "values",
    )  # fmt: skip


@checker
def check_pipe_prediction(predictions: Mapping | None) -> bool:
    """Exercise 1's predictions (:data:`PIPE_QUESTIONS`) against
    :func:`course_lib.lm_costs.predict_bytes` (which the notebook checks against the compiled program at
    the lab's own sizes), each within :data:`REL_NUMBER`."""
    return _judge(
        "pipe_predictions", predictions, PIPE_QUESTIONS, _pipe_truth,
        "write the bytes over stage as a formula before any number: a tick's send is one micro-batch "
        "[global_batch / n_data / n_micro, S, D], there are 2 (n_micro + p - 2) of them, and each shift "
        "leaves one stage silent (the last going forward, the first going backward: on average (p - 1)/p "
        "of the devices send); beside them the gradients of the token and position embeddings, the final "
        "LayerNorm and the head, and the loss, are all-reduced over stage, whatever the batch or the "
        "micro-batches. See what cancels at p = 2 and what does not at p = 4",
    )  # fmt: skip


@checker
def check_expert_prediction(predictions: Mapping | None) -> bool:
    """Exercise 3's predictions (:data:`EXPERT_QUESTIONS`) against
    :func:`course_lib.lm_experts.predict_bytes` (the count) and
    :func:`course_tools.checks._lesson12_experts.model_seconds` (the times), the count exactly, the time
    and the ratio within :data:`REL_NUMBER`."""
    return _judge(
        "expert_predictions", predictions, EXPERT_QUESTIONS, _expert_truth,
        "count per layer: the tokens go to their experts' devices and the outputs come back, and the "
        "backward pass runs both again, transposed; each all-to-all moves the dispatch buffer [E, C, D] in "
        "bfloat16, C = moe.capacity of the tokens ONE device routes (global_batch / 16 sequences of "
        "seq_len), and costs (n - 1) α + (n - 1)/n of the buffer over the link's bandwidth on the expert "
        "axis's link (n = 2). In the ratio the count cancels, the α terms do not: work both terms out on "
        "each link before dividing",
    )  # fmt: skip


@checker
def check_step_prediction(predictions: Mapping | None) -> bool:
    """Exercise 5's predictions (:data:`STEP_QUESTIONS`) against the step-time model
    (:func:`course_tools.checks._lesson12_time.model_step`, ``overlap="data"``, no roofline) at
    :data:`STEP_BATCH`, each layout on its :func:`step_fabric`; a layout within :data:`TIE` of the fastest
    counts, the time within :data:`REL_NUMBER`."""
    return _judge(
        "step_predictions", predictions, STEP_QUESTIONS, _step_truth,
        "the hidden traffic is hidden only up to the compute: a step lasts the longer of the two, plus what "
        "the next matmul waits for. On InfiniBand (50 GB/s, 9 x less than NVLink) the gradients' "
        "all-reduce over 8 devices moves about twice the bfloat16 gradients through each GPU's link; a "
        "layout whose outermost axis carries little (a short data axis, gradients split by the inner "
        "axes) keeps that traffic small",
    )  # fmt: skip

"""Checkers for ``12_transformer_lab.ipynb``: which axis crosses the nodes of a two-tier network (the lab's
main exercise, :mod:`._lesson12_nodes`), the memory a device holds under each layout
(:mod:`._lesson12_memory`) and the largest model that fits a memory limit, the
pipeline's bytes per mesh axis, a layout's step time predicted by hand (:mod:`._lesson12_time`), and the
time ``ep_dp``'s all-to-alls take over the expert axis (:mod:`._lesson12_experts`); and the predictions that
open exercises 1 to 5, judged against the model (:mod:`._lesson12_predict`).

None of them holds an answer: each compares the learner's function, on cases drawn afresh at every call
(``seed``: for tests), with :mod:`course_lib.lm_costs` — the step-time model
(:func:`~course_lib.lm_costs.step_time` on a two-tier fabric), the memory model
(:func:`~course_lib.lm_costs.largest_layers`) and :func:`~course_lib.lm_costs.predict_bytes`, which equals
the compiled pipeline's bytes (asserted in the notebook). Each says how many cases are wrong, and in which
part, never which case (an answer that raises is shown the call that raised, to rerun it). An answer that
calls the function the checker compares with is refused (:mod:`._unaided`: from any thread, under any
alias, or as a copy of its code; a copied and edited source cannot be detected — the checkers are a
self-test): the exercise is to build it from its pieces.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from course_lib import comms, lm_costs, lm_layouts, transformer

from ._common import checker, fail, passed, plain
from ._lesson12_experts import check_expert_a2a_seconds
from ._lesson12_memory import check_device_memory
from ._lesson12_nodes import check_node_placement
from ._lesson12_predict import (
    CROSSING_QUESTIONS,
    EXPERT_QUESTIONS,
    FIT_QUESTIONS,
    KINDS,
    PIPE_QUESTIONS,
    PIPE_TINY4,
    STEP_QUESTIONS,
    check_crossing_prediction,
    check_expert_prediction,
    check_fit_prediction,
    check_pipe_prediction,
    check_step_prediction,
    step_fabric,
)
from ._lesson12_time import check_step_time
from ._unaided import call_unaided as _call_unaided

__all__ = [
    "CROSSING_QUESTIONS",
    "EXPERT_QUESTIONS",
    "FIT_QUESTIONS",
    "KINDS",
    "PIPE_QUESTIONS",
    "PIPE_TINY4",
    "STEP_QUESTIONS",
    "check_crossing_prediction",
    "check_expert_prediction",
    "check_fit_prediction",
    "check_pipe_prediction",
    "check_step_prediction",
    "check_node_placement",
    "check_largest_model",
    "check_device_memory",
    "check_pipeline_bytes",
    "check_step_time",
    "check_expert_a2a_seconds",
    "step_fabric",
]

_G = transformer.GPU

_MODEL = (lm_costs.step_time, lm_costs.rank_layouts, lm_costs.largest_layers)
"""What the largest-model checker compares with: an answer must not call them."""
_BYTES = (lm_costs.predict_bytes, lm_costs._pipeline_transfers)
"""What the pipeline checker compares with."""


def _config_expr(cfg) -> str:
    """``cfg`` as code a learner can paste: ``transformer.GPU`` or ``transformer.TINY``, or the one of the
    two it differs from least with its other sizes (``dataclasses.replace(transformer.GPU, seq_len=8192)``)."""
    options = []
    for name, base in (("GPU", _G), ("TINY", transformer.TINY)):
        changed = [f"{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)
                   if getattr(cfg, f.name) != getattr(base, f.name)]  # fmt: skip
        code = f"dataclasses.replace(transformer.{name}, {', '.join(changed)})"
        options.append((len(changed), code if changed else f"transformer.{name}"))
    return min(options)[1]


# ---- exercise 2: the largest model that fits ---------------------------------------------------------------


def _fit_configs(rng) -> list:
    """Widths of the GPU configuration and others (sequence, vocabulary, MLP width)."""
    return [
        _G,
        dataclasses.replace(_G, seq_len=int(rng.choice([1024, 4096]))),
        dataclasses.replace(_G, d_model=1024, n_heads=8, d_ff=int(rng.choice([2048, 4096]))),
        dataclasses.replace(_G, vocab=int(rng.choice([16384, 65536]))),
    ]


def _memory_at(key, cfg, batch, n_layers) -> int:
    return lm_costs.step_time(
        key, dataclasses.replace(cfg, n_layers=n_layers), batch, lm_costs.FABRICS["H100"]
    )["memory_bytes"]


def _fit_cases(rng) -> list[tuple]:
    """(layout, config, global batch, memory limit): every layout twice, limits drawn between a few and
    dozens of layers; one at a count's memory exactly (``<=``), the pipeline between two counts of layers,
    one where not a single layer (stage) fits, and one whose count is above 100 layers (a search capped at
    64 or 100 layers is seen)."""
    configs = _fit_configs(rng)
    # the dense transformer's layouts (ep_dp trains another model)
    keys = list(lm_layouts.DENSE_KEYS)
    cases = []
    exact = int(rng.integers(2 * len(keys)))
    for i, key in enumerate(keys * 2):
        cfg = configs[int(rng.integers(len(configs)))]
        batch = int(rng.choice([32, 64])) if key == "pp_dp" else int(rng.choice([8, 16, 32]))
        p = lm_layouts.mesh_axes(key, 8).get("stage", 1)
        one, two = _memory_at(key, cfg, batch, p), _memory_at(key, cfg, batch, 2 * p)
        n = int(rng.integers(2, 40))
        if i == exact:  # a count's memory exactly
            limit = float(one + (n - 1) * (two - one))
        else:
            # the pipeline: past half a stage's increment (so one layer more than a stage count fits
            # by a line drawn through single layers)
            low = 0.55 if p > 1 else 0.05
            limit = float(one + (n - 1 + rng.uniform(low, 0.95)) * (two - one))
        cases.append((key, cfg, batch, limit))
    key = keys[int(rng.integers(len(keys)))]
    cfg = configs[int(rng.integers(len(configs)))]
    p = lm_layouts.mesh_axes(key, 8).get("stage", 1)
    one, two = _memory_at(key, cfg, 32, p), _memory_at(key, cfg, 32, 2 * p)
    cases.append((key, cfg, 32, float((2 * one - two) * rng.uniform(0.3, 0.95))))  # below no layers
    key = keys[int(rng.integers(len(keys)))]
    cfg = configs[int(rng.integers(len(configs)))]
    p = lm_layouts.mesh_axes(key, 8).get("stage", 1)
    one, two = _memory_at(key, cfg, 32, p), _memory_at(key, cfg, 32, 2 * p)
    n = int(rng.integers(104, 200)) // p  # stages: above 100 layers
    low = 0.55 if p > 1 else 0.05
    cases.append((key, cfg, 32, float(one + (n - 1 + rng.uniform(low, 0.95)) * (two - one))))
    rng.shuffle(cases)
    return cases


@checker
def check_largest_model(largest: Callable, *, seed: int | None = None) -> bool:
    """``largest(layout, cfg, global_batch, memory_limit) -> n_layers``: the most layers of ``cfg``'s width
    whose predicted memory per device is at most the limit (a multiple of the stages for the pipeline; 0 when
    none fits), compared with :func:`course_lib.lm_costs.largest_layers` on cases drawn afresh (``seed``:
    for tests): every layout, several widths, a limit at a count's memory exactly, one where nothing fits,
    one above 100 layers; an answer that is not an int (``numpy`` integers are) is refused.
    Says how many counts are too large and too small, not which (and, where every wrong count is the limit
    read as GiB, that). An answer that calls ``largest_layers``,
    ``step_time`` or ``rank_layouts`` is refused."""
    cases = _fit_cases(np.random.default_rng(seed))
    over = under = 0
    as_gib = (
        True  # every wrong count is the one of the limit read as GiB (a "GB" taken for 2**30 bytes)
    )
    as_f32 = only_pipeline = (
        True  # every wrong count is float32's; every wrong case is the pipeline
    )
    for key, cfg, batch, limit in cases:
        what = f"largest_model({key!r}, {_config_expr(cfg)}, {batch}, {limit!r})"
        got = _call_unaided(
            what, largest, _MODEL,
            "count the memory yourself (lm_costs.predict_memory gives it by kind) at the layer counts "
            "you need: largest_layers is what the checker compares with",
            key, cfg, batch, limit,
        )  # fmt: skip
        if not isinstance(got, int | np.integer) or isinstance(got, bool):
            fail(
                f"{what} returned {plain(got)!r} ({type(got).__name__})",
                "return the number of layers as an int (a whole count, not a float, a string or a bool: "
                "int(...) of a count you computed as a float, after checking it is whole)",
            )
        got = int(got)
        truth = lm_costs.largest_layers(key, cfg, batch, limit)
        over += got > truth
        under += got < truth
        if got != truth:
            as_gib &= got == lm_costs.largest_layers(key, cfg, batch, limit * 2**30 / 1e9) != truth
            as_f32 &= got == lm_costs.largest_layers(key, cfg, batch, limit / 2) != truth
            # the pipeline's "4 micro-batches per stage" read as 4 in all
            only_pipeline &= key == "pp_dp" and got == lm_costs.largest_layers(
                key, cfg, batch, limit, n_micro=4
            )
    if over or under:
        hints = []
        if as_f32 and not as_gib:
            hints.append(
                "every wrong count is the one of 4-byte values: the lab holds everything in bfloat16, "
                "2 bytes a value"
            )
        elif only_pipeline:
            hints.append(
                "only the pipeline's counts are wrong: it runs 4 micro-batches per stage (with 2 "
                "stages, 8 micro-batches of each data shard's batch) and holds its stage's layers plus "
                "the micro-batch activations its executor stashes (lm_costs.activation_bytes says which)"
            )
        if as_gib:
            hints.append(
                "every wrong count is the one for the limit read as GiB: memory_limit is bytes, the "
                "vendors' GB (40e9 is 40 GB); compare bytes with bytes"
            )
        if over:
            hints.append(
                "too many: the memory of the count you return (params + optimizer + gradients + "
                "activations, bfloat16) must be at most the limit, and a pipeline's count a multiple of "
                "its stages"
            )
        if under:
            hints.append(
                "too few: a larger count still fits (at most the limit, not below it; a multiple of the "
                "stages for the pipeline); 0, never less, when not even one fits"
            )
        fail(
            f"{over + under} of {len(cases)} cases are wrong ({over} too many layers, {under} too few)",
            "; ".join(hints),
        )
    return passed(f"the largest model right in all {len(cases)} cases, every layout")


# ---- exercise 1: the pipeline's bytes -----------------------------------------------------------------------

_BYTES_CASES = 8


def _bytes_cases(rng) -> list[tuple]:
    """(stages, data, micro-batches, config, global batch, itemsize): one data shard, one stage, fewer and
    more micro-batches than stages, every itemsize, configs drawn (vocabulary, sequence, widths, layers)."""
    shapes = [(2, 4), (4, 2), (8, 1), (1, 8), (2, 2), (4, 1), (2, 1), (1, 2)]
    cases = []
    for p, d in shapes:
        m = int(rng.choice([1, 2, 3, 4, 8]))
        cfg = dataclasses.replace(
            transformer.TINY,
            vocab=int(rng.choice([16, 24, 64])),
            seq_len=int(rng.choice([8, 16, 32])),
            d_model=int(rng.choice([16, 32, 48])),
            d_ff=int(rng.choice([32, 64, 96])),
            n_layers=p * int(rng.integers(1, 4)),
        )
        batch = d * m * int(rng.integers(1, 4))
        cases.append((p, d, m, cfg, batch, int(rng.choice([2, 4, 8]))))
    rng.shuffle(cases)
    return cases


@checker
def check_pipeline_bytes(pipeline_bytes: Callable, *, seed: int | None = None) -> bool:
    """``pipeline_bytes(n_stages, n_data, n_micro, cfg, global_batch, itemsize) -> {"stage", "data"}``: the
    bytes one device sends per step of ``pp_dp``, compared with :func:`course_lib.lm_costs.predict_bytes`
    (which the notebook checks against the compiled program) on :data:`_BYTES_CASES` cases drawn afresh
    (``seed``: for tests). Says how many cases are wrong over each axis, not which. An answer that calls
    ``predict_bytes`` is refused."""
    cases = _bytes_cases(np.random.default_rng(seed))
    wrong = {"stage": 0, "data": 0}
    n_wrong = 0
    for p, d, m, cfg, batch, itemsize in cases:
        what = f"pipeline_bytes({p}, {d}, {m}, {_config_expr(cfg)}, {batch}, {itemsize})"
        got = _call_unaided(
            what, pipeline_bytes, _BYTES,
            "count the transfers from the shapes: predict_bytes is what the checker compares with",
            p, d, m, cfg, batch, itemsize,
        )  # fmt: skip
        if not isinstance(got, dict):
            fail(
                f"{what} returned {type(got).__name__}",
                'return a dict {"stage": bytes, "data": bytes}',
            )
        truth = comms.sent_by_axis(lm_costs.predict_bytes("pp_dp", cfg, batch, {"data": d, "stage": p},
                                                            itemsize=itemsize, n_micro=m))  # fmt: skip
        bad = [a for a in wrong if not math.isclose(float(got.get(a, 0.0)), truth.get(a, 0.0),
                                                    rel_tol=1e-9, abs_tol=1e-6)]  # fmt: skip
        for a in bad:
            wrong[a] += 1
        n_wrong += bool(bad)
    if n_wrong:
        hints = {
            "stage": "stage: GPipe runs m + p - 1 ticks forward and as many backward; count the sends a later "
            "tick reads, each one micro-batch [global_batch / n_data / n_micro, S, D], as a mean over the "
            "devices (a shift that stops at the last stage); plus the ring all-reduce of the embedding's "
            "and the head's gradients and the loss",
            "data": "data: the ring all-reduce (2(n-1)/n of its array) of every gradient a device holds — its "
            "stage's layers, the token and position embeddings, the final LayerNorm, the head — and the "
            "loss, itemsize bytes each",
        }
        fail(
            f"{n_wrong} of {len(cases)} cases are wrong ({wrong['stage']} over stage, {wrong['data']} over "
            "data)",
            "; ".join(hints[a] for a in hints if wrong[a]),
        )
    return passed(f"the pipeline's bytes per axis right in all {len(cases)} cases")

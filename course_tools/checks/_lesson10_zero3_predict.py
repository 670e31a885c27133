"""Lesson 10, exercise 4's prediction, made before building ZeRO-3: how many times a training step gathers
each layer's parameters, and the bytes each device sends per step, under ``jax.checkpoint``.

The answer ``predict_zero3(P, n)`` → ``(gathers_per_layer, bytes_sent)`` is judged by its values on cases
drawn afresh at every call: ``n`` of 1, 2, 3, 4, 8 and 16 devices on the ``data`` axis and ``P`` (the bytes of
all the blocks' parameters) drawn. The reference is the ring model of ``notebooks/10_transformers.ipynb``,
section 4: each layer gathered in the forward pass and again in the backward pass (the checkpoint keeps
nothing), its gradient reduce-scattered, each collective sending ``(n − 1)/n`` of its buffer: ``2`` gathers a
layer and ``3(n − 1)/n · P`` bytes. A wrong answer equal on every case to one of :data:`MISTAKES` is named
with that mistake's hint; otherwise the hint lists the parts. :func:`course_lib.split_time.split_cost`
(section 6's model, which lists ZeRO-3's collectives with their bytes) is refused.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from course_lib import split_time

from ._common import checker, fail, passed
from ._lesson10_predict import number_pair
from ._unaided import call_unaided

COUNTS = (1, 2, 3, 4, 8, 16)
"""The device counts asked, each with a ``P`` drawn afresh."""


def cases(rng: np.random.Generator) -> list[tuple[int, int]]:
    """``(P, n)``: ``P`` bytes drawn from 4 B to 40 MB (a multiple of 4: float32 parameters), one per count
    of :data:`COUNTS`, in a drawn order."""
    return [(int(rng.integers(1, 10_000_001)) * 4, int(n)) for n in rng.permutation(COUNTS)]


def reference(p_bytes: int, n: int) -> tuple[int, float]:
    """``(2, 3(n − 1)/n · P)``: forward and backward gathers of each layer, and the gathers' and the
    gradient reduce-scatter's ring bytes per device per step."""
    gathers, ring_share = 2, (n - 1) / n  # each gather and the reduce-scatter send this share of P
    return gathers, 3 * ring_share * p_bytes


MISTAKES: tuple[tuple[Callable, str], ...] = (
    (
        lambda p, n: (2, 2 * (n - 1) / n * p),
        "under jax.checkpoint the backward pass gathers each layer again: the forward's gathers, the "
        "backward's gathers and the gradients' reduce-scatter each send their share",
    ),
    (
        lambda p, n: (2, 3 * p),
        "a ring all-gather or reduce-scatter does not send the whole buffer: each device already holds its own "
        "1/n of it",
    ),
    (
        lambda p, n: (2, 3 * (n - 1) / n * p / n),
        "P is the bytes of all the blocks' parameters, not one device's shard: the gathers rebuild every "
        "layer in full",
    ),
    (
        lambda p, n: (2, 3 * (n - 1) * p),
        "P is the bytes of all the blocks' parameters, not one device's shard: the gathers rebuild every "
        "layer in full",
    ),
    (
        lambda p, n: (2, 4 * (n - 1) / n * p),
        "the transpose of an all-gather is a reduce-scatter, not an all-reduce: each device keeps only its "
        "shard of the gradient",
    ),
    (
        lambda p, n: (1, 3 * (n - 1) / n * p),
        "count the gathers of a layer: the forward pass gathers it; under jax.checkpoint, which keeps nothing "
        "of the layer, what does the backward pass need before it can recompute the block?",
    ),
    (
        lambda p, n: (3, 3 * (n - 1) / n * p),
        "the gradient's reduce-scatter sends bytes, but it is not a gather of the layer's parameters",
    ),
)
"""``(answer, hint)``: typical wrong predictions and what each misses."""

HINT = (
    "per step: which collectives touch a layer's parameters (forward, backward under the checkpoint, the "
    "gradient), and what one device sends in each by the ring model, as a share of P"
)


def _pair(got, what):
    keys, shown = ("gathers_per_layer", "sent"), ("gathers_per_layer", "bytes_sent")
    return number_pair("predict_zero3", got, what, keys, shown)


def _same(got, want) -> bool:
    return got[0] == want[0] and bool(np.isclose(got[1], want[1], rtol=1e-6, atol=1e-9))


@checker
def check_predict_zero3(predict_zero3: Callable, *, seed: int | None = None) -> bool:
    """Exercise 4's prediction (the module docstring): ``predict_zero3(P, n)`` → ``(gathers_per_layer,
    bytes_sent)`` (or a dict with ``"gathers_per_layer"`` and ``"sent"``) for one training step of ZeRO-3
    under ``jax.checkpoint`` on a ``data`` axis of ``n`` devices, the blocks' parameters ``P`` bytes in all.
    ``seed``: the cases' draw, for tests (None: fresh).

    Raises:
      ExerciseError: a wrong value on some case (how many; a named mistake's hint when the answer makes
        it on every case), a return that is not a pair of numbers, or a call to
        :func:`course_lib.split_time.split_cost`.
    """
    drawn = cases(np.random.default_rng(seed))
    got = {}
    for p_bytes, n in drawn:
        what = f"predict_zero3({p_bytes}, {n})"
        out = call_unaided(
            what, predict_zero3, (split_time.split_cost,),
            "count the gathers and bytes from P and n with plain arithmetic", p_bytes, n,
        )  # fmt: skip
        got[p_bytes, n] = _pair(out, what)
    wrong = [c for c in drawn if not _same(got[c], reference(*c))]
    if wrong:
        gathers = sum(got[c][0] != reference(*c)[0] for c in drawn)
        counts = f"{gathers} gather counts, {len(wrong) - gathers} byte counts only"
        for mistake, hint in MISTAKES:
            if all(_same(got[c], mistake(*c)) for c in drawn if c[1] > 1):
                fail(f"{len(wrong)} of {len(drawn)} cases are wrong ({counts})", hint)
        if {n for _, n in wrong} == {1}:
            fail(
                f"{len(wrong)} of {len(drawn)} cases are wrong, all at n = 1 ({counts})",
                "on one device each layer is still gathered, but the gathers send nothing",
            )
        fail(
            f"{len(wrong)} of {len(drawn)} cases are wrong ({counts}; drawn anew at every check)",
            HINT,
        )
    return passed(
        f"gathers per layer and bytes per step right in all {len(drawn)} cases drawn (n = "
        f"{', '.join(map(str, COUNTS))}, P drawn)"
    )

"""Lesson 10, exercise 2 (predict): the bytes and the LayerNorm memory of tensor vs sequence parallelism, on
XLA:CPU and as XLA:TPU builds its program for 8 chips.

The answer ``predict(kind, compiler, B, S, D, n)`` → ``(bytes_sent, ln_elements)`` is judged by its values on
cases drawn afresh at every call, chosen to expose each part of the prediction: both kinds and both compilers,
B, S and D drawn afresh (S divisible by ``n``), ``n`` from 1 to 16 with an odd one on XLA:CPU, and ``n`` of 2,
4, 8 and 16 on XLA:TPU (its committed program, ``data/tpu_reference/programs/lesson10.sp_forward``, is for 8
chips at the lesson's ``cpu`` sizes: at other sizes and chip counts the prediction assumes XLA:TPU makes the
same choices, a model). The prompt gives XLA:TPU's collectives for one layer as the committed program lists
them (kind, dtype, shape), not their bytes nor why the compiler chose them: the learner costs them and reasons
out the choice. The values are compared with :func:`course_lib.splits.predict_tp_sp`, which the answer may not
call, nor :func:`course_lib.split_time.split_cost` (section 6's model lists the same collectives with their
ring bytes); :func:`course_lib.comms.ring_bytes`, the ring model the exercise names, it may. The checker
builds no program and uses no device: its device counts are its own, so it judges alike on any number of
devices present. A failure says how many cases each part got wrong (TP's bytes, SP's on each compiler, the
LayerNorm counts) and gives each wrong part's hint, without the formula.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from course_lib import split_time, splits

from ._common import checker, fail, passed, plain, require
from ._unaided import call_unaided

CPU_COUNTS = (1, 2, 3, 4, 8, 16)
"""The device counts asked on XLA:CPU (both kinds at each): 12 cases."""
TPU_COUNTS = (2, 4, 8, 16)
"""The chip counts asked on XLA:TPU (both kinds at each): 8 cases. Only 8 is a committed program; the others
assume the same choices (the exercise says so)."""

HINTS = {
    "tp": "TP's bytes: one all-reduce of the float32 [B, S, D] output per sub-layer (Megatron's g), two in "
    "a block's forward, the same program on both compilers; each one's ring cost per device "
    "(course_lib.comms.ring_bytes)",
    "sp XLA:CPU": "SP's bytes on XLA:CPU: before each sub-layer an all-gather, after it a reduce-scatter, "
    "both of the whole float32 [B, S, D] buffer; what do a ring all-gather and a ring reduce-scatter of one "
    "buffer send together, against one ring all-reduce of it?",
    "sp XLA:TPU": "SP's bytes on XLA:TPU: cost the collectives XLA:TPU's program runs for a layer (the "
    "cell before your answer lists them), not the ones JAX wrote: each at its own kind's ring factor for n "
    "devices, times its own dtype's bytes an element, over its whole shape",
    "ln": "LayerNorm: the elements of the [B, S, D] activation one device holds where the LayerNorm runs: "
    "under TP the residual stream is replicated, under SP it is split along the sequence",
    "ln XLA:TPU": "LayerNorm under SP on XLA:TPU: the compiler changed how the partial sums travel; did it "
    "change what each device computes with them afterwards?",
}
"""Each part's hint, shown when that part is wrong on some case."""


def cases(rng: np.random.Generator) -> list[tuple[str, str, int, int, int, int]]:
    """``(kind, compiler, B, S, D, n)``: B, S, D drawn afresh (S divisible by ``n``), both kinds at each
    of :data:`CPU_COUNTS` on XLA:CPU and of :data:`TPU_COUNTS` on XLA:TPU."""
    out = []
    counts = [("XLA:CPU", n) for n in CPU_COUNTS] + [("XLA:TPU", n) for n in TPU_COUNTS]
    for compiler, n in counts:
        b, s, d = (int(v) for v in rng.choice(np.arange(1, 33), 3, replace=False))
        s, d = s * n * 2, d * 8
        kinds = ("tp", "sp") if rng.random() < 0.5 else ("sp", "tp")
        out += [(kind, compiler, b, s, d, n) for kind in kinds]
    return out


def number_pair(fn: str, got, what: str, keys: tuple[str, str], shown: tuple[str, str]):
    """``got`` (a pair, or a dict with ``keys``) as two floats; a string, a bool or anything else fails
    with the hint "return a pair of numbers: (shown[0], shown[1])". Lesson 10's prediction checkers."""
    wanted = f"({shown[0]}, {shown[1]})"
    got = require(fn, got, f"return {wanted}")
    if isinstance(got, dict) and set(keys) <= set(got):
        got = (got[keys[0]], got[keys[1]])
    try:
        a, b = got
        if any(isinstance(v, (str, bytes, bool, np.bool_)) for v in (a, b)):
            raise TypeError("not numbers")
        return float(a), float(b)
    except (TypeError, ValueError):
        fail(f"{what} returned {plain(got)!r}", f"return a pair of numbers: {wanted}")


def _pair(got, what):
    return number_pair("predict", got, what, ("sent", "ln_elements"), ("bytes_sent", "ln_elements"))


@checker
def check_predict_tp_sp(predict: Callable, *, seed: int | None = None) -> bool:
    """Exercise 2 (predict): tensor vs sequence parallel on XLA:CPU and XLA:TPU (the module docstring).

    ``predict(kind, compiler, B, S, D, n)`` → ``(bytes_sent, ln_elements)`` (or a dict with ``"sent"`` and
    ``"ln_elements"``) for one block's forward in float32 on a model axis of ``n``: the bytes each device
    sends (ring model) and the elements of one LayerNorm's input a device holds. ``seed``: the cases' draw,
    for tests (None: fresh).

    Raises:
      ExerciseError: a wrong value on some case (how many, by part, and each wrong part's hint), a return
        that is not a pair of numbers, or a call to :func:`course_lib.splits.predict_tp_sp` or
        :func:`course_lib.split_time.split_cost`.
    """
    drawn = cases(np.random.default_rng(seed))
    bad = dict.fromkeys(("tp", "sp XLA:CPU", "sp XLA:TPU", "ln", "ln XLA:TPU"), 0)
    wrong, wrong_n = 0, set()
    for kind, compiler, b, s, d, n in drawn:
        what = f"predict({kind!r}, {compiler!r}, {b}, {s}, {d}, {n})"
        got = call_unaided(
            what, predict, (splits.predict_tp_sp, split_time.split_cost),
            "count the bytes and LayerNorm elements from B, S, D and n with plain arithmetic "
            "(course_lib.comms.ring_bytes for a collective's ring cost)",
            kind, compiler, b, s, d, n,
        )  # fmt: skip
        sent, ln = _pair(got, what)
        want = splits.predict_tp_sp(kind, b, s, d, n, compiler=compiler)
        bad_sent = not np.isclose(sent, want["sent"], rtol=1e-6, atol=1e-9)
        bad_ln = not np.isclose(ln, want["ln_elements"], rtol=0, atol=1e-9)
        if bad_sent:
            bad["tp" if kind == "tp" else f"sp {compiler}"] += 1
        if bad_ln:
            bad["ln XLA:TPU" if (kind, compiler) == ("sp", "XLA:TPU") else "ln"] += 1
        wrong += bad_sent or bad_ln
        if bad_sent or bad_ln:
            wrong_n.add(n)
    if wrong:
        counts = (
            f"{bad['tp']} TP bytes, {bad['sp XLA:CPU']} SP bytes on XLA:CPU, {bad['sp XLA:TPU']} SP bytes "
            f"on XLA:TPU, {bad['ln'] + bad['ln XLA:TPU']} LayerNorm counts"
        )
        if wrong_n == {1}:
            fail(
                f"{wrong} of {len(drawn)} cases are wrong, all at n = 1 ({counts})",
                "on one device nothing is split: what does it send, and what does it hold?",
            )
        fail(
            f"{wrong} of {len(drawn)} cases are wrong ({counts}; the cases are drawn anew at every check)",
            "; ".join(HINTS[part] for part, k in bad.items() if k),
        )
    return passed(
        f"bytes and LayerNorm elements right in all {len(drawn)} cases drawn (TP and SP, XLA:CPU at n = "
        f"{', '.join(map(str, CPU_COUNTS))}, XLA:TPU at n = {', '.join(map(str, TPU_COUNTS))})"
    )

"""Lesson 04, exercise 2: predict a data-parallel step's gradient all-reduce from the parameter shapes.

The step (:data:`STEP_SOURCE`, printed by the notebook and executed here, so what is printed is what is
measured) trains two dense layers on top of a frozen embedding table; under ``pmap`` it averages the loss
and the gradients with ``lax.pmean``. The checker compiles it and reads the compiled program's all-reduces
with ``course_lib.comms.collectives``: how many arrays they reduce, their bytes ``S`` and how many
all-reduce instructions XLA made of them (the last is judged only where the program is XLA:CPU's: how far
a compiler combines all-reduces is its own choice). The bytes each device sends are *not* in the program:
they are the ring model (NCCL's bus bytes) ``2 (n - 1) / n × S`` applied to the ``S`` read from it, so
that prediction tests the learner's ``S`` and use of the model, and the checker says so.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from numbers import Number
from typing import Any

import numpy as np

from ._common import fail, not_written

STEP_SOURCE = """\
VOCAB, WIDTH, HIDDEN, CLASSES, TOKENS = 1000, 32, 64, 10, 8

def init(key):
    k1, k2, k3 = jax.random.split(key, 3)
    params = {  # trained
        "dense1": {"kernel": jax.random.normal(k1, (WIDTH, HIDDEN)) / 6, "bias": jnp.zeros(HIDDEN)},
        "dense2": {"kernel": jax.random.normal(k2, (HIDDEN, CLASSES)) / 8, "bias": jnp.zeros(CLASSES)},
    }
    frozen = {"embed": jax.random.normal(k3, (VOCAB, WIDTH))}  # read by the step, never trained
    return params, frozen

def loss_fn(params, frozen, tokens, labels):  # tokens: int32[b, TOKENS], labels: int32[b]
    x = frozen["embed"][tokens].mean(axis=1)  # [b, WIDTH]
    h = jnp.tanh(x @ params["dense1"]["kernel"] + params["dense1"]["bias"])
    logits = h @ params["dense2"]["kernel"] + params["dense2"]["bias"]
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, CLASSES)).mean()

def local_step(params, frozen, tokens, labels):  # one device's shard of the batch
    loss, grads = jax.value_and_grad(loss_fn)(params, frozen, tokens, labels)
    return lax.pmean(loss, DATA), lax.pmean(grads, DATA)

# the data-parallel step: params and frozen replicated, the batch split over the devices
step = jax.pmap(local_step, axis_name=DATA, in_axes=(None, None, 0, 0))
"""
"""The step whose all-reduce the learner predicts (``DATA`` is ``course_lib.meshes.DATA``)."""

QUESTIONS = ("arrays reduced", "bytes reduced", "bytes sent per device", "all-reduce ops")
PER_DEVICE_BATCH = 4


def _namespace() -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from jax import lax

    from course_lib.meshes import DATA

    scope = {"jax": jax, "jnp": jnp, "lax": lax, "optax": optax, "DATA": DATA}
    exec(STEP_SOURCE, scope)
    return scope


def measure_allreduce(devices: Sequence[Any]) -> dict[str, Any]:
    """The step compiled for ``devices``: its all-reduces read from the HLO (see the module docstring)."""
    return dict(_measure(tuple(devices)))


@functools.cache
def _measure(devices: tuple) -> tuple:
    import jax

    from course_lib import comms
    from course_lib.meshes import DATA

    scope, n = _namespace(), len(devices)
    step = jax.pmap(
        scope["local_step"], axis_name=DATA, in_axes=(None, None, 0, 0), devices=list(devices)
    )
    params, frozen = scope["init"](jax.random.key(0))
    tokens = np.zeros((n, PER_DEVICE_BATCH, scope["TOKENS"]), np.int32)
    labels = np.zeros((n, PER_DEVICE_BATCH), np.int32)
    hlo = step.lower(params, frozen, tokens, labels).compile().as_text()
    reduces = [c for c in comms.collectives(hlo, {DATA: n}) if c.kind == "all-reduce"]
    lines = [
        line.strip()
        for line in hlo.splitlines()
        if " all-reduce(" in line or "all-reduce-start(" in line
    ]
    return (
        ("arrays reduced", sum(len(c.shapes) for c in reduces)),
        ("bytes reduced", sum(c.size_bytes for c in reduces)),
        ("bytes sent per device", sum(c.sent_bytes for c in reduces)),  # the ring model of S
        ("all-reduce ops", len(reduces)),
        ("platform", devices[0].platform),
        ("n", n),
        ("hlo", tuple(lines)),
    )


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Number | np.number):
        fail(
            f"the prediction for {name!r} is {value!r}, not a number",
            "write a number for each entry; you may compute it (sizes, n) in the cell",
        )
    return float(value)


def judge_allreduce(predictions: Mapping | None, measured: Mapping[str, Any]) -> list[str]:
    """Compare; returns notes on what was not judged, or fails with the number of wrong predictions."""
    hint = "write a number for every entry of allreduce_predictions, then run this cell"
    values = dict(predictions or {})
    if all(v is None or v is Ellipsis for v in values.values()):
        not_written("the all-reduce predictions", hint)
    missing = [q for q in QUESTIONS if values.get(q) is None or values.get(q) is Ellipsis]
    if missing:
        fail(f"no prediction for {missing[0]!r}", hint)
    guesses = {q: _number(q, values[q]) for q in QUESTIONS}
    judged = QUESTIONS if measured["platform"] == "cpu" else QUESTIONS[:3]
    wrong = 0
    for q in judged:
        want = float(measured[q])
        wrong += not (
            guesses[q] == want
            if q in ("arrays reduced", "all-reduce ops")
            else np.isclose(guesses[q], want, rtol=0.01, atol=1)
        )
    if wrong:
        fail(
            f"{wrong} of your {len(judged)} predictions are not what the compiled program does",
            "count what jax.grad differentiates (only the argument it is taken with respect to), plus "
            "what else is pmean'd; bytes are elements x 4 for float32; a ring all-reduce sends "
            "2 (n - 1) / n of the bytes it reduces from every device; and XLA combines the all-reduces "
            "of one step into as few instructions as it can",
        )
    notes = [
        "bytes sent per device: the ring model 2 (n - 1) / n x S (NCCL's bus bytes) applied to the S read "
        "from the program, not a measurement (XLA:CPU runs no ring)"
    ]
    if measured["platform"] != "cpu":
        notes.append(
            f"XLA:{measured['platform'].upper()} made {measured['all-reduce ops']} all-reduce "
            "instruction(s); not judged (how far a compiler combines them is its own choice)"
        )
    return notes

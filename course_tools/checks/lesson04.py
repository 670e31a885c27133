"""Checkers for ``04_pmap.ipynb``: predicting the gradient scale of four sync patterns, predicting a
data-parallel step's all-reduce from its shapes, and gradient accumulation over micro-batches under ``pmap``.

Each checker runs the answer on random inputs at the notebook's device count and judges what it does: the
values against a one-device computation, the collectives of the traced program
(:func:`course_lib.programs.jaxpr_collectives`), and the shapes the answer passed to the functions it was
given.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from functools import partial
from numbers import Number
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import P, lax
from jax.sharding import NamedSharding

from course_lib.meshes import DATA, data_mesh
from course_lib.programs import jaxpr_collectives

from ._common import NotWritten, call_answer, checker, close, fail, matmul_rtol, not_written, passed
from ._lesson04_allreduce import QUESTIONS, STEP_SOURCE, judge_allreduce, measure_allreduce
from ._lesson04_critical import check_critical_batch
from ._lesson04_memory import judge_memory
from ._simulated import run_json

__all__ = [
    "QUESTIONS",
    "STEP_SOURCE",
    "check_critical_batch",
    "measure_allreduce",
]  # the notebook uses these


def _call(what: str, fn: Callable, *args, hint: str):
    """``call_answer`` with this exercise's "not written yet" hint and the wrong-axis-name hint."""

    def explain(e: Exception):
        if isinstance(e, NameError):  # an axis name pmap does not bind
            return (
                f"{what} raised NameError: {e}",
                "use the axis name passed in as `axis_name`, the one pmap binds",
            )
        return None

    try:
        return call_answer(what, fn, *args, explain=explain)
    except NotWritten:
        not_written(what, hint)


# ---- exercise 1: predict the gradient scale of four sync patterns ----------------------------------

GRADIENT_PROGRAMS = ("a", "b", "c", "d")
"""Keys of the four programs of exercise 1 (the notebook prints their code)."""


def _loss(w, x, y):
    return jnp.mean((x @ w - y) ** 2)


def _body(name: str, n: int) -> Callable:
    """The per-device body of program ``name``: ``(w, x, y) -> gradient``."""
    if name == "a":  # pmap: psum of the local gradients
        return lambda w, x, y: lax.psum(jax.grad(_loss)(w, x, y), DATA)
    if name == "b":  # shard_map (check_vma=True): the local gradient, no collective written
        return lambda w, x, y: jax.grad(_loss)(w, x, y)
    if name == "c":  # shard_map (check_vma=True): pmean of the loss, then pmean of the gradients
        grad = jax.grad(lambda v, x, y: lax.pmean(_loss(v, x, y), DATA))
        return lambda w, x, y: lax.pmean(grad(w, x, y), DATA)
    # "d", pmap: the gradient of the psum of the local losses, divided by n
    return lambda w, x, y: jax.grad(lambda v: lax.psum(_loss(v, x, y), DATA) / n)(w)


def _scale(per_device: np.ndarray, true: np.ndarray) -> float | str:
    if not np.allclose(per_device, per_device[0:1], rtol=1e-5, atol=1e-6):
        return "local"
    return float(np.median(per_device[0] / true))


def measure_gradient_scales(devices: Sequence[Any], seed: int = 0) -> dict[str, float | str]:
    """Run the four programs on ``devices``: each one's gradient as a multiple of the true gradient of the
    global batch's mean loss (a float), or ``"local"`` when the devices end up with different gradients.
    The two pmap programs run as one program, and so do the two shard_map ones; a repeated check on the
    same devices reuses the measurement."""
    return dict(_measure_scales(tuple(devices), seed))


SIMULATED = 4
"""With a single device every program gives the true gradient, and with two a ring all-reduce sends
``2 (n - 1) / n × S = (n - 1) × S``, what a naive one sends; exercises 1 and 2 are then set for this many
simulated CPU devices, measured in a fresh process."""


def prediction_count(devices: Sequence[Any]) -> int:
    """The device count exercises 1 and 2's predictions are for: the run's, or :data:`SIMULATED` with one
    or two devices."""
    return len(devices) if len(devices) > 2 else SIMULATED


@functools.cache
def _measure_simulated() -> dict[str, float | str]:
    return run_json(
        "import json, jax\nfrom course_tools.checks.lesson04 import measure_gradient_scales\n"
        "print(json.dumps(measure_gradient_scales(jax.devices())))",
        SIMULATED,
    )


@functools.cache
def _measure_scales(devices: tuple, seed: int) -> tuple:
    n = len(devices)
    kx, ky, kw = jax.random.split(jax.random.key(seed), 3)
    x, y, w = (
        jax.random.normal(kx, (3 * n, 5)),
        jax.random.normal(ky, (3 * n,)),
        jax.random.normal(kw, (5,)),
    )
    bodies = {name: _body(name, n) for name in GRADIENT_PROGRAMS}
    by_pmap = jax.pmap(
        lambda w, x, y: (bodies["a"](w, x, y), bodies["d"](w, x, y)),
        axis_name=DATA,
        in_axes=(None, 0, 0),
        devices=list(devices),
    )(w, x.reshape(n, 3, 5), y.reshape(n, 3))
    mesh = data_mesh(devices, axis_type="explicit")
    place = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    by_shard_map = (
        jax.jit(  # out_specs P(DATA), a leading axis of 1 per device: every device's result
            jax.shard_map(
                lambda w, x, y: (bodies["b"](w, x, y)[None], bodies["c"](w, x, y)[None]),
                mesh=mesh,
                in_specs=(P(), P(DATA), P(DATA)),
                out_specs=(P(DATA), P(DATA)),
            )
        )(place(w, P()), place(x, P(DATA)), place(y, P(DATA)))
    )
    true = np.asarray(jax.grad(_loss)(w, x, y))
    got = dict(zip("adbc", [*by_pmap, *by_shard_map]))
    return tuple((name, _scale(np.asarray(got[name]), true)) for name in GRADIENT_PROGRAMS)


_SCALE_HINT = (  # how to reason, the same whichever prediction is wrong
    "for each program ask two things: does it run with check_vma=False (pmap) or True (shard_map), and "
    "what does the transpose of each collective - and of a replicated parameter's implicit broadcast - "
    "do there? Section 6's table is the key: psum adds n per-device means, pmean of a value equal "
    "everywhere changes nothing, and 'local' means the devices end with different gradients"
)


def _prediction(name: str, value: Any) -> float | str:
    if isinstance(value, str) and value.strip().lower() == "local":
        return "local"
    if isinstance(value, Number | np.number) and not isinstance(value, bool):
        return float(value)
    fail(
        f"prediction {name!r} is {value!r}",
        "a prediction is a number such as 1, n or 1 / n, or the string 'local'",
    )


@checker
def check_gradient_scales(predictions: dict | None, devices: Sequence[Any]) -> bool:
    """Exercise 1: predict each of :data:`GRADIENT_PROGRAMS`' gradient as a multiple of the true one.

    Spec: ``predictions[name]`` matches the measured gradient (to 0.1 %): a number (a multiple of the true
    gradient of the global batch's mean loss) or ``"local"`` (the devices end with different gradients),
    for :func:`prediction_count` devices (with one or two devices, measured on 4 simulated ones in a
    fresh process). A wrong answer is told how many predictions are wrong, never which.

    Raises:
      ExerciseError: wrong keys, a value that is neither a number nor "local", or wrong predictions
        (their number).
    """
    n = prediction_count(devices)
    if (
        predictions is None
        or isinstance(predictions, dict)
        and all(v is ... for v in predictions.values())
    ):
        not_written(
            "your predictions",
            "write each prediction as a number (a multiple of the true gradient; you may use n) or 'local'",
        )
    if not isinstance(predictions, dict) or set(predictions) != set(GRADIENT_PROGRAMS):
        keys = sorted(predictions) if isinstance(predictions, dict) else type(predictions).__name__
        fail(
            f"predictions has keys {keys}",
            f"give a dict with exactly the keys {list(GRADIENT_PROGRAMS)}",
        )
    guesses = {name: _prediction(name, predictions[name]) for name in GRADIENT_PROGRAMS}
    here = n == len(devices)
    measured = measure_gradient_scales(devices) if here else _measure_simulated()
    where = f"{n} device(s)" if here else f"{n} simulated CPU devices (a fresh process)"
    wrong = []
    for name, guess in guesses.items():
        got = measured[name]
        if isinstance(got, str) or isinstance(guess, str):
            ok = got == guess
        else:
            ok = np.isclose(guess, got, rtol=1e-3)
        if not ok:
            wrong.append((name, guess, got))
    if wrong:
        fail(
            f"{len(wrong)} of your 4 predictions differ from the measurement on {where}",
            _SCALE_HINT,
        )
    return passed(f"all four predictions match the measured gradients on {where}")


FAKE_AXIS = 4
"""With fewer than 2 devices, named-axis answers also run under ``jax.vmap(..., axis_name=DATA)`` over an axis
of this size: the same collectives, with rows of one array standing in for devices."""
_VMAP_WHAT = (
    f"your function under jax.vmap(..., axis_name={DATA!r}) over {FAKE_AXIS} simulated devices"
)


# ---- exercise 2: predict the gradient all-reduce -----------------------------------------------


@functools.cache
def _measure_allreduce_simulated() -> dict:
    return run_json(
        "import json, jax\nfrom course_tools.checks._lesson04_allreduce import measure_allreduce\n"
        "m = measure_allreduce(jax.devices())\nprint(json.dumps(m))",
        SIMULATED,
    )


@checker
def check_allreduce(predictions: dict | None, devices: Sequence[Any]) -> bool:
    """Exercise 2: predict the all-reduce of ``STEP_SOURCE``'s data-parallel step from its shapes.

    Spec (``_lesson04_allreduce``): for :func:`prediction_count` devices, the number of arrays the compiled
    step all-reduces (exactly), their bytes ``S`` (read from the HLO) and the bytes each device sends by the
    ring model ``2 (n - 1) / n × S`` applied to that ``S`` (within 1 %; a cost model, not read from the
    program), and the number of all-reduce instructions (exactly; judged only where the program is
    XLA:CPU's). With one or two devices the step is compiled for 4 simulated CPU devices in a fresh
    process. A
    wrong answer is told how many predictions are wrong, never which.

    Raises:
      ExerciseError: a missing or non-numeric prediction, or wrong ones (their number).
    """
    n = prediction_count(devices)
    if predictions is None or all(v is None or v is Ellipsis for v in dict(predictions).values()):
        judge_allreduce(predictions, {})  # "not written yet", before anything is compiled
    measured = measure_allreduce(devices) if n == len(devices) else _measure_allreduce_simulated()
    notes = judge_allreduce(predictions, measured)
    print(f"  the compiled step's all-reduce on {n} device(s), as XLA wrote it:")
    for line in measured["hlo"]:
        print("   ", line[:160] + (" ..." if len(line) > 160 else ""))
    for q in QUESTIONS:
        print(f"  {q:22s} {measured[q]:,.0f}")
    for note in notes:
        print("  " + note)
    return passed(f"the all-reduce predicted from the shapes, for {n} devices")


# ---- exercise 3: gradient accumulation over micro-batches ------------------------------------------

MICRO = (3, 4)
"""The micro-batch counts the checker tries (12 rows per device)."""


def _mlp_loss(params, batch, seen: list):
    x, y = batch
    seen.append(int(x.shape[0]))  # the batch size this loss is traced with: a trace-time record
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def _accumulation_inputs(n: int):
    kx, ky, k1, k2 = jax.random.split(jax.random.key(3), 4)
    params = {
        "w1": jax.random.normal(k1, (3, 6)) * 0.5,
        "b1": jnp.linspace(-1.0, 1.0, 6),
        "w2": jax.random.normal(k2, (6, 2)) * 0.5,
    }
    return params, jax.random.normal(kx, (n * 12, 3)), jax.random.normal(ky, (n * 12, 2))


def _diagnose_scale(ratios: list[float], n_micro: int, n: int) -> None:
    rtol = max(1e-3, matmul_rtol())  # median ratios of matmul results: the platform's rounding
    if np.allclose(ratios, n_micro, rtol=rtol):
        also = f" (or lax.psum over the {n} devices)" if n == n_micro else ""
        fail(
            f"gradients are {n_micro}x too large with n_micro={n_micro}{also}",
            "the sum of the micro-batch gradients is n_micro times the mean's gradient: divide by n_micro"
            + ("; and lax.pmean, not lax.psum, averages over devices" if also else ""),
        )
    if n > 1 and np.allclose(ratios, n, rtol=rtol):
        fail(
            f"gradients are {n}x (the device count) too large",
            "lax.psum adds the devices' gradients; lax.pmean averages them",
        )
    fail(
        "gradients differ from the single-device gradient of the whole batch",
        "accumulate jax.grad(loss_fn)(params, micro_batch) over the micro-batches, divide by n_micro, then "
        "lax.pmean over axis_name",
    )


def _trace(fn, devices, params, batch, n_micro):
    """The answer under pmap with ``n_micro``, traced: (mapped function, batch sizes loss_fn saw, psums)."""
    seen: list[int] = []
    loss_fn = partial(_mlp_loss, seen=seen)
    mapped = jax.pmap(
        lambda p, b: fn(loss_fn, p, b, DATA, n_micro),
        axis_name=DATA,
        in_axes=(None, 0),
        devices=list(devices),
    )
    jaxpr = _call(
        f"accumulated_grads(..., n_micro={n_micro}) under pmap",
        jax.make_jaxpr(mapped),
        params,
        batch,
        hint="split the local batch into n_micro micro-batches, add their gradients, then average once "
        "over devices",
    )
    if seen and sorted(set(seen)) != [12 // n_micro]:
        fail(
            f"loss_fn was called on batches of {sorted(set(seen))} rows; with n_micro={n_micro} each call "
            f"should see {12 // n_micro}",
            "split this device's batch into n_micro micro-batches (reshape the leading axis to "
            "[n_micro, b // n_micro]) and differentiate each one",
        )
    found = jaxpr_collectives(jaxpr)
    others = sorted({p for p, _, _ in found if p != "psum"})
    if others:
        grad_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))
        n = len(devices)
        gathered = (
            f": gathering the gradients, each of {n} devices receives (n - 1) x their {grad_bytes:,} "
            "bytes, where a ring all-reduce receives 2 (n - 1) / n x"
            if "all_gather" in others
            else ""
        )
        fail(
            f"the program moves data across devices with {', '.join(others)}, not only with an all-reduce "
            f"(psum/pmean){gathered}",
            "average the accumulated gradient with lax.pmean over axis_name, once, after the loop",
        )
    return mapped, [(ops, loop) for p, ops, loop in found if p == "psum"]


def _judge_grads(out, params, x, y, n: int, n_micro: int) -> None:
    """``out``: the answer's gradients, stacked over ``n`` devices (or simulated ones); x, y: the global batch."""
    if not isinstance(out, dict) or jax.tree.structure(out) != jax.tree.structure(params):
        fail(
            f"returned {jax.tree.structure(out)}",
            "return the gradient pytree, with the structure of params",
        )
    got = jax.tree.map(np.asarray, out)
    if n > 1 and not all(
        np.allclose(g, g[0:1], rtol=1e-5, atol=1e-6) for g in jax.tree.leaves(got)
    ):
        fail(
            f"devices return different gradients (with {n} devices)",
            "each device only saw its own shard: average the accumulated gradient over axis_name",
        )
    expected = jax.grad(lambda p: _mlp_loss(p, (x, y), []))(params)
    pairs = list(zip(jax.tree.leaves(jax.tree.map(lambda g: g[0], got)), jax.tree.leaves(expected)))
    if not all(close(a, e, matmul_rtol(1e-4)) for a, e in pairs):  # the platform's matmul rounding
        _diagnose_scale([float(np.median(a / np.asarray(e))) for a, e in pairs], n_micro, n)


@checker
def check_accumulated_grads(fn: Callable, devices: Sequence[Any]) -> bool:
    """Exercise 3 (project): micro-batch gradient accumulation under ``pmap``, one all-reduce.

    Spec: ``fn(loss_fn, params, batch, axis_name, n_micro)`` under ``pmap`` returns, on every device, the
    gradient of the global batch's mean loss (within ``course_lib.precision.float32_rtol()``: 1e-5 on
    XLA:CPU, 1.6e-2 on a TPU), computed from micro-batches of ``b // n_micro`` rows (``loss_fn`` never
    sees more), with one cross-device reduction after the loop, not one per micro-batch, and its count
    not growing with ``n_micro``; each micro-batch's forward pass inside a loop body, so they run one
    after another (``_lesson04_memory``: judged on the traced program on every platform, and by the
    compiled temporary bytes shrinking with ``n_micro`` where the program is XLA:CPU's). A Python loop
    over ``jax.checkpoint``'d micro-batch losses is refused, although lesson 01's eager exercise 4 accepts
    it: in one compiled program XLA orders the work, and XLA:CPU keeps as many temporary bytes for it as
    for a plain Python loop (``_lesson04_memory``). Values are checked with 3 micro-batches (with fewer
    than 2 devices also under ``jax.vmap`` over a simulated axis of :data:`FAKE_AXIS`); the reductions
    with 3 and with 4.

    Raises:
      ExerciseError: another loss than the global mean's gradient (naming a missing division, a psum, a
        local gradient), loss_fn on other batch sizes, a collective other than an all-reduce (all_gather,
        ppermute, ...), a reduction inside the loop or growing with n_micro, forward passes outside a
        loop, what the loop carries or stacks growing with n_micro, or (XLA:CPU) memory that does not
        shrink.
    """
    n = len(devices)
    params, x, y = _accumulation_inputs(n)
    batch = (x.reshape(n, 12, 3), y.reshape(n, 12, 2))
    lo, hi = MICRO
    mapped, psums = _trace(fn, devices, params, batch, lo)
    _judge_grads(
        _call("accumulated_grads under pmap", mapped, params, batch, hint=""), params, x, y, n, lo
    )
    if n < 2:
        _, xf, yf = _accumulation_inputs(FAKE_AXIS)
        fake = jax.vmap(
            lambda b: fn(partial(_mlp_loss, seen=[]), params, b, DATA, lo), axis_name=DATA
        )
        fb = (xf.reshape(FAKE_AXIS, 12, 3), yf.reshape(FAKE_AXIS, 12, 2))
        _judge_grads(_call(_VMAP_WHAT, fake, fb, hint=""), params, xf, yf, FAKE_AXIS, lo)
    if any(loop for _, loop in psums):
        fail(
            "a cross-device reduction runs inside the loop over micro-batches",
            "that communicates once per micro-batch; add the micro-batch gradients locally and lax.pmean "
            "once, after the loop",
        )
    more = _trace(fn, devices, params, batch, hi)[1]
    comm_lo, comm_hi = (sum(ops for ops, _ in found) for found in (psums, more))
    if comm_hi > comm_lo or any(loop for _, loop in more):
        fail(
            f"the program reduces {comm_lo} array(s) across devices with {lo} micro-batches and {comm_hi} "
            f"with {hi}",
            "communication grows with n_micro: reduce across devices once, after adding the micro-batch "
            "gradients",
        )
    memory = judge_memory(fn, devices[0], partial(_mlp_loss, seen=[]))
    return passed(
        f"full-batch gradient on all {n} device(s) from micro-batches of {12 // lo} rows, the same "
        f"communication with {hi} micro-batches ({comm_lo} array(s) reduced once), and {memory}"
    )

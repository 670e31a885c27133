"""Checkers for ``05_sharding.ipynb``: predicting the collectives of six sharded programs, a data-parallel
loop with two silent bugs, and a momentum-SGD step of an MLP stored FSDP × tensor-parallel on Explicit axes.

The programs run on meshes of the notebook's devices; collectives are read from the compiled program (which
op, over which mesh axes: :func:`course_lib.programs.collectives`); values are compared with the same
computation on one device; what a step is compiled for is recorded while it is traced.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import P
from jax.sharding import NamedSharding

from course_lib import programs
from course_lib.meshes import DATA, MODEL, data_mesh, data_model_mesh

from . import _lesson05_fsdp as _fsdp
from ._common import (
    ExerciseError,
    NotWritten,
    call_answer,
    checker,
    close,
    fail,
    judged_on,
    matmul_rtol,
    not_written,
    passed,
)
from ._lesson05_probe import FULL_MESH, measure_on_full_mesh

# ---- exercise 1: predict the collectives ------------------------------------------------------------

SHARDED_PROGRAMS = {
    "a": (lambda x, w: x @ w, ((DATA, None), (None, MODEL))),
    "b": (lambda x: x.sum(axis=1), ((DATA, MODEL),)),
    "c": (lambda x: x.T, ((DATA, None),)),
    "d": (lambda x: jax.nn.softmax(x, axis=0), ((DATA, MODEL),)),
    "e": (lambda x: x[::-1], ((DATA, None),)),
    "f": (
        lambda x, w: jnp.matmul(x, w, out_sharding=P(DATA, None)),
        ((DATA, None), (None, MODEL)),
    ),
}
"""name -> (program, the specs of its arguments); ``x: [B, D]``, ``w: [D, H]`` (the notebook's table).
Measured on XLA:CPU: a and c need nothing, b an all-reduce over model, d one over data, e a
collective-permute over data (the blocks change owner), f an all-gather over model."""

_OP_WORDS = {op.replace("-", ""): op for op in programs.HLO_COLLECTIVES} | {
    op: op for op in programs.HLO_COLLECTIVES
}
_PREDICTION_HINT = (
    "write 'none', or 'OP over AXIS' with OP one of all-reduce, all-gather, all-to-all, reduce-scatter, "
    "collective-permute and AXIS data and/or model; separate several with ';' ('none' stands alone)"
)
_HOW_TO_PREDICT = (
    "for each program ask what a device needs that another device holds. Nothing: 'none'. Partial sums "
    "of a reduction or contraction along a split dimension: an all-reduce over the axis that splits it. "
    "Blocks other devices hold, to be held whole: an all-gather over that axis. Blocks that change owner "
    "without being combined: a collective-permute (each block to one other device) or an all-to-all "
    "(pieces of every block to every device). An axis of size 1 never communicates"
)


def measure_collectives(name: str, mesh) -> set[tuple[str, str]]:
    """``{(op, axis)}`` of the compiled program ``name`` on ``mesh`` (axes of size 1 never appear); a
    repeated check on the same mesh reuses the measurement."""
    return set(_measure(name, mesh))


@functools.cache
def _measure(name: str, mesh) -> frozenset:
    fn, specs = SHARDED_PROGRAMS[name]
    size = 4 * mesh.size
    kx, kw = jax.random.split(jax.random.key(0))
    inputs = (
        jax.random.normal(kx, (size, size)),
        jax.random.normal(kw, (size, 2 * mesh.shape[MODEL])),
    )
    args = [jax.device_put(a, NamedSharding(mesh, P(*s))) for a, s in zip(inputs, specs)]
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn).lower(*args).compile()
    found = programs.collectives(compiled.as_text(), dict(mesh.shape))
    return frozenset((op, axis) for op, axes in found for axis in axes)


_NOTHING = ("none", "no communication", "nothing")


def _parse_text(value: str) -> set[tuple[str, str]]:
    out, parts = set(), [p.strip() for p in re.split(r"[;\n]", value.lower()) if p.strip()]
    if len(parts) > 1 and any(p in _NOTHING for p in parts):
        raise ValueError(value)  # "none" joined to an operation contradicts itself
    for part in parts:
        if part in _NOTHING:
            continue
        words = [w.replace("_", "-") for w in re.findall(r"[a-z_-]+", part)]
        ops = [_OP_WORDS[w] for w in words if w in _OP_WORDS]
        axes = [a for a in (DATA, MODEL) if re.search(rf"\b{a}\b", part)]
        if len(ops) != 1 or not axes:
            raise ValueError(part)
        out |= {(ops[0], a) for a in axes}
    return out


def _parse_prediction(value: Any) -> set[tuple[str, str]]:
    """None / "none" / set() | "all-reduce over model; all-gather over data" | ("all-reduce", "model") |
    ("all-reduce", ("data", "model")) | a list or set of such pairs -> {(op, axis)}."""
    if value is None:
        return set()
    if isinstance(value, str):
        return _parse_text(value)
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
        op, axes = _OP_WORDS.get(value[0].lower().replace("_", "-")), value[1]
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        if op is None or any(a not in (DATA, MODEL) for a in axes):
            raise ValueError(value)
        return {(op, a) for a in axes}
    if isinstance(value, set | frozenset | list | tuple):
        nothing = [
            v for v in value if v is None or isinstance(v, str) and v.strip().lower() in _NOTHING
        ]
        if nothing and len(value) > 1:
            raise ValueError(value)  # "none" next to an operation contradicts itself
        return set().union(*(_parse_prediction(item) for item in value))
    raise ValueError(value)


@checker
def check_collective_predictions(predictions: dict | None, devices: Sequence[Any]) -> bool:
    """Judge the predicted collectives of the programs of :data:`SHARDED_PROGRAMS`.

    Spec: ``predictions[name]`` names, for every program, the set of ``(collective, mesh axis)`` pairs of
    its compiled program on an Explicit ``data × model`` mesh of ``devices`` — nothing more, nothing less
    (an axis of size 1 communicates nothing, so a predicted pair on such an axis is dropped). When the
    mesh has an axis of size 1 the predictions are judged again on a ``data=2 × model=2`` mesh of
    simulated devices (a fresh process), where every pair can show. A wrong answer is told only *how
    many* predictions are wrong, never which.
    """
    if (
        predictions is None
        or isinstance(predictions, dict)
        and all(v is ... for v in predictions.values())
    ):
        not_written(
            "your predictions", "predict each program's collectives: 'none' or 'OP over AXIS'"
        )
    if not isinstance(predictions, dict) or set(predictions) != set(SHARDED_PROGRAMS):
        keys = sorted(predictions) if isinstance(predictions, dict) else type(predictions).__name__
        fail(
            f"predictions has keys {keys}",
            f"give a dict with exactly the keys {list(SHARDED_PROGRAMS)}",
        )
    mesh = data_model_mesh(devices, axis_type="explicit")
    sizes = dict(mesh.shape)
    guesses = {}
    for name in SHARDED_PROGRAMS:
        try:
            guesses[name] = _parse_prediction(predictions[name])
        except ValueError:
            fail(f"prediction {name!r} is {predictions[name]!r}", _PREDICTION_HINT)
    here = {name: measure_collectives(name, mesh) for name in SHARDED_PROGRAMS}
    # an axis of size 1 communicates nothing
    _compare({k: {(op, a) for op, a in g if sizes[a] > 1} for k, g in guesses.items()}, here, sizes)
    note = ""
    if min(sizes.values()) == 1:
        full = dict(zip((DATA, MODEL), FULL_MESH))
        _compare(guesses, measure_on_full_mesh(), full)
        note = f" on this {sizes} mesh and on a {full} mesh of simulated devices (a fresh process)"
    return passed(f"all {len(SHARDED_PROGRAMS)} predictions match the compiled programs{note}")


def _compare(guesses: dict, measured: dict, sizes: dict) -> None:
    wrong = sum(guesses[k] != measured[k] for k in SHARDED_PROGRAMS)
    if wrong:
        fail(
            f"{wrong} of your {len(SHARDED_PROGRAMS)} predictions do not match the compiled programs on "
            f"the mesh {sizes}",
            _HOW_TO_PREDICT,
        )


# ---- exercise 2: debug this - the data-parallel loop that is not ------------------------------------


def lr_schedule(i: int) -> float:
    """The learning rate of step ``i`` (a decaying schedule, different every step)."""
    return 0.1 / (1.0 + i)


def _make_step(record: list):
    def step(w, batch, lr):
        x, y = batch
        # one entry per trace, with the shardings of the state and of both halves of the batch
        record.append((jax.typeof(w), jax.typeof(x), jax.typeof(y)))
        loss, g = jax.value_and_grad(lambda v: jnp.mean((jnp.tanh(x @ v) - y) ** 2))(w)
        return w - lr * g, loss

    return step


def _loop_inputs(n: int, n_steps: int):
    rng = np.random.default_rng(5)
    d = (
        2 * n
    )  # features: a multiple of the device count, so that a wrong split along them also runs
    w0 = (rng.normal(size=(d, 3)) / np.sqrt(d)).astype(np.float32)
    rows = lambda k: rng.normal(size=(4 * n, k)).astype(np.float32)  # noqa: E731
    return w0, [(rows(d), rows(3)) for _ in range(n_steps)]


def _run_loop(fn, mesh, w0, batches, record):
    try:
        out = call_answer(
            "train(step, state, batches, mesh, lr_schedule)",
            fn,
            *(_make_step(record), w0, batches, mesh, lr_schedule),
        )
    except NotWritten:
        not_written(
            "train",
            "copy train_as_given and fix it: one jax.jit outside the loop (the learning rate as an "
            "argument), and every batch put on the mesh split over data",
        )
    except ExerciseError as e:
        cause = e.__context__
        if type(cause).__name__ == "ShardingTypeError" and "Contracting" in str(cause):
            fail(
                "train raised ShardingTypeError: the gradient contracts the data-split batch, and the "
                "state has no sharding to give the result",
                "place the state on the mesh, replicated, before the loop: "
                "jax.device_put(state, NamedSharding(mesh, P()))",
            )
        raise
    try:
        state, losses = out
        return state, [float(v) for v in losses]
    except (TypeError, ValueError):
        fail(f"returned {type(out).__name__}", "return (state, losses), losses one float per batch")


def _judge_traces(record: list, n_steps: int) -> Any:
    """The traces the step went through: one, with the batch split over data along its rows."""
    if len(record) == 2 and record[0][0] != record[1][0]:
        fail(
            f"the step was compiled twice: the state's type changed from {_placement(record[0][0])} "
            f"to {_placement(record[1][0])} after the first step",
            "a NumPy (or single-device) state is placed by the first call and comes back on the mesh: "
            "put it on the mesh before the loop, jax.device_put(state, NamedSharding(mesh, P()))",
        )
    if len(record) > 1:
        fail(
            f"the step was traced and compiled {len(record)} times for {n_steps} batches",
            "jax.jit(partial(step, lr=...)) makes a new function every step, with an empty cache (and a "
            "static learning rate compiles once per value): jit step once, outside the loop, and pass lr "
            "as an ordinary argument",
        )
    for what, t in (("batch's inputs", record[0][1]), ("batch's labels", record[0][2])):
        _judge_rows(what, t)
    return record[0][1]


def _placement(t) -> str:
    """``t`` (a traced type) and the mesh it is typed on: two replicated types print alike."""
    mesh = t.sharding.mesh
    if not mesh.shape:
        return f"{t} on no mesh (uncommitted)"
    return f"{t} on the mesh {dict(mesh.shape)}"


def _judge_rows(what: str, t) -> None:
    """``t`` (a traced type) is split over data along its rows, and along nothing else."""
    spec = tuple(getattr(t.sharding, "spec", ()) or ())
    if spec and spec[0] == DATA and all(s is None for s in spec[1:]):
        return
    if any(s is not None for s in spec):
        fail(
            f"the {what} type in the compiled step is {t}: split, but not along the rows",
            "axis 0 is the batch: NamedSharding(mesh, P('data')) splits the rows; splitting the "
            "features makes every layer communicate",
        )
    fail(
        f"the {what} type in the compiled step is {t}: every device holds the whole batch",
        "a NumPy batch (or a replicated one) is copied whole to every device: place the whole batch, "
        "inputs and labels, with jax.device_put(batch, NamedSharding(mesh, P('data'))) before the step. "
        "(On Explicit axes jit(in_shardings=...) is not enough: the step is traced for the type of what "
        "you pass)",
    )


def _judge_given_mesh(fn, devices: list, w0, batches) -> None:
    """The loop runs on the mesh it is given: here one over half the devices, in reverse order."""
    mesh, record = data_mesh(devices, axis_type="explicit"), []
    state, _ = _run_loop(fn, mesh, w0, batches, record)
    split = [dict(t.sharding.mesh.shape).get(DATA, 1) for _, t, _ in record]
    placed = getattr(state, "sharding", None)
    if any(k != len(devices) for k in split) or (
        placed is not None and placed.device_set != set(devices)
    ):
        where = f"{len(placed.device_set)} device(s)" if placed is not None else "the host"
        fail(
            f"given a mesh over {len(devices)} of the devices, the batch was split {split[0]} ways "
            f"and the state came back on {where}",
            "build every sharding from the mesh argument, NamedSharding(mesh, ...): a mesh of your "
            "own over jax.devices() is not the one the caller chose",
        )


@checker
@judged_on(2, "on one device a loop that builds its own mesh over jax.devices() uses the caller's")
def check_data_parallel_loop(fn: Callable, devices: Sequence[Any], n_steps: int = 3) -> bool:
    """Judge a data-parallel training loop on an Explicit data mesh of ``devices``.

    Spec: ``fn(step, state, batches, mesh, lr_schedule)`` runs ``step(state, batch, lr_schedule(i))``
    over the NumPy ``batches`` and returns ``(state, losses)``, where

    - the losses (one float per batch) and the final state equal the same steps on one device;
    - the step is traced and compiled once for all the batches (the learning rate, different every step,
      is an ordinary argument, not a static one or a baked-in constant);
    - in that compiled step both halves of the batch (inputs and labels) are typed as split over ``data``
      along their rows and along nothing else: every device works on its own examples only;
    - the loop uses the mesh it is given: on a mesh over half the devices (in reverse order) the batch
      is split over that mesh and the state comes back on its devices.

    Measured: the losses and the state against a single-device run; the types each trace of the step
    saw (recorded inside the step, one entry per trace).
    """
    n = len(devices)
    w0, batches = _loop_inputs(n, n_steps)
    record: list = []
    state, losses = _run_loop(fn, data_mesh(devices, axis_type="explicit"), w0, batches, record)
    ref_step, w, ref_losses = jax.jit(_make_step([])), jnp.asarray(w0), []  # the run on one device
    for i, b in enumerate(batches):
        w, loss = ref_step(w, b, lr_schedule(i))
        ref_losses.append(float(loss))
    rtol = matmul_rtol()  # sharded against one device: the platform's float32 matmul rounding
    if len(losses) != n_steps or not close(losses, ref_losses, rtol):
        fail(
            f"losses {np.round(losses, 6).tolist()} differ from the single-device run "
            f"{np.round(ref_losses, 6).tolist()}",
            "use lr_schedule(i) for step i and the given step unchanged; only how it is compiled and "
            "where the data lives should change",
        )
    if not close(np.asarray(state), np.asarray(w), rtol):
        fail(  # at a TPU's tolerance a wrong learning rate can show in the state only
            "the final state differs from the single-device run",
            "return the state after the last step, and run step i with lr_schedule(i)",
        )
    x_type = _judge_traces(record, n_steps)
    if n > 1:
        _judge_given_mesh(fn, list(devices)[::-1][: n // 2], w0, batches[:1])
    return passed(
        f"one compile for {n_steps} steps, each batch {x_type} split over {n} device(s), losses equal "
        "to one device's"
    )


# ---- exercise 3: an FSDP x tensor-parallel momentum step on Explicit axes --------------------------


@checker
@judged_on(2, "on a 1 x 1 mesh nothing is gathered, so a weight gathered twice cannot show")
def check_fsdp_tp_step(fn: Callable, devices: Sequence[Any]) -> bool:
    """Exercise 3; the spec is :func:`course_tools.checks._lesson05_fsdp.check_fsdp_tp_step`'s."""
    _fsdp.check_fsdp_tp_step(fn, devices)
    return passed(
        f"the FSDP x tensor-parallel step equals one device's on {len(_fsdp.mesh_shapes(len(devices)))} "
        "mesh shape(s); parameters and velocity keep their 2-D shardings; each weight's model block "
        "gathered over data once, nothing gathered over model"
    )

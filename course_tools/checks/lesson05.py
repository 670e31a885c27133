"""Checkers for ``05_sharding.ipynb``: predicting the collectives of five sharded programs, a data-parallel
loop with two silent bugs, and a tensor-parallel MLP train step on Explicit axes.

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
from course_lib.meshes import DATA, MODEL, choose_mesh_shape, data_mesh, data_model_mesh

from ._common import ExerciseError, NotWritten, call_answer, checker, fail, not_written, passed
from ._lesson05_probe import FULL_MESH, judge_types, measure_on_full_mesh

# ---- exercise 1: predict the collectives ------------------------------------------------------------

SHARDED_PROGRAMS = {
    "a": (lambda x, w: x @ w, ((DATA, None), (None, MODEL))),
    "b": (lambda x: x.sum(axis=1), ((DATA, MODEL),)),
    "c": (lambda x: x.T, ((DATA, None),)),
    "d": (lambda x: jax.nn.softmax(x, axis=0), ((DATA, MODEL),)),
    "e": (lambda x: jnp.mean(x), ((DATA, MODEL),)),
}
"""name -> (program, the specs of its arguments); ``x: [B, D]``, ``w: [D, H]`` (the notebook's table)."""

_WHY_COLLECTIVES = {
    "a": "x's rows are split over data and w's columns over model; the contracted D is whole on both, so "
    "each device computes its own [B/data, H/model] block: no communication",
    "b": "a sum along the model-split columns: each device adds its own columns, then an all-reduce over "
    "model adds the partial row sums (the result, [B@data], is replicated over model)",
    "c": "a transpose only relabels the axes: each device transposes its block in place and the sharding "
    "moves with its dimension, P('data', None) -> P(None, 'data')",
    "d": "softmax over axis 0 normalises each column over the rows, and the rows are split over data: the "
    "max and the sum of each column need an all-reduce over data (the model-split columns are independent)",
    "e": "a mean of every element: each device reduces its block, then the partial sums are added over "
    "both axes (the compiler may do it in one all-reduce or two)",
}

_OP_WORDS = {op.replace("-", ""): op for op in programs.HLO_COLLECTIVES} | {
    op: op for op in programs.HLO_COLLECTIVES
}
_PREDICTION_HINT = (
    "write 'none', or 'OP over AXIS' with OP one of all-reduce, all-gather, all-to-all, reduce-scatter, "
    "collective-permute and AXIS data and/or model; separate several with ';'"
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


def _parse_text(value: str) -> set[tuple[str, str]]:
    out = set()
    for part in re.split(r"[;\n]", value.lower()):
        part = part.strip()
        if part in ("", "none", "no communication", "nothing"):
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
        return set().union(*(_parse_prediction(item) for item in value))
    raise ValueError(value)


def _say(found: set) -> str:
    return "; ".join(f"{op} over {axis}" for op, axis in sorted(found)) or "no communication"


@checker
def check_collective_predictions(predictions: dict | None, devices: Sequence[Any]) -> bool:
    """``predictions[name]`` for each of :data:`SHARDED_PROGRAMS` must name the collectives (op and mesh
    axis) of its compiled program on an Explicit ``data × model`` mesh of ``devices``."""
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
    wrong = [(k, guesses[k], measured[k]) for k in SHARDED_PROGRAMS if guesses[k] != measured[k]]
    if wrong:
        name, guess, got = wrong[0]
        more = f"; {len(wrong) - 1} more prediction(s) wrong" if len(wrong) > 1 else ""
        fail(
            f"program {name!r} on the mesh {sizes}: you predicted {_say(guess)}, the compiled program has "
            f"{_say(got)}{more}",
            _WHY_COLLECTIVES[name],
        )


# ---- exercise 2: debug this - the data-parallel loop that is not ------------------------------------


def lr_schedule(i: int) -> float:
    """The learning rate of step ``i`` (a decaying schedule, different every step)."""
    return 0.1 / (1.0 + i)


def _make_step(record: list):
    def step(w, batch, lr):
        x, y = batch
        record.append((jax.typeof(w), jax.typeof(x)))  # one entry per trace, with the shardings
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
            f"the step was compiled twice: the state's type changed from {record[0][0]} to "
            f"{record[1][0]} after the first step",
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
    x_type = record[0][1]
    spec = tuple(getattr(x_type.sharding, "spec", ()) or ())
    if spec and spec[0] == DATA and all(s is None for s in spec[1:]):
        return x_type
    if any(s is not None for s in spec):
        fail(
            f"the batch's type in the compiled step is {x_type}: split, but not along the rows",
            "axis 0 is the batch: NamedSharding(mesh, P('data')) splits the rows; splitting the "
            "features makes every layer communicate",
        )
    fail(
        f"the batch's type in the compiled step is {x_type}: every device computes the whole batch",
        "a NumPy batch (or a replicated one) is copied whole to every device: place it with "
        "jax.device_put(batch, NamedSharding(mesh, P('data'))) before the step. (On Explicit axes "
        "jit(in_shardings=...) is not enough: the step is traced for the type of what you pass)",
    )


@checker
def check_data_parallel_loop(fn: Callable, devices: Sequence[Any], n_steps: int = 3) -> bool:
    """``fn(step, state, batches, mesh, lr_schedule)`` must run ``step(state, batch, lr)`` over the NumPy
    ``batches`` on an Explicit data mesh, compiled once, with every batch split over ``data`` along its
    rows, and return ``(state, losses)`` equal to the single-device run."""
    n = len(devices)
    w0, batches = _loop_inputs(n, n_steps)
    record: list = []
    state, losses = _run_loop(fn, data_mesh(devices, axis_type="explicit"), w0, batches, record)
    ref_step, w, ref_losses = jax.jit(_make_step([])), jnp.asarray(w0), []  # the run on one device
    for i, b in enumerate(batches):
        w, loss = ref_step(w, b, lr_schedule(i))
        ref_losses.append(float(loss))
    if len(losses) != n_steps or not np.allclose(losses, ref_losses, rtol=1e-5, atol=1e-6):
        fail(
            f"losses {np.round(losses, 6).tolist()} differ from the single-device run "
            f"{np.round(ref_losses, 6).tolist()}",
            "use lr_schedule(i) for step i and the given step unchanged; only how it is compiled and "
            "where the data lives should change",
        )
    if not np.allclose(np.asarray(state), np.asarray(w), rtol=1e-5, atol=1e-6):
        fail(
            "the final state differs from the single-device run",
            "return the state after the last step",
        )
    x_type = _judge_traces(record, n_steps)
    return passed(
        f"one compile for {n_steps} steps, each batch {x_type} split over {n} device(s), losses equal "
        "to one device's"
    )


# ---- exercise 3: a tensor-parallel MLP train step on Explicit axes ----------------------------------

MOMENTUM = 0.9
"""The momentum of exercise 3's SGD: ``v <- MOMENTUM * v + g``, ``p <- p - lr * v``."""


def _reference_step(params, velocity, x, y, lr):  # the same math, written for one device
    def loss_fn(p):
        return jnp.mean((jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - y) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(params)
    v = {k: MOMENTUM * velocity[k] + g[k] for k in params}
    return {k: params[k] - lr * v[k] for k in params}, v, loss


def _mesh_shapes(n: int) -> list[tuple[int, int]]:
    """The notebook's data × model split, every device on model, and every device on data when no other
    shape has a data axis (so that a layout that gathers the batch is always caught)."""
    shapes = [choose_mesh_shape(n), (1, n)]
    if n > 1 and shapes[0][0] == 1:
        shapes.append((n, 1))
    return list(dict.fromkeys(shapes))


def _tp_inputs(n: int):
    k = jax.random.split(jax.random.key(11), 7)
    d, h, o, b = 5, 4 * n, 3, 2 * n  # the same shapes on every mesh: the reference compiles once
    shapes = {"w1": (d, h), "b1": (h,), "w2": (h, o), "b2": (o,)}
    scale = {"w1": 0.5, "b1": 0.1, "w2": 0.5, "b2": 0.1}
    params = {
        name: jax.random.normal(k[i], shape) * scale[name]
        for i, (name, shape) in enumerate(shapes.items())
    }
    velocity = {
        name: 0.1 * jax.random.normal(jax.random.fold_in(k[6], i), shape)
        for i, (name, shape) in enumerate(shapes.items())
    }
    return params, velocity, jax.random.normal(k[4], (b, d)), jax.random.normal(k[5], (b, o))


def _run_tp(fn, mesh, params, velocity, x, y, where):
    s = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    specs = {"w1": s(None, MODEL), "b1": s(MODEL), "w2": s(MODEL, None), "b2": s()}
    args = (
        {name: jax.device_put(v, specs[name]) for name, v in params.items()},
        {name: jax.device_put(v, specs[name]) for name, v in velocity.items()},
        jax.device_put(x, s(DATA, None)),
        jax.device_put(y, s(DATA, None)),
        0.1,
    )
    with jax.set_mesh(mesh):
        try:
            lowered = call_answer(
                f"jax.jit(tp_train_step) {where}", lambda: jax.jit(fn).lower(*args)
            )
        except NotWritten:
            not_written(
                "tp_train_step",
                "write loss_fn: x @ w1 + b1, relu, then a matmul with out_sharding=P('data', None); "
                "take its gradient; v <- 0.9 v + g, p <- p - lr v",
            )
        compiled = lowered.compile()
        out = compiled(*args)
    try:
        new, new_v, loss = out
    except (TypeError, ValueError):
        fail(f"returned {type(out).__name__}", "return (new_params, new_velocity, loss)")
    return specs, new, new_v, loss, programs.collectives(compiled.as_text(), dict(mesh.shape))


def _judge_layout(specs, trees, found, n_model, where):
    for what, tree in trees.items():
        moved = [k for k in specs if not tree[k].sharding.is_equivalent_to(specs[k], tree[k].ndim)]
        if moved:
            fail(
                f"after the step the {what} {moved} changed sharding "
                f"({', '.join(str(tree[m].sharding.spec) for m in moved)}) {where}",
                "a gradient has its parameter's sharding, and so has the velocity built from it: update "
                "both in place and don't reshard the results",
            )
    gathers = sorted({(op, axes) for op, axes in found if op in ("all-gather", "all-to-all")})
    if gathers:
        fail(
            f"the compiled step moves whole arrays between devices {where}: {gathers}",
            "you resharded a weight or an activation (e.g. jax.reshard(..., P()) or out_sharding=P()): "
            "contract the model-split hidden dimension where it lies, with "
            "jnp.matmul(h, w2, out_sharding=P('data', None)); its partial sums become one all-reduce",
        )
    if n_model > 1 and ("all-reduce", (MODEL,)) not in found:
        fail(
            f"no all-reduce over 'model' {where}",
            "the second matmul's partial sums must be added over model",
        )


def _judge_values(params, new, new_v, loss, ref, where):
    ref_p, ref_v, ref_loss = ref
    for what, tree in (("new_params", new), ("new_velocity", new_v)):
        if not isinstance(tree, dict) or set(tree) != set(params):
            keys = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
            fail(f"{what} has keys {keys}", "return dicts with the same keys as params")
    if not np.isclose(float(loss), float(ref_loss), rtol=1e-5, atol=1e-6):
        fail(
            f"loss {float(loss):.6f} {where}, one device gives {float(ref_loss):.6f}",
            "loss = mean((relu(x @ w1 + b1) @ w2 + b2 - y) ** 2), computed before the update",
        )
    bad_v = [k for k in params if not np.allclose(new_v[k], ref_v[k], rtol=1e-4, atol=1e-5)]
    if bad_v:
        fail(
            f"the new velocity of {bad_v} differs from one device's {where}",
            "v_new = 0.9 * v + grad",
        )
    bad = [k for k in params if not np.allclose(new[k], ref_p[k], rtol=1e-4, atol=1e-5)]
    if bad:
        fail(
            f"updated {bad} differ from one device's step {where}",
            "p_new = p - lr * v_new, for every p",
        )


@checker
def check_tp_train_step(fn: Callable, devices: Sequence[Any]) -> bool:
    """``fn(params, velocity, x, y, lr)``, jitted under ``jax.set_mesh(mesh)`` with Explicit axes, must return
    ``(new_params, new_velocity, loss)`` equal to one device's momentum-SGD step on the MLP
    ``relu(x @ w1 + b1) @ w2 + b2`` with mean squared error, keep the shardings of the parameters and of
    the velocity, and communicate only with all-reduces."""
    n = len(devices)
    params, velocity, x, y = _tp_inputs(n)
    ref = None
    for n_data, n_model in _mesh_shapes(n):
        mesh = data_model_mesh(devices, (n_data, n_model), axis_type="explicit")
        where = f"on a data={n_data} x model={n_model} mesh"
        specs, new, new_v, loss, found = _run_tp(fn, mesh, params, velocity, x, y, where)
        if ref is None:
            ref = jax.jit(_reference_step)(params, velocity, x, y, 0.1)
        _judge_values(params, new, new_v, loss, ref, where)
        _judge_layout(specs, {"parameters": new, "velocity": new_v}, found, n_model, where)
        if min(n_data, n_model) == 1:
            judge_types(fn, mesh, params, velocity, x, y, where)
    return passed(
        f"tensor-parallel step equals one device's on {len(_mesh_shapes(n))} mesh shape(s); parameters "
        "and velocity keep their shardings; only all-reduces in the compiled program"
    )

"""Lesson 05's exercise 3 (exported by :mod:`course_tools.checks.lesson05`): one momentum-SGD step of an MLP
stored FSDP × tensor-parallel on an Explicit ``data × model`` mesh.

The step is compared with the same step on one device; the shardings it returns are read from its outputs;
what it communicates is read from the compiled program (which collective, over which mesh axes, how many
bytes); whether its first matmul ran on Explicit types is read from the types it was traced with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import P
from jax.sharding import NamedSharding

from course_lib import programs
from course_lib.meshes import DATA, MODEL, choose_mesh_shape, data_model_mesh

from ._common import NotWritten, call_answer, close, fail, matmul_rtol, not_written
from ._lesson05_probe import dim_axes, explicit_axes_of, typed_gathers

MOMENTUM = 0.9
"""The momentum of exercise 3's SGD: ``v <- MOMENTUM * v + g``, ``p <- p - lr * v``."""

AT_REST = {"w1": (DATA, MODEL), "b1": (MODEL,), "w2": (MODEL, DATA), "b2": ()}
"""The layout between steps (and of the velocity): each weight split over model (tensor parallel: w1 by
columns, w2 by rows) and over data along its other dimension (FSDP)."""

_GATHER_HINT = (
    "gather each weight over data only, where it is used: jax.reshard(p['w1'], P(None, 'model')) and "
    "jax.reshard(p['w2'], P('model', None)) keep the model split (reshard(..., P()) also gathers over "
    "model); then contract the model-split hidden dimension with "
    "jnp.matmul(h, w2, out_sharding=P('data', None))"
)


def _reference_step(params, velocity, x, y, lr):  # the same math, written for one device
    def loss_fn(p):
        return jnp.mean((jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - y) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(params)
    v = {k: MOMENTUM * velocity[k] + g[k] for k in params}
    return {k: params[k] - lr * v[k] for k in params}, v, loss


def mesh_shapes(n: int) -> list[tuple[int, int]]:
    """The notebook's ``data × model`` split of ``n`` devices and its transpose (when it differs)."""
    n_data, n_model = choose_mesh_shape(n)
    return list(dict.fromkeys([(n_data, n_model), (n_model, n_data)]))


def problem(n: int):
    """Parameters, velocity, inputs and labels for ``n`` devices: ``D = 2n`` inputs, ``H = 4n`` hidden,
    ``O = 2n`` outputs, ``B = 2n`` examples (every dimension divides on every mesh of ``n`` devices; B
    differs from H so that the first layer's product is recognisable by its shape)."""
    k = jax.random.split(jax.random.key(11), 10)
    d, h, o, b = 2 * n, 4 * n, 2 * n, 2 * n
    shapes = {"w1": (d, h), "b1": (h,), "w2": (h, o), "b2": (o,)}
    scale = {"w1": 0.5, "b1": 0.1, "w2": 0.5, "b2": 0.1}
    params = {
        name: jax.random.normal(k[i], s) * scale[name] for i, (name, s) in enumerate(shapes.items())
    }
    velocity = {
        name: 0.1 * jax.random.normal(k[4 + i], s) for i, (name, s) in enumerate(shapes.items())
    }
    return params, velocity, jax.random.normal(k[8], (b, d)), jax.random.normal(k[9], (b, o))


def _placed(mesh, params, velocity, x, y):
    s = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    specs = {name: s(*spec) for name, spec in AT_REST.items()}
    args = (
        {name: jax.device_put(v, specs[name]) for name, v in params.items()},
        {name: jax.device_put(v, specs[name]) for name, v in velocity.items()},
        jax.device_put(x, s(DATA, None)),
        jax.device_put(y, s(DATA, None)),
        0.1,
    )
    return specs, args


def _explain(e: Exception):
    if type(e).__name__ == "ShardingTypeError" and "Contracting" in str(e):
        return (
            "fsdp_tp_step raised ShardingTypeError: a matmul contracts a sharded dimension and its "
            "result's sharding is ambiguous",
            "the second matmul contracts the model-split hidden dimension: say where its result goes, "
            "jnp.matmul(h, w2, out_sharding=P('data', None)) (its partial sums become an all-reduce "
            "over model)",
        )
    return None


def _run(fn, mesh, args, where):
    with jax.set_mesh(mesh):
        try:
            jaxpr = call_answer(
                f"fsdp_tp_step {where}", lambda: jax.make_jaxpr(fn)(*args), explain=_explain
            )
        except NotWritten:
            not_written(
                "fsdp_tp_step",
                "gather w1 and w2 over data inside the loss (jax.reshard), compute the MLP on Explicit "
                "types, take the gradient; v <- 0.9 v + g, p <- p - lr v",
            )
        compiled = jax.jit(fn).lower(*args).compile()
        out = compiled(*args)
    try:
        new, new_v, loss = out
    except (TypeError, ValueError):
        fail(f"returned {type(out).__name__}", "return (new_params, new_velocity, loss)")
    return jaxpr, compiled, new, new_v, loss


def _judge_values(params, new, new_v, loss, ref, where):
    ref_p, ref_v, ref_loss = ref
    for what, tree in (("new_params", new), ("new_velocity", new_v)):
        if not isinstance(tree, dict) or set(tree) != set(params):
            keys = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
            fail(f"{what} has keys {keys}", "return dicts with the same keys as params")
    rtol = matmul_rtol()  # sharded against one device: the platform's float32 matmul rounding
    if not np.isclose(float(loss), float(ref_loss), rtol=rtol, atol=rtol / 10):
        fail(
            f"loss {float(loss):.6f} {where}, one device gives {float(ref_loss):.6f}",
            "loss = mean((relu(x @ w1 + b1) @ w2 + b2 - y) ** 2), computed before the update",
        )
    bad_v = [k for k in params if not close(new_v[k], ref_v[k], matmul_rtol(1e-4))]
    if bad_v:
        fail(
            f"the new velocity of {bad_v} differs from one device's {where}",
            "v_new = 0.9 * v + grad",
        )
    bad = [k for k in params if not close(new[k], ref_p[k], matmul_rtol(1e-4))]
    if bad:
        fail(
            f"updated {bad} differ from one device's step {where}",
            "p_new = p - lr * v_new, for every p, with lr the argument the step is given",
        )


def _judge_layout(specs, trees, where):
    for what, tree in trees.items():
        moved = [k for k in specs if not _same_layout(tree[k], specs[k])]
        if moved:
            fail(
                f"after the step the {what} {moved} changed sharding "
                f"({', '.join(str(tree[m].sharding.spec) for m in moved)}) {where}",
                "between steps every parameter and its velocity stay in the layout they came in: the "
                "gradient of a stored (sharded) parameter has its sharding; update it in place, and "
                "keep the gathered copies inside the loss",
            )


def _first_layer_types(jaxpr, b: int, h: int) -> list:
    """The types of every product of shape [B, H] (or [H, B]) in the step: the first layer's ``x @ w1``."""
    return [
        eqn.outvars[0].aval
        for eqn, _ in programs.jaxpr_equations(jaxpr)
        if eqn.primitive.name == "dot_general"
        and sorted(eqn.outvars[0].aval.shape) == sorted((b, h))
    ]


def _local_first_layer(jaxpr, b: int, h: int) -> bool:
    """A ``jax.shard_map`` body computes each device's block of ``x @ w1``, ``[B/d, H/m]``."""
    for eqn, _ in programs.jaxpr_equations(jaxpr):
        if eqn.primitive.name != "shard_map":
            continue
        sizes = dict(eqn.params["mesh"].shape)
        block = sorted((b // sizes.get(DATA, 1), h // sizes.get(MODEL, 1)))
        if any(
            inner.primitive.name == "dot_general" and sorted(inner.outvars[0].aval.shape) == block
            for inner, _ in programs.jaxpr_equations(eqn.params["jaxpr"])
        ):
            return True
    return False


def _judge_first_layer(jaxpr, b: int, h: int, where: str) -> None:
    found = _first_layer_types(jaxpr, b, h)
    for aval in found:
        if dim_axes(aval) == [{DATA} if size == b else {MODEL} for size in aval.shape]:
            return
    if _local_first_layer(jaxpr, b, h):
        return
    if found and not any(explicit_axes_of(aval) for aval in found):
        fail(
            f"x @ w1 ran on types that carry no sharding ({found[0]}) {where}",
            "inside auto_axes the compiler, not the types, chooses every layout; this exercise is "
            "about Explicit types. Only the second matmul's contraction needs a choice: give it "
            "out_sharding=P('data', None) (or put auto_axes around that matmul alone)",
        )
    fail(
        f"no product typed [{b}@data, {h}@model] in the step {where}"
        + (f": x @ w1 is {found[0]}" if found else ""),
        "the first layer needs no communication once w1 is gathered over data only; "
        + _GATHER_HINT,
    )


def _same_layout(a, spec) -> bool:
    """``a``'s sharding is ``spec``'s, axis for axis (also on a mesh axis of size 1)."""
    norm = lambda sp: [tuple(d) if isinstance(d, tuple) else (d,) for d in tuple(sp)]  # noqa: E731
    got = norm(a.sharding.spec) + [(None,)] * (a.ndim - len(tuple(a.sharding.spec)))
    want = norm(spec.spec) + [(None,)] * (a.ndim - len(tuple(spec.spec)))
    return a.sharding.is_equivalent_to(spec, a.ndim) and got == want


def _judge_program(compiled, jaxpr, mesh, weight_block_bytes: int, where) -> None:
    sizes = dict(mesh.shape)
    ops = programs.collective_ops(compiled.as_text(), mesh)
    over_model = [o for o in ops if o.op != "all-reduce" and MODEL in (o.axes or ())]
    moving = [o for o in ops if o.op in ("all-to-all", "collective-permute")]
    if over_model or moving:
        o = (over_model or moving)[0]
        fail(
            f"the compiled step moves blocks between model shards or re-splits an array {where}: "
            f"{o.op} over {o.axes} of {o.shape}",
            _GATHER_HINT,
        )
    gathered = sum(o.nbytes for o in ops if o.op == "all-gather")
    if sizes[DATA] > 1 and gathered > 1.01 * weight_block_bytes:
        chosen = (
            ""
            if _reshards_weights(jaxpr)
            else (
                "Your step's values and its layouts are right, and JAX's Explicit types accepted it; "
                "but no jax.reshard gathers w1 or w2, so XLA's partitioner chose what to move, and it "
                "moved more than the two weights. Gather them yourself (jax.reshard to the spec each "
                "matmul needs) so that the program moves only them. "
            )
        )
        fail(
            f"the compiled step gathers {gathered:,} bytes per device over data {where}; gathering "
            f"w1's and w2's model blocks once each is {weight_block_bytes:,} bytes",
            chosen
            + "gather each weight once, inside the loss, and nothing else: the batch and the "
            "activations stay split over data (out_sharding=P('data', None) on the second matmul). "
            "Under auto_axes the compiler may gather more than you would",
        )


def _reshards_weights(jaxpr) -> bool:
    """The traced step holds a ``jax.reshard`` that gathers over data (on Explicit types)."""
    return any(what.startswith("reshard") and DATA in lost for what, lost in typed_gathers(jaxpr))


def check_fsdp_tp_step(fn: Callable, devices: Sequence[Any]) -> bool:
    """Judge one momentum-SGD step of the MLP ``relu(x @ w1 + b1) @ w2 + b2`` (mean squared error) stored
    FSDP × tensor-parallel on Explicit ``data × model`` meshes of ``devices`` (:func:`mesh_shapes`).

    Spec: ``fn(params, velocity, x, y, lr)``, jitted under ``jax.set_mesh(mesh)`` with params and velocity
    laid out as :data:`AT_REST` and ``x``, ``y`` on ``P('data', None)``, returns ``(new_params,
    new_velocity, loss)`` where

    - the loss (before the update), the new velocity ``0.9 v + g`` and the new parameters ``p - lr v``
      equal one device's step;
    - every new parameter and velocity keeps its :data:`AT_REST` sharding;
    - the first layer's product ``x @ w1`` is computed on Explicit types, ``[B@data, H@model]`` (only the
      second matmul's contraction needs a choice: ``out_sharding=``, or ``auto_axes`` around it alone) —
      or, written with ``jax.shard_map``, each device's block ``[B/d, H/m]`` of it;
    - the learning rate is the argument ``lr`` (the step is also run with ``lr = 0.05``);
    - the compiled step gathers over data only, at most once per weight's model block (w1's ``[D, H/m]``
      and w2's ``[H/m, O]``), and never gathers, permutes or re-splits over model (all-reduces, e.g. the
      second layer's partial sums, are free to use either axis). On a mesh axis of size 1 nothing moves,
      so there the traced types are read for a gather over model instead.

    Returns True; raises ExerciseError naming the first broken rule (the exported checker prints the
    confirmation).
    """
    n = len(devices)
    params, velocity, x, y = problem(n)
    b, h = x.shape[0], params["w1"].shape[1]
    ref = jax.jit(_reference_step)(params, velocity, x, y, 0.1)
    for n_data, n_model in mesh_shapes(n):
        mesh = data_model_mesh(devices, (n_data, n_model), axis_type="explicit")
        where = f"on a data={n_data} x model={n_model} mesh"
        specs, args = _placed(mesh, params, velocity, x, y)
        jaxpr, compiled, new, new_v, loss = _run(fn, mesh, args, where)
        _judge_values(params, new, new_v, loss, ref, where)
        _judge_layout(specs, {"parameters": new, "velocity": new_v}, where)
        blocks = (params["w1"].size + params["w2"].size) // n_model * 4
        _judge_program(compiled, jaxpr, mesh, blocks, where)
        _judge_first_layer(jaxpr, b, h, where)
        if min(n_data, n_model) == 1:
            lost = [g for g in typed_gathers(jaxpr) if MODEL in g[1]]
            if lost:
                fail(
                    f"the step gathers over model {where}: {lost[0][0]} (an axis of size 1 moves "
                    "nothing here, but the type says what it would move on more devices)",
                    _GATHER_HINT,
                )
    other = jax.jit(_reference_step)(params, velocity, x, y, 0.05)
    new, new_v, loss = compiled(*args[:-1], 0.05)
    _judge_values(params, new, new_v, loss, other, f"with lr=0.05 {where}")
    return True

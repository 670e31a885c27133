"""Checkers for ``08_lab.ipynb``: the ZeRO-2 strategy the learner plans and builds (parameters replicated,
optimizer state and reduced gradients sharded), a prediction of what FSDP sends and holds per device, and of
its critical batch on a fabric and how that moves. Each judges behaviour — parity with single-device ``jit``
from the same states, bytes held per device, compiled collectives, values at its own cases — never source.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from course_lib import comms, data, model, parallel, parity, steps
from course_lib.meshes import DATA, data_mesh

from ._common import ExerciseError, call_answer, checker, fail, judged_on, passed
from ._lesson08_critical import (
    CRITICAL_MOVES,
    check_critical_batch_moves,
    check_fsdp_critical_batch,
)
from ._lesson08_fsdp import FSDP_CASES, check_fsdp_prediction, fsdp_case
from ._lesson08_zero2plan import ZERO2_PLAN, check_zero2_plan
from ._lesson08_zero2step import (
    DECAY_HINT,
    WEIGHT_DECAY,
    _check_params,
    _decay_missing,
    _tight_tolerance,
    _update_hint,
)

__all__ = [  # noqa: RUF022 (grouped: constants, then checkers)
    "CRITICAL_MOVES", "FSDP_CASES", "ZERO2_PLAN", "check_critical_batch_moves",
    "check_fsdp_critical_batch", "check_fsdp_prediction", "check_zero2", "check_zero2_plan", "fsdp_case",
    "make_check_optimizer",
]  # fmt: skip


def make_check_optimizer(learning_rate: float = 0.01):
    """SGD with momentum and weight decay: an update that *reads the parameters* (``g + wd · p``), so a
    step that hands ``optimizer.update`` the whole replicated parameters instead of this device's slices is
    caught, and whose size follows the gradient's (an update n× too large is caught; Adam's, normalised by
    the gradient's own scale, would not show it)."""
    import optax

    return optax.chain(
        optax.add_decayed_weights(WEIGHT_DECAY), optax.sgd(learning_rate, momentum=0.9)
    )


BATCH_PER_DEVICE = 4
CHECK_STEPS = 3
CHECK_MODEL = model.CNNConfig(image_size=16, channels=(8, 16, 16), hidden=16, num_classes=10)
"""The CNN the ZeRO-2 checker trains: small, and its leaves split over 2, 4 or 8 devices."""


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _zero2_mapped(body: Callable, model_config, n: int, mesh: Any):
    """The learner's body in ``shard_map`` over ``mesh`` (``n`` devices on the data axis, concrete or
    abstract): ``(mapped, state_specs, graphdef, params, optimizer, specs)``; parameters replicated, the
    optimizer state sharded as FSDP shards the parameters."""
    graphdef, params = _check_params(model_config)
    optimizer = make_check_optimizer()
    specs = parallel.fsdp_specs(params, n)
    opt_specs = parallel.specs_like(jax.eval_shape(optimizer.init, params), params, specs)
    state_specs = steps.TrainState(jax.tree.map(lambda _: P(), params), opt_specs)
    fn = partial(
        body,
        apply_fn=partial(model.apply, graphdef),
        optimizer=optimizer,
        specs=specs,
        axis_name=DATA,
    )
    mapped = jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(state_specs, (P(DATA), P(DATA))),
        out_specs=(state_specs, P()),
        check_vma=True,
    )
    return mapped, state_specs, graphdef, params, optimizer, specs


def _zero2_program(body: Callable, devices: Sequence[Any], model_config):
    """The learner's body in ``shard_map`` on a 1-D data mesh of ``devices``, on the CNN of ``model_config``."""
    mesh = data_mesh(devices, axis_type="explicit")
    mapped, state_specs, graphdef, params, optimizer, specs = _zero2_mapped(
        body, model_config, len(devices), mesh
    )
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs, is_leaf=_is_spec)
    return (
        jax.jit(mapped),
        shardings,
        NamedSharding(mesh, P(DATA)),
        graphdef,
        params,
        optimizer,
        specs,
    )


_PARAMS_HINT = (
    "the new parameters must be the same on every device (out_specs P()): all_gather each updated "
    "slice with lax.all_gather(…, axis=d, tiled=True, to='invarying')"
)
_STATE_HINT = (
    "the optimizer state of a leaf kept whole (P()) must be the same on every device: update it with "
    "the mean of the devices' gradients (lax.pmean), not this device's own gradient"
)
_LOSS_HINT = "the loss must be the same on every device: lax.pmean it"


def _refused_outputs(text: str) -> list[str]:
    """The outputs shard_map names in a refusal of replication (``out_specs[0].params['conv1']…``)."""
    return list(dict.fromkeys(re.findall(r"out_specs(\S*) is P\(", text)))


def _refusal_hint(paths: list[str]) -> str:
    """The hint for the outputs shard_map could not prove replicated: parameters, state or loss."""
    parts = []
    if not paths or any(".params" in q for q in paths):
        parts.append(_PARAMS_HINT)
    if any(".opt_state" in q for q in paths):
        parts.append(_STATE_HINT)
    if not paths or any(q.startswith("[1]") for q in paths):
        parts.append(_LOSS_HINT)
    return "; ".join(parts or [_PARAMS_HINT, _LOSS_HINT])


def _explain(e: Exception):
    text = str(e)
    if any(w in text for w in ("vma", "varying", "out_specs", "replicat")):
        paths = _refused_outputs(text)
        named = ", ".join(f"out_specs{q}" for q in paths[:3])
        return (
            f"shard_map refused the result: {named} not the same on every device"
            if paths
            else f"shard_map refused the result ({type(e).__name__}: {text[:160]})",
            _refusal_hint(paths),
        )
    if "params" in text and "update" in text:
        return (
            f"optimizer.update needs the parameters ({type(e).__name__}: {text[:160]})",
            "the checker's optimizer (weight decay) reads the parameters: pass this device's parameter "
            "slices as optimizer.update's third argument",
        )
    if "shape" in text.lower() or "incompatible" in text.lower():
        return (
            f"a shape does not match ({type(e).__name__}: {text[:160]})",
            "the optimizer state holds only this device's slice of each sharded leaf: give optimizer.update "
            "the slices of the gradients and of the parameters (lax.dynamic_slice_in_dim at lax.axis_index), "
            "each p.shape[d] // lax.axis_size(axis_name) long: the device count read from the mesh, not "
            "written in",
        )
    return None


@functools.cache
def _reference(n: int, model_config):
    """Single-device jit on the CNN: the batches for ``n`` devices, A's states and losses (cached)."""
    graphdef, params = _check_params(model_config)
    optimizer = make_check_optimizer()
    ds = data.SyntheticImages(image_size=model_config.image_size, signal=3.0)
    batches = data.batches(ds, jax.random.key(1), CHECK_STEPS, BATCH_PER_DEVICE * n)
    step = jax.jit(
        partial(steps.train_step, apply_fn=partial(model.apply, graphdef), optimizer=optimizer)
    )
    states, losses = [jax.device_get(steps.init_state(params, optimizer))], []
    for b in batches:
        new, m = step(states[-1], b)
        states.append(jax.device_get(new))
        losses.append(float(m["loss"]))
    return [jax.device_get(b) for b in batches], states, losses


@checker
@judged_on(
    4,
    "below 4 devices a ZeRO-2 step runs where a slice is the whole parameter or every leaf splits: a "
    "device count written in, or the summed gradient of a leaf kept whole, passes there",
)
def check_zero2(body: Callable, devices: Sequence[Any], model_config=None) -> bool:
    """``body(state, batch, *, apply_fn, optimizer, specs, axis_name)`` must be a ZeRO-2 step: parameters
    replicated, optimizer state sharded by ``specs``, the same update and the same new optimizer state as
    single-device training, gradients reduce-scattered (not all-reduced) in float32, updated slices
    all-gathered. Run on ``devices`` and on the first half of them (a step written for one device count
    only is caught); the collectives are read from the compiled program on ``devices``."""
    devices = list(devices)
    n = len(devices)
    model_config = CHECK_MODEL if model_config is None else model_config
    try:
        compiled, params, specs, new = _run_zero2(body, devices, model_config)
    except ExerciseError as e:  # a value off by a rounding: a bfloat16 reduction says why
        if "differs from single-device jit" in str(e):
            _judge_dtypes(body, model_config, max(n, 2))
        raise
    if n >= 2:
        _run_zero2(body, devices[: n // 2], model_config)
    _judge_dtypes(body, model_config, max(n, 2))
    if n > 1:
        found = [(c.kind, c.size_bytes) for c in comms.collectives(compiled.as_text(), {DATA: n})]
        _judge_collectives(found, params, specs, n)
    else:  # one device has no collectives: trace the body on a simulated axis of TRACE_DEVICES instead
        m = TRACE_DEVICES
        _judge_collectives(
            _traced_collectives(body, model_config, m), params, parallel.fsdp_specs(params, m), m
        )
    return passed(
        f"ZeRO-2 on {n} devices"
        + (f" (and on {n // 2})" if n >= 2 else "")
        + f": single-device updates and momentum at {CHECK_STEPS} steps, momentum sharded "
        f"({parallel.bytes_per_device(new.opt_state):,} of {model.param_bytes(params):,} bytes per device), "
        "gradients reduce-scattered, parameters all-gathered"
        + ("" if n > 1 else f" (collectives traced on a {TRACE_DEVICES}-device axis)")
    )


def _run_zero2(body: Callable, devices: list, model_config):
    """Compile the body on ``devices``, run :data:`CHECK_STEPS` steps from single-device jit's states and
    judge each step and the layout; ``(compiled, params, specs, last new state)``."""
    n = len(devices)
    step, shardings, batch_sharding, graphdef, params, optimizer, specs = _zero2_program(
        body, devices, model_config
    )
    host, ref_states, ref_losses = _reference(n, model_config)
    batch0 = jax.device_put(host[0], batch_sharding)
    start = jax.device_put(ref_states[0], shardings)

    def explain(e):  # the device count in the message: a step may fail at one count only
        known = _explain(e)
        return None if known is None else (f"on {n} device(s): {known[0]}", known[1])

    compiled = call_answer(
        f"your zero2_step on {n} device(s)",
        lambda: step.lower(start, batch0).compile(),
        explain=explain,
    )
    tol = _tight_tolerance()
    for k in range(CHECK_STEPS):
        new, metrics = call_answer(
            f"your zero2_step on {n} device(s)", compiled, jax.device_put(ref_states[k], shardings),
            jax.device_put(host[k], batch_sharding), explain=explain,
        )  # fmt: skip
        _judge_step(k, n, new, metrics, ref_states, ref_losses, tol, specs)
    _judge_layout(new, params, specs, n)
    return compiled, params, specs, new


def _judge_step(k, n, new, metrics, ref_states, ref_losses, tol, specs) -> None:
    loss = float(np.asarray(metrics["loss"]).ravel()[0])
    ratio = loss / ref_losses[k]
    if abs(ratio - 1) > tol.one_step_loss:
        hint = "the loss must be the mean over the whole batch: lax.pmean of this device's loss"
        if n > 1 and abs(ratio - n) < 0.05 * n:
            hint = f"the loss is {n}x the mean: lax.psum adds the devices' losses, lax.pmean averages them"
        fail(f"step {k}: loss {loss:.6g}, single-device jit {ref_losses[k]:.6g}", hint)
    new_params = jax.device_get(new.params)
    before, after = ref_states[k].params, ref_states[k + 1].params
    new_opt = jax.device_get(new.opt_state)
    old_opt, next_opt = ref_states[k].opt_state, ref_states[k + 1].opt_state
    d, leaf = parity.update_diff(new_params, after, before)
    if d > tol.one_step_update:
        bare = _decay_missing(new_opt, next_opt, old_opt, before, tol.one_step_update)
        fail(
            f"step {k}{f' on {n} devices' if n > 1 else ''}: the update of {leaf} differs from "
            f"single-device jit by {d:.2g} (relative)",
            DECAY_HINT.format(leaf=bare)
            if bare
            else _update_hint(new_params, after, before, leaf, n, specs),
        )
    d, leaf = parity.update_diff(new_opt, next_opt, old_opt)
    leaf = leaf.split("trace/")[-1]  # the parameter's path in the optimizer state's tree
    if d > tol.one_step_update:
        bare = _decay_missing(new_opt, next_opt, old_opt, before, tol.one_step_update)
        fail(
            f"step {k}: the parameters are right, but the new momentum of {leaf} differs from "
            f"single-device jit's by {d:.2g} (relative)",
            DECAY_HINT.format(leaf=bare)
            if bare
            else "the step must return the optimizer state that optimizer.update gave back, for this "
            "device's slices",
        )


def _judge_layout(new, params, specs, n) -> None:
    full = model.param_bytes(params)
    held = parallel.bytes_per_device(new.params)
    if held != full:
        fail(
            f"each device holds {held:,} bytes of parameters, not all {full:,}",
            "ZeRO-2 keeps the parameters replicated: all_gather the updated slices (to='invarying')",
        )
    want = (
        comms.local_param_count(
            {k: {t: a.shape for t, a in v.items()} for k, v in params.items()}, specs, {DATA: n}
        )
        * 4
    )
    got = parallel.bytes_per_device(new.opt_state)
    if got != want:
        fail(
            f"each device holds {got:,} bytes of optimizer state, expected {want:,}",
            "keep the state the specs shard",
        )


TRACE_DEVICES = 4
"""On one device the ZeRO-2 checker traces the learner's body on an abstract mesh of this many devices."""

_JAXPR_KINDS = {
    "reduce_scatter": "reduce-scatter",
    "all_gather": "all-gather",
    "all_gather_invariant": "all-gather",
    "psum": "all-reduce",
    "psum_invariant": "all-reduce",
}


def _abstract_jaxpr(body: Callable, model_config, n: int, what: str):
    """The jaxpr of the answer's step mapped over an abstract ``n``-device data mesh (no devices needed),
    traced on abstract state and batch; ``what`` names the answer in an error."""
    from jax.sharding import AbstractMesh, AxisType

    abstract = AbstractMesh((n,), (DATA,), axis_types=(AxisType.Auto,))
    mapped, _, _, params, optimizer, _ = _zero2_mapped(body, model_config, n, abstract)
    s = model_config.image_size
    batch = (
        jax.ShapeDtypeStruct((BATCH_PER_DEVICE * n, s, s, model_config.in_channels), np.float32),
        jax.ShapeDtypeStruct((BATCH_PER_DEVICE * n,), np.int32),
    )
    state = jax.eval_shape(lambda: steps.init_state(params, optimizer))
    return call_answer(what, lambda: jax.make_jaxpr(mapped)(state, batch), explain=_explain)


def _traced_collectives(body: Callable, model_config, n: int) -> list[tuple[str, int]]:
    """``[(kind, S bytes)]`` of the body's jaxpr traced on an abstract ``n``-device data mesh (no devices
    needed): ``S`` is the gathered result, the reduce-scattered operand or the all-reduced array."""
    from course_lib import programs

    jaxpr = _abstract_jaxpr(body, model_config, n, "your zero2_step")
    found = []
    for eqn, times in programs.jaxpr_equations(jaxpr):
        kind = _JAXPR_KINDS.get(eqn.primitive.name)
        if kind is not None:
            arrays = eqn.outvars if kind == "all-gather" else eqn.invars
            size = sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in arrays)
            found += [(kind, size)] * times
    return found


def _judge_dtypes(body: Callable, model_config, n: int) -> None:
    """Every collective of the body's jaxpr (traced on an abstract ``n``-device axis) moves float32: a
    gradient reduce-scattered in bfloat16 sends half the bytes and rounds the update (XLA:CPU would promote
    it back to float32 in the compiled program, so the jaxpr is read)."""
    from course_lib import programs

    jaxpr = _abstract_jaxpr(body, model_config, n, f"your zero2_step traced on {n} devices")
    narrow = sorted(
        {
            f"{_JAXPR_KINDS[eqn.primitive.name]} in {v.aval.dtype}"
            for eqn, _ in programs.jaxpr_equations(jaxpr)
            if eqn.primitive.name in _JAXPR_KINDS
            for v in eqn.invars
            if jax.numpy.issubdtype(v.aval.dtype, jax.numpy.floating) and v.aval.dtype != np.float32
        }
    )
    if narrow:
        fail(
            f"the program runs {', '.join(narrow)}: the parameters, gradients and loss are float32",
            "a collective in a narrower dtype sends fewer bytes but rounds what it carries (a reduction "
            "rounds what it reduces; an all-gather, the parameters it rebuilds): the update is no longer "
            "single-device training's",
        )


def _judge_collectives(found: list[tuple[str, int]], params, specs, n) -> None:
    """Reduce-scatter + all-gather, no all-reduce of the sharded gradients, the all-gathers gathering the
    sharded parameters only, and no more bytes than one all-reduce of the gradients (what B sends).

    ``found``: ``[(kind, S bytes)]`` per collective over ``n`` devices (S as in :func:`comms.ring_bytes`).
    """
    kinds = {kind for kind, _ in found}
    sharded = sum(
        int(np.prod(a.shape)) * 4
        for (_, a), s in zip(
            jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(specs, is_leaf=_is_spec)
        )
        if DATA in tuple(s)
    )
    reduced = sum(size for kind, size in found if kind == "all-reduce")
    scattered = sum(size for kind, size in found if kind == "reduce-scatter")
    if reduced >= sharded / 2 and abs(scattered - sharded) <= 0.05 * sharded:
        fail(
            f"the gradients are reduce-scattered, and the program also all-reduces {reduced:,} bytes: the "
            "updated parameters are put together by an all-reduce",
            "an all-reduce sends twice an all-gather's bytes (2(n-1)/n of them, not (n-1)/n): gathering "
            "the updated slices needs no sum",
        )
    if reduced >= sharded / 2:
        fail(
            f"the program all-reduces {reduced:,} bytes, the sharded gradients' size is {sharded:,}",
            "an all-reduce gives every device the whole gradient; lax.psum_scatter gives each its slice "
            "for the same bytes per device as half an all-reduce",
        )
    if "reduce-scatter" not in kinds or "all-gather" not in kinds:
        fail(
            f"the program's collectives are {sorted(kinds)}",
            "reduce-scatter the gradients (lax.psum_scatter) and all-gather the updated parameters",
        )
    gathered = sum(size for kind, size in found if kind == "all-gather")
    if abs(gathered - sharded) > 0.05 * sharded:
        fail(
            f"the program all-gathers {gathered:,} bytes; the sharded parameters are {sharded:,}",
            "all-gather only the updated parameter slices: gradients and momentum stay sharded (each "
            "device updates its own slice with its own momentum)",
        )
    sent = sum(comms.ring_bytes(kind, size, n) for kind, size in found)
    bound = 1.05 * comms.ring_bytes("all-reduce", model.param_bytes(params) + 4, n)
    if sent > bound:
        fail(
            f"each device sends {sent:,.0f} bytes per step, more than one all-reduce of the gradients "
            f"({bound / 1.05:,.0f})",
            "ZeRO-2 sends what data parallelism sends: one reduce-scatter of each sharded gradient and one "
            "all-gather of each updated parameter slice",
        )

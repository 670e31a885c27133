"""Checkers for ``08_lab.ipynb``: the ZeRO-1 strategy the learner builds, and a prediction of what FSDP
sends and holds per device. Each judges behaviour — parity with single-device ``jit`` from the same states,
bytes held per device, the collectives in the compiled program — never the source text.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from course_lib import comms, data, model, parallel, parity, steps
from course_lib.meshes import DATA, data_mesh

from ._common import call_answer, checker, fail, passed, require

BATCH_PER_DEVICE = 4
CHECK_STEPS = 3
CHECK_MODEL = model.CNNConfig(image_size=16, channels=(8, 16, 16), hidden=16, num_classes=10)
"""The CNN the ZeRO-1 checker trains: small, and its leaves split over 2, 4 or 8 devices."""


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _zero1_program(body: Callable, devices: Sequence[Any], model_config):
    """The learner's body in ``shard_map`` on a 1-D data mesh of ``devices``, on the CNN of ``model_config``."""
    n = len(devices)
    graphdef, params = model.init_model(jax.random.key(0), model_config)
    optimizer = steps.make_optimizer(0.01)
    specs = parallel.fsdp_specs(params, n)
    opt_specs = parallel.specs_like(jax.eval_shape(optimizer.init, params), params, specs)
    state_specs = steps.TrainState(jax.tree.map(lambda _: P(), params), opt_specs)
    mesh = data_mesh(devices, axis_type="explicit")
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


def _explain(e: Exception):
    text = str(e)
    if any(w in text for w in ("vma", "varying", "out_specs", "replicat")):
        return (
            f"shard_map refused the result ({type(e).__name__}: {text[:160]})",
            "the new parameters must be the same on every device (out_specs P()): all_gather each updated "
            "slice with lax.all_gather(…, axis=d, tiled=True, to='invarying'); and the loss: lax.pmean it",
        )
    if "shape" in text.lower() or "incompatible" in text.lower():
        return (
            f"a shape does not match ({type(e).__name__}: {text[:160]})",
            "the optimizer state holds only this device's slice of each sharded leaf: give optimizer.update "
            "the slices of the gradients and of the parameters (lax.dynamic_slice_in_dim at lax.axis_index)",
        )
    return None


@functools.cache
def _reference(n: int, model_config):
    """Single-device jit on the CNN: the batches for ``n`` devices, A's states and losses (cached)."""
    graphdef, params = model.init_model(jax.random.key(0), model_config)
    optimizer = steps.make_optimizer(0.01)
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
def check_zero1(body: Callable, devices: Sequence[Any], model_config=None) -> bool:
    """``body(state, batch, *, apply_fn, optimizer, specs, axis_name)`` must be a ZeRO-1 step: parameters
    replicated, optimizer state sharded by ``specs``, the same update as single-device training, gradients
    reduce-scattered (not all-reduced), updated slices all-gathered."""
    devices = list(devices)
    n = len(devices)
    model_config = CHECK_MODEL if model_config is None else model_config
    step, shardings, batch_sharding, graphdef, params, optimizer, specs = _zero1_program(
        body, devices, model_config
    )
    host, ref_states, ref_losses = _reference(n, model_config)
    batch0 = jax.device_put(host[0], batch_sharding)
    start = jax.device_put(ref_states[0], shardings)
    compiled = call_answer(
        "your zero1_step", lambda: step.lower(start, batch0).compile(), explain=_explain
    )
    tol = parity.TOLERANCES["float32"]
    for k in range(CHECK_STEPS):
        new, metrics = call_answer(
            "your zero1_step", compiled, jax.device_put(ref_states[k], shardings),
            jax.device_put(host[k], batch_sharding), explain=_explain,
        )  # fmt: skip
        _judge_step(k, n, new, metrics, ref_states, ref_losses, tol)
    _judge_layout(new, params, specs, n)
    _judge_collectives(compiled.as_text(), params, specs, n)
    return passed(
        f"ZeRO-1 on {n} devices: single-device updates at {CHECK_STEPS} steps, momentum sharded "
        f"({parallel.bytes_per_device(new.opt_state):,} of {model.param_bytes(params):,} bytes per device), "
        "gradients reduce-scattered, parameters all-gathered"
    )


def _judge_step(k, n, new, metrics, ref_states, ref_losses, tol) -> None:
    loss = float(np.asarray(metrics["loss"]).ravel()[0])
    ratio = loss / ref_losses[k]
    if abs(ratio - 1) > tol.one_step_loss:
        hint = "the loss must be the mean over the whole batch: lax.pmean of this device's loss"
        if n > 1 and abs(ratio - n) < 0.05 * n:
            hint = f"the loss is {n}x the mean: lax.psum adds the devices' losses, lax.pmean averages them"
        fail(f"step {k}: loss {loss:.6g}, single-device jit {ref_losses[k]:.6g}", hint)
    new_params = jax.device_get(new.params)
    before, after = ref_states[k].params, ref_states[k + 1].params
    d, leaf = parity.update_diff(new_params, after, before)
    if d <= tol.one_step_update:
        return
    u = np.concatenate(
        [np.ravel(a - b) for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(before))]
    )
    u_ref = np.concatenate(
        [np.ravel(a - b) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before))]
    )
    scale = float(np.dot(u, u_ref) / max(float(np.dot(u_ref, u_ref)), 1e-30))
    if n > 1 and abs(scale - n) < 0.1 * n:
        hint = (
            f"the updates are {n}x too large: the gradient must be the MEAN over devices — divide the "
            "psum_scatter by the axis size, and differentiate the local loss of parameters made varying "
            "(lax.pcast(params, axis_name, to='varying')) so that no implicit psum adds them first"
        )
    elif n > 1 and abs(scale * n - 1) < 0.1:
        hint = f"the updates are {n}x too small: divide the summed gradient by the axis size once, not twice"
    else:
        hint = (
            "each device must update its own slice with the mean gradient's slice "
            "(psum_scatter(g, axis_name, scatter_dimension=d, tiled=True) / n), then all_gather the slices"
        )
    fail(
        f"step {k}: the update of {leaf} differs from single-device jit by {d:.2g} (relative)", hint
    )


def _judge_layout(new, params, specs, n) -> None:
    full = model.param_bytes(params)
    held = parallel.bytes_per_device(new.params)
    if held != full:
        fail(
            f"each device holds {held:,} bytes of parameters, not all {full:,}",
            "ZeRO-1 keeps the parameters replicated: all_gather the updated slices (to='invarying')",
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


def _judge_collectives(hlo_text: str, params, specs, n) -> None:
    if n == 1:
        return
    found = comms.collectives(hlo_text, {DATA: n})
    kinds = {c.kind for c in found}
    sharded = sum(
        int(np.prod(a.shape)) * 4
        for (_, a), s in zip(
            jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(specs, is_leaf=_is_spec)
        )
        if DATA in tuple(s)
    )
    reduced = sum(c.size_bytes for c in found if c.kind == "all-reduce")
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


@checker
def check_fsdp_prediction(sent_bytes, state_bytes, measured_row: dict) -> bool:
    """Predictions of E's bytes sent per device per step and its parameter + momentum bytes per device,
    against the lab's measurement (``runs["fsdp"].row``), within 5 %."""
    sent = require(
        "predicted_fsdp_sent_bytes",
        sent_bytes,
        "a number of bytes: the ring formula of each collective E runs",
    )
    state = require(
        "predicted_fsdp_state_bytes",
        state_bytes,
        "a number of bytes: what each device holds of params and momentum",
    )
    true_sent = float(measured_row["collective_bytes_per_device"])
    true_state = float(
        measured_row["param_bytes_per_device"] + measured_row["opt_state_bytes_per_device"]
    )
    n = int(measured_row["n_devices"])
    if not _close(float(sent), true_sent):
        if true_sent and _close(float(sent), 2 * true_sent):
            hint = "E does not all-reduce its gradients: each device gets only its slice (a reduce-scatter)"
        elif true_sent and _close(float(sent), true_sent / 2):
            hint = "the backward pass sends too: the transpose of the all_gather is a reduce-scatter of the gradients"
        elif n > 1 and true_sent and _close(float(sent), true_sent * n / (n - 1)):
            hint = f"a device keeps its own block: (n-1)/n of the bytes travel, with n = {n}"
        else:
            hint = "per parameter: all-gather (n-1)/n·S forward + reduce-scatter (n-1)/n·S backward, S its bytes"
        fail(f"predicted {float(sent):,.0f} bytes sent per device, measured {true_sent:,.0f}", hint)
    if not _close(float(state), true_state):
        if _close(float(state), true_state / 2):
            hint = "SGD with momentum keeps one momentum value per parameter: count it too"
        elif n > 1 and _close(float(state), true_state * n):
            hint = f"FSDP shards both the parameters and the momentum over the {n} devices"
        else:
            hint = "(parameters + momentum) bytes / n, plus the leaves that stay replicated"
        fail(
            f"predicted {float(state):,.0f} bytes of state per device, measured {true_state:,.0f}",
            hint,
        )
    return passed(
        f"E sends {true_sent:,.0f} B per device per step and holds {true_state:,.0f} B of state per device"
    )


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 0.05 * max(abs(b), 1.0)

"""The lab's training strategies, each built from the same step body (:func:`course_lib.steps.train_step`).

===  ================  ==============================================================================
key  name              what it does
===  ================  ==============================================================================
A    ``jit``           one device; ``jax.jit`` of the step
B    ``pmap``          data parallelism: ``jax.pmap`` over the leading device axis, ``lax.pmean`` of gradients
C    ``shard_map``     2-D ``data × model`` mesh, manual SPMD: batch over ``data``, tensor-parallel layers
                       over ``model`` (:mod:`course_lib.parallel`), ``check_vma=True``
D    ``sharded_jit``   ``jax.jit`` of the unmodified step on a 1-D ``data`` mesh; the compiler partitions it
                       ("computation follows data") and inserts the all-reduce
===  ================  ==============================================================================

Every strategy starts from the same parameters and consumes the same global batches, so their losses
and final parameters agree with A's within float32 rounding (the parity tests).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from . import data as data_lib
from . import model as model_lib
from . import parallel
from .meshes import DATA, MODEL, choose_mesh_shape, data_mesh, data_model_mesh, describe
from .steps import TrainState, init_state, train_step

STRATEGIES = ("jit", "pmap", "shard_map", "sharded_jit")
"""Strategy keys in the lab's order (A, B, C, D)."""
LABELS = {
    "jit": "A: jit, 1 device",
    "pmap": "B: pmap (data parallel)",
    "shard_map": "C: shard_map (data x model)",
    "sharded_jit": "D: sharded jit (data parallel)",
    "shard_map_article": "C': shard_map, article's split",
}


@dataclasses.dataclass
class Strategy:
    """A built strategy: how to place state and batches, and the compiled-on-first-call step.

    Attributes:
      key: one of ``STRATEGIES`` (or ``"shard_map_article"``).
      label: a readable name for tables and plots.
      n_devices: devices the strategy runs on.
      mesh: description such as ``"data=4 x model=2"`` (``"1 device"`` for A).
      step: ``(state, batch) -> (state, {"loss": scalar})``, with the state donated.
      batch_sharding: the sharding a *global* batch is generated in.
      place_state: puts a host/single-device :class:`TrainState` where the step expects it.
      host_params: brings the parameters back as one global copy (numpy), for comparisons.
      to_step_batch: turns a global batch in ``batch_sharding`` into what ``step`` takes (pmap's reshape).
    """

    key: str
    label: str
    n_devices: int
    mesh: str
    step: Callable
    batch_sharding: jax.sharding.Sharding
    place_state: Callable[[TrainState], Any]
    host_params: Callable[[Any], Any]
    to_step_batch: Callable[[Any], Any] = lambda b: b
    global_batch_divisor: int = 1

    def batches(self, ds: data_lib.SyntheticImages, key: jax.Array, steps: int, global_batch: int) -> list:
        """``steps`` global batches in this strategy's layout; batch *i* from ``fold_in(key, i)``.

        Raises:
          ValueError: ``global_batch`` not divisible by the strategy's data shards (numbers named).
        """
        data_lib.check_divisible(global_batch, self.global_batch_divisor, "global batch")
        return [self.to_step_batch(b) for b in data_lib.batches(ds, key, steps, global_batch, self.batch_sharding)]

    def lower(self, state: Any, batch: Any):
        """``jax.stages.Lowered`` of the step for these placed inputs (compile it to measure it)."""
        return self.step.lower(state, batch)


def build(
    key: str,
    graphdef: Any,
    params: Any,
    optimizer: optax.GradientTransformation,
    devices: Sequence[Any],
    mesh_shape: tuple[int, int] | None = None,
) -> Strategy:
    """Build strategy ``key`` on ``devices``.

    Args:
      key: ``"jit"``, ``"pmap"``, ``"shard_map"``, ``"sharded_jit"`` or ``"shard_map_article"``.
      graphdef: the CNN's graph definition (:func:`course_lib.model.init_model`).
      params: the parameters (used for shapes and layout checks only; not captured).
      optimizer: the shared optax optimizer.
      devices: devices to run on; ``"jit"`` uses the first one only.
      mesh_shape: ``(n_data, n_model)`` for the shard_map strategies; default :func:`choose_mesh_shape`.

    Raises:
      ValueError: unknown key, no devices, or a model axis that does not divide a split layer.
    """
    devices = list(devices)
    if not devices:
        raise ValueError("no devices given; pass report.devices from setup_devices()")
    apply_fn = partial(model_lib.apply, graphdef)
    if key == "jit":
        return _build_jit(apply_fn, optimizer, devices[0])
    if key == "pmap":
        return _build_pmap(apply_fn, optimizer, devices)
    if key == "sharded_jit":
        return _build_sharded_jit(apply_fn, optimizer, devices)
    if key in ("shard_map", "shard_map_article"):
        return _build_shard_map(key, params, optimizer, devices, mesh_shape)
    raise ValueError(f"unknown strategy {key!r}; choose one of {STRATEGIES + ('shard_map_article',)}")


def _build_jit(apply_fn, optimizer, device) -> Strategy:
    step = jax.jit(partial(train_step, apply_fn=apply_fn, optimizer=optimizer), donate_argnums=0)
    sharding = SingleDeviceSharding(device)
    return Strategy(
        key="jit",
        label=LABELS["jit"],
        n_devices=1,
        mesh="1 device",
        step=step,
        batch_sharding=sharding,
        place_state=lambda s: _put(s, sharding),
        host_params=lambda s: jax.device_get(s.params),
    )


def _build_pmap(apply_fn, optimizer, devices) -> Strategy:
    n = len(devices)
    body = partial(train_step, apply_fn=apply_fn, optimizer=optimizer, data_axis=DATA, sync="grads")
    step = jax.pmap(body, axis_name=DATA, devices=devices, donate_argnums=0)
    mesh = data_mesh(devices, axis_type="auto")
    stacked = NamedSharding(mesh, P(DATA))

    def place_state(state):
        # pmap does not replicate by itself: give every device its own copy along a new leading axis.
        return _put(jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), state), stacked)

    to_pmap = jax.jit(
        lambda b: jax.tree.map(lambda x: data_lib.split_leading(x, n), b),
        out_shardings=stacked,
    )
    return Strategy(
        key="pmap",
        label=LABELS["pmap"],
        n_devices=n,
        mesh=f"{DATA}={n} (pmap axis)",
        step=step,
        batch_sharding=stacked,
        place_state=place_state,
        host_params=lambda s: jax.device_get(jax.tree.map(lambda x: x[0], s.params)),
        to_step_batch=to_pmap,
        global_batch_divisor=n,
    )


def _build_sharded_jit(apply_fn, optimizer, devices) -> Strategy:
    mesh = data_mesh(devices, axis_type="explicit")
    replicated = NamedSharding(mesh, P())
    step = jax.jit(partial(train_step, apply_fn=apply_fn, optimizer=optimizer), donate_argnums=0)
    return Strategy(
        key="sharded_jit",
        label=LABELS["sharded_jit"],
        n_devices=len(devices),
        mesh=describe(mesh),
        step=step,
        batch_sharding=NamedSharding(mesh, P(DATA)),
        place_state=lambda s: _put(s, replicated),
        host_params=lambda s: jax.device_get(s.params),
        global_batch_divisor=len(devices),
    )


def _build_shard_map(key, params, optimizer, devices, mesh_shape) -> Strategy:
    shape = mesh_shape or choose_mesh_shape(len(devices))
    mesh = data_model_mesh(devices, shape, axis_type="explicit")
    if key == "shard_map":
        param_specs, apply_fn = parallel.tp_param_specs(params, MODEL), parallel.tp_apply
    else:
        param_specs, apply_fn = parallel.article_param_specs(params, MODEL), parallel.article_apply
    parallel.check_model_split(params, param_specs, shape[1])
    opt_specs = parallel.specs_like(jax.eval_shape(optimizer.init, params), params, param_specs)
    state_specs = TrainState(params=param_specs, opt_state=opt_specs)
    batch_spec = (P(DATA), P(DATA))
    body = partial(
        train_step, apply_fn=partial(apply_fn, model_axis=MODEL), optimizer=optimizer, data_axis=DATA, sync="loss"
    )
    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(state_specs, batch_spec), out_specs=(state_specs, P()), check_vma=True
    )
    step = jax.jit(mapped, donate_argnums=0)
    state_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs, is_leaf=lambda x: isinstance(x, P))
    return Strategy(
        key=key,
        label=LABELS[key],
        n_devices=len(devices),
        mesh=describe(mesh),
        step=step,
        batch_sharding=NamedSharding(mesh, P(DATA)),
        place_state=lambda s: _put(s, state_shardings),
        host_params=lambda s: jax.device_get(s.params),
        global_batch_divisor=shape[0],
    )


def _put(tree: Any, sharding: Any) -> Any:
    # Always fresh buffers, made from a host copy: the steps donate their state, and donation must never
    # delete the caller's arrays (device_put onto a device that already holds a buffer may reuse it).
    return jax.device_put(jax.device_get(tree), sharding)


def data_shards(key: str, n_devices: int) -> int:
    """How many pieces strategy ``key`` splits the global batch into on ``n_devices`` devices."""
    if key == "jit":
        return 1
    if key in ("shard_map", "shard_map_article"):
        return choose_mesh_shape(n_devices)[0]
    return n_devices


def max_param_diff(a: Any, b: Any) -> float:
    """Largest absolute difference between two parameter pytrees of the same structure (float)."""
    return float(max(np.max(np.abs(np.asarray(x) - np.asarray(y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))


def replicas_identical(state: Any) -> bool:
    """For pmap's stacked state: True when every device's copy of every leaf is bit-identical to device 0's."""
    return all(bool(np.all(np.asarray(x) == np.asarray(x)[0:1])) for x in jax.tree.leaves(state))

"""The lab's training strategies, each built from the same step body (:func:`course_lib.steps.train_step`).

===  ================  ==============================================================================
key  name              what it does
===  ================  ==============================================================================
A    ``jit``           one device; ``jax.jit`` of the step (``notebooks/02_jit.ipynb``)
B    ``pmap``          data parallelism: ``jax.pmap`` over the leading device axis, ``lax.pmean`` of
                       gradients (``notebooks/04_pmap.ipynb``)
C    ``shard_map``     2-D ``data × model`` mesh, manual SPMD: batch over ``data``, tensor-parallel layers
                       over ``model`` (:mod:`course_lib.parallel`), ``check_vma=True``
                       (``notebooks/06_shard_map.ipynb``)
D    ``sharded_jit``   ``jax.jit`` of the unmodified step on a 1-D ``data`` mesh; the compiler partitions it
                       ("computation follows data") and inserts the all-reduce (``notebooks/05_sharding.ipynb``)
C′   ``shard_map_article``  C with the source article's split: only conv1 over ``model``
===  ================  ==============================================================================

Every strategy starts from the same parameters and consumes the same global batches, so their losses
and final parameters agree with A's within float32 rounding (the parity tests).

:data:`REGISTRY` is the one place that describes a strategy: its key, letter, label, plot marker, mesh
(from which its data shards follow), builder, and which runs it takes part in (the lab's line-up, the
multi-process lesson, the scaling sweep). :data:`STRATEGIES`, :data:`LABELS`, :func:`build`,
:func:`data_shards`, the plots' markers, the multi-process strategies and the scaling sweep all read it.
To add a strategy, write its builder ``(info, graphdef, params, optimizer, devices, mesh_shape) ->
Strategy`` and add one :class:`StrategyInfo` entry to :data:`REGISTRY`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from . import data as data_lib
from . import model as model_lib
from . import parallel
from .meshes import DATA, MODEL, choose_mesh_shape, data_mesh, data_model_mesh, describe
from .steps import TrainState, train_step

MESH_KINDS = ("single", "data", "data_model")
"""``single``: one device; ``data``: the batch split over every device; ``data_model``: a 2-D mesh whose
``data`` axis splits the batch and whose ``model`` axis splits the layers."""


@dataclasses.dataclass(frozen=True)
class StrategyInfo:
    """Everything the course says about one strategy; :data:`REGISTRY` holds one per key.

    Attributes:
      key: the name used everywhere (``"jit"``), also in results files.
      letter: the lab's letter (``"A"``; ``"C'"`` for the article's variant).
      label: a readable name for tables and plots (``"A: jit, 1 device"``).
      marker: its matplotlib marker in plots.
      mesh_kind: one of :data:`MESH_KINDS`; the data shards follow from it (:meth:`data_shards`).
      builder: ``(info, graphdef, params, optimizer, devices, mesh_shape) -> Strategy``.
      lab: in the lab's default line-up (:data:`STRATEGIES`).
      multihost: run by the multi-process lesson (:data:`course_lib.distributed.MULTIHOST_STRATEGIES`).
      scaling: in the lab's scaling sweep (:func:`course_lib.lab.scaling_sweep`).
    """

    key: str
    letter: str
    label: str
    marker: str
    mesh_kind: str
    builder: Callable[..., Strategy]
    lab: bool = False
    multihost: bool = False
    scaling: bool = False

    def __post_init__(self):
        if self.mesh_kind not in MESH_KINDS:
            raise ValueError(
                f"mesh_kind={self.mesh_kind!r} of strategy {self.key!r} must be one of {MESH_KINDS}"
            )

    def data_shards(self, n_devices: int, mesh_shape: tuple[int, int] | None = None) -> int:
        """How many pieces the global batch is split into on ``n_devices`` (or on a ``mesh_shape``)."""
        if self.mesh_kind == "single":
            return 1
        if self.mesh_kind == "data":
            return n_devices
        return (mesh_shape or choose_mesh_shape(n_devices))[0]


@dataclasses.dataclass
class Strategy:
    """A built strategy: how to place state and batches, and the compiled-on-first-call step.

    Attributes:
      key: a key of :data:`REGISTRY`.
      label: a readable name for tables and plots.
      n_devices: devices the strategy runs on.
      mesh: description such as ``"data=4 x model=2"`` (``"1 device"`` for A).
      step: ``(state, batch) -> (state, {"loss": scalar})``, with the state donated.
      batch_sharding: the sharding a *global* batch is generated in.
      place_state: puts a host/single-device :class:`TrainState` where the step expects it.
      host_params: brings the parameters back as one global copy (numpy), for comparisons.
      to_step_batch: turns a global batch in ``batch_sharding`` into what ``step`` takes (pmap's reshape).
      global_batch_divisor: the data shards: the global batch must be a multiple of it.
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

    def batches(
        self, ds: data_lib.SyntheticImages, key: jax.Array, steps: int, global_batch: int
    ) -> list:
        """``steps`` global batches in this strategy's layout; batch *i* from ``fold_in(key, i)``.

        Raises:
          ValueError: ``global_batch`` not divisible by the strategy's data shards (numbers named).
        """
        data_lib.check_divisible(global_batch, self.global_batch_divisor, "global batch")
        return [
            self.to_step_batch(b)
            for b in data_lib.batches(ds, key, steps, global_batch, self.batch_sharding)
        ]

    def lower(self, state: Any, batch: Any):
        """``jax.stages.Lowered`` of the step for these placed inputs (compile it to measure it)."""
        return self.step.lower(state, batch)


def _strategy(info: StrategyInfo, devices: list, mesh_shape, **fields: Any) -> Strategy:
    """A :class:`Strategy` of ``info`` on ``devices``: key, label and data shards come from the registry."""
    n = 1 if info.mesh_kind == "single" else len(devices)
    fields.setdefault("host_params", lambda s: jax.device_get(s.params))
    return Strategy(
        key=info.key,
        label=info.label,
        n_devices=n,
        global_batch_divisor=info.data_shards(n, mesh_shape),
        **fields,
    )


def _build_jit(info, graphdef, params, optimizer, devices, mesh_shape) -> Strategy:
    apply_fn = partial(model_lib.apply, graphdef)
    step = jax.jit(partial(train_step, apply_fn=apply_fn, optimizer=optimizer), donate_argnums=0)
    sharding = SingleDeviceSharding(devices[0])
    return _strategy(
        info,
        devices,
        mesh_shape,
        mesh="1 device",
        step=step,
        batch_sharding=sharding,
        place_state=lambda s: _put(s, sharding),
    )


def _build_pmap(info, graphdef, params, optimizer, devices, mesh_shape) -> Strategy:
    n = len(devices)
    apply_fn = partial(model_lib.apply, graphdef)
    body = partial(train_step, apply_fn=apply_fn, optimizer=optimizer, data_axis=DATA, sync="grads")
    step = jax.pmap(body, axis_name=DATA, devices=devices, donate_argnums=0)
    stacked = data_lib.pmap_sharding(devices)

    def place_state(state):
        # pmap does not replicate by itself: give every device its own copy along a new leading axis.
        return _put(jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), state), stacked)

    return _strategy(
        info,
        devices,
        mesh_shape,
        mesh=f"{DATA}={n} (pmap axis)",
        step=step,
        batch_sharding=stacked,
        place_state=place_state,
        host_params=lambda s: jax.device_get(jax.tree.map(lambda x: x[0], s.params)),
        to_step_batch=jax.jit(partial(data_lib.to_pmap_layout, n_devices=n), out_shardings=stacked),
    )


def _build_sharded_jit(info, graphdef, params, optimizer, devices, mesh_shape) -> Strategy:
    mesh = data_mesh(devices, axis_type="explicit")
    apply_fn = partial(model_lib.apply, graphdef)
    step = jax.jit(partial(train_step, apply_fn=apply_fn, optimizer=optimizer), donate_argnums=0)
    return _strategy(
        info,
        devices,
        mesh_shape,
        mesh=describe(mesh),
        step=step,
        batch_sharding=NamedSharding(mesh, P(DATA)),
        place_state=lambda s: _put(s, NamedSharding(mesh, P())),
    )


def _build_shard_map(
    info, params, optimizer, devices, mesh_shape, param_specs, apply_fn
) -> Strategy:
    """C and C′: the step in ``shard_map`` over a ``data × model`` mesh, parameters laid out by ``param_specs``."""
    shape = mesh_shape or choose_mesh_shape(len(devices))
    mesh = data_model_mesh(devices, shape, axis_type="explicit")
    parallel.check_model_split(params, param_specs, shape[1])
    opt_specs = parallel.specs_like(jax.eval_shape(optimizer.init, params), params, param_specs)
    state_specs = TrainState(params=param_specs, opt_state=opt_specs)
    body = partial(
        train_step,
        apply_fn=partial(apply_fn, model_axis=MODEL),
        optimizer=optimizer,
        data_axis=DATA,
        sync="loss",
    )
    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(state_specs, (P(DATA), P(DATA))),
        out_specs=(state_specs, P()),
        check_vma=True,
    )
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), state_specs, is_leaf=lambda x: isinstance(x, P)
    )
    return _strategy(
        info,
        devices,
        shape,
        mesh=describe(mesh),
        step=jax.jit(mapped, donate_argnums=0),
        batch_sharding=NamedSharding(mesh, P(DATA)),
        place_state=lambda s: _put(s, shardings),
    )


def _build_tensor_parallel(info, graphdef, params, optimizer, devices, mesh_shape) -> Strategy:
    specs = parallel.tp_param_specs(params, MODEL)
    return _build_shard_map(info, params, optimizer, devices, mesh_shape, specs, parallel.tp_apply)


def _build_article(info, graphdef, params, optimizer, devices, mesh_shape) -> Strategy:
    specs = parallel.article_param_specs(params, MODEL)
    return _build_shard_map(
        info, params, optimizer, devices, mesh_shape, specs, parallel.article_apply
    )


REGISTRY: dict[str, StrategyInfo] = {
    info.key: info
    for info in (
        StrategyInfo("jit", "A", "A: jit, 1 device", "o", "single", _build_jit, lab=True),
        StrategyInfo(
            "pmap", "B", "B: pmap (data parallel)", "s", "data", _build_pmap, lab=True, scaling=True
        ),
        StrategyInfo(
            "shard_map",
            "C",
            "C: shard_map (data x model)",
            "^",
            "data_model",
            _build_tensor_parallel,
            lab=True,
            multihost=True,
            scaling=True,
        ),
        StrategyInfo(
            "sharded_jit",
            "D",
            "D: sharded jit (data parallel)",
            "D",
            "data",
            _build_sharded_jit,
            lab=True,
            multihost=True,
            scaling=True,
        ),
        StrategyInfo(
            "shard_map_article",
            "C'",
            "C': shard_map, article's split",
            "v",
            "data_model",
            _build_article,
        ),
    )
}
"""Every strategy, in the lab's order; the one place a strategy is described."""

STRATEGIES = tuple(k for k, info in REGISTRY.items() if info.lab)
"""Strategy keys of the lab's line-up, in order (A, B, C, D); C′ joins with ``article_variant``."""
LABELS = {k: info.label for k, info in REGISTRY.items()}
"""Readable names for tables and plots."""


def info(key: str) -> StrategyInfo:
    """The registry entry of ``key``.

    Raises:
      ValueError: an unknown key; the message lists the registry's keys.
    """
    try:
        return REGISTRY[key]
    except (KeyError, TypeError):
        raise ValueError(f"unknown strategy {key!r}; choose one of {list(REGISTRY)}") from None


def build(
    key: str,
    graphdef: Any,
    params: Any,
    optimizer: optax.GradientTransformation,
    devices: Sequence[Any],
    mesh_shape: tuple[int, int] | None = None,
) -> Strategy:
    """Build strategy ``key`` on ``devices`` with the builder its :data:`REGISTRY` entry names.

    Args:
      key: a key of :data:`REGISTRY`: ``"jit"``, ``"pmap"``, ``"shard_map"``, ``"sharded_jit"`` or
        ``"shard_map_article"``.
      graphdef: the CNN's graph definition (:func:`course_lib.model.init_model`).
      params: the parameters (used for shapes and layout checks only; not captured).
      optimizer: the shared optax optimizer.
      devices: devices to run on; ``"jit"`` uses the first one only.
      mesh_shape: ``(n_data, n_model)`` for the ``data_model`` strategies; default :func:`choose_mesh_shape`.

    Raises:
      ValueError: unknown key, no devices, or a model axis that does not divide a split layer.
    """
    entry = info(key)
    devices = list(devices)
    if not devices:
        raise ValueError("no devices given; pass report.devices from setup_devices()")
    return entry.builder(entry, graphdef, params, optimizer, devices, mesh_shape)


def _put(tree: Any, sharding: Any) -> Any:
    # Always fresh buffers, made from a host copy: the steps donate their state, and donation must never
    # delete the caller's arrays (device_put onto a device that already holds a buffer may reuse it).
    return jax.device_put(jax.device_get(tree), sharding)


def data_shards(key: str, n_devices: int, mesh_shape: tuple[int, int] | None = None) -> int:
    """How many pieces strategy ``key`` splits the global batch into on ``n_devices`` devices."""
    return info(key).data_shards(n_devices, mesh_shape)


def max_param_diff(a: Any, b: Any) -> float:
    """Largest absolute difference between two parameter pytrees of the same structure (float)."""
    return float(
        max(
            np.max(np.abs(np.asarray(x) - np.asarray(y)))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
        )
    )


def replicas_identical(state: Any) -> bool:
    """For pmap's stacked state: True when every device's copy of every leaf is bit-identical to device 0's."""
    return all(bool(np.all(np.asarray(x) == np.asarray(x)[0:1])) for x in jax.tree.leaves(state))

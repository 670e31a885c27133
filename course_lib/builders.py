"""How each strategy is built from the shared step body (:func:`course_lib.steps.train_step`).

A builder ``(info, graphdef, params, optimizer, devices, mesh_shape, *, precision) -> Strategy`` applies one
transform to the same ``train_step``: ``jax.jit`` (A), ``jax.pmap`` (B), ``jax.shard_map`` over a
``data × model`` mesh with a tensor-parallel layout (C and its variants), ``jax.jit`` of sharded inputs
(D), ``jax.shard_map`` with the parameters sharded over ``data``, gathered once before the forward pass and
kept through the backward pass (E, FSDP gathered once: ZeRO-2-like), ``jax.jit`` of FSDP-sharded inputs
(E′). :mod:`course_lib.strategies` holds the registry that names them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from . import data as data_lib
from . import model as model_lib
from . import parallel
from . import precision as precision_lib
from .meshes import DATA, MODEL, choose_mesh_shape, data_mesh, data_model_mesh, describe
from .steps import TrainState, train_step


@dataclasses.dataclass
class Strategy:
    """A built strategy: how to place state and batches, and the compiled-on-first-call step.

    Attributes:
      key: a key of :data:`course_lib.strategies.REGISTRY`.
      label: a readable name for tables and plots.
      n_devices: devices the strategy runs on.
      mesh: description such as ``"data=4 x model=2"`` (``"1 device"`` for A).
      step: ``(state, batch) -> (state, {"loss": scalar})``, with the state donated.
      batch_sharding: the sharding a *global* batch is generated in.
      place_state: puts a host/single-device :class:`TrainState` where the step expects it.
      host_params: brings the parameters back as one global copy (numpy), for comparisons.
      to_step_batch: turns a global batch in ``batch_sharding`` into what ``step`` takes (pmap's reshape).
      global_batch_divisor: the data shards: the global batch must be a multiple of it.
      mesh_axes: the mesh's axis sizes in order (``{"data": 4, "model": 2}``; ``{}`` for one device), to
        name the axes of the compiled program's collectives (:func:`course_lib.comms.collectives`).
      param_specs: the parameters' PartitionSpecs on that mesh (None: one device or pmap's stacked copies).
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
    mesh_axes: dict = dataclasses.field(default_factory=dict)
    param_specs: Any = None

    def batches(
        self,
        ds: data_lib.SyntheticImages,
        key: jax.Array,
        steps: int,
        global_batch: int,
        cast: Callable[[Any], Any] | None = None,
    ) -> list:
        """``steps`` global batches in this strategy's layout; batch *i* from ``fold_in(key, i)``.

        ``cast`` (e.g. ``lambda b: precision.cast_batch(b, "bfloat16")``) is applied to each batch as it
        is made (:func:`course_lib.data.batches`'s ``transform``).

        Raises:
          ValueError: ``global_batch`` not divisible by the strategy's data shards (numbers named).
        """
        data_lib.check_divisible(global_batch, self.global_batch_divisor, "global batch")
        cast = cast or (lambda b: b)
        return data_lib.batches(
            ds, key, steps, global_batch, self.batch_sharding,
            transform=lambda b: cast(self.to_step_batch(b)),
        )  # fmt: skip

    def batch(
        self,
        ds: data_lib.SyntheticImages,
        key: jax.Array,
        i: int,
        global_batch: int,
        cast: Callable[[Any], Any] | None = None,
    ) -> Any:
        """Batch ``i`` of :meth:`batches` alone (the same values: ``fold_in(key, i)``), made again."""
        data_lib.check_divisible(global_batch, self.global_batch_divisor, "global batch")
        cast = cast or (lambda b: b)
        return cast(
            self.to_step_batch(
                ds.batch(jax.random.fold_in(key, i), global_batch, self.batch_sharding)
            )
        )

    def lower(self, state: Any, batch: Any):
        """``jax.stages.Lowered`` of the step for these placed inputs (compile it to measure it)."""
        return self.step.lower(state, batch)


def _strategy(info, devices: list, mesh_shape, **fields: Any) -> Strategy:
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


def put(tree: Any, sharding: Any) -> Any:
    """``tree`` placed by ``sharding`` (one sharding or a tree of them), always in fresh buffers.

    The steps donate their state, and donation must never delete the caller's arrays (``device_put``
    onto a device that already holds a buffer may reuse it), so the copy goes through the host.
    """
    return jax.device_put(jax.device_get(tree), sharding)


def _shardings(mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def build_jit(info, graphdef, params, optimizer, devices, mesh_shape, *, precision="float32"):
    """A: ``jax.jit`` of the step on the first device."""
    apply_fn = precision_lib.compute_in(partial(model_lib.apply, graphdef), precision)
    step = jax.jit(partial(train_step, apply_fn=apply_fn, optimizer=optimizer), donate_argnums=0)
    sharding = SingleDeviceSharding(devices[0])
    return _strategy(
        info,
        devices,
        mesh_shape,
        mesh="1 device",
        step=step,
        batch_sharding=sharding,
        place_state=lambda s: put(s, sharding),
    )


def build_pmap(info, graphdef, params, optimizer, devices, mesh_shape, *, precision="float32"):
    """B: ``jax.pmap`` over the leading device axis, gradients averaged with ``lax.pmean``."""
    n = len(devices)
    apply_fn = precision_lib.compute_in(partial(model_lib.apply, graphdef), precision)
    body = partial(train_step, apply_fn=apply_fn, optimizer=optimizer, data_axis=DATA, sync="grads")
    step = jax.pmap(body, axis_name=DATA, devices=devices, donate_argnums=0)
    stacked = data_lib.pmap_sharding(devices)

    def place_state(state):
        # pmap does not replicate by itself: give every device its own copy along a new leading axis.
        return put(jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), state), stacked)

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
        mesh_axes={DATA: n},
    )


def build_sharded_jit(
    info, graphdef, params, optimizer, devices, mesh_shape, *, precision="float32"
):
    """D: ``jax.jit`` of the unchanged step on batches sharded over an Explicit ``data`` mesh."""
    mesh = data_mesh(devices, axis_type="explicit")
    apply_fn = precision_lib.compute_in(partial(model_lib.apply, graphdef), precision)
    step = jax.jit(partial(train_step, apply_fn=apply_fn, optimizer=optimizer), donate_argnums=0)
    return _strategy(
        info,
        devices,
        mesh_shape,
        mesh=describe(mesh),
        step=step,
        batch_sharding=NamedSharding(mesh, P(DATA)),
        place_state=lambda s: put(s, NamedSharding(mesh, P())),
        mesh_axes=dict(mesh.shape),
        param_specs=jax.tree.map(lambda _: P(), params),
    )


def _shard_map_strategy(info, devices, mesh, mesh_shape, params, optimizer, param_specs, apply_fn):
    """The step in ``shard_map`` (``check_vma=True``, ``sync="loss"``) with the state laid out by
    ``param_specs`` (the optimizer state by the same specs, :func:`course_lib.parallel.specs_like`)."""
    opt_specs = parallel.specs_like(jax.eval_shape(optimizer.init, params), params, param_specs)
    state_specs = TrainState(params=param_specs, opt_state=opt_specs)
    body = partial(train_step, apply_fn=apply_fn, optimizer=optimizer, data_axis=DATA, sync="loss")
    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(state_specs, (P(DATA), P(DATA))),
        out_specs=(state_specs, P()),
        check_vma=True,
    )
    shardings = _shardings(mesh, state_specs)
    return _strategy(
        info,
        devices,
        mesh_shape,
        mesh=describe(mesh),
        step=jax.jit(mapped, donate_argnums=0),
        batch_sharding=NamedSharding(mesh, P(DATA)),
        place_state=lambda s: put(s, shardings),
        mesh_axes=dict(mesh.shape),
        param_specs=param_specs,
    )


def _tensor_parallel(info, params, optimizer, devices, mesh_shape, specs_fn, apply_fn, precision):
    shape = mesh_shape or choose_mesh_shape(len(devices))
    mesh = data_model_mesh(devices, shape, axis_type="explicit")
    specs = specs_fn(params, MODEL)
    parallel.check_model_split(params, specs, shape[1])
    apply_fn = precision_lib.compute_in(partial(apply_fn, model_axis=MODEL), precision, DATA)
    return _shard_map_strategy(info, devices, mesh, shape, params, optimizer, specs, apply_fn)


def build_tensor_parallel(
    info, graphdef, params, optimizer, devices, mesh_shape, *, precision="float32"
):
    """C: the gather layout (:func:`course_lib.parallel.tp_gather_apply`) on a ``data × model`` mesh."""
    return _tensor_parallel(
        info, params, optimizer, devices, mesh_shape,
        parallel.tp_gather_param_specs, parallel.tp_gather_apply, precision,
    )  # fmt: skip


def build_tensor_parallel_pairs(
    info, graphdef, params, optimizer, devices, mesh_shape, *, precision="float32"
):
    """C with the pairs layout of lesson 06 (:func:`course_lib.parallel.tp_apply`)."""
    return _tensor_parallel(
        info, params, optimizer, devices, mesh_shape,
        parallel.tp_param_specs, parallel.tp_apply, precision,
    )  # fmt: skip


def build_article(info, graphdef, params, optimizer, devices, mesh_shape, *, precision="float32"):
    """C′: the source article's split, only conv1 over ``model`` (:func:`course_lib.parallel.article_apply`)."""
    return _tensor_parallel(
        info, params, optimizer, devices, mesh_shape,
        parallel.article_param_specs, parallel.article_apply, precision,
    )  # fmt: skip


def build_fsdp(info, graphdef, params, optimizer, devices, mesh_shape, *, precision="float32"):
    """E, FSDP in ``shard_map``, gathered once: parameters and optimizer state sharded over ``data``
    (:func:`course_lib.parallel.fsdp_specs`); the step gathers every parameter before the forward pass
    (:func:`course_lib.parallel.gather_params`) and the residuals keep them all alive through the backward
    pass; the gradients come back reduce-scattered. That is ZeRO-2-like — PyTorch's ``SHARD_GRAD_OP``,
    ``fully_shard(reshard_after_forward=False)`` — not ZeRO-3, which frees each layer's parameters after
    use and gathers them again in the backward pass (``notebooks/10_transformers.ipynb``)."""
    mesh = data_mesh(devices, axis_type="explicit")
    specs = parallel.fsdp_specs(params, len(devices))
    model_apply = precision_lib.compute_in(partial(model_lib.apply, graphdef), precision, DATA)

    def gathering_apply(p, images):
        return model_apply(parallel.gather_params(p, specs), images)

    return _shard_map_strategy(
        info, devices, mesh, mesh_shape, params, optimizer, specs, gathering_apply
    )


def build_fsdp_jit(info, graphdef, params, optimizer, devices, mesh_shape, *, precision="float32"):
    """E′, E's layout with sharded ``jit``: the unchanged step, state placed by the FSDP specs on an **Auto**
    ``data`` mesh; the partitioner inserts the gathers and reductions (on XLA:CPU it all-reduces the whole
    gradients and gathers some activations and kernels again: ``notebooks/08_lab.ipynb`` reads them). (On an
    Explicit mesh a convolution whose kernel and batch are both sharded over ``data`` raises
    ``ShardingTypeError``: it asks for ``out_sharding``.)"""
    mesh = data_mesh(devices, axis_type="auto")
    specs = parallel.fsdp_specs(params, len(devices))
    opt_specs = parallel.specs_like(jax.eval_shape(optimizer.init, params), params, specs)
    shardings = _shardings(mesh, TrainState(params=specs, opt_state=opt_specs))
    apply_fn = precision_lib.compute_in(partial(model_lib.apply, graphdef), precision)
    step = jax.jit(
        partial(train_step, apply_fn=apply_fn, optimizer=optimizer),
        donate_argnums=0,
        out_shardings=(shardings, NamedSharding(mesh, P())),
    )
    return _strategy(
        info,
        devices,
        mesh_shape,
        mesh=describe(mesh),
        step=step,
        batch_sharding=NamedSharding(mesh, P(DATA)),
        place_state=lambda s: put(s, shardings),
        mesh_axes=dict(mesh.shape),
        param_specs=specs,
    )


# ---- the transformer lab's layouts (notebooks/12_transformer_lab.ipynb) ------------------------------------
# A layout builder ``(info, config, devices, *, n_micro, compiler_options) -> lm_layouts.Built`` lays the
# transformer's step (SGD with momentum) out on the layout's mesh (:func:`course_lib.lm_layouts.build`).


def _layout(info, config, devices, n_micro, compiler_options):
    from . import lm_layouts  # the transformer's modules load only when a layout is built

    return lm_layouts.build(
        info.key, config, devices, n_micro=n_micro, compiler_options=compiler_options
    )


def build_lm_dp(info, config, devices, *, n_micro=2, compiler_options=None):
    """DP: the batch over ``data``, parameters replicated, gradients all-reduced over ``data``."""
    return _layout(info, config, devices, n_micro, compiler_options)


def build_lm_tp_sp(info, config, devices, *, n_micro=2, compiler_options=None):
    """TP+SP: ``data × model``; Megatron's heads/MLP split over ``model``, the residual stream split over
    the sequence between sub-layers."""
    return _layout(info, config, devices, n_micro, compiler_options)


def build_lm_fsdp_tp(info, config, devices, *, n_micro=2, compiler_options=None):
    """FSDP+TP: ``fsdp × model``; TP over ``model``, every parameter also split over ``fsdp`` (which splits
    the batch)."""
    return _layout(info, config, devices, n_micro, compiler_options)


def build_lm_pp_dp(info, config, devices, *, n_micro=2, compiler_options=None):
    """PP+DP: ``data × stage``; lesson 11's GPipe pipeline over ``stage``, ``n_micro`` micro-batches per data
    shard."""
    return _layout(info, config, devices, n_micro, compiler_options)


def build_lm_dp_cp(info, config, devices, *, n_micro=2, compiler_options=None):
    """DP+CP: ``data × context``; the sequence over ``context``, keys and values gathered for attention."""
    return _layout(info, config, devices, n_micro, compiler_options)


def build_lm_3d(info, config, devices, *, n_micro=2, compiler_options=None):
    """3-D: ``data × fsdp × model``, the three at once."""
    return _layout(info, config, devices, n_micro, compiler_options)


def build_lm_ep_dp(info, config, devices, *, n_micro=2, compiler_options=None):
    """EP+DP: ``data × expert``; the MoE transformer (:mod:`course_lib.lm_experts`), the batch over both
    axes, the experts over ``expert`` (two ``all_to_all`` per layer forward); ``n_micro`` unused."""
    return _layout(info, config, devices, n_micro, compiler_options)


class RemadeBatches(Sequence):
    """A finished run's batches, made again when read: ``batches[i]`` equals the batch step ``i`` trained on.

    A run keeps its ``steps`` batches on the devices while it trains (timed steps read nothing but device
    memory); afterwards they are dropped and this stands in for the list, so the lab's runs do not hold every
    strategy's batches at once (on one 16 GiB TPU v5e chip, eight runs' float32 batches of the article's
    size would not fit). Indexing makes batch ``i`` with the run's key, layout and cast (one small program).
    """

    def __init__(self, strategy, dataset, key, steps: int, global_batch: int, precision: str):
        self._args = strategy, dataset, key, global_batch, precision
        self._steps = steps

    def _make(self, i: int):
        strategy, dataset, key, global_batch, precision = self._args
        with precision_lib.enabled(precision):  # float64 batches need x64 on while they are made
            return strategy.batch(
                dataset, key, i, global_batch, lambda b: precision_lib.cast_batch(b, precision)
            )

    def __len__(self) -> int:
        return self._steps

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._steps))]
        if not -self._steps <= i < self._steps:
            raise IndexError(f"batch {i} of a run of {self._steps} steps")
        return self._make(i % self._steps)

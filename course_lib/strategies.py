"""The lab's training strategies, each built from the same step body (:func:`course_lib.steps.train_step`).

===  ====================  ===========================================================================
key  name                  what it does
===  ====================  ===========================================================================
A    ``jit``               one device; ``jax.jit`` of the step (``notebooks/02_jit.ipynb``)
B    ``pmap``              data parallelism: ``jax.pmap`` over the leading device axis, ``lax.pmean`` of
                           gradients (``notebooks/04_pmap.ipynb``)
C    ``shard_map``         2-D ``data × model`` mesh, manual SPMD: batch over ``data``, the gather layout's
                           tensor-parallel layers over ``model`` (:mod:`course_lib.parallel`), ``check_vma=True``
D    ``sharded_jit``       ``jax.jit`` of the unmodified step on a 1-D ``data`` mesh; the compiler partitions it
                           ("computation follows data") and inserts the all-reduce (``notebooks/05_sharding.ipynb``)
E    ``fsdp``              FSDP in ``shard_map``, gathered once: parameters and optimizer state sharded over
                           ``data``, every parameter all-gathered before the forward pass and kept alive
                           through the backward pass, gradients reduce-scattered. That is ZeRO-2-like
                           (PyTorch's ``SHARD_GRAD_OP``, ``fully_shard(reshard_after_forward=False)``): it
                           saves memory at rest, not at the peak. ZeRO-3 frees each layer's parameters after
                           use and gathers them again for the backward pass (``notebooks/10_transformers.ipynb``)
C2   ``shard_map_pairs``   C with lesson 06's pairs layout (``notebooks/06_shard_map.ipynb``)
C′   ``shard_map_article`` C with the source article's split: only conv1 over ``model``
E′   ``fsdp_jit``          E's layout as sharded ``jit``: the unchanged step on FSDP-placed state (Auto mesh);
                           the partitioner chooses the collectives
T1…  ``dp`` … ``3d``       the transformer lab's six layouts (:mod:`course_lib.lm_layouts`,
                           ``notebooks/12_transformer_lab.ipynb``): data × model (TP+SP), fsdp × model,
                           data × stage (PP), data × context (CP), data × fsdp × model; built by
                           :func:`build_layout`, bytes predicted by :func:`course_lib.lm_costs.predict_bytes`
===  ====================  ===========================================================================

Every strategy starts from the same parameters and consumes the same global batches, so their losses
and final parameters agree with A's (within 1e-10 in float64, as the lab asserts; to rounding in float32, see
:mod:`course_lib.parity`).

:data:`REGISTRY` is the one place that describes a strategy: its key, letter, label, plot marker, mesh
(from which its data shards follow), builder (:mod:`course_lib.builders`), parameter layout and model of
the bytes it sends (:mod:`course_lib.comms`), and which runs it takes part in (the lab's line-up, the
multi-process lesson, the scaling sweep). :data:`STRATEGIES`, :data:`LABELS`, :func:`build`,
:func:`data_shards`, :func:`predict_comm`, the plots' markers, the multi-process strategies and the scaling
sweep all read it. To add a strategy, write its builder ``(info, graphdef, params, optimizer, devices,
mesh_shape, *, precision) -> Strategy`` and add one :class:`StrategyInfo` entry to :data:`REGISTRY`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from . import builders, comms, parallel
from . import precision as precision_lib
from .builders import Strategy
from .meshes import MODEL, choose_mesh_shape

__all__ = [
    "REGISTRY",
    "STRATEGIES",
    "LABELS",
    "Strategy",
    "StrategyInfo",
    "CNN_KEYS",
    "LAYOUT_KEYS",
    "build",
    "build_layout",
    "info",
    "predict_comm",
]

MESH_KINDS = ("single", "data", "data_model", "layout")
"""``single``: one device; ``data``: the batch split over every device; ``data_model``: a 2-D mesh whose
``data`` axis splits the batch and whose ``model`` axis splits the layers; ``layout``: a transformer layout's
mesh, named by :data:`course_lib.lm_layouts.LAYOUTS` under the same key (``data × model``, ``fsdp × model``,
``data × stage``, ``data × context``, ``data × fsdp × model``)."""

MODELS = ("cnn", "transformer")
"""``cnn``: the lab's CNN (``notebooks/08_lab.ipynb``), built by :func:`build`; ``transformer``: the
transformer lab's layouts (``notebooks/12_transformer_lab.ipynb``), built by :func:`build_layout`."""


@dataclasses.dataclass(frozen=True)
class StrategyInfo:
    """Everything the course says about one strategy; :data:`REGISTRY` holds one per key.

    Attributes:
      key: the name used everywhere (``"jit"``), also in results files.
      letter: the lab's letter (``"A"``; ``"C'"`` for the article's variant).
      label: a readable name for tables and plots (``"A: jit, 1 device"``).
      marker: its matplotlib marker in plots.
      mesh_kind: one of :data:`MESH_KINDS`; the data shards follow from it (:meth:`data_shards`).
      builder: ``(info, graphdef, params, optimizer, devices, mesh_shape, *, precision) -> Strategy``.
      layout: ``(params, n_devices, mesh_shape) -> PartitionSpecs`` of the parameters on the strategy's
        mesh; None: replicated (or one device).
      comm_model: predicts the collectives from shapes: a function of :mod:`course_lib.comms`
        (``predict_data_parallel``, ``predict_fsdp``, ``predict_tensor_parallel``); None: no model (one
        device, or collectives the compiler chooses).
      tp_layout: the tensor-parallel layout of a ``data_model`` strategy (``"gather"``, ``"pairs"``,
        ``"article"``): which activations cross the model axis (:mod:`course_lib.comms`) and which
        each device keeps (:mod:`course_lib.costs`); None: every device keeps whole activations.
      lab: in the lab's default line-up (:data:`STRATEGIES`).
      multihost: run by the multi-process lesson (:data:`course_lib.distributed.MULTIHOST_STRATEGIES`).
      scaling: in the lab's scaling sweep (:func:`course_lib.lab.scaling_sweep`).
      model: one of :data:`MODELS`: which lab's model the strategy trains (and so its builder's signature:
        a ``transformer`` builder is ``(info, config, devices, *, n_micro, compiler_options) ->
        course_lib.lm_layouts.Built``).
      reduces_partial_sums: the compiler inserts the gradient all-reduce (sharded ``jit``), on the partial
        sums of the backward pass, in the dtype they are computed in: under ``bfloat16`` the partitioner asks
        for bfloat16 all-reduces, which XLA:CPU promotes to float32 and XLA:GPU keeps
        (``notebooks/08_lab.ipynb``, "the bfloat16 partial-sum pitfall"). False: the step reduces float32
        gradients itself (``pmap``, ``shard_map``: the cast to bfloat16 sits after the parameters are made
        to vary over ``data``, so the reduction, the transpose of that broadcast, sees float32).
    """

    key: str
    letter: str
    label: str
    marker: str
    mesh_kind: str
    builder: Callable[..., Strategy]
    layout: Callable[..., Any] | None = None
    comm_model: Callable[..., list] | None = None
    tp_layout: str | None = None
    lab: bool = False
    multihost: bool = False
    scaling: bool = False
    reduces_partial_sums: bool = False
    model: str = "cnn"

    def __post_init__(self):
        if self.mesh_kind not in MESH_KINDS:
            raise ValueError(
                f"mesh_kind={self.mesh_kind!r} of strategy {self.key!r} must be one of {MESH_KINDS}"
            )
        if self.model not in MODELS or (self.model == "transformer") != (
            self.mesh_kind == "layout"
        ):
            raise ValueError(
                f"model={self.model!r} of strategy {self.key!r} must be one of {MODELS}; a transformer "
                "strategy has mesh_kind 'layout', a CNN strategy one of the others"
            )

    def data_shards(self, n_devices: int, mesh_shape: tuple[int, int] | None = None) -> int:
        """How many pieces the global batch is split into on ``n_devices`` (or on a ``mesh_shape``)."""
        if self.mesh_kind == "single":
            return 1
        if self.mesh_kind == "data":
            return n_devices
        if self.mesh_kind == "layout":
            from . import lm_layouts

            sizes = lm_layouts.mesh_axes(self.key, n_devices)
            if sizes is None:
                raise ValueError(f"layout {self.key!r} does not fit {n_devices} devices")
            return math.prod(sizes[a] for a in lm_layouts.layout(self.key).batch_axes)
        return (mesh_shape or choose_mesh_shape(n_devices))[0]


def _tp_layout(specs_fn):
    return lambda params, n_devices, mesh_shape: specs_fn(params, MODEL)


def _lm(key: str, letter: str, builder) -> StrategyInfo:
    from .lm_layouts import LAYOUTS  # label and marker: the layout's own

    lay = LAYOUTS[key]
    return StrategyInfo(
        key, letter, f"{letter}: {lay.label}", lay.marker, "layout", builder, model="transformer"
    )


REGISTRY: dict[str, StrategyInfo] = {
    info.key: info
    for info in (
        StrategyInfo(
            "jit", "A", "A: jit, 1 device", "o", "single", builders.build_jit, lab=True,
        ),
        StrategyInfo(
            "pmap", "B", "B: pmap (data parallel)", "s", "data", builders.build_pmap,
            comm_model=comms.predict_data_parallel, lab=True, scaling=True,
        ),
        StrategyInfo(
            "shard_map", "C", "C: shard_map (data x model)", "^", "data_model",
            builders.build_tensor_parallel, layout=_tp_layout(parallel.tp_gather_param_specs),
            comm_model=comms.predict_tensor_parallel, tp_layout="gather", lab=True, multihost=True, scaling=True,
        ),
        StrategyInfo(
            "sharded_jit", "D", "D: sharded jit (data parallel)", "D", "data",
            builders.build_sharded_jit, comm_model=comms.predict_data_parallel,
            lab=True, multihost=True, scaling=True, reduces_partial_sums=True,
        ),
        StrategyInfo(
            "fsdp", "E", "E: FSDP, gathered once (ZeRO-2-like)", "P", "data", builders.build_fsdp,
            layout=lambda params, n, shape: parallel.fsdp_specs(params, n),
            comm_model=comms.predict_fsdp, lab=True,
        ),
        StrategyInfo(
            "shard_map_pairs", "C2", "C2: shard_map, lesson 06's pairs", "<", "data_model",
            builders.build_tensor_parallel_pairs, layout=_tp_layout(parallel.tp_param_specs),
            comm_model=comms.predict_tensor_parallel, tp_layout="pairs",
        ),
        StrategyInfo(
            "shard_map_article", "C'", "C': shard_map, article's split", "v", "data_model",
            builders.build_article, layout=_tp_layout(parallel.article_param_specs),
            comm_model=comms.predict_tensor_parallel, tp_layout="article",
        ),
        StrategyInfo(
            "fsdp_jit", "E'", "E': E's layout as sharded jit", "X", "data", builders.build_fsdp_jit,
            layout=lambda params, n, shape: parallel.fsdp_specs(params, n), reduces_partial_sums=True,
        ),
        # the transformer lab's layouts (notebooks/12_transformer_lab.ipynb): meshes that combine axes
        _lm("dp", "T1", builders.build_lm_dp),
        _lm("tp_sp", "T2", builders.build_lm_tp_sp),
        _lm("fsdp_tp", "T3", builders.build_lm_fsdp_tp),
        _lm("pp_dp", "T4", builders.build_lm_pp_dp),
        _lm("dp_cp", "T5", builders.build_lm_dp_cp),
        _lm("3d", "T6", builders.build_lm_3d),
        _lm("ep_dp", "T7", builders.build_lm_ep_dp),  # the MoE transformer (course_lib.lm_experts)
    )
}  # fmt: skip
"""Every strategy, in the lab's order; the one place a strategy is described."""

CNN_KEYS = tuple(k for k, info in REGISTRY.items() if info.model == "cnn")
"""The CNN lab's strategies (``notebooks/08_lab.ipynb``), in order."""
LAYOUT_KEYS = tuple(k for k, info in REGISTRY.items() if info.model == "transformer")
"""The transformer lab's layouts (``notebooks/12_transformer_lab.ipynb``), in order: the keys of
:data:`course_lib.lm_layouts.LAYOUTS`."""
STRATEGIES = tuple(k for k, info in REGISTRY.items() if info.lab)
"""Strategy keys of the lab's line-up, in order (A, B, C, D, E); the notebook adds the variants."""
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
    *,
    precision: str = "float32",
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
      precision: one of :data:`course_lib.precision.PRECISIONS`; ``"bfloat16"`` computes in bfloat16
        (:func:`course_lib.precision.compute_in`); the parameters' dtype is the caller's.

    Raises:
      ValueError: unknown key or precision, no devices, or a model axis that does not divide a split layer.
    """
    entry = _of_model(key, "cnn")
    devices = list(devices)
    if not devices:
        raise ValueError("no devices given; pass report.devices from setup_devices()")
    precision_lib.check(precision)
    return entry.builder(
        entry, graphdef, params, optimizer, devices, mesh_shape, precision=precision
    )


def _of_model(key: str, model: str) -> StrategyInfo:
    entry = info(key)
    if entry.model != model:
        other = "build_layout" if entry.model == "transformer" else "build"
        raise ValueError(
            f"strategy {key!r} trains the {entry.model}, not the {model}: build it with strategies.{other}"
        )
    return entry


def build_layout(
    key: str,
    config: Any,
    devices: Sequence[Any],
    *,
    n_micro: int = 2,
    compiler_options: dict | None = None,
):
    """Build transformer layout ``key`` on ``devices`` with the builder its :data:`REGISTRY` entry names.

    Args:
      key: a key of :data:`LAYOUT_KEYS` (``"dp"``, ``"tp_sp"``, ``"fsdp_tp"``, ``"pp_dp"``, ``"dp_cp"``,
        ``"3d"``, ``"ep_dp"``: the MoE transformer, placed with :func:`course_lib.lm_experts.init_params`).
      config: the transformer's shape (:class:`course_lib.transformer.TransformerConfig`).
      devices: the devices of the mesh; their number fixes its axes (:func:`course_lib.lm_layouts.mesh_axes`).
      n_micro: the pipeline's micro-batches per data shard (``pp_dp``).
      compiler_options: passed to ``jax.jit``.

    Returns:
      :class:`course_lib.lm_layouts.Built`: the jitted step, mesh and shardings.

    Raises:
      ValueError: an unknown key, a CNN strategy, no devices, or a device count the layout does not fit.
    """
    entry = _of_model(key, "transformer")
    devices = list(devices)
    if not devices:
        raise ValueError("no devices given; pass report.devices from setup_devices()")
    return entry.builder(entry, config, devices, n_micro=n_micro, compiler_options=compiler_options)


def predict_comm(
    key: str,
    model_config: Any,
    global_batch: int,
    n_devices: int,
    mesh_shape: tuple[int, int] | None = None,
    *,
    precision: str = "float32",
    platform: str = "cpu",
) -> list[comms.Transfer]:
    """The collectives strategy ``key`` should send per step, predicted from shapes (no compile).

    Args:
      key: a key of :data:`REGISTRY`.
      model_config: the CNN's shape (:class:`course_lib.model.CNNConfig`), or for a transformer layout the
        transformer's (:class:`course_lib.transformer.TransformerConfig`; then the bytes are
        :func:`course_lib.lm_costs.predict_bytes`').
      global_batch: images per step over all devices.
      n_devices: devices the strategy runs on.
      mesh_shape: ``(n_data, n_model)`` for the ``data_model`` strategies; default :func:`choose_mesh_shape`.
      precision: ``"float64"``: every value moves in 8 bytes. ``"bfloat16"``: activations move in bfloat16;
        gradients in float32, except where the compiler reduces the partial sums
        (:attr:`StrategyInfo.reduces_partial_sums`: sharded ``jit``), which sum bfloat16 on a GPU; the
        loss is float32 everywhere.
      platform: ``"cpu"``: XLA:CPU promotes bfloat16 collectives to float32 (``AllReducePromotion``), so
        they move 4 bytes per value; ``"gpu"``: XLA:GPU keeps bfloat16 (2 bytes).

    Returns:
      One :class:`course_lib.comms.Transfer` per collective; empty for a single device.

    Raises:
      ValueError: a strategy without a communication model (its collectives are the compiler's choice).
    """
    entry = info(key)
    if entry.model == "transformer":
        from . import lm_costs, lm_layouts

        itemsize = (
            8
            if precision == "float64"
            else (2 if precision == "bfloat16" and platform != "cpu" else 4)
        )
        sizes = lm_layouts.mesh_axes(key, n_devices)
        return lm_costs.predict_bytes(key, model_config, global_batch, sizes, itemsize=itemsize)
    if entry.mesh_kind == "single":
        return []
    if entry.comm_model is None:
        raise ValueError(
            f"strategy {key!r} has no communication model: its collectives are XLA's choice"
        )
    n = 1 if entry.mesh_kind == "single" else n_devices
    shape = (mesh_shape or choose_mesh_shape(n)) if entry.mesh_kind == "data_model" else (n, 1)
    shapes = comms.param_shapes(model_config)
    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes, is_leaf=_is_shape
    )
    if entry.layout is None:
        specs = jax.tree.map(lambda _: P(), abstract)
    else:
        specs = entry.layout(abstract, n, shape)
    value_bytes = 8 if precision == "float64" else 4
    bf16_moves = precision == "bfloat16" and platform != "cpu"  # XLA:CPU promotes bf16 collectives
    act_bytes = 2 if bf16_moves else value_bytes
    grad_bytes = 2 if bf16_moves and entry.reduces_partial_sums else value_bytes
    return entry.comm_model(
        shapes, specs, cfg=model_config, global_batch=global_batch, n_devices=n, mesh_shape=shape,
        act_bytes=act_bytes, grad_bytes=grad_bytes, loss_bytes=value_bytes, layout=entry.tp_layout,
    )  # fmt: skip


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


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

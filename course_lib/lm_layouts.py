"""The transformer's training step under meshes that combine axes — the layouts of ``12_transformer_lab``.

Each :class:`Layout` names a mesh (axis name → size, for a device count), how the parameters and the batch
are split over it, and where the activations are constrained. Except the pipeline (lesson 11's), every step
is written by hand in ``jax.shard_map`` (:mod:`course_lib.lm_steps`), every collective in the code;
``build(..., partitioner=True)`` gives the same step under sharded ``jax.jit`` on an *Auto* mesh, where the
partitioner inserts them (the lab's contrast). The layouts are entries of :data:`course_lib.strategies.REGISTRY`.

===========  ============================  ===================================================================
key          mesh (8 devices)              what is split
===========  ============================  ===================================================================
``dp``       data=8                        the batch; parameters replicated; gradients all-reduced over data
``tp_sp``    data=4 × model=2              Megatron TP (heads, MLP width over model) + sequence parallelism:
                                           the residual stream between sub-layers is split over the sequence
``fsdp_tp``  fsdp=4 × model=2              TP over model; every parameter also split over fsdp, which splits
                                           the batch too (gathered for use)
``pp_dp``    data=4 × stage=2              lesson 11's GPipe pipeline
                                           (:func:`course_lib.pipeline.transformer_grads`), batch over data
``dp_cp``    data=4 × context=2            the batch over data, the sequence over context (activations
                                           sequence-sharded; attention gathers the keys and values)
``3d``       data=2 × fsdp=2 × model=2     the three at once
``ep_dp``    data=4 × expert=2             a mixture-of-experts transformer (lesson 11's MoE MLP): the batch
                                           over both axes, the experts over expert, two ``all_to_all``
                                           per layer forward (:mod:`course_lib.lm_experts`)
===========  ============================  ===================================================================

The step is SGD with momentum returning the new parameters and momentum, the loss and the gradients, so
``memory_analysis()`` shows every kind; :mod:`course_lib.lm_costs` predicts each kind, each axis's bytes and
the step-time model (a model, not a measurement) of the lab's exercises.
Taught in ``notebooks/12_transformer_lab.ipynb``; tested in ``tests/test_lm_layouts.py``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import lm_steps, pipeline, schedules, transformer
from .meshes import CONTEXT, DATA, EXPERT, MODEL, STAGE, mesh_of

__all__ = [
    "FSDP",
    "Layout",
    "LAYOUTS",
    "DENSE_KEYS",
    "layout",
    "fixed_axes",
    "mesh_axes",
    "param_specs",
    "local_bytes",
    "Built",
    "build",
    "reference_step",
    "init_momentum",
]

FSDP = "fsdp"
"""Name of the fully-sharded data-parallel axis: it splits the batch, and every parameter; the step gathers
each parameter once and keeps it through the backward pass (PyTorch's ``SHARD_GRAD_OP``, ZeRO-2-like: it saves
memory at rest, not at the peak; :mod:`course_lib.lm_steps`)."""

LEARNING_RATE = 0.1
MOMENTUM = 0.9


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to lay the transformer's step out on a mesh.

    Attributes:
      key: the name used in tables (``"tp_sp"``).
      label: a readable name.
      marker: its matplotlib marker.
      sizes: axis name → size on 8 devices, in mesh order (the last axis varies fastest).
      batch_axes: the mesh axes that split the batch (its first dimension).
      seq_axis: the axis that splits the sequence of the tokens and of the residual stream, or None.
      model_axis: the tensor-parallel axis, or None.
      fsdp_axis: the axis every parameter is also split over, or None.
      stage_axis: the pipeline axis, or None.
      expert_axis: the axis the experts of a mixture-of-experts MLP are split over, or None (the layout
        then trains :mod:`course_lib.lm_experts`' MoE transformer, not the dense one).
    """

    key: str
    label: str
    marker: str
    sizes: tuple[tuple[str, int], ...]
    batch_axes: tuple[str, ...]
    seq_axis: str | None = None
    model_axis: str | None = None
    fsdp_axis: str | None = None
    stage_axis: str | None = None
    expert_axis: str | None = None

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh's axis names, in order."""
        return tuple(a for a, _ in self.sizes)


LAYOUTS: dict[str, Layout] = {
    lay.key: lay
    for lay in (
        Layout("dp", "data parallel (DP)", "o", ((DATA, 8),), (DATA,)),
        Layout("tp_sp", "data x model (TP+SP)", "^", ((DATA, 4), (MODEL, 2)), (DATA,),
               seq_axis=MODEL, model_axis=MODEL),
        Layout("fsdp_tp", "fsdp x model (FSDP+TP)", "P", ((FSDP, 4), (MODEL, 2)), (FSDP,),
               model_axis=MODEL, fsdp_axis=FSDP),
        Layout("pp_dp", "data x stage (DP+PP)", "s", ((DATA, 4), (STAGE, 2)), (DATA,), stage_axis=STAGE),
        Layout("dp_cp", "data x context (DP+CP)", "D", ((DATA, 4), (CONTEXT, 2)), (DATA,),
               seq_axis=CONTEXT),
        Layout("3d", "data x fsdp x model (3-D)", "X", ((DATA, 2), (FSDP, 2), (MODEL, 2)), (DATA, FSDP),
               model_axis=MODEL, fsdp_axis=FSDP),
        Layout("ep_dp", "data x expert (EP+DP, MoE)", "*", ((DATA, 4), (EXPERT, 2)), (DATA, EXPERT),
               expert_axis=EXPERT),
    )
}  # fmt: skip
"""Every layout of the lab, in its order."""

DENSE_KEYS = tuple(k for k, lay in LAYOUTS.items() if not lay.expert_axis)
"""The layouts of the dense transformer (all but ``ep_dp``, which trains the MoE transformer of
:mod:`course_lib.lm_experts`): the ones whose parameters, rankings and memory compare like for like."""


def layout(key: str) -> Layout:
    """The :class:`Layout` of ``key``.

    Raises:
      ValueError: an unknown key (the message lists them).
    """
    if key not in LAYOUTS:
        raise ValueError(f"unknown layout {key!r}; choose one of {list(LAYOUTS)}")
    return LAYOUTS[key]


def fixed_axes(key: str) -> dict[str, int]:
    """The layout's axes after the first: their sizes stay as on 8 devices at any count (the first axis takes
    what is left), so a device count must be a multiple of their product (:func:`mesh_axes`)."""
    return dict(layout(key).sizes[1:])


def mesh_axes(key: str, n_devices: int) -> dict[str, int] | None:
    """The layout's axis sizes on ``n_devices``: on 8 its :attr:`Layout.sizes`; on fewer, the first axis
    shrinks (``tp_sp`` on 4 devices: data=2 × model=2). None when the other axes do not fit (the lab skips
    the layout and says so): ``3d`` needs 4 devices (data=1 there), a 2-way axis needs 2.
    """
    sizes = dict(layout(key).sizes)
    first, rest = next(iter(sizes)), math.prod(fixed_axes(key).values())
    if n_devices % rest or n_devices < rest:
        return None
    sizes[first] = n_devices // rest
    return sizes


# ---- parameter layouts ------------------------------------------------------------------------------------

# tensor-parallel dimension of each block leaf (the leaf's own dims, after the layer axis): Megatron's split
_TP_DIM = {
    ("attn", "wq", "kernel"): 1,  # [D, H, Dh]: heads
    ("attn", "wk", "kernel"): 1,
    ("attn", "wv", "kernel"): 1,
    ("attn", "wo", "kernel"): 0,  # [H, Dh, D]: heads
    ("mlp", "w1", "kernel"): 1,  # [D, F]: F
    ("mlp", "w1", "bias"): 0,  # [F]
    ("mlp", "w2", "kernel"): 0,  # [F, D]: F
}


def _path(path) -> tuple[str, ...]:
    return tuple(getattr(k, "key", getattr(k, "name", str(k))) for k in path)


def param_specs(key: str, params: Any, sizes: dict[str, int]) -> Any:
    """``PartitionSpec`` of every parameter leaf under layout ``key`` with axis ``sizes``.

    ``params`` as :func:`course_lib.transformer.init_model` returns them (arrays or ``ShapeDtypeStruct``);
    for ``pp_dp`` the blocks :func:`course_lib.pipeline.chunked` to ``[1, L, …]``. The model axis splits the
    heads of ``wq``/``wk``/``wv``/``wo`` and the MLP width of ``w1``/``w2`` (and ``w1``'s bias); the fsdp axis
    then splits, in every leaf, the first dimension not already split that it divides (never a block's
    layer axis); a leaf it divides nowhere stays replicated over it. An expert layout (``ep_dp``, the MoE
    parameters of :func:`course_lib.lm_experts.init_params`): the experts' leaves of ``blocks.moe`` split
    on their expert dimension over the expert axis, the router and everything else replicated.
    """
    lay = layout(key)

    def one(path, leaf):
        names = _path(path)
        shape = leaf.shape
        spec: list = [None] * len(shape)
        if lay.stage_axis:
            return pipeline.stage_spec(lay.stage_axis) if names[0] == "blocks" else P()
        if lay.expert_axis:
            expert = names[:2] == ("blocks", "moe") and names[2] != "router"
            return P(None, lay.expert_axis) if expert else P()
        offset = 1 if names[0] == "blocks" else 0
        if lay.model_axis and names[0] == "blocks" and names[1:] in _TP_DIM:
            spec[offset + _TP_DIM[names[1:]]] = lay.model_axis
        if lay.fsdp_axis:
            n = sizes[lay.fsdp_axis]
            for d in range(offset, len(shape)):
                if spec[d] is None and shape[d] % n == 0:
                    spec[d] = lay.fsdp_axis
                    break
        return P(*spec)

    return jax.tree_util.tree_map_with_path(one, params)


def local_bytes(shape: Sequence[int], spec: P, sizes: dict[str, int], itemsize: int) -> int:
    """Bytes of one device's block of an array of ``shape`` split by ``spec`` over axes of ``sizes``."""
    count = 1
    for i, d in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        count *= d // math.prod(sizes[a] for a in axes)
    return count * itemsize


# ---- the step ----------------------------------------------------------------------------------------------


def init_momentum(params: Any) -> Any:
    """The optimizer state: one zero per parameter (momentum), the parameters' dtype."""
    return jax.tree.map(jnp.zeros_like, params)


def _update(params, velocity, grads):
    velocity = jax.tree.map(lambda v, g: MOMENTUM * v + g, velocity, grads)
    params = jax.tree.map(lambda w, v: w - LEARNING_RATE * v, params, velocity)
    return params, velocity


def _mean_ce(logits, targets):
    return pipeline.cross_entropy_sum(logits, targets) / targets.size


def _layer(blocks, i):
    return jax.tree.map(lambda a: a[i], blocks)


def _loss(params, tokens, targets, *, n_layers, eps, constrain=None, mid=None):
    """The transformer's mean cross-entropy, the layers unrolled (every collective outside any loop);
    ``constrain(x)`` pins the residual stream's layout, ``mid(h)`` a sub-layer's normalised input's."""
    c = constrain or (lambda x: x)
    m = mid or (lambda x: x)
    x = c(transformer.embed(params, tokens))
    for i in range(n_layers):
        p = _layer(params["blocks"], i)
        x = c(x + transformer.attention(m(transformer.layer_norm(x, p["ln1"], eps)), p["attn"]))
        x = c(x + transformer.mlp(m(transformer.layer_norm(x, p["ln2"], eps)), p["mlp"]))
    return _mean_ce(transformer.head(params, x, eps), targets)


def reference_step(config: transformer.TransformerConfig) -> Callable:
    """The one-device step ``(params, velocity, tokens, targets) -> (params, velocity, loss, grads)``
    (not jitted): the layouts' parity reference."""

    def step(params, velocity, tokens, targets):
        loss, grads = jax.value_and_grad(_loss)(
            params, tokens, targets, n_layers=config.n_layers, eps=config.ln_eps
        )
        return (*_update(params, velocity, grads), loss, grads)

    return step


@dataclasses.dataclass
class Built:
    """A layout's step on its mesh, ready to lower.

    Attributes:
      key: the layout's key.
      mesh: the ``jax.sharding.Mesh`` (Auto axes).
      sizes: its axis sizes.
      step: the jitted step ``(params, velocity, tokens, targets) -> (params, velocity, loss, grads)``.
      param_shardings: ``NamedSharding`` per parameter leaf (the momentum and the gradients share them).
      batch_sharding: the tokens' and targets' ``NamedSharding``.
      to_layout: ``params -> params`` in this layout's structure (``pp_dp`` chunks the blocks).
      from_layout: the inverse, to compare with the one-device parameters.
    """

    key: str
    mesh: Any
    sizes: dict[str, int]
    step: Callable
    param_shardings: Any
    batch_sharding: Any
    to_layout: Callable
    from_layout: Callable

    def place(self, params, velocity, tokens, targets):
        """Everything put on the mesh in this layout."""
        params, velocity = self.to_layout(params), self.to_layout(velocity)
        return (
            jax.device_put(params, self.param_shardings),
            jax.device_put(velocity, self.param_shardings),
            jax.device_put(tokens, self.batch_sharding),
            jax.device_put(targets, self.batch_sharding),
        )

    def lower(self, params, velocity, tokens, targets):
        """``self.step.lower`` on placed arguments (:meth:`place`)."""
        return self.step.lower(params, velocity, tokens, targets)


def _batch_spec(lay: Layout) -> P:
    first = lay.batch_axes[0] if len(lay.batch_axes) == 1 else lay.batch_axes
    return P(first, lay.seq_axis)


def _partitioner_grads(lay: Layout, mesh, config) -> Callable:
    """The step body's loss and gradients for sharded ``jit`` on the Auto ``mesh``: the residual stream's layout
    pinned by ``with_sharding_constraint``, the partitioner choosing the collectives."""
    batch = lay.batch_axes[0] if len(lay.batch_axes) == 1 else lay.batch_axes
    residual = NamedSharding(mesh, P(batch, lay.seq_axis, None))
    # sequence parallelism: a sub-layer's input is gathered over the sequence (model axis), its output
    # reduce-scattered back; context parallelism keeps the sequence split and gathers keys/values
    mid = NamedSharding(mesh, P(batch, None, None)) if lay.seq_axis == lay.model_axis else None

    def grads_of(params, tokens, targets):
        return jax.value_and_grad(_loss)(
            params, tokens, targets, n_layers=config.n_layers, eps=config.ln_eps,
            constrain=lambda x: jax.lax.with_sharding_constraint(x, residual),
            mid=None if mid is None else (lambda h: jax.lax.with_sharding_constraint(h, mid)),
        )  # fmt: skip

    return grads_of


def build(
    key: str,
    config: transformer.TransformerConfig,
    devices: Sequence[Any],
    *,
    n_micro: int = 2,
    compiler_options: dict | None = None,
    partitioner: bool = False,
) -> Built:
    """Layout ``key``'s step on ``devices`` (their number fixes the mesh, :func:`mesh_axes`).

    Args:
      key: a key of :data:`LAYOUTS`.
      config: the transformer's shape; its heads, MLP width and sequence must divide by the model/context
        axes, its layers by the stage axis.
      devices: the devices of the mesh.
      n_micro: micro-batches per data shard of the pipeline (``pp_dp``; GPipe).
      compiler_options: passed to ``jax.jit``.
      partitioner: False (the lab's layouts): the step written by hand in ``shard_map``
        (:func:`course_lib.lm_steps.grads_fn`), every collective in the code. True: the same step body under
        sharded ``jax.jit`` on the Auto mesh, the residual stream's layout pinned by
        ``with_sharding_constraint``: the partitioner picks the collectives (the lab's contrast). Not for
        ``pp_dp`` (always lesson 11's pipeline).

    An expert layout (``ep_dp``) is :func:`course_lib.lm_experts.build` (the MoE transformer; no
    partitioner variant, ``n_micro`` unused).

    Raises:
      ValueError: an unknown layout, or a device count it does not fit.
    """
    lay = layout(key)
    if lay.expert_axis:
        from . import lm_experts

        if partitioner:
            raise ValueError(f"layout {key!r} is written in shard_map only; pass partitioner=False")
        return lm_experts.build(config, devices, compiler_options=compiler_options)
    devices = list(devices)
    sizes = mesh_axes(key, len(devices))
    if sizes is None:
        raise ValueError(
            f"layout {key!r} needs a multiple of {math.prod(fixed_axes(key).values())} devices; "
            f"{len(devices)} given"
        )
    mesh = mesh_of(sizes, devices, axis_type="auto")
    batch_sharding = NamedSharding(mesh, _batch_spec(lay))
    abstract = jax.eval_shape(lambda: transformer.init_model(jax.random.key(0), config)[1])
    if lay.stage_axis:
        to_layout = lambda prm: {**prm, "blocks": pipeline.chunked(prm["blocks"], 1)}  # noqa: E731
        from_layout = lambda prm: {**prm, "blocks": pipeline.unchunked(prm["blocks"])}  # noqa: E731
        schedule = schedules.gpipe(sizes[lay.stage_axis], n_micro)
        grads_of = pipeline.transformer_grads(
            mesh, schedule, axis=lay.stage_axis, data_axis=DATA, eps=config.ln_eps, unroll=True
        )
    else:
        to_layout = from_layout = lambda prm: prm  # noqa: E731
    specs = param_specs(key, jax.eval_shape(to_layout, abstract), sizes)
    if not lay.stage_axis:
        grads_of = (
            _partitioner_grads(lay, mesh, config)
            if partitioner
            else lm_steps.grads_fn(lay, mesh, specs, config)
        )

    def step(params, velocity, tokens, targets):
        loss, grads = grads_of(params, tokens, targets)
        return (*_update(params, velocity, grads), loss, grads)

    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    repl = NamedSharding(mesh, P())
    jitted = jax.jit(
        step,
        in_shardings=(shardings, shardings, batch_sharding, batch_sharding),
        out_shardings=(shardings, shardings, repl, shardings),
        compiler_options=compiler_options,
    )
    return Built(key, mesh, sizes, jitted, shardings, batch_sharding, to_layout, from_layout)

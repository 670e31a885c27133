"""The transformer's training step under meshes that combine axes — the layouts of ``12_transformer_lab``.

Each :class:`Layout` names a mesh (axis name → size, for a device count), how the parameters are split
over it (``PartitionSpec`` per leaf), how the batch is split, and where the activations are constrained
(``jax.lax.with_sharding_constraint``). Except the pipeline, every layout is the same step body under
sharded ``jax.jit`` on an *Auto* mesh: the partitioner inserts the collectives ("computation follows
data", ``notebooks/05_sharding.ipynb``); :mod:`course_lib.comms` reads them back from the compiled program.

=========  ============================  =====================================================================
key        mesh (8 devices)              what is split
=========  ============================  =====================================================================
``dp``     data=8                        the batch; parameters replicated; gradients all-reduced over data
``tp_sp``  data=4 × model=2              Megatron TP (heads, MLP width over model) + sequence parallelism:
                                         the residual stream between sub-layers is split over the sequence
``fsdp_tp`` fsdp=4 × model=2             TP over model; every parameter also split over fsdp, which splits
                                         the batch too (gathered for use, gradients reduce-scattered)
``pp_dp``  data=4 × stage=2              lesson 11's GPipe pipeline (:func:`course_lib.pipeline.transformer_grads`)
                                         with the batch over data
``dp_cp``  data=4 × context=2            the batch over data, the sequence over context (activations
                                         sequence-sharded; attention gathers the keys and values)
``3d``     data=2 × fsdp=2 × model=2     the three at once
=========  ============================  =====================================================================

The step is SGD with momentum (one optimizer value per parameter), returning the new parameters, the
new momentum, the loss and the gradients: ``memory_analysis()`` then shows every kind — arguments =
parameters + optimizer state + batch, outputs = the same + gradients + loss — and :func:`predict_memory`
predicts each from the shapes. :func:`predict_bytes` predicts every collective's bytes per mesh axis;
:func:`rank_layouts` is the step-time model (a model, not a measurement) that the lab's exercises ask the
learner to predict. Taught in ``notebooks/12_transformer_lab.ipynb``; tested in ``tests/test_lm_layouts.py``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import costs, pipeline, schedules, transformer
from .meshes import CONTEXT, DATA, MODEL, STAGE, mesh_of

__all__ = [
    "FSDP",
    "Layout",
    "LAYOUTS",
    "layout",
    "mesh_axes",
    "param_specs",
    "Built",
    "build",
    "reference_step",
    "init_momentum",
    "predict_bytes",
    "predict_memory",
    "H200",
    "PROFILES",
    "step_time",
    "rank_layouts",
    "largest_layers",
    "splits",
    "by_kind",
    "plot_step_times",
    "plot_bytes",
]

FSDP = "fsdp"
"""Name of the fully-sharded data-parallel axis: it splits the batch, and every parameter (ZeRO-3-like)."""

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
    )
}  # fmt: skip
"""Every layout of the lab, in its order."""


def layout(key: str) -> Layout:
    """The :class:`Layout` of ``key``.

    Raises:
      ValueError: an unknown key (the message lists them).
    """
    if key not in LAYOUTS:
        raise ValueError(f"unknown layout {key!r}; choose one of {list(LAYOUTS)}")
    return LAYOUTS[key]


def mesh_axes(key: str, n_devices: int) -> dict[str, int] | None:
    """The layout's axis sizes on ``n_devices``: on 8 its :attr:`Layout.sizes`; on fewer, the first axis
    shrinks (``tp_sp`` on 4 devices: data=2 × model=2). None when the other axes do not fit (the lab skips
    the layout and says so): ``3d`` needs 4 devices (data=1 there), a 2-way axis needs 2.
    """
    sizes = dict(layout(key).sizes)
    first, rest = next(iter(sizes)), math.prod(list(sizes.values())[1:])
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
    layer axis); a leaf it divides nowhere stays replicated over it.
    """
    lay = layout(key)

    def one(path, leaf):
        names = _path(path)
        shape = leaf.shape
        spec: list = [None] * len(shape)
        if lay.stage_axis:
            return pipeline.stage_spec(lay.stage_axis) if names[0] == "blocks" else P()
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


def build(
    key: str,
    config: transformer.TransformerConfig,
    devices: Sequence[Any],
    *,
    n_micro: int = 2,
    compiler_options: dict | None = None,
) -> Built:
    """Layout ``key``'s step on ``devices`` (their number fixes the mesh, :func:`mesh_axes`).

    Args:
      key: a key of :data:`LAYOUTS`.
      config: the transformer's shape; its heads, MLP width and sequence must divide by the model/context
        axes, its layers by the stage axis.
      devices: the devices of the mesh.
      n_micro: micro-batches per data shard of the pipeline (``pp_dp``; GPipe).
      compiler_options: passed to ``jax.jit``.

    Raises:
      ValueError: an unknown layout, or a device count it does not fit.
    """
    lay = layout(key)
    devices = list(devices)
    sizes = mesh_axes(key, len(devices))
    if sizes is None:
        raise ValueError(
            f"layout {key!r} needs a multiple of {math.prod(list(dict(lay.sizes).values())[1:])} devices; "
            f"{len(devices)} given"
        )
    mesh = mesh_of(sizes, devices, axis_type="auto")
    eps, n_layers = config.ln_eps, config.n_layers
    batch_sharding = NamedSharding(mesh, _batch_spec(lay))
    abstract = jax.eval_shape(lambda: transformer.init_model(jax.random.key(0), config)[1])
    if lay.stage_axis:
        to_layout = lambda prm: {**prm, "blocks": pipeline.chunked(prm["blocks"], 1)}  # noqa: E731
        from_layout = lambda prm: {**prm, "blocks": pipeline.unchunked(prm["blocks"])}  # noqa: E731
        p = sizes[lay.stage_axis]
        grads_fn = pipeline.transformer_grads(
            mesh,
            schedules.gpipe(p, n_micro),
            axis=lay.stage_axis,
            data_axis=DATA,
            eps=eps,
            unroll=True,
        )

        def step(params, velocity, tokens, targets):
            loss, grads = grads_fn(params, tokens, targets)
            return (*_update(params, velocity, grads), loss, grads)

    else:
        to_layout = from_layout = lambda prm: prm  # noqa: E731
        batch = lay.batch_axes[0] if len(lay.batch_axes) == 1 else lay.batch_axes
        residual = NamedSharding(mesh, P(batch, lay.seq_axis, None))
        # sequence parallelism: a sub-layer's input is gathered over the sequence (model axis), its output
        # reduce-scattered back; context parallelism keeps the sequence split and gathers keys/values
        mid = NamedSharding(mesh, P(batch, None, None)) if lay.seq_axis == lay.model_axis else None

        def step(params, velocity, tokens, targets):
            loss, grads = jax.value_and_grad(_loss)(
                params, tokens, targets, n_layers=n_layers, eps=eps,
                constrain=lambda x: jax.lax.with_sharding_constraint(x, residual),
                mid=None if mid is None else (lambda h: jax.lax.with_sharding_constraint(h, mid)),
            )  # fmt: skip
            return (*_update(params, velocity, grads), loss, grads)

    specs = param_specs(key, jax.eval_shape(to_layout, abstract), sizes)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    repl = NamedSharding(mesh, P())
    jitted = jax.jit(
        step,
        in_shardings=(shardings, shardings, batch_sharding, batch_sharding),
        out_shardings=(shardings, shardings, repl, shardings),
        compiler_options=compiler_options,
    )
    return Built(key, mesh, sizes, jitted, shardings, batch_sharding, to_layout, from_layout)


# ---- bytes on the wire, predicted from shapes ---------------------------------------------------------------


def _shapes(config) -> dict:
    """The parameters' shapes as :func:`course_lib.transformer.init_model` makes them (no model built)."""
    d, h, k, f, v, s, n = (config.d_model, config.n_heads, config.d_head, config.d_ff, config.vocab,
                           config.seq_len, config.n_layers)  # fmt: skip
    ln = lambda *lead: {"bias": (*lead, d), "scale": (*lead, d)}  # noqa: E731
    return {
        "blocks": {
            "attn": {"wk": {"kernel": (n, d, h, k)}, "wo": {"kernel": (n, h, k, d)},
                     "wq": {"kernel": (n, d, h, k)}, "wv": {"kernel": (n, d, h, k)}},
            "ln1": ln(n), "ln2": ln(n),
            "mlp": {"w1": {"bias": (n, f), "kernel": (n, d, f)}, "w2": {"bias": (n, d), "kernel": (n, f, d)}},
        },
        "embed": {"embedding": (v, d)}, "ln_f": ln(), "pos": (s, d), "unembed": {"kernel": (d, v)},
    }  # fmt: skip


def _abstract_params(config, key: str):
    shapes = _shapes(config)
    if layout(key).stage_axis:
        shapes["blocks"] = jax.tree.map(lambda sh: (1, *sh), shapes["blocks"], is_leaf=_is_shape)
    return jax.tree.map(lambda sh: jax.ShapeDtypeStruct(sh, jnp.float32), shapes, is_leaf=_is_shape)


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def param_bytes(key: str, config, sizes: dict[str, int], itemsize: int = 4, where=None) -> int:
    """Bytes of one device's parameters under layout ``key`` (``where(path_names, spec)`` selects leaves)."""
    abstract = _abstract_params(config, key)
    specs = param_specs(key, abstract, sizes)
    total = 0
    for (path, leaf), spec in zip(
        jax.tree_util.tree_leaves_with_path(abstract),
        jax.tree.leaves(specs, is_leaf=_is_spec),
        strict=True,
    ):
        if where is None or where(_path(path), spec):
            total += local_bytes(leaf.shape, spec, sizes, itemsize)
    return total


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _t(kind, axis, n, size, what, times=1):
    one = transfer_of(kind, axis, n, size, what)
    return [one] * times


def transfer_of(kind: str, axis: str, n: int, size_bytes: float, what: str):
    """A predicted collective (:class:`course_lib.comms.Transfer`); a ``collective-permute`` sends ``S`` from
    ``(n-1)/n`` of the devices (a shift that stops at the last stage): its mean per device."""
    from . import comms

    if kind == "collective-permute":
        return comms.Transfer(kind, axis, n, int(size_bytes), size_bytes * (n - 1) / n, what)
    return comms.transfer(kind, axis, n, size_bytes, what)


def predict_bytes(
    key: str,
    config,
    global_batch: int,
    sizes: dict[str, int],
    *,
    itemsize: int = 4,
    n_micro: int = 2,
) -> list:
    """The collectives of one step of layout ``key``, from shapes — the textbook algorithm of each axis.

    Args:
      key: a key of :data:`LAYOUTS`.
      config: the transformer's shape.
      global_batch: sequences per step over all devices.
      sizes: the mesh's axis sizes (:func:`mesh_axes`).
      itemsize: bytes per value (4 float32, 8 float64, 2 bfloat16 on a GPU).
      n_micro: the pipeline's micro-batches per data shard (``pp_dp``).

    Returns:
      :class:`course_lib.comms.Transfer` per collective (:func:`course_lib.comms.sent_by_axis` sums them by
      axis). The model: DP all-reduces the gradients of the parameters each device holds, and the loss;
      FSDP all-gathers the parameters once and reduce-scatters the gradients; TP all-reduces each
      sub-layer's output forward and its input's gradient backward (4 per layer), TP+SP replaces each of
      those by an all-gather and a reduce-scatter of the sequence-split residual (8 per layer), and the
      gradients of the parameters that are not split over ``model`` are all-reduced over it; CP all-gathers
      the keys and values forward and reduce-scatters their gradients backward; PP (GPipe) sends one
      micro-batch activation per tick that a later tick reads, forward and backward, and all-reduces the
      embedding's and the head's gradients over the stages. For ``dp`` and ``pp_dp`` the compiled program
      sends exactly this; for the others the partitioner picks its own algorithm (the lab shows the
      difference, collective by collective).
    """
    lay = layout(key)
    s, d, n_layers = config.seq_len, config.d_model, config.n_layers
    n_batch = math.prod(sizes[a] for a in lay.batch_axes)
    b = global_batch // n_batch
    if lay.seq_axis and lay.seq_axis != lay.model_axis:
        n_batch_and_seq = n_batch * sizes[lay.seq_axis]
    else:
        n_batch_and_seq = n_batch
    act = b * s * d * itemsize  # a local batch's residual stream, whole sequence
    out: list = []
    if lay.stage_axis:
        p, n_d = sizes[lay.stage_axis], sizes[DATA]
        sends = 2 * (n_micro + p - 2)
        out += (
            _t("collective-permute", STAGE, p, act // n_micro, "a micro-batch's activation", sends)
            if p > 1
            else []
        )
        rest = param_bytes(key, config, sizes, itemsize, lambda names, spec: names[0] != "blocks")
        out += _t("all-reduce", STAGE, p, rest + itemsize, "embedding and head gradients (+ loss)")
        local = param_bytes(key, config, sizes, itemsize)
        out += _t("all-reduce", DATA, n_d, local + itemsize, "gradients (+ loss)")
        return [t for t in out if t.group_size > 1]
    local = param_bytes(key, config, sizes, itemsize)
    grad_axes = [
        a
        for a in (*lay.batch_axes, lay.seq_axis)
        if a and a != lay.model_axis and a != lay.fsdp_axis
    ]
    if lay.fsdp_axis:
        f = sizes[lay.fsdp_axis]
        gathered = local * f  # the parameters as the model axis splits them
        out += _t("all-gather", lay.fsdp_axis, f, gathered, "parameters gathered")
        out += _t("reduce-scatter", lay.fsdp_axis, f, gathered, "gradients reduce-scattered")
    if grad_axes:
        n_g = math.prod(sizes[a] for a in grad_axes)
        out += _t("all-reduce", ",".join(grad_axes), n_g, local + itemsize, "gradients (+ loss)")
    if lay.model_axis:
        m = sizes[lay.model_axis]
        if lay.seq_axis == lay.model_axis:
            out += _t(
                "all-gather", MODEL, m, act, "residual gathered over the sequence", 4 * n_layers
            )
            out += _t(
                "reduce-scatter", MODEL, m, act, "sub-layer output reduce-scattered", 4 * n_layers
            )
            repl = param_bytes(
                key, config, sizes, itemsize, lambda names, spec: MODEL not in tuple(spec)
            )
            out += _t("all-reduce", MODEL, m, repl, "gradients of parameters not split over model")
        else:
            out += _t(
                "all-reduce", MODEL, m, act, "sub-layer output / input gradient", 4 * n_layers
            )
    if lay.seq_axis and lay.seq_axis != lay.model_axis:
        c = sizes[lay.seq_axis]
        out += _t("all-gather", lay.seq_axis, c, act, "keys and values gathered", 2 * n_layers)
        out += _t("reduce-scatter", lay.seq_axis, c, act, "key and value gradients", 2 * n_layers)
    del n_batch_and_seq
    return [t for t in out if t.group_size > 1]


# ---- memory by kind -----------------------------------------------------------------------------------------


def activation_bytes(key: str, config, global_batch: int, sizes: dict[str, int], itemsize: int = 4,
                     n_micro: int = 2) -> int:  # fmt: skip
    """Bytes of the activations one device keeps for the backward pass — an estimate, per layer: the
    residual stream and the two LayerNorm outputs (split over the sequence axis, if any), q, k, v, the
    attention output and the MLP's two hidden values (split over the model axis), the scores and weights
    ``[b, H, S, S]`` (heads over model, queries over the sequence axis); the logits once. A pipeline stage
    holds its layers' values for all its micro-batches (GPipe)."""
    lay = layout(key)
    b = global_batch // math.prod(sizes[a] for a in lay.batch_axes)
    t = sizes[lay.model_axis] if lay.model_axis else 1
    c = sizes[lay.seq_axis] if lay.seq_axis else 1
    s, d, f, h = config.seq_len, config.d_model, config.d_ff, config.n_heads
    layers = config.n_layers // (sizes[lay.stage_axis] if lay.stage_axis else 1)
    per_layer = b * (s // c) * (3 * d + 4 * d // t + 2 * f // t) + 2 * b * (h // t) * (s // c) * s
    if (
        lay.seq_axis == lay.model_axis and lay.model_axis
    ):  # SP: the residual is split, the rest is whole-sequence
        per_layer = (
            b * (s // t) * 3 * d + b * s * (4 * d // t + 2 * f // t) + 2 * b * (h // t) * s * s
        )
    logits = b * (s // c) * config.vocab
    return int((layers * per_layer + logits) * itemsize)


def predict_memory(key: str, config, global_batch: int, sizes: dict[str, int], itemsize: int = 4,
                   n_micro: int = 2) -> dict[str, int]:  # fmt: skip
    """Bytes per device by kind: ``params``, ``optimizer`` (momentum: one value per parameter),
    ``gradients`` (laid out as the parameters), ``batch`` (tokens and targets, int32), ``activations``
    (:func:`activation_bytes`, an estimate), and what the compiled step's ``memory_analysis()`` reports
    exactly: ``arguments`` (params + optimizer + batch) and ``outputs`` (params + optimizer + gradients +
    the loss, + 8 bytes per output array on XLA:CPU: the output tuple's table of buffer pointers)."""
    lay = layout(key)
    prm = param_bytes(key, config, sizes, itemsize)
    n_leaves = len(jax.tree.leaves(_abstract_params(config, key)))
    b = global_batch // math.prod(sizes[a] for a in lay.batch_axes)
    c = sizes[lay.seq_axis] if lay.seq_axis else 1
    batch = 2 * b * (config.seq_len // c) * 4
    return {
        "params": prm,
        "optimizer": prm,
        "gradients": prm,
        "batch": batch,
        "activations": activation_bytes(key, config, global_batch, sizes, itemsize, n_micro),
        "arguments": 2 * prm + batch,
        "outputs": 3 * prm + itemsize + 8 * (3 * n_leaves + 1),
    }


# ---- a step-time model for GPUs (a model, not a measurement) ------------------------------------------------

H200 = costs.DeviceProfile(
    "H200 SXM 141GB, NVLink 4", costs._PEAK["H200"], 4.8e12, 450e9,
    "H200 datasheet: 4.8 TB/s HBM3e; NVLink 4: 900 GB/s (450 GB/s each way)",
)  # fmt: skip
PROFILES = {"H100": costs.DEVICE_PROFILES["H100"], "H200": H200}
"""The device profiles of the lab's step-time model (8 GPUs of one NVLink server)."""
MEMORY_BYTES = {"H100": 80e9, "H200": 141e9}
"""HBM per GPU (datasheets)."""


def step_time(key: str, config, global_batch: int, profile: costs.DeviceProfile, n_devices: int = 8, *,
              precision: str = "bfloat16", n_micro: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Layout ``key``'s step time on ``profile`` — a MODEL: the training FLOPs (3 × the forward's,
    :func:`course_lib.transformer.flops_per_token`) split over the devices at the peak rate, stretched by the
    pipeline's bubble ``(m + p - 1)/m``, plus per mesh axis the predicted bytes (:func:`predict_bytes`) at
    the link bandwidth and a fixed latency per collective; no overlap of compute and communication.

    Returns:
      ``{"layout", "sizes", "compute_s", "comm_s" (per axis), "step_s", "sent_bytes" (per device),
      "memory_bytes" (per device: parameters, optimizer, gradients, activations)}``.
    """
    from . import comms

    sizes = mesh_axes(key, n_devices)
    if sizes is None:
        raise ValueError(f"layout {key!r} does not fit {n_devices} devices")
    itemsize = 2 if precision == "bfloat16" else (8 if precision == "float64" else 4)
    lay = layout(key)
    m = n_micro or (4 * sizes[lay.stage_axis] if lay.stage_axis else 1)
    flops = 3 * transformer.flops_per_token(config) * global_batch * config.seq_len / n_devices
    peak = costs.rate(profile.peak, precision)
    compute = flops / peak
    if lay.stage_axis:
        compute *= (m + sizes[lay.stage_axis] - 1) / m
    transfers = predict_bytes(key, config, global_batch, sizes, itemsize=itemsize, n_micro=m)
    comm: dict[str, float] = {}
    for t in transfers:
        comm[t.axis] = (
            comm.get(t.axis, 0.0)
            + t.sent_bytes / profile.link_bytes_per_s
            + costs.COLLECTIVE_LATENCY_S
        )
    mem = predict_memory(key, config, global_batch, sizes, itemsize, m)
    memory = mem["params"] + mem["optimizer"] + mem["gradients"] + mem["activations"]
    return {
        "layout": key, "sizes": sizes, "compute_s": compute, "comm_s": comm,
        "step_s": compute + sum(comm.values()), "sent_bytes": comms.total_sent(transfers),
        "memory_bytes": memory,
    }  # fmt: skip


def rank_layouts(config, global_batch: int, profile: costs.DeviceProfile, n_devices: int = 8, *,
                 memory_limit: float | None = None, precision: str = "bfloat16") -> list[dict]:  # fmt: skip
    """Every layout that fits ``n_devices`` (and, given ``memory_limit``, whose predicted memory per device
    is at most it), fastest first by :func:`step_time` — the model's ranking, not a measurement. A layout
    whose batch or heads do not split is left out."""
    rows = []
    for key in LAYOUTS:
        sizes = mesh_axes(key, n_devices)
        if sizes is None or not splits(key, config, global_batch, sizes):
            continue
        row = step_time(key, config, global_batch, profile, n_devices, precision=precision)
        if memory_limit is None or row["memory_bytes"] <= memory_limit:
            rows.append(row)
    return sorted(rows, key=lambda r: r["step_s"])


def splits(key: str, config, global_batch: int, sizes: dict[str, int]) -> bool:
    """True when layout ``key`` on axes ``sizes`` splits the model and the batch evenly: the batch by its
    batch axes (and the pipeline's ``4 × stages`` micro-batches), heads and MLP width by ``model``, the
    sequence by its sequence axis, the layers by ``stage``."""
    lay = layout(key)
    n_batch = math.prod(sizes[a] for a in lay.batch_axes)
    m = 4 * sizes[lay.stage_axis] if lay.stage_axis else 1
    ok = global_batch % (n_batch * m) == 0
    if lay.model_axis:
        ok &= (
            config.n_heads % sizes[lay.model_axis] == 0 and config.d_ff % sizes[lay.model_axis] == 0
        )
    if lay.seq_axis:
        ok &= config.seq_len % sizes[lay.seq_axis] == 0
    if lay.stage_axis:
        ok &= config.n_layers % sizes[lay.stage_axis] == 0
    return bool(ok)


def largest_layers(key: str, config, global_batch: int, memory_limit: float, n_devices: int = 8, *,
                   precision: str = "bfloat16", max_layers: int = 4096) -> int:  # fmt: skip
    """The most layers (``config`` otherwise unchanged) whose predicted memory per device
    (:func:`step_time`'s ``memory_bytes``) is at most ``memory_limit``; 0 when not even one fits. For
    ``pp_dp`` the count is a multiple of the stage axis."""
    sizes = mesh_axes(key, n_devices)
    if sizes is None:
        raise ValueError(f"layout {key!r} does not fit {n_devices} devices")
    step = sizes.get(STAGE, 1)

    def fits(n):
        cfg = dataclasses.replace(config, n_layers=n * step)
        row = step_time(key, cfg, global_batch, PROFILES["H100"], n_devices, precision=precision)
        return row["memory_bytes"] <= memory_limit

    lo, hi = 0, max_layers // step  # fits(lo) (or lo == 0); the memory grows with the layers
    if fits(hi):
        return hi * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step


# ---- tables and the plot of the lab --------------------------------------------------------------------------


def by_kind(predicted: Sequence, measured: Sequence) -> list[dict]:
    """Predicted and measured collectives side by side, one row per (mesh axis, kind): how many and the
    bytes each device sends (:class:`course_lib.comms.Transfer` / :class:`course_lib.comms.Collective`)."""
    rows: dict[tuple[str, str], dict] = {}
    for source, items in (("predicted", predicted), ("measured", measured)):
        for t in items:
            row = rows.setdefault(
                (t.axis, t.kind),
                {"axis": t.axis, "kind": t.kind, "predicted_n": 0, "predicted_bytes": 0.0,
                 "measured_n": 0, "measured_bytes": 0.0},
            )  # fmt: skip
            row[f"{source}_n"] += 1
            row[f"{source}_bytes"] += t.sent_bytes
    return sorted(rows.values(), key=lambda r: (r["axis"], r["kind"]))


def plot_step_times(rows: Sequence[dict], ax=None, title: str = ""):
    """Stacked bars of a step-time model (:func:`step_time` rows): compute, then each mesh axis's
    communication; labelled as a model. Returns the axes."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7, 3))[1]
    axes = sorted({a for r in rows for a in r["comm_s"]})
    names = [r["layout"] for r in rows]
    bottom = np.zeros(len(rows))
    parts = [("compute", [r["compute_s"] for r in rows])]
    parts += [(f"comm: {a}", [r["comm_s"].get(a, 0.0) for r in rows]) for a in axes]
    for label, values in parts:
        values = np.asarray(values) * 1e3
        ax.bar(names, values, bottom=bottom, label=label)
        bottom += values
    ax.set_ylabel("ms per step (model)")
    ax.set_title(title or "step-time MODEL (not a measurement)")
    ax.legend(fontsize=7)
    return ax


def plot_bytes(rows: Sequence[dict], ax=None):
    """Bytes per device per step of each layout, predicted (hollow) beside measured from the compiled program
    (filled), from the lab's run (``rows``: ``{"layout", "predicted_bytes", "measured_bytes"}``)."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7, 3))[1]
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["predicted_bytes"] / 1e3 for r in rows], 0.4, label="predicted from shapes",
           fill=False, edgecolor="C0")  # fmt: skip
    ax.bar(
        x + 0.2,
        [r["measured_bytes"] / 1e3 for r in rows],
        0.4,
        label="compiled program",
        color="C1",
    )
    ax.set_xticks(x, [r["layout"] for r in rows])
    ax.set_ylabel("kB sent per device per step")
    ax.legend(fontsize=7)
    return ax

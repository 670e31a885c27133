"""Tensor parallelism and FSDP for the CNN inside ``shard_map``: parameter layouts and per-shard forwards.

Two Megatron-style layouts on the ``model`` axis (column-parallel = output-split, row-parallel =
input-split + ``psum``), so the model axis *splits* work instead of duplicating it:

=========  =========================================  ==============================================
layer      ``tp_gather_*`` (strategy C, the default)   ``tp_*`` (strategy ``shard_map_pairs``)
=========  =========================================  ==============================================
conv1      output-split, pooled output ``all_gather``  output-split
conv2      output-split                                input-split → ``psum`` of its output
conv3      input-split → ``psum`` of its output        output-split
dense1     output-split (its rows stay whole)          input-split → ``psum``
dense2     input-split → ``psum``                      replicated
=========  =========================================  ==============================================

Bytes over the model axis per step (``notebooks/08_lab.ipynb`` measures and predicts them): the pairs
layout all-reduces conv2's output — the largest activation any layout here all-reduces (conv1's output is
twice as large, and only its pooled quarter is gathered, by the gather layout) — in the forward pass, dense1's
output, and (backward) conv3's input gradient. The gather layout moves the pooled conv1 output (an
``all_gather`` forward, its transpose a reduce-scatter backward), conv3's output, dense2's output and
(backward) dense1's input gradient: about a third fewer bytes, and no layer computed twice. dense1's
rows split cleanly in the pairs layout because the CNN flattens channel-major
(:func:`course_lib.model.flatten_channel_major`). The source article split only conv1;
:func:`article_param_specs` / :func:`article_apply` reproduce it (everything after conv1 is computed on
every model shard).

FSDP shards every parameter over the ``data`` axis (:func:`fsdp_specs`) and gathers them for the forward
pass (:func:`gather_params`); under ``check_vma=True`` the transpose of that ``all_gather`` is a
reduce-scatter of the gradients, so the shared ``train_step`` needs no change. The gathered parameters
are all kept alive through the backward pass (its residuals hold them), so 1/n of the parameters is held at
rest, not at the peak: ZeRO-2-like, PyTorch's ``SHARD_GRAD_OP`` / ``fully_shard(reshard_after_forward=
False)``. ZeRO-3 frees each layer's parameters after use and gathers them again in the backward pass
(a per-layer gather under ``jax.checkpoint``: ``notebooks/10_transformers.ipynb``).
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from .meshes import DATA, MODEL
from .model import flatten_channel_major, max_pool


def conv(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """3×3 'SAME' convolution as ``nnx.Conv`` computes it.

    x [B, H, W, Cin], kernel [3, 3, Cin, Cout] (bias [Cout]) → [B, H, W, Cout].
    """
    y = lax.conv_general_dilated(
        x, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return y if bias is None else y + bias


def tp_param_specs(params: Any, model_axis: str = MODEL) -> dict:
    """PartitionSpecs of the tensor-parallel layout (table in the module docstring), same tree as ``params``."""
    m = model_axis
    return {
        "conv1": {"kernel": P(None, None, None, m), "bias": P(m)},
        "conv2": {"kernel": P(None, None, m, None), "bias": P()},
        "conv3": {"kernel": P(None, None, None, m), "bias": P(m)},
        "dense1": {"kernel": P(m, None), "bias": P()},
        "dense2": {"kernel": P(), "bias": P()},
    }


def tp_apply(params: Any, images: jax.Array, model_axis: str = MODEL) -> jax.Array:
    """Per-shard forward of the tensor-parallel CNN; call inside ``shard_map`` over a mesh with ``model_axis``.

    Args:
      params: this shard's parameters, laid out by :func:`tp_param_specs`.
      images: float32 [b, H, W, 3], this data shard's images (replicated over the model axis).
      model_axis: the mesh axis the features are split over.

    Returns:
      float32 logits [b, num_classes], identical on every model shard (after the last ``psum``).
    """
    p = params
    x = jax.nn.relu(conv(images, p["conv1"]["kernel"], p["conv1"]["bias"]))  # [b, H, W, c1/m]
    x = max_pool(x)
    x = (
        lax.psum(conv(x, p["conv2"]["kernel"]), model_axis) + p["conv2"]["bias"]
    )  # [b, H/2, W/2, c2]
    x = max_pool(jax.nn.relu(x))
    x = jax.nn.relu(conv(x, p["conv3"]["kernel"], p["conv3"]["bias"]))  # [b, H/4, W/4, c3/m]
    x = flatten_channel_major(max_pool(x))  # [b, c3/m · H/8 · W/8]
    x = lax.psum(x @ p["dense1"]["kernel"], model_axis) + p["dense1"]["bias"]  # [b, hidden]
    x = jax.nn.relu(x)
    return x @ p["dense2"]["kernel"] + p["dense2"]["bias"]  # [b, num_classes]


def tp_gather_param_specs(params: Any, model_axis: str = MODEL) -> dict:
    """PartitionSpecs of the gather layout (strategy C; table in the module docstring), same tree as ``params``."""
    m = model_axis
    return {
        "conv1": {"kernel": P(None, None, None, m), "bias": P(m)},
        "conv2": {"kernel": P(None, None, None, m), "bias": P(m)},
        "conv3": {"kernel": P(None, None, m, None), "bias": P()},
        "dense1": {"kernel": P(None, m), "bias": P(m)},
        "dense2": {"kernel": P(m, None), "bias": P()},
    }


def tp_gather_apply(params: Any, images: jax.Array, model_axis: str = MODEL) -> jax.Array:
    """Per-shard forward of the gather layout; call inside ``shard_map`` over a mesh with ``model_axis``.

    Args:
      params: this shard's parameters, laid out by :func:`tp_gather_param_specs`.
      images: float32 [b, H, W, 3], this data shard's images (replicated over the model axis).
      model_axis: the mesh axis the features are split over.

    Returns:
      float32 logits [b, num_classes], identical on every model shard (after the last ``psum``).
    """
    p = params
    x = max_pool(jax.nn.relu(conv(images, p["conv1"]["kernel"], p["conv1"]["bias"])))
    # x: [b, H/2, W/2, c1/m]; gathered: [b, H/2, W/2, c1] (its transpose: a reduce-scatter)
    x = lax.all_gather(x, model_axis, axis=3, tiled=True)
    x = max_pool(
        jax.nn.relu(conv(x, p["conv2"]["kernel"], p["conv2"]["bias"]))
    )  # [b, H/4, W/4, c2/m]
    x = (
        lax.psum(conv(x, p["conv3"]["kernel"]), model_axis) + p["conv3"]["bias"]
    )  # [b, H/4, W/4, c3]
    x = flatten_channel_major(max_pool(jax.nn.relu(x)))  # [b, c3 · H/8 · W/8]: dense1's rows whole
    x = jax.nn.relu(x @ p["dense1"]["kernel"] + p["dense1"]["bias"])  # [b, hidden/m]
    return lax.psum(x @ p["dense2"]["kernel"], model_axis) + p["dense2"]["bias"]  # [b, classes]


def fsdp_dim(shape: tuple[int, ...], n: int) -> int | None:
    """The dimension FSDP shards a leaf of ``shape`` along: the largest one divisible by ``n`` (the last such
    one on a tie), or None when none is (the leaf stays replicated). ``n = 1`` shards nothing."""
    best = None
    for i, d in enumerate(shape):
        if n > 1 and d % n == 0 and (best is None or d >= shape[best]):
            best = i
    return best


def fsdp_specs(params: Any, n_data: int, data_axis: str = DATA) -> Any:
    """FSDP PartitionSpecs: each leaf split along :func:`fsdp_dim` over ``data_axis``, else ``P()``.

    Example, the cpu profile on 8 devices: conv kernels ``P(None, None, None, 'data')`` (output channels),
    dense1's kernel ``P('data', None)`` (its 1024 rows), dense2's bias (10 values) replicated.
    """

    def spec(x):
        d = fsdp_dim(tuple(x.shape), n_data)
        return (
            P() if d is None else P(*[data_axis if i == d else None for i in range(len(x.shape))])
        )

    return jax.tree.map(spec, params)


def gather_params(params: Any, param_specs: Any, data_axis: str = DATA) -> Any:
    """Inside ``shard_map``: ``lax.all_gather`` (tiled) every leaf that ``param_specs`` splits over
    ``data_axis``, giving every device the full parameters; replicated leaves pass through.

    Under ``check_vma=True`` the gathered values vary over the axis, and differentiating through the gather
    gives each device the reduce-scatter of the gradients: its own slice of their sum.
    """

    def gather(x, spec):
        axes = tuple(spec)
        if data_axis not in axes:
            return x
        return lax.all_gather(x, data_axis, axis=axes.index(data_axis), tiled=True)

    return jax.tree.map(gather, params, param_specs, is_leaf=_is_spec)


def article_param_specs(params: Any, model_axis: str = MODEL) -> dict:
    """The source article's layout: only conv1's kernel (and bias) split over output features; the rest replicated."""
    specs = jax.tree.map(lambda _: P(), params)
    specs["conv1"] = {"kernel": P(None, None, None, model_axis), "bias": P(model_axis)}
    return specs


def article_apply(params: Any, images: jax.Array, model_axis: str = MODEL) -> jax.Array:
    """Per-shard forward of the article's variant: conv1 output-split, then ``all_gather`` and full replicated work."""
    p = params
    x = jax.nn.relu(conv(images, p["conv1"]["kernel"], p["conv1"]["bias"]))  # [b, H, W, c1/m]
    x = lax.all_gather(
        x, model_axis, axis=3, tiled=True, to="invarying"
    )  # [b, H, W, c1]: every model shard gets all channels
    x = max_pool(x)
    for name in ("conv2", "conv3"):
        x = max_pool(jax.nn.relu(conv(x, p[name]["kernel"], p[name]["bias"])))
    x = flatten_channel_major(x)
    x = jax.nn.relu(x @ p["dense1"]["kernel"] + p["dense1"]["bias"])
    return x @ p["dense2"]["kernel"] + p["dense2"]["bias"]


def specs_like(tree: Any, params: Any, param_specs: Any) -> Any:
    """PartitionSpecs for any pytree that holds parameter-shaped leaves (e.g. an optax state).

    A leaf whose path ends in a parameter's path (``…/conv1/kernel``) and has that parameter's shape gets
    that parameter's spec; every other leaf (counts, empty states) is replicated, ``P()``.
    """
    flat_params = {
        tuple(str(k) for k in path): (leaf.shape, spec)
        for (path, leaf), spec in zip(
            jax.tree_util.tree_leaves_with_path(params),
            jax.tree.leaves(param_specs, is_leaf=_is_spec),
            strict=True,
        )
    }

    def pick(path, leaf):
        keys = tuple(str(k) for k in path)
        for ppath, (shape, spec) in flat_params.items():
            if keys[-len(ppath) :] == ppath and getattr(leaf, "shape", None) == shape:
                return spec
        return P()

    return jax.tree_util.tree_map_with_path(pick, tree)


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def check_model_split(params: Any, param_specs: Any, n_model: int) -> None:
    """Raise a ValueError naming the layer when a split dimension is not divisible by ``n_model``."""
    for (path, leaf), spec in zip(
        jax.tree_util.tree_leaves_with_path(params),
        jax.tree.leaves(param_specs, is_leaf=_is_spec),
        strict=True,
    ):
        for dim, axis in zip(
            leaf.shape, tuple(spec), strict=False
        ):  # a spec may be shorter than the shape
            if axis is not None and dim % n_model:
                name = "/".join(str(getattr(k, "key", k)) for k in path)
                raise ValueError(
                    f"{name} has {dim} features along the split dimension, not divisible by a model axis of "
                    f"{n_model}; use a model axis that divides it, or channels that are multiples of {n_model}"
                )


def shard_shapes(tree: Any) -> Any:
    """The per-device shard shape of every array leaf (first addressable shard), e.g. for a notebook table."""
    return jax.tree.map(lambda x: x.addressable_shards[0].data.shape, tree)


def bytes_per_device(tree: Any) -> int:
    """Bytes that one device (the first) holds of a placed pytree: the sum of its shards' sizes."""
    first = None
    total = 0
    for x in jax.tree.leaves(tree):
        shards = x.addressable_shards
        if first is None:
            first = shards[0].device
        total += sum(s.data.nbytes for s in shards if s.device == first)
    return total

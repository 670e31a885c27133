"""Numerical precision of a lab run: ``float32`` (default), ``float64`` or ``bfloat16`` mixed precision.

- ``float64``: parameters, optimizer state, images and every computation in float64 (``jax_enable_x64``).
  Every strategy then equals single-device ``jit`` at every step within 1e-10 relative (the lab asserts
  it and prints the largest difference): the evidence that the parallel programs compute the same
  mathematics (``notebooks/08_lab.ipynb``, "Parity").
- ``float32``: everything in float32; XLA chooses how float32 matmuls and convolutions are computed unless
  ``jax_default_matmul_precision`` says otherwise (TF32 on recent NVIDIA GPUs by default; no effect on CPU),
  so results record :func:`matmul_precision`.
- ``bfloat16``: the usual mixed-precision recipe — bfloat16 activations and conv/matmul inputs, float32
  parameters (master weights), optimizer state and loss (:func:`compute_in`). The gradients the update
  reads are float32. *Where they are summed over devices, and in which dtype*, depends on the strategy and
  the platform (``notebooks/08_lab.ipynb``, "the bfloat16 partial-sum pitfall"):

  ==========================  ==========================================  ========================
  strategy                    the gradient all-reduce sums                bytes per value moved
  ==========================  ==========================================  ========================
  ``pmap`` (B)                float32: the cast's transpose runs on each   4
                              device before ``pmean``
  ``shard_map`` (C, E)        float32, when the parameters are made to     4
                              vary over ``data`` before the cast (below)
  sharded ``jit`` (D, E′)     bfloat16 partial sums: the partitioner       XLA:GPU 2; XLA:CPU 4
                              all-reduces the backward pass's bf16         (``AllReducePromotion``
                              results, then casts them to float32          sums them in float32)
  ==========================  ==========================================  ========================

Where the bfloat16 cast sits matters inside ``shard_map`` (``check_vma=True``): a replicated parameter is
implicitly broadcast (``pvary``) where it meets data that varies over the ``data`` axis, and the transpose of
that broadcast is the gradient's all-reduce. Cast first, and that all-reduce sums bfloat16 gradients; make
the parameters vary over ``data`` first (``lax.pcast(p, "data", to="varying")``), then cast, and it sums
float32 gradients (the cast's transpose comes before it). :func:`compute_in` does the latter when given the
data axis. Sharded ``jit`` has no such choice in the step body: the partitioner places the all-reduce after
the backward convolution or matmul that produced the partial sum, in that op's dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

PRECISIONS = ("float32", "float64", "bfloat16")
"""The lab's ``precision`` parameter values."""

PARAM_DTYPES = {"float32": jnp.float32, "float64": jnp.float64, "bfloat16": jnp.float32}
"""dtype of parameters, gradients and optimizer state per precision (bfloat16 keeps float32 master weights)."""

COMPUTE_DTYPES = {"float32": None, "float64": None, "bfloat16": jnp.bfloat16}
"""dtype activations and conv/matmul inputs are cast to (None: the parameters' dtype)."""


def check(precision: str) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`; else a ValueError naming it and the choices."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {list(PRECISIONS)}")
    return precision


@contextlib.contextmanager
def enabled(precision: str) -> Iterator[None]:
    """Context in which ``precision``'s arrays can be made: ``jax.enable_x64(True)`` for float64, else
    nothing. Arrays made inside stay float64 outside; computations on them should run inside too."""
    if check(precision) == "float64":
        with jax.enable_x64(True):
            yield
    else:
        yield


def cast_params(tree: Any, precision: str) -> Any:
    """Every floating leaf of ``tree`` (parameters, optimizer state) in :data:`PARAM_DTYPES` [precision].

    Call inside :func:`enabled` for float64 (outside it, JAX would make float32 arrays again).
    """
    dtype = PARAM_DTYPES[check(precision)]

    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x

    return jax.tree.map(cast, tree)


def cast_batch(batch: tuple[jax.Array, jax.Array], precision: str) -> tuple[jax.Array, jax.Array]:
    """``(images, labels)`` with the images in the parameters' dtype (labels stay int32); keeps the sharding."""
    images, labels = batch
    return images.astype(PARAM_DTYPES[check(precision)]), labels


def compute_in(
    apply_fn: Callable[..., jax.Array], precision: str, vary_over: str | None = None
) -> Callable[..., jax.Array]:
    """``apply_fn(params, images, **kw)`` computed in :data:`COMPUTE_DTYPES` [precision], logits float32.

    For ``bfloat16``: parameters and images are cast to bfloat16 at the call, so every conv and matmul takes
    bfloat16 inputs and its activations are bfloat16; the logits are cast back to float32 for the loss, and
    the gradients flow back to the float32 parameters. Other precisions return ``apply_fn`` unchanged.

    Args:
      apply_fn: ``(params, images, **kw) -> logits``.
      precision: one of :data:`PRECISIONS`.
      vary_over: inside ``shard_map``, the data axis: parameters are made varying over it *before* the cast,
        so the gradients are summed over it in float32 (see the module docstring).
    """
    dtype = COMPUTE_DTYPES[check(precision)]
    if dtype is None:
        return apply_fn

    def mixed(params, images, **kw):
        if vary_over is not None:
            params = jax.tree.map(lambda p: _vary(p, vary_over), params)
        params, images = jax.tree.map(lambda x: x.astype(dtype), (params, images))
        return apply_fn(params, images, **kw).astype(jnp.float32)

    return mixed


def _vary(x: jax.Array, axis: str) -> jax.Array:
    try:
        return lax.pcast(x, axis, to="varying")
    except (
        ValueError
    ):  # already varying over the axis (a sharded or gathered parameter): nothing to do
        return x


def matmul_precision() -> str:
    """``jax_default_matmul_precision`` as results record it: its value, or ``"default"`` when unset."""
    return jax.config.jax_default_matmul_precision or "default"

"""Grouped-query and multi-query attention (GQA, MQA) under tensor parallelism.

GQA gives ``H`` query heads only ``H_kv`` key/value heads: query head ``h`` reads key/value head
``h // (H / H_kv)`` (MQA is ``H_kv = 1``). Tensor parallelism splits the ``H`` query heads over ``n``
devices, ``H/n`` each. With ``n ≤ H_kv`` the key/value heads split the same way (``H_kv/n`` a device);
with ``n > H_kv`` there are not enough of them to go round, and each device holds the **one** key/value
head its query heads read, so every key/value head is replicated on ``n/H_kv`` devices (the layout of
vLLM's ``QKVParallelLinear``; Megatron-Core instead raises unless ``n`` divides ``H_kv``).
:func:`tp_kv_heads` lays out ``wk``/``wv`` that way, :func:`kv_weight_bytes` predicts what a device
holds, :func:`gqa_attention` is the single-device reference and :func:`tp_gqa_attention` the per-device
body for ``shard_map``.

Taught in: notebook 10 (section 1, "Fewer key/value heads than devices").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from course_lib import transformer

__all__ = ["check_layout", "gqa_attention", "kv_weight_bytes", "tp_gqa_attention", "tp_kv_heads"]


def check_layout(n_heads: int, n_kv_heads: int, n: int) -> None:
    """Raise ``ValueError`` unless ``n_heads`` query heads and ``n_kv_heads`` key/value heads split over
    ``n`` devices: ``n_kv_heads`` divides ``n_heads``, ``n`` divides ``n_heads``, and ``n`` divides
    ``n_kv_heads`` or ``n_kv_heads`` divides ``n``."""
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(
            f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}: pick a divisor of it"
        )
    if n < 1 or n_heads % n:
        raise ValueError(f"n={n} devices must divide n_heads={n_heads}: pick a divisor of it")
    if n_kv_heads % n and n % n_kv_heads:
        raise ValueError(
            f"n={n} devices and n_kv_heads={n_kv_heads}: one must divide the other (each device holds "
            f"n_kv_heads/n heads, or one head shared by n/n_kv_heads devices)"
        )


def tp_kv_heads(w: jax.Array, n: int) -> jax.Array:
    """``wk`` or ``wv`` ``[D, H_kv, Dh]`` laid out for ``n`` devices along its head axis: unchanged when
    ``n ≤ H_kv``; with ``n > H_kv`` each head repeated ``n/H_kv`` times (``[D, n, Dh]``), so that splitting
    the head axis over ``n`` devices gives each the one head its query heads read. Same dtype.

    Raises:
      ValueError: when ``n`` and ``H_kv`` do not divide one another.
    """
    h_kv = w.shape[1]
    if h_kv % n and n % h_kv:
        raise ValueError(
            f"n={n} and the {h_kv} key/value heads of w {w.shape}: one must divide the other"
        )
    return jnp.repeat(w, max(1, n // h_kv), axis=1)


def kv_weight_bytes(d_model: int, n_kv_heads: int, d_head: int, n: int, itemsize: int) -> int:
    """Bytes of ``wk`` and ``wv`` kernels one device holds under :func:`tp_kv_heads`:
    ``2·D·max(H_kv/n, 1)·Dh·itemsize`` (``n_kv_heads = n_heads`` gives multi-head attention's
    ``2·D·(H/n)·Dh``). ``itemsize`` in bytes (8 for float64)."""
    per_device = max(n_kv_heads // n, 1)
    return 2 * d_model * per_device * d_head * itemsize


def _attend(x: jax.Array, p: dict) -> jax.Array:
    """x ``[B, S, D]``; p's kernels wq ``[D, Hq, Dh]``, wk/wv ``[D, Hk, Dh]`` (Hk divides Hq), wo
    ``[Hq, Dh, D]`` → ``[B, S, D]``, each key/value head read by ``Hq/Hk`` query heads in a row."""
    q = jnp.einsum("bsd,dhe->bshe", x, p["wq"])
    k, v = (jnp.einsum("bsd,dhe->bshe", x, p[w]) for w in ("wk", "wv"))
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    return jnp.einsum("bshe,hed->bsd", transformer.causal_attention(q, k, v), p["wo"])


def gqa_attention(x: jax.Array, p: dict) -> jax.Array:
    """Causal grouped-query attention on one device (no biases).

    Args:
      x: ``[B, S, D]`` activations, any float dtype.
      p: ``{"wq": [D, H, Dh], "wk": [D, H_kv, Dh], "wv": [D, H_kv, Dh], "wo": [H, Dh, D]}``.

    Returns:
      ``[B, S, D]``, x's dtype.

    Raises:
      ValueError: when ``H_kv`` does not divide ``H``.
    """
    check_layout(p["wq"].shape[1], p["wk"].shape[1], 1)
    return _attend(x, p)


def tp_gqa_attention(x: jax.Array, p: dict, axis: str) -> jax.Array:
    """The tensor-parallel body of :func:`gqa_attention` for ``shard_map``: ``x`` ``[B, S, D]`` replicated;
    ``p`` this device's ``H/n`` query heads of wq and wo and its key/value heads of :func:`tp_kv_heads`'s
    layout; one ``psum`` over ``axis`` adds the partial outputs (Megatron's *g*; *f* written as a
    ``pcast``). Returns ``[B, S, D]``, replicated."""
    x = lax.pcast(x, axis, to="varying")
    return lax.psum(_attend(x, p), axis)

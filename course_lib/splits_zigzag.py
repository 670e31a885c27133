"""Ring attention on a sequence laid out in any order over the ring, and the zig-zag layout that balances
its causal work (``notebooks/10_transformers.ipynb``, section 3).

:func:`course_lib.splits.ring_attention` gives device ``r`` the contiguous block ``r`` of the sequence, so
under the causal mask device ``r`` sees ``r + 1`` of the ``n`` key blocks: the last device has ``n`` times
the first one's unmasked work. The **zig-zag** layout (ring-flash-attention; Llama 3's context
parallelism) cuts the sequence into ``2n`` chunks and gives device ``r`` chunks ``r`` and ``2n − 1 − r``:
every device then holds an early and a late chunk, and the unmasked scores are the same on every device.

- :func:`contiguous_order`, :func:`zigzag_order`: the global positions in the order a layout stores them
  (device ``r`` holds entries ``r·S/n … (r+1)·S/n − 1``).
- :func:`ring_attention_at`: ring attention whose causal mask reads each token's global position,
  passed round the ring with its K and V (so any layout works).
- :func:`block_masks`, :func:`visible_blocks`, :func:`visible_scores`, :func:`visible_chunks`: the causal
  mask each device applies at each step of the ring, and what is unmasked in it, counted from the masks;
  :func:`layout_counts`: the three counts of one layout at once.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "contiguous_order",
    "zigzag_order",
    "ring_attention_at",
    "block_masks",
    "visible_blocks",
    "visible_scores",
    "visible_chunks",
    "layout_counts",
]


def _check(s: int, n: int, parts: int) -> None:
    if n < 1 or s % parts:
        raise ValueError(
            f"a sequence of {s} positions on {n} device(s) must split into {parts} equal parts; "
            f"pick a sequence length divisible by {parts} or another device count"
        )


def contiguous_order(s: int, n: int) -> np.ndarray:
    """Positions 0 … S−1 in order, int64 [S]: device ``r`` holds block ``r`` (``S/n`` positions).

    Raises:
      ValueError: ``s`` not divisible by ``n``.
    """
    _check(s, n, n)
    return np.arange(s)


def zigzag_order(s: int, n: int) -> np.ndarray:
    """The zig-zag layout's order, int64 [S]: ``2n`` chunks of ``S/2n`` positions, device ``r`` holding
    chunk ``r`` then chunk ``2n − 1 − r``. ``x[:, order]`` lays a [B, S, …] array out for ``P(None, axis)``;
    ``y[:, np.argsort(order)]`` puts the result back in sequence order.

    Raises:
      ValueError: ``s`` not divisible by ``2n``.
    """
    _check(s, n, 2 * n)
    chunks = np.arange(s).reshape(2 * n, s // (2 * n))
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * n - 1 - r]]) for r in range(n)])


def ring_attention_at(
    q: jax.Array, k: jax.Array, v: jax.Array, pos: jax.Array, axis: str
) -> jax.Array:
    """Causal attention with the sequence split over ``axis`` in any order: q/k/v [B, S/n, H, Dh] this
    device's tokens, ``pos`` [S/n] int32 their global positions → [B, S/n, H, Dh].

    The ring of :func:`course_lib.splits.ring_attention` (``n − 1`` ``ppermute`` steps in a
    ``lax.fori_loop``, an online softmax), with the key positions travelling beside K and V (``4·S/n``
    bytes a step), so the mask ``query position >= key position`` holds for any layout
    (:func:`zigzag_order`, :func:`contiguous_order`). Equal to
    :func:`course_lib.transformer.causal_attention` on the sequence in order (float64: to 1e-10).
    This ring is lesson 10's exercise 3 with positions: the student package runs :func:`_gathered_at`
    instead (the same values from K, V and positions gathered whole; :data:`course_lib.held.REPLACED`).
    """
    # BEGIN SOLUTION  # STUB: return _gathered_at(q, k, v, pos, axis)
    n = lax.axis_size(axis)
    scale = 1.0 / math.sqrt(q.shape[-1])
    ring = [(i, (i + 1) % n) for i in range(n)]
    qi = pos[:, None]

    def fold(k, v, kpos, m, denom, o):
        s = jnp.einsum("bqhk,bthk->bhqt", q, k) * scale
        s = jnp.where(qi >= kpos[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        w = jnp.exp(s - safe[..., None])
        corr = jnp.exp(jnp.where(jnp.isfinite(m), m - safe, -jnp.inf))
        denom = denom * corr + w.sum(-1)
        return m_new, denom, o * corr[..., None] + jnp.einsum("bhqt,bthk->bhqk", w, v)

    def step(_, carry):
        k, v, kpos = lax.ppermute(carry[:3], axis, ring)
        return (k, v, kpos, *fold(k, v, kpos, *carry[3:]))

    m = jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf, q.dtype)  # [B, H, Sq]
    o = jnp.zeros((q.shape[0], q.shape[2], q.shape[1], q.shape[3]), q.dtype)  # [B, H, Sq, Dh]
    m, o = lax.pcast((m, o), axis, to="varying")
    carry = (k, v, pos, *fold(k, v, pos, m, jnp.zeros_like(m), o))
    *_, denom, o = lax.fori_loop(1, n, step, carry)
    return (o / jnp.where(denom > 0, denom, 1.0)[..., None]).transpose(0, 2, 1, 3)
    # END SOLUTION


def _gathered_at(q: jax.Array, k: jax.Array, v: jax.Array, pos: jax.Array, axis: str) -> jax.Array:
    """:func:`ring_attention_at`'s values without its ring (what the student package runs in its place):
    K, V [B, S/n, H, Dh] and the positions [S/n] gathered whole with ``all_gather``, each query scored
    against every key whose position is not after its own. It holds the whole sequence's K and V, so it is
    no answer to exercise 3 (whose checker refuses any collective but ``ppermute``)."""
    k, v = (lax.all_gather(a, axis, axis=1, tiled=True) for a in (k, v))
    kpos = lax.all_gather(pos, axis, axis=0, tiled=True)
    s = jnp.einsum("bqhk,bthk->bhqt", q, k) / math.sqrt(q.shape[-1])
    w = jax.nn.softmax(jnp.where(pos[:, None] >= kpos[None, :], s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqt,bthk->bqhk", w, v)


def block_masks(order: np.ndarray, n: int) -> np.ndarray:
    """The causal mask device ``r`` applies at step ``t`` of the ring (it holds the keys of device
    ``(r − t) mod n``), bool [n, n, S/n, S/n] indexed [r, t, query, key], for the layout ``order`` [S]
    (:func:`zigzag_order`, :func:`contiguous_order`).

    Raises:
      ValueError: ``len(order)`` not divisible by ``n``.
    """
    _check(len(order), n, n)
    pos = np.asarray(order).reshape(n, -1)
    src = (np.arange(n)[:, None] - np.arange(n)[None, :]) % n  # [r, t]
    return pos[:, None, :, None] >= pos[src][:, :, None, :]


def visible_blocks(masks: np.ndarray) -> np.ndarray:
    """Per device, the key blocks with at least one unmasked score, int [n] (``masks``: :func:`block_masks`)."""
    return masks.any(axis=(2, 3)).sum(1)


def visible_scores(masks: np.ndarray) -> np.ndarray:
    """Per device, the unmasked (query, key) scores over all steps, int [n]."""
    return masks.sum(axis=(1, 2, 3))


def visible_chunks(masks: np.ndarray) -> np.ndarray:
    """Per device and step, how many of the block's four (query half, key half) quarters hold an unmasked
    score, int [n, n]: the work a ring that skips fully masked quarters (as ring-flash-attention's
    zig-zag does) runs at that step.

    Raises:
      ValueError: the block has an odd number of positions.
    """
    n, _, b, _ = masks.shape
    if b % 2:
        raise ValueError(
            f"blocks of {b} positions do not halve; use a sequence divisible by {2 * n}"
        )
    quarters = masks.reshape(n, n, 2, b // 2, 2, b // 2)
    return quarters.any(axis=(3, 5)).sum(axis=(2, 3))


def layout_counts(order: np.ndarray, n: int) -> dict[str, np.ndarray]:
    """The three counts of a layout on a ring of ``n``, from the masks its devices apply
    (:func:`block_masks`), as ``notebooks/10_transformers.ipynb`` (section 3, the zig-zag layout) prints them.

    Args:
      order: the global positions in the layout's order, int [S] (:func:`zigzag_order`,
        :func:`contiguous_order`).
      n: devices on the ring.

    Returns:
      ``{"blocks": int [n], "scores": int [n], "quarters": int [n, n]}``: per device the key blocks with an
      unmasked score (:func:`visible_blocks`), the unmasked scores over all steps (:func:`visible_scores`),
      and per device and step the quarters of the block holding one (:func:`visible_chunks`).

    Raises:
      ValueError: ``len(order)`` not divisible by ``n``, or blocks of an odd number of positions.
    """
    masks = block_masks(order, n)
    return {
        "blocks": visible_blocks(masks),
        "scores": visible_scores(masks),
        "quarters": visible_chunks(masks),
    }

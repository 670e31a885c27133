"""More answers to lesson 11's exercise 4 (the all_to_all of experts beside data): exchanges that give the
right values another way, or nearly right ones, for tests/test_checks_lesson11.py."""

import jax
import jax.numpy as jnp
from answers_lesson11 import _routed
from jax import lax

from course_lib import moe


def _to_places(out, e, n, cap):
    """[E/n, n·C, D] outputs → [n, E/n, C, D]: the block of each source device."""
    return out.reshape(e // n, n, cap, -1).transpose(1, 0, 2, 3)


def moe_layer_ppermute(x, p, axis_name, k, capacity_factor):
    """Not the exercise: n-1 ppermutes per direction (the right values, an all_to_all's bytes)."""
    buf, r, e, cap = _routed(x, p, k, capacity_factor)
    n, i = lax.axis_size(axis_name), lax.axis_index(axis_name)
    order = (i - jnp.arange(n)) % n  # shift s brings the block of device (i - s) % n

    def exchange(blocks):  # [n (destination), …] → [n (source), …]
        got = []
        for s in range(n):
            b = lax.dynamic_index_in_dim(blocks, (i + s) % n, axis=0, keepdims=False)
            got.append(lax.ppermute(b, axis_name, [(j, (j + s) % n) for j in range(n)]) if s else b)
        return jnp.zeros((n, *got[0].shape), got[0].dtype).at[order].set(jnp.stack(got))

    mine = exchange(buf.reshape(n, e // n, cap, -1)).transpose(1, 0, 2, 3)
    out = moe.experts(p, mine.reshape(e // n, n * cap, -1))
    return moe.combine(exchange(_to_places(out, e, n, cap)).reshape(e, cap, -1), r)


def moe_layer_bfloat16(x, p, axis_name, k, capacity_factor):
    """Wrong: the buffer and the outputs cast to bfloat16 for the exchange (half the bytes, rounded)."""
    buf, r, e, cap = _routed(x, p, k, capacity_factor)
    half = buf.astype(jnp.bfloat16)
    mine = lax.all_to_all(half, axis_name, split_axis=0, concat_axis=1, tiled=True)
    out = moe.experts(p, mine.astype(buf.dtype)).astype(jnp.bfloat16)
    back = lax.all_to_all(out, axis_name, split_axis=1, concat_axis=0, tiled=True)
    return moe.combine(back.astype(buf.dtype), r)


def moe_layer_psum(x, p, axis_name, k, capacity_factor):
    """Wrong: every device's buffer and outputs summed into place with psum (right values, n× the bytes)."""
    buf, r, e, cap = _routed(x, p, k, capacity_factor)
    n, i = lax.axis_size(axis_name), lax.axis_index(axis_name)
    every = lax.psum(jnp.zeros((n, *buf.shape), buf.dtype).at[i].set(buf), axis_name)
    mine = lax.dynamic_slice_in_dim(every, i * (e // n), e // n, axis=1)  # [n, E/n, C, D]
    out = moe.experts(p, mine.transpose(1, 0, 2, 3).reshape(e // n, n * cap, -1))
    full = jnp.zeros((e, n, cap, buf.shape[-1]), out.dtype)
    full = lax.dynamic_update_slice_in_dim(full, out.reshape(e // n, n, cap, -1), i * (e // n), 0)
    back = lax.dynamic_index_in_dim(lax.psum(full, axis_name), i, axis=1, keepdims=False)
    return moe.combine(back, r)


def moe_layer_weights_gathered(x, p, axis_name, k, capacity_factor):
    """Wrong: the experts' weights gathered to every device, the tokens left in place (no exchange)."""
    buf, r, e, cap = _routed(x, p, k, capacity_factor)
    every = jax.tree.map(lambda w: lax.all_gather(w, axis_name, tiled=True), p)
    return moe.combine(moe.experts(dict(every, router=p["router"]), buf), r)


def moe_layer_double(x, p, axis_name, k, capacity_factor):
    """Wrong: the buffer sent twice over (concatenated with itself), half of it dropped on arrival."""
    buf, r, e, cap = _routed(x, p, k, capacity_factor)
    two = jnp.concatenate([buf, buf], axis=-1)
    mine = lax.all_to_all(two, axis_name, split_axis=0, concat_axis=1, tiled=True)[
        ..., : buf.shape[-1]
    ]
    back = lax.all_to_all(moe.experts(p, mine), axis_name, split_axis=1, concat_axis=0, tiled=True)
    return moe.combine(back, r)


def moe_layer_four(x, p, axis_name, k, capacity_factor):
    """Wrong: n = 4 written in (the default expert axis), not the size of axis_name."""
    buf, r, e, cap = _routed(x, p, k, capacity_factor)
    n = 4
    got = lax.all_to_all(buf.reshape(n, e // n, cap, -1), axis_name, 0, 0, tiled=True)
    out = moe.experts(p, got.transpose(1, 0, 2, 3).reshape(e // n, n * cap, -1))
    back = lax.all_to_all(_to_places(out, e, n, cap), axis_name, 0, 0, tiled=True)
    return moe.combine(back.reshape(e, cap, -1), r)


def moe_layer_stop_gradient(x, p, axis_name, k, capacity_factor):
    """Wrong: the right exchange behind lax.stop_gradient (the right values, no gradient through the
    experts to the tokens and the router)."""
    buf, r, e, cap = _routed(x, p, k, capacity_factor)
    mine = lax.all_to_all(
        lax.stop_gradient(buf), axis_name, split_axis=0, concat_axis=1, tiled=True
    )
    back = lax.all_to_all(moe.experts(p, mine), axis_name, split_axis=1, concat_axis=0, tiled=True)
    return moe.combine(back, r)

"""Checkers for ``04_pmap.ipynb``: replicating a pytree, per-device PRNG keys, data-parallel gradients."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from course_lib.meshes import DATA

from ._common import call_answer, checker, fail, passed


def _call(what: str, fn: Callable, *args):
    def explain(e: Exception):
        if isinstance(e, NameError):  # a wrong axis name: say which one to use
            return (
                f"{what} raised NameError: {e}",
                "use the axis name passed in as `axis_name`, the one pmap binds",
            )
        return None

    return call_answer(what, fn, *args, explain=explain)


@checker
def check_replicate(fn: Callable[[Any, int], Any], devices: Sequence[Any]) -> bool:
    """``fn(tree, n)`` must return ``tree`` with a new leading axis of size ``n`` holding identical copies."""
    n = len(devices)
    tree = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.arange(3.0) - 1.0}
    out = _call("replicate(tree, n)", fn, tree, n)
    if jax.tree.structure(out) != jax.tree.structure(tree):
        fail(
            f"the tree structure changed: {jax.tree.structure(out)}",
            "keep the structure and change every leaf: jax.tree.map(lambda x: ..., tree)",
        )
    for name in ("w", "b"):
        x, y = tree[name], out[name]
        shape = tuple(np.shape(y))
        if shape == x.shape and n > 1:
            fail(
                f"leaf {name!r} has shape {shape}: no leading device axis",
                f"pmap maps over axis 0, so every leaf needs a new leading axis of size n={n}: "
                "jnp.broadcast_to(x, (n,) + x.shape)",
            )
        if (
            shape == x.shape + (n,) and shape != (n,) + x.shape and n > 1
        ):  # e.g. (3,) + (3,): both orders agree
            fail(
                f"leaf {name!r} has shape {shape}: the device axis was added last",
                "pmap maps over the leading axis (axis 0), not the last one: the copies go first, (n,) + x.shape",
            )
        if shape != (n,) + x.shape:
            fail(
                f"leaf {name!r} has shape {shape}, expected {(n,) + x.shape}",
                "add one leading axis of size n",
            )
        if not np.array_equal(np.asarray(y), np.broadcast_to(np.asarray(x), shape)):
            fail(
                f"the copies of leaf {name!r} differ from the original",
                "every device needs an identical copy: broadcast the leaf, don't split or reshape it",
            )
    # The replicated tree really feeds pmap: each device sees the original shapes.
    seen = jax.pmap(lambda t: jax.tree.map(jnp.sum, t), devices=list(devices))(out)
    assert np.allclose(np.asarray(seen["w"]), float(tree["w"].sum()))
    return passed(
        f"every leaf has a leading axis of {n} identical copies; pmap gives each device the original shapes"
    )


@checker
def check_device_noise(fn: Callable, devices: Sequence[Any]) -> bool:
    """``fn(key, x, axis_name)`` inside pmap must return ``x + normal(fold_in(key, axis_index), x.shape)``."""
    n = len(devices)
    key = jax.random.key(42)
    xs = jnp.arange(n * 5, dtype=jnp.float32).reshape(n, 5)
    mapped = jax.pmap(
        partial(fn, axis_name=DATA), axis_name=DATA, in_axes=(None, 0), devices=list(devices)
    )
    out = np.asarray(_call("your function under pmap", mapped, key, xs))
    if out.shape != xs.shape:
        fail(
            f"result has shape {out.shape}, expected {xs.shape}",
            "return x + noise, the noise with x's shape",
        )
    noise = out - np.asarray(xs)
    if n > 1 and np.allclose(noise, noise[0:1]):
        fail(
            "every device drew the same numbers",
            "one replicated key gives identical noise on every device: give device i its own key with "
            "jax.random.fold_in(key, lax.axis_index(axis_name))",
        )
    expected = np.stack(
        [np.asarray(jax.random.normal(jax.random.fold_in(key, i), (5,))) for i in range(n)]
    )
    if np.allclose(out, expected, atol=1e-6):
        fail("the result is the noise alone", "return x plus the noise, not the noise")
    if not np.allclose(noise, expected, atol=1e-5):
        fail(
            "the noise is not jax.random.normal(jax.random.fold_in(key, i), x.shape) on device i",
            "derive the key with jax.random.fold_in(key, lax.axis_index(axis_name)) and draw one normal of x's shape",
        )
    return passed(f"each of the {n} devices drew its own noise from fold_in(key, axis_index)")


def _mse(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


@checker
def check_data_parallel_grads(fn: Callable, devices: Sequence[Any]) -> bool:
    """``fn(loss_fn, params, batch, axis_name)`` inside pmap must return the full-batch gradient on every device."""
    n = len(devices)
    kx, ky, kw = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (4 * n, 3))
    y = jax.random.normal(ky, (4 * n, 2))
    params = {"w": jax.random.normal(kw, (3, 2)), "b": jnp.zeros(2)}
    expected = jax.grad(_mse)(params, (x, y))
    batch = (x.reshape(n, 4, 3), y.reshape(n, 4, 2))
    mapped = jax.pmap(
        partial(fn, _mse, axis_name=DATA), axis_name=DATA, in_axes=(None, 0), devices=list(devices)
    )
    out = _call("your function under pmap", mapped, params, batch)
    if jax.tree.structure(out) != jax.tree.structure(params):
        fail(
            f"returned {jax.tree.structure(out)}",
            "return the gradient pytree, same structure as params",
        )
    got = jax.tree.map(np.asarray, out)
    if n > 1 and not all(np.allclose(g, g[0:1], atol=1e-6) for g in jax.tree.leaves(got)):
        fail(
            "devices return different gradients",
            "each device differentiated only its own shard: average them with lax.pmean(grads, axis_name)",
        )
    first = jax.tree.map(lambda g: g[0], got)
    ok = all(
        np.allclose(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(expected), strict=True)
    )
    if not ok:
        too_big = all(
            np.allclose(a, n * np.asarray(b), rtol=1e-5, atol=1e-6)
            for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(expected), strict=True)
        )
        if too_big and n > 1:
            fail(
                f"gradients are {n}x (n_devices x) too large",
                "lax.psum adds the per-device gradients; lax.pmean averages them",
            )
        fail(
            "gradients differ from the single-device gradient of the whole batch",
            "differentiate loss_fn(params, batch) on the local shard, then lax.pmean the gradients over axis_name",
        )
    return passed(f"every device holds the full-batch gradient (averaged over {n} devices)")

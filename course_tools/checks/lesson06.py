"""Checkers for ``06_shard_map.ipynb``: an all-reduce mean, a ring shift, data-parallel gradients, a
row-parallel dense layer. Each runs the learner's per-shard body in ``jax.shard_map`` with ``check_vma=True``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from course_lib.meshes import DATA, MODEL, data_mesh, data_model_mesh

from ._common import call_answer, checker, fail, passed

_VMA_WORDS = ("out_specs", "replicat", "vma", "varying")


def _run(what: str, fn: Callable, *args, varies_hint: str):
    def explain(e: Exception):
        if isinstance(e, NameError):
            return (
                f"{what} raised NameError: {e}",
                "use the axis name passed in as `axis_name`, the mesh's axis",
            )
        if any(w in str(e) for w in _VMA_WORDS):
            return (
                f"{what}: shard_map says the result varies across devices, but out_specs=P() promises one value",
                varies_hint,
            )
        return None

    return call_answer(what, fn, *args, explain=explain)


@checker
def check_allreduce_mean(fn: Callable, devices: Sequence[Any]) -> bool:
    """``fn(x_block, axis_name)`` must return the mean of the *whole* array, the same on every device."""
    mesh = data_mesh(devices, axis_type="auto")
    n = len(devices)
    x = jnp.arange(4 * n, dtype=jnp.float32) ** 1.5
    mapped = jax.shard_map(
        partial(fn, axis_name=DATA), mesh=mesh, in_specs=P(DATA), out_specs=P(), check_vma=True
    )
    got = np.asarray(
        _run(
            "your body",
            mapped,
            x,
            varies_hint="each device computed only its own block's mean; "
            "combine across devices with lax.pmean(…, axis_name)",
        )
    )
    want = float(np.mean(np.asarray(x)))
    if got.shape != ():
        fail(f"result has shape {got.shape}", "return one scalar: the mean over the whole array")
    if np.isclose(got, want, rtol=1e-5):
        return passed(f"the mean over all {n} shards, {want:.4f}, on every device")
    if n > 1 and np.isclose(got, n * want, rtol=1e-5):
        fail(
            f"{n}x (n_devices x) too large",
            "lax.psum adds the per-device means; lax.pmean averages them",
        )
    fail(
        f"got {float(got):.4f}, expected {want:.4f}",
        "take the local mean, then lax.pmean it over axis_name",
    )


@checker
def check_ring_shift(fn: Callable, devices: Sequence[Any]) -> bool:
    """``fn(x_block, axis_name)`` must send each device's block to the next device (i → i+1, the last to 0)."""
    mesh = data_mesh(devices, axis_type="auto")
    n = len(devices)
    k = 3
    x = jnp.arange(k * n, dtype=jnp.float32)
    mapped = jax.shard_map(
        partial(fn, axis_name=DATA), mesh=mesh, in_specs=P(DATA), out_specs=P(DATA), check_vma=True
    )
    got = np.asarray(
        _run(
            "your body", mapped, x, varies_hint="return the received block, which varies per device"
        )
    )
    want = np.roll(np.asarray(x), k)
    if got.shape != want.shape:
        fail(
            f"result has shape {got.shape}, expected {want.shape}",
            "return a block of the same shape as x_block",
        )
    if np.array_equal(got, want):
        return passed(f"every block moved one device forward around a ring of {n}")
    if n > 1 and np.array_equal(got, np.roll(np.asarray(x), -k)):
        fail(
            "the blocks moved backwards (i → i-1)",
            "ppermute's perm lists (source, destination) pairs: use [(i, (i + 1) % n) for i in range(n)]",
        )
    if np.array_equal(got, np.asarray(x)):
        fail(
            "nothing moved",
            "send with lax.ppermute(x_block, axis_name, perm=[(i, (i + 1) % n) for i in range(n)])",
        )
    fail(
        "the blocks are not where they should be",
        "device i's block must arrive on device (i + 1) % n",
    )


def _local_loss(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


@checker
def check_dp_grad(fn: Callable, devices: Sequence[Any]) -> bool:
    """``fn(loss_fn, params, x_block, y_block, axis_name)`` inside shard_map (params ``P()``, batch ``P(data)``,
    out ``P()``, check_vma=True) must return the gradient of the mean loss over the *whole* batch."""
    mesh = data_mesh(devices, axis_type="auto")
    n = len(devices)
    kx, ky, kw = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (4 * n, 3))
    y = jax.random.normal(ky, (4 * n, 2))
    params = {"w": jax.random.normal(kw, (3, 2)), "b": jnp.ones(2)}
    want = jax.grad(_local_loss)(params, x, y)
    mapped = jax.shard_map(
        partial(fn, _local_loss, axis_name=DATA),
        mesh=mesh,
        in_specs=(P(), P(DATA), P(DATA)),
        out_specs=P(),
        check_vma=True,
    )
    got = _run(
        "your body",
        mapped,
        params,
        x,
        y,
        varies_hint="the gradients differ per device: the result must be the one global gradient",
    )
    if jax.tree.structure(got) != jax.tree.structure(params):
        fail(
            f"returned {jax.tree.structure(got)}",
            "return the gradient pytree, same structure as params",
        )
    pairs = list(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
    if all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in pairs):
        return passed(f"the full-batch gradient, from {n} data shards (check_vma=True)")
    if n > 1 and all(np.allclose(a, n * np.asarray(b), rtol=1e-5, atol=1e-6) for a, b in pairs):
        fail(
            f"gradient is n_data× too large ({n}×): you pmean'd gradients of a local loss inside shard_map",
            "for a replicated (P()) parameter, grad already sums the shards' gradients over the data axis; "
            "differentiate the global loss instead: jax.grad(lambda p: lax.pmean(loss_fn(p, x, y), axis_name))(params)",
        )
    fail(
        "gradients differ from the single-device gradient",
        "differentiate lax.pmean(loss_fn(p, x_block, y_block), axis_name)",
    )


@checker
def check_row_parallel(fn: Callable, devices: Sequence[Any]) -> bool:
    """``fn(x_block, w_block, axis_name)`` on a 2-D mesh: x [b, d/m] split over model, w [d/m, h] row-split;
    must return the full ``x @ w`` rows [b, h], the same on every model shard."""
    mesh = data_model_mesh(devices, axis_type="auto")
    kx, kw = jax.random.split(jax.random.key(2))
    rows, d = (
        2 * mesh.shape[DATA],
        4 * mesh.shape[MODEL],
    )  # multiples of the axis sizes (8 x 8 on 4 x 2)
    x = jax.random.normal(kx, (rows, d))
    w = jax.random.normal(kw, (d, 4))
    mapped = jax.shard_map(
        partial(fn, axis_name=MODEL),
        mesh=mesh,
        in_specs=(P(DATA, MODEL), P(MODEL, None)),
        out_specs=P(DATA, None),
        check_vma=True,
    )
    got = np.asarray(
        _run(
            "your body",
            mapped,
            x,
            w,
            varies_hint="each model shard holds a partial sum over its slice of d: "
            "add them with lax.psum(…, axis_name)",
        )
    )
    want = np.asarray(x @ w)
    if got.shape != want.shape:
        fail(
            f"result has shape {got.shape}, expected {want.shape}",
            "return x_block @ w_block summed over the model axis",
        )
    if np.allclose(got, want, atol=1e-5):
        return passed(f"row-parallel x @ w on a {dict(mesh.shape)} mesh: one psum over {MODEL!r}")
    m = mesh.shape[MODEL]
    if m > 1 and np.allclose(got * m, want, atol=1e-5):
        fail(f"{m}x too small", "lax.pmean averages the partial sums; they must be added: lax.psum")
    fail(
        "x @ w is wrong",
        "multiply the local blocks, then lax.psum the partial products over axis_name",
    )

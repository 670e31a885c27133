"""Checkers for ``07_debugging.ipynb``: a static argument that compiles once per value, a donating update,
and balancing work across shards."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ._common import call_answer, checker, fail, passed


def _reference_poly(x, degree):
    return sum(np.asarray(x) ** k for k in range(degree + 1))


def _explain_static(e: Exception):
    if isinstance(e, (jax.errors.TracerIntegerConversionError, jax.errors.ConcretizationTypeError)):
        return (
            f"degree is traced ({type(e).__name__}): range() needs a Python int",
            "mark it static so each degree is a compile-time constant: jax.jit(..., static_argnames='degree')",
        )
    if isinstance(e, ValueError) and "hash" in str(e).lower():
        return (
            "x was made static: arrays are not hashable",
            "mark only degree static (static_argnames='degree'); x stays a traced argument",
        )
    return None


@checker
def check_static_poly(fn: Callable) -> bool:
    """``fn(x, degree)``, jitted, must compute ``sum_{k=0}^{degree} x**k`` and compile once per degree."""
    if not hasattr(fn, "_cache_size") or not hasattr(fn, "lower"):
        fail("poly is not jit-compiled", "decorate it: @partial(jax.jit, static_argnames='degree')")
    fn.clear_cache()
    x1, x2 = jnp.linspace(-1.0, 1.0, 5), jnp.linspace(0.0, 2.0, 5)
    for x, degree in ((x1, 3), (x2, 3), (x1, 4), (x2, 4), (x1, 3)):
        got = call_answer(f"poly(x, {degree})", fn, x, degree, explain=_explain_static)
        if not np.allclose(np.asarray(got), _reference_poly(x, degree), rtol=1e-5):
            fail(
                f"poly(x, {degree}) is wrong", "sum x**k for k = 0, 1, …, degree (degree + 1 terms)"
            )
    size = fn._cache_size()
    if size > 2:
        fail(
            f"{size} compilations for 2 degrees and one input shape",
            "new values of x (same shape) must reuse the compiled program: only degree should be static",
        )
    return passed(f"{size} compilation(s) for 5 calls with 2 degrees: one per static value")


@checker
def check_donating_update(fn: Callable) -> bool:
    """``fn(params, grads)``, jitted, must return ``params - 0.1 * grads`` and donate ``params``."""
    if not hasattr(fn, "lower"):
        fail("sgd_update is not jit-compiled", "decorate it: @partial(jax.jit, donate_argnums=0)")
    params = {"w": jnp.ones((64, 64)), "b": jnp.zeros(64)}
    grads = {"w": jnp.full((64, 64), 2.0), "b": jnp.ones(64)}
    new = call_answer("sgd_update(params, grads)", fn, params, grads)
    if not (np.allclose(np.asarray(new["w"]), 0.8) and np.allclose(np.asarray(new["b"]), -0.1)):
        fail("the update is wrong", "return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)")
    params_gone = all(x.is_deleted() for x in jax.tree.leaves(params))
    grads_gone = all(x.is_deleted() for x in jax.tree.leaves(grads))
    if not params_gone:
        if grads_gone:
            fail(
                "you donated the gradients (argument 1), not the parameters",
                "donate what the update replaces: donate_argnums=0 lets the new params reuse the old params' memory",
            )
        fail(
            "the old parameters were not donated: the update holds two copies of them at its peak",
            "pass donate_argnums=0 to jax.jit so the new params can reuse the old params' buffers",
        )
    return passed(
        "params donated: the old buffers were reused for the new parameters (old ones now deleted)"
    )


def _shard_work(lengths: np.ndarray, order: np.ndarray, n_shards: int) -> np.ndarray:
    return np.asarray(lengths)[np.asarray(order)].reshape(n_shards, -1).sum(axis=1)


@checker
def check_balance(fn: Callable) -> bool:
    """``fn(lengths, n_shards)`` must return a permutation of example indices such that, cut into
    ``n_shards`` contiguous blocks, every block has about the same total length (max ≤ 1.25 × mean)."""
    rng = np.random.default_rng(0)
    cases = [
        (np.arange(1, 33), 8),
        (np.sort(rng.integers(1, 100, size=64)), 8),
        (np.concatenate([np.full(4, 50), np.ones(28, dtype=int)]), 4),
    ]
    for lengths, n_shards in cases:
        order = np.asarray(
            call_answer(f"balance(lengths, {n_shards})", fn, lengths.copy(), n_shards)
        )
        if order.shape != lengths.shape or sorted(order.tolist()) != list(range(len(lengths))):
            fail(
                "the result is not a permutation of the example indices",
                "return each index 0 … len(lengths) - 1 exactly once (indices, not lengths)",
            )
        work = _shard_work(lengths, order, n_shards)
        ratio = work.max() / work.mean()
        if ratio > 1.25:
            fail(
                f"shard {int(work.argmax())} has {ratio:.2f}× the mean work (per-shard work {work.tolist()})",
                "sorting alone puts the longest examples together on one shard: sort by length, then deal them "
                "out round-robin (shard s gets sorted positions s, s + n_shards, …)",
            )
    return passed(
        "every shard gets about the same total work (max ≤ 1.25 × mean) on all test cases"
    )

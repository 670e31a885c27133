"""Checkers for ``03_vmap.ipynb``: a per-pair cosine similarity, a pairwise matrix, per-example gradients."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ._common import checker, fail, passed


def _cos(a, b):
    return np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def _pairs(n=1000, d=16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype(np.float32), rng.normal(size=(n, d)).astype(np.float32)


@checker
def check_cosine(cosine_similarity: Callable) -> bool:
    """Exercise 1: ``cosine_similarity(a, b)`` for ONE pair of float32 [d] vectors → a scalar in [-1, 1].

    The checker applies ``jax.vmap`` to it over 1000 pairs.

    Raises:
      ExerciseError: not a scalar for one pair, not normalised, wrong value, wrong shape under vmap.
    """
    import jax
    import jax.numpy as jnp

    a, b = _pairs()
    one = np.asarray(cosine_similarity(jnp.asarray(a[0]), jnp.asarray(b[0])))
    if one.shape != ():
        fail(
            f"one pair gave shape {one.shape}, expected a scalar ()",
            "reduce over the feature axis: jnp.dot(a, b), not a * b",
        )
    out = np.asarray(jax.vmap(cosine_similarity)(jnp.asarray(a), jnp.asarray(b)))
    if out.shape != (len(a),):
        fail(
            f"vmap over {len(a)} pairs gave shape {out.shape}, expected ({len(a)},)",
            "write the function for one pair; vmap adds the batch axis",
        )
    expected = _cos(a, b)
    if np.allclose(out, np.sum(a * b, -1), rtol=1e-4):
        fail(
            "got the plain dot product",
            "divide by both norms: jnp.linalg.norm(a) * jnp.linalg.norm(b)",
        )
    if np.any(np.abs(out) > 1 + 1e-5):
        fail(
            "some similarities are outside [-1, 1]", "divide by the product of both vectors' norms"
        )
    if not np.allclose(out, expected, rtol=1e-4, atol=1e-5):
        fail(
            f"values differ from the reference (first: {out[0]:.4f}, expected {expected[0]:.4f})",
            "cosine = a·b / (|a| |b|)",
        )
    return passed(f"cosine similarity right for {len(a)} pairs under vmap")


@checker
def check_pairwise(pairwise_cosine: Callable) -> bool:
    """Exercise 2: ``pairwise_cosine(A, B)``: float32 [n, d], [m, d] → [n, m], entry (i, j) = cos(A[i], B[j]).

    Raises:
      ExerciseError: transposed result, wrong shape (e.g. only matching pairs), wrong values.
    """
    import jax.numpy as jnp

    a, b = _pairs(n=7, d=5, seed=1)
    b = b[:4]
    out = np.asarray(pairwise_cosine(jnp.asarray(a), jnp.asarray(b)))
    expected = _cos(a[:, None, :], b[None, :, :])
    if out.shape == expected.T.shape and out.shape != expected.shape:
        fail(
            f"shape {out.shape}, expected {expected.shape}: the result is transposed",
            "the OUTER vmap maps over A (rows): jax.vmap(jax.vmap(cos, in_axes=(None, 0)), in_axes=(0, None))",
        )
    if out.shape != expected.shape:
        fail(
            f"A [7, 5] and B [4, 5] gave shape {out.shape}, expected {expected.shape}",
            "nest two vmaps: the inner one maps B with in_axes=(None, 0), the outer one maps A with (0, None)",
        )
    if not np.allclose(out, expected, rtol=1e-4, atol=1e-5):
        fail("values differ from the reference", "entry (i, j) is cos(A[i], B[j])")
    return passed("pairwise cosine similarity has the right shape and values")


@checker
def check_per_example_grads(per_example_grads: Callable) -> bool:
    """Exercise 3: ``per_example_grads(loss_fn, params, xs, ys)`` → a pytree like ``params`` with a leading axis n.

    ``loss_fn(params, x, y)`` is the loss of ONE example. The checker uses a linear model
    ``params = {"w": [3], "b": []}``, ``loss = (x @ w + b - y) ** 2``.

    Raises:
      ExerciseError: the batch gradient instead of per-example ones, a mapped ``params``, wrong values.
    """
    import jax
    import jax.numpy as jnp

    def loss_fn(params, x, y):
        return (x @ params["w"] + params["b"] - y) ** 2

    rng = np.random.default_rng(3)
    n = 6
    params = {"w": jnp.asarray(rng.normal(size=3), jnp.float32), "b": jnp.asarray(0.5, jnp.float32)}
    xs = rng.normal(size=(n, 3)).astype(np.float32)
    ys = rng.normal(size=n).astype(np.float32)
    try:
        out = per_example_grads(loss_fn, params, jnp.asarray(xs), jnp.asarray(ys))
    except ValueError as e:
        if "vmap" in str(e):
            fail(
                f"vmap raised ValueError: {str(e).splitlines()[0]}",
                "params are shared by all examples: in_axes=(None, 0, 0)",
            )
        raise
    if jax.tree.structure(out) != jax.tree.structure(params):
        fail(
            f"result structure {jax.tree.structure(out)}, expected {jax.tree.structure(params)}",
            "return what jax.grad returns (a tree like params), vmapped",
        )
    if tuple(np.shape(out["b"])) == () or tuple(np.shape(out["w"])) == (3,):
        fail(
            f"leaf shapes {jax.tree.map(np.shape, out)}: no per-example axis",
            "that is one gradient for the whole batch; vmap the gradient of one example over the batch",
        )
    if tuple(np.shape(out["w"])) != (n, 3) or tuple(np.shape(out["b"])) != (n,):
        fail(
            f"leaf shapes {jax.tree.map(np.shape, out)}, expected w: ({n}, 3), b: ({n},)",
            "map over the leading axis of xs and ys (in_axes 0), not over params",
        )
    r = xs @ np.asarray(params["w"]) + float(params["b"]) - ys
    if not np.allclose(
        np.asarray(out["w"]), 2 * r[:, None] * xs, rtol=1e-4, atol=1e-5
    ) or not np.allclose(np.asarray(out["b"]), 2 * r, rtol=1e-4, atol=1e-5):
        fail(
            "per-example gradients have the right shapes but wrong values",
            "jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0))(params, xs, ys)",
        )
    return passed(f"{n} per-example gradients, each equal to the gradient of its own loss")

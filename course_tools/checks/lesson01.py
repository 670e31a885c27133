"""Checkers for ``01_grad.ipynb``: value_and_grad, pytree updates, a pure dropout with PRNG keys."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ._common import checker, fail, passed


def _mse_reference(w, x, y):
    r = x @ w - y
    return float(np.mean(r**2)), 2.0 * x.T @ r / len(y)


@checker
def check_loss_and_grad(loss_and_grad: Callable) -> bool:
    """Exercise 1: ``loss_and_grad(w, x, y) -> (loss, dloss/dw)`` for ``loss = mean((x @ w - y) ** 2)``.

    ``w``: float32 [3], ``x``: float32 [5, 3], ``y``: float32 [5].

    Raises:
      ExerciseError: not a pair, gradient of the wrong argument (shape), sum instead of mean, wrong value.
    """
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    w = rng.normal(size=3).astype(np.float32)
    x = rng.normal(size=(5, 3)).astype(np.float32)
    y = rng.normal(size=5).astype(np.float32)
    out = loss_and_grad(jnp.asarray(w), jnp.asarray(x), jnp.asarray(y))
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        fail(
            "expected a pair (loss, grad)",
            "jax.value_and_grad(loss)(w, x, y) returns exactly that pair",
        )
    loss, grad = (np.asarray(v) for v in out)
    ref_loss, ref_grad = _mse_reference(
        w.astype(np.float64), x.astype(np.float64), y.astype(np.float64)
    )
    if loss.shape != ():
        fail(
            f"the loss has shape {loss.shape}, expected a scalar",
            "reduce with jnp.mean over the examples",
        )
    if grad.shape != w.shape:
        fail(
            f"the gradient has shape {grad.shape}, expected {w.shape} (the shape of w)",
            "differentiate with respect to w, the first argument (argnums=0), not x",
        )
    if np.isclose(loss, ref_loss * len(y), rtol=1e-4):
        fail(
            f"loss {float(loss):.4f} is {len(y)}x the expected {ref_loss:.4f}",
            "use the mean, not the sum",
        )
    if not np.isclose(loss, ref_loss, rtol=1e-4):
        fail(
            f"loss {float(loss):.4f}, expected {ref_loss:.4f}", "loss = jnp.mean((x @ w - y) ** 2)"
        )
    if not np.allclose(grad, ref_grad, rtol=1e-4, atol=1e-5):
        fail(
            f"gradient {grad} differs from the expected {ref_grad}",
            "take the gradient of the same loss you return, e.g. with jax.value_and_grad",
        )
    return passed("loss and gradient match the analytic values")


_JIT_HINT = "use only jax.tree.map and jnp operations"


@checker
def check_sgd_update(sgd_update: Callable) -> bool:
    """Exercise 2: ``sgd_update(params, grads, lr)`` returns ``params - lr * grads`` leaf by leaf, same structure.

    Raises:
      ExerciseError: a different tree structure, the wrong sign, a wrong value, or a function jit rejects.
    """
    import jax
    import jax.numpy as jnp

    params = {
        "dense": {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)},
        "scale": jnp.array(2.0),
    }
    grads = {"dense": {"w": jnp.full((2, 3), 0.5), "b": jnp.arange(3.0)}, "scale": jnp.array(-1.0)}
    lr = 0.1
    expected = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    out = sgd_update(params, grads, lr)
    if jax.tree.structure(out) != jax.tree.structure(params):
        fail(
            f"the result's structure {jax.tree.structure(out)} differs from the params' "
            f"{jax.tree.structure(params)}",
            "map over both trees leaf by leaf: jax.tree.map(f, params, grads)",
        )
    for path, o, e, p, g in zip(
        jax.tree_util.tree_leaves_with_path(out),
        jax.tree.leaves(out),
        jax.tree.leaves(expected),
        jax.tree.leaves(params),
        jax.tree.leaves(grads),
        strict=True,
    ):
        name = jax.tree_util.keystr(path[0])
        if np.shape(o) != np.shape(e):
            fail(
                f"leaf {name} has shape {np.shape(o)}, expected {np.shape(e)}",
                "update each leaf elementwise",
            )
        if np.allclose(o, p + lr * g) and not np.allclose(o, e):
            fail(f"leaf {name} moved uphill", "gradient descent subtracts: p - lr * g")
        if not np.allclose(o, e):
            fail(
                f"leaf {name} is {np.asarray(o)}, expected {np.asarray(e)}",
                "new = p - lr * g for every leaf",
            )
    try:
        jax.jit(sgd_update)(params, grads, lr)
    except Exception as e:  # noqa: BLE001
        fail(f"sgd_update fails under jax.jit: {type(e).__name__}", _JIT_HINT)
    return passed("sgd_update keeps the tree structure and steps downhill")


@checker
def check_dropout(dropout: Callable) -> bool:
    """Exercise 3: a pure ``dropout(key, x, rate)``: drops a fraction ``rate``, scales the rest by ``1/(1-rate)``.

    Raises:
      ExerciseError: wrong shape, not a function of the key alone (impure), ignores the key, wrong drop
        fraction, missing rescaling, or fails under ``jit``.
    """
    import jax
    import jax.numpy as jnp

    x = jnp.ones((100, 100))
    rate = 0.3
    key = jax.random.key(42)
    a = np.asarray(dropout(key, x, rate))
    if a.shape != x.shape:
        fail(
            f"output shape {a.shape}, expected {x.shape}",
            "the mask has the shape of x: jax.random.bernoulli(key, p, x.shape)",
        )
    b = np.asarray(dropout(key, x, rate))
    if not np.array_equal(a, b):
        fail(
            "two calls with the same key gave different outputs: the function is not pure",
            "draw the randomness only from the key argument (jax.random), never np.random or a global key",
        )
    c = np.asarray(dropout(jax.random.key(7), x, rate))
    if np.array_equal(a, c):
        fail(
            "a different key gave the same output",
            "use the key you are given, do not make a fixed one inside",
        )
    dropped = float(np.mean(a == 0))
    if not 0.26 < dropped < 0.34:
        fail(
            f"{dropped:.0%} of the entries were dropped, expected about {rate:.0%}",
            "keep each entry with probability 1 - rate: jax.random.bernoulli(key, 1 - rate, x.shape)",
        )
    kept = a[a != 0]
    if not np.allclose(kept, 1 / (1 - rate), rtol=1e-5):
        fail(
            f"kept entries are {float(kept.mean()):.3f}, expected 1/(1-rate) = {1 / (1 - rate):.3f}",
            "scale the kept entries by 1 / (1 - rate) so that the mean of the output stays the mean of x",
        )
    try:
        j = np.asarray(jax.jit(dropout, static_argnums=2)(key, x, rate))
    except Exception as e:  # noqa: BLE001
        fail(
            f"dropout fails under jax.jit: {type(e).__name__}: {str(e).splitlines()[0]}",
            "use jnp.where(keep, x / (1 - rate), 0) instead of Python control flow on arrays",
        )
    if not np.allclose(j, a):
        fail(
            "the jitted dropout gives other values than the eager one",
            "the result must depend only on the inputs",
        )
    return passed("dropout is pure, drops the right fraction and keeps the expectation")

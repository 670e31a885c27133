"""Checkers for ``02_jit.ipynb``: jnp.where instead of Python ``if``, static arguments, padding a ragged batch."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ._common import checker, fail, passed


def _tracer_error(e: Exception) -> bool:
    import jax

    return isinstance(
        e,
        (
            jax.errors.TracerBoolConversionError,
            jax.errors.TracerIntegerConversionError,
            jax.errors.ConcretizationTypeError,
        ),
    )


@checker
def check_leaky_relu(leaky_relu: Callable) -> bool:
    """Exercise 1: ``leaky_relu(x)`` = ``x`` where ``x > 0``, else ``0.1 * x``, elementwise, and works under ``jit``.

    Raises:
      ExerciseError: fails under jit (Python ``if`` on a traced value), wrong shape, wrong slope or branch.
    """
    import jax
    import jax.numpy as jnp

    x = jnp.array([-2.0, -0.5, 0.0, 0.5, 3.0])
    expected = np.where(np.asarray(x) > 0, np.asarray(x), 0.1 * np.asarray(x))
    try:
        jax.jit(leaky_relu)(
            jnp.float32(-1.0)
        )  # a scalar first: a Python `if` fails with the tracer error
        out = np.asarray(jax.jit(leaky_relu)(x))
    except Exception as e:  # noqa: BLE001
        if _tracer_error(e) or (isinstance(e, ValueError) and "truth value" in str(e)):
            fail(
                f"leaky_relu fails under jax.jit with {type(e).__name__}",
                "a Python `if` needs one concrete bool, but under jit x is a tracer (and an array holds many "
                "values); use jnp.where(x > 0, x, 0.1 * x)",
            )
        raise
    if out.shape != expected.shape:
        fail(
            f"output shape {out.shape}, expected {expected.shape}",
            "work elementwise, keep the input's shape",
        )
    if not np.allclose(out, expected):
        if np.allclose(out, np.maximum(np.asarray(x), 0)):
            fail(
                f"got {out}: that is a plain ReLU",
                "negative inputs are scaled by 0.1, not set to 0",
            )
        fail(
            f"leaky_relu({np.asarray(x)}) = {out}, expected {expected}",
            "x where x > 0, else 0.1 * x",
        )
    return passed("leaky_relu is right and compiles under jit")


@checker
def check_poly_jit(poly_jit: Callable) -> bool:
    """Exercise 2: ``poly_jit(x, degree)`` = ``1 + x + … + x**degree``, jitted with ``degree`` static.

    Each distinct degree compiles once; other values of ``x`` (same shape) reuse the compiled program.

    Raises:
      ExerciseError: not a jitted function, ``degree`` traced, wrong value, or a new compile per call.
    """
    import jax.numpy as jnp

    if not hasattr(poly_jit, "lower") or not hasattr(poly_jit, "_cache_size"):
        fail("poly_jit is not a jitted function", "poly_jit = jax.jit(poly, static_argnums=1)")
    xs = [jnp.linspace(-1.0, 1.0, 13) + 0.1 * k for k in range(3)]  # a shape only this checker uses
    calls = [(xs[0], 3), (xs[1], 3), (xs[2], 5), (xs[0], 3), (xs[1], 5)]
    before = poly_jit._cache_size()
    for x, degree in calls:
        try:
            out = np.asarray(poly_jit(x, degree))
        except Exception as e:  # noqa: BLE001
            if _tracer_error(e):
                fail(
                    f"poly_jit(x, {degree}) raised {type(e).__name__}: degree is traced, so range(degree) fails",
                    "mark it static: jax.jit(poly, static_argnums=1) (or static_argnames='degree')",
                )
            if isinstance(e, ValueError) and "hash" in str(e).lower():
                fail(
                    "a static argument is not hashable",
                    "only degree is static; x stays a traced array",
                )
            raise
        xn = np.asarray(x, np.float64)
        expected = sum(xn**k for k in range(degree + 1))
        if out.shape != expected.shape or not np.allclose(out, expected, rtol=1e-5, atol=1e-6):
            fail(
                f"poly_jit(x, {degree}) is wrong (first values {out.ravel()[:3]}, expected {expected[:3]})",
                "sum x**k for k = 0, 1, …, degree (degree + 1 terms, starting at 1)",
            )
    compiled = poly_jit._cache_size() - before
    if compiled > 2:
        fail(
            f"{len(calls)} calls with 2 distinct degrees compiled {compiled} programs",
            "only the degree may be static; a new static value or a new shape is what triggers a compile",
        )
    return passed("poly_jit is right and compiles once per degree")


@checker
def check_pad_batch(pad_batch: Callable) -> bool:
    """Exercise 3: ``pad_batch(x, size) -> (x_padded, mask)`` so that a ragged last batch reuses the compiled step.

    ``x``: float32 [n, d] with ``n <= size``; ``x_padded``: [size, d] with ``x`` in its first ``n`` rows;
    ``mask``: [size], true (or 1.0) for the ``n`` real rows. The checker runs a jitted masked mean over
    batches of 8, 8 and 5 rows and counts its traces.

    Raises:
      ExerciseError: wrong shapes, a mask that counts padding, a wrong mean, or a second trace.
    """
    import jax
    import jax.numpy as jnp

    traces = []

    @jax.jit
    def masked_mean(xp, mask):
        traces.append(xp.shape)  # runs only while tracing: one entry per compile
        m = mask.astype(xp.dtype)
        return (xp * m[:, None]).sum(0) / m.sum()

    rng = np.random.default_rng(0)
    size = 8
    for n in (8, 8, 5):
        x = rng.normal(size=(n, 3)).astype(np.float32)
        out = pad_batch(jnp.asarray(x), size)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            fail(
                "expected a pair (x_padded, mask)",
                "return both: the padded batch and the mask of real rows",
            )
        xp, mask = out
        if tuple(xp.shape) != (size, 3):
            fail(
                f"a batch of {n} rows padded to shape {tuple(xp.shape)}, expected ({size}, 3)",
                "pad the leading axis up to size: jnp.pad(x, ((0, size - n), (0, 0)))",
            )
        if tuple(mask.shape) != (size,):
            fail(
                f"mask shape {tuple(mask.shape)}, expected ({size},)",
                "one mask entry per padded row",
            )
        if int(np.asarray(mask).astype(bool).sum()) != n:
            fail(
                f"the mask marks {int(np.asarray(mask).astype(bool).sum())} rows as real, the batch had {n}",
                "mask = jnp.arange(size) < n",
            )
        if not np.allclose(np.asarray(xp)[:n], x):
            fail(
                "the first rows of x_padded are not x",
                "keep x in the first n rows; put the padding after it",
            )
        got = np.asarray(masked_mean(xp, mask))
        if not np.allclose(got, x.mean(0), rtol=1e-5, atol=1e-6):
            fail(
                f"the masked mean of a {n}-row batch is wrong",
                "the mask must be true exactly for the real rows",
            )
    if len(traces) != 1:
        fail(
            f"the jitted step traced {len(traces)} times, for shapes {traces}",
            "every batch must reach the step with the same shape: pad the ragged batch to size",
        )
    return passed("the ragged batch reuses the compiled step (1 trace for 3 batches)")

"""The exercise checkers of lesson 02 (course_tools.checks.lesson02) accept the reference solutions and
reject typical wrong answers.

Each wrong answer is one a learner plausibly writes; the test asserts on the hint the checker gives.
"""

import jax
import jax.numpy as jnp
import pytest

from course_tools.checks import ExerciseError, lesson02


def rejects(check, answer, *args, match: str):
    with pytest.raises(ExerciseError, match=match):
        check(answer, *args)


def test_leaky_relu():
    assert lesson02.check_leaky_relu(lambda x: jnp.where(x > 0, x, 0.1 * x))

    def python_if(x):
        if x > 0:
            return x
        return 0.1 * x

    rejects(lesson02.check_leaky_relu, python_if, match="jnp.where")
    rejects(lesson02.check_leaky_relu, lambda x: jnp.maximum(x, 0), match="plain ReLU")
    rejects(lesson02.check_leaky_relu, lambda x: jnp.where(x > 0, x, 0.01 * x), match="0.1")


def _poly(x, degree):
    return sum(x**k for k in range(degree + 1))


def test_poly_jit():
    assert lesson02.check_poly_jit(jax.jit(_poly, static_argnums=1))
    rejects(lesson02.check_poly_jit, jax.jit(_poly), match="static_argnums=1")
    rejects(lesson02.check_poly_jit, _poly, match="not a jitted function")
    rejects(
        lesson02.check_poly_jit,
        jax.jit(lambda x, d: sum(x**k for k in range(1, d + 1)), static_argnums=1),
        match="starting at 1",
    )


def test_poly_jit_counts_compiles():
    """An answer that compiles on every call is caught by the compile count (cache growth)."""

    class CompilesEveryCall:  # stands in for a jitted function whose cache grows on each call
        def __init__(self):
            self.n = 0

        def _cache_size(self):
            return self.n

        def lower(self, *args):  # pragma: no cover - only its presence is checked
            raise NotImplementedError

        def __call__(self, x, degree):
            self.n += 1
            return _poly(x, degree)

    rejects(lesson02.check_poly_jit, CompilesEveryCall(), match="compiled 5 programs")


def _pad_batch(x, size):
    n = x.shape[0]
    return jnp.pad(x, ((0, size - n), (0, 0))), jnp.arange(size) < n


def test_pad_batch():
    assert lesson02.check_pad_batch(_pad_batch)
    rejects(
        lesson02.check_pad_batch,
        lambda x, size: (x, jnp.ones(x.shape[0], bool)),
        match=r"padded to shape \(5, 3\)",
    )
    rejects(
        lesson02.check_pad_batch,
        lambda x, size: (_pad_batch(x, size)[0], jnp.ones(size, bool)),
        match="marks 8 rows as real",
    )
    rejects(
        lesson02.check_pad_batch, lambda x, size: _pad_batch(x, size)[0], match="expected a pair"
    )

"""The exercise checkers of lesson 01 (course_tools.checks.lesson01) accept the reference solutions and
reject typical wrong answers.

Each wrong answer is one a learner plausibly writes; the test asserts on the hint the checker gives.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from course_tools.checks import ExerciseError, lesson01


def rejects(check, answer, *args, match: str):
    with pytest.raises(ExerciseError, match=match):
        check(answer, *args)


def test_loss_and_grad():
    def loss(w, x, y):
        return jnp.mean((x @ w - y) ** 2)

    assert lesson01.check_loss_and_grad(jax.value_and_grad(loss))
    rejects(lesson01.check_loss_and_grad, jax.value_and_grad(loss, argnums=1), match="argnums=0")
    rejects(
        lesson01.check_loss_and_grad,
        jax.value_and_grad(lambda w, x, y: jnp.sum((x @ w - y) ** 2)),
        match="use the mean, not the sum",
    )
    rejects(lesson01.check_loss_and_grad, jax.grad(loss), match=r"expected a pair|scalar")


def test_sgd_update():
    assert lesson01.check_sgd_update(lambda p, g, lr: jax.tree.map(lambda a, b: a - lr * b, p, g))
    rejects(
        lesson01.check_sgd_update,
        lambda p, g, lr: jax.tree.map(lambda a, b: a + lr * b, p, g),
        match="uphill",
    )
    rejects(
        lesson01.check_sgd_update,
        lambda p, g, lr: [
            a - lr * b for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(g), strict=True)
        ],
        match="jax.tree.map",
    )
    rejects(
        lesson01.check_sgd_update,
        lambda p, g, lr: jax.tree.map(lambda a, b: a - b, p, g),
        match="p - lr",
    )


def _dropout(key, x, rate):
    keep = jax.random.bernoulli(key, 1 - rate, x.shape)
    return jnp.where(keep, x / (1 - rate), 0)


def test_dropout():
    assert lesson01.check_dropout(_dropout)
    rng = np.random.default_rng()
    rejects(
        lesson01.check_dropout,
        lambda k, x, r: x * (rng.random(x.shape) > r) / (1 - r),
        match="not pure",
    )
    rejects(
        lesson01.check_dropout,
        lambda k, x, r: jnp.where(jax.random.bernoulli(k, 1 - r, x.shape), x, 0),
        match=r"1 / \(1 - rate\)",
    )
    rejects(
        lesson01.check_dropout,
        lambda k, x, r: _dropout(jax.random.key(0), x, r),
        match="use the key",
    )
    rejects(
        lesson01.check_dropout,
        lambda k, x, r: jnp.where(jax.random.bernoulli(k, r, x.shape), x / r, 0),
        match="probability 1 - rate",
    )

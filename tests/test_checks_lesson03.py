"""The exercise checkers of lesson 03 (course_tools.checks.lesson03) accept the reference solutions and
reject typical wrong answers.

Each wrong answer is one a learner plausibly writes; the test asserts on the hint the checker gives.
"""

import jax
import jax.numpy as jnp
import pytest

from course_tools.checks import ExerciseError, lesson00, lesson03


def rejects(check, answer, *args, match: str):
    with pytest.raises(ExerciseError, match=match):
        check(answer, *args)


def _cos(a, b):
    return jnp.dot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b))


def test_cosine():
    assert lesson03.check_cosine(_cos)
    rejects(lesson03.check_cosine, lambda a, b: jnp.dot(a, b), match="divide by both norms")
    rejects(
        lesson03.check_cosine,
        lambda a, b: a * b / (jnp.linalg.norm(a) * jnp.linalg.norm(b)),
        match="expected a scalar",
    )
    rejects(
        lesson03.check_cosine,
        lambda a, b: jnp.dot(a, b) / jnp.linalg.norm(a) ** 2,
        match=r"outside \[-1, 1\]|reference",
    )


def test_pairwise():
    assert lesson03.check_pairwise(jax.vmap(jax.vmap(_cos, in_axes=(None, 0)), in_axes=(0, None)))
    rejects(
        lesson03.check_pairwise,
        jax.vmap(jax.vmap(_cos, in_axes=(0, None)), in_axes=(None, 0)),
        match="transposed",
    )
    rejects(
        lesson03.check_pairwise, lambda a, b: jax.vmap(_cos)(a[: len(b)], b), match="nest two vmaps"
    )


def test_per_example_grads():
    def ref(loss_fn, params, xs, ys):
        return jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0))(params, xs, ys)

    assert lesson03.check_per_example_grads(ref)
    rejects(
        lesson03.check_per_example_grads,
        lambda f, p, xs, ys: jax.grad(
            lambda p: jax.vmap(f, in_axes=(None, 0, 0))(p, xs, ys).mean()
        )(p),
        match="no per-example axis",
    )
    rejects(
        lesson03.check_per_example_grads,
        lambda f, p, xs, ys: jax.vmap(jax.grad(f), in_axes=(0, 0, 0))(p, xs, ys),
        match="in_axes=\\(None, 0, 0\\)",
    )
    rejects(
        lesson03.check_per_example_grads,
        lambda f, p, xs, ys: jax.vmap(jax.grad(f, argnums=0), in_axes=(None, 0, 0))(p, xs, -ys),
        match="wrong values",
    )


def test_student_stub_is_not_written_yet(monkeypatch, capsys):
    """The student stub: strict (the test suite) raises "not written yet"; a learner's run prints the
    hint and the checker returns False, so the notebook goes on."""
    from course_tools.checks import NotWritten

    def stub(*args):
        raise NotImplementedError("Exercise: write this part")

    for check in (lesson03.check_cosine, lesson00.check_parameters_cell):
        with pytest.raises(NotWritten, match="not written yet"):
            check(stub)
    monkeypatch.delenv("COURSE_STRICT_CHECKS")
    assert lesson03.check_cosine(stub) is False
    assert "not written yet" in capsys.readouterr().out

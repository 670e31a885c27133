"""The exercise checkers of lessons 00-03 accept the reference solutions and reject typical wrong answers.

Each wrong answer is one a learner plausibly writes; the test asserts on the hint the checker gives.
"""

import ast

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from course_tools.checks import ExerciseError, lesson00, lesson01, lesson02, lesson03


def rejects(check, answer, *args, match: str):
    with pytest.raises(ExerciseError, match=match):
        check(answer, *args)


# ---------------------------------------------------------------- lesson 00


def test_xla_flags():
    assert lesson00.check_xla_flags(lambda n: f"--xla_force_host_platform_device_count={n}")
    rejects(lesson00.check_xla_flags, lambda n: f"\u2013xla_force_host_platform_device_count={n}", match="typographic dash")
    rejects(lesson00.check_xla_flags, lambda n: f"xla_force_host_platform_device_count={n}", match="must start with '--'")
    rejects(lesson00.check_xla_flags, lambda n: "--xla_force_host_platform_device_count=8", match="use the argument n")
    rejects(lesson00.check_xla_flags, lambda n: f"--xla_force_host_device_count={n}", match="check the spelling")
    rejects(lesson00.check_xla_flags, lambda n: n, match="not a string")


def test_one_array_per_device(report):
    devices = report.devices
    assert lesson00.check_one_array_per_device(
        lambda ds: [jax.device_put(jnp.full(3, i), d) for i, d in enumerate(ds)], devices
    )
    rejects(lesson00.check_one_array_per_device, lambda ds: [jnp.full(3, i) for i, _ in enumerate(ds)], devices,
            match="jax.device_put")
    rejects(lesson00.check_one_array_per_device, lambda ds: [jax.device_put(jnp.full(3, 1), d) for d in ds], devices,
            match=r"three copies of i")
    rejects(lesson00.check_one_array_per_device, lambda ds: [jnp.zeros(3)], devices, match="one array for each device")


def _plain_reference(source):
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    return _plain_tree(tree)


def _plain_tree(tree):
    for stmt in tree.body:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            return False
        try:
            ast.literal_eval(stmt.value)
        except ValueError:
            return False
    return True


def test_parameters_cell():
    assert lesson00.check_parameters_cell(_plain_reference)
    rejects(lesson00.check_parameters_cell, lambda s: "import" not in s, match="a call on the right-hand side")

    def no_syntax_guard(source):  # forgets that ast.parse raises on a broken cell
        return _plain_tree(ast.parse(source))

    rejects(lesson00.check_parameters_cell, no_syntax_guard, match="catch SyntaxError")
    rejects(lesson00.check_parameters_cell, lambda s: all("=" in ln for ln in s.splitlines() if ln.strip()),
            match="comments, blank lines")


# ---------------------------------------------------------------- lesson 01


def test_loss_and_grad():
    def loss(w, x, y):
        return jnp.mean((x @ w - y) ** 2)

    assert lesson01.check_loss_and_grad(jax.value_and_grad(loss))
    rejects(lesson01.check_loss_and_grad, jax.value_and_grad(loss, argnums=1), match="argnums=0")
    rejects(lesson01.check_loss_and_grad, jax.value_and_grad(lambda w, x, y: jnp.sum((x @ w - y) ** 2)),
            match="use the mean, not the sum")
    rejects(lesson01.check_loss_and_grad, jax.grad(loss), match=r"expected a pair|scalar")


def test_sgd_update():
    assert lesson01.check_sgd_update(lambda p, g, lr: jax.tree.map(lambda a, b: a - lr * b, p, g))
    rejects(lesson01.check_sgd_update, lambda p, g, lr: jax.tree.map(lambda a, b: a + lr * b, p, g), match="uphill")
    rejects(lesson01.check_sgd_update, lambda p, g, lr: [a - lr * b for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(g))],
            match="jax.tree.map")
    rejects(lesson01.check_sgd_update, lambda p, g, lr: jax.tree.map(lambda a, b: a - b, p, g), match="p - lr")


def _dropout(key, x, rate):
    keep = jax.random.bernoulli(key, 1 - rate, x.shape)
    return jnp.where(keep, x / (1 - rate), 0)


def test_dropout():
    assert lesson01.check_dropout(_dropout)
    rng = np.random.default_rng()
    rejects(lesson01.check_dropout, lambda k, x, r: x * (rng.random(x.shape) > r) / (1 - r), match="not pure")
    rejects(lesson01.check_dropout, lambda k, x, r: jnp.where(jax.random.bernoulli(k, 1 - r, x.shape), x, 0),
            match=r"1 / \(1 - rate\)")
    rejects(lesson01.check_dropout, lambda k, x, r: _dropout(jax.random.key(0), x, r), match="use the key")
    rejects(lesson01.check_dropout, lambda k, x, r: jnp.where(jax.random.bernoulli(k, r, x.shape), x / r, 0),
            match="probability 1 - rate")


# ---------------------------------------------------------------- lesson 02


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
    rejects(lesson02.check_poly_jit, jax.jit(lambda x, d: sum(x**k for k in range(1, d + 1)), static_argnums=1),
            match="starting at 1")


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
    rejects(lesson02.check_pad_batch, lambda x, size: (x, jnp.ones(x.shape[0], bool)), match=r"padded to shape \(5, 3\)")
    rejects(lesson02.check_pad_batch, lambda x, size: (_pad_batch(x, size)[0], jnp.ones(size, bool)),
            match="marks 8 rows as real")
    rejects(lesson02.check_pad_batch, lambda x, size: _pad_batch(x, size)[0], match="expected a pair")


# ---------------------------------------------------------------- lesson 03


def _cos(a, b):
    return jnp.dot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b))


def test_cosine():
    assert lesson03.check_cosine(_cos)
    rejects(lesson03.check_cosine, lambda a, b: jnp.dot(a, b), match="divide by both norms")
    rejects(lesson03.check_cosine, lambda a, b: a * b / (jnp.linalg.norm(a) * jnp.linalg.norm(b)), match="expected a scalar")
    rejects(lesson03.check_cosine, lambda a, b: jnp.dot(a, b) / jnp.linalg.norm(a) ** 2, match=r"outside \[-1, 1\]|reference")


def test_pairwise():
    assert lesson03.check_pairwise(jax.vmap(jax.vmap(_cos, in_axes=(None, 0)), in_axes=(0, None)))
    rejects(lesson03.check_pairwise, jax.vmap(jax.vmap(_cos, in_axes=(0, None)), in_axes=(None, 0)), match="transposed")
    rejects(lesson03.check_pairwise, lambda a, b: jax.vmap(_cos)(a[: len(b)], b), match="nest two vmaps")


def test_per_example_grads():
    def ref(loss_fn, params, xs, ys):
        return jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0))(params, xs, ys)

    assert lesson03.check_per_example_grads(ref)
    rejects(lesson03.check_per_example_grads,
            lambda f, p, xs, ys: jax.grad(lambda p: jax.vmap(f, in_axes=(None, 0, 0))(p, xs, ys).mean())(p),
            match="no per-example axis")
    rejects(lesson03.check_per_example_grads,
            lambda f, p, xs, ys: jax.vmap(jax.grad(f), in_axes=(0, 0, 0))(p, xs, ys), match="in_axes=\\(None, 0, 0\\)")
    rejects(lesson03.check_per_example_grads,
            lambda f, p, xs, ys: jax.vmap(jax.grad(f, argnums=0), in_axes=(None, 0, 0))(p, xs, -ys), match="wrong values")


def test_student_stub_is_rejected():
    """The student stub raises NotImplementedError; the checker lets it through (the cell fails visibly)."""

    def stub(*args):
        raise NotImplementedError("Exercise: write this part")

    with pytest.raises(NotImplementedError):
        lesson03.check_cosine(stub)
    with pytest.raises(NotImplementedError):
        lesson00.check_parameters_cell(stub)

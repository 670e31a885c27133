"""The checkers of lesson 03 (course_tools.checks.lesson03) accept correct answers in several forms and
reject typical wrong ones, each with its own hint; an unwritten answer prints its hint (or raises under
COURSE_STRICT_CHECKS=1)."""

import jax
import jax.numpy as jnp
import numpy as np
from checking import not_written
from checking import rejects_written as rejects
from checking import stub as _stub
from jax import lax

from course_tools.checks import lesson03

# ---------------------------------------------------------------- exercise 1


def _pairwise(f, A, B):
    return jax.vmap(jax.vmap(f, in_axes=(None, 0)), in_axes=(0, None))(A, B)


def _pairwise_inner_a(f, A, B):  # another correct form: map B outside, A inside, then move the axes
    out = jax.vmap(jax.vmap(f, in_axes=(0, None)), in_axes=(None, 0))(A, B)  # [m, n, ...]
    return jnp.swapaxes(out, 0, 1)


def test_pairwise_accepts_correct_forms():
    assert lesson03.check_pairwise(_pairwise)
    assert lesson03.check_pairwise(_pairwise_inner_a)
    assert lesson03.check_pairwise(
        lambda f, A, B: jax.vmap(lambda a: jax.vmap(lambda b: f(a, b))(B))(A)
    )


def test_pairwise_stub(monkeypatch, capsys):
    not_written(lesson03.check_pairwise, _stub, monkeypatch=monkeypatch, capsys=capsys)


def test_pairwise_wrong_answers():
    # the hole of the old checker: a broadcasting answer without vmap
    rejects(
        lesson03.check_pairwise,
        lambda f, A, B: f(A[:, None, :], B[None, :, :]),
        match="batched arrays",
    )
    rejects(
        lesson03.check_pairwise,
        lambda f, A, B: jnp.array([[f(a, b) for b in B] for a in A]),
        match="Python loop",
    )
    rejects(
        lesson03.check_pairwise,
        lambda f, A, B: jax.vmap(jax.vmap(f, in_axes=(0, None)), in_axes=(None, 0))(A, B),
        match="transposed",
    )
    rejects(lesson03.check_pairwise, lambda f, A, B: jax.vmap(f)(A[: len(B)], B), match="nested")


# ---------------------------------------------------------------- exercise 2

RIGHT = {"a": (3,), "b": (5, 3), "c": (), "d": (3, 3), "e": (3,), "g": (5, 3)}


def test_batched_shapes_measured():
    assert lesson03.measure_batched() == RIGHT


def test_batched_shapes_accept_correct_forms():
    assert lesson03.check_batched_shapes(RIGHT)
    assert lesson03.check_batched_shapes({k: list(v) for k, v in RIGHT.items()})  # lists
    assert lesson03.check_batched_shapes(
        {k: tuple(np.int64(s) for s in v) for k, v in RIGHT.items()}
    )


def test_batched_shapes_stub(monkeypatch, capsys):
    not_written(
        lesson03.check_batched_shapes,
        dict.fromkeys("abcdeg"),
        monkeypatch=monkeypatch,
        capsys=capsys,
    )


def test_batched_shapes_wrong_answers():
    everything = {
        "a": (5, 3),
        "b": (5, 3),
        "c": (5,),
        "d": (5, 3, 3),
        "e": (5, 3),
        "g": (5, 3),
    }  # "every intermediate"
    rejects(lesson03.check_batched_shapes, everything, match=r"for a .*\n.*read x")
    rejects(
        lesson03.check_batched_shapes, {**RIGHT, "g": (3,)}, match="scatter"
    )  # the update's dependence missed
    rejects(
        lesson03.check_batched_shapes, {**RIGHT, "e": (5, 3)}, match="from w alone"
    )  # any scatter is batched
    rejects(lesson03.check_batched_shapes, {**RIGHT, "c": 1}, match="not a shape tuple")


# ---------------------------------------------------------------- exercise 3


def _batch_norm(x):
    mean = lax.pmean(x, "batch")
    var = lax.pmean((x - mean) ** 2, "batch")
    return (x - mean) / jnp.sqrt(var + 1e-5)


def _batch_norm_psum(x):  # another correct form: psum and the axis size
    n = lax.psum(1, "batch")
    mean = lax.psum(x, "batch") / n
    var = lax.psum(x**2, "batch") / n - mean**2
    return (x - mean) * lax.rsqrt(var + 1e-5)


def _layer_norm(x):  # the bug: statistics over the example's own features
    mean = x.mean()
    var = ((x - mean) ** 2).mean()
    return (x - mean) / jnp.sqrt(var + 1e-5)


def test_batch_norm_accepts_correct_forms(report):
    assert lesson03.check_batch_norm(_batch_norm, report.devices)
    assert lesson03.check_batch_norm(_batch_norm_psum, report.devices)
    assert lesson03.check_batch_norm(_batch_norm)  # without the pmap part


def test_batch_norm_stub(report, monkeypatch, capsys):
    not_written(
        lesson03.check_batch_norm, _stub, report.devices, monkeypatch=monkeypatch, capsys=capsys
    )


def test_batch_norm_wrong_answers(report):
    rejects(lesson03.check_batch_norm, _layer_norm, report.devices, match="layer norm")
    rejects(
        lesson03.check_batch_norm,
        lambda x: (
            (x - lax.psum(x, "batch"))
            / jnp.sqrt(lax.psum((x - lax.psum(x, "batch")) ** 2, "batch") + 1e-5)
        ),
        report.devices,
        match="sums over the batch",
    )
    rejects(
        lesson03.check_batch_norm,
        lambda x: (x - lax.pmean(x, "batch")) / jnp.sqrt(lax.pmean(x**2, "batch") + 1e-5),
        report.devices,
        match=r"mean of \(x - mean\) \*\* 2",
    )
    rejects(
        lesson03.check_batch_norm,
        lambda x: (x - lax.pmean(x, "i")) / jnp.sqrt(lax.pmean((x - lax.pmean(x, "i")) ** 2, "i")),
        report.devices,
        match='axis name "batch"',
    )


# ---------------------------------------------------------------- exercise 4


def _clipped(loss_fn, params, xs, ys, max_norm):
    g = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0))(params, xs, ys)
    n = xs.shape[0]
    sq = sum(jnp.sum(leaf.reshape(n, -1) ** 2, axis=1) for leaf in jax.tree.leaves(g))
    scale = jnp.minimum(1.0, max_norm / jnp.maximum(jnp.sqrt(sq), 1e-12))
    return jax.tree.map(
        lambda leaf: jnp.mean(leaf * scale.reshape((n,) + (1,) * (leaf.ndim - 1)), 0), g
    )


def _clipped_per_example_fn(
    loss_fn, params, xs, ys, max_norm
):  # another correct form: clip inside the vmapped fn
    def one(x, y):
        g = jax.grad(loss_fn)(params, x, y)
        norm = jnp.sqrt(sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(g)))
        s = jnp.minimum(1.0, max_norm / (norm + 1e-12))
        return jax.tree.map(lambda leaf: leaf * s, g)

    return jax.tree.map(lambda leaf: leaf.mean(0), jax.vmap(one)(xs, ys))


def _batch_clipped(loss_fn, params, xs, ys, max_norm):
    g = jax.grad(lambda p: jax.vmap(loss_fn, in_axes=(None, 0, 0))(p, xs, ys).mean())(params)
    norm = jnp.sqrt(sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(g)))
    return jax.tree.map(lambda leaf: leaf * jnp.minimum(1.0, max_norm / norm), g)


def _per_leaf(loss_fn, params, xs, ys, max_norm):
    g = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0))(params, xs, ys)

    def clip(leaf):
        norms = jnp.sqrt(jnp.sum(leaf.reshape(leaf.shape[0], -1) ** 2, axis=1))
        s = jnp.minimum(1.0, max_norm / norms)
        return jnp.mean(leaf * s.reshape((-1,) + (1,) * (leaf.ndim - 1)), 0)

    return jax.tree.map(clip, g)


def _scales_up(loss_fn, params, xs, ys, max_norm):
    g = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0))(params, xs, ys)
    n = xs.shape[0]
    sq = sum(jnp.sum(leaf.reshape(n, -1) ** 2, axis=1) for leaf in jax.tree.leaves(g))
    scale = max_norm / jnp.sqrt(sq)  # no min(1, .)
    return jax.tree.map(
        lambda leaf: jnp.mean(leaf * scale.reshape((n,) + (1,) * (leaf.ndim - 1)), 0), g
    )


def _python_min(loss_fn, params, xs, ys, max_norm):
    out = []
    for x, y in zip(xs, ys):
        g = jax.grad(loss_fn)(params, x, y)
        norm = float(jnp.sqrt(sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(g))))
        scale = min(1.0, max_norm / norm)  # a Python float: fails under jit
        out.append(jax.tree.map(lambda leaf, s=scale: leaf * s, g))
    return jax.tree.map(lambda *ls: sum(ls) / len(ls), *out)


def test_clipped_grad_accepts_correct_forms():
    assert lesson03.check_clipped_grad(_clipped)
    assert lesson03.check_clipped_grad(_clipped_per_example_fn)


def test_clipped_grad_stub(monkeypatch, capsys):
    not_written(lesson03.check_clipped_grad, _stub, monkeypatch=monkeypatch, capsys=capsys)


def test_clipped_grad_wrong_answers():
    rejects(lesson03.check_clipped_grad, _batch_clipped, match="not each example's")
    rejects(lesson03.check_clipped_grad, _per_leaf, match="own norm")
    rejects(lesson03.check_clipped_grad, _scales_up, match="scaled up")
    rejects(
        lesson03.check_clipped_grad,
        lambda *a: jax.tree.map(lambda leaf: 8 * leaf, _clipped(*a)),
        match="8x",
    )
    rejects(lesson03.check_clipped_grad, _python_min, match="jax.jit")

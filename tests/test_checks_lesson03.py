"""The checkers of lesson 03 (course_tools.checks.lesson03) accept correct answers in several forms and
reject typical wrong ones, each with its own hint; an unwritten answer prints its hint (or raises under
COURSE_STRICT_CHECKS=1)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from checking import TOLERANCES, not_written, use_tolerance
from checking import rejects_written as rejects
from checking import stub as _stub
from jax import lax

from course_tools.checks import ExerciseError, lesson03

# ---------------------------------------------------------------- exercise 1


def _init_vmap(init, key, members):
    return jax.vmap(init)(jax.random.split(key, members))


def _predict(apply, stacked, key, x):
    members = jax.tree.leaves(stacked)[0].shape[0]

    def member(params, member_key):
        keys = jax.random.split(member_key, x.shape[0])
        return jax.vmap(apply, in_axes=(None, 0, 0))(params, keys, x)

    return jax.vmap(member)(stacked, jax.random.split(key, members))


def ensemble_of(init_part, predict_part):
    def ensemble(init, apply, init_key, dropout_key, x, members):
        stacked = init_part(init, init_key, members)
        return stacked, predict_part(apply, stacked, dropout_key, x)

    return ensemble


def _init_by_loop(init, key, members):  # another correct form: a loop over members, then a stack
    inits = [init(k) for k in jax.random.split(key, members)]
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *inits)


def _predict_keys_first(apply, stacked, key, x):  # another correct form: all keys made up front
    members, batch = jax.tree.leaves(stacked)[0].shape[0], x.shape[0]
    keys = jax.vmap(lambda k: jax.random.split(k, batch))(jax.random.split(key, members))
    inner = jax.vmap(apply, in_axes=(None, 0, 0))
    return jax.vmap(inner, in_axes=(0, 0, None))(stacked, keys, x)


def _fold_in_keys(apply, stacked, key, x):  # another correct form: fold_in(k, i) = split(k, n)[i]
    members = jax.tree.leaves(stacked)[0].shape[0]

    def member(params, m):
        fold = jax.random.fold_in
        keys = jax.vmap(lambda b: fold(fold(key, m), b))(jnp.arange(x.shape[0]))
        return jax.vmap(apply, in_axes=(None, 0, 0))(params, keys, x)

    return jax.vmap(member)(stacked, jnp.arange(members))


def test_ensemble_accepts_correct_forms():
    assert lesson03.check_ensemble(ensemble_of(_init_vmap, _predict))
    assert lesson03.check_ensemble(ensemble_of(_init_by_loop, _predict_keys_first))
    assert lesson03.check_ensemble(ensemble_of(_init_vmap, _fold_in_keys))


def test_ensemble_stub(monkeypatch, capsys):
    not_written(lesson03.check_ensemble, _stub, monkeypatch=monkeypatch, capsys=capsys)


def _one_key_per_member(apply, stacked, key, x):  # examples share their member's dropout mask
    members = jax.tree.leaves(stacked)[0].shape[0]
    one = jax.vmap(apply, in_axes=(None, None, 0))
    return jax.vmap(one, in_axes=(0, 0, None))(stacked, jax.random.split(key, members), x)


def _members_share_keys(apply, stacked, key, x):  # every member splits the same key
    keys = jax.random.split(key, x.shape[0])
    one = jax.vmap(apply, in_axes=(None, 0, 0))
    return jax.vmap(one, in_axes=(0, None, None))(stacked, keys, x)


def _unmapped_params(apply, stacked, key, x):  # the stacked params handed to apply whole
    keys = jax.random.split(key, x.shape[0])
    return jax.vmap(apply, in_axes=(None, 0, 0))(stacked, keys, x)


def _loop_over_members(apply, stacked, key, x):
    members = jax.tree.leaves(stacked)[0].shape[0]
    outs = []
    for m, k in enumerate(jax.random.split(key, members)):
        params = jax.tree.map(lambda a, m=m: a[m], stacked)
        keys = jax.random.split(k, x.shape[0])
        outs.append(jax.vmap(apply, in_axes=(None, 0, 0))(params, keys, x))
    return jnp.stack(outs)


def _grid_of_keys(apply, stacked, key, x):  # right too: independent keys, one split into a grid
    members, batch = jax.tree.leaves(stacked)[0].shape[0], x.shape[0]
    keys = jax.random.split(key, (members, batch))
    inner = jax.vmap(apply, in_axes=(None, 0, 0))
    return jax.vmap(inner, in_axes=(0, 0, None))(stacked, keys, x)


def _flat_split(apply, stacked, key, x):  # right too: split(dropout_key, members * batch), reshaped
    members, batch = jax.tree.leaves(stacked)[0].shape[0], x.shape[0]
    keys = jax.random.split(key, members * batch).reshape(members, batch)
    inner = jax.vmap(apply, in_axes=(None, 0, 0))
    return jax.vmap(inner, in_axes=(0, 0, None))(stacked, keys, x)


def test_ensemble_judges_independent_keys_not_one_derivation():
    assert lesson03.check_ensemble(ensemble_of(_init_vmap, _grid_of_keys))
    assert lesson03.check_ensemble(ensemble_of(_init_vmap, _flat_split))


def _fixed_key(apply, stacked, key, x):  # WRONG: the masks do not come from dropout_key
    return _predict(apply, stacked, jax.random.key(0), x)


def _dropout_from_init_key(
    init, apply, init_key, dropout_key, x, members
):  # WRONG: init_key reused
    stacked = _init_vmap(init, init_key, members)
    return stacked, _predict(apply, stacked, jax.random.fold_in(init_key, 1), x)


def _rows_shifted(apply, stacked, key, x):  # WRONG: example b gets row b + 1's input
    return _predict(apply, stacked, key, jnp.roll(x, 1, axis=0))


def _members_collide(apply, stacked, key, x):  # WRONG: member 2 reuses member 1's keys
    members, batch = jax.tree.leaves(stacked)[0].shape[0], x.shape[0]
    member_keys = jax.random.split(key, members)
    member_keys = jnp.stack([member_keys[0], member_keys[1], member_keys[1], member_keys[3]])
    keys = jax.vmap(lambda k: jax.random.split(k, batch))(member_keys)
    inner = jax.vmap(apply, in_axes=(None, 0, 0))
    return jax.vmap(inner, in_axes=(0, 0, None))(stacked, keys, x)


@pytest.mark.parametrize("tolerance", TOLERANCES)
def test_ensemble_wrong_answers(monkeypatch, tolerance):
    use_tolerance(monkeypatch, tolerance)  # refused at this platform's tolerance, and at a TPU's
    check = lesson03.check_ensemble
    assert check(ensemble_of(_init_vmap, _predict))
    same_members = lambda init, key, m: jax.vmap(init)(jnp.stack([key] * m))  # noqa: E731
    rejects(check, ensemble_of(same_members, _predict), match="same parameters")
    shifted = lambda init, key, m: jax.vmap(init)(jax.random.split(key, m + 1)[1:])  # noqa: E731
    rejects(check, ensemble_of(shifted, _predict), match=r"member 0 is not init")
    rejects(check, ensemble_of(_init_vmap, _one_key_per_member), match="share one dropout key")
    rejects(check, ensemble_of(_init_vmap, _members_share_keys), match="share their example keys")
    rejects(check, ensemble_of(_init_vmap, _unmapped_params), match="stacked parameters")
    rejects(check, ensemble_of(_init_vmap, _loop_over_members), match="Python loop")
    rejects(check, ensemble_of(_init_vmap, _fixed_key), match="do not come from dropout_key")
    rejects(check, _dropout_from_init_key, match="another init_key changed")
    rejects(check, ensemble_of(_init_vmap, _rows_shifted), match=r"not apply\(member m")
    rejects(check, ensemble_of(_init_vmap, _members_collide), match="drew the same dropout mask")
    not_stacked = lambda init, key, m: init(key)  # noqa: E731
    rejects(check, ensemble_of(not_stacked, _predict), match="not stacked")


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
    everything = {"a": (5, 3), "b": (5, 3), "c": (5,), "d": (5, 3, 3), "e": (5, 3), "g": (5, 3)}
    rejects(lesson03.check_batched_shapes, everything, match="4 of your 6 shapes")
    rejects(lesson03.check_batched_shapes, {**RIGHT, "g": (3,)}, match="1 of your 6")
    rejects(
        lesson03.check_batched_shapes, {**RIGHT, "e": (5, 3)}, match="1 of your 6"
    )  # the review's
    rejects(lesson03.check_batched_shapes, {**RIGHT, "c": (1,)}, match="1 of your 6")
    rejects(lesson03.check_batched_shapes, {**RIGHT, "c": 1}, match="not a shape tuple")


def test_batched_shapes_never_name_the_wrong_case():
    messages = set()
    for name in RIGHT:
        with pytest.raises(ExerciseError) as e:
            lesson03.check_batched_shapes({**RIGHT, name: (7, 7)})
        messages.add(str(e.value))
    assert len(messages) == 1


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


def _batch_norm_moments(x):  # another correct form: E[x^2] - E[x]^2, both pmean'd at once
    m1, m2 = lax.pmean((x, x * x), "batch")
    return (x - m1) / jnp.sqrt(m2 - m1 * m1 + 1e-5)


def test_batch_norm_accepts_correct_forms(report):
    assert lesson03.check_batch_norm(_batch_norm, report.devices)
    assert lesson03.check_batch_norm(_batch_norm_psum, report.devices)
    assert lesson03.check_batch_norm(_batch_norm_moments, report.devices)
    assert lesson03.check_batch_norm(_batch_norm)  # without the pmap part


def test_batch_norm_stub(report, monkeypatch, capsys):
    not_written(
        lesson03.check_batch_norm, _stub, report.devices, monkeypatch=monkeypatch, capsys=capsys
    )


def _norm_with(eps_inside=None, eps_outside=0.0, ddof=0):
    def norm(x):
        mean = lax.pmean(x, "batch")
        n = lax.psum(1, "batch")
        var = lax.psum((x - mean) ** 2, "batch") / (n - ddof)
        return (x - mean) / (jnp.sqrt(var + (eps_inside or 0.0)) + eps_outside)

    return norm


def test_batch_norm_refuses_a_wrong_epsilon(report):
    """The review's wrong answers (no epsilon, epsilon outside the root) passed the old data."""
    quiet = "variance is about 1e-06 is normalised wrongly"
    rejects(lesson03.check_batch_norm, _norm_with(None), report.devices, match=quiet)
    rejects(lesson03.check_batch_norm, _norm_with(None, 1e-5), report.devices, match=quiet)
    rejects(lesson03.check_batch_norm, _norm_with(1e-3), report.devices, match=quiet)
    rejects(lesson03.check_batch_norm, _norm_with(1e-5, ddof=1), report.devices, match="n - 1")


def _frozen_statistics(x):  # right values, but no gradient through the batch's mean and variance
    mean = lax.stop_gradient(lax.pmean(x, "batch"))
    var = lax.stop_gradient(lax.pmean((x - mean) ** 2, "batch"))
    return (x - mean) * lax.rsqrt(var + 1e-5)


def _frozen_variance(x):  # the mean differentiated, the variance not
    mean = lax.pmean(x, "batch")
    var = lax.stop_gradient(lax.pmean((x - mean) ** 2, "batch"))
    return (x - mean) / jnp.sqrt(var + 1e-5)


def test_batch_norm_wrong_answers(report):
    rejects(lesson03.check_batch_norm, _layer_norm, report.devices, match="layer norm")
    rejects(
        lesson03.check_batch_norm, _frozen_statistics, match="gradient with respect to the batch"
    )
    rejects(lesson03.check_batch_norm, _frozen_variance, match="gradient with respect to the batch")
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


def _clipped_optax(loss_fn, params, xs, ys, max_norm):  # another correct form (the review's)
    clip = optax.clip_by_global_norm(max_norm)

    def one(x, y):
        g = jax.grad(loss_fn)(params, x, y)
        return clip.update(g, clip.init(g))[0]

    return jax.tree.map(lambda leaf: leaf.mean(0), jax.vmap(one)(xs, ys))


def _w_norm_only(loss_fn, params, xs, ys, max_norm):  # the review's misdiagnosed wrong answer
    g = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0))(params, xs, ys)
    scale = jnp.minimum(1.0, max_norm / jnp.linalg.norm(g["w"], axis=1))
    return jax.tree.map(
        lambda leaf: jnp.mean(leaf * scale.reshape((-1,) + (1,) * (leaf.ndim - 1)), 0), g
    )


def _mean_scale_times_mean_grad(loss_fn, params, xs, ys, max_norm):  # the review's wrong answer
    g = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0))(params, xs, ys)
    n = xs.shape[0]
    sq = sum(jnp.sum(leaf.reshape(n, -1) ** 2, axis=1) for leaf in jax.tree.leaves(g))
    scale = jnp.minimum(1.0, max_norm / jnp.sqrt(sq)).mean()
    return jax.tree.map(lambda leaf: scale * leaf.mean(0), g)


def _no_clipping(
    loss_fn, params, xs, ys, max_norm
):  # per-example gradients, averaged, never clipped
    grads = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0))(params, xs, ys)
    return jax.tree.map(lambda g: g.mean(axis=0), grads)


def test_clipped_grad_accepts_correct_forms():
    assert lesson03.check_clipped_grad(_clipped)
    assert lesson03.check_clipped_grad(_clipped_per_example_fn)
    assert lesson03.check_clipped_grad(_clipped_optax)


def test_clipped_grad_stub(monkeypatch, capsys):
    not_written(lesson03.check_clipped_grad, _stub, monkeypatch=monkeypatch, capsys=capsys)


@pytest.mark.parametrize("tolerance", TOLERANCES)
def test_clipped_grad_wrong_answers(monkeypatch, tolerance):
    use_tolerance(monkeypatch, tolerance)  # refused at this platform's tolerance, and at a TPU's
    assert lesson03.check_clipped_grad(_clipped)
    rejects(lesson03.check_clipped_grad, _batch_clipped, match="not each example's")
    rejects(lesson03.check_clipped_grad, _no_clipping, match="no example.s gradient was clipped")
    rejects(lesson03.check_clipped_grad, _per_leaf, match="own norm")
    rejects(lesson03.check_clipped_grad, _mean_scale_times_mean_grad, match="differs from a loop")
    rejects(lesson03.check_clipped_grad, _w_norm_only, match="one leaf \\(w\\) only")
    rejects(lesson03.check_clipped_grad, _scales_up, match="scaled up")
    rejects(
        lesson03.check_clipped_grad,
        lambda *a: jax.tree.map(lambda leaf: 8 * leaf, _clipped(*a)),
        match="8x",
    )
    rejects(lesson03.check_clipped_grad, _python_min, match="jax.jit")

"""Checkers for ``03_vmap.ipynb``: every pair, which values get batched, batch statistics, clipped gradients.

The checkers use black-box per-example functions that refuse batched input (so only a vmap can apply them),
read shapes from the vmapped jaxpr, compare batch statistics with NumPy's over the batch axis, and compare
clipped gradients with a loop over examples of an analytic gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from ._common import call_answer, checker, fail, not_written, passed

# ---------------------------------------------------------------- exercise 1: every pair


def _batched_input(e: BaseException):
    if isinstance(e, TypeError) and "ONE pair" in str(e):
        return (
            f"f received batched arrays: {e}",
            "f works on one pair only: let vmap hand it one row of A and "
            "one row of B (two vmaps, nested)",
        )
    return None


@checker
def check_pairwise(pairwise: Callable) -> bool:
    """Exercise 1: ``pairwise(f, A, B)[i, j] == f(A[i], B[j])`` for any per-pair ``f`` of two float32 [d] vectors.

    The ``f`` the checker passes refuses anything but one pair (its Python body checks the rank) and counts
    how often its Python body runs; one returns a scalar, one a vector (the result is then [n, m, k]).

    Raises:
      ExerciseError: ``f`` given batched arrays (broadcasting instead of vmap), a Python loop (``f`` traced once
        per pair), transposed or wrong-shaped results, wrong values.
    """
    import jax.numpy as jnp

    runs = []

    def one_pair_only(fn):
        def f(a, b):
            runs.append(1)
            if a.ndim != 1 or b.ndim != 1:
                raise TypeError(
                    f"this f takes ONE pair of vectors, got shapes {a.shape} and {b.shape}"
                )
            return fn(a, b)

        return f

    rng = np.random.default_rng(1)
    A = rng.normal(size=(7, 5)).astype(np.float32)
    B = rng.normal(size=(4, 5)).astype(np.float32)
    cases = [
        (
            "a cosine",
            lambda a, b: jnp.dot(a, b) / jnp.sqrt(jnp.dot(a, a) * jnp.dot(b, b)),
            lambda a, b: a @ b / np.sqrt((a @ a) * (b @ b)),
            (),
        ),
        (
            "a weighted difference",
            lambda a, b: (a - b) * jnp.arange(1.0, 6.0),
            lambda a, b: (a - b) * np.arange(1.0, 6.0),
            (5,),
        ),
    ]
    for name, fn, reference, tail in cases:
        runs.clear()
        out = call_answer(
            "pairwise(f, A, B)",
            pairwise,
            one_pair_only(fn),
            jnp.asarray(A),
            jnp.asarray(B),
            explain=_batched_input,
        )
        expected = np.array([[reference(a, b) for b in B] for a in A])
        shape = np.shape(out)
        if len(runs) > 2:
            fail(
                f"f's Python body ran {len(runs)} times for {len(A)} x {len(B)} pairs: a Python loop",
                "vmap traces f once for all pairs; nest two vmaps instead of looping",
            )
        if shape == (len(B), len(A)) + tail:
            fail(
                f"shape {shape}, expected {expected.shape}: the result is transposed",
                "the outer vmap must map over A's rows, so that the result's first axis is A's",
            )
        if shape != expected.shape:
            fail(
                f"A [7, 5] and B [4, 5] with {name} gave shape {shape}, expected {expected.shape}",
                "entry (i, j) pairs A[i] with B[j]: one vmap over A, one over B, nested",
            )
        if not np.allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-5):
            fail(f"values differ from f(A[i], B[j]) with {name}", "entry (i, j) is f(A[i], B[j])")
    return passed("pairwise(f, A, B) applies any one-pair f to every pair, with one trace of f")


# ---------------------------------------------------------------- exercise 2: which values get batched

BATCHED_SOURCE = """\
def f(x, w):                         # x: f32[3] (mapped, 5 examples), w: f32[3] (shared)
    a = jnp.sin(w)
    b = x * a
    c = jnp.sum(w ** 2)
    d = jnp.outer(w, w)
    e = jnp.zeros(3).at[0].set(c)
    g = jnp.zeros(3).at[0].set(x[0])
    return b @ d + e + g

batched = jax.vmap(f, in_axes=(0, None))   # called on x: f32[5, 3], w: f32[3]
"""
"""The function whose intermediates' shapes under vmap the learner predicts (as the notebook prints it)."""

_BATCHED_HINTS = {  # what to think about, not the answer
    "a": "does sin(w) read x?",
    "b": "one of b's inputs is mapped: what does that make b?",
    "c": "c is computed from w alone",
    "d": "d is computed from w alone",
    "e": "e's buffer and its update come from w alone",
    "g": "g's update comes from x: look at section 4's scatter",
}


def measure_batched() -> dict[str, tuple[int, ...]]:
    """Shapes of a, b, c, d, e, g in the jaxpr of ``jax.vmap(f, in_axes=(0, None))`` (tagged with checkpoint_name)."""
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name as tag

    def f(x, w):  # BATCHED_SOURCE, with every named intermediate tagged
        a = tag(jnp.sin(w), "a")
        b = tag(x * a, "b")
        c = tag(jnp.sum(w**2), "c")
        d = tag(jnp.outer(w, w), "d")
        e = tag(jnp.zeros(3).at[0].set(c), "e")
        g = tag(jnp.zeros(3).at[0].set(x[0]), "g")
        return b @ d + e + g

    jaxpr = jax.make_jaxpr(jax.vmap(f, in_axes=(0, None)))(jnp.ones((5, 3)), jnp.arange(3.0))
    return {
        e.params["name"]: tuple(e.outvars[0].aval.shape)
        for e in jaxpr.eqns
        if e.primitive.name == "name"
    }


@checker
def check_batched_shapes(predictions: Mapping[str, tuple] | None) -> bool:
    """Exercise 2: predict the shape of each intermediate a, b, c, d, e, g of ``BATCHED_SOURCE`` under vmap.

    Raises:
      ExerciseError: a missing entry, an entry that is not a shape tuple, or a wrong shape.
    """
    hint = (
        "write a shape tuple for each of a, b, c, d, e, g, e.g. (3,) or (5, 3) or () for a scalar"
    )
    if all(v is None or v is Ellipsis for v in dict(predictions or {}).values()):
        not_written("the shape table", hint)
    measured = measure_batched()
    got = dict(predictions)
    for name in measured:
        value = got.get(name)
        if not isinstance(value, (tuple, list)) or not all(
            isinstance(k, (int, np.integer)) for k in value
        ):
            fail(f"the prediction for {name} is {value!r}, not a shape tuple", hint)
    wrong = [name for name in measured if tuple(int(k) for k in got[name]) != measured[name]]
    if wrong:
        others = f" ({len(wrong) - 1} other shape(s) wrong too)" if len(wrong) > 1 else ""
        fail(
            f"your shape {tuple(got[wrong[0]])} for {wrong[0]} is not what vmap produces{others}",
            _BATCHED_HINTS[wrong[0]],
        )
    print("  " + ", ".join(f"{k}: {v}" for k, v in measured.items()))
    return passed("every intermediate's shape predicted: only what depends on x is batched")


# ---------------------------------------------------------------- exercise 3: batch statistics


def _unbound_axis(e: BaseException):
    if isinstance(e, NameError):
        return (
            f"NameError: {str(e).splitlines()[0][:150]}",
            'use the axis name "batch": the check maps your '
            'function with jax.vmap(batch_norm, axis_name="batch")',
        )
    return None


def _agrees_under_pmap(batch_norm: Callable, devices, rng) -> None:
    """Run ``batch_norm`` under ``jax.pmap`` (one example per device) and compare with ``jax.vmap``."""
    import jax
    import jax.numpy as jnp

    X = jnp.asarray(rng.normal(size=(len(devices), 6)).astype(np.float32) * 3 + 1)
    by_pmap = np.asarray(
        call_answer(
            "jax.pmap(batch_norm, axis_name='batch')(X)",
            jax.pmap(batch_norm, axis_name="batch", devices=list(devices)),
            X,
            explain=_unbound_axis,
        )
    )
    by_vmap = np.asarray(jax.vmap(batch_norm, axis_name="batch")(X))
    if not np.allclose(by_pmap, by_vmap, rtol=1e-4, atol=1e-4):
        fail(
            "under pmap (one example per device) the result differs from vmap's",
            "use only the named-axis collectives for batch statistics, nothing that sees the whole array",
        )


@checker
def check_batch_norm(batch_norm: Callable, devices=None) -> bool:
    """Exercise 3: ``batch_norm(x)`` for ONE example x: f32[features], normalised with the BATCH's statistics.

    The checker maps it with ``jax.vmap(batch_norm, axis_name="batch")`` over random batches of several sizes
    and compares with NumPy's ``(X - X.mean(0)) / sqrt(X.var(0) + 1e-5)``; with ``devices``, it also runs it
    unchanged under ``jax.pmap(batch_norm, axis_name="batch")``, one example per device.

    Raises:
      ExerciseError: statistics of the example's own features, a sum instead of a mean, the variance not
        centred, a wrong epsilon, an unbound axis name, or different results under pmap.
    """
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(3)
    for rows, features in ((16, 4), (5, 7)):
        X = (
            rng.normal(size=(rows, features)) * rng.uniform(0.5, 3, size=features)
            + rng.normal(size=features) * 2
        )
        X = X.astype(np.float32)
        mapped = jax.vmap(batch_norm, axis_name="batch")
        out = np.asarray(
            call_answer(
                "jax.vmap(batch_norm, axis_name='batch')(X)",
                mapped,
                jnp.asarray(X),
                explain=_unbound_axis,
            )
        )
        expected = (X - X.mean(0)) / np.sqrt(X.var(0) + 1e-5)
        if out.shape != X.shape:
            fail(
                f"output shape {out.shape} for a batch {X.shape}",
                "normalise each example: same shape in, same out",
            )
        if np.allclose(out, expected, rtol=1e-4, atol=1e-4):
            continue
        own = (X - X.mean(1, keepdims=True)) / np.sqrt(X.var(1, keepdims=True) + 1e-5)
        if np.allclose(out, own, rtol=1e-4, atol=1e-4):
            fail(
                "each example is normalised with the mean and variance of its own features",
                "that is a layer norm; batch norm averages each feature over the examples: a collective "
                "over the named axis",
            )
        if np.allclose(
            out, (X - X.sum(0)) / np.sqrt(((X - X.sum(0)) ** 2).sum(0) + 1e-5), rtol=1e-3, atol=1e-3
        ):
            fail(
                "the statistics are sums over the batch, not means",
                "lax.psum adds; lax.pmean averages",
            )
        uncentred = (X - X.mean(0)) / np.sqrt((X**2).mean(0) + 1e-5)
        if np.allclose(out, uncentred, rtol=1e-3, atol=1e-3):
            fail(
                "the variance is the mean of x ** 2", "the variance is the mean of (x - mean) ** 2"
            )
        fail(
            f"batch {X.shape}: values differ from (x - batch mean) / sqrt(batch variance + 1e-5)",
            "the mean and the variance are both averages over the named axis, feature by feature",
        )
    if devices is not None:
        _agrees_under_pmap(batch_norm, devices, rng)
        where = f"; the same function under pmap on {len(devices)} device(s) agrees"
    else:
        where = ""
    return passed(f"batch_norm uses the batch's statistics through the named axis{where}")


# ---------------------------------------------------------------- exercise 4: per-example clipping


def _loop_reference(params, xs, ys, max_norm):
    """Per-example gradients of the linear model by formula, one example at a time, clipped, averaged."""
    w, b = (np.asarray(params["w"], np.float64), float(params["b"]))
    clipped = []
    for x, y in zip(np.asarray(xs, np.float64), np.asarray(ys, np.float64)):
        r = x @ w + b - y  # loss = r ** 2
        g_w, g_b = 2 * r * x, 2 * r
        norm = np.sqrt(np.sum(g_w**2) + g_b**2)
        scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
        clipped.append((scale * g_w, scale * g_b))
    return {
        "w": np.mean([c[0] for c in clipped], 0),
        "b": np.mean([c[1] for c in clipped]),
    }, clipped


def _clipping_problem(rng, n: int, d: int, max_norm: float):
    """A linear model and examples whose gradient norms lie on both sides of ``max_norm``."""
    import jax.numpy as jnp

    params = {"w": jnp.asarray(rng.normal(size=d), jnp.float32), "b": jnp.asarray(0.3, jnp.float32)}
    xs = rng.normal(size=(n, d)).astype(np.float32)
    residual = rng.normal(size=n) * np.where(
        np.arange(n) % 2, 0.02, 3.0
    )  # small and large gradients
    ys = (xs @ np.asarray(params["w"]) + float(params["b"]) - residual).astype(np.float32)
    norms = np.abs(2 * residual) * np.sqrt(
        np.sum(xs.astype(np.float64) ** 2, 1) + 1
    )  # |2 r (x, 1)|
    assert norms.min() < max_norm < norms.max()  # both sides of the threshold are tested
    return params, xs, ys


def _diagnose_clipping(got_w, params, xs, ys, max_norm, want_w) -> None:
    """Name the usual mistake behind a wrong clipped gradient (always raises ExerciseError)."""
    r = xs @ np.asarray(params["w"], np.float64) + float(params["b"]) - ys
    raw = [(2 * ri * x, 2 * ri) for ri, x in zip(r, xs)]  # per-example (grad w, grad b), unclipped
    mean_w, mean_b = np.mean([g for g, _ in raw], 0), np.mean([gb for _, gb in raw])
    whole = min(1.0, max_norm / np.sqrt(np.sum(mean_w**2) + mean_b**2))

    def close(candidate) -> bool:
        return np.allclose(got_w, candidate, rtol=1e-4, atol=1e-5)

    if close(whole * mean_w):
        fail(
            "the batch's mean gradient is clipped, not each example's",
            "compute per-example gradients first (vmap of grad), clip each one, then average",
        )
    if close(np.mean([g * min(1.0, max_norm / np.linalg.norm(g)) for g, _ in raw], 0)):
        fail(
            "each leaf is clipped by its own norm",
            "the norm of one example's gradient is over ALL its leaves: the root of every leaf's sum of squares",
        )
    if close(np.mean([max_norm / np.sqrt(np.sum(g**2) + gb**2) * g for g, gb in raw], 0)):
        fail(
            "small gradients are scaled up to max_norm",
            "the scale is min(1, max_norm / norm): clipping only shrinks",
        )
    if close(len(xs) * want_w):
        fail(
            f"the result is {len(xs)}x the expected one",
            "average the clipped gradients over the examples",
        )
    fail(
        "the clipped mean gradient differs from a loop over examples",
        "each example's gradient, scaled by min(1, max_norm / its norm), then the mean over the examples",
    )


@checker
def check_clipped_grad(clipped_mean_grad: Callable) -> bool:
    """Exercise 4 (project): ``clipped_mean_grad(loss_fn, params, xs, ys, max_norm)``, DP-SGD's clipped gradient.

    Each example's gradient (a pytree like ``params``) is scaled by ``min(1, max_norm / ||g||)``, where
    ``||g||`` is the norm over ALL its leaves together; the result is the mean over examples. Judged on a
    linear model ``{"w": [d], "b": []}`` with examples above and below the threshold, against a loop of
    analytic per-example gradients, and under ``jax.jit``.

    Raises:
      ExerciseError: the batch gradient clipped instead of each example's, a norm per leaf instead of over the
        whole pytree, small gradients scaled up, a sum instead of a mean, wrong structure, fails under jit.
    """
    import jax
    import jax.numpy as jnp

    def loss_fn(params, x, y):
        return (x @ params["w"] + params["b"] - y) ** 2

    rng = np.random.default_rng(5)
    for n, d, max_norm in ((8, 3, 1.0), (5, 4, 0.5)):
        params, xs, ys = _clipping_problem(rng, n, d, max_norm)
        want, _ = _loop_reference(params, xs, ys, max_norm)
        out = call_answer(
            "clipped_mean_grad(loss_fn, params, xs, ys, max_norm)",
            clipped_mean_grad,
            loss_fn,
            params,
            jnp.asarray(xs),
            jnp.asarray(ys),
            max_norm,
        )
        if jax.tree.structure(out) != jax.tree.structure(params):
            fail(
                f"the result's structure {jax.tree.structure(out)} is not the params' "
                f"{jax.tree.structure(params)}",
                "return one averaged gradient pytree, like jax.grad's",
            )
        if np.shape(out["w"]) != (d,) or np.shape(out["b"]) != ():
            fail(
                f"leaf shapes {jax.tree.map(np.shape, out)}, expected w: ({d},), b: ()",
                "average the clipped per-example gradients over the example axis",
            )
        got_w, got_b = np.asarray(out["w"], np.float64), float(out["b"])
        if not (
            np.allclose(got_w, want["w"], rtol=1e-4, atol=1e-5)
            and np.isclose(got_b, want["b"], rtol=1e-4, atol=1e-5)
        ):
            _diagnose_clipping(got_w, params, xs, ys, max_norm, want["w"])
    try:
        jax.jit(clipped_mean_grad, static_argnums=0)(
            loss_fn, params, jnp.asarray(xs), jnp.asarray(ys), max_norm
        )
    except Exception as e:  # noqa: BLE001
        fail(
            f"clipped_mean_grad fails under jax.jit: {type(e).__name__}: {str(e).splitlines()[0][:150]}",
            "use jnp.minimum, not Python min or an if on the norm (the norm is a traced array)",
        )
    return passed(
        "each example's gradient is clipped over all its leaves, then averaged; it works under jit"
    )

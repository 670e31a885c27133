"""Checkers for ``03_vmap.ipynb``: an ensemble, which values get batched, batch statistics, clipped gradients.

The checkers use black-box one-member, one-example functions that refuse batched input (so only a vmap
can apply them),
read shapes from the vmapped jaxpr, compare batch statistics with NumPy's over the batch axis, and compare
clipped gradients with a loop over examples of an analytic gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from ._common import call_answer, checker, fail, matmul_rtol, not_written, passed
from ._lesson03_ensemble import judge_ensemble

# ---------------------------------------------------------------- exercise 1: an ensemble


@checker
def check_ensemble(ensemble: Callable) -> bool:
    """Exercise 1: an ensemble of small networks with stacked parameters and per-example dropout keys.

    Spec (in full in ``_lesson03_ensemble``): ``ensemble(init, apply, init_key, dropout_key, x, members)``
    returns ``(stacked, outputs)``: the members' parameters stacked, member m being ``init(split(init_key,
    members)[m])``; outputs ``[members, batch, out]`` with entry ``[m, b] = apply(params_m, k_mb, x[b])``,
    every ``k_mb`` a key of its own derived from ``dropout_key`` alone (judged by the dropout masks
    ``apply`` draws: all distinct, unchanged by another ``init_key``, changed by another ``dropout_key``);
    ``apply`` traced once.

    Raises:
      ExerciseError: parameters not stacked or all equal, a member not initialised from its key, apply
        given stacked parameters or a batch, a Python loop, axes swapped, an entry not apply's on member
        m's parameters and example b, examples or members sharing a dropout key, dropout keys not derived
        from dropout_key alone.
    """
    judge_ensemble(ensemble)
    return passed(
        "each member has its own parameters and key, each example its own dropout mask, in one trace"
    )


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

_BATCHED_HINT = (  # how to reason, the same whichever shape is wrong
    "for each intermediate, follow its inputs back: does any of them depend on x, the mapped argument? "
    "Only those get the batch axis of 5; a value computed from w alone keeps its one-example shape "
    "(a scalar is ()). An update (.at[].set) is batched when its update value depends on x"
)


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

    Spec: every shape equals the one read from the vmapped jaxpr (:func:`measure_batched`). A wrong answer
    is told how many shapes are wrong, never which.

    Raises:
      ExerciseError: a missing entry, an entry that is not a shape tuple, or wrong shapes (their number).
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
    wrong = sum(tuple(int(k) for k in got[name]) != measured[name] for name in measured)
    if wrong:
        fail(f"{wrong} of your {len(measured)} shapes are not what vmap produces", _BATCHED_HINT)
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


EPS = 1e-5
QUIET = 1e-3
"""The standard deviation of the checker's quiet feature (variance about 1e-6, a tenth of EPS): there a
missing epsilon, one outside the square root or another value changes the result by a factor of 3 or
more."""


def _batch(rng, rows: int, features: int) -> np.ndarray:
    """Features of several scales and offsets; feature 0 is quiet (std QUIET, mean about 0)."""
    X = (
        rng.normal(size=(rows, features)) * rng.uniform(0.5, 3, size=features)
        + rng.normal(size=features) * 2
    )
    X[:, 0] = QUIET * rng.normal(size=rows)
    return X.astype(np.float32)


def _diagnose_norm(out: np.ndarray, X: np.ndarray) -> None:
    """A wrong batch norm: name the usual mistake (always raises)."""
    X64 = X.astype(np.float64)
    mean, var = X64.mean(0), X64.var(0)

    def close(candidate, tol=1e-3):
        return np.allclose(out, candidate, rtol=tol, atol=tol)

    own = (X64 - X64.mean(1, keepdims=True)) / np.sqrt(X64.var(1, keepdims=True) + EPS)
    if close(own, 1e-4):
        fail(
            "each example is normalised with the mean and variance of its own features",
            "that is a layer norm; batch norm averages each feature over the examples: a collective "
            "over the named axis",
        )
    if close((X64 - X64.sum(0)) / np.sqrt(((X64 - X64.sum(0)) ** 2).sum(0) + EPS)):
        fail(
            "the statistics are sums over the batch, not means", "lax.psum adds; lax.pmean averages"
        )
    if close((X64 - mean) / np.sqrt((X64**2).mean(0) + EPS)):
        fail("the variance is the mean of x ** 2", "the variance is the mean of (x - mean) ** 2")
    if np.allclose(out[:, 1:], ((X64 - mean) / np.sqrt(var + EPS))[:, 1:], rtol=1e-3, atol=1e-3):
        fail(
            f"the feature whose variance is about {QUIET**2:.0e} is normalised wrongly (the others are "
            "right): the epsilon is missing, outside the square root, or another value",
            f"divide by sqrt(var + {EPS:g}): the epsilon goes inside the square root, and it matters "
            "exactly for features this quiet",
        )
    if close((X64 - mean) / np.sqrt(X64.var(0, ddof=1) + EPS)):
        fail(
            "the variance is divided by n - 1 (unbiased)",
            "batch norm normalises with the biased variance: the mean of (x - mean) ** 2",
        )
    fail(
        f"batch {X.shape}: values differ from (x - batch mean) / sqrt(batch variance + {EPS:g})",
        "the mean and the variance are both averages over the named axis, feature by feature",
    )


def _judge_norm_gradient(mapped: Callable, X: np.ndarray, rng) -> None:
    """The input gradient of a random weighting of the outputs, against a batch norm that differentiates
    through the batch's mean and variance (as training does), or an ExerciseError."""
    import jax
    import jax.numpy as jnp

    weights = jnp.asarray(rng.normal(size=X.shape), jnp.float32)

    def reference(Z):
        return (Z - Z.mean(0)) / jnp.sqrt(Z.var(0) + EPS)

    want = np.asarray(jax.grad(lambda Z: jnp.sum(reference(Z) * weights))(jnp.asarray(X)))
    got = np.asarray(jax.grad(lambda Z: jnp.sum(mapped(Z) * weights))(jnp.asarray(X)))
    if not np.allclose(got, want, rtol=1e-3, atol=1e-3 * float(np.max(np.abs(want)))):
        fail(
            f"the values are right, but the gradient with respect to the batch is off by up to "
            f"{float(np.max(np.abs(got - want))):.2g} (largest entry {float(np.max(np.abs(want))):.2g})",
            "a batch norm in training differentiates through the batch's mean and variance too: do not "
            "stop_gradient the statistics (every example's output depends on every example)",
        )


@checker
def check_batch_norm(batch_norm: Callable, devices=None) -> bool:
    """Exercise 3: ``batch_norm(x)`` for ONE example x: f32[features], normalised with the BATCH's statistics.

    Spec: under ``jax.vmap(batch_norm, axis_name="batch")`` the result is ``(X - X.mean(0)) /
    sqrt(X.var(0) + 1e-5)``: per feature, the mean and the biased variance over the named batch axis, the
    epsilon 1e-5 inside the square root (to 1e-4). Judged on batches of 16 and 5 rows whose features have
    several scales and offsets and one quiet feature (variance about 1e-6, a tenth of the epsilon: there
    a missing or misplaced epsilon changes the result several-fold); ``E[x**2] - E[x]**2`` is as right as
    the mean of squared deviations. The input gradient (of a random weighting of the outputs) must equal
    the one through the batch's mean and variance, as training differentiates it. With ``devices``, it
    also runs unchanged under ``jax.pmap(batch_norm, axis_name="batch")``, one example per device, and must
    agree with vmap.

    Raises:
      ExerciseError: statistics of the example's own features, a sum instead of a mean, the variance not
        centred or unbiased, the epsilon missing, outside the root or another value, no gradient through
        the statistics, an unbound axis name, or different results under pmap.
    """
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(3)
    for rows, features in ((16, 4), (5, 7)):
        X = _batch(rng, rows, features)
        mapped = jax.vmap(batch_norm, axis_name="batch")
        out = np.asarray(
            call_answer(
                "jax.vmap(batch_norm, axis_name='batch')(X)",
                mapped,
                jnp.asarray(X),
                explain=_unbound_axis,
            )
        )
        if out.shape != X.shape:
            fail(
                f"output shape {out.shape} for a batch {X.shape}",
                "normalise each example: same shape in, same out",
            )
        X64 = X.astype(np.float64)
        expected = (X64 - X64.mean(0)) / np.sqrt(X64.var(0) + EPS)
        if not np.allclose(out, expected, rtol=1e-4, atol=1e-4):
            _diagnose_norm(out, X)
        _judge_norm_gradient(mapped, X, rng)
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


def _diagnose_clipping(got, params, xs, ys, max_norm, want) -> None:
    """Name the usual mistake behind a wrong clipped gradient, judging both leaves (always raises)."""
    r = xs @ np.asarray(params["w"], np.float64) + float(params["b"]) - ys
    raw = [(2 * ri * x, 2 * ri) for ri, x in zip(r, xs)]  # per-example (grad w, grad b), unclipped
    mean_w, mean_b = np.mean([g for g, _ in raw], 0), np.mean([gb for _, gb in raw])

    def shrink(norm):
        return min(1.0, max_norm / norm) if norm > 0 else 1.0

    rtol = matmul_rtol(1e-4)  # the answer's x @ w in float32: the platform's matmul rounding

    def close(w, b) -> bool:
        return np.allclose(got[0], w, rtol=rtol, atol=rtol / 10) and np.isclose(
            got[1], b, rtol=rtol, atol=rtol / 10
        )

    def averaged(scale_w, scale_b) -> tuple:  # per-example scales -> the mean of the scaled leaves
        return (
            np.mean([scale_w(g, gb) * g for g, gb in raw], 0),
            np.mean([scale_b(g, gb) * gb for g, gb in raw]),
        )

    whole = shrink(np.sqrt(np.sum(mean_w**2) + mean_b**2))
    mistakes = [
        (
            (mean_w, mean_b),
            "no example's gradient was clipped: the result is the mean of the unclipped gradients"
            + (
                " (here the batch's mean gradient is shorter than max_norm, so clipping the mean, not "
                "each example's, gives it too)"
                if whole == 1.0
                else ""
            ),
            "compute per-example gradients first (vmap of grad), scale each one by "
            "min(1, max_norm / its norm), then average",
        ),
        (
            (whole * mean_w, whole * mean_b),
            "the batch's mean gradient is clipped, not each example's",
            "compute per-example gradients first (vmap of grad), clip each one, then average",
        ),
        (
            averaged(lambda g, gb: shrink(np.linalg.norm(g)), lambda g, gb: shrink(abs(gb))),
            "each leaf is clipped by its own norm",
            "the norm of one example's gradient is over ALL its leaves: the root of every leaf's sum of "
            "squares",
        ),
        (
            averaged(
                lambda g, gb: shrink(np.linalg.norm(g)), lambda g, gb: shrink(np.linalg.norm(g))
            ),
            "the norm is taken over one leaf (w) only, and that scale applied to every leaf",
            "the norm of one example's gradient is over ALL its leaves together: add every leaf's sum of "
            "squares before the square root",
        ),
        (
            averaged(
                lambda g, gb: max_norm / np.sqrt(np.sum(g**2) + gb**2),
                lambda g, gb: max_norm / np.sqrt(np.sum(g**2) + gb**2),
            ),
            "small gradients are scaled up to max_norm",
            "the scale is min(1, max_norm / norm): clipping only shrinks",
        ),
        (
            (len(xs) * want[0], len(xs) * want[1]),
            f"the result is {len(xs)}x the expected one",
            "average the clipped gradients over the examples",
        ),
    ]
    for (w, b), what, hint in mistakes:
        if close(w, b):
            fail(what, hint)
    fail(
        "the clipped mean gradient differs from a loop over examples",
        "each example's gradient, scaled by min(1, max_norm / its norm), then the mean over the examples",
    )


@checker
def check_clipped_grad(clipped_mean_grad: Callable) -> bool:
    """Exercise 4 (project): ``clipped_mean_grad(loss_fn, params, xs, ys, max_norm)``, DP-SGD's clipped gradient.

    Spec: each example's gradient (a pytree like ``params``) is scaled by ``min(1, max_norm / ||g||)``, where
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
        rtol = matmul_rtol(1e-4)  # float32 x @ w against float64: the platform's matmul rounding
        if not (
            np.allclose(got_w, want["w"], rtol=rtol, atol=rtol / 10)
            and np.isclose(got_b, want["b"], rtol=rtol, atol=rtol / 10)
        ):
            _diagnose_clipping((got_w, got_b), params, xs, ys, max_norm, (want["w"], want["b"]))
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

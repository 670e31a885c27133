"""Checkers for ``01_grad.ipynb``: a pure dropout, trace counts, a NaN-free distance, gradient accumulation,
checkpoint block sizes.

The checkers compare with measurements (the trace counts are counted), with independent formulas (the
distance's analytic gradient) or with another algorithm (the full-batch gradient against the accumulated
one); none holds an answer.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping

import numpy as np

from ._common import call_answer, checker, fail, not_written, passed
from ._lesson01_accumulate import judge_accumulated, judge_one_at_a_time, pass_tap
from ._lesson01_blocks import BLOCK_QUESTIONS, BLOCKS, barriers_merged, judge_blocks

__all__ = ["BLOCK_QUESTIONS", "BLOCKS"]  # the notebook uses these

# ---------------------------------------------------------------- exercise 1: dropout


@checker
def check_dropout(dropout: Callable) -> bool:
    """Exercise 1: a pure ``dropout(key, x, rate)``: zero a fraction ``rate``, scale the rest by ``1/(1-rate)``.

    Spec: the output has x's shape and dtype; every entry is 0 or the same entry of ``x / (1 - rate)``;
    the entries are dropped independently (no axis along which every slice has the same mask); about
    ``rate`` of them (within 3 points) are 0; the same key gives the same output and another key
    another; under ``jax.jit`` (``rate`` static) the values are the same. Judged on random (not constant)
    ``x`` (so an output that ignores x shows) at rates 0.3 and 0.6.

    Raises:
      ExerciseError: wrong shape or dtype, output not built from ``x``, no rescaling, one mask shared along
        an axis, impure, key ignored, wrong drop fraction, fails under ``jit``.
    """
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(1)
    for shape, rate in (((60, 40, 25), 0.3), ((60, 40, 25), 0.6)):  # random x: not all ones
        x = jnp.asarray(
            rng.normal(size=shape).astype(np.float32) + 2.0
        )  # random, none zero in practice
        key = jax.random.key(42)
        out = call_answer("dropout(key, x, rate)", dropout, key, x, rate)
        a = np.asarray(out)
        if a.shape != x.shape:
            fail(
                f"output shape {a.shape}, expected {x.shape}",
                "draw one keep/drop decision per entry of x: shape x.shape",
            )
        if getattr(out, "dtype", None) != x.dtype:
            fail(
                f"output dtype {getattr(out, 'dtype', type(out))}, input {x.dtype}",
                "keep the dtype of x",
            )
        xs = np.asarray(x)
        kept = a != 0
        scaled = xs / (1 - rate)
        dropped = 1 - kept.mean()
        shared = [
            axis
            for axis in range(kept.ndim)
            if (kept == np.take(kept, [0], axis=axis)).all()  # every slice along axis: one mask
        ]
        if shared:
            fail(
                f"every slice of the output along axis {shared[0]} drops the same entries: one mask "
                f"serves all {x.shape[shared[0]]} of them",
                "draw one keep/drop decision per entry of x (shape x.shape), not one mask broadcast over "
                "the batch",
            )
        if abs(dropped - rate) > 0.03:
            fail(
                f"{dropped:.0%} of the entries were dropped, expected about {rate:.0%}",
                "keep each entry with probability 1 - rate (jax.random.bernoulli's p is the probability of True)",
            )
        if np.allclose(a[kept], 1 / (1 - rate), rtol=1e-5):
            fail(
                "the kept entries are all 1/(1-rate): the output does not depend on x",
                "build the output from x: its entries, scaled, where the mask keeps them, and 0 elsewhere",
            )
        if np.allclose(a[kept], xs[kept], rtol=1e-5):
            fail(
                "the kept entries equal x: they are not rescaled",
                "scale the kept entries by 1 / (1 - rate), so that the output's mean stays the mean of x",
            )
        if not np.allclose(a[kept], scaled[kept], rtol=1e-5):
            fail(
                "kept entries are not x / (1 - rate)",
                "each output entry is 0 or the same entry of x / (1 - rate)",
            )
        if not np.array_equal(np.asarray(dropout(key, x, rate)), a):
            fail(
                "two calls with the same key gave different outputs: the function is not pure",
                "draw the randomness only from the key argument (jax.random), never np.random or a global key",
            )
        if np.array_equal(np.asarray(dropout(jax.random.key(7), x, rate)), a):
            fail(
                "a different key gave the same output",
                "use the key you are given, do not make a fixed one inside",
            )
        try:
            j = np.asarray(jax.jit(dropout, static_argnums=2)(key, x, rate))
        except Exception as e:  # noqa: BLE001
            fail(
                f"dropout fails under jax.jit: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                "select with jnp.where instead of Python control flow or NumPy on the arrays",
            )
        if not np.allclose(j, a):
            fail(
                "the jitted dropout gives other values than the eager one",
                "the result must depend only on the inputs",
            )
    return passed("dropout is pure, drops the right fraction, and rescales what it keeps")


# ---------------------------------------------------------------- exercise 2: predict trace counts

TRACE_CASES = {
    "linearize, then its linear map twice": "y, f_lin = jax.linearize(f, x)\nf_lin(x)\nf_lin(2 * x)",
    "a Hessian": "jax.hessian(f)(x)",
    "vmap over 4 rows": "jax.vmap(f)(jnp.ones((4, 3)))",
    "jit, then grad of the jitted f": "jf = jax.jit(f)\njf(x)\njax.grad(jf)(x)",
    "jit twice, then grad of the plain f": "jf = jax.jit(f)\njf(x)\njf(x)\njax.grad(f)(x)",
    "jit(vmap(grad)) on 4 rows, then 5": "g = jax.jit(jax.vmap(jax.grad(f)))\ng(jnp.ones((4, 3)))\ng(jnp.ones((5, 3)))",
    "grad of a checkpointed f": "jax.grad(jax.checkpoint(f))(x)",
}
"""Snippets (as the notebook prints them) whose number of runs of ``f``'s Python body the learner predicts."""

_TRACE_HINT = (  # how to reason, the same whichever count is wrong
    "for each snippet ask what the transform works on: your Python function (it runs f again) or a "
    "program already traced (jit's cache, a linear map, a jaxpr being transformed further)? A transform "
    "traces once per new input shape, and never once per row"
)


def measure_traces() -> dict[str, int]:
    """Run each snippet with a fresh ``f`` (JAX's caches are keyed by the function) and count its Python runs."""
    import jax
    import jax.numpy as jnp

    counts = {}
    for name, code in TRACE_CASES.items():
        runs = []

        def f(x, runs=runs):
            runs.append(1)
            return jnp.sum(jnp.sin(x) ** 2)

        exec(code, {"jax": jax, "jnp": jnp, "f": f, "x": jnp.arange(3.0)})
        counts[name] = len(runs)
    return counts


@checker
def check_trace_counts(predictions: Mapping[str, int] | None) -> bool:
    """Exercise 2: predict how many times ``f``'s Python body runs in each snippet of ``TRACE_CASES``.

    Spec: every count equals the one :func:`measure_traces` counts (a fresh ``f`` per snippet). A wrong
    answer is told how many counts are wrong, never which, with one hint on how to reason.

    Raises:
      ExerciseError: a missing or non-integer prediction, or wrong ones (their number).
    """
    hint = "write a whole number for every snippet, then run this cell"
    if all(v is None or v is Ellipsis for v in dict(predictions or {}).values()):
        not_written("the trace-count table", hint)
    got = dict(predictions)
    for name in TRACE_CASES:
        value = got.get(name)
        if value is None or value is Ellipsis:
            fail(f"no prediction for {name!r}", hint)
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            fail(
                f"the prediction for {name!r} is {value!r}, a {type(value).__name__}, not a number",
                f"{hint} (a number such as 1, not the text '1')",
            )
        if not float(value).is_integer():
            fail(f"the prediction for {name!r} is {value!r}", hint)
    measured = measure_traces()
    wrong = sum(int(got[name]) != measured[name] for name in TRACE_CASES)
    if wrong:
        fail(f"{wrong} of your {len(TRACE_CASES)} counts are not what happens", _TRACE_HINT)
    for name in TRACE_CASES:
        print(f"  {name:36s} {measured[name]} run(s) of f's Python body")
    return passed(f"all {len(TRACE_CASES)} trace counts predicted")


# ---------------------------------------------------------------- exercise 3: debug a NaN gradient


NEAR = (1e-4, 1e-4, 1e-5, 1e-6, 1e-8, 1e-15)
"""The distances of the checker's nearly equal pairs: an epsilon inside the square root, or a threshold
below which points count as coincident, shows at one of them (float32 represents them all: the points of
the smaller ones have magnitudes near 100 times their distance, so p - q is exact)."""


def _distance_pairs():
    """p, q: f32[12, 5]; rows 0 and 4 the same point twice, rows 2, 6, 8, 9, 10, 11 at the distances
    ``NEAR``, the rest random; returns (p, q, same, near, the distance of each near row)."""
    rng = np.random.default_rng(2)
    p = rng.normal(size=(12, 5)).astype(np.float32)
    q = rng.normal(size=(12, 5)).astype(np.float32)
    rows = (2, 6, 8, 9, 10, 11)
    same, near = np.isin(np.arange(12), (0, 4)), np.isin(np.arange(12), rows)
    q[same] = p[same]
    step = rng.normal(size=(len(rows), 5))
    step /= np.linalg.norm(step, axis=1, keepdims=True)
    for row, dist, u in zip(rows, NEAR, step):
        if dist < 1e-4:
            p[row] = (p[row] * 100 * dist).astype(np.float32)
        q[row] = (p[row] + dist * u).astype(np.float32)
    return p, q, same, near, dict(zip(rows, NEAR))


@checker
def check_safe_distance(safe_distance: Callable) -> bool:
    """Exercise 3: ``safe_distance(p, q)`` = ``|p - q|`` with finite gradients everywhere, also at ``p == q``.

    Spec: for float32 [d] vectors, the value is ``sqrt(sum((p - q) ** 2))`` everywhere — exactly 0 at
    ``p == q`` — and the gradient with respect to ``p`` is ``(p - q) / |p - q|`` wherever ``p != q`` (to
    1e-4, also at ``|p - q|`` from 1e-4 down to 1e-15 (``NEAR``), where an epsilon inside the square root, or a
    threshold below which points count as the same, bends it) and 0 at ``p == q``;
    finite in reverse mode (``grad``, under ``jit`` and ``vmap``) and in forward mode (``jvp``). So the
    double ``jnp.where`` and a ``jax.custom_jvp`` pass; any epsilon or clamp (``sqrt(d2 + eps)``,
    ``sqrt(maximum(d2, eps))``) fails at one of the two edges.

    Raises:
      ExerciseError: a wrong value (also not exactly 0 at p == q), NaN or infinite gradients at ``p == q``
        (with the reason), a gradient bent near 0, a wrong gradient, or not traceable under ``jit``/``vmap``.
    """
    import jax
    import jax.numpy as jnp

    p, q, same, near, near_dist = _distance_pairs()
    diff = p - q  # float32, as JAX computes it
    norm = np.linalg.norm(diff.astype(np.float64), axis=1)
    value = np.asarray(
        call_answer("safe_distance(p, q)", safe_distance, jnp.asarray(p[1]), jnp.asarray(q[1]))
    )
    if value.shape != ():
        fail(
            f"one pair gave shape {value.shape}, expected a scalar",
            "sum the squared differences over the d entries",
        )
    try:
        values = np.asarray(jax.jit(jax.vmap(safe_distance))(p, q))
        grads = np.asarray(jax.jit(jax.vmap(jax.grad(safe_distance)))(p, q))
        _, tangents = jax.jit(
            jax.vmap(lambda a, b: jax.jvp(lambda u: safe_distance(u, b), (a,), (jnp.ones_like(a),)))
        )(p, q)
    except Exception as e:  # noqa: BLE001
        fail(
            f"safe_distance fails under jit/vmap: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
            "use jnp operations only (jnp.where, not a Python if on the arrays)",
        )
    _judge_distance(values, grads, np.asarray(tangents), diff, norm, same, near, near_dist)
    return passed(
        "safe_distance is exact (0 at p == q), and its gradient is right everywhere, also at |p - q| from "
        f"{max(NEAR):g} down to {min(NEAR):g} (grad, vmap and jvp)"
    )


def _judge_distance(values, grads, tangents, diff, norm, same, near, near_dist) -> None:
    apart, far = ~same, ~same & ~near
    if not np.allclose(values[far], norm[far], rtol=1e-5, atol=0):
        fail(
            "the distance between different points is wrong",
            "the value is sqrt(sum((p - q) ** 2))",
        )
    if np.any(values[same] != 0):
        fail(
            f"the distance of a point to itself is {float(np.max(np.abs(values[same]))):.1e}, not 0",
            "an epsilon inside sqrt (or a clamp) makes it sqrt(eps); select the value 0 exactly where "
            "p == q instead (jnp.where)",
        )
    close = sorted(near_dist, key=near_dist.get, reverse=True)
    for row in close:  # the largest distance first: where a threshold or an epsilon first shows
        if values[row] == 0:
            fail(
                f"the distance of two points {near_dist[row]:g} apart is 0",
                "a tolerance (d2 > eps, or a clamp) treats close points as the same point: select the "
                "zero branch only where p == q exactly (d2 > 0)",
            )
        if not np.isclose(values[row], norm[row], rtol=1e-5, atol=0):
            fail(
                f"the distance of two points {near_dist[row]:g} apart is {float(values[row]):.7g}, a "
                f"relative error of {abs(float(values[row]) / norm[row] - 1):.1e}",
                "an epsilon inside sqrt shifts the small distances, however small it is: keep sqrt's input "
                "exact where p != q",
            )
    if not np.all(np.isfinite(grads)):
        fail(
            "the gradient at p == q is NaN",
            "sqrt's gradient at 0 is infinite (as jnp.linalg.norm's, which takes one), so at p == q "
            "the chain rule gives NaN (inf x 0); a jnp.where selecting 0 there does not help alone, since "
            "its gradient is 0 x the unselected branch's: 0 x inf = NaN. Give sqrt an input that is safe "
            "where p == q (a jnp.where on d2 before the sqrt), then select 0 there",
        )
    unit = diff / np.maximum(norm, 1e-38)[:, None]
    bent = [r for r in close if not np.allclose(grads[r], unit[r], rtol=1e-4, atol=1e-6)]
    if bent:
        fail(
            f"at |p - q| = {near_dist[bent[0]]:g} the gradient is not (p - q) / |p - q|",
            "an epsilon inside sqrt bends the gradient of small distances; keep sqrt's input exact "
            "where p != q and change it only where p == q",
        )
    if not np.allclose(grads[apart], unit[apart], rtol=1e-4, atol=1e-6):
        fail(
            "the gradient between different points is wrong",
            "the gradient of |p - q| with respect to p is (p - q) / |p - q|",
        )
    if not np.allclose(grads[same], 0.0):
        fail(
            "the gradient at p == q is not 0",
            "at p == q return the zero branch, whose gradient is 0",
        )
    if not np.all(np.isfinite(tangents)):
        fail(
            "forward mode (jax.jvp) gives NaN at p == q",
            "the same fix makes jvp finite: keep sqrt away from 0",
        )


# ---------------------------------------------------------------- exercise 4: gradient accumulation


@checker
def check_accumulate(accumulated_value_and_grad: Callable) -> bool:
    """Exercise 4 (project): ``accumulated_value_and_grad(loss_fn, params, x, y, micro)`` in micro-batches.

    Spec: ``loss_fn(params, x, y)`` is a MEAN over its rows. The result must equal
    ``jax.value_and_grad(loss_fn)`` on the whole batch (within ``course_lib.precision.float32_rtol()``: 1e-5
    on XLA:CPU, 1.6e-2 on a TPU), for batch sizes that ``micro`` does and does not divide, while ``loss_fn``
    never sees more than ``micro`` rows at once. ``params`` is a nested pytree. ``loss_fn`` logs
    (``jax.debug.callback`` in a ``custom_vjp``) when its forward pass starts and when its backward pass
    ends: each micro-batch's backward pass must end before the next one's forward pass starts, so that only
    one micro-batch's activations are alive at a time. (A checkpointed forward pass that is recomputed just
    before its backward pass counts as one: it keeps no activations, so one ``grad`` over a sum of
    ``jax.checkpoint``'d micro-batch losses passes. That holds because the answer runs eagerly, each
    operation when Python issues it; lesson 04's exercise 3 compiles one program, whose order is XLA's,
    and there the same answer keeps every micro-batch's activations on XLA:CPU, and is refused.)

    Raises:
      ExerciseError: ``loss_fn`` called on more than ``micro`` rows, a result of the wrong structure, the loss
        or gradient off (sum instead of mean, unweighted mean of the micro-batches, the last rows dropped),
        all micro-batches differentiated at once (one ``grad`` of a sum, ``vmap`` of ``grad``).
    """
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(4)
    seen, passes = [], []
    tap = pass_tap(passes)

    def loss_fn(params, x, y):
        seen.append(x.shape[0])
        params = tap(params)  # logs "f" when differentiated, "b" when its gradient arrives
        h = jnp.tanh(x @ params["dense"]["w"] + params["dense"]["b"])
        return jnp.mean((h @ params["out"] - y) ** 2)

    params = {
        "dense": {
            "w": jnp.asarray(rng.normal(size=(4, 6)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=6), jnp.float32),
        },
        "out": jnp.asarray(rng.normal(size=6), jnp.float32),
    }
    for batch, micro in ((12, 4), (10, 4)):  # micro divides the batch, and it does not
        x = jnp.asarray(rng.normal(size=(batch, 4)), jnp.float32)
        y = jnp.asarray(rng.normal(size=batch), jnp.float32)
        seen.clear()
        passes.clear()
        out = call_answer(
            f"accumulated_value_and_grad(loss_fn, params, x, y, micro={micro})",
            accumulated_value_and_grad,
            loss_fn,
            params,
            x,
            y,
            micro,
        )
        if seen and max(seen) > micro:
            fail(
                f"loss_fn was called on {max(seen)} rows at once with micro={micro}",
                "slice the batch into micro-batches of at most micro rows and differentiate each one",
            )
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            fail(
                "expected a pair (loss, grads)",
                "return the accumulated loss and the accumulated gradient pytree",
            )
        loss, grads = out
        if jax.tree.structure(grads) != jax.tree.structure(params):
            fail(
                f"the gradient's structure {jax.tree.structure(grads)} is not the params' "
                f"{jax.tree.structure(params)}",
                "add the micro-batch gradients leaf by leaf with jax.tree.map",
            )
        jax.effects_barrier()
        order = "".join(passes)
        judge_accumulated(loss_fn, params, x, y, micro, loss, grads)
        judge_one_at_a_time(order, -(-batch // micro))
    return passed(
        "the accumulated loss and gradient equal the full-batch ones, micro-batch by micro-batch"
    )


# ---------------------------------------------------------------- exercise 5: checkpoint block sizes


@checker
def check_block_memory(predictions: Mapping | None) -> bool:
    """Exercise 5: predict, for section 7's 16-layer gradient with ``jax.checkpoint`` around blocks of k
    layers, the block size that needs the least temporary memory, the memory at k = 1, 2, 8 and 16 (in
    activations: one layer's output), and the FLOPs at k = 1 as a multiple of the FLOPs without
    checkpointing.

    Spec: each prediction within ``_lesson01_blocks.ACTIVATION_TOLERANCE`` activations (the block size:
    exactly) or ``RATIO_TOLERANCE`` (the FLOP ratio) of what XLA:CPU's compiled programs report
    (``_lesson01_blocks.measure_blocks``: ``memory_analysis`` and ``cost_analysis``, compiled for the CPU
    backend on every host; under JAX 0.10.2 without the pass that merges the recomputation away). A wrong
    answer is told how many predictions are off, never which.

    Raises:
      ExerciseError: a missing or non-numeric prediction, or wrong ones (their number).
    """
    import jax

    measured = judge_blocks(predictions)
    print("  block size k :", "  ".join(f"{k:>5}" for k in BLOCKS))
    print("  activations  :", "  ".join(f"{measured[k][0]:5.2f}" for k in BLOCKS))
    print("  FLOPs / none :", "  ".join(f"{measured[k][1]:5.2f}" for k in BLOCKS))
    print(f"  (no checkpoint: {measured[None][0]:.2f} activations; measured with XLA:CPU)")
    if barriers_merged("cpu"):
        print(
            f"  (JAX {jax.__version__}: compiled without XLA:CPU's pass cse_barrier_expander, which would merge"
            " the recomputation away; lesson 01, section 7)"
        )
    return passed("every checkpoint prediction matches the compiled programs")

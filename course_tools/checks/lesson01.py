"""Checkers for ``01_grad.ipynb``: a pure dropout, trace counts, a NaN-free distance, gradient accumulation.

The checkers compare with measurements (the trace counts are counted), with independent formulas (the
distance's analytic gradient) or with another algorithm (the full-batch gradient against the accumulated
one); none holds an answer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from ._common import call_answer, checker, fail, not_written, passed

# ---------------------------------------------------------------- exercise 1: dropout


@checker
def check_dropout(dropout: Callable) -> bool:
    """Exercise 1: a pure ``dropout(key, x, rate)``: zero a fraction ``rate``, scale the rest by ``1/(1-rate)``.

    Judged on random (not constant) ``x`` of two shapes and two rates: every output entry is either 0 or the
    input entry scaled, about ``rate`` of them are 0, the same key gives the same output, another key another,
    and ``jax.jit`` (``rate`` static) gives the same values.

    Raises:
      ExerciseError: wrong shape or dtype, output not built from ``x``, no rescaling, impure, key ignored,
        wrong drop fraction, fails under ``jit``.
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
    "three eager gradients": "for _ in range(3):\n    jax.grad(f)(x)",
    "one vjp, two backward passes": "y, f_vjp = jax.vjp(f, x)\nf_vjp(1.0)\nf_vjp(2.0)",
    "a Hessian": "jax.hessian(f)(x)",
    "vmap over 4 rows": "jax.vmap(f)(jnp.ones((4, 3)))",
    "jit, then grad of the jitted f": "jf = jax.jit(f)\njf(x)\njax.grad(jf)(x)",
    "jit(vmap(grad)) on 4 rows, then 5": "g = jax.jit(jax.vmap(jax.grad(f)))\ng(jnp.ones((4, 3)))\ng(jnp.ones((5, 3)))",
    "grad of a checkpointed f": "jax.grad(jax.checkpoint(f))(x)",
}
"""Snippets (as the notebook prints them) whose number of runs of ``f``'s Python body the learner predicts."""

_TRACE_HINTS = {  # how to reason, not the answer
    "three eager gradients": "does anything from one jax.grad call survive to the next?",
    "one vjp, two backward passes": "what does f_vjp hold, and does applying it need your Python function?",
    "a Hessian": "jax.hessian is jax.jacfwd(jax.jacrev(f)): transforms compose on one traced program",
    "vmap over 4 rows": "vmap traces f with a tracer that stands for one row; is there a loop over the rows?",
    "jit, then grad of the jitted f": "jit caches the program it traced for these shapes; grad transforms a program",
    "jit(vmap(grad)) on 4 rows, then 5": "which part of the input does the jit cache key on?",
    "grad of a checkpointed f": "checkpoint recomputes during the backward pass: from your Python, or "
    "from the traced program?",
}


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

    Raises:
      ExerciseError: a missing or non-integer prediction, or a wrong one (the hint says what to think about).
    """
    hint = "write a whole number for every snippet, then run this cell"
    if all(v is None or v is Ellipsis for v in dict(predictions or {}).values()):
        not_written("the trace-count table", hint)
    got = dict(predictions)
    for name in TRACE_CASES:
        value = got.get(name)
        if value is None or value is Ellipsis:
            fail(f"no prediction for {name!r}", hint)
        if isinstance(value, bool) or not float(value).is_integer():
            fail(f"the prediction for {name!r} is {value!r}", hint)
    measured = measure_traces()
    wrong = [name for name in TRACE_CASES if int(got[name]) != measured[name]]
    if wrong:
        others = f" ({len(wrong) - 1} other prediction(s) wrong too)" if len(wrong) > 1 else ""
        fail(
            f"your count {int(got[wrong[0]])} for {wrong[0]!r} is not what happens{others}",
            _TRACE_HINTS[wrong[0]],
        )
    for name in TRACE_CASES:
        print(f"  {name:36s} {measured[name]} run(s) of f's Python body")
    return passed(f"all {len(TRACE_CASES)} trace counts predicted")


# ---------------------------------------------------------------- exercise 3: debug a NaN gradient


@checker
def check_safe_distance(safe_distance: Callable) -> bool:
    """Exercise 3: ``safe_distance(p, q)`` = ``|p - q|`` with finite gradients everywhere, also at ``p == q``.

    ``p, q``: float32 [d]. Judged on random pairs (value and gradient against the analytic ``(p - q) / |p - q|``),
    on equal pairs (value 0, gradient finite and 0), under ``vmap(grad)`` and forward mode (``jvp``).

    Raises:
      ExerciseError: a wrong value, NaN or infinite gradients at ``p == q`` (with the reason), a biased value
        near 0 (a large epsilon), a wrong gradient, or not traceable under ``jit``/``vmap``.
    """
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(2)
    p = rng.normal(size=(6, 5)).astype(np.float32)
    q = rng.normal(size=(6, 5)).astype(np.float32)
    q[::3] = p[::3]  # rows 0 and 3: the same point twice
    same = np.zeros(6, bool)
    same[::3] = True
    diff = p - q
    norm = np.linalg.norm(diff, axis=1)
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
    if not np.allclose(values[~same], norm[~same], rtol=1e-5):
        fail(
            "the distance between different points is wrong", "the value is sqrt(sum((p - q) ** 2))"
        )
    if np.any(np.abs(values[same]) > 1e-5):
        fail(
            f"the distance of a point to itself is {float(np.max(np.abs(values[same]))):.1e}, not 0",
            "an epsilon inside sqrt shifts every distance by about sqrt(eps); select the value at 0 exactly instead",
        )
    if not np.all(np.isfinite(grads)):
        fail(
            "the gradient at p == q is NaN",
            "jnp.where(d2 > 0, jnp.sqrt(d2), 0.0) picks the value, but its gradient "
            "is 0 x (the unselected branch's gradient), and sqrt's gradient at 0 is infinite: 0 x inf = NaN. Give "
            "sqrt an input that is safe where its branch is not used (a second jnp.where on d2)",
        )
    if not np.allclose(grads[~same], diff[~same] / norm[~same, None], rtol=1e-4, atol=1e-6):
        fail(
            "the gradient between different points is wrong",
            "the gradient of |p - q| with respect to p is (p - q) / |p - q|",
        )
    if not np.allclose(grads[same], 0.0):
        fail(
            "the gradient at p == q is not 0",
            "at p == q return the zero branch, whose gradient is 0",
        )
    if not np.all(np.isfinite(np.asarray(tangents))):
        fail(
            "forward mode (jax.jvp) gives NaN at p == q",
            "the same fix makes jvp finite: keep sqrt away from 0",
        )
    return passed(
        "safe_distance is exact, and its gradient is finite everywhere (grad, vmap and jvp)"
    )


# ---------------------------------------------------------------- exercise 4: gradient accumulation


@checker
def check_accumulate(accumulated_value_and_grad: Callable) -> bool:
    """Exercise 4 (project): ``accumulated_value_and_grad(loss_fn, params, x, y, micro)`` in micro-batches.

    ``loss_fn(params, x, y)`` is a MEAN over its rows. The result must equal ``jax.value_and_grad(loss_fn)``
    on the whole batch, for batch sizes that ``micro`` does and does not divide, while ``loss_fn`` never sees
    more than ``micro`` rows at once. ``params`` is a nested pytree. ``loss_fn`` logs (``jax.debug.callback``
    in a ``custom_vjp``) when its forward pass starts and when its backward pass ends: each micro-batch's
    backward pass must end before the next one's forward pass starts, so that only one micro-batch's
    activations are alive at a time.

    Raises:
      ExerciseError: ``loss_fn`` called on more than ``micro`` rows, a result of the wrong structure, the loss
        or gradient off (sum instead of mean, unweighted mean of the micro-batches, the last rows dropped),
        all micro-batches differentiated at once (one ``grad`` of a sum, ``vmap`` of ``grad``).
    """
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(4)
    seen, passes = [], []
    tap = _pass_tap(passes)

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
        _judge_accumulated(loss_fn, params, x, y, micro, loss, grads)
        _judge_one_at_a_time(order, -(-batch // micro))
    return passed(
        "the accumulated loss and gradient equal the full-batch ones, micro-batch by micro-batch"
    )


def _pass_tap(passes: list):
    """An identity on params whose forward logs "f" and whose backward logs "b" into ``passes``, at run time."""
    import jax

    @jax.custom_vjp
    def tap(params):
        return params

    def forward(params):
        jax.debug.callback(lambda: passes.append("f"))
        return params, None

    def backward(_, cotangent):
        jax.debug.callback(lambda: passes.append("b"))
        return (cotangent,)

    tap.defvjp(forward, backward)
    return tap


def _judge_one_at_a_time(order: str, chunks: int) -> None:
    """``order``: the "f"/"b" log of the answer's passes (a checkpoint's recompute repeats an "f")."""
    while "ff" in order:
        order = order.replace("ff", "f")
    if order.count("b") < chunks:
        fail(
            f"{order.count('b')} backward pass(es) for {chunks} micro-batches: the micro-batches were "
            "differentiated together (vmap of grad?), so all their activations are alive at once",
            "differentiate one micro-batch, add its gradient into the running sum, then take the next "
            "(a Python loop, lax.scan or lax.fori_loop)",
        )
    if order != "fb" * chunks:
        fail(
            "a micro-batch's forward pass started before the previous one's backward pass ended "
            "(one grad of a sum of micro-batch losses?): every micro-batch's activations are kept",
            "call jax.value_and_grad(loss_fn) on one micro-batch at a time and add the results",
        )


def _judge_accumulated(loss_fn, params, x, y, micro, loss, grads) -> None:
    """The accumulated (loss, grads) against the whole batch's value_and_grad, or an ExerciseError."""
    import jax

    batch = x.shape[0]
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn))(
        params, x, y
    )  # the whole batch at once
    chunks = -(-batch // micro)
    leaves, ref_leaves = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
    close = all(np.allclose(g, r, rtol=1e-4, atol=1e-6) for g, r in zip(leaves, ref_leaves))
    if close and np.isclose(float(loss), float(ref_loss), rtol=1e-4):
        return
    if all(np.allclose(g, chunks * r, rtol=1e-4, atol=1e-6) for g, r in zip(leaves, ref_leaves)):
        fail(
            f"the gradient is {chunks}x the full-batch one ({chunks} micro-batches)",
            "loss_fn is a mean: weight each micro-batch by its share of the rows before adding",
        )
    if batch % micro:
        fail(
            f"batch {batch} in micro-batches of {micro}: the result differs from the full-batch one "
            "(it is right when micro divides the batch)",
            f"the last micro-batch has {batch % micro} rows, not {micro}: weight each micro-batch by "
            f"rows_in_it / {batch}, and do not drop it",
        )
    if not np.isclose(float(loss), float(ref_loss), rtol=1e-4):
        fail(
            f"loss {float(loss):.5f}, the full batch gives {float(ref_loss):.5f}",
            "accumulate the loss with the same weights as the gradient",
        )
    fail(
        "the gradient differs from the full-batch gradient",
        "each micro-batch's gradient, weighted by its share of rows",
    )

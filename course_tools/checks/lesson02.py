"""Checkers for ``02_jit.ipynb``: predicting compiles, padding a ragged batch, a timing bug, a scan loop.

Compiles are counted with ``course_lib.programs.CompileLog`` (``jax.log_compiles``), traces with a
counter inside the jitted function, timings against a stand-in step whose compute time is known, and the
scan loop against a Python loop of jitted steps (another algorithm) and by its program size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from functools import partial

import numpy as np

from course_lib.programs import CompileLog

from ._common import call_answer, checker, fail, not_written, passed

# ---------------------------------------------------------------- exercise 1: predict the compiles

COMPILE_CASES = (
    "jnp.arange(4.0)",
    "np.arange(4.0)",
    "jnp.arange(4)",
    "2.0",
    "3.0",
    "np.float32(3.0)",
    "jnp.arange(4.0).reshape(2, 2)",
    "jax.device_put(jnp.arange(4.0), jax.devices()[0])",
    "[jnp.arange(4.0)]",
    "jnp.ones(4)",
)
"""Arguments passed, in this order, to one fresh ``f = jax.jit(lambda x: jax.tree.map(lambda t: 2 * t, x))``."""

_COMPILE_HINTS = {  # what to look at, not the answer
    "jnp.arange(4.0)": "a jitted function has compiled nothing before its first call",
    "np.arange(4.0)": "print jnp.asarray(np.arange(4.0)).dtype: what does JAX make of a float64 NumPy array "
    "when 64-bit mode is off?",
    "jnp.arange(4)": "compare jnp.arange(4).dtype with jnp.arange(4.0).dtype",
    "2.0": "compare jax.typeof(2.0) with the shapes seen so far",
    "3.0": "jax.typeof(3.0) versus jax.typeof(2.0): what is in the key, the value or the type?",
    "np.float32(3.0)": "compare jax.typeof(np.float32(3.0)) with jax.typeof(3.0): look for the ~",
    "jnp.arange(4.0).reshape(2, 2)": "the shape is part of the key",
    "jax.device_put(jnp.arange(4.0), jax.devices()[0])": "same device as before, but print .committed: is that "
    "in the key?",
    "[jnp.arange(4.0)]": "a list of one array is another pytree than the array itself",
    "jnp.ones(4)": "which earlier call had exactly this shape, dtype, weak type, structure and placement?",
}


def measure_compiles() -> dict[str, bool]:
    """Call one fresh jitted function on ``COMPILE_CASES`` in order; True where a call compiled."""
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda x: jax.tree.map(lambda t: 2 * t, x))
    scope = {"jax": jax, "jnp": jnp, "np": np}
    out = {}
    for case in COMPILE_CASES:
        arg = eval(case, scope)  # built before counting: eager operations compile too
        with CompileLog() as log:
            jax.block_until_ready(f(arg))
        out[case] = bool(log.compiled)
    return out


@checker
def check_compiles(predictions: Mapping[str, bool] | None) -> bool:
    """Exercise 1: predict, for each call in ``COMPILE_CASES`` (in order), whether it compiles a new program.

    Raises:
      ExerciseError: a missing or non-boolean entry, or a wrong prediction (the hint says where to look).
    """
    hint = "write True (this call compiles) or False (it reuses a program) for every call, then run this cell"
    if all(v is None or v is Ellipsis for v in dict(predictions or {}).values()):
        not_written("the compile table", hint)
    got = dict(predictions)
    for case in COMPILE_CASES:
        if not isinstance(got.get(case), (bool, np.bool_)):
            fail(f"the prediction for f({case}) is {got.get(case)!r}, not True or False", hint)
    measured = measure_compiles()
    wrong = [c for c in COMPILE_CASES if bool(got[c]) != measured[c]]
    if wrong:
        others = f" ({len(wrong) - 1} other prediction(s) wrong too)" if len(wrong) > 1 else ""
        fail(
            f"your prediction {bool(got[wrong[0]])} for f({wrong[0]}) is not what happens{others}",
            _COMPILE_HINTS[wrong[0]],
        )
    for case in COMPILE_CASES:
        print(
            f"  f({case}){'':{max(0, 50 - len(case))}} {'compiles' if measured[case] else 'reuses'}"
        )
    return passed(f"all {len(COMPILE_CASES)} calls predicted: {sum(measured.values())} compiles")


# ---------------------------------------------------------------- exercise 2: pad a ragged batch


@checker
def check_pad_batch(pad_batch: Callable) -> bool:
    """Exercise 2: ``pad_batch(x, size) -> (x_padded, mask)`` so that a ragged last batch reuses the compiled step.

    ``x``: float32 [n, d] with ``n <= size``; ``x_padded``: [size, d], ``x`` in its first ``n`` rows; ``mask``:
    [size], true (or 1) for the ``n`` real rows. The checker runs a jitted masked mean over batches of 8, 8, 5
    and 1 rows (random values, two widths) and counts its traces.

    Raises:
      ExerciseError: wrong shapes, a mask that counts padding, real rows moved, a wrong mean, or a second trace.
    """
    import jax
    import jax.numpy as jnp

    traces = []

    @jax.jit
    def masked_mean(xp, mask):
        traces.append(xp.shape)  # runs only while tracing: one entry per compile
        m = mask.astype(xp.dtype)
        return (xp * m[:, None]).sum(0) / m.sum()

    rng = np.random.default_rng(0)
    size = 8
    for d in (3, 5):
        traces.clear()
        for n in (8, 8, 5, 1):
            x = rng.normal(size=(n, d)).astype(np.float32)
            out = call_answer(f"pad_batch(x of {n} rows, {size})", pad_batch, jnp.asarray(x), size)
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                fail(
                    "expected a pair (x_padded, mask)",
                    "return both: the padded batch and the mask of real rows",
                )
            xp, mask = out
            if tuple(xp.shape) != (size, d):
                fail(
                    f"a batch of {n} rows padded to shape {tuple(xp.shape)}, expected ({size}, {d})",
                    "pad the leading axis up to size, after the real rows "
                    "(jnp.pad takes one (before, after) pair per axis)",
                )
            if tuple(mask.shape) != (size,):
                fail(
                    f"mask shape {tuple(mask.shape)}, expected ({size},)",
                    "one mask entry per padded row",
                )
            real = int(np.asarray(mask).astype(bool).sum())
            if real != n:
                fail(
                    f"the mask marks {real} rows as real, the batch had {n}",
                    "the mask is true at the first n positions only",
                )
            if not np.allclose(np.asarray(xp)[:n], x):
                fail(
                    "the first rows of x_padded are not x",
                    "keep x in the first n rows; put the padding after it",
                )
            got = np.asarray(masked_mean(xp, mask))
            if not np.allclose(got, x.mean(0), rtol=1e-5, atol=1e-6):
                fail(
                    f"the masked mean of a {n}-row batch is wrong",
                    "the mask must be true exactly for the real rows",
                )
        if len(traces) != 1:
            fail(
                f"the jitted step traced {len(traces)} times, for shapes {traces}",
                "every batch must reach the step with the same shape: pad the ragged batch to size",
            )
    return passed("ragged batches reuse the compiled step (1 trace for 4 batches, at two widths)")


# ---------------------------------------------------------------- exercise 3: debug a timing function

WORK_S = 0.04  # the stand-in step's compute time per call
COMPILE_S = 0.4  # its first call's compile time


class _Pending:
    """A result that becomes ready at ``ready_at`` (``time.perf_counter()`` seconds), like a dispatched jax.Array."""

    def __init__(self, ready_at: float, step: StandInStep):
        self.ready_at, self.step = ready_at, step

    def block_until_ready(self):
        self.step.waited += 1
        delay = self.ready_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return self


class StandInStep:
    """Behaves like a jitted step for timing purposes: the first call compiles (blocks ``COMPILE_S``); every call
    returns at once (asynchronous dispatch) a result ready ``WORK_S`` after the previous one (a queue)."""

    def __init__(self):
        self.calls = 0
        self.waited = 0  # results someone waited for
        self.busy_until = 0.0

    def __call__(self, *args):
        self.calls += 1
        if self.calls == 1:
            time.sleep(COMPILE_S)
        self.busy_until = max(self.busy_until, time.perf_counter()) + WORK_S
        return _Pending(self.busy_until, self)


@checker
def check_median_time(median_time: Callable) -> bool:
    """Exercise 3: ``median_time(fn, *args, repeats=5)`` returns the median seconds per call of a jitted ``fn``.

    Judged against a stand-in step whose compute time (``WORK_S``) and compile time (``COMPILE_S``) are known,
    with ``repeats`` 5 and 1.

    Raises:
      ExerciseError: the time of the dispatch only (no synchronisation), the compile included (no warm-up),
        milliseconds instead of seconds, too many calls, or not a number.
    """
    for repeats in (5, 1):
        step = StandInStep()
        seconds = call_answer(
            f"median_time(step, x, repeats={repeats})",
            median_time,
            step,
            np.ones(3),
            repeats=repeats,
        )
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float, np.floating)):
            fail(
                f"median_time returned {type(seconds).__name__}",
                "return one number: the median in seconds",
            )
        seconds = float(seconds)
        if step.calls > repeats + 5:
            fail(
                f"median_time called fn {step.calls} times for repeats={repeats}",
                "one or two warm-up calls, then `repeats` timed calls",
            )
        if step.waited == 0:
            fail(
                f"median_time never waited for a result ({seconds * 1e3:.3f} ms for a {WORK_S * 1e3:.0f} ms step)",
                "a jitted call returns once the work is queued: wait for the result (jax.block_until_ready) "
                "before you stop the clock",
            )
        if seconds > 100 * WORK_S:
            fail(
                f"median_time returned {seconds:g} for a step of {WORK_S} s",
                "return seconds, not milliseconds",
            )
        if seconds < 0.3 * WORK_S:
            fail(
                f"median_time says {seconds * 1e3:.3f} ms for a step that computes for {WORK_S * 1e3:.0f} ms",
                "a jitted call returns once the work is queued: wait for the result (jax.block_until_ready) "
                "before you stop the clock",
            )
        if seconds > 2 * WORK_S:
            fail(
                f"median_time says {seconds * 1e3:.0f} ms with repeats={repeats} for a step of "
                f"{WORK_S * 1e3:.0f} ms",
                "the first call traces and compiles: make an untimed warm-up call "
                "(and wait for it) before timing",
            )
        if not 0.75 * WORK_S <= seconds <= 1.6 * WORK_S:
            fail(
                f"median_time says {seconds * 1e3:.1f} ms for a {WORK_S * 1e3:.0f} ms step",
                "time each call from just before it to just after its result is ready, and take the median",
            )
    return passed(
        f"median_time measures the compute ({seconds * 1e3:.1f} ms for a {WORK_S * 1e3:.0f} ms step), "
        "not the dispatch or the compile"
    )


# ---------------------------------------------------------------- exercise 4: a scan training loop


def _problem(steps: int, seed: int):
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    params = {
        "w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=2), jnp.float32),
    }
    xs = jnp.asarray(rng.normal(size=(steps, 5, 3)), jnp.float32)
    ys = jnp.asarray(rng.normal(size=(steps, 5, 2)), jnp.float32)
    return params, xs, ys


def _loss_fn(params, x, y):
    import jax.numpy as jnp

    return jnp.mean((jnp.tanh(x @ params["w"] + params["b"]) - y) ** 2)


def _python_loop(loss_fn, params, xs, ys, lr):
    """Another algorithm for the same result: a jitted step called from a Python loop."""
    import jax

    @jax.jit
    def step(weights, x, y):
        value, grad = jax.value_and_grad(loss_fn)(weights, x, y)
        return jax.tree.map(lambda w, dw: w - lr * dw, weights, grad), value

    losses = []
    for x, y in zip(xs, ys):
        params, loss = step(params, x, y)
        losses.append(loss)
    return params, np.stack([np.asarray(v) for v in losses])


def _judge_training(train_scan: Callable, steps: int, seed: int, lr: float) -> None:
    """train_scan's values against a Python loop of jitted SGD steps, or an ExerciseError."""
    import jax

    params, xs, ys = _problem(steps, seed)
    out = call_answer(
        "train_scan(loss_fn, params, xs, ys, lr)", train_scan, _loss_fn, params, xs, ys, lr
    )
    if not isinstance(out, tuple | list) or len(out) != 2:
        fail(
            "expected a pair (final_params, losses)",
            "lax.scan returns (final carry, stacked outputs)",
        )
    final, losses = out
    ref_params, ref_losses = _python_loop(_loss_fn, params, xs, ys, lr)
    if jax.tree.structure(final) != jax.tree.structure(params):
        fail(
            f"final params have structure {jax.tree.structure(final)}",
            "the carry is the params pytree",
        )
    if np.shape(losses) != (steps,):
        fail(
            f"losses has shape {np.shape(losses)}, expected ({steps},)",
            "each step outputs its scalar loss",
        )
    losses = np.asarray(losses)
    if not np.allclose(losses, ref_losses, rtol=1e-4, atol=1e-6):
        if np.allclose(losses, [_loss_fn(params, x, y) for x, y in zip(xs, ys)], rtol=1e-4):
            fail(
                "every loss is computed with the initial params",
                "the step must return the updated params as the new carry, and use the carry it receives",
            )
        after = [
            float(
                _loss_fn(
                    _python_loop(_loss_fn, params, xs[: i + 1], ys[: i + 1], lr)[0], xs[i], ys[i]
                )
            )
            for i in range(3)
        ]
        if np.allclose(losses[:3], after, rtol=1e-4):
            fail(
                "losses[i] is measured after step i's update",
                "record the loss value_and_grad returns, before updating",
            )
        fail(
            f"losses differ from a Python loop of SGD steps (first {losses[:2]}, expected {ref_losses[:2]})",
            "each step takes the loss and gradient at the params it receives, then subtracts lr times it",
        )
    for got, want in zip(jax.tree.leaves(final), jax.tree.leaves(ref_params)):
        if not np.allclose(got, want, rtol=1e-4, atol=1e-6):
            fail(
                "the final params differ from a Python loop of SGD steps",
                "return the carry scan ends with",
            )


def _compile_seconds(train_scan: Callable, lr: float, steps: int = 10) -> dict[str, float]:
    """Trace + compile time of the learner's loop and of the same loop unrolled by Python."""
    import jax

    params, xs, ys = _problem(steps, 3)
    seconds = {}
    for name, fn in (
        ("your scan", lambda *a: train_scan(_loss_fn, *a)),
        ("unrolled", partial(_unrolled, _loss_fn)),
    ):
        began = time.perf_counter()
        jax.jit(fn).lower(params, xs, ys, lr).compile()
        seconds[name] = time.perf_counter() - began
    return seconds


@checker
def check_train_scan(train_scan: Callable) -> bool:
    """Exercise 4 (project): ``train_scan(loss_fn, params, xs, ys, lr) -> (params, losses)``, one compiled loop.

    ``xs``: [steps, batch, d_in], ``ys``: [steps, batch, d_out]; one SGD step per leading index; ``losses[i]``
    is step i's loss before its update. Judged against a Python loop of jitted steps (values, at 6 and 24
    steps), by program size (as many printed jaxpr lines, nested jaxprs included, for 6 steps as for 24: not
    unrolled), and by compile counts (new data and a new learning rate reuse the program). Then prints the
    compile time against the same loop unrolled.

    Raises:
      ExerciseError: wrong values (params not carried, loss after the update, wrong sign), wrong shapes, an
        unrolled loop, a recompile per call or per learning rate.
    """
    import jax

    lr = 0.3
    for steps, seed in ((6, 0), (24, 1)):
        _judge_training(train_scan, steps, seed, lr)

    def program_lines(steps):  # the printed jaxpr, nested jaxprs (jit, scan, while bodies) included
        jaxpr = jax.make_jaxpr(lambda p, x, y: train_scan(_loss_fn, p, x, y, lr))(
            *_problem(steps, 0)
        )
        return len(str(jaxpr).splitlines())

    small, large = program_lines(6), program_lines(24)
    if large > 1.5 * small:
        fail(
            f"the program grows with the steps ({small} jaxpr lines for 6 steps, {large} for 24): the loop is "
            "unrolled",
            "a Python loop over the steps is traced once per step; use lax.scan over xs, ys",
        )
    params, xs, ys = _problem(24, 2)  # new data of the same shapes, made before counting
    with CompileLog() as log:
        jax.block_until_ready(train_scan(_loss_fn, params, xs, ys, lr))
        jax.block_until_ready(train_scan(_loss_fn, params, xs, ys, 0.1))
    if log.compiled:
        fail(
            f"two more calls (new data, then a new learning rate) compiled {len(log.compiled)} program(s)",
            "jit the whole loop once (loss_fn static, everything else traced: the learning rate is data)",
        )
    seconds = _compile_seconds(train_scan, lr)
    print(
        f"  trace + compile for 10 steps: your scan {seconds['your scan']:.2f} s, the same loop unrolled "
        f"{seconds['unrolled']:.2f} s (relative timings)"
    )
    return passed(
        "train_scan matches a Python loop of SGD steps, in one program that does not grow with the steps"
    )


def _unrolled(loss_fn, params, xs, ys, lr):
    """The same loop unrolled by Python at trace time (for the compile-time comparison)."""
    import jax
    import jax.numpy as jnp

    values = []
    for i in range(xs.shape[0]):
        value, grad = jax.value_and_grad(loss_fn)(params, xs[i], ys[i])
        params = jax.tree.map(lambda w, dw: w - lr * dw, params, grad)
        values.append(value)
    return params, jnp.stack(values)

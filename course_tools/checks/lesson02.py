"""Checkers for ``02_jit.ipynb``: why code recompiles, power-of-two buckets, a timing bug, a scan loop.

Compiles are counted with ``course_lib.programs.CompileLog`` (``jax.log_compiles``), traces with a
counter inside the jitted function, timings against a stand-in step whose compute time is drawn at random
for each check, and the scan loop against a Python loop of jitted steps (another algorithm) and by its
program size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from functools import partial

import numpy as np

from course_lib.programs import CompileLog

from ._common import (
    ExerciseError,
    call_answer,
    checker,
    close,
    fail,
    matmul_rtol,
    not_written,
    passed,
)
from ._lesson02_bucket import LENGTHS, judge_bucket_pad
from ._lesson02_recompile import RECOMPILE_CASES, RECOMPILE_SETUP, measure_recompiles

__all__ = ["RECOMPILE_CASES", "RECOMPILE_SETUP", "measure_recompiles"]  # the notebook prints these

# ---------------------------------------------------------------- exercise 1: why does this recompile?

_RECOMPILE_HINT = (  # how to reason, the same whichever count is wrong
    "the compile cache belongs to the function object jax.jit wraps and holds one program per key; a "
    "static argument enters the key by its hash and ==, and the way it is passed (by keyword or position) "
    "is part of the key. Ask of every snippet: is it the same function object each time, and would the "
    "key compare equal? A value the function only closes over is in no key at all"
)


@checker
def check_recompiles(predictions: Mapping[str, int | str] | None) -> bool:
    """Exercise 1: predict how many programs each snippet of ``RECOMPILE_CASES`` compiles (or ``"error"``).

    Spec: every prediction equals the count :func:`measure_recompiles` measures (``CompileLog``, the
    snippet's own jitted functions only) — a whole number, or ``"error"`` where the snippet raises. A wrong
    answer is told how many predictions are wrong, never which, with one hint on how to reason.

    Raises:
      ExerciseError: a missing or malformed prediction, or wrong ones (their number).
    """
    hint = 'write a whole number (or "error") for every snippet, then run this cell'
    if all(v is None or v is Ellipsis for v in dict(predictions or {}).values()):
        not_written("the compile predictions", hint)
    got = {}
    for name in RECOMPILE_CASES:
        value = dict(predictions).get(name)
        if isinstance(value, str) and value.strip().lower() == "error":
            got[name] = "error"
        elif isinstance(value, int | np.integer) and not isinstance(value, bool):
            got[name] = int(value)
        else:
            fail(f"the prediction for {name!r} is {value!r}", hint)
    measured = measure_recompiles()
    wrong = sum(got[name] != measured[name] for name in RECOMPILE_CASES)
    if wrong:
        fail(
            f"{wrong} of your {len(RECOMPILE_CASES)} predictions are not what happens",
            _RECOMPILE_HINT,
        )
    for name in RECOMPILE_CASES:
        print(f"  {name:28s} {measured[name]}")
    return passed(f"all {len(RECOMPILE_CASES)} snippets predicted")


# ---------------------------------------------------------------- exercise 2: buckets of powers of two


@checker
def check_bucket_pad(bucket_pad: Callable) -> bool:
    """Exercise 2: ``bucket_pad(x) -> (x_padded, mask)``: rows padded to the next power of two.

    Spec (in full in ``_lesson02_bucket``): ``x_padded`` is ``[b, d]`` with ``b`` the smallest power of two
    ``>= n``, ``x`` in its first ``n`` rows; ``mask`` ``[b]`` marks the real rows; outputs of one bucket
    have one shape and dtype, so a jitted masked mean run on lengths from 1 to 40 compiles 7 programs, one per
    bucket, and its values are the means of the real rows.

    Raises:
      ExerciseError: a wrong number of rows (naming the bucket), a wrong mask, real rows moved, a wrong
        masked mean, or more compiles than buckets (naming what changed inside a bucket).
    """
    buckets = judge_bucket_pad(bucket_pad)
    return passed(
        f"{len(LENGTHS)} batch lengths compile {buckets} programs, and no batch is more than half padding"
    )


# ---------------------------------------------------------------- exercise 3: debug a timing function

WORK_RANGE_S = (0.04, 0.08)
"""The stand-in step's compute time per call is drawn from this range for every check (so no constant
passes); its first call's compile time is ten times that."""


class _Pending:
    """One output of the stand-in step: ready at ``ready_at`` (``time.perf_counter()`` seconds), like a
    dispatched jax.Array; waiting for it (``block_until_ready``, or a copy to the host through ``__array__``,
    as ``jax.device_get`` and ``np.asarray`` make) blocks until then."""

    def __init__(self, ready_at: float, step: StandInStep):
        self.ready_at, self.step, self.waited = ready_at, step, False

    def block_until_ready(self):
        self.step.waited += 1
        self.waited = True
        delay = self.ready_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
            # how late the sleep woke: on a busy machine a few ms to tens of ms, which a right answer measures
            self.step.late.append(time.perf_counter() - self.ready_at)
        return self

    def copy_to_host_async(self):
        return None

    def __array__(self, dtype=None, copy=None):
        self.block_until_ready()
        return np.zeros((), dtype or np.float32)


SLOW_CALLS = {4: 8.0, 5: 0.5}
"""With ``repeats > 1``, the stand-in's 4th call computes for 8 times its usual time and its 5th for half of
it, like a step that meets a slow and a fast moment: both fall among the timed calls after one or two
warm-up calls, so the median of the timed calls is the usual time while their mean, minimum and maximum
are not."""


class StandInStep:
    """Behaves like a jitted step for timing purposes: the first call compiles (blocks ``compile_s``); every
    call returns at once (asynchronous dispatch) a plain tuple ``(loss, params)`` of two :class:`_Pending`
    results, as a jitted step returns a pytree of arrays (a tuple has no ``block_until_ready`` method, as on
    real JAX: ``jax.block_until_ready(out)`` waits for every leaf): the loss is ready early in the call, the
    params the call's compute time after the previous call's (a queue); call ``k`` computes for
    ``work_s * slow.get(k, 1)``."""

    def __init__(self, work_s: float, compile_s: float, slow: Mapping[int, float] | None = None):
        self.work_s, self.compile_s, self.slow = work_s, compile_s, dict(slow or {})
        self.calls = 0
        self.waited = 0  # results someone waited for
        self.late: list[float] = []  # seconds each wait woke after its result was ready
        self.busy_until = 0.0
        self.outputs: list[tuple[_Pending, _Pending]] = []

    def __call__(self, *args):
        self.calls += 1
        if self.calls == 1:
            time.sleep(self.compile_s)
        start = max(self.busy_until, time.perf_counter())
        self.busy_until = start + self.work_s * self.slow.get(self.calls, 1.0)
        out = (_Pending(start + 0.1 * self.work_s, self), _Pending(self.busy_until, self))
        self.outputs.append(out)
        return out

    def timed_mean(self) -> float:
        """The mean compute time of the calls after the first (what a mean of the timed calls gives)."""
        return self.work_s * float(np.mean([self.slow.get(k, 1.0) for k in range(2, 7)]))


def _judge_seconds(seconds, step: StandInStep, repeats: int) -> float:
    work = step.work_s
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float, np.floating)):
        fail(
            f"median_time returned {type(seconds).__name__}",
            "return one number: the median in seconds",
        )
    seconds = float(seconds)
    if step.calls > repeats + 5 or step.calls < repeats:
        fail(
            f"median_time called fn {step.calls} times for repeats={repeats}",
            "one or two untimed warm-up calls, then `repeats` timed calls",
        )
    part = [(loss, params) for loss, params in step.outputs if loss.waited != params.waited]
    if part:
        fail(
            f"median_time waited for one of the 2 results of a call only ({len(part)} of "
            f"{len(step.outputs)} calls): a step's results are not ready at the same moment",
            "wait for the whole output, every array in its pytree: jax.block_until_ready(out)",
        )
    unsynced = (
        "a jitted call returns once the work is queued: wait for the result (jax.block_until_ready) "
        "before you stop the clock"
    )
    if step.waited == 0:
        fail(
            f"median_time never waited for a result ({seconds * 1e3:.3f} ms for a {work * 1e3:.0f} ms step)",
            unsynced,
        )
    if seconds > 100 * work:
        fail(
            f"median_time returned {seconds:g} for a step of {work:.3f} s",
            "return seconds, not milliseconds",
        )
    if seconds < 0.3 * work:
        fail(
            f"median_time says {seconds * 1e3:.3f} ms for a step that computes for {work * 1e3:.0f} ms",
            unsynced,
        )
    return seconds


def _judge_bounds(seconds: float, step: StandInStep, repeats: int) -> None:
    """The bounds a loaded machine can push a right answer past (the mean among them), judged on a fresh run
    again by :func:`check_median_time` when one fails.

    A wait on a busy machine wakes late, and an answer that waits for every call measures that too: the
    upper bounds are judged on the answer less how late this run's waits woke (their median), so load
    cannot fail a right answer, and a compile counted in still shows (it costs ten steps)."""
    work = step.work_s
    late = float(np.median(step.late)) if step.late else 0.0
    # a right answer that load delayed by about the slow call's share lands on the mean: judged afresh
    if repeats > 1 and abs(seconds - late - step.timed_mean()) < 0.3 * work:
        fail(
            f"median_time says {seconds * 1e3:.0f} ms for a step that usually computes for "
            f"{work * 1e3:.0f} ms: that is the mean of the timed calls, and one of them was slow",
            "one slow call moves the mean, not the median: return statistics.median of the timed calls",
        )
    if seconds - late > 2 * work:
        fail(
            f"median_time says {seconds * 1e3:.0f} ms with repeats={repeats} for a step of "
            f"{work * 1e3:.0f} ms",
            "the first call traces and compiles: make an untimed warm-up call "
            "(and wait for it) before timing",
        )
    if not (seconds >= 0.75 * work and seconds - late <= 1.6 * work):
        fail(
            f"median_time says {seconds * 1e3:.1f} ms for a {work * 1e3:.0f} ms step"
            + (f" (its waits woke {late * 1e3:.1f} ms late)" if late > 1e-3 else ""),
            "time each call from just before it to just after its result is ready, and take the median",
        )


BOUND_ATTEMPTS = 3
"""Fresh runs a timing gets before its bounds refuse it: a right answer measures what a loaded machine adds
(a wait that wakes late, a thread not scheduled between the call and the clock), which can push it past a
bound once; a wrong one (the compile counted in, another statistic) is past it every time."""


def _explain_timing_error(error: Exception):
    """A learner's message for calling ``block_until_ready`` on the output pytree itself."""
    if isinstance(error, AttributeError) and "block_until_ready" in str(error):
        return (
            f"median_time called .block_until_ready() on the step's output: {error}",
            "a step returns a pytree (here a tuple of two arrays), which has no such method; "
            "jax.block_until_ready(out) waits for every array in it",
        )
    return None


@checker
def check_median_time(median_time: Callable) -> bool:
    """Exercise 3: ``median_time(fn, *args, repeats=5)`` returns the median seconds per call of a jitted ``fn``.

    Spec: within 0.75–1.6 × the usual compute time of one call (the upper bound judged on the answer less
    the median time the run's waits woke late, which a busy machine adds to a right answer; a run past the
    bounds is judged again on a fresh stand-in, up to ``BOUND_ATTEMPTS`` runs), for ``repeats`` 5 and 1,
    with ``repeats`` to ``repeats + 5`` calls, each waited-for output waited for whole. Judged against a
    stand-in step (asynchronous dispatch, a queue, a first call that compiles, an output that is a plain
    tuple of two results ready at different moments) whose compute time is drawn from ``WORK_RANGE_S``
    anew for each run, so neither a constant nor a time measured once passes; with ``repeats=5`` one timed
    call is slow and one fast (``SLOW_CALLS``), so the mean, the minimum and the maximum miss.

    Raises:
      ExerciseError: the time of the dispatch only (no synchronisation), a wait for part of the output (or a
        ``.block_until_ready()`` method called on the output pytree, which has none), the
        compile included (no warm-up), the mean (or another statistic) for the median, milliseconds instead
        of seconds, too many or too few calls, or not a number.
    """
    rng = np.random.default_rng()
    for repeats in (5, 1):
        for attempt in range(BOUND_ATTEMPTS):
            work = float(rng.uniform(*WORK_RANGE_S))
            step = StandInStep(work, 10 * work, SLOW_CALLS if repeats > 1 else None)
            seconds = call_answer(
                f"median_time(step, x, repeats={repeats})",
                median_time,
                step,
                np.ones(3),
                repeats=repeats,
                explain=_explain_timing_error,
            )
            seconds = _judge_seconds(seconds, step, repeats)
            try:
                _judge_bounds(seconds, step, repeats)
                break
            except ExerciseError:
                if attempt == BOUND_ATTEMPTS - 1:
                    raise
    return passed(
        f"median_time measures the compute ({seconds * 1e3:.1f} ms for a {work * 1e3:.0f} ms step), "
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


def _copies(*trees):
    """Fresh copies of the arrays in ``trees``, so that an answer that donates them leaves ours alive."""
    import jax
    import jax.numpy as jnp

    return jax.tree.map(jnp.copy, trees)


def _judge_training(train_scan: Callable, steps: int, seed: int, lr: float) -> None:
    """train_scan's values against a Python loop of jitted SGD steps, or an ExerciseError."""
    import jax

    params, xs, ys = _problem(steps, seed)
    out = call_answer(  # on copies: an answer may donate its arguments (section 6)
        "train_scan(loss_fn, params, xs, ys, lr)",
        train_scan,
        _loss_fn,
        *_copies(params, xs, ys),
        lr,
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
    rtol = matmul_rtol(1e-4)  # a scan against a Python loop: the platform's float32 matmul rounding
    if not close(losses, ref_losses, rtol):
        if np.allclose(losses, [_loss_fn(params, x, y) for x, y in zip(xs, ys)], rtol=rtol):
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
        if np.allclose(losses[:3], after, rtol=rtol):
            fail(
                "losses[i] is measured after step i's update",
                "record the loss value_and_grad returns, before updating",
            )
        fail(
            f"losses differ from a Python loop of SGD steps (first {losses[:2]}, expected {ref_losses[:2]})",
            "each step takes the loss and gradient at the params it receives, then subtracts lr times it",
        )
    for got, want in zip(jax.tree.leaves(final), jax.tree.leaves(ref_params)):
        if not close(got, want, rtol):
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

    Spec: ``xs``: [steps, batch, d_in], ``ys``: [steps, batch, d_out]; one SGD step per leading index; ``losses[i]``
    is step i's loss before its update. Judged against a Python loop of jitted steps (values, at 6 and 24
    steps), by program size (about as many lines of compiled HLO for 6 steps as for 24: not unrolled, neither
    by Python nor by ``scan(unroll=True)``), and by compile counts (new data and a new learning rate reuse
    the program). The answer gets copies of the arrays (it may donate them). Then prints the compile time
    against the same loop unrolled.

    Raises:
      ExerciseError: wrong values (params not carried, loss after the update, wrong sign), wrong shapes, an
        unrolled loop, a recompile per call or per learning rate.
    """
    import jax

    lr = 0.3
    for steps, seed in ((6, 0), (24, 1)):
        _judge_training(train_scan, steps, seed, lr)

    def program_lines(steps):  # the compiled program XLA runs (what scan's unroll= changes too)
        lowered = jax.jit(lambda p, x, y: train_scan(_loss_fn, p, x, y, lr)).lower(
            *_problem(steps, 0)
        )
        return len(lowered.compile().as_text().splitlines())

    small, large = program_lines(6), program_lines(24)
    if large > 1.5 * small:
        fail(
            f"the compiled program grows with the steps ({small} HLO lines for 6 steps, {large} for 24): the "
            "loop is unrolled",
            "a Python loop over the steps is traced once per step, and lax.scan(..., unroll=True) is unrolled "
            "by the compiler: use lax.scan over xs, ys without unrolling",
        )
    data = [
        _copies(*_problem(24, 2)) for _ in range(2)
    ]  # new data of the same shapes, made before counting
    with CompileLog() as log:
        jax.block_until_ready(train_scan(_loss_fn, *data[0], lr))
        jax.block_until_ready(train_scan(_loss_fn, *data[1], 0.1))
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

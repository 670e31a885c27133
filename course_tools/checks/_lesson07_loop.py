"""Lesson 07's exercise 3 (exported by :mod:`course_tools.checks.lesson07`): a training loop that keeps the
devices busy while the host makes batches and logs.

The checker hands the loop its own ``step``, ``make_batch`` and ``log`` and measures what overlapped: a
watcher thread waits on every dispatched step in order and records when it finished, so each step's busy
interval on the device is known (from its dispatch, or the previous step's end, to its end); every
``make_batch`` records its own interval and, exactly, whether the step dispatched last was still running when
it began and when it ended. The steps' device work and the host's work vary from step to step; the first
step takes at least :data:`MIN_STEP_S` on every platform (an accelerator gets more matmuls per step), so
that dispatching a step is short next to running it, as on XLA:CPU.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._common import call_answer, fail

N_STEPS = 6
WORK = (1.0, 1.6, 0.7, 1.3, 0.9, 1.2)
"""Each step's device work, relative to the first's (its matmul count)."""
HOST = (0.45, 0.3, 0.6, 0.35, 0.5, 0.4)
"""Each ``make_batch(i)``'s host work, as a fraction of the device time of the step before it (step
``i - 1``, with which a good loop overlaps it); ``log`` works a quarter of that."""
_BASE_ITERS = 120
MIN_STEP_S = 0.02
"""The shortest device time of the first step, in seconds: long next to dispatching a step and waking a
thread (tens of microseconds). 120 matmuls of 256 × 256 take tens of milliseconds on XLA:CPU but
microseconds on an accelerator, less than their dispatch, so :meth:`Harness.warm_up` scales every step's
matmul count up until the first step takes at least this long."""
LOG_LAG = 2
"""``log(i, …)`` runs before step ``i + 1 + LOG_LAG`` is dispatched: at most this many steps late."""


class Harness:
    """The step, make_batch and log handed to the learner's loop, recording what ran when."""

    def __init__(self, size: int = 256):
        rng = np.random.default_rng(10)
        self.size = size
        self.m = jnp.asarray(rng.standard_normal((size, size)) / np.sqrt(size), jnp.float32)
        self.batches = [
            rng.standard_normal((size, size)).astype(np.float32) for _ in range(N_STEPS)
        ]
        self.iters = self._iters(1.0)
        self._step = jax.jit(self._step_fn)
        self.lock = threading.Lock()
        self.dispatched: list = []  # (time, loss) of each step, in dispatch order
        self.ended: list = []  # when each step finished, recorded by the watcher thread
        self.batch_calls: list = []  # (i, start, end, running at start, running at end)
        self.logs: list = []  # (i, loss, steps dispatched by then)
        self.queued: list = []  # per step 1 …: whether the step before still ran when it was dispatched
        self.host_calls: list = []  # (start, end) of every make_batch and log call
        self._pending: queue.Queue = queue.Queue()

    def _step_fn(self, state, batch, iters):
        h = lax.fori_loop(0, iters, lambda i, h: jnp.tanh(h @ self.m), state + batch)
        loss = jnp.mean((h - batch) ** 2)
        # the new state depends on the whole step's work: it is ready no sooner than the loss
        return 0.9 * state + 0.1 * batch + 1e-6 * loss, {"loss": loss}

    @staticmethod
    def _iters(scale: float) -> list[int]:
        return [max(1, round(_BASE_ITERS * scale * w)) for w in WORK]

    def warm_up(self) -> Any:
        """Compile, then time one step of the base work (the fastest of 5: a busy machine only ever
        slows a step down): the unit of every host time. A step shorter than :data:`MIN_STEP_S` (an
        accelerator's) gets more matmuls, all steps alike, until it is not (the count is an argument of
        the compiled step: nothing recompiles)."""
        state0 = jnp.zeros((self.size, self.size), jnp.float32)
        jax.block_until_ready(self._step(state0, self.batches[0], self.iters[0]))
        scale = 1.0
        for _ in range(8):
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                jax.block_until_ready(self._step(state0, self.batches[0], self.iters[0]))
                times.append(time.perf_counter() - t0)
            self.device_s = float(np.min(times))
            if self.device_s >= MIN_STEP_S:
                break
            scale *= min(64.0, max(2.0, 1.5 * MIN_STEP_S / self.device_s))
            self.iters = self._iters(scale)
        return state0

    def expected(self, state):
        losses = []
        for b, iters in zip(self.batches, self.iters):
            state, metrics = self._step(state, b, iters)
            losses.append(float(metrics["loss"]))
        return state, losses

    def _watch(self):
        while (item := self._pending.get()) is not None:
            jax.block_until_ready(item)
            with self.lock:
                self.ended.append(time.perf_counter())

    def run(self, fn, state):
        watcher = threading.Thread(target=self._watch, daemon=True)
        watcher.start()
        try:
            return call_answer(
                "train_loop", fn, self.step, state, self.make_batch, N_STEPS, self.log
            )
        finally:
            self._pending.put(None)
            watcher.join(timeout=60)

    def step(self, state, batch):
        with self.lock:
            k = len(self.dispatched)
        if k:
            self.queued.append(self._running())
        t = time.perf_counter()
        out = self._step(state, batch, self.iters[min(k, N_STEPS - 1)])
        with self.lock:
            self.dispatched.append((t, out[1]["loss"]))
        self._pending.put(out[1]["loss"])
        return out

    def _running(self) -> bool:
        with self.lock:
            last = self.dispatched[-1][1] if self.dispatched else None
        return last is not None and not last.is_ready()

    def _host_s(self, i: int) -> float:
        before = WORK[max(i - 1, 0)]
        return HOST[int(i) % N_STEPS] * before * self.device_s

    def make_batch(self, i):
        start, running_start = time.perf_counter(), self._running()
        time.sleep(self._host_s(int(i)))
        end, running_end = time.perf_counter(), self._running()
        self.batch_calls.append((int(i), start, end, running_start, running_end))
        self.host_calls.append((start, end))
        return self.batches[int(i)]

    def log(self, i, loss):
        start = time.perf_counter()
        with self.lock:
            n_dispatched = len(self.dispatched)
        self.logs.append((int(i), float(loss), n_dispatched))
        time.sleep(self._host_s(int(i)) / 4)
        self.host_calls.append((start, time.perf_counter()))

    def waited(self) -> list[bool]:
        """Per step ``1 …``: whether the loop waited for the step before ended before dispatching it —
        that step had finished at the dispatch, and between the two dispatches the host spent more than a
        tenth of a step outside ``make_batch`` and ``log`` (idle, or reading the step's results). A step
        that finished during the host's own work is not a wait: the timing of a busy machine varies."""
        out = []
        times = [t for t, _ in self.dispatched]
        for k, queued in enumerate(self.queued, start=1):
            a, b = times[k - 1], times[k]
            busy = _union_length(
                [(max(s, a), min(e, b)) for s, e in self.host_calls if e > a and s < b]
            )
            out.append(not queued and (b - a) - busy > 0.1 * self.device_s)
        return out

    def busy_intervals(self) -> list[tuple[float, float]]:
        """Each step's interval on the device: from its dispatch (or the previous step's end) to its end."""
        out, prev_end = [], -np.inf
        for (t, _), end in zip(self.dispatched, self.ended):
            out.append((max(t, prev_end), end))
            prev_end = end
        return out

    def overlap(self) -> tuple[float, float]:
        """``(seconds of batch-making while a step ran, seconds of batch-making)`` for batches 1 … n-1.

        Exact at the extremes: a batch made while no step was running (it began with the last step done)
        overlaps nothing, one that ended with a step still running overlapped for its whole length;
        between the two, the watcher's end times give the overlap."""
        busy = self.busy_intervals()
        total = overlapped = 0.0
        for i, start, end, running_start, running_end in self.batch_calls:
            if i < 1:
                continue
            total += end - start
            if running_end:
                overlapped += end - start
            elif running_start:
                overlapped += sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy)
        return overlapped, total


def _union_length(spans: list[tuple[float, float]]) -> float:
    total, reach = 0.0, -np.inf
    for s, e in sorted(spans):
        if e > reach:
            total += e - max(s, reach)
            reach = e
    return total


def _judge_calls(h: Harness, state, want_state, want_losses) -> None:
    calls = sorted(i for i, *_ in h.batch_calls)
    if calls != list(range(N_STEPS)):
        fail(
            f"make_batch was called for {calls}", f"make each batch 0 … {N_STEPS - 1} exactly once"
        )
    if [i for i, _, _ in h.logs] != list(range(N_STEPS)):
        missing = sorted(set(range(N_STEPS)) - {i for i, _, _ in h.logs})
        fail(
            f"log was called for steps {[i for i, _, _ in h.logs]}",
            f"log every step once, in order (missing: {missing}); after the loop, the last step is "
            "still unlogged",
        )
    losses = [loss for _, loss, _ in h.logs]
    if not np.allclose(losses, want_losses, rtol=1e-5):
        late = np.allclose(losses[1:], want_losses[:-1], rtol=1e-5)
        early = np.allclose(losses[:-1], want_losses[1:], rtol=1e-5)
        fail(
            "the logged losses are not those of the steps they are logged for",
            "log(i, …) must get step i's loss"
            + (": yours are one step late" if late else "")
            + (
                ": yours come from the step after (keep the previous step's metrics, log those)"
                if early
                else ""
            ),
        )
    if not np.allclose(np.asarray(state), np.asarray(want_state), rtol=1e-5, atol=1e-6):
        fail(
            "the final state differs from running the steps in order",
            "feed each step the state the previous step returned",
        )


def check_train_loop(fn: Callable) -> tuple[float, float, float]:
    """Judge a training loop that overlaps the host's work with the devices' (exercise 3).

    Spec: ``fn(step, state, make_batch, n_steps, log)``

    - calls ``make_batch(i)`` once for each ``i`` in ``0 … n_steps-1`` and runs ``step`` on those batches
      in order, each on the state the previous one returned, and returns the final state (equal to the
      steps run one after the other);
    - calls ``log(i, loss_i)`` once per step, in order, with step ``i``'s own loss;
    - never reads a loss before the next step is on its way: when ``log(i, …)`` runs, step ``i + 1`` has
      been dispatched (``i < n_steps - 1``);
    - logs while training runs: ``log(i, …)`` runs before step ``i + 1 + LOG_LAG`` is dispatched;
    - keeps the devices fed: at most half of the steps ``1 … n_steps-1`` are dispatched after the loop
      waited for the step before (:meth:`Harness.waited`; a loop that reads step ``i``'s loss or copies
      the state to the host before dispatching step ``i + 1`` waits at every step);
    - makes the batches while the devices compute: of the time ``make_batch(1 …)`` take, at least half
      overlaps a running step (measured: see :meth:`Harness.overlap`). The devices' work and the host's
      work per step vary (:data:`WORK`, :data:`HOST`), the host's always less than the step it can overlap.

    Returns ``(overlapped seconds, batch-making seconds, the whole loop's seconds)``; raises ExerciseError
    naming the first broken rule.
    """
    h = Harness()
    state0 = h.warm_up()
    want_state, want_losses = h.expected(state0)
    t0 = time.perf_counter()
    state = h.run(fn, state0)
    jax.block_until_ready(state)
    took = time.perf_counter() - t0
    _judge_calls(h, state, want_state, want_losses)
    early = [i for i, _, n_disp in h.logs if i < N_STEPS - 1 and n_disp < i + 2]
    if early:
        fail(
            f"log({early[0]}) ran before step {early[0] + 1} was dispatched",
            "reading a loss waits for its step; dispatch the next step first, so the devices have work "
            "while the host waits and logs",
        )
    behind = [i for i, _, n_disp in h.logs if n_disp > i + 1 + LOG_LAG]
    if behind:
        i = behind[0]
        fail(
            f"log({i}) ran after step {h.logs[i][2] - 1} was dispatched: the losses are logged "
            f"{h.logs[i][2] - 1 - i} steps late",
            "log while training runs, not after it: log step i's loss once step i+1 is on its way "
            "(a diverging loss should show while the devices still compute)",
        )
    overlapped, total = h.overlap()
    if overlapped < 0.5 * total:
        idle = sum(1 for i, _, _, start, _ in h.batch_calls if i >= 1 and not start)
        fail(
            f"the devices computed during {overlapped * 1e3:.0f} ms of the {total * 1e3:.0f} ms the host "
            f"spent making batches 1 … {N_STEPS - 1} ({idle} of them began with no step running)",
            "make batch i+1 while step i runs: dispatch step i, then make the next batch, and read "
            "losses only after the next step is on its way",
        )
    waited = h.waited().count(True)
    if waited > len(h.queued) // 2:
        fail(
            f"{waited} of the {len(h.queued)} steps 1 … {N_STEPS - 1} were dispatched after the loop waited "
            "for the step before to finish: the devices sat idle between steps",
            "something in the loop waits for step i before step i+1 is dispatched — reading its loss "
            "(float, np.asarray, device_get), copying the state to the host, block_until_ready: dispatch "
            "step i+1 first, then read step i's values",
        )
    return overlapped, total, took

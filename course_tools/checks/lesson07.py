"""Checkers for ``07_debugging.ipynb``: predicted memory of a donating update, silently diverging replicas
(debug this), and a training loop that keeps the devices busy while the host works.

None of them holds an answer: memory is measured with ``memory_analysis()``; the replicas are compared with
one another and with single-device SGD on the whole batch; the loop is observed through the step, batch and
log functions the checker hands it (what was dispatched, and whether it was still running, when the host
worked).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from course_lib.meshes import DATA, data_mesh

from ._common import call_answer, checker, fail, passed

# ---- exercise 1: predict the memory of a donating update ---------------------------------------------------

DONATIONS = ((), (0,), (0, 2), (0, 1, 2))


def momentum_update(params, grads, velocity):
    """The update of exercise 1 (the question, as the notebook shows it): SGD with momentum."""
    velocity = jax.tree.map(lambda v, g: 0.9 * v + g, velocity, grads)
    params = jax.tree.map(lambda p, v: p - 0.01 * v, params, velocity)
    return params, velocity


def _measured_memory(donate: tuple[int, ...]) -> tuple[float, float, float]:
    rng = np.random.default_rng(len(donate))
    shapes = {"w": (int(rng.integers(200, 400)), 128), "b": (128,)}
    tree = lambda: {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}  # noqa: E731
    size = sum(int(np.prod(s)) * 4 for s in shapes.values())  # bytes of one tree
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Some donated buffers were not usable" for (0, 1, 2)
        mem = (
            jax.jit(momentum_update, donate_argnums=donate)
            .lower(tree(), tree(), tree())
            .compile()
            .memory_analysis()
        )
    return tuple(
        round(b / size, 2)
        for b in (mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes)
    )


_MEMORY_HINTS = (
    "arguments are every input buffer the program receives: params, grads and velocity, whatever is donated",
    "outputs are the trees the update returns: new params and new velocity",
    "an alias is a donated input buffer reused for an output of the same shape and dtype; without donation "
    "nothing aliases, and there are only two outputs to reuse buffers for (a third donation is unusable, and "
    "JAX warns about it)",
)


@checker
def check_memory_prediction(predict: Callable[[], dict]) -> bool:
    """``predict()`` returns ``{donate_argnums: (argument, output, alias)}`` in units of one tree's bytes for
    each of :data:`DONATIONS`; compared with ``memory_analysis()`` of the compiled update."""
    got = call_answer("predict_memory", predict)
    if not isinstance(got, dict) or {
        tuple(k) if isinstance(k, (tuple, list)) else (k,) for k in got
    } != set(DONATIONS):
        fail(
            f"predict_memory returned {got!r}",
            f"return a dict with the keys {list(DONATIONS)}, each (argument, output, alias)",
        )
    got = {tuple(k) if isinstance(k, (tuple, list)) else (k,): v for k, v in got.items()}
    for donate in DONATIONS:
        measured = _measured_memory(donate)
        try:
            predicted = tuple(float(v) for v in got[donate])
            assert len(predicted) == 3
        except (TypeError, ValueError, AssertionError):
            fail(
                f"{donate}: {got[donate]!r} is not three numbers",
                "give (argument, output, alias) in units of one tree",
            )
        for what, p, m, hint in zip(
            ("argument", "output", "alias"), predicted, measured, _MEMORY_HINTS
        ):
            if abs(p - m) > 0.05:
                fail(
                    f"with donate_argnums={donate}, {what} bytes are {m:g} trees; you predicted {p:g}",
                    hint,
                )
    return passed(
        "argument, output and alias bytes of all four variants, as memory_analysis() reports them"
    )


# ---- exercise 2: debug the diverging replicas ----------------------------------------------------------------


def local_loss(params, xb, yb):
    """Mean squared error of a linear model on one device's examples (exercise 2)."""
    return jnp.mean((xb @ params["w"] + params["b"] - yb) ** 2)


def _problem(rng, n: int):
    x = jnp.asarray(rng.standard_normal((8 * n, 3)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((8 * n, 2)), jnp.float32)
    params = {
        "w": jnp.asarray(rng.standard_normal((3, 2)), jnp.float32),
        "b": jnp.zeros(2, jnp.float32),
    }
    return params, x, y


def _reference_sgd(params, x, y, steps: int):
    for _ in range(steps):
        grads = jax.grad(local_loss)(params, x, y)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    return params


def _judge_replicas(per_device: list, want, n: int, where: str) -> None:
    spread = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(per_device[0][k]))))
        for d in per_device
        for k, a in d.items()
    )
    if spread > 1e-6:
        fail(
            f"{where}: after 3 steps the devices hold different parameters (up to {spread:.2g} apart)",
            "each device applied the gradient of its own examples only; average the gradients over axis_name "
            "(lax.pmean) before the update — under check_vma=False, as under pmap, averaging the loss does not "
            "reach the gradients",
        )
    got = per_device[0]
    if all(np.allclose(got[k], want[k], rtol=1e-5, atol=1e-6) for k in want):
        return
    fail(
        f"{where}: the devices agree, but not with SGD on the whole batch",
        "a psum of the gradients is n times their mean (the learning rate grows with the device count): use "
        "lax.pmean; and update with the averaged gradient, 0.1 * g",
    )


@checker
def check_replicas(fn: Callable, devices: Sequence[Any]) -> bool:
    """``fn(params, xb, yb, axis_name)``, run as ``shard_map(..., check_vma=False)`` with params ``P()`` and
    the batch split, must keep every device's parameters identical and equal to single-device SGD (lr 0.1)."""
    rng = np.random.default_rng(9)
    # pmap semantics on a simulated axis of 4 (vmap), whatever the number of devices.
    params, x, y = _problem(rng, 4)
    step = jax.jit(jax.vmap(partial(fn, axis_name=DATA), in_axes=(0, 0, 0), axis_name=DATA))
    p = jax.tree.map(lambda a: jnp.broadcast_to(a, (4, *a.shape)), params)
    xs, ys = x.reshape(4, -1, 3), y.reshape(4, -1, 2)
    for _ in range(3):
        p = call_answer("sgd_step", step, p, xs, ys)
    _judge_replicas(
        [{k: v[i] for k, v in p.items()} for i in range(4)],
        _reference_sgd(params, x, y, 3),
        4,
        "on 4 simulated devices",
    )
    # The real devices, as the notebook runs it.
    n = len(devices)
    mesh = data_mesh(list(devices), axis_type="auto")
    params, x, y = _problem(rng, n)
    mapped = jax.jit(
        jax.shard_map(
            partial(fn, axis_name=DATA),
            mesh=mesh,
            in_specs=(P(), P(DATA), P(DATA)),
            out_specs=P(),
            check_vma=False,
        )
    )
    p = params
    for _ in range(3):
        p = call_answer("sgd_step", mapped, p, x, y)
    per_device = [{k: v.addressable_shards[i].data for k, v in p.items()} for i in range(n)]
    _judge_replicas(per_device, _reference_sgd(params, x, y, 3), n, f"on {n} devices")
    return passed(
        f"after 3 steps every device holds the same parameters, equal to SGD on the whole batch "
        f"(4 simulated devices and {n} real ones)"
    )


# ---- exercise 3: keep the devices busy -----------------------------------------------------------------------


class _Harness:
    """The step, make_batch and log handed to the learner's loop, recording what happened when."""

    def __init__(self, n_steps: int, size: int = 256):
        rng = np.random.default_rng(10)
        self.n_steps, self.size = n_steps, size
        self.m = jnp.asarray(rng.standard_normal((size, size)) / np.sqrt(size), jnp.float32)
        self.batches = [
            rng.standard_normal((size, size)).astype(np.float32) for _ in range(n_steps)
        ]
        self._step = jax.jit(self._step_fn)
        self.lock = threading.Lock()
        self.dispatched, self.batch_calls, self.logs = [], [], []

    def _step_fn(self, state, batch):
        h = lax.fori_loop(
            0, 24, lambda i, h: jnp.tanh(h @ self.m), state + batch
        )  # the device's work
        loss = jnp.mean((h - batch) ** 2)
        return 0.9 * state + 0.1 * batch, {"loss": loss}

    def warm_up(self) -> tuple[float, Any]:
        state0 = jnp.zeros((self.size, self.size), jnp.float32)
        jax.block_until_ready(self._step(state0, self.batches[0]))
        t0 = time.perf_counter()
        jax.block_until_ready(self._step(state0, self.batches[0]))
        return time.perf_counter() - t0, state0

    def expected(self, state):
        losses = []
        for b in self.batches:
            state, metrics = self._step(state, b)
            losses.append(float(metrics["loss"]))
        return state, losses

    def step(self, state, batch):
        out = self._step(state, batch)
        with self.lock:
            self.dispatched.append(out[1]["loss"])
        return out

    def make_batch(self, i):
        with self.lock:
            last = self.dispatched[-1] if self.dispatched else None
            self.batch_calls.append((int(i), last is not None and not last.is_ready()))
        time.sleep(self.host_s)
        return self.batches[int(i)]

    def log(self, i, loss):
        with self.lock:
            n_dispatched = len(self.dispatched)
        self.logs.append((int(i), float(loss), n_dispatched))
        time.sleep(self.host_s / 4)


@checker
def check_train_loop(fn: Callable) -> bool:
    """``fn(step, state, make_batch, n_steps, log)`` must run ``n_steps`` steps on batches ``make_batch(0 …
    n_steps-1)``, call ``log(i, loss_i)`` for every step in order, return the final state — and let the host
    make batches and log while the devices compute."""
    n_steps = 6
    h = _Harness(n_steps)
    device_s, state0 = h.warm_up()
    h.host_s = max(device_s / 2, 0.005)
    want_state, want_losses = h.expected(state0)
    t0 = time.perf_counter()
    state = call_answer("train_loop", fn, h.step, state0, h.make_batch, n_steps, h.log)
    jax.block_until_ready(state)
    took = time.perf_counter() - t0
    calls = sorted(i for i, _ in h.batch_calls)
    if calls != list(range(n_steps)):
        fail(
            f"make_batch was called for {calls}", f"make each batch 0 … {n_steps - 1} exactly once"
        )
    if [i for i, _, _ in h.logs] != list(range(n_steps)):
        missing = sorted(set(range(n_steps)) - {i for i, _, _ in h.logs})
        fail(
            f"log was called for steps {[i for i, _, _ in h.logs]}",
            f"log every step once, in order (missing: {missing}); after the loop, the last step is still unlogged",
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
    early = [i for i, _, n_disp in h.logs if i < n_steps - 1 and n_disp < i + 2]
    if early:
        fail(
            f"log({early[0]}) ran before step {early[0] + 1} was dispatched",
            "reading a loss waits for its step; dispatch the next step first, so the devices have work while "
            "the host waits and logs",
        )
    busy = [running for i, running in h.batch_calls if i >= 1]
    if sum(busy) < len(busy) / 2:
        fail(
            f"the devices were idle while the host made {len(busy) - sum(busy)} of {len(busy)} batches",
            "make batch i+1 while step i runs: dispatch step i, then make the next batch, and read losses only "
            "after the next step is on its way",
        )
    naive = n_steps * (device_s + h.host_s * 1.25)
    return passed(
        f"all {n_steps} steps logged in order with their losses; the host made batches and logged while "
        f"the devices ran ({took:.2f} s; one after the other would take about {naive:.2f} s)"
    )

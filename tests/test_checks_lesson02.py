"""The checkers of lesson 02 (course_tools.checks.lesson02) accept correct answers in several forms and
reject typical wrong ones, each with its own hint; an unwritten answer prints its hint (or raises under
COURSE_STRICT_CHECKS=1)."""

import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from checking import not_written
from checking import rejects_written as rejects
from checking import stub as _stub
from jax import lax

from course_tools.checks import lesson02

# ---------------------------------------------------------------- exercise 1

RIGHT = {
    "jnp.arange(4.0)": True,
    "np.arange(4.0)": False,
    "jnp.arange(4)": True,
    "2.0": True,
    "3.0": False,
    "np.float32(3.0)": True,
    "jnp.arange(4.0).reshape(2, 2)": True,
    "jax.device_put(jnp.arange(4.0), jax.devices()[0])": True,
    "[jnp.arange(4.0)]": True,
    "jnp.ones(4)": False,
}


def test_compiles_measured():
    assert lesson02.measure_compiles() == RIGHT


def test_compiles_accept_correct_forms():
    assert lesson02.check_compiles(RIGHT)
    assert lesson02.check_compiles({k: np.bool_(v) for k, v in RIGHT.items()})


def test_compiles_stub(monkeypatch, capsys):
    not_written(
        lesson02.check_compiles, dict.fromkeys(RIGHT), monkeypatch=monkeypatch, capsys=capsys
    )


def test_compiles_wrong_answers():
    shape_dtype_only = {
        **RIGHT,
        "np.float32(3.0)": False,
        "jax.device_put(jnp.arange(4.0), jax.devices()[0])": False,
        "[jnp.arange(4.0)]": False,
    }  # the key is shapes and dtypes only
    rejects(
        lesson02.check_compiles, shape_dtype_only, match=r"np.float32\(3.0\).*\n.*look for the ~"
    )
    rejects(
        lesson02.check_compiles, {**RIGHT, "np.arange(4.0)": True}, match="float64 NumPy array"
    )  # float64 differs
    rejects(
        lesson02.check_compiles, {**RIGHT, "3.0": True}, match="the value or the type"
    )  # values in the key
    rejects(
        lesson02.check_compiles,
        {**RIGHT, "jax.device_put(jnp.arange(4.0), jax.devices()[0])": False},
        match="committed",
    )
    rejects(lesson02.check_compiles, {**RIGHT, "jnp.ones(4)": 1}, match="not True or False")


# ---------------------------------------------------------------- exercise 2


def _pad(x, size):
    n = x.shape[0]
    return jnp.pad(x, ((0, size - n), (0, 0))), jnp.arange(size) < n


def _pad_concat(x, size):  # another correct form: concatenate zeros, a float mask, a list
    n, d = x.shape
    return [
        jnp.concatenate([x, jnp.zeros((size - n, d), x.dtype)]),
        (jnp.arange(size) < n).astype(jnp.float32),
    ]


def test_pad_batch_accepts_correct_forms():
    assert lesson02.check_pad_batch(_pad)
    assert lesson02.check_pad_batch(_pad_concat)


def test_pad_batch_stub(monkeypatch, capsys):
    not_written(lesson02.check_pad_batch, _stub, monkeypatch=monkeypatch, capsys=capsys)


def test_pad_batch_wrong_answers():
    rejects(
        lesson02.check_pad_batch,
        lambda x, size: (x, jnp.ones(x.shape[0], bool)),
        match=r"padded to shape \(5, 3\)",
    )
    rejects(
        lesson02.check_pad_batch,
        lambda x, size: (_pad(x, size)[0], jnp.ones(size, bool)),
        match="marks 8 rows as real",
    )
    rejects(lesson02.check_pad_batch, lambda x, size: _pad(x, size)[0], match="expected a pair")
    rejects(
        lesson02.check_pad_batch,
        lambda x, size: (
            jnp.pad(x, ((size - x.shape[0], 0), (0, 0))),
            jnp.arange(size) < x.shape[0],
        ),
        match="first rows",
    )  # pads before


# ---------------------------------------------------------------- exercise 3


def _median_time(fn, *args, repeats=5):
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _loop_then_block(
    fn, *args, repeats=5
):  # another correct form: time a queue of calls, block once
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    outs = [fn(*args) for _ in range(repeats)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - start) / repeats


def _the_original(fn, *args, repeats=5):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return sum(times) / len(times)


def _synced_no_warmup(fn, *args, repeats=5):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return sum(times) / len(times)


def _median_no_warmup(
    fn, *args, repeats=5
):  # right for repeats=5 by luck of the median, wrong for 1
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _warm_but_unsynced(fn, *args, repeats=5):
    fn(*args)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def test_median_time_accepts_correct_forms():
    assert lesson02.check_median_time(_median_time)
    assert lesson02.check_median_time(_loop_then_block)


def test_median_time_stub(monkeypatch, capsys):
    not_written(lesson02.check_median_time, _stub, monkeypatch=monkeypatch, capsys=capsys)


def test_median_time_wrong_answers():
    rejects(lesson02.check_median_time, _the_original, match="queued")
    rejects(lesson02.check_median_time, _warm_but_unsynced, match="queued")
    rejects(lesson02.check_median_time, _synced_no_warmup, match="warm-up")
    rejects(lesson02.check_median_time, _median_no_warmup, match="repeats=1.*\n.*warm-up")
    rejects(
        lesson02.check_median_time,
        lambda fn, *a, repeats=5: 1e3 * _median_time(fn, *a, repeats=repeats),
        match="milliseconds",
    )


# ---------------------------------------------------------------- exercise 4


@partial(jax.jit, static_argnums=0)
def _train_scan(loss_fn, params, xs, ys, lr):
    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss

    return lax.scan(step, params, (xs, ys))


@partial(jax.jit, static_argnums=0)
def _train_fori(
    loss_fn, params, xs, ys, lr
):  # another correct form: fori_loop, losses written into a buffer
    def body(i, carry):
        params, losses = carry
        loss, grads = jax.value_and_grad(loss_fn)(params, xs[i], ys[i])
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), losses.at[i].set(loss)

    return lax.fori_loop(0, xs.shape[0], body, (params, jnp.zeros(xs.shape[0])))


@partial(jax.jit, static_argnums=0)
def _unrolled(loss_fn, params, xs, ys, lr):
    losses = []
    for i in range(xs.shape[0]):
        loss, grads = jax.value_and_grad(loss_fn)(params, xs[i], ys[i])
        params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
        losses.append(loss)
    return params, jnp.stack(losses)


def _not_jitted(loss_fn, params, xs, ys, lr):
    return _train_scan.__wrapped__(loss_fn, params, xs, ys, lr)


@partial(jax.jit, static_argnums=(0, 4))
def _static_lr(loss_fn, params, xs, ys, lr):
    return _train_scan.__wrapped__(loss_fn, params, xs, ys, lr)


@partial(jax.jit, static_argnums=0)
def _params_not_carried(loss_fn, params, xs, ys, lr):
    def step(carry, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)  # the initial params, every step
        return jax.tree.map(lambda p, g: p - lr * g, carry, grads), loss

    return lax.scan(step, params, (xs, ys))


@partial(jax.jit, static_argnums=0)
def _loss_after_update(loss_fn, params, xs, ys, lr):
    def step(params, batch):
        grads = jax.grad(loss_fn)(params, *batch)
        params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
        return params, loss_fn(params, *batch)

    return lax.scan(step, params, (xs, ys))


def test_train_scan_accepts_correct_forms():
    assert lesson02.check_train_scan(_train_scan)
    assert lesson02.check_train_scan(_train_fori)


def test_train_scan_stub(monkeypatch, capsys):
    not_written(lesson02.check_train_scan, _stub, monkeypatch=monkeypatch, capsys=capsys)


def test_train_scan_wrong_answers():
    rejects(lesson02.check_train_scan, _unrolled, match="unrolled")
    rejects(lesson02.check_train_scan, _not_jitted, match="compiled")
    rejects(lesson02.check_train_scan, _static_lr, match="learning rate is data")
    rejects(lesson02.check_train_scan, _params_not_carried, match="initial params")
    rejects(lesson02.check_train_scan, _loss_after_update, match="after step i's update")
    rejects(
        lesson02.check_train_scan,
        lambda *a: _train_scan(*a)[0],
        match="expected a pair|final_params",
    )

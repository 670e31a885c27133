"""The checkers of lesson 02 (course_tools.checks.lesson02) accept correct answers in several forms and
reject typical wrong ones, each with its own hint; an unwritten answer prints its hint (or raises under
COURSE_STRICT_CHECKS=1)."""

import math
import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checking import not_written, use_tolerance
from checking import rejects_written as rejects
from checking import stub as _stub
from jax import lax

from course_tools.checks import ExerciseError, lesson02

# ---------------------------------------------------------------- exercise 1

RIGHT = {
    "config object": 3,
    "plain dataclass config": "error",
    "frozen config": 1,
    "jit in the loop": 1,
    "jit of a lambda in the loop": 3,
    "partial in the loop": 3,
    "bound method": 3,
    "closed-over array": 1,
    "keyword, then position": 2,
}


def test_recompiles_measured():
    assert lesson02.measure_recompiles() == RIGHT


def test_recompiles_accept_correct_forms():
    assert lesson02.check_recompiles(RIGHT)
    assert lesson02.check_recompiles(
        {k: (" Error " if v == "error" else np.int64(v)) for k, v in RIGHT.items()}
    )
    # red team H1: case is ignored, as in lesson 00's predictions
    for spelled in ("Error", "ERROR"):
        assert lesson02.check_recompiles({**RIGHT, "plain dataclass config": spelled})


def test_recompiles_stub(monkeypatch, capsys):
    not_written(
        lesson02.check_recompiles, dict.fromkeys(RIGHT), monkeypatch=monkeypatch, capsys=capsys
    )


def test_recompiles_wrong_answers():
    check = lesson02.check_recompiles
    values_not_identity = {
        **RIGHT,
        "config object": 1,
        "bound method": 1,
    }  # "equal fields, one key"
    rejects(check, values_not_identity, match="2 of your 9 predictions")
    rejects(check, {**RIGHT, "plain dataclass config": 3}, match="1 of your 9")  # hashable?
    rejects(check, {**RIGHT, "jit in the loop": 3}, match="1 of your 9")  # "a new jit, a new cache"
    rejects(
        check, {**RIGHT, "closed-over array": 3}, match="1 of your 9"
    )  # "the closure is in the key"
    rejects(check, {**RIGHT, "keyword, then position": 1}, match="1 of your 9")
    rejects(check, {**RIGHT, "partial in the loop": 1}, match="1 of your 9")
    rejects(check, {**RIGHT, "frozen config": True}, match="is True")
    rejects(check, {**RIGHT, "frozen config": 1.0}, match="is 1.0")


def test_recompiles_never_name_the_wrong_case():
    messages = set()
    for name, v in RIGHT.items():
        with pytest.raises(ExerciseError) as e:
            lesson02.check_recompiles({**RIGHT, name: 4 if v != 4 else 5})
        messages.add(str(e.value))
    assert len(messages) == 1 and not any(name in next(iter(messages)) for name in RIGHT)


# ---------------------------------------------------------------- exercise 2


def _bucket_pad(x):
    n = x.shape[0]
    b = 1 << (n - 1).bit_length()
    return jnp.pad(x, ((0, b - n), (0, 0))), jnp.arange(b) < n


def _bucket_loop(x):  # another correct form: double until it fits, concatenate zeros, a float mask
    n, d = x.shape
    b = 1
    while b < n:
        b *= 2
    padded = jnp.concatenate([x, jnp.zeros((b - n, d), x.dtype)])
    return [padded, (jnp.arange(b) < n).astype(jnp.float32)]


def _bucket_log2(x):  # another correct form: math.log2, a NumPy mask
    n = x.shape[0]
    b = 2 ** math.ceil(math.log2(n))
    return jnp.pad(x, ((0, b - n), (0, 0))), np.arange(b) < n


def _bucket_edge(x):  # another correct form (the review's): copies of the last row as padding
    n = x.shape[0]
    b = 1 << (n - 1).bit_length()
    return jnp.pad(x, ((0, b - n), (0, 0)), mode="edge"), jnp.arange(b) < n


def test_bucket_pad_accepts_correct_forms():
    assert lesson02.check_bucket_pad(_bucket_pad)
    assert lesson02.check_bucket_pad(_bucket_edge)
    assert lesson02.check_bucket_pad(_bucket_loop)
    assert lesson02.check_bucket_pad(_bucket_log2)


def test_bucket_pad_stub(monkeypatch, capsys):
    not_written(lesson02.check_bucket_pad, _stub, monkeypatch=monkeypatch, capsys=capsys)


def _pad_to_largest(x):  # one program, but a 1-row batch is 63/64 padding
    return jnp.pad(x, ((0, 64 - x.shape[0]), (0, 0))), jnp.arange(64) < x.shape[0]


def _multiples_of_eight(x):
    n = x.shape[0]
    b = -(-n // 8) * 8
    return jnp.pad(x, ((0, b - n), (0, 0))), jnp.arange(b) < n


def _mask_dtype_varies(x):  # the review's case in a new form: a full bucket gets a float mask
    xp, mask = _bucket_pad(x)
    return xp, mask.astype(jnp.float32) if x.shape[0] == xp.shape[0] else mask


def _off_by_one(x):  # the next power of two above n, also when n is one
    n = x.shape[0]
    b = 1 << n.bit_length()
    return jnp.pad(x, ((0, b - n), (0, 0))), jnp.arange(b) < n


def test_bucket_pad_wrong_answers():
    check = lesson02.check_bucket_pad
    rejects(check, _pad_to_largest, match="padded to 64 rows; the bucket for 1 is 1")
    rejects(check, _multiples_of_eight, match="padded to 8 rows; the bucket for 1 is 1")
    rejects(check, _off_by_one, match="padded to 2 rows; the bucket for 1 is 1")
    rejects(check, lambda x: (x, jnp.ones(x.shape[0], bool)), match="padded to 3 rows")
    rejects(
        check,
        lambda x: (_bucket_pad(x)[0], jnp.ones(_bucket_pad(x)[0].shape[0], bool)),
        match="marks 4 rows as real for a batch of 3",
    )
    rejects(check, _mask_dtype_varies, match="traced .* mask came back as .*float32")
    rejects(check, lambda x: _bucket_pad(x)[0], match="expected a pair")
    before = lambda x: (  # noqa: E731 - pads before the real rows
        jnp.pad(x, ((_bucket_pad(x)[0].shape[0] - x.shape[0], 0), (0, 0))),
        jnp.arange(_bucket_pad(x)[0].shape[0]) < x.shape[0],
    )
    rejects(check, before, match="first rows")
    before_marked = lambda x: (  # noqa: E731 - pads before the real rows, and marks the last n
        before(x)[0],
        jnp.arange(_bucket_pad(x)[0].shape[0]) >= _bucket_pad(x)[0].shape[0] - x.shape[0],
    )
    rejects(check, before_marked, match="first rows of x_padded are not x")
    nan_padding = lambda x: (  # noqa: E731
        jnp.pad(x, ((0, _bucket_pad(x)[0].shape[0] - x.shape[0]), (0, 0)), constant_values=jnp.nan),
        _bucket_pad(x)[1],
    )
    rejects(check, nan_padding, match="padding rows .* hold NaN")
    mask_at_end = lambda x: (  # noqa: E731 - x in the first rows, the mask true at the last n
        _bucket_pad(x)[0],
        jnp.arange(_bucket_pad(x)[0].shape[0]) >= _bucket_pad(x)[0].shape[0] - x.shape[0],
    )
    rejects(check, mask_at_end, match="but not the first 3, where x is")


# ---------------------------------------------------------------- exercise 3


def _median_time(fn, *args, repeats=5):
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _loop_then_block(fn, *args, repeats=5):  # WRONG: a queue of calls blocked once gives their mean
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    outs = [fn(*args) for _ in range(repeats)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - start) / repeats


def _timed(fn, args, repeats, wait):
    def one():
        begin = time.perf_counter()
        wait(fn(*args))
        return time.perf_counter() - begin

    one()  # warm-up
    return [one() for _ in range(repeats)]


def _device_get_median(fn, *args, repeats=5):  # another correct form: a copy to the host waits too
    return float(np.median(_timed(fn, args, repeats, jax.device_get)))


def _mean(fn, *args, repeats=5):  # the colleague's statistic, synchronised and warmed up
    times = _timed(fn, args, repeats, jax.block_until_ready)
    return sum(times) / len(times)


def _minimum(fn, *args, repeats=5):
    return min(_timed(fn, args, repeats, jax.block_until_ready))


def _one_call(fn, *args, repeats=5):  # ignores repeats
    return _timed(fn, args, 1, jax.block_until_ready)[0]


def _first_leaf(fn, *args, repeats=5):  # waits for the first array of the output only
    wait = lambda out: jax.tree.leaves(out)[0].block_until_ready()  # noqa: E731
    return statistics.median(_timed(fn, args, repeats, wait))


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
    assert lesson02.check_median_time(_device_get_median)


# WRONG on real JAX: a step's output is a pytree, which has no such method
def _method_on_output(fn, *args, repeats=5):
    return statistics.median(_timed(fn, args, repeats, lambda out: out.block_until_ready()))


def test_median_time_refuses_a_method_the_output_pytree_lacks():
    out = lesson02.StandInStep(0.001, 0.0)(None)
    assert type(out) is tuple and len(jax.tree.leaves(out)) == 2  # a plain pytree, like a step's
    rejects(lesson02.check_median_time, _method_on_output, match="jax.block_until_ready")


def test_median_time_judges_a_fresh_run_when_load_delays_a_right_answer_once():
    runs = []

    def delayed_once(fn, *args, repeats=5):  # right; its first run descheduled 50 ms a call
        runs.append(repeats)
        extra = 0.05 if len(runs) == 1 else 0.0
        return _median_time(fn, *args, repeats=repeats) + extra

    assert lesson02.check_median_time(delayed_once)
    assert runs == [5, 5, 1]  # the first run was past the bound; a fresh one was judged


def test_median_time_judges_a_fresh_run_when_load_delays_a_right_answer_onto_the_mean():
    runs = []

    def delayed_onto_mean(step, *args, repeats=5):  # right, but its first run came out at the mean
        runs.append(repeats)
        seconds = _median_time(step, *args, repeats=repeats)
        return seconds + (step.timed_mean() - step.work_s if len(runs) == 1 else 0.0)

    assert lesson02.check_median_time(delayed_onto_mean)
    assert runs == [5, 5, 1]


@pytest.fixture
def busy_sleep(monkeypatch):
    """time.sleep as a loaded machine gives it: every wait wakes 30 ms late."""
    real = time.sleep
    monkeypatch.setattr(lesson02.time, "sleep", lambda s: real(s + 0.03))


def test_median_time_on_a_busy_machine_accepts_right_answers_and_refuses_wrong_ones(busy_sleep):
    assert lesson02.check_median_time(_median_time)
    assert lesson02.check_median_time(_device_get_median)
    rejects(lesson02.check_median_time, _mean, match="mean of the timed calls")
    rejects(lesson02.check_median_time, _synced_no_warmup, match="warm-up")
    rejects(lesson02.check_median_time, _median_no_warmup, match="repeats=1.*\n.*warm-up")
    rejects(lesson02.check_median_time, _the_original, match="queued")


def test_median_time_stub(monkeypatch, capsys):
    not_written(lesson02.check_median_time, _stub, monkeypatch=monkeypatch, capsys=capsys)


def test_median_time_wrong_answers():
    rejects(lesson02.check_median_time, _the_original, match="queued")
    rejects(lesson02.check_median_time, _warm_but_unsynced, match="queued")
    rejects(lesson02.check_median_time, _synced_no_warmup, match="warm-up")
    rejects(lesson02.check_median_time, _median_no_warmup, match="repeats=1.*\n.*warm-up")
    rejects(lesson02.check_median_time, _mean, match="mean of the timed calls")
    rejects(lesson02.check_median_time, _loop_then_block, match="mean of the timed calls")
    rejects(lesson02.check_median_time, _minimum, match="take the median")
    rejects(lesson02.check_median_time, _one_call, match="2 times for repeats=5")
    rejects(lesson02.check_median_time, _first_leaf, match="one of the 2 results")
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


@partial(jax.jit, static_argnums=0, donate_argnums=1)
def _train_scan_donating(
    loss_fn, params, xs, ys, lr
):  # another correct form: the params are donated
    return _train_scan.__wrapped__(loss_fn, params, xs, ys, lr)


@partial(jax.jit, static_argnums=0)
def _unrolled_by_xla(
    loss_fn, params, xs, ys, lr
):  # one body in the jaxpr, unrolled in the compiled HLO
    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss

    return lax.scan(step, params, (xs, ys), unroll=True)


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
    assert lesson02.check_train_scan(_train_scan_donating)


def test_train_scan_stub(monkeypatch, capsys):
    not_written(lesson02.check_train_scan, _stub, monkeypatch=monkeypatch, capsys=capsys)


def test_train_scan_wrong_answers():
    rejects(lesson02.check_train_scan, _unrolled, match="unrolled")
    rejects(lesson02.check_train_scan, _unrolled_by_xla, match="compiled program grows")
    rejects(lesson02.check_train_scan, _not_jitted, match="compiled")
    rejects(lesson02.check_train_scan, _static_lr, match="learning rate is data")
    rejects(lesson02.check_train_scan, _params_not_carried, match="initial params")
    rejects(lesson02.check_train_scan, _loss_after_update, match="after step i's update")
    rejects(
        lesson02.check_train_scan,
        lambda *a: _train_scan(*a)[0],
        match="expected a pair|final_params",
    )


def test_train_scan_at_a_tpus_tolerance(monkeypatch):
    """At the loosest float32 tolerance (a TPU's, 1.6e-2) a scan still passes, and the wrong values are
    still refused."""
    use_tolerance(monkeypatch, "tpu")
    assert lesson02.check_train_scan(_train_scan)
    rejects(lesson02.check_train_scan, _params_not_carried, match="initial params")
    rejects(lesson02.check_train_scan, _loss_after_update, match="after step i's update")

"""Exercise checkers of lesson 04 (course_tools.checks.lesson04): each accepts the reference answer and
other correct forms and rejects typical wrong answers with a specific hint, at 8 devices (from conftest.py)
and, for the references, at 1 and 3 (the checkers take the devices they run on)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checking import rejects, use_tolerance
from jax import lax

from course_lib import comms
from course_tools.checks import ExerciseError, NotWritten, lesson04


def stub(*args, **kwargs):
    raise NotImplementedError("Exercise: write this part")


def _not_written(check, *args):
    """Strict (the test suite): the unwritten answer raises NotWritten; a learner's run prints the hint and
    the checker returns False."""
    with pytest.raises(NotWritten, match="not written yet"):
        check(*args)
    mp = pytest.MonkeyPatch()
    mp.delenv("COURSE_STRICT_CHECKS", raising=False)
    try:
        assert check(*args) is False
    finally:
        mp.undo()


# ---- exercise 1 ----


def test_gradient_scales(report):
    n = len(report.devices)
    right = {"a": n, "b": n, "c": 1, "d": "local"}
    assert lesson04.check_gradient_scales(right, report.devices)
    # other correct forms: numpy scalars, floats, "Local" with spaces
    assert lesson04.check_gradient_scales(
        {"a": np.int32(n), "b": float(n), "c": 1.0, "d": " Local "}, report.devices
    )
    if n == 1:
        return
    check = lesson04.check_gradient_scales
    rejects(check, {**right, "a": 1}, report.devices, match="1 of your 4 predictions.*psum adds")
    rejects(check, {**right, "b": "local"}, report.devices, match="1 of your 4")
    rejects(check, {**right, "c": 1 / n}, report.devices, match="1 of your 4")
    rejects(check, {**right, "c": n}, report.devices, match="1 of your 4")  # the review's
    rejects(check, {**right, "d": 1}, report.devices, match="1 of your 4")  # the review's
    rejects(check, {"a": 1, "b": 1, "c": 1, "d": 1}, report.devices, match="3 of your 4")
    messages = set()
    for name in right:
        with pytest.raises(ExerciseError) as e:
            check({**right, name: 7}, report.devices)
        messages.add(str(e.value))
    assert len(messages) == 1  # the message never says which prediction is wrong
    rejects(
        lesson04.check_gradient_scales,
        {**right, "d": "true"},
        report.devices,
        match="number such as",
    )
    rejects(lesson04.check_gradient_scales, {"a": n}, report.devices, match="exactly the keys")
    _not_written(lesson04.check_gradient_scales, None, report.devices)
    _not_written(lesson04.check_gradient_scales, dict.fromkeys("abcd", ...), report.devices)


# ---- exercise 2 ----


def _allreduce_right(n):
    trained = 32 * 64 + 64 + 64 * 10 + 10  # the embedding table is frozen: not differentiated
    size = 4 * (trained + 1)  # float32 gradients and the loss
    return {
        "arrays reduced": 5,
        "bytes reduced": size,
        "bytes sent per device": 2 * (n - 1) / n * size,
        "all-reduce ops": 1,
    }


def test_allreduce_measured(report):
    measured = lesson04.measure_allreduce(report.devices)
    right = _allreduce_right(len(report.devices))
    assert {q: measured[q] for q in right} == pytest.approx(right)
    assert measured["hlo"] and all("all-reduce" in line for line in measured["hlo"])


def test_allreduce_says_which_numbers_are_read_and_which_modelled(report, capsys):
    """S and the counts come from the HLO; the bytes sent are the ring model of that S, and the check says so."""
    from course_tools.checks._lesson04_allreduce import judge_allreduce

    n = len(report.devices)
    if lesson04.prediction_count(report.devices) != n:
        pytest.skip("judged on 4 simulated devices in a fresh process: tested below")
    measured = lesson04.measure_allreduce(report.devices)
    ring = 2 * (n - 1) / n
    assert measured["bytes sent per device"] == pytest.approx(ring * measured["bytes reduced"])
    notes = judge_allreduce(_allreduce_right(n), measured)
    assert any("ring model" in note and "not a measurement" in note for note in notes)
    lesson04.check_allreduce(_allreduce_right(n), report.devices)
    assert "ring model" in capsys.readouterr().out


def test_allreduce_accepts_correct_forms(report):
    n = len(report.devices)
    assert lesson04.check_allreduce(_allreduce_right(n), report.devices)
    rounded = {k: round(v) for k, v in _allreduce_right(n).items()}  # whole bytes, numpy ints
    assert lesson04.check_allreduce({k: np.int64(v) for k, v in rounded.items()}, report.devices)


def test_allreduce_wrong_answers(report):
    n = len(report.devices)
    right = _allreduce_right(n)
    check = lesson04.check_allreduce
    with_table = 4 * (1000 * 32 + 32 * 64 + 64 + 64 * 10 + 10 + 1)  # the frozen table counted
    frozen_too = {**right, "arrays reduced": 6, "bytes reduced": with_table}
    frozen_too["bytes sent per device"] = 2 * (n - 1) / n * with_table
    rejects(check, frozen_too, report.devices, match="3 of your 4 predictions")
    one_per_leaf = {**right, "all-reduce ops": 5}  # "one all-reduce per psum'd array"
    rejects(check, one_per_leaf, report.devices, match="1 of your 4")
    sends_all = {**right, "bytes sent per device": right["bytes reduced"] * (n - 1)}  # naive
    rejects(check, sends_all, report.devices, match="1 of your 4")
    no_loss = {**right, "arrays reduced": 4}  # the loss's pmean forgotten
    rejects(check, no_loss, report.devices, match="1 of your 4")
    rejects(check, {**right, "all-reduce ops": "one"}, report.devices, match="not a number")
    _not_written(check, dict.fromkeys(right), report.devices)


# ---- exercise 3 ----


def acc_scan(loss_fn, params, batch, axis_name, n_micro):
    micro = jax.tree.map(lambda a: a.reshape((n_micro, a.shape[0] // n_micro) + a.shape[1:]), batch)

    def add(total, mb):
        g = jax.grad(loss_fn)(params, mb)
        return jax.tree.map(jnp.add, total, g), None

    total, _ = lax.scan(add, jax.tree.map(jnp.zeros_like, params), micro)
    grads = jax.tree.map(lambda g: g / n_micro, total)
    return lax.pmean(grads, axis_name)


def acc_python_loop(
    loss_fn, params, batch, axis_name, n_micro
):  # right values, but unrolled into one program: memory does not shrink with n_micro
    x, y = batch
    total = None
    for i in range(n_micro):
        g = jax.grad(loss_fn)(params, (x[i::n_micro], y[i::n_micro]))
        total = g if total is None else jax.tree.map(jnp.add, total, g)
    return jax.tree.map(lambda g: lax.pmean(g, axis_name) / n_micro, total)


def acc_fori(
    loss_fn, params, batch, axis_name, n_micro
):  # another correct form: fori_loop + dynamic_slice
    x, y = batch
    m = x.shape[0] // n_micro

    def body(i, total):
        mb = (lax.dynamic_slice_in_dim(x, i * m, m), lax.dynamic_slice_in_dim(y, i * m, m))
        return jax.tree.map(jnp.add, total, jax.grad(loss_fn)(params, mb))

    total = lax.fori_loop(0, n_micro, body, jax.tree.map(jnp.zeros_like, params))
    return lax.pmean(jax.tree.map(lambda g: g / n_micro, total), axis_name)


def acc_strided_scan(loss_fn, params, batch, axis_name, n_micro):  # another correct form
    # micro-batch i holds rows i, i + n_micro, ...: the same rows in another grouping
    micro = jax.tree.map(
        lambda a: jnp.swapaxes(a.reshape((-1, n_micro) + a.shape[1:]), 0, 1), batch
    )
    total, _ = lax.scan(
        lambda t, mb: (jax.tree.map(jnp.add, t, jax.grad(loss_fn)(params, mb)), None),
        jax.tree.map(jnp.zeros_like, params),
        micro,
    )
    return lax.pmean(jax.tree.map(lambda g: g / n_micro, total), axis_name)


def acc_no_divide(loss_fn, params, batch, axis_name, n_micro):
    micro = jax.tree.map(lambda a: a.reshape((n_micro, -1) + a.shape[1:]), batch)
    total, _ = lax.scan(
        lambda t, mb: (jax.tree.map(jnp.add, t, jax.grad(loss_fn)(params, mb)), None),
        jax.tree.map(jnp.zeros_like, params),
        micro,
    )
    return lax.pmean(total, axis_name)


def acc_sync_each(loss_fn, params, batch, axis_name, n_micro):
    micro = jax.tree.map(lambda a: a.reshape((n_micro, -1) + a.shape[1:]), batch)

    def add(t, mb):
        g = lax.pmean(jax.grad(loss_fn)(params, mb), axis_name)
        return jax.tree.map(jnp.add, t, g), None

    total, _ = lax.scan(add, jax.tree.map(jnp.zeros_like, params), micro)
    return jax.tree.map(lambda g: g / n_micro, total)


def acc_scan_unrolled(loss_fn, params, batch, axis_name, n_micro):  # red team H3: unroll=True
    micro = jax.tree.map(lambda a: a.reshape((n_micro, a.shape[0] // n_micro) + a.shape[1:]), batch)

    def add(total, mb):
        return jax.tree.map(jnp.add, total, jax.grad(loss_fn)(params, mb)), None

    total, _ = lax.scan(add, jax.tree.map(jnp.zeros_like, params), micro, unroll=True)
    return lax.pmean(jax.tree.map(lambda g: g / n_micro, total), axis_name)


def acc_sync_each_unrolled(loss_fn, params, batch, axis_name, n_micro):
    x, y = batch
    m = x.shape[0] // n_micro
    gs = [
        lax.pmean(
            jax.grad(loss_fn)(params, (x[i * m : (i + 1) * m], y[i * m : (i + 1) * m])), axis_name
        )
        for i in range(n_micro)
    ]
    return jax.tree.map(lambda *g: sum(g) / n_micro, *gs)


def acc_whole_batch(loss_fn, params, batch, axis_name, n_micro):
    return lax.pmean(jax.grad(loss_fn)(params, batch), axis_name)


def acc_local(loss_fn, params, batch, axis_name, n_micro):
    micro = jax.tree.map(lambda a: a.reshape((n_micro, -1) + a.shape[1:]), batch)
    total, _ = lax.scan(
        lambda t, mb: (jax.tree.map(jnp.add, t, jax.grad(loss_fn)(params, mb)), None),
        jax.tree.map(jnp.zeros_like, params),
        micro,
    )
    return jax.tree.map(lambda g: g / n_micro, total)


def acc_psum(loss_fn, params, batch, axis_name, n_micro):
    g = acc_local(loss_fn, params, batch, axis_name, n_micro)
    return lax.psum(g, axis_name)


def acc_grad_of_sum(
    loss_fn, params, batch, axis_name, n_micro
):  # one backward pass: all residuals alive
    micro = jax.tree.map(lambda a: a.reshape((n_micro, -1) + a.shape[1:]), batch)
    parts = [jax.tree.map(lambda a, i=i: a[i], micro) for i in range(n_micro)]
    g = jax.grad(lambda p: sum(loss_fn(p, mb) for mb in parts) / n_micro)(params)
    return lax.pmean(g, axis_name)


def acc_vmap(loss_fn, params, batch, axis_name, n_micro):  # every micro-batch at once
    micro = jax.tree.map(lambda a: a.reshape((n_micro, -1) + a.shape[1:]), batch)
    g = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0))(params, micro)
    return lax.pmean(jax.tree.map(lambda a: a.mean(0), g), axis_name)


def acc_stacked(
    loss_fn, params, batch, axis_name, n_micro
):  # n_micro gradients stacked, then averaged
    micro = jax.tree.map(lambda a: a.reshape((n_micro, -1) + a.shape[1:]), batch)
    _, grads = lax.scan(lambda c, mb: (c, jax.grad(loss_fn)(params, mb)), 0, micro)
    return lax.pmean(jax.tree.map(lambda g: g.mean(axis=0), grads), axis_name)


def acc_buffer(
    loss_fn, params, batch, axis_name, n_micro
):  # a carried [n_micro, ...] buffer per leaf
    micro = jax.tree.map(lambda a: a.reshape((n_micro, -1) + a.shape[1:]), batch)

    def body(i, bufs):
        g = jax.grad(loss_fn)(params, jax.tree.map(lambda a: a[i], micro))
        return jax.tree.map(lambda b, gi: b.at[i].set(gi), bufs, g)

    empty = jax.tree.map(lambda p: jnp.zeros((n_micro,) + p.shape, p.dtype), params)
    bufs = lax.fori_loop(0, n_micro, body, empty)
    return lax.pmean(jax.tree.map(lambda b: b.mean(axis=0), bufs), axis_name)


def acc_all_gather(
    loss_fn, params, batch, axis_name, n_micro
):  # no all-reduce: every gradient gathered
    g = acc_local(loss_fn, params, batch, axis_name, n_micro)
    return jax.tree.map(lambda a: lax.all_gather(a, axis_name).mean(axis=0), g)


def acc_checkpointed_loop(
    loss_fn, params, batch, axis_name, n_micro
):  # lesson 01 accepts it eagerly
    x, y = batch
    m = x.shape[0] // n_micro
    parts = [(x[i * m : (i + 1) * m], y[i * m : (i + 1) * m]) for i in range(n_micro)]
    total = lambda p: sum(jax.checkpoint(loss_fn)(p, mb) for mb in parts) / n_micro  # noqa: E731
    return lax.pmean(jax.grad(total)(params), axis_name)


def test_a_checkpointed_python_loop_is_refused_with_the_reason(report):
    """Lesson 01's eager exercise 4 accepts one grad over checkpointed micro-batch losses; in one compiled
    program the order is XLA's: XLA:CPU keeps as many temporaries for it as for a plain Python loop, at
    every n_micro, where a scan's shrink. The refusal says why (both specs state it)."""
    from functools import partial

    from course_tools.checks import _lesson04_memory as memory

    device = report.devices[0]
    loss = partial(lesson04._mlp_loss, seen=[])
    temps = {
        fn.__name__: [memory._temp_bytes(fn, device, loss, m) for m in memory.MEMORY_MICRO]
        for fn in (acc_checkpointed_loop, acc_python_loop, acc_scan)
    }
    if device.platform == "cpu":
        few, many = temps["acc_checkpointed_loop"]
        assert few == many == temps["acc_python_loop"][0]  # the checkpoints bound nothing here
        assert temps["acc_scan"][1] < 0.6 * temps["acc_scan"][0]  # a loop of the program does
    rejects(
        lesson04.check_accumulated_grads,
        acc_checkpointed_loop,
        report.devices,
        match="runs outside any loop.*\n.*jax.checkpoint around each micro-batch",
    )


def test_accumulated_grads(report):
    n = len(report.devices)
    assert lesson04.check_accumulated_grads(acc_scan, report.devices)
    assert lesson04.check_accumulated_grads(acc_fori, report.devices)
    assert lesson04.check_accumulated_grads(acc_strided_scan, report.devices)  # the review's
    for unbounded in (acc_python_loop, acc_grad_of_sum, acc_vmap):
        rejects(
            lesson04.check_accumulated_grads,
            unbounded,
            report.devices,
            match="runs outside any loop.*lax.scan",
        )
    rejects(
        lesson04.check_accumulated_grads,
        acc_no_divide,
        report.devices,
        match="too large with n_micro=3.*divide by n_micro",
    )
    rejects(
        lesson04.check_accumulated_grads, acc_sync_each, report.devices, match="inside the loop"
    )
    rejects(
        lesson04.check_accumulated_grads,
        acc_sync_each_unrolled,
        report.devices,
        match="grows with n_micro",
    )
    if report.devices[0].platform == "cpu":  # the compiled temporaries are judged on XLA:CPU only
        rejects(
            lesson04.check_accumulated_grads,
            acc_scan_unrolled,
            report.devices,
            match="(?s)does not shrink.*unrolled \\(8 micro-batches per iteration.*unroll at its default",
        )
    rejects(
        lesson04.check_accumulated_grads,
        acc_whole_batch,
        report.devices,
        match="called on batches of \\[12\\]",
    )
    if n > 1:
        rejects(
            lesson04.check_accumulated_grads, acc_local, report.devices, match="different gradients"
        )
        rejects(lesson04.check_accumulated_grads, acc_psum, report.devices, match="psum adds")
    for kept in (acc_stacked, acc_buffer):
        rejects(
            lesson04.check_accumulated_grads,
            kept,
            report.devices,
            match="carries or stacks 76[89] numbers with n_micro=2 and 3,07[23]",
        )
    rejects(
        lesson04.check_accumulated_grads,
        acc_all_gather,
        report.devices,
        match="with all_gather, not only with an all-reduce",
    )
    _not_written(lesson04.check_accumulated_grads, stub, report.devices)


def test_references_at_an_odd_device_count(report):
    """The notebooks run at 1, 2, 4 and 8 devices in CI; 3 is promised too."""
    k = 3
    devices = report.devices[:k]
    right = {"a": k, "b": k, "c": 1, "d": "local"}
    assert lesson04.check_gradient_scales(right, devices)
    assert lesson04.check_allreduce(_allreduce_right(k), devices)
    assert lesson04.check_accumulated_grads(acc_scan, devices)


def test_two_devices_set_the_predictions_for_four(report):
    """On two devices a ring all-reduce sends 2 (n - 1) / n × S = (n - 1) × S, what a naive one sends: the
    predictions are for 4 simulated devices, where the naive count (once accepted on two) is refused."""
    two = report.devices[:2]
    assert lesson04.prediction_count(two) == 4
    assert lesson04.check_allreduce(_allreduce_right(4), two)
    right = _allreduce_right(2)
    naive = {**right, "bytes sent per device": right["bytes reduced"] * (2 - 1)}
    assert naive == right  # the same numbers on two devices
    rejects(lesson04.check_allreduce, naive, two, match="1 of your 4")
    assert lesson04.check_gradient_scales({"a": 4, "b": 4, "c": 1, "d": "local"}, two)


def test_one_device_answers_run_on_a_simulated_axis(report):
    """With 1 device local and global agree; the checks also map the answer over 4 simulated devices."""
    one = report.devices[:1]
    rejects(
        lesson04.check_accumulated_grads, acc_local, one, match="different gradients.*4 devices"
    )
    rejects(lesson04.check_accumulated_grads, acc_psum, one, match="4x \\(the device count\\)")
    assert lesson04.prediction_count(one) == 4
    assert lesson04.check_gradient_scales({"a": 4, "b": 4, "c": 1, "d": "local"}, one)
    for wrong in ({"a": 1, "b": 1, "c": 1, "d": 1}, {"a": 4, "b": 4, "c": 1, "d": 1}):
        rejects(lesson04.check_gradient_scales, wrong, one, match="measurement on 4 simulated")
    assert lesson04.check_allreduce(_allreduce_right(4), one)  # compiled for 4 simulated devices
    rejects(lesson04.check_allreduce, _allreduce_right(1), one, match="1 of your 4")
    assert lesson04.check_accumulated_grads(acc_fori, one)


def test_accumulated_grads_at_a_tpus_tolerance(report, monkeypatch):
    """At the loosest float32 tolerance (a TPU's, 1.6e-2) the reference passes and the wrong gradients are
    still refused, on the notebook's devices and on one device (a simulated axis of 4)."""
    use_tolerance(monkeypatch, "tpu")
    for devices in (report.devices, report.devices[:1]):
        k = max(len(devices), lesson04.FAKE_AXIS if len(devices) == 1 else 0)
        assert lesson04.check_accumulated_grads(acc_scan, devices)
        rejects(
            lesson04.check_accumulated_grads,
            acc_no_divide,
            devices,
            match="too large with n_micro=3.*divide by n_micro",
        )
        rejects(lesson04.check_accumulated_grads, acc_psum, devices, match=f"{k}x|psum adds")
        rejects(lesson04.check_accumulated_grads, acc_local, devices, match="different gradients")


# ---- exercise 4: the critical batch of data parallelism ----------------------------------------------


def critical_ref(n_params, flops_per_example, n_devices, fabric):
    if n_devices == 1:
        return 0.0
    sent = 2 * (n_devices - 1) / n_devices * 4 * n_params
    bandwidth = fabric.link.bytes_per_s * (2 if fabric.link.topology == "ring" else 1)
    return sent / bandwidth * fabric.chip.bf16 * 1e12 / flops_per_example


def critical_other_form(n_params, flops_per_example, n_devices, fabric):
    # time per example and time of the all-reduce, then their ratio
    per_example_s = flops_per_example / (fabric.chip.bf16 * 1e12)
    ways = 2 if fabric.link.topology == "ring" else 1
    allreduce_s = (n_devices - 1) * 2 * n_params * 4 / n_devices / (ways * fabric.link.bytes_per_s)
    return allreduce_s / per_example_s


def test_critical_batch_accepts_correct_forms():
    assert lesson04.check_critical_batch(critical_ref)
    assert lesson04.check_critical_batch(critical_other_form)
    _not_written(lesson04.check_critical_batch, stub)


def test_critical_batch_wrong_answers():
    from course_lib import costs

    def scaled(f):
        return lambda p, fl, n, fab: f(p, fl, n, fab) * critical_ref(p, fl, n, fab)

    one_way = lambda p, fl, n, fab: critical_ref(p, fl, n, dataclasses.replace(
        fab, link=dataclasses.replace(fab.link, topology="switch")))  # fmt: skip
    cases = {
        "bidirectional ring": one_way,
        "2 \\(n − 1\\) / n": scaled(lambda p, fl, n, fab: n / (n - 1) if n > 1 else 1),
        "factors of 2": scaled(lambda p, fl, n, fab: 0.5),  # bfloat16 gradients: 2 bytes
        "batch of all devices": scaled(lambda p, fl, n, fab: n),  # the global batch
        "one device reduces nothing": lambda p, fl, n, fab: critical_ref(p, fl, max(n, 2), fab),
        "compute time = batch": lambda p, fl, n, fab: (
            critical_ref(p, fl, n, fab) * 197 / fab.chip.bf16
        ),
        "return a number": lambda p, fl, n, fab: None,
    }
    # found by a red-team reading: a string, the ring told from the chip or the names, a whole number
    cases_by_name = {
        "return a number: a per": lambda p, fl, n, fab: str(critical_ref(p, fl, n, fab)),
        "factors of 2|bidirectional": lambda p, fl, n, fab: critical_ref(p, fl, n, dataclasses.replace(
            fab, link=dataclasses.replace(fab.link, topology="ring" if fab.chip.platform == "tpu" else "switch"))),
        "factors of 2|bidirectional ": lambda p, fl, n, fab: critical_ref(p, fl, n, dataclasses.replace(
            fab, link=dataclasses.replace(fab.link, topology="ring" if "ICI" in fab.link.name else "switch"))),
        "not a whole number": lambda p, fl, n, fab: math.ceil(critical_ref(p, fl, n, fab)),
    }  # fmt: skip
    cases.update(cases_by_name)
    for hint, answer in cases.items():
        rejects(lesson04.check_critical_batch, answer, match=hint)
    library = lambda p, fl, n, fab: costs.critical_size(
        1, costs.step_time(fl, None, [comms.transfer("all-reduce", "data", n, 4 * p, "g")], fab)
    )
    rejects(lesson04.check_critical_batch, library, match="do not call costs")

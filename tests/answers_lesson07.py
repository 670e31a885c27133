"""Lesson 07 exercises: the notebook's reference solutions, other correct forms and typical wrong answers,
for tests/test_checks_lesson07.py (tests are not in the student package)."""

from __future__ import annotations

import concurrent.futures

import jax
from jax import lax

from course_tools.checks.lesson07 import local_loss

# ---- exercise 1: predict memory ---------------------------------------------------------------------------


def predict_memory():  # reference
    return {(): (3, 2, 0), (0,): (3, 2, 1), (0, 2): (3, 2, 2), (0, 1, 2): (3, 2, 2)}


def predict_memory_lists():  # other correct form: lists, an int key, floats
    return {(): [3.0, 2.0, 0.0], 0: [3, 2, 1], (0, 2): [3, 2, 2], (0, 1, 2): [3, 2, 2]}


def predict_memory_donated_not_counted():  # wrong: donated inputs left out of the arguments
    return {(): (3, 2, 0), (0,): (2, 2, 1), (0, 2): (1, 2, 2), (0, 1, 2): (0, 2, 2)}


def predict_memory_three_aliases():  # wrong: every donated tree aliases
    return {(): (3, 2, 0), (0,): (3, 2, 1), (0, 2): (3, 2, 2), (0, 1, 2): (3, 2, 3)}


def predict_memory_one_output():  # wrong: forgets the velocity output
    return {(): (3, 1, 0), (0,): (3, 1, 1), (0, 2): (3, 1, 1), (0, 1, 2): (3, 1, 1)}


# ---- exercise 2: the diverging replicas ---------------------------------------------------------------------


def sgd_step_buggy(params, xb, yb, axis_name):  # the given program
    grads = jax.grad(local_loss)(params, xb, yb)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def sgd_step(params, xb, yb, axis_name):  # reference
    grads = lax.pmean(jax.grad(local_loss)(params, xb, yb), axis_name)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def sgd_step_average_params(params, xb, yb, axis_name):  # other correct form (for plain SGD)
    grads = jax.grad(local_loss)(params, xb, yb)
    return lax.pmean(jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), axis_name)


def sgd_step_psum(params, xb, yb, axis_name):  # wrong: sums the gradients
    grads = lax.psum(jax.grad(local_loss)(params, xb, yb), axis_name)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def sgd_step_pmean_loss(
    params, xb, yb, axis_name
):  # wrong under check_vma=False: still local gradients
    grads = jax.grad(lambda p: lax.pmean(local_loss(p, xb, yb), axis_name))(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


# ---- exercise 3: the busy loop -------------------------------------------------------------------------------


def train_loop(step, state, make_batch, n_steps, log):  # reference
    batch, previous = make_batch(0), None
    for i in range(n_steps):
        state, metrics = step(state, batch)  # dispatched: the devices start step i
        if i + 1 < n_steps:
            batch = make_batch(i + 1)  # host work while step i runs
        if previous is not None:
            log(i - 1, previous)  # step i-1: finished, or about to
        previous = metrics["loss"]
    log(n_steps - 1, previous)
    return state


def train_loop_log_first(
    step, state, make_batch, n_steps, log
):  # other correct form: log, then the batch
    batch, previous = make_batch(0), None
    for i in range(n_steps):
        state, metrics = step(state, batch)
        if previous is not None:
            log(i - 1, previous)
        if i + 1 < n_steps:
            batch = make_batch(i + 1)
        previous = metrics["loss"]
    log(n_steps - 1, previous)
    return state


def train_loop_prefetch_thread(
    step, state, make_batch, n_steps, log
):  # other correct form: a loader thread
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future, pending = pool.submit(make_batch, 0), []
        for i in range(n_steps):
            batch = future.result()
            state, metrics = step(state, batch)
            if i + 1 < n_steps:
                future = pool.submit(make_batch, i + 1)
            pending.append((i, metrics["loss"]))
            if len(pending) == 2:
                log(*pending.pop(0))
        for item in pending:
            log(*item)
    return state


def train_loop_naive(step, state, make_batch, n_steps, log):  # wrong: the host waits every step
    for i in range(n_steps):
        state, metrics = step(state, make_batch(i))
        log(i, metrics["loss"])
    return state


def train_loop_forgets_last(
    step, state, make_batch, n_steps, log
):  # wrong: the last step is never logged
    batch, previous = make_batch(0), None
    for i in range(n_steps):
        state, metrics = step(state, batch)
        if i + 1 < n_steps:
            batch = make_batch(i + 1)
        if previous is not None:
            log(i - 1, previous)
        previous = metrics["loss"]
    return state


def train_loop_wrong_loss(
    step, state, make_batch, n_steps, log
):  # wrong: step i's loss logged as step i-1
    batch, last = make_batch(0), None
    for i in range(n_steps):
        state, metrics = step(state, batch)
        if i + 1 < n_steps:
            batch = make_batch(i + 1)
        if i > 0:
            log(i - 1, metrics["loss"])
        last = metrics["loss"]
    log(n_steps - 1, last)
    return state


def train_loop_blocks(
    step, state, make_batch, n_steps, log
):  # wrong: waits for each step before the batch
    batch, previous = make_batch(0), None
    for i in range(n_steps):
        state, metrics = step(state, batch)
        jax.block_until_ready(state)
        if i + 1 < n_steps:
            batch = make_batch(i + 1)
        if previous is not None:
            log(i - 1, previous)
        previous = metrics["loss"]
    log(n_steps - 1, previous)
    return state


def train_loop_batch_first(
    step, state, make_batch, n_steps, log
):  # wrong: logs before dispatching the next
    previous = None
    for i in range(n_steps):
        batch = make_batch(i)
        if previous is not None:
            log(i - 1, previous)
        state, metrics = step(state, batch)
        previous = metrics["loss"]
    log(n_steps - 1, previous)
    return state

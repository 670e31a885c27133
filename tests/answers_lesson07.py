"""Lesson 07 exercises: the notebook's reference solutions, other correct forms and typical wrong answers,
for tests/test_checks_lesson07.py (tests are not in the student package)."""

from __future__ import annotations

import concurrent.futures
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from course_tools.checks.lesson07 import layer

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


# ---- exercise 2: a checkpoint that saves nothing ----------------------------------------------------------


def remat_loss_given(weights, x):  # the given program: a checkpoint around every layer
    h = x
    for i in range(weights.shape[0]):
        h = jax.checkpoint(layer)(h, weights[i])
    return jnp.mean(h**2)


def remat_loss(weights, x):  # reference: blocks of about sqrt(L) layers
    n_layers = weights.shape[0]
    k = min(
        (d for d in range(1, n_layers + 1) if n_layers % d == 0), key=lambda d: n_layers // d + d
    )

    def block(h, w_block):
        for i in range(w_block.shape[0]):
            h = layer(h, w_block[i])
        return h

    h = x
    for start in range(0, n_layers, k):
        h = jax.checkpoint(block)(h, weights[start : start + k])
    return jnp.mean(h**2)


def remat_loss_sqrt(weights, x):  # other correct form: k = round(sqrt(L)), a last block shorter
    n_layers = weights.shape[0]
    k = max(1, round(math.sqrt(n_layers)))

    @jax.checkpoint
    def block(h, w_block):
        for w in w_block:
            h = jnp.tanh(h @ w)
        return h

    h = x
    for start in range(0, n_layers, k):
        h = block(h, weights[start : start + k])
    return jnp.mean(h**2)


def remat_loss_whole(weights, x):  # wrong: one checkpoint around everything
    def plain(weights, x):
        h = x
        for i in range(weights.shape[0]):
            h = layer(h, weights[i])
        return jnp.mean(h**2)

    return jax.checkpoint(plain)(weights, x)


def remat_loss_pairs(weights, x):  # wrong: blocks of 2, whatever the depth
    h, n_layers = x, weights.shape[0]

    def block(h, w_block):
        for w in w_block:
            h = layer(h, w)
        return h

    for start in range(0, n_layers, 2):
        h = jax.checkpoint(block)(h, weights[start : start + 2])
    return jnp.mean(h**2)


def remat_loss_fixed_4(weights, x):  # wrong: the block size that is best for 16 layers only
    h, n_layers = x, weights.shape[0]

    def block(h, w_block):
        for w in w_block:
            h = layer(h, w)
        return h

    for start in range(0, n_layers, 4):
        h = jax.checkpoint(block)(h, weights[start : start + 4])
    return jnp.mean(h**2)


def remat_loss_dots(weights, x):  # wrong: a policy that saves the matmuls: nothing recomputed
    def plain(weights, x):
        h = x
        for i in range(weights.shape[0]):
            h = layer(h, weights[i])
        return jnp.mean(h**2)

    return jax.checkpoint(plain, policy=jax.checkpoint_policies.dots_saveable)(weights, x)


def remat_loss_scan(weights, x):  # wrong: a scan with a checkpointed body keeps every layer's input
    h, _ = lax.scan(jax.checkpoint(lambda h, w: (layer(h, w), None)), x, weights)
    return jnp.mean(h**2)


def remat_loss_scan_blocks(weights, x):  # right: a scan over checkpointed blocks of √L layers
    n_layers = weights.shape[0]
    k = max(1, round(n_layers**0.5))
    n = n_layers // k

    def block(h, w_block):
        for i in range(k):
            h = layer(h, w_block[i])
        return h, None

    blocks = weights[: n * k].reshape((n, k) + weights.shape[1:])
    h, _ = lax.scan(jax.checkpoint(block), x, blocks)
    for i in range(n * k, n_layers):  # the layers left over
        h = layer(h, weights[i])
    return jnp.mean(h**2)


def remat_loss_scan_whole(weights, x):  # wrong: one checkpoint around a scan over every layer
    def run(h, w):
        h, _ = lax.scan(lambda h, wi: (layer(h, wi), None), h, w)
        return h

    return jnp.mean(jax.checkpoint(run)(x, weights) ** 2)


def remat_loss_fixed_3_dummy_scan(weights, x):  # wrong: blocks of 3 after a scan over 2 layers
    h, _ = lax.scan(lambda h, w: (layer(h, w), None), x, weights[:2])
    return remat_loss_fixed_3(weights[2:], h)


def remat_loss_skips_a_layer(weights, x):  # wrong: the last layer left out
    return remat_loss(weights[:-1], x) if weights.shape[0] > 1 else jnp.mean(x**2)


def remat_loss_fixed_3(weights, x):  # wrong: blocks of 3, right for 4 and 9 layers, not for 25
    h, n_layers = x, weights.shape[0]

    def block(h, w_block):
        for w in w_block:
            h = layer(h, w)
        return h

    for start in range(0, n_layers, 3):
        h = jax.checkpoint(block)(h, weights[start : start + 3])
    return jnp.mean(h**2)


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


def train_loop_two_deep(
    step, state, make_batch, n_steps, log
):  # other correct form: log two steps late
    batch, pending = make_batch(0), []
    for i in range(n_steps):
        state, metrics = step(state, batch)
        if i + 1 < n_steps:
            batch = make_batch(i + 1)
        pending.append((i, metrics["loss"]))
        if len(pending) == 3:
            log(*pending.pop(0))
    for item in pending:
        log(*item)
    return state


def train_loop_batches_up_front(step, state, make_batch, n_steps, log):  # wrong: no overlap at all
    batches = [make_batch(i) for i in range(n_steps)]  # every batch before the first step
    previous = None
    for i, batch in enumerate(batches):
        state, metrics = step(state, batch)
        if previous is not None:
            log(i - 1, previous)
        previous = metrics["loss"]
    log(n_steps - 1, previous)
    return state


def train_loop_log_before_next(
    step, state, make_batch, n_steps, log
):  # wrong: reads step i at once
    batch = make_batch(0)
    for i in range(n_steps):
        state, metrics = step(state, batch)
        if i + 1 < n_steps:
            batch = make_batch(i + 1)  # overlaps step i ...
        log(
            i, metrics["loss"]
        )  # ... but then waits for it: the devices idle until the next dispatch
    return state


def predict_memory_wrong_alias():  # wrong: with every tree donated, a third tree aliases
    return {(): (3, 2, 0), (0,): (3, 2, 1), (0, 2): (3, 2, 2), (0, 1, 2): (3, 2, 3)}


def remat_loss_named_depths_only(weights, x):  # wrong: block sizes looked up for 4, 9 and 25 layers
    depth = weights.shape[0]
    size = {4: 2, 9: 3, 25: 5}.get(depth, depth)  # any other depth: one checkpoint, nothing saved

    @jax.checkpoint
    def block(h, ws):
        for w in ws:
            h = layer(h, w)
        return h

    h = x
    for i in range(0, depth, size):
        h = block(h, weights[i : i + size])
    return jnp.mean(h**2)


def train_loop_reads_loss_early(step, state, make_batch, n_steps, log):
    """Wrong: reads step i's loss before step i+1 is dispatched, so the host waits for every step."""
    batch, pending = make_batch(0), None
    for i in range(n_steps):
        state, metrics = step(state, batch)
        if i + 1 < n_steps:
            batch = make_batch(i + 1)
        value = np.asarray(metrics["loss"])  # waits for step i
        if pending is not None:
            log(i - 1, pending)
        pending = value
    log(n_steps - 1, pending)
    return state


def train_loop_syncs_state(step, state, make_batch, n_steps, log):
    """Wrong: copies the state to the host after every step (a checkpoint every step): it waits."""
    batch, pending = make_batch(0), None
    for i in range(n_steps):
        state, metrics = step(state, batch)
        if i + 1 < n_steps:
            batch = make_batch(i + 1)
        jax.device_get(state)  # waits for step i
        if pending is not None:
            log(i - 1, pending)
        pending = metrics["loss"]
    log(n_steps - 1, pending)
    return state


def train_loop_logs_at_end(step, state, make_batch, n_steps, log):
    """Wrong: overlaps batch-making, but logs nothing until training ends."""
    batch, losses = make_batch(0), []
    for i in range(n_steps):
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
        if i + 1 < n_steps:
            batch = make_batch(i + 1)
    for i, loss in enumerate(losses):
        log(i, loss)
    return state

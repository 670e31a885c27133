"""Lesson 06 exercises: the notebook's reference solutions, other correct forms and typical wrong answers,
for tests/test_checks_lesson06.py (tests are not in the student package)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from course_lib.meshes import DATA, MODEL

# ---- exercise 1: predict shapes and vma -------------------------------------------------------------------


def predict(n_data, n_model):  # reference
    return {
        "x": ((8, 4), {DATA, MODEL}),
        "w": ((4, 6), {MODEL}),
        "xw": ((8, 6), {DATA, MODEL}),
        "y": ((8, 6), {DATA}),
        "g": ((8, 4 * n_model), {DATA, MODEL}),
        "s": ((8 // n_data, 6), {DATA}),
        "i": ((), {MODEL}),
        "wy": ((4, 6), {DATA, MODEL}),
    }


def predict_lists(n_data, n_model):  # other correct form: lists, frozensets, a str for one axis
    return {
        "x": ([8, 4], frozenset(["data", "model"])),
        "w": ([4, 6], "model"),
        "xw": ([8, 6], ("data", "model")),
        "y": ([8, 6], ["data"]),
        "g": ([8, 4 * n_model], {"model", "data"}),
        "s": ([8 // n_data, 6], "data"),
        "i": ([], ["model"]),
        "wy": ([4, 6], ["model", "data"]),
    }


def predict_global_shapes(n_data, n_model):  # wrong: global shapes instead of block shapes
    d = predict(n_data, n_model)
    d["x"] = ((8 * n_data, 4 * n_model), {DATA, MODEL})
    return d


def predict_gather_invariant(n_data, n_model):  # wrong: all_gather's result taken as invariant
    d = predict(n_data, n_model)
    d["g"] = ((8, 4 * n_model), {DATA})
    return d


def predict_psum_still_varies(n_data, n_model):  # wrong: psum keeps MODEL in the vma
    d = predict(n_data, n_model)
    d["y"] = ((8, 6), {DATA, MODEL})
    return d


def predict_hardcoded_4x2(n_data, n_model):  # wrong: right for data=4 x model=2 only
    return predict(4, 2)


def predict_scatter_full(n_data, n_model):  # wrong: psum_scatter keeps the whole dimension
    d = predict(n_data, n_model)
    d["s"] = ((8, 6), {DATA})
    return d


def predict_all_wrong_vma(n_data, n_model):  # wrong: the right shapes, every vma empty
    return {k: (shape, set()) for k, (shape, _) in predict(n_data, n_model).items()}


# ---- exercise 2: a ring all-reduce --------------------------------------------------------------------------


def ring_all_reduce(x_block, axis_name):  # reference
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    to_right = [(i, (i + 1) % n) for i in range(n)]
    chunks = x_block.reshape(n, -1, *x_block.shape[1:])  # [n, k/n, ...]: n chunks
    # Reduce-scatter: at step s device i adds what arrives (a partial sum of chunk i-1-s) to its own copy.
    send = chunks[me]
    for s in range(n - 1):
        send = lax.ppermute(send, axis_name, to_right) + chunks[(me - 1 - s) % n]
    # Now device i holds the complete sum of chunk i+1. All-gather: pass the complete chunks around.
    out = jnp.zeros_like(chunks).at[(me + 1) % n].set(send)
    for s in range(n - 1):
        send = lax.ppermute(send, axis_name, to_right)
        out = out.at[(me - s) % n].set(send)
    return out.reshape(x_block.shape)


def ring_all_reduce_fori(x_block, axis_name):  # other correct form: lax.fori_loop, ring to the left
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    to_left = [(i, (i - 1) % n) for i in range(n)]
    chunks = x_block.reshape(n, -1, *x_block.shape[1:])

    def reduce_step(s, send):
        return lax.ppermute(send, axis_name, to_left) + chunks[(me + 1 + s) % n]

    send = lax.fori_loop(0, n - 1, reduce_step, chunks[me])

    def gather_step(s, carry):
        send, out = carry
        send = lax.ppermute(send, axis_name, to_left)
        return send, out.at[(me + s) % n].set(send)

    out0 = jnp.zeros_like(chunks).at[(me - 1) % n].set(send)
    _, out = lax.fori_loop(0, n - 1, gather_step, (send, out0))
    return out.reshape(x_block.shape)


def ring_uses_psum(x_block, axis_name):  # wrong: not built from ppermute
    return lax.psum(x_block, axis_name)


def ring_scatter_gather(x_block, axis_name):  # wrong for this exercise: library collectives
    part = lax.psum_scatter(x_block, axis_name, tiled=True)
    return lax.all_gather(part, axis_name, tiled=True)


def ring_whole_blocks(x_block, axis_name):  # wrong: right values, (n-1)x the block sent
    n = lax.axis_size(axis_name)
    to_right = [(i, (i + 1) % n) for i in range(n)]
    total, send = x_block, x_block
    for _ in range(n - 1):
        send = lax.ppermute(send, axis_name, to_right)
        total = total + send
    return total


def ring_only_on_eight(x_block, axis_name):  # wrong: a chunked ring at n = 8 only (red team W4)
    if lax.axis_size(axis_name) == 8:
        return ring_all_reduce(x_block, axis_name)
    return ring_whole_blocks(x_block, axis_name)


def ring_whole_blocks_while(
    x_block, axis_name
):  # wrong: the whole block n-1 times, in a while_loop
    n = lax.axis_size(axis_name)
    to_right = [(i, (i + 1) % n) for i in range(n)]

    def step(carry):
        k, total, send = carry
        send = lax.ppermute(send, axis_name, to_right)
        return k + 1, total + send, send

    _, total, _ = lax.while_loop(lambda c: c[0] < n - 1, step, (0, x_block, x_block))
    return total


def ring_whole_blocks_scan(x_block, axis_name):  # wrong: the whole block n-1 times, in a lax.scan
    n = lax.axis_size(axis_name)
    to_right = [(i, (i + 1) % n) for i in range(n)]

    def step(carry, _):
        total, send = carry
        send = lax.ppermute(send, axis_name, to_right)
        return (total + send, send), None

    (total, _), _ = lax.scan(step, (x_block, x_block), length=n - 1)
    return total


def ring_reduce_scatter_only(x_block, axis_name):  # wrong: stops after the reduce-scatter half
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    to_right = [(i, (i + 1) % n) for i in range(n)]
    chunks = x_block.reshape(n, -1, *x_block.shape[1:])
    send = chunks[me]
    for s in range(n - 1):
        send = lax.ppermute(send, axis_name, to_right) + chunks[(me - 1 - s) % n]
    return jnp.zeros_like(chunks).at[(me + 1) % n].set(send).reshape(x_block.shape)


def ring_off_by_one(x_block, axis_name):  # wrong: n-2 reduce steps
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    to_right = [(i, (i + 1) % n) for i in range(n)]
    chunks = x_block.reshape(n, -1, *x_block.shape[1:])
    send = chunks[me]
    for s in range(max(n - 2, 0)):
        send = lax.ppermute(send, axis_name, to_right) + chunks[(me - 1 - s) % n]
    out = jnp.zeros_like(chunks).at[(me + 1) % n].set(send)
    for s in range(n - 1):
        send = lax.ppermute(send, axis_name, to_right)
        out = out.at[(me - s) % n].set(send)
    return out.reshape(x_block.shape)


def ring_wrong_index(
    x_block, axis_name
):  # wrong: adds the chunk it sends, not the one that arrives
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    to_right = [(i, (i + 1) % n) for i in range(n)]
    chunks = x_block.reshape(n, -1, *x_block.shape[1:])
    send = chunks[me]
    for s in range(n - 1):
        send = lax.ppermute(send, axis_name, to_right) + chunks[(me - s) % n]
    out = jnp.zeros_like(chunks).at[me].set(send)
    for s in range(n - 1):
        send = lax.ppermute(send, axis_name, to_right)
        out = out.at[(me - 1 - s) % n].set(send)
    return out.reshape(x_block.shape)


def ring_gather_then_sum(x_block, axis_name):  # wrong: an all-gather by ppermute, then a local sum
    n = lax.axis_size(axis_name)
    to_right = [(i, (i + 1) % n) for i in range(n)]
    blocks, send = [x_block], x_block
    for _ in range(n - 1):
        send = lax.ppermute(send, axis_name, to_right)  # the whole block, every step
        blocks.append(send)
    return sum(blocks[1:], blocks[0])


def ring_nothing(x_block, axis_name):  # wrong: returns the block
    return x_block


# ---- exercise 3: vocabulary-parallel cross-entropy -------------------------------------------------------


def _target(z_block, labels, axis_name):
    # The label's logit, from the shard that owns it (0 elsewhere): [b]
    k = z_block.shape[-1]
    local = labels - lax.axis_index(axis_name) * k  # the label's index in this shard's block
    mine = (local >= 0) & (local < k)
    picked = jnp.take_along_axis(z_block, jnp.clip(local, 0, k - 1)[:, None], axis=-1)[:, 0]
    return jnp.where(mine, picked, 0.0)


def tp_cross_entropy_buggy(logits_block, labels, axis_name):  # the given program (the bug)
    log_probs = jax.nn.log_softmax(
        logits_block, axis=-1
    )  # normalised over this shard's classes only
    return -lax.psum(_target(log_probs, labels, axis_name), axis_name)


def tp_cross_entropy(logits_block, labels, axis_name):  # reference
    shift = lax.pmax(
        lax.stop_gradient(jnp.max(logits_block, axis=-1)), axis_name
    )  # [b], the same on every shard
    z = logits_block - shift[:, None]
    log_norm = jnp.log(
        lax.psum(jnp.sum(jnp.exp(z), axis=-1), axis_name)
    )  # log Σ over all V classes
    return log_norm - lax.psum(_target(z, labels, axis_name), axis_name)


def tp_cross_entropy_onehot(logits_block, labels, axis_name):  # other correct form: one-hot target
    k = logits_block.shape[-1]
    shift = lax.pmax(lax.stop_gradient(logits_block.max(-1, keepdims=True)), axis_name)
    z = logits_block - shift
    classes = lax.axis_index(axis_name) * k + jnp.arange(k)
    target = lax.psum(jnp.sum(jnp.where(classes[None] == labels[:, None], z, 0.0), -1), axis_name)
    return jnp.log(lax.psum(jnp.exp(z).sum(-1), axis_name)) - target


def tp_cross_entropy_two_level(
    logits_block, labels, axis_name
):  # other correct form: two logsumexps
    local = jax.nn.logsumexp(logits_block, axis=-1)  # [b]: log Σ over this shard's classes
    top = lax.pmax(lax.stop_gradient(local), axis_name)
    log_norm = top + jnp.log(lax.psum(jnp.exp(local - top), axis_name))  # log Σ over every shard
    return log_norm - lax.psum(_target(logits_block, labels, axis_name), axis_name)


def tp_cross_entropy_no_shift(logits_block, labels, axis_name):  # wrong: overflows for large logits
    log_norm = jnp.log(lax.psum(jnp.sum(jnp.exp(logits_block), axis=-1), axis_name))
    return log_norm - lax.psum(_target(logits_block, labels, axis_name), axis_name)


def tp_cross_entropy_local_max(
    logits_block, labels, axis_name
):  # wrong: each shard shifts by its own max
    z = logits_block - lax.stop_gradient(jnp.max(logits_block, axis=-1, keepdims=True))
    log_norm = jnp.log(lax.psum(jnp.sum(jnp.exp(z), axis=-1), axis_name))
    return log_norm - lax.psum(_target(z, labels, axis_name), axis_name)


def tp_cross_entropy_batch_max(logits_block, labels, axis_name):  # wrong: one shift for all rows
    m = lax.pmax(lax.stop_gradient(jnp.max(logits_block)), axis_name)  # no axis=-1 (red team W3)
    log_norm = jnp.log(lax.psum(jnp.sum(jnp.exp(logits_block - m), -1), axis_name)) + m
    return log_norm - lax.psum(_target(logits_block, labels, axis_name), axis_name)


def tp_cross_entropy_no_stop_gradient(
    logits_block, labels, axis_name
):  # wrong: pmax in the gradient
    shift = lax.pmax(jnp.max(logits_block, axis=-1), axis_name)
    z = logits_block - shift[:, None]
    return jnp.log(lax.psum(jnp.sum(jnp.exp(z), axis=-1), axis_name)) - lax.psum(
        _target(z, labels, axis_name), axis_name
    )


def tp_cross_entropy_gather(logits_block, labels, axis_name):  # wrong: gathers all the logits
    import optax

    full = lax.all_gather(logits_block, axis_name, axis=1, tiled=True, to="invarying")
    return optax.softmax_cross_entropy_with_integer_labels(full, labels)


def tp_cross_entropy_unmasked(
    logits_block, labels, axis_name
):  # wrong: every shard adds a target logit
    k = logits_block.shape[-1]
    shift = lax.pmax(lax.stop_gradient(jnp.max(logits_block, axis=-1)), axis_name)
    z = logits_block - shift[:, None]
    local = jnp.clip(labels - lax.axis_index(axis_name) * k, 0, k - 1)
    picked = jnp.take_along_axis(z, local[:, None], axis=-1)[:, 0]
    return jnp.log(lax.psum(jnp.sum(jnp.exp(z), axis=-1), axis_name)) - lax.psum(picked, axis_name)


# ---- exercise 4: a stencil with a halo exchange ----------------------------------------------------------


def halo_stencil(x_block, kernel, axis_name):  # reference
    n = lax.axis_size(axis_name)
    r = kernel.shape[0] // 2
    to_next = [(i, i + 1) for i in range(n - 1)]  # no pair wraps around: the ends receive zeros
    to_prev = [(i + 1, i) for i in range(n - 1)]
    before = lax.ppermute(
        x_block[x_block.shape[0] - r :], axis_name, to_next
    )  # the last r rows of i-1
    after = lax.ppermute(x_block[:r], axis_name, to_prev)  # the first r rows of i+1
    padded = jnp.concatenate([before, x_block, after])  # [L/n + 2r, C]
    rows = x_block.shape[0]
    return sum(kernel[j] * padded[j : j + rows] for j in range(kernel.shape[0]))


def halo_stencil_conv(x_block, kernel, axis_name):  # other correct form: lax.conv, a masked ring
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    r = kernel.shape[0] // 2
    ring_next = [(i, (i + 1) % n) for i in range(n)]
    ring_prev = [((i + 1) % n, i) for i in range(n)]
    before = lax.ppermute(x_block[-r:], axis_name, ring_next)
    after = lax.ppermute(x_block[:r], axis_name, ring_prev)
    before = jnp.where(me == 0, 0.0, before)  # the wrap-around halves masked to zero
    after = jnp.where(me == n - 1, 0.0, after)
    padded = jnp.concatenate([before, x_block, after])  # [rows + 2r, C]
    lhs = padded.T[:, None, :]  # [C, 1, rows + 2r]: channels as the batch
    out = lax.conv_general_dilated(lhs, kernel[None, None, :], (1,), "VALID")
    return out[:, 0, :].T


def halo_ring(x_block, kernel, axis_name):  # wrong: a ring wraps the ends around
    n = lax.axis_size(axis_name)
    r = kernel.shape[0] // 2
    before = lax.ppermute(x_block[-r:], axis_name, [(i, (i + 1) % n) for i in range(n)])
    after = lax.ppermute(x_block[:r], axis_name, [((i + 1) % n, i) for i in range(n)])
    padded = jnp.concatenate([before, x_block, after])
    return sum(kernel[j] * padded[j : j + x_block.shape[0]] for j in range(kernel.shape[0]))


def halo_flipped(x_block, kernel, axis_name):  # wrong: a convolution (the kernel reversed)
    return halo_stencil(x_block, kernel[::-1], axis_name)


def halo_none(x_block, kernel, axis_name):  # wrong: zeros at every block's edges
    r = kernel.shape[0] // 2
    z = jnp.zeros((r, x_block.shape[1]), x_block.dtype)
    padded = jnp.concatenate([z, x_block, z])
    return sum(kernel[j] * padded[j : j + x_block.shape[0]] for j in range(kernel.shape[0]))


def halo_swapped(x_block, kernel, axis_name):  # wrong: each neighbour's edge put on the wrong side
    n = lax.axis_size(axis_name)
    r = kernel.shape[0] // 2
    before = lax.ppermute(x_block[:r], axis_name, [(i + 1, i) for i in range(n - 1)])
    after = lax.ppermute(x_block[-r:], axis_name, [(i, i + 1) for i in range(n - 1)])
    padded = jnp.concatenate([before, x_block, after])
    return sum(kernel[j] * padded[j : j + x_block.shape[0]] for j in range(kernel.shape[0]))


def halo_whole_blocks(x_block, kernel, axis_name):  # wrong: right values, whole blocks sent
    n = lax.axis_size(axis_name)
    r = kernel.shape[0] // 2
    prev = lax.ppermute(x_block, axis_name, [(i, i + 1) for i in range(n - 1)])
    nxt = lax.ppermute(x_block, axis_name, [(i + 1, i) for i in range(n - 1)])
    padded = jnp.concatenate([prev[x_block.shape[0] - r :], x_block, nxt[:r]])
    return sum(kernel[j] * padded[j : j + x_block.shape[0]] for j in range(kernel.shape[0]))


def halo_gather(x_block, kernel, axis_name):  # wrong: gathers the whole signal
    rows, r = x_block.shape[0], kernel.shape[0] // 2
    whole = lax.all_gather(x_block, axis_name, tiled=True)
    z = jnp.zeros((r, x_block.shape[1]), x_block.dtype)
    padded = jnp.concatenate([z, whole, z])
    start = lax.axis_index(axis_name) * rows
    window = lax.dynamic_slice_in_dim(padded, start, rows + 2 * r)
    return sum(kernel[j] * window[j : j + rows] for j in range(kernel.shape[0]))


def ring_bf16(x_block, axis_name):  # wrong: the reference ring, every chunk sent in bfloat16
    n = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    right = [(i, (i + 1) % n) for i in range(n)]
    chunks = x_block.reshape(n, -1, *x_block.shape[1:])

    def send(v):
        return lax.ppermute(v.astype(jnp.bfloat16), axis_name, right).astype(x_block.dtype)

    running = chunks[me]
    for s in range(n - 1):
        running = send(running) + chunks[(me - 1 - s) % n]
    out = jnp.zeros_like(chunks).at[(me + 1) % n].set(running)
    for s in range(n - 1):
        running = send(running)
        out = out.at[(me - s) % n].set(running)
    return out.reshape(x_block.shape)


def tp_cross_entropy_gather_varying(
    logits_block, labels, axis_name
):  # wrong: all_gather, to varying
    full = lax.all_gather(logits_block, axis_name, axis=1, tiled=True)  # [b, V] on every shard
    return jax.nn.logsumexp(full, -1) - jnp.take_along_axis(full, labels[:, None], -1)[:, 0]


def halo_bf16(x_block, kernel, axis_name):  # wrong: the right exchange, the halos sent in bfloat16
    n = lax.axis_size(axis_name)
    r, rows = kernel.shape[0] // 2, x_block.shape[0]
    to_next = [(i, i + 1) for i in range(n - 1)]
    to_prev = [(i + 1, i) for i in range(n - 1)]
    before = lax.ppermute(x_block[rows - r :].astype(jnp.bfloat16), axis_name, to_next)
    after = lax.ppermute(x_block[:r].astype(jnp.bfloat16), axis_name, to_prev)
    padded = jnp.concatenate([before.astype(x_block.dtype), x_block, after.astype(x_block.dtype)])
    return sum(kernel[j] * padded[j : j + rows] for j in range(kernel.shape[0]))

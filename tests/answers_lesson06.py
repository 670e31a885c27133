"""Lesson 06 exercises: the notebook's reference solutions, other correct forms and typical wrong answers,
for tests/test_checks_lesson06.py (tests are not in the student package)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import P, lax

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


def tp_cross_entropy_no_shift(logits_block, labels, axis_name):  # wrong: overflows for large logits
    log_norm = jnp.log(lax.psum(jnp.sum(jnp.exp(logits_block), axis=-1), axis_name))
    return log_norm - lax.psum(_target(logits_block, labels, axis_name), axis_name)


def tp_cross_entropy_local_max(
    logits_block, labels, axis_name
):  # wrong: each shard shifts by its own max
    z = logits_block - lax.stop_gradient(jnp.max(logits_block, axis=-1, keepdims=True))
    log_norm = jnp.log(lax.psum(jnp.sum(jnp.exp(z), axis=-1), axis_name))
    return log_norm - lax.psum(_target(z, labels, axis_name), axis_name)


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


# ---- exercise 4: a tensor-parallel MLP, fewest collectives -------------------------------------------------


def mlp_layout(data_axis, model_axis):  # reference: column-parallel, then row-parallel
    return {"w1": P(None, model_axis), "b1": P(model_axis), "w2": P(model_axis, None), "b2": P()}


def tp_mlp_loss_and_grads(params, x_block, y_block, data_axis, model_axis):  # reference
    def global_loss(p):
        h = jax.nn.relu(x_block @ p["w1"] + p["b1"])  # [b, H/m]: no communication
        out = lax.psum(h @ p["w2"], model_axis) + p["b2"]  # [b, K]: one psum, then the bias once
        return lax.pmean(jnp.mean((out - y_block) ** 2), data_axis)

    return jax.value_and_grad(global_loss)(params)


def mlp_layout_tuples(data_axis, model_axis):  # other correct form: specs as tuples
    return {"w1": (None, model_axis), "b1": (model_axis,), "w2": (model_axis,), "b2": ()}


def tp_mlp_sum_form(
    params, x_block, y_block, data_axis, model_axis
):  # other correct form: a global sum
    n_total = x_block.shape[0] * lax.axis_size(data_axis) * y_block.shape[1]

    def global_loss(p):
        h = jax.nn.relu(jnp.dot(x_block, p["w1"]) + p["b1"])
        out = lax.psum(jnp.dot(h, p["w2"]), model_axis) + p["b2"]
        return lax.psum(jnp.sum((out - y_block) ** 2), data_axis) / n_total

    return jax.value_and_grad(global_loss)(params)


def tp_mlp_two_passes(
    params, x_block, y_block, data_axis, model_axis
):  # wasteful: the forward twice
    loss = tp_mlp_loss_and_grads(params, x_block, y_block, data_axis, model_axis)[0]
    grads = tp_mlp_loss_and_grads(params, x_block, y_block, data_axis, model_axis)[1]
    return loss, grads


def tp_mlp_article_grads(
    params, x_block, y_block, data_axis, model_axis
):  # wrong: pmean the gradients
    def local_loss(p):
        h = jax.nn.relu(x_block @ p["w1"] + p["b1"])
        out = lax.psum(h @ p["w2"], model_axis) + p["b2"]
        return jnp.mean((out - y_block) ** 2)

    loss, grads = jax.value_and_grad(local_loss)(params)
    return lax.pmean(loss, data_axis), lax.pmean(grads, data_axis)


def tp_mlp_bias_before_psum(
    params, x_block, y_block, data_axis, model_axis
):  # wrong: b2 inside the psum
    def global_loss(p):
        h = jax.nn.relu(x_block @ p["w1"] + p["b1"])
        out = lax.psum(h @ p["w2"] + p["b2"], model_axis)
        return lax.pmean(jnp.mean((out - y_block) ** 2), data_axis)

    return jax.value_and_grad(global_loss)(params)


def tp_mlp_no_psum(
    params, x_block, y_block, data_axis, model_axis
):  # wrong: partial sums taken as outputs
    def global_loss(p):
        h = jax.nn.relu(x_block @ p["w1"] + p["b1"])
        return lax.pmean(jnp.mean((h @ p["w2"] + p["b2"] - y_block) ** 2), data_axis)

    return jax.value_and_grad(global_loss)(params)


def mlp_layout_columns(data_axis, model_axis):  # wrong layout: both column-parallel
    return {
        "w1": P(None, model_axis),
        "b1": P(model_axis),
        "w2": P(None, model_axis),
        "b2": P(model_axis),
    }


def tp_mlp_columns(
    params, x_block, y_block, data_axis, model_axis
):  # its body: gathers h, splits the loss
    def global_loss(p):
        h = jax.nn.relu(x_block @ p["w1"] + p["b1"])
        h_all = lax.all_gather(h, model_axis, axis=1, tiled=True)  # [b, H]
        out = h_all @ p["w2"] + p["b2"]  # [b, K/m]
        sq = lax.psum(jnp.sum((out - y_block_cols(y_block, model_axis)) ** 2), model_axis)
        return lax.pmean(sq / (y_block.shape[0] * y_block.shape[1]), data_axis)

    return jax.value_and_grad(global_loss)(params)


def y_block_cols(y_block, model_axis):  # this model shard's columns of y
    k = y_block.shape[1] // lax.axis_size(model_axis)
    return lax.dynamic_slice_in_dim(y_block, lax.axis_index(model_axis) * k, k, axis=1)


def mlp_layout_replicated(data_axis, model_axis):  # wrong: nothing split
    return {"w1": P(), "b1": P(), "w2": P(), "b2": P()}

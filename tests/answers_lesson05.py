"""Lesson 05 exercise 3 (an FSDP x tensor-parallel momentum step on Explicit axes): the notebook's reference
solution, other correct forms and plausible wrong answers, for tests/test_checks_lesson05.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import P
from jax.sharding import auto_axes

from course_lib.meshes import DATA, MODEL


def _momentum(params, velocity, grads, lr):
    v = jax.tree.map(lambda v, g: 0.9 * v + g, velocity, grads)
    return jax.tree.map(lambda p, v: p - lr * v, params, v), v


ROWS = P(DATA, None)


def _mlp(p, x, y, w1, w2, out_sharding=ROWS):
    h = jax.nn.relu(x @ w1 + p["b1"])  # [B@data, H@model]
    out = jnp.matmul(h, w2, out_sharding=out_sharding) + p["b2"]
    return jnp.mean((out - y) ** 2)


def fsdp_tp_step(params, velocity, x, y, lr):  # reference
    def loss_fn(p):
        w1 = jax.reshard(p["w1"], P(None, MODEL))  # all-gather over data: [D, H@model]
        w2 = jax.reshard(p["w2"], P(MODEL, None))  # all-gather over data: [H@model, O]
        return _mlp(p, x, y, w1, w2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return (*_momentum(params, velocity, grads, lr), loss)


def fsdp_tp_step_einsum(
    params, velocity, x, y, lr
):  # other correct form: einsum, sum / size, dicts
    def loss_fn(p):
        w1 = jax.reshard(p["w1"], P(None, MODEL))
        w2 = jax.reshard(p["w2"], P(MODEL, None))
        h = jnp.maximum(jnp.einsum("bd,dh->bh", x, w1) + p["b1"], 0.0)
        out = jnp.einsum("bh,ho->bo", h, w2, out_sharding=P(DATA, None)) + p["b2"]
        return jnp.sum((out - y) ** 2) / y.size

    loss, g = jax.value_and_grad(loss_fn)(params)
    v = {k: 0.9 * velocity[k] + g[k] for k in params}
    return {k: params[k] - lr * v[k] for k in params}, v, loss


def fsdp_tp_step_auto_matmul(
    params, velocity, x, y, lr
):  # other correct form: auto_axes, one matmul
    def loss_fn(p):
        w1 = jax.reshard(p["w1"], P(None, MODEL))
        w2 = jax.reshard(p["w2"], P(MODEL, None))
        h = jax.nn.relu(x @ w1 + p["b1"])
        out = auto_axes(lambda a, b: a @ b, out_sharding=P(DATA, None))(h, w2) + p["b2"]
        return jnp.mean((out - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return (*_momentum(params, velocity, grads, lr), loss)


def fsdp_tp_step_gather_first(
    params, velocity, x, y, lr
):  # other correct form: gradient of the gathered
    full = {**params, "w1": jax.reshard(params["w1"], P(None, MODEL))}
    full["w2"] = jax.reshard(params["w2"], P(MODEL, None))
    loss, g = jax.value_and_grad(lambda f: _mlp(f, x, y, f["w1"], f["w2"]))(full)
    g = {
        **g,
        "w1": jax.reshard(g["w1"], P(DATA, MODEL)),
        "w2": jax.reshard(g["w2"], P(MODEL, DATA)),
    }
    return (*_momentum(params, velocity, g, lr), loss)


def fsdp_tp_step_whole_auto(params, velocity, x, y, lr):  # wrong: auto_axes around the whole loss
    def f(p, x, y):
        return jnp.mean((jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - y) ** 2)

    loss, grads = jax.value_and_grad(lambda p: auto_axes(f, out_sharding=P())(p, x, y))(params)
    return (*_momentum(params, velocity, grads, lr), loss)


def fsdp_tp_step_no_reshard(
    params, velocity, x, y, lr
):  # borderline: no reshard, out_sharding twice
    def loss_fn(p):
        h = jax.nn.relu(jnp.matmul(x, p["w1"], out_sharding=P(DATA, MODEL)) + p["b1"])
        out = jnp.matmul(h, p["w2"], out_sharding=ROWS) + p["b2"]
        return jnp.mean((out - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return (*_momentum(params, velocity, grads, lr), loss)


def fsdp_tp_step_gather_all(
    params, velocity, x, y, lr
):  # wrong: reshard(..., P()) gathers over model too
    def loss_fn(p):
        f = jax.tree.map(lambda w: jax.reshard(w, P()), p)
        return _mlp(f, x, y, f["w1"], f["w2"], out_sharding=P(DATA, None))

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return (*_momentum(params, velocity, grads, lr), loss)


def fsdp_tp_step_replicated_out(params, velocity, x, y, lr):  # wrong: the output gathered whole
    def loss_fn(p):
        w1 = jax.reshard(p["w1"], P(None, MODEL))
        w2 = jax.reshard(p["w2"], P(MODEL, None))
        return _mlp(p, jax.reshard(x, P()), jax.reshard(y, P()), w1, w2, out_sharding=P())

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return (*_momentum(params, velocity, grads, lr), loss)


def fsdp_tp_step_keeps_gathered(params, velocity, x, y, lr):  # wrong: returns the gathered weights
    full = {**params, "w1": jax.reshard(params["w1"], P(None, MODEL))}
    full["w2"] = jax.reshard(params["w2"], P(MODEL, None))
    loss, g = jax.value_and_grad(lambda f: _mlp(f, x, y, f["w1"], f["w2"]))(full)
    v = {**velocity, "w1": jax.reshard(velocity["w1"], P(None, MODEL))}
    v["w2"] = jax.reshard(velocity["w2"], P(MODEL, None))
    return (*_momentum(full, v, g, lr), loss)


def fsdp_tp_step_sgd(params, velocity, x, y, lr):  # wrong: plain SGD, the velocity ignored
    new, _, loss = fsdp_tp_step(params, jax.tree.map(jnp.zeros_like, velocity), x, y, lr)
    return new, velocity, loss


def fsdp_tp_step_loss_after(params, velocity, x, y, lr):  # wrong: the loss after the update
    new, v, _ = fsdp_tp_step(params, velocity, x, y, lr)
    return new, v, fsdp_tp_step(new, v, x, y, lr)[2]


def fsdp_tp_step_no_out_sharding(params, velocity, x, y, lr):  # wrong: the ambiguous contraction
    def loss_fn(p):
        w1 = jax.reshard(p["w1"], P(None, MODEL))
        w2 = jax.reshard(p["w2"], P(MODEL, None))
        return jnp.mean((jax.nn.relu(x @ w1 + p["b1"]) @ w2 + p["b2"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return (*_momentum(params, velocity, grads, lr), loss)


def fsdp_tp_step_lr_ignored(params, velocity, x, y, lr):  # wrong: the learning rate hard-coded
    def loss_fn(p):
        return _mlp(
            p, x, y, jax.reshard(p["w1"], P(None, MODEL)), jax.reshard(p["w2"], P(MODEL, None))
        )

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return (*_momentum(params, velocity, grads, 0.1), loss)


def fsdp_tp_step_shard_map(params, velocity, x, y, lr):
    """Other correct form: the same step in ``jax.shard_map``: all_gather over data only, one psum over
    model, the gradient of the global loss (the gradients come back reduce-scattered over data)."""
    specs = {"w1": P(DATA, MODEL), "b1": P(MODEL), "w2": P(MODEL, DATA), "b2": P()}

    def body(p, v, xb, yb):
        def loss_fn(p):
            w1 = jax.lax.all_gather(p["w1"], DATA, axis=0, tiled=True)
            w2 = jax.lax.all_gather(p["w2"], DATA, axis=1, tiled=True)
            out = jax.lax.psum(jax.nn.relu(xb @ w1 + p["b1"]) @ w2, MODEL) + p["b2"]
            return jax.lax.pmean(jnp.mean((out - yb) ** 2), DATA)

        loss, g = jax.value_and_grad(loss_fn)(p)
        return (*_momentum(p, v, g, lr), loss)

    mapped = jax.shard_map(
        body,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(specs, specs, P(DATA), P(DATA)),
        out_specs=(specs, specs, P()),
    )
    return mapped(params, velocity, x, y)


def fsdp_tp_step_regathers(
    params, velocity, x, y, lr
):  # the red team's D4: the backward gathers again
    @jax.checkpoint
    def loss_fn(p):
        w1 = jax.reshard(p["w1"], P(None, MODEL))
        w2 = jax.reshard(p["w2"], P(MODEL, None))
        return _mlp(p, x, y, w1, w2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return (*_momentum(params, velocity, grads, lr), loss)

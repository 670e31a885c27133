"""Exercise checkers of lesson 05 (course_tools.checks.lesson05): each accepts the reference answer and
other correct forms and rejects typical wrong answers with a specific hint, at 8 devices (from conftest.py)
and, for the references, at 3 (the checkers take the devices they run on)."""

from functools import partial

import jax
import jax.numpy as jnp
import pytest
from checking import rejects
from jax import P
from jax.sharding import NamedSharding, auto_axes

from course_lib.meshes import DATA, MODEL, data_model_mesh
from course_tools.checks import NotWritten, lesson05


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

RIGHT = {
    "a": "none",
    "b": "all-reduce over model",
    "c": None,
    "d": "all-reduce over data",
    "e": "all-reduce over data and model",
}


def test_collective_predictions(report):
    devs = report.devices
    assert lesson05.check_collective_predictions(RIGHT, devs)
    other = {
        "a": set(),
        "b": ("all-reduce", "model"),
        "c": [],
        "d": {("all_reduce", "data")},
        "e": [("all-reduce", "data"), ("allreduce", "model")],
    }
    assert lesson05.check_collective_predictions(other, devs)
    sizes = data_model_mesh(devs).shape
    if sizes[MODEL] > 1:
        rejects(
            lesson05.check_collective_predictions,
            {**RIGHT, "b": "none"},
            devs,
            match="'b'.*partial row sums",
        )
        rejects(
            lesson05.check_collective_predictions,
            {**RIGHT, "a": "all-reduce over model"},
            devs,
            match="'a'.*no communication",
        )
    if sizes[DATA] > 1:
        rejects(
            lesson05.check_collective_predictions,
            {**RIGHT, "d": "all-reduce over model"},
            devs,
            match="'d'.*over the rows",
        )
        rejects(
            lesson05.check_collective_predictions,
            {**RIGHT, "c": "all-to-all over data"},
            devs,
            match="'c'.*relabels",
        )
        rejects(
            lesson05.check_collective_predictions,
            {**RIGHT, "e": "all-reduce over model"},
            devs,
            match="'e'.*both",
        )
    rejects(
        lesson05.check_collective_predictions,
        {**RIGHT, "a": "a broadcast"},
        devs,
        match="OP over AXIS",
    )
    rejects(lesson05.check_collective_predictions, {"a": "none"}, devs, match="exactly the keys")
    _not_written(lesson05.check_collective_predictions, None, devs)
    _not_written(lesson05.check_collective_predictions, dict.fromkeys(RIGHT, ...), devs)


# ---- exercise 2 ----


def train_as_given(step, state, batches, mesh, lr_schedule):
    state = jax.device_put(state, NamedSharding(mesh, P()))
    losses = []
    for i, batch in enumerate(batches):
        step_i = jax.jit(partial(step, lr=lr_schedule(i)))
        state, loss = step_i(state, batch)
        losses.append(float(loss))
    return state, losses


def train_ref(step, state, batches, mesh, lr_schedule):
    state = jax.device_put(state, NamedSharding(mesh, P()))
    step_fn = jax.jit(step)
    losses = []
    for i, batch in enumerate(batches):
        batch = jax.device_put(batch, NamedSharding(mesh, P(DATA)))
        state, loss = step_fn(state, batch, lr_schedule(i))
        losses.append(float(loss))
    return state, losses


def train_placed_up_front(step, state, batches, mesh, lr_schedule):  # other correct form
    rows = NamedSharding(mesh, P(DATA))
    placed = [jax.device_put(b, rows) for b in batches]
    step_fn = jax.jit(step, donate_argnums=0)
    state = jax.device_put(jnp.asarray(state), NamedSharding(mesh, P()))
    losses = []
    for i, batch in enumerate(placed):
        state, loss = step_fn(state, batch, jnp.float32(lr_schedule(i)))
        losses.append(loss)
    return state, jnp.stack(losses)


def train_in_shardings(
    step, state, batches, mesh, lr_schedule
):  # wrong on Explicit axes: all-gathers
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(DATA))
    step_fn = jax.jit(step, in_shardings=(rep, rows, None))
    state = jax.device_put(state, rep)
    losses = []
    for i, batch in enumerate(batches):
        state, loss = step_fn(state, batch, jnp.float32(lr_schedule(i)))
        losses.append(loss)
    return state, jnp.stack(losses)


def train_hoisted_only(step, state, batches, mesh, lr_schedule):
    state = jax.device_put(state, NamedSharding(mesh, P()))
    step_fn = jax.jit(step)
    losses = []
    for i, batch in enumerate(batches):
        state, loss = step_fn(state, batch, lr_schedule(i))
        losses.append(float(loss))
    return state, losses


def train_placed_only(step, state, batches, mesh, lr_schedule):
    state = jax.device_put(state, NamedSharding(mesh, P()))
    losses = []
    for i, batch in enumerate(batches):
        batch = jax.device_put(batch, NamedSharding(mesh, P(DATA)))
        state, loss = jax.jit(partial(step, lr=lr_schedule(i)))(state, batch)
        losses.append(float(loss))
    return state, losses


def train_static_lr(step, state, batches, mesh, lr_schedule):
    step_fn = jax.jit(step, static_argnums=2)
    state = jax.device_put(state, NamedSharding(mesh, P()))
    losses = []
    for i, batch in enumerate(batches):
        state, loss = step_fn(
            state, jax.device_put(batch, NamedSharding(mesh, P(DATA))), lr_schedule(i)
        )
        losses.append(float(loss))
    return state, losses


def train_replicated(step, state, batches, mesh, lr_schedule):
    step_fn = jax.jit(step)
    state = jax.device_put(state, NamedSharding(mesh, P()))
    losses = []
    for i, batch in enumerate(batches):
        state, loss = step_fn(
            state, jax.device_put(batch, NamedSharding(mesh, P())), lr_schedule(i)
        )
        losses.append(float(loss))
    return state, losses


def train_features(step, state, batches, mesh, lr_schedule):
    step_fn = jax.jit(step)
    state = jax.device_put(state, NamedSharding(mesh, P()))
    losses = []
    for i, (x, y) in enumerate(batches):
        b = (
            jax.device_put(x, NamedSharding(mesh, P(None, DATA))),
            jax.device_put(y, NamedSharding(mesh, P())),
        )
        state, loss = step_fn(state, b, lr_schedule(i))
        losses.append(float(loss))
    return state, losses


def train_state_unplaced(step, state, batches, mesh, lr_schedule):
    step_fn = jax.jit(step)
    losses = []
    for i, batch in enumerate(batches):
        state, loss = step_fn(
            state, jax.device_put(batch, NamedSharding(mesh, P(DATA))), lr_schedule(i)
        )
        losses.append(float(loss))
    return state, losses


def train_wrong_lr(step, state, batches, mesh, lr_schedule):
    step_fn = jax.jit(step)
    state = jax.device_put(state, NamedSharding(mesh, P()))
    losses = []
    for batch in batches:
        state, loss = step_fn(
            state, jax.device_put(batch, NamedSharding(mesh, P(DATA))), lr_schedule(0)
        )
        losses.append(float(loss))
    return state, losses


def test_data_parallel_loop(report):
    devs = report.devices
    n = len(devs)
    assert lesson05.check_data_parallel_loop(train_ref, devs)
    assert lesson05.check_data_parallel_loop(train_placed_up_front, devs)
    rejects(
        lesson05.check_data_parallel_loop,
        train_in_shardings,
        devs,
        match="whole batch.*in_shardings",
    )
    rejects(
        lesson05.check_data_parallel_loop, train_as_given, devs, match="traced and compiled 3 times"
    )
    rejects(
        lesson05.check_data_parallel_loop, train_placed_only, devs, match="new function every step"
    )
    rejects(lesson05.check_data_parallel_loop, train_static_lr, devs, match="static learning rate")
    rejects(lesson05.check_data_parallel_loop, train_hoisted_only, devs, match="whole batch")
    rejects(lesson05.check_data_parallel_loop, train_replicated, devs, match="whole batch")
    if n > 1:
        rejects(lesson05.check_data_parallel_loop, train_features, devs, match="not along the rows")
    rejects(lesson05.check_data_parallel_loop, train_wrong_lr, devs, match="lr_schedule\\(i\\)")
    rejects(
        lesson05.check_data_parallel_loop,
        train_state_unplaced,
        devs,
        match="place the state on the mesh",
    )
    _not_written(lesson05.check_data_parallel_loop, stub, devs)


# ---- exercise 3 ----


def _momentum(params, velocity, grads, lr):
    v = jax.tree.map(lambda v, g: 0.9 * v + g, velocity, grads)
    return jax.tree.map(lambda p, v: p - lr * v, params, v), v


def tp_ref(params, velocity, x, y, lr):
    def loss_fn(p):
        h = jax.nn.relu(x @ p["w1"] + p["b1"])  # [B@data, H@model]: no communication
        out = jnp.matmul(
            h, p["w2"], out_sharding=P(DATA, None)
        )  # contracts H: all-reduce over model
        return jnp.mean((out + p["b2"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    new_params, new_velocity = _momentum(params, velocity, grads, lr)
    return new_params, new_velocity, loss


def tp_einsum(params, velocity, x, y, lr):  # other correct form: einsum, sum / size, a dict loop
    def loss_fn(p):
        h = jnp.maximum(jnp.einsum("bd,dh->bh", x, p["w1"]) + p["b1"], 0.0)
        out = jnp.einsum("bh,ho->bo", h, p["w2"], out_sharding=P(DATA, None)) + p["b2"]
        return jnp.sum((out - y) ** 2) / y.size

    loss, grads = jax.value_and_grad(loss_fn)(params)
    v = {k: 0.9 * velocity[k] + grads[k] for k in params}
    return {k: params[k] - lr * v[k] for k in params}, v, loss


def tp_auto(
    params, velocity, x, y, lr
):  # other correct form: the compiler chooses inside auto_axes
    def loss_fn(p):
        h = jax.nn.relu(x @ p["w1"] + p["b1"])
        out = auto_axes(lambda h, w: h @ w, out_sharding=P(DATA, None))(h, p["w2"]) + p["b2"]
        return jnp.mean((out - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return (*_momentum(params, velocity, grads, lr), loss)


def _with_loss(loss_fn):
    def step(params, velocity, x, y, lr):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(p, x, y))(params)
        return (*_momentum(params, velocity, grads, lr), loss)

    return step


tp_no_out_sharding = _with_loss(
    lambda p, x, y: jnp.mean((jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - y) ** 2)
)
tp_gather_w2 = _with_loss(
    lambda p, x, y: jnp.mean(
        (
            jax.reshard(jax.nn.relu(x @ p["w1"] + p["b1"]), P(DATA, None))
            @ jax.reshard(p["w2"], P())
            + p["b2"]
            - y
        )
        ** 2
    )
)
tp_replicated_out = _with_loss(
    lambda p, x, y: jnp.mean(
        (
            jnp.matmul(jax.nn.relu(x @ p["w1"] + p["b1"]), p["w2"], out_sharding=P())
            + p["b2"]
            - jax.reshard(y, P())
        )
        ** 2
    )
)
tp_sum_loss = _with_loss(
    lambda p, x, y: jnp.sum(
        (
            jnp.matmul(jax.nn.relu(x @ p["w1"] + p["b1"]), p["w2"], out_sharding=P(DATA, None))
            + p["b2"]
            - y
        )
        ** 2
    )
)


def tp_resharded_params(params, velocity, x, y, lr):
    new, v, loss = tp_ref(params, velocity, x, y, lr)
    return jax.tree.map(lambda p: jax.reshard(p, P()), new), v, loss


def tp_resharded_velocity(params, velocity, x, y, lr):
    new, v, loss = tp_ref(params, velocity, x, y, lr)
    return new, jax.tree.map(lambda a: jax.reshard(a, P()), v), loss


def tp_plain_sgd(params, velocity, x, y, lr):  # ignores the momentum
    new, _, loss = tp_ref(params, jax.tree.map(jnp.zeros_like, velocity), x, y, lr)
    return new, velocity, loss


def tp_loss_after(params, velocity, x, y, lr):
    new, v, _ = tp_ref(params, velocity, x, y, lr)
    return new, v, tp_ref(new, v, x, y, lr)[2]


def test_tp_train_step(report):
    devs = report.devices
    assert lesson05.check_tp_train_step(tp_ref, devs)
    assert lesson05.check_tp_train_step(tp_einsum, devs)
    assert lesson05.check_tp_train_step(tp_auto, devs)
    rejects(lesson05.check_tp_train_step, tp_no_out_sharding, devs, match="ShardingTypeError")
    rejects(lesson05.check_tp_train_step, tp_gather_w2, devs, match="moves whole arrays")
    rejects(lesson05.check_tp_train_step, tp_replicated_out, devs, match="moves whole arrays")
    rejects(
        lesson05.check_tp_train_step,
        tp_resharded_params,
        devs,
        match="parameters .* changed sharding",
    )
    rejects(
        lesson05.check_tp_train_step,
        tp_resharded_velocity,
        devs,
        match="velocity .* changed sharding",
    )
    rejects(lesson05.check_tp_train_step, tp_plain_sgd, devs, match="velocity of")
    rejects(lesson05.check_tp_train_step, tp_sum_loss, devs, match="loss .* one device gives")
    rejects(lesson05.check_tp_train_step, tp_loss_after, devs, match="before the update")
    rejects(
        lesson05.check_tp_train_step,
        lambda p, v, x, y, lr: tp_ref(p, v, x, y, lr)[0],
        devs,
        match="new_params, new_velocity, loss",
    )
    _not_written(lesson05.check_tp_train_step, stub, devs)


def test_references_at_an_odd_device_count(report):
    """The notebooks run at 1, 2, 4 and 8 devices in CI; 3 is promised too."""
    devs = report.devices[:3]
    assert lesson05.check_collective_predictions(RIGHT, devs)
    assert lesson05.check_data_parallel_loop(train_ref, devs)
    assert lesson05.check_tp_train_step(tp_ref, devs)
    rejects(lesson05.check_data_parallel_loop, train_hoisted_only, devs, match="whole batch")


def test_an_axis_of_size_1_is_judged_on_a_full_mesh_too(report):
    """With 1 device (or 3: data=3 x model=1) an axis of size 1 hides collectives: the predictions are also
    judged on a 2 x 2 mesh in a fresh process, and the TP step's traced types show a gather."""
    one, three = report.devices[:1], report.devices[:3]
    assert lesson05.check_collective_predictions(RIGHT, one)
    rejects(
        lesson05.check_collective_predictions,
        {**RIGHT, "b": "none"},
        one,
        match="'b' on the mesh \\{'data': 2, 'model': 2\\}.*partial row sums",
    )
    rejects(
        lesson05.check_collective_predictions,
        {**RIGHT, "d": "none"},
        three,
        match="'d'.*over the rows",
    )
    assert lesson05.check_tp_train_step(tp_ref, one)
    assert lesson05.check_tp_train_step(tp_auto, one)
    for gathers in (tp_gather_w2, tp_replicated_out):
        rejects(lesson05.check_tp_train_step, gathers, one, match="gathers a sharded array")

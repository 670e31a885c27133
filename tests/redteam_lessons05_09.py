"""Answers that fool, or are misjudged by, the exercise checkers of lessons 05, 06, 07 and 09.

Input for whoever hardens the checkers; not a test module (pytest does not collect it: no ``test_``
prefix). Each function is one answer, written as a learner would from the notebook's exercise text,
with a comment that says what is wrong with it (or, for a right answer refused or misjudged, what is
right) and which checker it fools. ``CASES`` lists them with the call the exercise's check cell makes
and what the checker should say; ``python tests/redteam_lessons05_09.py`` runs every case on 8
simulated CPU devices and prints each verdict next to the one it should be (``FOOLED``: a wrong
answer accepted; ``REFUSED``: a right one refused; ``MSG``: the right verdict with a false or
unhelpful message; ``WEAK``: a right verdict on inputs that cannot tell two mental models apart),
then the demonstrations that back the cases whose fault the checker's inputs cannot show:

- ``probe_queued_steps``: 07 exercise 3, how often step i+1 is dispatched while step i still runs;
- ``demo_bounding_box_over_read``: 09 exercise 3, what the bounding-box loader reads in a process
  whose blocks are not contiguous (interleaved device ids, the layout 09 exercise 2's check uses);
- ``demo_own_mesh``: 05 exercise 2, where the answer that builds its own mesh puts the data when the
  mesh it is given is not all the devices;
- ``brute_force_*``: three predict exercises solved blind, from the count of wrong answers alone.

Run it alone (one JAX process): ``.venv/bin/python tests/redteam_lessons05_09.py [substring]``.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import re
import sys
import time
from functools import partial

import jax  # importing is not a JAX operation: main() sets up the devices before the first one
import jax.numpy as jnp
import numpy as np
from jax import P, lax
from jax.sharding import NamedSharding

from course_lib.devices import setup_devices
from course_lib.meshes import DATA, MODEL

# ------------------------------------------------------------------------------------------------
# 05 · exercise 1 · check_collective_predictions(predictions, devices)
# ------------------------------------------------------------------------------------------------
PREDICT_05_REF = dict(
    a="none",
    b="all-reduce over model",
    c="none",
    d="all-reduce over data",
    e="collective-permute over data",
    f="all-gather over model",
)

# WRONG, ACCEPTED: a prediction that contradicts itself ("none" and an all-reduce). The parser drops
# "none" when it is joined by ';' to an operation, so hedging "nothing, or maybe an all-reduce"
# passes. Fools check_collective_predictions. Any spelling with "none" next to an operation should be
# refused as malformed (the checker already refuses 'all-reduce' without an axis).
PREDICT_05_HEDGED = {**PREDICT_05_REF, "b": "none; all-reduce over model"}


# ------------------------------------------------------------------------------------------------
# 05 · exercise 2 · check_data_parallel_loop(train, devices)
# ------------------------------------------------------------------------------------------------
def train_own_mesh(step, state, batches, mesh, lr_schedule):
    """WRONG, ACCEPTED by check_data_parallel_loop: ignores the ``mesh`` argument and builds a mesh
    over ``jax.devices()``. Right only when the mesh handed in is every device in default order —
    which is the only mesh the checker hands in. Given a mesh over 4 of 8 devices it spreads the
    batch over all 8 (``demo_own_mesh``). The checker should also pass a mesh over a subset of the
    devices (or in another order) and require the outputs on that mesh."""
    own = jax.make_mesh((jax.device_count(),), (DATA,))
    step_fn, rows = jax.jit(step), NamedSharding(own, P(DATA))
    state, losses = jax.device_put(state, NamedSharding(own, P())), []
    for i, batch in enumerate(batches):
        state, loss = step_fn(state, jax.device_put(batch, rows), lr_schedule(i))
        losses.append(float(loss))
    return state, losses


def train_in_shardings_numpy(step, state, batches, mesh, lr_schedule):
    """WRONG, REFUSED, but with a confusing message: ``jit(in_shardings=...)`` fed NumPy, state never
    placed. The checker says "the state's type changed from float32[16,3] to float32[16,3]" — the
    same string twice, so the reader cannot see what changed (committed vs uncommitted / the
    sharding, which the Explicit type of a replicated array does not print). It should name the
    sharding or the committedness, not the type."""
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(DATA))
    step_fn, losses = jax.jit(step, in_shardings=(rep, rows, None)), []
    for i, batch in enumerate(batches):
        state, loss = step_fn(state, batch, lr_schedule(i))
        losses.append(float(loss))
    return state, losses


# ------------------------------------------------------------------------------------------------
# 05 · exercise 3 · check_fsdp_tp_step(fsdp_tp_step, devices)
# ------------------------------------------------------------------------------------------------
def _fsdp_tp_loss(p, x, y):
    w1 = jax.reshard(p["w1"], P(None, MODEL))
    w2 = jax.reshard(p["w2"], P(MODEL, None))
    h = jax.nn.relu(x @ w1 + p["b1"])
    out = jnp.matmul(h, w2, out_sharding=P(DATA, None))
    return jnp.mean((out + p["b2"] - y) ** 2)


def fsdp_tp_step_lr_ignored(params, velocity, x, y, lr):
    """WRONG, ACCEPTED by check_fsdp_tp_step: ignores ``lr`` and uses 0.1. The checker calls the step
    with one learning rate only, 0.1 (the same answer with 0.05 is refused), so any step with the
    learning rate hard-coded to the checker's value passes. Call it with two learning rates."""
    loss, grads = jax.value_and_grad(_fsdp_tp_loss)(params, x, y)
    new_velocity = jax.tree.map(lambda v, g: 0.9 * v + g, velocity, grads)
    new_params = jax.tree.map(lambda p, v: p - 0.1 * v, params, new_velocity)
    return new_params, new_velocity, loss


def fsdp_tp_step_shard_map(params, velocity, x, y, lr):
    """RIGHT by the numbers, REFUSED by check_fsdp_tp_step (by its stated spec, which asks for the
    first layer on Explicit types): the same step written with ``jax.shard_map`` — all_gather over
    data only, one psum over model, the gradient of the global loss (check_vma=True), so the
    gradients come back reduce-scattered. Its compiled collectives are the reference's. The refusal
    says "no product typed [16@data, 32@model]" and hints to gather "over data only, where it is
    used", which this answer does; the message should say that the exercise asks for sharded jit on
    Explicit axes and that a shard_map body has no such types."""
    specs = {"w1": P(DATA, MODEL), "b1": P(MODEL), "w2": P(MODEL, DATA), "b2": P()}

    def body(p, v, xb, yb):
        def loss_fn(p):
            w1 = lax.all_gather(p["w1"], DATA, axis=0, tiled=True)
            w2 = lax.all_gather(p["w2"], DATA, axis=1, tiled=True)
            out = lax.psum(jax.nn.relu(xb @ w1 + p["b1"]) @ w2, MODEL) + p["b2"]
            return lax.pmean(jnp.mean((out - yb) ** 2), DATA)

        loss, g = jax.value_and_grad(loss_fn)(p)
        nv = jax.tree.map(lambda a, b: 0.9 * a + b, v, g)
        return jax.tree.map(lambda a, b: a - lr * b, p, nv), nv, loss

    mesh = jax.sharding.get_abstract_mesh()
    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(specs, specs, P(DATA), P(DATA)),
        out_specs=(specs, specs, P()),
    )
    return mapped(params, velocity, x, y)


# ------------------------------------------------------------------------------------------------
# 06 · exercise 2 · check_ring_all_reduce(ring_all_reduce)
# ------------------------------------------------------------------------------------------------
def ring_all_reduce_bf16(x_block, axis_name):
    """WRONG, REFUSED, with a false hint: the reference ring, each chunk sent in bfloat16 (half the
    bytes). The values are off by ~1e-2, rightly refused — but the hint says "each chunk must collect
    all n contributions … track which chunk index arrives at step s", blaming the chunk bookkeeping,
    which is right here. The hint should say the sum lost precision (a dtype change on the wire)."""
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


# ------------------------------------------------------------------------------------------------
# 06 · exercise 3 · check_tp_cross_entropy(tp_cross_entropy, devices)
# ------------------------------------------------------------------------------------------------
def tp_cross_entropy_gathered(logits_block, labels, axis_name):
    """WRONG, REFUSED for the wrong reason: gathers every class's logits on every shard (what the
    exercise forbids). The checker reports "jax.grad raised
    ValueError: Too few leaves for PyTreeDef; expected 6, got 5" with the hint "run it under
    jax.grad on a small input" — JAX's obscure symptom of a replication error under grad, not the
    mistake. The same answer with ``to="invarying"`` gets the right message ("the logits travel:
    ['all_gather_invariant'] moves more than one value per example"). Inspect the forward jaxpr for
    gathers before taking the gradient, so that this answer gets that message too."""
    full = lax.all_gather(logits_block, axis_name, axis=1, tiled=True)  # [b, V] on every shard
    return jax.nn.logsumexp(full, -1) - jnp.take_along_axis(full, labels[:, None], -1)[:, 0]


# ------------------------------------------------------------------------------------------------
# 06 · exercise 4 · check_halo_stencil(halo_stencil, devices)
# ------------------------------------------------------------------------------------------------
def halo_stencil_bf16(x_block, kernel, axis_name):
    """WRONG, REFUSED, with a false hint: the right halo exchange with the halos sent in bfloat16.
    Refused for the values, but the hint says "device i needs the last r rows of device i-1 … check
    which block each ppermute" — the pairs and rows are right; the halos lost precision."""
    n = lax.axis_size(axis_name)
    r, rows = kernel.shape[0] // 2, x_block.shape[0]
    to_next = [(i, i + 1) for i in range(n - 1)]
    to_prev = [(i + 1, i) for i in range(n - 1)]
    half = jnp.bfloat16
    before = lax.ppermute(x_block[rows - r :].astype(half), axis_name, to_next)
    after = lax.ppermute(x_block[:r].astype(half), axis_name, to_prev)
    padded = jnp.concatenate([before.astype(x_block.dtype), x_block, after.astype(x_block.dtype)])
    return sum(kernel[j] * padded[j : j + rows] for j in range(kernel.shape[0]))


# ------------------------------------------------------------------------------------------------
# 07 · exercise 1 · check_memory_prediction(predict_memory)
# ------------------------------------------------------------------------------------------------
def predict_memory_wrong_alias():
    """WRONG, REFUSED — but the first refusal's hint states the whole rule: "arguments are every
    input buffer … donated or not; outputs are the trees it returns; an alias is a donated input
    buffer reused for an output of the same shape and dtype — without donation nothing aliases,
    and an output can reuse only one buffer (a donation that finds no output to reuse is
    unusable…)". After one wrong guess the twelve numbers follow from the hint; together with the
    count of wrong numbers the exercise is solved blind in 49 calls (``brute_force_memory``). The
    hint should point at the section to reread, not state the rule."""
    return {(): (3, 2, 0), (0,): (3, 2, 1), (0, 2): (3, 2, 2), (0, 1, 2): (3, 2, 3)}


# ------------------------------------------------------------------------------------------------
# 07 · exercise 2 · check_remat_loss(remat_loss)
# ------------------------------------------------------------------------------------------------
def _layer(h, w):
    return jnp.tanh(h @ w)


def remat_loss_checker_depths_only(weights, x):
    """WRONG, ACCEPTED by check_remat_loss: block sizes looked up for the three depths the exercise
    text names (4, 9, 25); any other depth gets one checkpoint around the whole network, which saves
    nothing. The exercise asks to choose k "from L"; the checker tries only the announced depths.
    It should also try a depth the text does not name (16, 36, or one drawn at random).
    Separately, the first refusal of any answer names the best block size for that depth ("…
    checkpointing blocks of 2 consecutive layers 4.3") and its hint ends "choose k from L to make
    L/k + k smallest": the "choose" half of this debug-then-choose exercise is given away."""
    depth = weights.shape[0]
    size = {4: 2, 9: 3, 25: 5}.get(depth, depth)

    @jax.checkpoint
    def block(h, ws):
        for w in ws:
            h = _layer(h, w)
        return h

    h = x
    for i in range(0, depth, size):
        h = block(h, weights[i : i + size])
    return jnp.mean(h**2)


# ------------------------------------------------------------------------------------------------
# 07 · exercise 3 · check_train_loop(train_loop)
# ------------------------------------------------------------------------------------------------
def train_loop_reads_loss_early(step, state, make_batch, n_steps, log):
    """WRONG, ACCEPTED by check_train_loop: reads step i's loss (``np.asarray``) after making batch
    i+1 but BEFORE dispatching step i+1, so the host waits for step i and step i+1 is never queued
    while step i runs: the devices idle during log() and the dispatch at every step
    (``probe_queued_steps``: 0 of 7 steps queued, against 7 of 7 for the reference). The exercise
    text says the checker requires "that no loss is read before the next step is on its way"; it
    only watches when log() is called, not when the loss is read. Hand the loop loss objects whose
    read is recorded (or check, at each dispatch, whether the previous step was still running)."""
    batch, pending = make_batch(0), None
    for i in range(n_steps):
        state, metrics = step(state, batch)
        if i + 1 < n_steps:
            batch = make_batch(i + 1)
        value = np.asarray(metrics["loss"])  # waits for step i, before step i+1 is dispatched
        if pending is not None:
            log(i - 1, pending)
        pending = value
    log(n_steps - 1, pending)
    return state


def train_loop_syncs_state(step, state, make_batch, n_steps, log):
    """WRONG, ACCEPTED by check_train_loop: copies the state to the host after every step (a
    "checkpoint every step"), which waits for the step before the next is dispatched — the same
    bubble as above (0 of 7 steps queued). The checker measures only the batch-making overlap and
    when log() runs; it should measure whether each step was dispatched before the previous one
    ended, as the notebook's own section 10 does."""
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
    """WRONG by the exercise's own words, ACCEPTED by check_train_loop: overlaps batch-making, keeps
    every loss and logs them all after the loop. The text asks that the host "makes batches and logs
    **while the devices compute**"; this logs nothing until training ends (no progress, no early
    stop on a diverging loss). The checker should require log(i) before step i+2 (or i+k) starts."""
    batch, losses = make_batch(0), []
    for i in range(n_steps):
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
        if i + 1 < n_steps:
            batch = make_batch(i + 1)
    for i, loss in enumerate(losses):
        log(i, loss)
    return state


# ------------------------------------------------------------------------------------------------
# 09 · exercise 1 · check_process_rows(predictions, ex_devices, ex_proc, global_batch)
# ------------------------------------------------------------------------------------------------
# WEAK: on the notebook's plan (2 processes x 4 devices, data x model = 4 x 2, batch 16) layout "b"
# holds exactly the rows of layout "a" ([(0, 8), (8, 16)] both), so a learner who thinks the model
# axis never matters is right on "b" by accident; only "c" separates the two mental models. The
# check should also judge a group where "b" differs from "a" (e.g. 8 processes x 1 device, or a
# mesh with model = 4). A blind coordinate search solves it in 537 calls (brute_force_rows).
PROCESS_ROWS_MODEL_BLIND = {"a": [(0, 8), (8, 16)], "b": [(0, 8), (8, 16)], "c": [(0, 16), (0, 16)]}


# ------------------------------------------------------------------------------------------------
# 09 · exercise 2 · check_mesh_devices(mesh_devices)
# ------------------------------------------------------------------------------------------------
def mesh_devices_first_appearance(devices, n_data, n_model):
    """WRONG, ACCEPTED by check_mesh_devices: orders the processes by where their first device
    appears in the list, not by process index. Every device list the checker hands in starts with a
    process-0 device ([0, 1, 0, 1, …], [0, 1, 2, 3, 0, …], [0, 0, 0, 0]), so this equals "process 0's
    rows first" there; given a list that starts with process 1 it puts process 1's rows first. Hand
    in at least one list that starts with another process."""
    seen = []
    for d in devices:
        if d.process_index not in seen:
            seen.append(d.process_index)
    ordered = sorted(devices, key=lambda d: (seen.index(d.process_index), d.id))
    return np.array(ordered, dtype=object).reshape(n_data, n_model)


def mesh_devices_hybrid(devices, n_data, n_model):
    """RIGHT in intent, REFUSED by check_mesh_devices — and the checker's own success message
    recommends it: "JAX's mesh_utils.create_hybrid_device_mesh(..., process_is_granule=True) builds
    such meshes". Called on the devices as given it keeps their order inside each process, so the
    checker's shuffled lists fail "inside a process the devices are not in id order"; sorted by id
    first it passes. The message should say "on the devices sorted by id" (or not name it)."""
    from jax.experimental import mesh_utils

    n_proc = len({d.process_index for d in devices})
    return mesh_utils.create_hybrid_device_mesh(
        (n_data // n_proc, n_model), (n_proc, 1), devices=devices, process_is_granule=True
    )


# ------------------------------------------------------------------------------------------------
# 09 · exercise 3 · check_block_loader(load_global_batch, devices)
# ------------------------------------------------------------------------------------------------
def load_global_batch_bounding_box(source, sharding, global_shape):
    """WRONG, ACCEPTED by check_block_loader: one read of the bounding box of this process's blocks.
    On every layout the checker simulates, a process's blocks are contiguous, so the box is exactly
    its elements. When they are not — interleaved device ids, the case 09 exercise 2's own check
    uses, make P('data') give process 0 the rows of data indices 0, 2, 4, 6 — the box reads the
    rows in between, which only the other process holds (``demo_bounding_box_over_read``). The
    exercise allows "one larger read … if it covers exactly those elements"; the checker should
    include a layout where a process's blocks are not contiguous."""
    index_map = sharding.addressable_devices_indices_map(global_shape)
    dims = range(len(global_shape))
    lo = [min(idx[k].indices(global_shape[k])[0] for idx in index_map.values()) for k in dims]
    hi = [max(idx[k].indices(global_shape[k])[1] for idx in index_map.values()) for k in dims]
    box = np.asarray(source[tuple(slice(a, b) for a, b in zip(lo, hi))])
    per_device = []
    for device, idx in index_map.items():
        local = tuple(
            slice(s.indices(n)[0] - a, s.indices(n)[1] - a)
            for s, a, n in zip(idx, lo, global_shape)
        )
        per_device.append(jax.device_put(box[local], device))
    return jax.make_array_from_single_device_arrays(global_shape, sharding, per_device)


def load_global_batch_fill_and_put(source, sharding, global_shape):
    """WRONG, ACCEPTED by check_block_loader: reads each of this process's blocks once into a host
    array of the WHOLE global shape (zeros elsewhere), then ``jax.device_put``s it. The exercise asks
    to assemble with ``jax.make_array_from_single_device_arrays``; this allocates the global batch
    on every host (what a per-process loader exists to avoid) and relies on device_put of a
    non-addressable sharding taking only each process's part of a host array that differs between
    processes. The checker should require the assembly it names (e.g. refuse any array the answer
    did not assemble from per-device arrays of the blocks' shapes), or bound host allocation."""
    index_map = sharding.addressable_devices_indices_map(global_shape)
    full, done = np.zeros(global_shape, source.dtype), set()
    for idx in index_map.values():
        if str(idx) not in done:
            full[idx] = source[idx]
            done.add(str(idx))
    return jax.device_put(full, sharding)


# ------------------------------------------------------------------------------------------------
# Demonstrations
# ------------------------------------------------------------------------------------------------
def probe_queued_steps(train_loop, n_steps=8):
    """How many steps a loop dispatches while the previous step still runs, with a slow device step,
    a slow batch and a slow log (wall clock; a gap of 0 of n-1 means every step waited)."""
    mix = jax.random.normal(jax.random.key(0), (256, 256)) / 16

    @jax.jit
    def device_step(state, batch):
        h = lax.fori_loop(0, 300, lambda i, h: jnp.tanh(h @ mix), state + batch)
        return h, {"loss": h.sum()}

    last, queued = {"loss": None}, []

    def step(state, batch):
        if last["loss"] is not None:
            queued.append(not last["loss"].is_ready())
        state, metrics = device_step(state, batch)
        last["loss"] = metrics["loss"]
        return state, metrics

    def make_batch(i):
        time.sleep(0.01)
        return jnp.full((256, 256), i * 1e-3)

    def log(i, loss):
        float(loss)
        time.sleep(0.005)

    zeros = jnp.zeros((256, 256))
    device_step(zeros, zeros)[0].block_until_ready()
    train_loop(step, zeros, make_batch, n_steps, log)
    return sum(queued), len(queued)


def demo_bounding_box_over_read():
    """Process 0 of an interleaved 2-process group (device id even -> process 0) on P('data') over
    8 devices: which rows it holds, and which the bounding-box loader reads."""

    class Recorder:
        def __init__(self, array):
            self.array, self.reads, self.dtype = array, [], array.dtype

        def __getitem__(self, index):
            self.reads.append(index)
            return self.array[index]

    class ProcessView:  # the sharding as process 0 sees it: only its devices are addressable
        def __init__(self, sharding, pid):
            self.sharding, self.pid = sharding, pid

        def addressable_devices_indices_map(self, shape):
            items = self.sharding.devices_indices_map(shape).items()
            return {d: i for d, i in items if d.id % 2 == self.pid}

    devices = sorted(jax.devices(), key=lambda d: d.id)
    mesh = jax.sharding.Mesh(np.array(devices), (DATA,))
    view = ProcessView(NamedSharding(mesh, P(DATA)), pid=0)
    shape = (16, 4)
    source = Recorder(np.arange(64, dtype=np.float32).reshape(shape))
    held = sorted(
        {r for i in view.addressable_devices_indices_map(shape).values() for r in range(16)[i[0]]}
    )
    with contextlib.suppress(Exception):  # assembling needs all 8 devices in one process: not here
        load_global_batch_bounding_box(source, view, shape)
    read = sorted({r for i in source.reads for r in range(16)[i[0]]})
    print(f"  process 0 holds rows {held}")
    print(f"  the bounding-box loader reads rows {read}")
    print(f"  rows read that only process 1 holds: {sorted(set(read) - set(held))}")
    return set(read) - set(held)


def demo_own_mesh():
    """train_own_mesh given a mesh over 4 of the 8 devices: where the batch and the state end up."""
    sub_mesh = jax.make_mesh((4,), (DATA,), devices=jax.devices()[:4])

    def step(state, batch, lr):
        x, y = batch
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(state)
        return state - lr * g, loss

    x, y = np.ones((16, 3), np.float32), np.ones((16, 2), np.float32)
    state, _ = train_own_mesh(step, np.zeros((3, 2), np.float32), [(x, y)], sub_mesh, lambda i: 0.1)
    print(f"  mesh given: {len(sub_mesh.devices.flat)} devices; state on {len(state.devices())}")
    return len(state.devices())


def _count_wrong(check, answer):
    """The number of wrong cases a predict checker reports (0 when it accepts)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return 0 if check(answer) else None
    except Exception as e:  # noqa: BLE001 - the checker's ExerciseError
        found = re.search(r"(\d+) of (your|the)", str(e))
        return int(found.group(1)) if found else None


def _coordinate_search(check, start, options):
    """Change one entry at a time, keep a change when the count of wrong entries drops."""
    guess, calls = dict(start), 0
    best = _count_wrong(check, guess)
    for key, values in options.items():
        for value in values:
            calls += 1
            count = _count_wrong(check, {**guess, key: value})
            if count is not None and count < best:
                best, guess = count, {**guess, key: value}
                break
    return guess, best, calls


def brute_force_collectives():
    """05 exercise 1 solved without reading the programs: 16 spellings per entry."""
    from course_tools.checks import lesson05

    ops = ["all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"]
    axes = ["data", "model", "data and model"]
    spellings = ["none"] + [f"{op} over {ax}" for op in ops for ax in axes]
    check = partial(lambda p, devs: lesson05.check_collective_predictions(p, devs), devs=_devices())
    start = {k: "none" for k in "abcdef"}
    return _coordinate_search(check, start, {k: spellings for k in "abcdef"})


def brute_force_memory():
    """07 exercise 1 solved blind: each of the twelve numbers tried from 0 to 3."""
    from course_tools.checks import lesson07

    keys = [(), (0,), (0, 2), (0, 1, 2)]
    guess, calls = {k: [0, 0, 0] for k in keys}, 0

    def as_answer(g):
        return {k: tuple(v) for k, v in g.items()}

    check = lambda answer: lesson07.check_memory_prediction(lambda: answer)
    best = _count_wrong(check, as_answer(guess))
    for k, pos, val in itertools.product(keys, range(3), range(4)):
        trial = {kk: list(vv) for kk, vv in guess.items()}
        trial[k][pos] = val
        calls += 1
        count = _count_wrong(check, as_answer(trial))
        if count is not None and count < best:
            best, guess = count, trial
    return as_answer(guess), best, calls


def brute_force_rows():
    """09 exercise 1 solved blind: every list of (start, stop) pairs, one entry at a time."""
    from course_lib import distributed
    from course_tools.checks import lesson09

    n_proc = distributed.plan(8, 2, fallback=True)[0]
    ex_devices, ex_proc = lesson09.exercise_group(_devices(), n_proc)
    batch = 2 * len(ex_devices)
    pairs = [(s, e) for s, e in itertools.product(range(0, batch + 1, 2), repeat=2) if s < e]
    lists = [list(c) for c in itertools.product(pairs, repeat=ex_proc)]
    check = lambda p: lesson09.check_process_rows(p, ex_devices, ex_proc, batch)
    return _coordinate_search(check, {k: lists[0] for k in "abc"}, {k: lists for k in "abc"})


# ------------------------------------------------------------------------------------------------
# The cases, called as the check cells call them
# ------------------------------------------------------------------------------------------------
def _devices():
    return list(jax.devices())


def _cases():
    from course_lib import distributed
    from course_tools.checks import lesson05, lesson06, lesson07, lesson09

    devs = _devices()
    n_proc = distributed.plan(len(devs), 2, fallback=True)[0]
    ex_devices, ex_proc = lesson09.exercise_group(devs, n_proc)
    rows = lambda p: lesson09.check_process_rows(p, ex_devices, ex_proc, 2 * len(ex_devices))
    # (name, call, what the checker should do: "refuse" a wrong answer / "accept" a right one)
    return [
        ("05-1 hedged 'none; all-reduce'", lambda: lesson05.check_collective_predictions(
            PREDICT_05_HEDGED, devs), "refuse"),
        ("05-2 own mesh", lambda: lesson05.check_data_parallel_loop(train_own_mesh, devs),
         "refuse"),
        ("05-2 in_shardings + NumPy (message)", lambda: lesson05.check_data_parallel_loop(
            train_in_shardings_numpy, devs), "refuse"),
        ("05-3 lr ignored", lambda: lesson05.check_fsdp_tp_step(fsdp_tp_step_lr_ignored, devs),
         "refuse"),
        ("05-3 shard_map form", lambda: lesson05.check_fsdp_tp_step(fsdp_tp_step_shard_map, devs),
         "accept"),
        ("06-2 bf16 ring (hint)", lambda: lesson06.check_ring_all_reduce(ring_all_reduce_bf16),
         "refuse"),
        ("06-3 gathered logits (message)", lambda: lesson06.check_tp_cross_entropy(
            tp_cross_entropy_gathered, devs), "refuse"),
        ("06-4 bf16 halos (hint)", lambda: lesson06.check_halo_stencil(halo_stencil_bf16, devs),
         "refuse"),
        ("07-1 wrong alias (hint)", lambda: lesson07.check_memory_prediction(
            predict_memory_wrong_alias), "refuse"),
        ("07-2 checker's depths only", lambda: lesson07.check_remat_loss(
            remat_loss_checker_depths_only), "refuse"),
        ("07-3 loss read early", lambda: lesson07.check_train_loop(train_loop_reads_loss_early),
         "refuse"),
        ("07-3 state synced", lambda: lesson07.check_train_loop(train_loop_syncs_state),
         "refuse"),
        ("07-3 logs at end", lambda: lesson07.check_train_loop(train_loop_logs_at_end), "refuse"),
        ("09-1 model-blind b (weak)", lambda: rows(PROCESS_ROWS_MODEL_BLIND), "accept"),
        ("09-2 first appearance", lambda: lesson09.check_mesh_devices(
            mesh_devices_first_appearance), "refuse"),
        ("09-2 create_hybrid_device_mesh", lambda: lesson09.check_mesh_devices(
            mesh_devices_hybrid), "accept"),
        ("09-3 bounding box", lambda: lesson09.check_block_loader(
            load_global_batch_bounding_box, devs), "refuse"),
        ("09-3 fill and device_put", lambda: lesson09.check_block_loader(
            load_global_batch_fill_and_put, devs), "refuse"),
    ]  # fmt: skip


# Cases whose verdict is right: the defect is the message (MSG) or that the case does not discriminate.
NOTES = {"(message)": "MSG", "(hint)": "MSG", "(weak)": "WEAK"}


def _verdict(call):
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            ok = call()
        return ("accept" if ok else "refuse"), out.getvalue().strip()
    except Exception as e:  # noqa: BLE001 - the checker's ExerciseError
        return "refuse", str(e).strip()


def main(only=""):
    for name, call, should in _cases():
        if only not in name:
            continue
        got, message = _verdict(call)
        flag = "ok" if got == should else ("FOOLED" if should == "refuse" else "REFUSED")
        if flag == "ok":  # the verdict is right; the defect is in the message, or the case is weak
            flag = next((tag for key, tag in NOTES.items() if key in name), flag)
        print(f"[{flag:7s}] {name}: checker {got}s, should {should}")
        print("    " + message.replace("\n", "\n    ")[:600])
        sys.stdout.flush()
    if only:
        return
    print("\n07-3 steps dispatched while the previous one still ran (queued / steps):")
    for loop in (train_loop_reads_loss_early, train_loop_syncs_state):
        print(f"  {loop.__name__}: {probe_queued_steps(loop)}")
    print("\n09-3 bounding box on an interleaved group:")
    demo_bounding_box_over_read()
    print("\n05-2 own mesh on a mesh of 4 devices:")
    demo_own_mesh()
    for solve in (brute_force_collectives, brute_force_memory, brute_force_rows):
        answer, wrong, calls = solve()
        print(f"\n{solve.__name__}: {wrong} wrong after {calls} calls: {answer}")


if __name__ == "__main__":
    setup_devices(8, "cpu")  # before the first JAX operation
    main(sys.argv[1] if len(sys.argv) > 1 else "")

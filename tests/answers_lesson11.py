"""Answers to the exercises of lesson 11, right and wrong, for tests/test_checks_lesson11.py."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from course_lib import moe

# ---- exercise 1: GPipe ------------------------------------------------------------------------------------


def gpipe_forward(stage_fn, stage_params, xs, axis_name):
    """The reference (the notebook's solution): a Python loop over the m + p - 1 ticks."""
    p = lax.axis_size(axis_name)
    s = lax.axis_index(axis_name)
    m = xs.shape[0]
    to_next = [(i, i + 1) for i in range(p - 1)]
    arrived = jnp.zeros_like(xs[0])
    ys = jnp.zeros_like(xs)
    for t in range(m + p - 1):
        x = jnp.where(s == 0, xs[min(t, m - 1)], arrived)
        y = stage_fn(x, stage_params)
        i = t - (p - 1)
        if i >= 0:
            ys = ys.at[i].set(jnp.where(s == p - 1, y, ys[i]))
        arrived = lax.ppermute(y, axis_name, to_next)
    return ys


def gpipe_tagged(stage_fn, stage_params, xs, axis_name):
    """Right: the reference that also sends each tick's micro-batch id (an int32 scalar) with the
    activation: 4 bytes of metadata per tick."""
    p = lax.axis_size(axis_name)
    s = lax.axis_index(axis_name)
    m = xs.shape[0]
    to_next = [(i, i + 1) for i in range(p - 1)]
    arrived, tag = jnp.zeros_like(xs[0]), jnp.int32(-1)
    ys = jnp.zeros_like(xs)
    for t in range(m + p - 1):
        x = jnp.where(s == 0, xs[min(t, m - 1)], arrived)
        mb = jnp.where(s == 0, jnp.int32(t), tag)
        y = stage_fn(x, stage_params)
        i = t - (p - 1)
        if i >= 0:
            ys = ys.at[i].set(jnp.where((s == p - 1) & (mb == i), y, ys[i]))
        arrived, tag = lax.ppermute((y, mb), axis_name, to_next)
    return ys


def gpipe_library(stage_fn, stage_params, xs, axis_name):
    """Bypasses the exercise: runs course_lib.pipeline's executor on the GPipe table."""
    from course_lib import pipeline, schedules

    sched = schedules.gpipe(lax.axis_size(axis_name), xs.shape[0])
    ys, _ = pipeline.forward(
        stage_fn, jax.tree.map(lambda a: a[None], stage_params), xs, sched, axis_name
    )
    return ys


def gpipe_rows_of_two(stage_fn, stage_params, xs, axis_name):
    """Wrong beyond 2 stages: the last stage writes micro-batch i's output at tick i + min(p - 1, 1), right
    on 1 and 2 stages only (values compared on 2 devices once accepted it)."""
    n_stages, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    n_mb = xs.shape[0]
    arrived, ys = jnp.zeros_like(xs[0]), jnp.zeros_like(xs)
    for t in range(n_mb + n_stages - 1):
        y = stage_fn(jnp.where(me == 0, xs[min(t, n_mb - 1)], arrived), stage_params)
        done = t - min(n_stages - 1, 1)
        if 0 <= done < n_mb:
            ys = ys.at[done].set(jnp.where(me == n_stages - 1, y, ys[done]))
        arrived = jax.lax.ppermute(y, axis_name, [(i, i + 1) for i in range(n_stages - 1)])
    return ys


def gpipe_scan(stage_fn, stage_params, xs, axis_name):
    """Another correct form: lax.scan over the ticks, a zero micro-batch padded for the drain."""
    p = lax.axis_size(axis_name)
    s = lax.axis_index(axis_name)
    feed = jnp.concatenate([xs, jnp.zeros((p - 1, *xs.shape[1:]), xs.dtype)])

    def tick(arrived, x_new):
        y = stage_fn(jnp.where(s == 0, x_new, arrived), stage_params)
        return lax.ppermute(y, axis_name, [(i, i + 1) for i in range(p - 1)]), y

    start = lax.pcast(jnp.zeros_like(xs[0]), axis_name, to="varying")
    _, outs = lax.scan(tick, start, feed)
    return outs[p - 1 :]  # the last stage's outputs from tick p - 1 on (the others return junk)


def gpipe_scan_invariant_carry(stage_fn, stage_params, xs, axis_name):
    """Wrong (does not trace): gpipe_scan with its carry started from zeros that are the same on every
    stage, while the tick returns a carry that varies over the stage axis."""
    p = lax.axis_size(axis_name)
    s = lax.axis_index(axis_name)
    feed = jnp.concatenate([xs, jnp.zeros((p - 1, *xs.shape[1:]), xs.dtype)])

    def tick(arrived, x_new):
        y = stage_fn(jnp.where(s == 0, x_new, arrived), stage_params)
        return lax.ppermute(y, axis_name, [(i, i + 1) for i in range(p - 1)]), y

    _, outs = lax.scan(tick, jnp.zeros_like(xs[0]), feed)
    return outs[p - 1 :]


def gpipe_no_send(stage_fn, stage_params, xs, axis_name):
    """Wrong: each stage applies its layers to the inputs themselves."""
    return jax.vmap(lambda x: stage_fn(x, stage_params))(xs)


def gpipe_reversed(stage_fn, stage_params, xs, axis_name):
    """Wrong: the outputs are written in the opposite order."""
    return gpipe_forward(stage_fn, stage_params, xs, axis_name)[::-1]


def gpipe_late_read(stage_fn, stage_params, xs, axis_name):
    """Wrong: the last stage writes micro-batch t - p at tick t (one tick late)."""
    p = lax.axis_size(axis_name)
    s = lax.axis_index(axis_name)
    m = xs.shape[0]
    arrived = jnp.zeros_like(xs[0])
    ys = jnp.zeros_like(xs)
    for t in range(m + p - 1):
        y = stage_fn(jnp.where(s == 0, xs[min(t, m - 1)], arrived), stage_params)
        i = t - p
        if 0 <= i < m:
            ys = ys.at[i].set(jnp.where(s == p - 1, y, ys[i]))
        arrived = lax.ppermute(y, axis_name, [(j, j + 1) for j in range(p - 1)])
    return ys


def gpipe_sequential(stage_fn, stage_params, xs, axis_name):
    """Right values, no overlap: each micro-batch goes through all p stages before the next enters."""
    p = lax.axis_size(axis_name)
    s = lax.axis_index(axis_name)
    ys = jnp.zeros_like(xs)
    for i in range(xs.shape[0]):
        h = xs[i]
        for _ in range(p):
            y = stage_fn(h, stage_params)
            h = jnp.where(
                s == 0, xs[i], lax.ppermute(y, axis_name, [(j, j + 1) for j in range(p - 1)])
            )
        ys = ys.at[i].set(y)
    return ys


def gpipe_twice(stage_fn, stage_params, xs, axis_name):
    """Right values, double work: the stage runs on the new input and on what arrived, then chooses."""
    p = lax.axis_size(axis_name)
    s = lax.axis_index(axis_name)
    m = xs.shape[0]
    arrived = jnp.zeros_like(xs[0])
    ys = jnp.zeros_like(xs)
    for t in range(m + p - 1):
        y = jnp.where(
            s == 0, stage_fn(xs[min(t, m - 1)], stage_params), stage_fn(arrived, stage_params)
        )
        if t >= p - 1:
            ys = ys.at[t - p + 1].set(y)
        arrived = lax.ppermute(y, axis_name, [(j, j + 1) for j in range(p - 1)])
    return ys


def gpipe_send_buffer(stage_fn, stage_params, xs, axis_name):
    """Right values, too many bytes: every tick also passes the whole buffer of outputs along."""
    p = lax.axis_size(axis_name)
    s = lax.axis_index(axis_name)
    m = xs.shape[0]
    to_next = [(i, i + 1) for i in range(p - 1)]
    arrived = jnp.zeros_like(xs[0])
    ys = jnp.zeros_like(xs)
    for t in range(m + p - 1):
        y = stage_fn(jnp.where(s == 0, xs[min(t, m - 1)], arrived), stage_params)
        if t >= p - 1:
            ys = ys.at[t - p + 1].set(jnp.where(s == p - 1, y, ys[t - p + 1]))
        arrived = lax.ppermute(y, axis_name, to_next)
        ys = jnp.where(s == p - 1, ys, lax.ppermute(ys, axis_name, to_next))
    return ys


def gpipe_backwards(stage_fn, stage_params, xs, axis_name):
    """Wrong: activations are sent to the previous stage."""
    p = lax.axis_size(axis_name)
    s = lax.axis_index(axis_name)
    m = xs.shape[0]
    arrived = jnp.zeros_like(xs[0])
    ys = jnp.zeros_like(xs)
    for t in range(m + p - 1):
        y = stage_fn(jnp.where(s == 0, xs[min(t, m - 1)], arrived), stage_params)
        if t >= p - 1:
            ys = ys.at[t - p + 1].set(y)
        arrived = lax.ppermute(y, axis_name, [(j + 1, j) for j in range(p - 1)])
    return ys


def _gpipe_sending(stage_fn, stage_params, xs, axis_name, pairs, feed=lambda t, m: min(t, m - 1)):
    """The reference's loop with other ppermute pairs (``pairs(p)``) or another feed of micro-batches."""
    p = lax.axis_size(axis_name)
    s = lax.axis_index(axis_name)
    m = xs.shape[0]
    arrived, ys = jnp.zeros_like(xs[0]), jnp.zeros_like(xs)
    for t in range(m + p - 1):
        y = stage_fn(jnp.where(s == 0, xs[feed(t, m)], arrived), stage_params)
        if t >= p - 1:
            ys = ys.at[t - (p - 1)].set(jnp.where(s == p - 1, y, ys[t - (p - 1)]))
        arrived = lax.ppermute(y, axis_name, pairs(p))
    return ys


def gpipe_ring(stage_fn, stage_params, xs, axis_name):
    """Wrong (right values): a ring, the last stage also sends its output to stage 0, which ignores it."""
    ring = lambda p: [(i, (i + 1) % p) for i in range(p)]  # noqa: E731
    return _gpipe_sending(stage_fn, stage_params, xs, axis_name, ring)


def gpipe_backward_ring(stage_fn, stage_params, xs, axis_name):
    """Wrong: a ring the other way, each stage sends to the previous one (and stage 0 to the last)."""
    back = lambda p: [(i, (i - 1) % p) for i in range(p)]  # noqa: E731
    return _gpipe_sending(stage_fn, stage_params, xs, axis_name, back)


def gpipe_short_chain(stage_fn, stage_params, xs, axis_name):
    """Wrong: the pairs stop one stage short, the next-to-last stage never sends to the last."""
    short = lambda p: [(i, i + 1) for i in range(p - 2)]  # noqa: E731
    return _gpipe_sending(stage_fn, stage_params, xs, axis_name, short)


def gpipe_feed_reversed(stage_fn, stage_params, xs, axis_name):
    """Wrong: stage 0 starts the micro-batches last first, and the outputs are written by tick."""
    forward = lambda p: [(i, i + 1) for i in range(p - 1)]  # noqa: E731
    feed = lambda t, m: max(m - 1 - t, 0)  # noqa: E731
    return _gpipe_sending(stage_fn, stage_params, xs, axis_name, forward, feed)


def gpipe_feed_skips(stage_fn, stage_params, xs, axis_name):
    """Wrong: stage 0 starts micro-batch t + 1 at tick t (micro-batch 0 never runs)."""
    forward = lambda p: [(i, i + 1) for i in range(p - 1)]  # noqa: E731
    feed = lambda t, m: min(t + 1, m - 1)  # noqa: E731
    return _gpipe_sending(stage_fn, stage_params, xs, axis_name, forward, feed)


def gpipe_no_drain(stage_fn, stage_params, xs, axis_name):
    """Wrong: m ticks, no drain (right on one stage only: the last p - 1 micro-batches never finish)."""
    p = lax.axis_size(axis_name)
    s = lax.axis_index(axis_name)
    m = xs.shape[0]
    arrived, ys = jnp.zeros_like(xs[0]), jnp.zeros_like(xs)
    for t in range(m):
        y = stage_fn(jnp.where(s == 0, xs[t], arrived), stage_params)
        if t >= p - 1:
            ys = ys.at[t - (p - 1)].set(jnp.where(s == p - 1, y, ys[t - (p - 1)]))
        arrived = lax.ppermute(y, axis_name, [(j, j + 1) for j in range(p - 1)])
    return ys


def gpipe_broadcast(stage_fn, stage_params, xs, axis_name):
    """Wrong: right values, then an all-reduce hands the last stage's outputs to every stage."""
    p = lax.axis_size(axis_name)
    ys = gpipe_forward(stage_fn, stage_params, xs, axis_name)
    return lax.psum(jnp.where(lax.axis_index(axis_name) == p - 1, ys, 0), axis_name)


def gpipe_tick_more(stage_fn, stage_params, xs, axis_name):
    """Wrong: m + p ticks, one stage application each (the last tick's work fills no output)."""
    p = lax.axis_size(axis_name)
    s = lax.axis_index(axis_name)
    m = xs.shape[0]
    arrived, ys = jnp.zeros_like(xs[0]), jnp.zeros_like(xs)
    for t in range(m + p):
        y = stage_fn(jnp.where(s == 0, xs[min(t, m - 1)], arrived), stage_params)
        if 0 <= t - (p - 1) < m:
            ys = ys.at[t - (p - 1)].set(jnp.where(s == p - 1, y, ys[t - (p - 1)]))
        arrived = lax.ppermute(y, axis_name, [(j, j + 1) for j in range(p - 1)])
    return ys


def gpipe_bf16_send(stage_fn, stage_params, xs, axis_name):
    """Wrong: the activations travel in bfloat16 (half the bytes, three digits)."""
    p = lax.axis_size(axis_name)
    s = lax.axis_index(axis_name)
    m = xs.shape[0]
    arrived, ys = jnp.zeros_like(xs[0]), jnp.zeros_like(xs)
    for t in range(m + p - 1):
        y = stage_fn(jnp.where(s == 0, xs[min(t, m - 1)], arrived), stage_params)
        if t >= p - 1:
            ys = ys.at[t - (p - 1)].set(jnp.where(s == p - 1, y, ys[t - (p - 1)]))
        sent = lax.ppermute(y.astype(jnp.bfloat16), axis_name, [(j, j + 1) for j in range(p - 1)])
        arrived = sent.astype(y.dtype)
    return ys


def gpipe_halves(stage_fn, stage_params, xs, axis_name):
    """Another correct form: each activation sent as two halves (one activation's bytes per tick)."""
    p = lax.axis_size(axis_name)
    s = lax.axis_index(axis_name)
    m = xs.shape[0]
    pairs = [(j, j + 1) for j in range(p - 1)]
    arrived, ys = jnp.zeros_like(xs[0]), jnp.zeros_like(xs)
    for t in range(m + p - 1):
        y = stage_fn(jnp.where(s == 0, xs[min(t, m - 1)], arrived), stage_params)
        if t >= p - 1:
            ys = ys.at[t - (p - 1)].set(jnp.where(s == p - 1, y, ys[t - (p - 1)]))
        a, b = jnp.split(y.reshape(-1), 2)
        both = [lax.ppermute(a, axis_name, pairs), lax.ppermute(b, axis_name, pairs)]
        arrived = jnp.concatenate(both).reshape(y.shape)
    return ys


# ---- exercise 2: predict the bubble and the stash ---------------------------------------------------------


def predict(name, p, m, v):
    if name == "gpipe":
        return (p - 1) / (m + p - 1), [m] * p
    if name == "1f1b_lockstep":
        return (p - 1) / (m + p - 1), [min(m, 2 * (p - s) - 1) for s in range(p)]
    return (p - 1) / (v * m + p - 1), [v * m] * p


def predict_dict(name, p, m, v):
    bubble, stash = predict(name, p, m, v)
    return {"bubble": bubble, "stash": stash}


def predict_array(name, p, m, v):
    """Correct, another form: the stash an int array counted down from the last stage, the bubble from
    the ticks (idle lanes over all lanes)."""
    ticks = v * m + p - 1
    stash = np.full(p, v * m)
    if name == "1f1b_lockstep":
        stash = np.minimum(m, 1 + 2 * np.arange(p)[::-1])
    return 1 - v * m / ticks, stash


def predict_classic_1f1b(name, p, m, v):
    """Wrong for this executor: the asynchronous 1F1B's min(m, p - s) in flight on stage s."""
    bubble, stash = predict(name, p, m, v)
    return bubble, [min(m, p - s) for s in range(p)] if name == "1f1b_lockstep" else stash


def predict_max_everywhere(name, p, m, v):
    """Wrong: the lockstep 1F1B's peak, min(m, 2p - 1), on every stage (right on stage 0 only)."""
    bubble, stash = predict(name, p, m, v)
    return bubble, [stash[0]] * p


def predict_unclipped(name, p, m, v):
    """Wrong: the lockstep 1F1B's 2(p - s) - 1 not clipped by m (wrong where m < 2(p - s) - 1)."""
    bubble, stash = predict(name, p, m, v)
    return bubble, [2 * (p - s) - 1 for s in range(p)] if name == "1f1b_lockstep" else stash


def predict_off_by_one(name, p, m, v):
    """Wrong: min(m, 2(p - s)), the B's own tick counted twice."""
    bubble, stash = predict(name, p, m, v)
    return bubble, [min(m, 2 * (p - s)) for s in range(p)] if name == "1f1b_lockstep" else stash


def predict_scalar_stash(name, p, m, v):
    """Wrong form: one stash for the whole pipeline, not one per stage."""
    bubble, stash = predict(name, p, m, v)
    return bubble, max(stash)


def predict_circular_like_gpipe(name, p, m, v):
    """Wrong: every schedule is GPipe (1F1B's stash and interleaving change nothing)."""
    return predict("gpipe", p, m, 1)


def predict_circular_stash_vp(name, p, m, v):
    """Circular's stash v·p: right only where m = p (red team, once accepted on 2 % of the draws)."""
    return (
        predict(name, p, m, v) if name != "circular" else (predict(name, p, m, v)[0], [v * p] * p)
    )


def predict_bubble_over_m(name, p, m, v):
    """Wrong: (p-1)/m, the bubble against the useful time."""
    _, stash = predict(name, p, m, v)
    return (p - 1) / (v * m if name == "circular" else m), stash


def predict_reads_tables(name, p, m, v):
    """Wrong (no prediction): builds the library's table and reads it."""
    from course_lib import schedules

    sched = schedules.make(name, p, m, v)
    return schedules.bubble_fraction(sched), sched.in_flight().tolist()


def predict_closed_forms(name, p, m, v):
    """Wrong (no prediction): the library's closed forms of section 5b (op_schedules.predicted_bubble and
    predicted_in_flight), 1F1B's lockstep stash by hand."""
    from course_lib import op_schedules

    if name == "circular":
        return (
            op_schedules.predicted_bubble("interleaved", p, m, v),
            op_schedules.predicted_in_flight("breadth_first", p, m, v),
        )
    bubble = op_schedules.predicted_bubble("gpipe", p, m)
    if name == "gpipe":
        return bubble, op_schedules.predicted_in_flight("gpipe", p, m)
    return bubble, [min(m, 2 * (p - 1 - s) + 1) for s in range(p)]


def predict_reads_tables_unhooked(name, p, m, v):
    """Wrong (no prediction): switches off the checker's profile hook, then reads the library's table."""
    import sys

    from course_lib import schedules

    sys.setprofile(None)
    sched = schedules.make(name, p, m, v)
    return schedules.bubble_fraction(sched), sched.in_flight().tolist()


OLD_CASES = (  # the checker's cases when they were a public constant
    ("gpipe", 4, 8, 1), ("gpipe", 2, 6, 1), ("gpipe", 8, 4, 1), ("gpipe", 1, 5, 1),
    ("1f1b_lockstep", 4, 8, 1), ("1f1b_lockstep", 4, 16, 1), ("1f1b_lockstep", 2, 3, 1),
    ("1f1b_lockstep", 8, 4, 1), ("1f1b_lockstep", 3, 10, 1),
    ("circular", 4, 8, 2), ("circular", 2, 6, 3), ("circular", 4, 4, 4),
)  # fmt: skip


def predict_table(name, p, m, v):
    """Wrong (no prediction): a table of the answers at the cases once checked, GPipe's formula elsewhere."""
    table = {
        ("1f1b_lockstep", 4, 8, 1): (3 / 11, [7, 5, 3, 1]),
        ("1f1b_lockstep", 4, 16, 1): (3 / 19, [7, 5, 3, 1]),
        ("1f1b_lockstep", 2, 3, 1): (1 / 4, [3, 1]),
        ("1f1b_lockstep", 8, 4, 1): (7 / 11, [4, 4, 4, 4, 4, 4, 3, 1]),
        ("1f1b_lockstep", 3, 10, 1): (2 / 12, [5, 3, 1]),
        ("circular", 4, 8, 2): (3 / 19, [16] * 4),
        ("circular", 2, 6, 3): (1 / 19, [18] * 2),
        ("circular", 4, 4, 4): (3 / 19, [16] * 4),
    }
    return table.get((name, p, m, v), ((p - 1) / (m + p - 1), [m] * p))


# ---- exercise 3: the router ---------------------------------------------------------------------------------


def route(logits, k, capacity):
    """The reference (the notebook's solution), written without moe.route: a cumulative count per expert,
    every first choice before any second choice."""
    top_p, expert = lax.top_k(jax.nn.softmax(logits, axis=-1), k)  # [N, k], largest first
    flat = jax.nn.one_hot(expert.T, logits.shape[1], dtype=jnp.int32).reshape(-1, logits.shape[1])
    before = jnp.cumsum(flat, axis=0) - flat  # entries before this one that chose the same expert
    place = (before * flat).sum(-1).reshape(k, -1).T  # [N, k], from 0
    return moe.Routing(expert, place, place < capacity, top_p / top_p.sum(-1, keepdims=True))


def route_library(logits, k, capacity):
    """Bypasses the exercise: calls the library's router, which the checker compares with."""
    return moe.route(logits, k, capacity)


def route_library_alias(logits, k, capacity):
    """Bypasses the exercise under another name, and swallows the error the stub raises."""
    f = moe.route
    try:
        return f(logits, k, capacity)
    except RuntimeError:
        return route(logits, k, capacity)


def route_tuple(logits, k, capacity):
    """Another correct form: a plain tuple, slots from a running count per expert with lax.scan."""
    n, e = logits.shape
    probs = jax.nn.softmax(logits, axis=-1)
    gate, expert = lax.top_k(probs, k)
    gate = gate / gate.sum(-1, keepdims=True)

    def place(counts, choice):  # choice: [N] experts of one choice rank, tokens in order
        def one(c, ex):
            return c.at[ex].add(1), c[ex]

        counts, slots = lax.scan(one, counts, choice)
        return counts, slots

    _, slots = lax.scan(place, jnp.zeros(e, jnp.int32), expert.T)
    slot = slots.T
    return expert, slot, slot < capacity, gate


def route_keep_int(logits, k, capacity):
    """Another correct form: keep as 0/1 integers (moe.dispatch's and combine's where and product take
    them)."""
    expert, slot, keep, gate = route(logits, k, capacity)
    return expert, slot, keep.astype(jnp.int32), gate


def route_keep_float(logits, k, capacity):
    """Another correct form: keep as 0.0/1.0 floats (the MoE layer only multiplies by it)."""
    expert, slot, keep, gate = route(logits, k, capacity)
    return expert, slot, keep.astype(jnp.float32), gate


def route_slot_float(logits, k, capacity):
    """Right values, but slot as float32: it cannot index the experts' buffers."""
    top_p, expert = lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    flat = jax.nn.one_hot(expert.T, logits.shape[1], dtype=jnp.int32).reshape(-1, logits.shape[1])
    before = jnp.cumsum(flat, axis=0) - flat
    place = (before * flat).sum(-1).reshape(k, -1).T
    return expert, place.astype(jnp.float32), place < capacity, top_p / top_p.sum(-1, keepdims=True)


def route_given(logits, k, capacity):
    """The notebook's silent bug: an inclusive cumulative count, so places start at 1."""
    n, e = logits.shape
    probs = jax.nn.softmax(logits, axis=-1)
    gate, expert = lax.top_k(probs, k)
    gate = gate / gate.sum(-1, keepdims=True)
    chosen = jax.nn.one_hot(expert, e, dtype=jnp.int32).transpose(1, 0, 2).reshape(k * n, e)
    slot = (jnp.cumsum(chosen, axis=0) * chosen).sum(-1).reshape(k, n).T
    return moe.Routing(expert, slot, slot < capacity, gate)


def route_token_major(logits, k, capacity):
    """Wrong priority: a token's second choice before the next token's first choice."""
    n, e = logits.shape
    probs = jax.nn.softmax(logits, axis=-1)
    gate, expert = lax.top_k(probs, k)
    gate = gate / gate.sum(-1, keepdims=True)
    chosen = jax.nn.one_hot(expert, e, dtype=jnp.int32).reshape(n * k, e)
    slot = ((jnp.cumsum(chosen, axis=0) - chosen) * chosen).sum(-1).reshape(n, k)
    return moe.Routing(expert, slot, slot < capacity, gate)


def route_raw_gates(logits, k, capacity):
    """Wrong: the gates are the router probabilities, not renormalised over the k choices."""
    r = route(logits, k, capacity)
    gate, _ = lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    return r._replace(gate=gate)


def route_keep_le(logits, k, capacity):
    """Wrong: a slot equal to the capacity is kept."""
    r = route(logits, k, capacity)
    return r._replace(keep=r.slot <= capacity)


def route_softmax_tokens(logits, k, capacity):
    """Wrong: the softmax over the tokens instead of the experts."""
    return route(jnp.log(jax.nn.softmax(logits, axis=0)), k, capacity)


def route_eight_experts(logits, k, capacity):
    """Wrong: the notebook's 8 experts baked into the one-hot count."""
    gate, expert = lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    flat = jax.nn.one_hot(expert.T, 8, dtype=jnp.int32).reshape(-1, 8)
    slot = ((jnp.cumsum(flat, axis=0) - flat) * flat).sum(-1).reshape(k, -1).T
    return expert, slot, slot < capacity, gate / gate.sum(-1, keepdims=True)


def route_per_choice(logits, k, capacity):
    """Wrong: a slot counter of its own for each choice (an expert's second choices start again at 0)."""
    n, e = logits.shape
    gate, expert = lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    chosen = jax.nn.one_hot(expert, e, dtype=jnp.int32)  # [N, k, E]
    slot = ((jnp.cumsum(chosen, axis=0) - chosen) * chosen).sum(
        -1
    )  # counted down the tokens, per choice
    return expert, slot, slot < capacity, gate / gate.sum(-1, keepdims=True)


def route_keep_all(logits, k, capacity):
    """Wrong: nothing is dropped (keep is all true)."""
    r = route(logits, k, capacity)
    return r._replace(keep=jnp.ones_like(r.keep))


def route_from_one_le(logits, k, capacity):
    """Wrong: places from 1, kept up to the capacity (the same choices kept, each a row too far)."""
    r = route(logits, k, capacity)
    return r._replace(slot=r.slot + 1)


# ---- exercise 4: the all_to_all exchange of experts beside data --------------------------------------------


def _routed(x, p, k, capacity_factor):
    e = p["router"]["kernel"].shape[1]
    cap = moe.capacity(x.shape[0], e, k, capacity_factor)
    r = moe.route(x @ p["router"]["kernel"], k, cap)
    return moe.dispatch(x, r, e, cap), r, e, cap


def moe_layer(x, p, axis_name, k, capacity_factor):
    """Right (the notebook's): split the experts, concatenate the places, and back."""
    buf, r, e, cap = _routed(x, p, k, capacity_factor)
    mine = lax.all_to_all(buf, axis_name, split_axis=0, concat_axis=1, tiled=True)
    back = lax.all_to_all(moe.experts(p, mine), axis_name, split_axis=1, concat_axis=0, tiled=True)
    return moe.combine(back, r)


def moe_layer_places_rolled(x, p, axis_name, k, capacity_factor):
    """Wrong on an expert axis of 4: the places of device j taken for device j + 2's (the same on an axis of
    2, so the 2 × 2 meshes of 4 devices once accepted it)."""
    buf, r, e, cap = _routed(x, p, k, capacity_factor)
    mine = lax.all_to_all(buf, axis_name, split_axis=0, concat_axis=1, tiled=True)
    mine = jnp.roll(mine, 2 * cap, axis=1)
    back = lax.all_to_all(moe.experts(p, mine), axis_name, split_axis=1, concat_axis=0, tiled=True)
    return moe.combine(back, r)


def moe_layer_transposed(x, p, axis_name, k, capacity_factor):
    """Right: split 0 / concat 0, then reshape and transpose the source device behind the experts."""
    buf, r, e, cap = _routed(x, p, k, capacity_factor)
    n = lax.axis_size(axis_name)
    got = lax.all_to_all(buf, axis_name, 0, 0, tiled=True).reshape(n, e // n, cap, -1)
    out = moe.experts(p, got.transpose(1, 0, 2, 3)).transpose(1, 0, 2, 3).reshape(e, cap, -1)
    return moe.combine(lax.all_to_all(out, axis_name, 0, 0, tiled=True), r)


def moe_layer_untiled(x, p, axis_name, k, capacity_factor):
    """Right: the untiled all_to_all on [n, E/n, C, D], the experts on [E/n, n, C, D]."""
    buf, r, e, cap = _routed(x, p, k, capacity_factor)
    n = lax.axis_size(axis_name)
    mine = lax.all_to_all(buf.reshape(n, e // n, cap, -1), axis_name, 0, 1)  # [E/n, n, C, D]
    back = lax.all_to_all(moe.experts(p, mine), axis_name, 1, 0)  # [n, E/n, C, D]
    return moe.combine(back.reshape(e, cap, -1), r)


def moe_layer_library(x, p, axis_name, k, capacity_factor):
    """Refused: the library's layer."""
    from course_lib import moe_layout

    return moe_layout.moe_mlp_ep_dp(
        x, p, expert_axis=axis_name, k=k, capacity_factor=capacity_factor
    )


def moe_layer_swapped(x, p, axis_name, k, capacity_factor):
    """Wrong: split_axis and concat_axis swapped on the way there."""
    buf, r, e, cap = _routed(x, p, k, capacity_factor)
    mine = lax.all_to_all(buf, axis_name, split_axis=1, concat_axis=0, tiled=True)
    back = lax.all_to_all(moe.experts(p, mine), axis_name, split_axis=1, concat_axis=0, tiled=True)
    return moe.combine(back, r)


def moe_layer_swapped_back(x, p, axis_name, k, capacity_factor):
    """Wrong: the way back repeats the way there (split 0, concat 1) instead of reversing it."""
    buf, r, e, cap = _routed(x, p, k, capacity_factor)
    mine = lax.all_to_all(buf, axis_name, split_axis=0, concat_axis=1, tiled=True)
    back = lax.all_to_all(moe.experts(p, mine), axis_name, split_axis=0, concat_axis=1, tiled=True)
    return moe.combine(back, r)


def moe_layer_no_transpose(x, p, axis_name, k, capacity_factor):
    """Wrong: split 0 / concat 0 and a reshape without the transpose (experts get other experts' rows)."""
    buf, r, e, cap = _routed(x, p, k, capacity_factor)
    n = lax.axis_size(axis_name)
    got = lax.all_to_all(buf, axis_name, 0, 0, tiled=True).reshape(e // n, n * cap, -1)
    out = moe.experts(p, got).reshape(e, cap, -1)
    return moe.combine(lax.all_to_all(out, axis_name, 0, 0, tiled=True), r)


def moe_layer_no_reshape_back(x, p, axis_name, k, capacity_factor):
    """Wrong: the untiled exchange, and the way back not reshaped to [E, C, D]."""
    buf, r, e, cap = _routed(x, p, k, capacity_factor)
    n = lax.axis_size(axis_name)
    mine = lax.all_to_all(buf.reshape(n, e // n, cap, -1), axis_name, 0, 1)
    return moe.combine(lax.all_to_all(moe.experts(p, mine), axis_name, 1, 0), r)


def moe_layer_named(x, p, axis_name, k, capacity_factor):
    """Wrong: the expert axis named in the code ("expert") instead of axis_name."""
    return moe_layer(x, p, "expert", k, capacity_factor)


def moe_layer_both_axes(x, p, axis_name, k, capacity_factor):
    """Wrong: the exchange over every axis of the mesh (the tokens' axes)."""
    buf, r, e, cap = _routed(x, p, k, capacity_factor)
    axes = jax.sharding.get_abstract_mesh().axis_names
    mine = lax.all_to_all(buf, axes, split_axis=0, concat_axis=1, tiled=True)
    back = lax.all_to_all(moe.experts(p, mine), axes, split_axis=1, concat_axis=0, tiled=True)
    return moe.combine(back, r)


def moe_layer_gather(x, p, axis_name, k, capacity_factor):
    """Wrong (sends n times the bytes): every buffer gathered, this device's experts picked, then a
    reduce-scatter back."""
    buf, r, e, cap = _routed(x, p, k, capacity_factor)
    n, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    every = lax.all_gather(buf, axis_name)  # [n, E, C, D]
    mine = lax.dynamic_slice_in_dim(every, me * (e // n), e // n, axis=1)  # [n, E/n, C, D]
    out = moe.experts(p, mine.transpose(1, 0, 2, 3))  # [E/n, n, C, D]
    full = jnp.zeros((e, n, cap, x.shape[-1]), x.dtype)
    full = lax.dynamic_update_slice_in_dim(full, out, me * (e // n), axis=0)
    back = lax.psum(full, axis_name)[:, lax.axis_index(axis_name)]
    return moe.combine(back, r)


def gpipe_axis_written_in(stage_fn, stage_params, xs, axis_name):
    """The reference over "stage", the notebook's axis, whatever ``axis_name`` is."""
    return gpipe_forward(stage_fn, stage_params, xs, "stage")


def gpipe_cond_skip(stage_fn, stage_params, xs, axis_name):
    """Right: a stage skips its work on bubble ticks with lax.cond (no collective in the branches, in the
    forward or in the gradient)."""
    p, s, m = lax.axis_size(axis_name), lax.axis_index(axis_name), xs.shape[0]
    to_next = [(i, i + 1) for i in range(p - 1)]
    arrived, ys = jnp.zeros_like(xs[0]), jnp.zeros_like(xs)
    for t in range(m + p - 1):
        x = jnp.where(s == 0, xs[min(t, m - 1)], arrived)
        busy = (t - s >= 0) & (t - s < m)
        y = lax.cond(busy, lambda x: stage_fn(x, stage_params), lambda x: x, x)
        if t >= p - 1:
            ys = ys.at[t - (p - 1)].set(jnp.where(s == p - 1, y, ys[t - (p - 1)]))
        arrived = lax.ppermute(y, axis_name, to_next)
    return ys


def gpipe_cond_input(stage_fn, stage_params, xs, axis_name):
    """Stage 0 runs on xs, the others on what arrived, chosen by lax.cond on the stage: the forward is
    right, but jax.grad puts the transpose of reading xs (replicated) in a branch, a psum_invariant that
    only stage 0 runs (XLA:CPU waits 40 s for the others, then aborts the process)."""
    p, s, m = lax.axis_size(axis_name), lax.axis_index(axis_name), xs.shape[0]
    to_next = [(i, i + 1) for i in range(p - 1)]
    arrived, ys = jnp.zeros_like(xs[0]), jnp.zeros_like(xs)
    for t in range(m + p - 1):
        x0 = xs[min(t, m - 1)]
        y = lax.cond(
            s == 0,
            lambda a, b: stage_fn(a, stage_params),
            lambda a, b: stage_fn(b, stage_params),
            x0,
            arrived,
        )
        if t >= p - 1:
            ys = ys.at[t - (p - 1)].set(jnp.where(s == p - 1, y, ys[t - (p - 1)]))
        arrived = lax.ppermute(y, axis_name, to_next)
    return ys

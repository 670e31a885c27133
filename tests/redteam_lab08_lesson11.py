"""Answers that the checkers of lab 08 and lesson 11 judge wrongly: input for fixing the checkers.

Not a pytest module: the name has no ``test_`` prefix, so pytest does not collect it. Each function below is one
learner's answer to one exercise, with a comment saying what is wrong with it (or why it is right) and which
checker it fools. ``DEFECTS`` lists them with the verdict a correct checker would give:

- ``"refuse"``: a wrong answer that the checker accepts;
- ``"accept"``: a right answer that the checker refuses, with a false message;
- ``"message"``: a wrong answer that the checker refuses, but for a reason that is not the answer's fault.

Run every answer through its checker, called as the notebook's check cell calls it, on 8 simulated CPU devices:

    .venv/bin/python tests/redteam_lab08_lesson11.py            # all of them
    .venv/bin/python tests/redteam_lab08_lesson11.py 11.2 08.1  # only the exercises whose id starts so
    .venv/bin/python tests/redteam_lab08_lesson11.py --checked  # the answers already judged right

It prints each verdict and message, and marks with ``DEFECT`` every case where the checker still gets it wrong;
a fixed checker turns a line into ``ok``. Verdicts were recorded on JAX 0.12.0.1, XLA:CPU, 8 simulated devices.
Exercise ids: 08.1 ``check_fsdp_prediction``, 08.2 ``check_zero1``, 11.1 ``check_gpipe``, 11.2
``check_predict_pipeline``, 11.3 ``check_router``.
"""

import sys
from functools import cache

# --------------------------------------------------------------------------------------------------------------
# 08.1 fsdp_sent_bytes / fsdp_state_bytes (lesson08.check_fsdp_prediction); answers are (sent_fn, state_fn)


def _sent(param_bytes, replicated_bytes, n):
    return 2 * (n - 1) / n * (param_bytes + 4)


def _state(param_bytes, replicated_bytes, n):
    return 2 * ((param_bytes - replicated_bytes) / n + replicated_bytes)


def fsdp_reference():
    return _sent, _state


def fsdp_lookup():
    # WRONG (no prediction), accepted? The notebook's `cases` table is built from lesson08.fsdp_case, which
    # returns the true `sent` and `state` of every case the checker tries; the measured row gives this run's.
    from course_tools.checks import lesson08

    table = {}
    for prof, k in lesson08.FSDP_CASES:
        c = lesson08.fsdp_case(prof, k)
        table[(c["param_bytes"], c["replicated_bytes"], k)] = c

    def sent(param_bytes, replicated_bytes, n):
        return table[(param_bytes, replicated_bytes, n)]["sent"]

    def state(param_bytes, replicated_bytes, n):
        return table[(param_bytes, replicated_bytes, n)]["state"]

    return sent, state


def fsdp_no_ring_factor():
    # WRONG: every device sends its whole parameters twice (no (n-1)/n).
    return (lambda P, R, n: 2 * P), _state


def fsdp_gather_only():
    # WRONG: the all-gather only, no reduce-scatter of the gradients.
    return (lambda P, R, n: (n - 1) / n * P), _state


def fsdp_sharded_only():
    # WRONG: forgets the all-reduce of the leaves kept whole.
    return (lambda P, R, n: 2 * (n - 1) / n * (P - R)), _state


def fsdp_replicated_once():
    # WRONG: the leaves kept whole all-reduced as if an all-reduce sent (n-1)/n S.
    return (lambda P, R, n: 2 * (n - 1) / n * (P - R) + (n - 1) / n * R), _state


def fsdp_state_params_only():
    # WRONG: forgets the momentum.
    return _sent, (lambda P, R, n: (P - R) / n + R)


def fsdp_state_all_sharded():
    # WRONG: everything 1/n, the leaves kept whole too.
    return _sent, (lambda P, R, n: 2 * P / n)


def fsdp_state_with_grads():
    # WRONG: counts the reduced gradients as state.
    return _sent, (lambda P, R, n: 3 * ((P - R) / n + R))


def fsdp_hard_coded_8():
    # WRONG: n = 8 baked in.
    return (lambda P, R, n: 2 * 7 / 8 * P), (lambda P, R, n: 2 * ((P - R) / 8 + R))


def fsdp_other_form():
    # RIGHT: per collective, numpy scalars; no loss term (within 2 %).
    import numpy as np

    def sent(P, R, n):
        ring = np.float32((n - 1) / n)
        return ring * (P - R) + ring * (P - R) + 2 * ring * R

    def state(P, R, n):
        return int(2 * (P - R) // n + 2 * R)

    return sent, state


def fsdp_jax_scalar():
    # RIGHT: jnp arithmetic, a 0-d jax.Array.
    import jax.numpy as jnp

    return (lambda P, R, n: jnp.float32(2 * (n - 1) / n) * P), (
        lambda P, R, n: jnp.asarray(2 * ((P - R) / n + R))
    )


# --------------------------------------------------------------------------------------------------------------
# 08.2 zero1_step (lesson08.check_zero1)


def _zero1(
    *,
    reduce="scatter",  # "scatter" | "allreduce" (pmean then slice)
    mean=True,
    replicated="pmean",  # "pmean" | "psum"
    opt_params="slices",  # "slices" | "grads" | "zeros"
    gather="all_gather",  # "all_gather" | "psum" (zero-padded slices summed)
    index=lambda i, n: i,
    keep_opt_state=False,
    loss="pmean",  # "pmean" | "psum" | "first"
    grad_dtype=None,
    n_fixed=None,
    pcast=True,
):
    import jax
    import jax.numpy as jnp
    import optax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from course_lib.steps import TrainState, cross_entropy

    def body(state, batch, *, apply_fn, optimizer, specs, axis_name):
        images, labels = batch
        n = n_fixed or lax.axis_size(axis_name)
        me = index(lax.axis_index(axis_name), n)
        params = lax.pcast(state.params, axis_name, to="varying") if pcast else state.params
        loss_v, grads = jax.value_and_grad(lambda p: cross_entropy(apply_fn(p, images), labels))(
            params
        )
        if grad_dtype is not None:
            grads = jax.tree.map(lambda g: g.astype(grad_dtype), grads)

        def dim(spec):
            return tuple(spec).index(axis_name) if axis_name in tuple(spec) else None

        def cut(x, d):
            size = x.shape[d] // n
            return lax.dynamic_slice_in_dim(x, me * size, size, axis=d)

        def my_grad(g, spec):
            d = dim(spec)
            if d is None:
                out = lax.pmean(g, axis_name) if replicated == "pmean" else lax.psum(g, axis_name)
                return out.astype(jnp.float32)
            if reduce == "scatter":
                out = lax.psum_scatter(g, axis_name, scatter_dimension=d, tiled=True)
                out = out / n if mean else out
            else:
                out = cut(lax.pmean(g, axis_name), d)
            return out.astype(jnp.float32)

        def my_slice(p, spec):
            d = dim(spec)
            return p if d is None else cut(p, d)

        def put(p, spec):
            d = dim(spec)
            if d is None:
                return p
            if gather == "all_gather":
                return lax.all_gather(p, axis_name, axis=d, tiled=True, to="invarying")
            full = list(p.shape)
            full[d] *= n
            padded = lax.dynamic_update_slice_in_dim(
                jnp.zeros(full, p.dtype), p, me * p.shape[d], axis=d
            )
            return lax.psum(padded, axis_name)

        is_spec = lambda s: isinstance(s, P)  # noqa: E731
        g = jax.tree.map(my_grad, grads, specs, is_leaf=is_spec)
        mine = jax.tree.map(my_slice, state.params, specs, is_leaf=is_spec)
        given = {"slices": mine, "grads": g, "zeros": jax.tree.map(jnp.zeros_like, mine)}[
            opt_params
        ]
        updates, opt_state = optimizer.update(g, state.opt_state, given)
        new = jax.tree.map(put, optax.apply_updates(mine, updates), specs, is_leaf=is_spec)
        if keep_opt_state:
            opt_state = state.opt_state
        if loss == "pmean":
            out_loss = lax.pmean(loss_v, axis_name)
        elif loss == "psum":
            out_loss = lax.psum(loss_v, axis_name)
        else:
            out_loss = lax.psum(jnp.where(lax.axis_index(axis_name) == 0, loss_v, 0.0), axis_name)
        return TrainState(new, opt_state), {"loss": out_loss}

    return body


def zero1_reference(state, batch, **kw):
    return _zero1()(state, batch, **kw)


def zero1_allreduce_then_slice(state, batch, **kw):
    # WRONG: pmean of every gradient, then this device's slice: an all-reduce, not a reduce-scatter.
    return _zero1(reduce="allreduce")(state, batch, **kw)


def zero1_no_mean(state, batch, **kw):
    # WRONG: the summed gradient, not the mean.
    return _zero1(mean=False)(state, batch, **kw)


def zero1_replicated_psum(state, batch, **kw):
    # WRONG: the leaf kept whole (dense2's bias) is psum'ed, not pmean'ed: its update n x too large.
    return _zero1(replicated="psum")(state, batch, **kw)


def zero1_decay_reads_grads(state, batch, **kw):
    # WRONG: hands optimizer.update the gradients where the parameters belong.
    return _zero1(opt_params="grads")(state, batch, **kw)


def zero1_gather_by_psum(state, batch, **kw):
    # WRONG: the updated slices gathered by a psum of zero-padded copies: an all-reduce, twice the bytes.
    return _zero1(gather="psum")(state, batch, **kw)


def zero1_slices_shifted(state, batch, **kw):
    # WRONG: parameters sliced at the next device's offset.
    return _zero1(index=lambda i, n: (i + 1) % n)(state, batch, **kw)


def zero1_stale_momentum(state, batch, **kw):
    # WRONG: returns the optimizer state it was given.
    return _zero1(keep_opt_state=True)(state, batch, **kw)


def zero1_loss_summed(state, batch, **kw):
    # WRONG: the loss metric is the sum over devices, not the mean.
    return _zero1(loss="psum")(state, batch, **kw)


def zero1_loss_first_device(state, batch, **kw):
    # WRONG: the loss metric is device 0's batch only.
    return _zero1(loss="first")(state, batch, **kw)


def zero1_bf16_gradients(state, batch, **kw):
    # WRONG: gradients cast to bfloat16 before the reduce-scatter (half the bytes, not the same update).
    import jax.numpy as jnp

    return _zero1(grad_dtype=jnp.bfloat16)(state, batch, **kw)


def zero1_eight_devices(state, batch, **kw):
    # WRONG: n = 8 baked in.
    return _zero1(n_fixed=8)(state, batch, **kw)


def zero1_no_pcast(state, batch, **kw):
    # WRONG: no pcast: the gradient is already psum'ed implicitly, then reduce-scattered again.
    return _zero1(pcast=False)(state, batch, **kw)


# --------------------------------------------------------------------------------------------------------------
# 11.1 gpipe_forward (lesson11.check_gpipe)


def _gpipe(
    *,
    extra_ticks=0,
    ring=False,
    reorder=None,
    stage0_mask=True,
    every_stage_reads_xs=False,
    send_last=True,
    double_apply=False,
    broadcast=False,
    n_fixed=None,
    send_stack=False,
):
    import jax
    import jax.numpy as jnp

    def gpipe_forward(stage_fn, stage_params, xs, axis_name):
        p = n_fixed or jax.lax.axis_size(axis_name)
        me = jax.lax.axis_index(axis_name)
        m = xs.shape[0]
        pairs = [(i, (i + 1) % p) for i in range(p)] if ring else [(i, i + 1) for i in range(p - 1)]
        arrived = jnp.zeros_like(xs[0])
        ys = jnp.zeros_like(xs)
        ticks = m + p - 1 + extra_ticks
        for t in range(ticks):
            if every_stage_reads_xs:
                x = jax.lax.dynamic_index_in_dim(xs, jnp.clip(t - me, 0, m - 1), 0, False)
            elif stage0_mask:
                x = jnp.where(me == 0, xs[min(t, m - 1)], arrived)
            else:
                x = arrived if t else xs[0]
            y = stage_fn(x, stage_params)
            if double_apply:
                y = jnp.where(
                    me == 0,
                    stage_fn(xs[min(t, m - 1)], stage_params),
                    stage_fn(arrived, stage_params),
                )
            done = t - (p - 1)
            if 0 <= done < m:
                row = reorder(done, m) if reorder else done
                ys = ys.at[row].set(jnp.where(me == p - 1, y, ys[row]))
            if send_last or t < ticks - 1:
                if send_stack:
                    stack = jax.lax.ppermute(jnp.concatenate([y[None], ys]), axis_name, pairs)
                    arrived = stack[0]
                else:
                    arrived = jax.lax.ppermute(y, axis_name, pairs)
        if broadcast:
            ys = jax.lax.psum(jnp.where(me == p - 1, ys, 0), axis_name)
        return ys

    return gpipe_forward


def gpipe_reference(*a):
    return _gpipe()(*a)


def gpipe_one_tick_more(*a):
    # WRONG: m + p ticks (one tick of nothing but bubble more); the values are right.
    return _gpipe(extra_ticks=1)(*a)


def gpipe_two_ticks_more(*a):
    # WRONG: m + p + 1 ticks.
    return _gpipe(extra_ticks=2)(*a)


def gpipe_ring(*a):
    # WRONG (minor): a cyclic ppermute, the last stage sends to stage 0 what stage 0 never reads.
    return _gpipe(ring=True)(*a)


def gpipe_reversed_rows(*a):
    # WRONG: micro-batch i written to row m - 1 - i.
    return _gpipe(reorder=lambda i, m: m - 1 - i)(*a)


def gpipe_rotated_rows(*a):
    # WRONG: micro-batch i written to row (i + 1) % m.
    return _gpipe(reorder=lambda i, m: (i + 1) % m)(*a)


def gpipe_no_stage0_mask(*a):
    # WRONG: stage 0 reads xs[0] once and then what arrives (from nobody: zeros).
    return _gpipe(stage0_mask=False)(*a)


def gpipe_skip_last_send(*a):
    # RIGHT: the last tick's send goes nowhere useful and is left out.
    return _gpipe(send_last=False)(*a)


def gpipe_double_apply(*a):
    # WRONG: two stage applications per tick (one on xs, one on what arrived), then a select.
    return _gpipe(double_apply=True)(*a)


def gpipe_broadcast_result(*a):
    # WRONG (extra collective): psums the last stage's ys to every stage at the end.
    return _gpipe(broadcast=True)(*a)


def gpipe_every_stage_reads_xs(*a):
    # WRONG: stage s applies itself to xs[t - s], not to what stage s - 1 sent.
    return _gpipe(every_stage_reads_xs=True)(*a)


def gpipe_four_stages(*a):
    # WRONG: p = 4 baked in.
    return _gpipe(n_fixed=4)(*a)


def gpipe_sends_stack(*a):
    # WRONG: sends the activation together with the whole ys accumulator each tick (m + 1 activations).
    return _gpipe(send_stack=True)(*a)


def gpipe_all_gather_params(stage_fn, stage_params, xs, axis_name):
    # WRONG: no pipeline at all: all_gather every stage's parameters and run every stage on every device.
    import jax

    everything = jax.lax.all_gather(stage_params, axis_name)
    p = jax.lax.axis_size(axis_name)
    ys = xs
    for s in range(p):
        ys = jax.vmap(lambda x, s=s: stage_fn(x, jax.tree.map(lambda a: a[s], everything)))(ys)
    return ys


def gpipe_scan(stage_fn, stage_params, xs, axis_name):
    # RIGHT: the ticks as a lax.scan.
    import jax.numpy as jnp
    from jax import lax

    p, me, m = lax.axis_size(axis_name), lax.axis_index(axis_name), xs.shape[0]
    pairs = [(i, i + 1) for i in range(p - 1)]

    def tick(carry, t):
        arrived, ys = carry
        x = jnp.where(me == 0, xs[jnp.minimum(t, m - 1)], arrived)
        y = stage_fn(x, stage_params)
        done = t - (p - 1)
        row = jnp.clip(done, 0, m - 1)
        ys = lax.dynamic_update_index_in_dim(
            ys, jnp.where((me == p - 1) & (done >= 0), y, ys[row]), row, 0
        )
        return (lax.ppermute(y, axis_name, pairs), ys), None

    init = lax.pcast((jnp.zeros_like(xs[0]), jnp.zeros_like(xs)), axis_name, to="varying")
    (_, ys), _ = lax.scan(tick, init, jnp.arange(m + p - 1))
    return ys


def gpipe_fori(stage_fn, stage_params, xs, axis_name):
    # RIGHT: the ticks as a lax.fori_loop.
    import jax.numpy as jnp
    from jax import lax

    p, me, m = lax.axis_size(axis_name), lax.axis_index(axis_name), xs.shape[0]
    pairs = [(i, i + 1) for i in range(p - 1)]

    def tick(t, carry):
        arrived, ys = carry
        x = jnp.where(
            me == 0, lax.dynamic_index_in_dim(xs, jnp.minimum(t, m - 1), 0, False), arrived
        )
        y = stage_fn(x, stage_params)
        done = t - (p - 1)
        row = jnp.clip(done, 0, m - 1)
        old = lax.dynamic_index_in_dim(ys, row, 0, False)
        ys = lax.dynamic_update_index_in_dim(
            ys, jnp.where((me == p - 1) & (done >= 0), y, old), row, 0
        )
        return lax.ppermute(y, axis_name, pairs), ys

    init = lax.pcast((jnp.zeros_like(xs[0]), jnp.zeros_like(xs)), axis_name, to="varying")
    _, ys = lax.fori_loop(0, m + p - 1, tick, init)
    return ys


def _gpipe_loop(
    stage_fn, stage_params, xs, axis_name, *, send=None, run=None, first=None, row=None
):
    """A Python-loop GPipe whose send, stage application, stage-0 input and output row can be replaced."""
    import jax
    import jax.numpy as jnp

    p, me, m = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name), xs.shape[0]
    pairs = [(i, i + 1) for i in range(p - 1)]
    send = send or (lambda y: jax.lax.ppermute(y, axis_name, pairs))
    run = run or (lambda x, t: stage_fn(x, stage_params))
    first = first or (lambda t: xs[min(t, m - 1)])
    row = row or (lambda i: i)
    arrived, ys = jnp.zeros_like(xs[0]), jnp.zeros_like(xs)
    for t in range(m + p - 1):
        y = run(jnp.where(me == 0, first(t), arrived), t)
        if 0 <= t - (p - 1) < m:
            r = row(t - (p - 1))
            ys = ys.at[r].set(jnp.where(me == p - 1, y, ys[r]))
        arrived = send(y)
    return ys


def gpipe_stop_gradient(stage_fn, stage_params, xs, axis_name):
    # WRONG: what arrives is stop_gradient'ed: the values are right, the earlier stages get no gradient.
    import jax

    pairs = [(i, i + 1) for i in range(jax.lax.axis_size(axis_name) - 1)]
    return _gpipe_loop(
        stage_fn,
        stage_params,
        xs,
        axis_name,
        send=lambda y: jax.lax.stop_gradient(jax.lax.ppermute(y, axis_name, pairs)),
    )


def gpipe_bf16_send(stage_fn, stage_params, xs, axis_name):
    # WRONG: activations sent in bfloat16 (half the bytes, values rounded to 3 digits).
    import jax
    import jax.numpy as jnp

    pairs = [(i, i + 1) for i in range(jax.lax.axis_size(axis_name) - 1)]
    return _gpipe_loop(
        stage_fn,
        stage_params,
        xs,
        axis_name,
        send=lambda y: jax.lax.ppermute(y.astype(jnp.bfloat16), axis_name, pairs).astype(y.dtype),
    )


def gpipe_send_halves(stage_fn, stage_params, xs, axis_name):
    # RIGHT: the activation sent as two halves: one activation's bytes per tick, two ppermutes.
    import jax
    import jax.numpy as jnp

    pairs = [(i, i + 1) for i in range(jax.lax.axis_size(axis_name) - 1)]

    def send(y):
        a, b = jnp.split(y.reshape(-1), [y.size // 2])
        a, b = jax.lax.ppermute(a, axis_name, pairs), jax.lax.ppermute(b, axis_name, pairs)
        return jnp.concatenate([a, b]).reshape(y.shape)

    return _gpipe_loop(stage_fn, stage_params, xs, axis_name, send=send)


def gpipe_cond_idle(stage_fn, stage_params, xs, axis_name):
    # RIGHT: an idle stage skips its work with lax.cond (one application per tick at most).
    from jax import lax

    me, m = lax.axis_index(axis_name), xs.shape[0]

    def run(x, t):
        busy = (t - me >= 0) & (t - me < m)
        return lax.cond(busy, lambda x: stage_fn(x, stage_params), lambda x: x, x)

    return _gpipe_loop(stage_fn, stage_params, xs, axis_name, run=run)


def gpipe_backwards_order(stage_fn, stage_params, xs, axis_name):
    # RIGHT: stage 0 feeds the micro-batches last first, and the last stage writes each to its own row.
    m = xs.shape[0]
    return _gpipe_loop(
        stage_fn,
        stage_params,
        xs,
        axis_name,
        first=lambda t: xs[m - 1 - min(t, m - 1)],
        row=lambda i: m - 1 - i,
    )


# --------------------------------------------------------------------------------------------------------------
# 11.2 predict (lesson11.check_predict_pipeline)


def predict_reference(name, p, m, v):
    if name == "gpipe":
        return (p - 1) / (m + p - 1), m
    if name == "1f1b":
        return (p - 1) / (m + p - 1), min(m, 2 * p - 1)
    return (p - 1) / (v * m + p - 1), v * m


def predict_reads_tables(name, p, m, v):
    # WRONG (no prediction): builds the library's tables and reads them, the thing the exercise predicts.
    from course_lib import schedules

    s = {
        "gpipe": lambda: schedules.gpipe(p, m),
        "1f1b": lambda: schedules.one_f_one_b(p, m),
        "circular": lambda: schedules.circular(p, m, v),
    }[name]()
    return schedules.bubble_fraction(s), max(s.in_flight())


def _table_of_cases():
    from course_tools.checks import lesson11

    return {c: predict_reads_tables(*c) for c in lesson11._PREDICT_CASES}


def predict_lookup(name, p, m, v):
    # WRONG (no prediction): the checker's cases are a public constant; a table of their answers, anything
    # elsewhere.
    return _table_of_cases().get((name, p, m, v), (0.0, 1))


@cache
def _brute_forced_table():
    """A table of answers found by guessing one case at a time and reading how many cases the checker counts
    wrong: the checker's cases are a public constant, and a guess that lowers the count is right."""
    import contextlib
    import io
    import re

    from course_tools.checks import lesson11

    cases = lesson11._PREDICT_CASES
    table = {c: (0.0, 0) for c in cases}
    calls = 0

    def wrong(t):
        nonlocal calls
        calls += 1
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                lesson11.check_predict_pipeline(lambda *c: t.get(c, (0.0, 0)))
            return 0
        except Exception as e:
            return int(re.search(r"(\d+) of \d+", str(e)).group(1))

    base = wrong(table)
    for c in cases:
        name, p, m, v = c
        bubbles = {(p - 1) / (a * m + p - 1) for a in (1, v)} | {(p - 1) / (a * m) for a in (1, v)}
        found = False
        for b in sorted(bubbles):
            for stash in range(0, 4 * v * m + 2 * p + 1):
                trial = {**table, c: (b, stash)}
                if (w := wrong(trial)) < base:
                    table, base, found = trial, w, True
                    break
            if found:
                break
    return table, calls


def predict_brute_force(name, p, m, v):
    # WRONG (no prediction): guessed case by case against the checker's count of wrong cases.
    return _brute_forced_table()[0].get((name, p, m, v), (0.0, 0))


def predict_1f1b_stash_p(name, p, m, v):
    # WRONG: PipeDream-Flush's p, not this lockstep table's min(m, 2p - 1).
    if name == "1f1b":
        return (p - 1) / (m + p - 1), min(m, p)
    return predict_reference(name, p, m, v)


def predict_1f1b_stash_uncapped(name, p, m, v):
    # WRONG: 2p - 1 even when there are fewer micro-batches.
    if name == "1f1b":
        return (p - 1) / (m + p - 1), 2 * p - 1
    return predict_reference(name, p, m, v)


def predict_circular_no_v(name, p, m, v):
    # WRONG: the interleaved schedule's bubble without v.
    if name == "circular":
        return (p - 1) / (m + p - 1), v * m
    return predict_reference(name, p, m, v)


def predict_circular_stash_m(name, p, m, v):
    # WRONG: m stashed inputs, not v m.
    if name == "circular":
        return (p - 1) / (v * m + p - 1), m
    return predict_reference(name, p, m, v)


def predict_bubble_over_m(name, p, m, v):
    # WRONG: the bubble as a fraction of the useful time, (p - 1)/(v m).
    b, s = predict_reference(name, p, m, v)
    return (p - 1) / (v * m), s


def predict_other_form(name, p, m, v):
    # RIGHT: fractions and a list, a float stash.
    from fractions import Fraction

    b, s = predict_reference(name, p, m, v)
    return [Fraction(p - 1, v * m + p - 1), float(s)]


def predict_numpy(name, p, m, v):
    # RIGHT: numpy scalars.
    import numpy as np

    b, s = predict_reference(name, p, m, v)
    return np.float32(b), np.int64(s)


# --------------------------------------------------------------------------------------------------------------
# 11.3 route (lesson11.check_router)


def _route(
    *,
    token_major=False,
    start=0,
    keep_le=False,
    renorm=True,
    ascending=False,
    slot_dropped=None,
    gate_keep=False,
    gate_softmax_topk=False,
    float_slot=False,
    hard_k=None,
):
    import jax
    import jax.numpy as jnp

    def route(logits, k, capacity):
        kk = hard_k or k
        n_tokens, n_experts = logits.shape
        probs = jax.nn.softmax(logits, axis=-1)
        top_p, expert = jax.lax.top_k(probs, kk)
        if ascending:
            top_p, expert = top_p[:, ::-1], expert[:, ::-1]
        if gate_softmax_topk:
            gate = jax.nn.softmax(jnp.take_along_axis(logits, expert, axis=-1), axis=-1)
        else:
            gate = top_p / top_p.sum(-1, keepdims=True) if renorm else top_p
        one = jax.nn.one_hot(expert, n_experts, dtype=jnp.float32 if float_slot else jnp.int32)
        if token_major:
            flat = one.reshape(-1, n_experts)
        else:
            flat = one.transpose(1, 0, 2).reshape(-1, n_experts)
        before = jnp.cumsum(flat, axis=0) - flat + start
        place = (before * flat).sum(-1)
        place = place.reshape(n_tokens, kk) if token_major else place.reshape(kk, n_tokens).T
        keep = place <= capacity if keep_le else place < capacity
        if slot_dropped == "zero":
            place = jnp.where(keep, place, 0)
        elif slot_dropped == "clip":
            place = jnp.minimum(place, capacity - 1)
        if gate_keep:
            gate = gate * keep
        return expert, place, keep, gate

    return route


def route_reference(*a):
    return _route()(*a)


def route_given_bug(*a):
    # WRONG: the notebook's given router (places start at 1).
    return _route(start=1)(*a)


def route_token_major(*a):
    # WRONG: every choice of token 0, then of token 1, ...: second choices compete with first ones.
    return _route(token_major=True)(*a)


def route_start1_keep_le(*a):
    # WRONG: places from 1, kept while place <= capacity: keep is right, the slots are one off.
    return _route(start=1, keep_le=True)(*a)


def route_keep_le(*a):
    # WRONG: kept while place <= capacity: one choice over capacity per expert.
    return _route(keep_le=True)(*a)


def route_no_renorm(*a):
    # WRONG: gates not renormalised over the k.
    return _route(renorm=False)(*a)


def route_ascending(*a):
    # WRONG: smallest probability first.
    return _route(ascending=True)(*a)


def route_softmax_of_topk(*a):
    # RIGHT: softmax of the top-k logits equals the renormalised probabilities.
    return _route(gate_softmax_topk=True)(*a)


def route_dropped_slot_zero(*a):
    # RIGHT: a dropped choice's slot is never used; this one sets it to 0.
    return _route(slot_dropped="zero")(*a)


def route_dropped_slot_clip(*a):
    # RIGHT: a dropped choice's slot clipped to capacity - 1 (never used: keep is False).
    return _route(slot_dropped="clip")(*a)


def route_gate_zero_when_dropped(*a):
    # WRONG by the letter, refused: the gate of a dropped choice set to 0. The MoE output is the same, but the
    # rule returns every choice's renormalised gate; the checker says "gives other gates", which is true.
    return _route(gate_keep=True)(*a)


def route_float_slot(*a):
    # RIGHT or a message: places counted in float32 (integers held exactly).
    return _route(float_slot=True)(*a)


def route_eight_experts(logits, k, capacity):
    # WRONG: 8 experts baked in (the notebook's E): every case of the checker has 8.
    import jax
    import jax.numpy as jnp

    top_p, expert = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    flat = jax.nn.one_hot(expert.T, 8, dtype=jnp.int32).reshape(-1, 8)
    place = ((jnp.cumsum(flat, axis=0) - flat) * flat).sum(-1).reshape(k, -1).T
    return expert, place, place < capacity, top_p / top_p.sum(-1, keepdims=True)


def route_k2(*a):
    # WRONG: k = 2 baked in.
    return _route(hard_k=2)(*a)


# --------------------------------------------------------------------------------------------------------------

DEFECTS = [
    # (exercise, what a correct checker does, function, note)
    (
        "08.1",
        "refuse",
        fsdp_lookup,
        "fsdp_case, public, returns the true sent and state of every case",
    ),
    ("08.2", "refuse", zero1_stale_momentum, "returns the optimizer state it was given"),
    ("08.2", "refuse", zero1_bf16_gradients, "gradients reduce-scattered in bfloat16"),
    (
        "08.2",
        "refuse",
        zero1_eight_devices,
        "n = 8 baked in; checked at the run's device count only",
    ),
    (
        "08.2",
        "message",
        zero1_slices_shifted,
        "hint: 'the updates are 8x too large' (they are not)",
    ),
    (
        "08.2",
        "message",
        zero1_gather_by_psum,
        "blames the gradients; the all-reduce is the params' gather",
    ),
    ("08.2", "message", zero1_replicated_psum, "hint names psum_scatter for a leaf kept whole"),
    (
        "08.2",
        "message",
        zero1_decay_reads_grads,
        "hint does not say the parameters handed to update",
    ),
    (
        "11.1",
        "refuse",
        gpipe_broadcast_result,
        "an all-reduce of every output besides the ppermutes",
    ),
    ("11.1", "refuse", gpipe_ring, "cyclic ppermute: p sends per tick where p - 1 are needed"),
    ("11.1", "message", gpipe_one_tick_more, "hint: 'apply the stage once per tick' (it does)"),
    (
        "11.1",
        "message",
        gpipe_bf16_send,
        "hint about which stage runs what (the sends are rounded)",
    ),
    ("11.2", "refuse", predict_reads_tables, "reads course_lib.schedules' tables"),
    ("11.2", "refuse", predict_lookup, "table of the public _PREDICT_CASES"),
    ("11.2", "refuse", predict_brute_force, "112 checker calls, one case varied at a time"),
    ("11.2", "message", predict_1f1b_stash_p, "hint sends the learner to the tables (the answer)"),
    ("11.3", "refuse", route_eight_experts, "E = 8 baked in; every case has 8 experts"),
    ("11.3", "message", route_given_bug, "hint gives the fix (exclusive count, place 0)"),
]

# Answers the checkers already judge right: kept as regression cases for the tests.
CHECKED = [
    ("08.1", "accept", fsdp_reference, "reference"),
    ("08.1", "refuse", fsdp_no_ring_factor, "2 P"),
    ("08.1", "refuse", fsdp_gather_only, "all-gather only"),
    ("08.1", "refuse", fsdp_sharded_only, "forgets the replicated leaves' all-reduce"),
    ("08.1", "refuse", fsdp_replicated_once, "all-reduce as (n-1)/n S"),
    ("08.1", "refuse", fsdp_state_params_only, "no momentum"),
    ("08.1", "refuse", fsdp_state_all_sharded, "replicated leaves 1/n too"),
    ("08.1", "refuse", fsdp_state_with_grads, "gradients counted"),
    ("08.1", "refuse", fsdp_hard_coded_8, "n = 8 baked in"),
    ("08.1", "accept", fsdp_other_form, "numpy, per collective"),
    ("08.1", "accept", fsdp_jax_scalar, "jax scalars"),
    ("08.2", "accept", zero1_reference, "reference"),
    ("08.2", "refuse", zero1_allreduce_then_slice, "all-reduce then slice"),
    ("08.2", "refuse", zero1_no_mean, "sum not mean"),
    ("08.2", "refuse", zero1_replicated_psum, "replicated leaf psum"),
    ("08.2", "refuse", zero1_decay_reads_grads, "decay reads grads"),
    ("08.2", "refuse", zero1_gather_by_psum, "gather by psum"),
    ("08.2", "refuse", zero1_slices_shifted, "slices at the next offset"),
    ("08.2", "refuse", zero1_loss_summed, "loss summed"),
    ("08.2", "refuse", zero1_loss_first_device, "loss of device 0"),
    ("08.2", "refuse", zero1_no_pcast, "no pcast"),
    ("11.1", "accept", gpipe_reference, "reference"),
    ("11.1", "refuse", gpipe_one_tick_more, "m + p ticks"),
    ("11.1", "refuse", gpipe_two_ticks_more, "m + p + 1 ticks"),
    ("11.1", "refuse", gpipe_reversed_rows, "rows reversed"),
    ("11.1", "refuse", gpipe_rotated_rows, "rows rotated"),
    ("11.1", "refuse", gpipe_no_stage0_mask, "stage 0 reads arrivals"),
    ("11.1", "accept", gpipe_skip_last_send, "last send left out"),
    ("11.1", "refuse", gpipe_double_apply, "two applications per tick"),
    ("11.1", "refuse", gpipe_every_stage_reads_xs, "each stage reads xs"),
    ("11.1", "refuse", gpipe_four_stages, "p = 4 baked in"),
    ("11.1", "refuse", gpipe_sends_stack, "sends ys each tick"),
    ("11.1", "refuse", gpipe_all_gather_params, "all_gather params, no pipeline"),
    ("11.1", "accept", gpipe_scan, "lax.scan"),
    ("11.1", "accept", gpipe_fori, "lax.fori_loop"),
    ("11.1", "refuse", gpipe_stop_gradient, "stop_gradient on arrivals"),
    ("11.1", "refuse", gpipe_bf16_send, "bf16 sends"),
    ("11.1", "accept", gpipe_send_halves, "two halves per tick"),
    ("11.1", "accept", gpipe_cond_idle, "lax.cond skips idle ticks"),
    ("11.1", "accept", gpipe_backwards_order, "micro-batches fed last first"),
    ("11.2", "accept", predict_reference, "reference"),
    ("11.2", "refuse", predict_1f1b_stash_p, "1f1b stash p"),
    ("11.2", "refuse", predict_1f1b_stash_uncapped, "1f1b stash 2p-1"),
    ("11.2", "refuse", predict_circular_no_v, "circular bubble without v"),
    ("11.2", "refuse", predict_circular_stash_m, "circular stash m"),
    ("11.2", "refuse", predict_bubble_over_m, "(p-1)/(vm)"),
    ("11.2", "accept", predict_other_form, "Fraction, list"),
    ("11.2", "accept", predict_numpy, "numpy scalars"),
    ("11.3", "accept", route_reference, "reference"),
    ("11.3", "refuse", route_given_bug, "given router"),
    ("11.3", "refuse", route_token_major, "token-major places"),
    ("11.3", "refuse", route_start1_keep_le, "places from 1, keep <="),
    ("11.3", "refuse", route_keep_le, "keep <= capacity"),
    ("11.3", "refuse", route_no_renorm, "gates not renormalised"),
    ("11.3", "refuse", route_ascending, "ascending"),
    ("11.3", "accept", route_softmax_of_topk, "softmax of top-k logits"),
    ("11.3", "accept", route_dropped_slot_zero, "dropped slot 0"),
    ("11.3", "accept", route_dropped_slot_clip, "dropped slot clipped"),
    (
        "11.3",
        "refuse",
        route_gate_zero_when_dropped,
        "zeroed gate: another gate array (same output)",
    ),
    ("11.3", "accept", route_float_slot, "float32 slots"),
    ("11.3", "refuse", route_k2, "k = 2 baked in"),
]


@cache
def _fsdp_row():
    """``runs["fsdp"].row`` of the lab at the cpu profile on 8 devices, as the notebook's check cell passes it."""
    import jax

    from course_lib import lab
    from course_lib.config import resolve_profile

    devices = jax.devices()
    config = resolve_profile("auto", "cpu", steps=0, global_batch=0, n_devices=len(devices))
    return lab.run_strategy(
        "fsdp", devices, config, seed=0, precision="float32", progress=False
    ).row


def _checker(exercise, devices):
    from course_tools.checks import lesson08, lesson11

    return {
        "08.1": lambda fn: lesson08.check_fsdp_prediction(*fn(), _fsdp_row()),
        "08.2": lambda fn: lesson08.check_zero1(fn, devices),
        "11.1": lambda fn: lesson11.check_gpipe(fn, devices),
        "11.2": lambda fn: lesson11.check_predict_pipeline(fn),
        "11.3": lambda fn: lesson11.check_router(fn),
    }[exercise]


def main(prefixes, cases=None):
    import contextlib
    import io

    from course_lib.devices import setup_devices

    report = setup_devices(8, "cpu")
    still = 0
    for exercise, should, fn, note in DEFECTS if cases is None else cases:
        if prefixes and not any(exercise.startswith(p) for p in prefixes):
            continue
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                _checker(exercise, report.devices)(fn)
            verdict, message = "accepted", out.getvalue().strip().splitlines()[-1:]
        except Exception as e:  # an ExerciseError, or the checker's own crash
            verdict, message = "refused", [" | ".join(f"{type(e).__name__}: {e}".splitlines()[:3])]
        if should == "message":  # refused either way: read whether the message now names the fault
            mark = "READ  " if verdict == "refused" else "DEFECT"
        else:
            mark = "ok    " if (verdict == "accepted") == (should == "accept") else "DEFECT"
        still += mark == "DEFECT"
        print(f"{mark} {exercise} {fn.__name__} ({note}): {verdict}; should {should}", flush=True)
        print(f"         {' '.join(message)[:300]}", flush=True)
    print(
        f"{still} case(s) judged wrongly; READ: a wrong answer refused, check that its message is now true"
    )


if __name__ == "__main__":
    args = sys.argv[1:]
    main([a for a in args if a != "--checked"], CHECKED if "--checked" in args else None)

"""The checkers of lesson 01 (course_tools.checks.lesson01) accept correct answers in several forms and
reject typical wrong ones, each with its own hint; an unwritten answer prints its hint (or raises under
COURSE_STRICT_CHECKS=1)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checking import TOLERANCES, not_written, use_tolerance
from checking import rejects_written as rejects
from checking import stub as _stub

from course_tools.checks import ExerciseError, lesson01
from course_tools.checks._lesson01_blocks import measure_blocks

# ---------------------------------------------------------------- exercise 1


def _dropout(key, x, rate):
    keep = jax.random.bernoulli(key, 1 - rate, x.shape)
    return jnp.where(keep, x / (1 - rate), 0)


def _dropout_uniform(key, x, rate):  # another correct form: a uniform draw and a multiply
    keep = jax.random.uniform(key, x.shape) >= rate
    return x * keep.astype(x.dtype) / (1 - rate)


def test_dropout_accepts_correct_forms():
    assert lesson01.check_dropout(_dropout)
    assert lesson01.check_dropout(_dropout_uniform)


def test_dropout_stub(monkeypatch, capsys):
    not_written(lesson01.check_dropout, _stub, monkeypatch=monkeypatch, capsys=capsys)


def test_dropout_wrong_answers():
    # the hole of the old checker (its x was all ones): an answer that ignores x
    rejects(
        lesson01.check_dropout,
        lambda k, x, r: jnp.where(jax.random.bernoulli(k, 1 - r, x.shape), 1 / (1 - r), 0.0),
        match="does not depend on x",
    )
    rng = np.random.default_rng()
    rejects(
        lesson01.check_dropout,
        lambda k, x, r: x * (rng.random(x.shape) > r) / (1 - r),
        match="not pure|dtype",
    )
    rejects(
        lesson01.check_dropout,
        lambda k, x, r: jnp.where(jax.random.bernoulli(k, 1 - r, x.shape), x, 0),
        match="not rescaled",
    )
    rejects(
        lesson01.check_dropout,
        lambda k, x, r: _dropout(jax.random.key(0), x, r),
        match="use the key",
    )
    rejects(
        lesson01.check_dropout,
        lambda k, x, r: jnp.where(jax.random.bernoulli(k, r, x.shape), x / r, 0),
        match="probability 1 - rate",
    )
    rejects(lesson01.check_dropout, lambda k, x, r: _dropout(k, x[0], r), match="output shape")
    rejects(lesson01.check_dropout, _same_columns_every_row, match="along axis 0 drops the same")
    rejects(lesson01.check_dropout, _mask_per_column, match="along axis 0 drops the same")
    rejects(lesson01.check_dropout, _mask_per_example, match="along axis 1 drops the same")


def _same_columns_every_row(key, x, rate):  # exactly `rate` of the last axis, the same in every row
    d = x.shape[-1]
    keep = jax.random.permutation(key, d) >= int(round(rate * d))
    return jnp.where(keep, x / (1 - rate), 0)


def _mask_per_column(key, x, rate):  # one bernoulli mask of the last axis, broadcast over the batch
    keep = jax.random.bernoulli(key, 1 - rate, x.shape[-1:])
    return jnp.where(keep, x / (1 - rate), 0)


def _mask_per_example(key, x, rate):  # one mask per leading index, shared by the axes after it
    keep = jax.random.bernoulli(key, 1 - rate, (x.shape[0], 1, x.shape[2]))
    return jnp.where(keep, x / (1 - rate), 0)


# ---------------------------------------------------------------- exercise 2

RIGHT = {
    "linearize, then its linear map twice": 1,
    "a Hessian": 1,
    "vmap over 4 rows": 1,
    "jit, then grad of the jitted f": 1,
    "jit twice, then grad of the plain f": 2,
    "jit(vmap(grad)) on 4 rows, then 5": 2,
    "grad of a checkpointed f": 1,
}


def test_trace_counts_measured():
    assert lesson01.measure_traces() == RIGHT
    # fresh functions: the second measurement is not a cache hit
    assert lesson01.measure_traces() == RIGHT


def test_trace_counts_accept_correct_forms():
    assert lesson01.check_trace_counts(RIGHT)
    assert lesson01.check_trace_counts({k: float(v) for k, v in RIGHT.items()})  # 1.0 is whole
    assert lesson01.check_trace_counts({k: np.int64(v) for k, v in RIGHT.items()})
    # the red team's: counts written as text ("1") are refused, with the reason
    name = next(iter(RIGHT))
    with pytest.raises(ExerciseError, match="a str, not a number"):
        lesson01.check_trace_counts({**RIGHT, name: str(RIGHT[name])})


def test_trace_counts_stub(monkeypatch, capsys):
    not_written(
        lesson01.check_trace_counts, dict.fromkeys(RIGHT), monkeypatch=monkeypatch, capsys=capsys
    )


def test_trace_counts_wrong_answers():
    check = lesson01.check_trace_counts
    one_each = dict.fromkeys(RIGHT, 1)  # "a trace is cached forever"
    rejects(check, one_each, match="2 of your 7 counts")
    rejects(check, {**RIGHT, "linearize, then its linear map twice": 3}, match="1 of your 7")
    rejects(check, {**RIGHT, "vmap over 4 rows": 4}, match="1 of your 7")  # a loop over rows
    rejects(check, {**RIGHT, "a Hessian": 2}, match="1 of your 7")  # the review's wrong answer
    rejects(check, {**RIGHT, "jit, then grad of the jitted f": 2}, match="1 of your 7")
    rejects(check, {**RIGHT, "grad of a checkpointed f": 2}, match="1 of your 7")
    rejects(check, {**RIGHT, "jit twice, then grad of the plain f": 1}, match="1 of your 7")
    rejects(check, {**RIGHT, "a Hessian": 1.5}, match="whole number")


def test_trace_counts_never_name_the_wrong_case():
    messages = set()
    for name in RIGHT:
        with pytest.raises(ExerciseError) as e:
            lesson01.check_trace_counts({**RIGHT, name: RIGHT[name] + 1})
        messages.add(str(e.value))
    assert len(messages) == 1 and not any(name in next(iter(messages)) for name in RIGHT)


# ---------------------------------------------------------------- exercise 3


def _double_where(p, q):
    d2 = jnp.sum((p - q) ** 2)
    ok = d2 > 0
    return jnp.where(ok, jnp.sqrt(jnp.where(ok, d2, 1.0)), 0.0)


@jax.custom_jvp
def _norm_jvp(d):  # another correct form: the derivative written by hand
    return jnp.sqrt(jnp.sum(d**2))


@_norm_jvp.defjvp
def _norm_jvp_rule(primals, tangents):
    (d,), (t,) = primals, tangents
    value = _norm_jvp(d)
    safe = jnp.where(value > 0, value, 1.0)
    return value, jnp.where(value > 0, jnp.vdot(d, t) / safe, 0.0)


def _custom(p, q):
    return _norm_jvp(p - q)


def _equal_test(p, q):  # another correct form: test equality, not d2 > 0
    d2 = jnp.sum((p - q) ** 2)
    zero = d2 == 0
    return jnp.where(zero, 0.0, jnp.sqrt(jnp.where(zero, 1.0, d2)))


def test_safe_distance_accepts_correct_forms():
    assert lesson01.check_safe_distance(_double_where)
    assert lesson01.check_safe_distance(_custom)
    assert lesson01.check_safe_distance(_equal_test)


def test_safe_distance_stub(monkeypatch, capsys):
    not_written(lesson01.check_safe_distance, _stub, monkeypatch=monkeypatch, capsys=capsys)


def test_safe_distance_refuses_every_epsilon():
    """The review's wrong answers: an epsilon inside sqrt (1e-10, 1e-12) passed the old value test."""
    check = lesson01.check_safe_distance
    for eps in (1e-6, 1e-10, 1e-12, 1e-20):
        rejects(
            check, lambda p, q, e=eps: jnp.sqrt(jnp.sum((p - q) ** 2) + e), match="not 0|shifts"
        )
    clamped = lambda p, q: jnp.sqrt(jnp.maximum(jnp.sum((p - q) ** 2), 1e-30))  # noqa: E731
    rejects(check, clamped, match="not 0")
    # exact at 0, but the epsilon still bends small distances: the value near 0 gives it away
    shifted = lambda p, q: jnp.where(  # noqa: E731
        jnp.all(p == q), 0.0, jnp.sqrt(jnp.sum((p - q) ** 2) + 1e-10)
    )
    rejects(check, shifted, match="0.0001 apart is .*relative error")
    rejects(check, _small_epsilon, match="1e-05 apart is .*relative error")
    rejects(check, _threshold, match="1e-05 apart is 0")
    rejects(check, _threshold_1e12, match="1e-0[68] apart is 0")


def _small_epsilon(p, q):  # exact at 0, an epsilon small enough to hide at 1e-4: 0.5% off at 1e-6
    squared = jnp.sum((p - q) ** 2)
    return jnp.where(squared > 0, jnp.sqrt(squared + 1e-14), 0.0)


def _threshold(p, q):  # every pair closer than ~3e-5 counts as coincident
    squared = jnp.sum((p - q) ** 2)
    positive = squared > 1e-9
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, squared, 1.0)), 0.0)


def _threshold_1e12(p, q):  # the same with a tolerance of 1e-12 on d2: zero below 1e-6
    squared = jnp.sum((p - q) ** 2)
    positive = squared > 1e-12
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, squared, 1.0)), 0.0)


def test_safe_distance_wrong_answers():
    check = lesson01.check_safe_distance
    rejects(check, lambda p, q: jnp.sqrt(jnp.sum((p - q) ** 2)), match="NaN")
    single_where = lambda p, q: jnp.where(  # noqa: E731
        jnp.sum((p - q) ** 2) > 0, jnp.sqrt(jnp.sum((p - q) ** 2)), 0.0
    )
    rejects(check, single_where, match=r"0 x inf = NaN")
    rejects(check, lambda p, q: jnp.linalg.norm(p - q), match="NaN")  # the review's: refused
    # D3: the hint describes the failure and claims no jnp.where the answer does not hold
    with pytest.raises(ExerciseError) as e:
        check(lambda p, q: jnp.linalg.norm(p - q))
    assert "gradient at 0 is infinite" in str(e.value) and "picks the value" not in str(e.value)
    rejects(check, lambda p, q: jnp.nan_to_num(jnp.sqrt(jnp.sum((p - q) ** 2))), match="NaN")
    rejects(check, lambda p, q: jnp.sum((p - q) ** 2), match="different points is wrong")
    rejects(check, lambda p, q: jnp.abs(p - q), match="scalar")


# ---------------------------------------------------------------- exercise 4


def _accumulate(loss_fn, params, x, y, micro):
    total = x.shape[0]
    loss_sum, grad_sum = 0.0, jax.tree.map(jnp.zeros_like, params)
    for start in range(0, total, micro):
        xb, yb = x[start : start + micro], y[start : start + micro]
        loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
        w = xb.shape[0] / total
        loss_sum = loss_sum + w * loss
        grad_sum = jax.tree.map(lambda a, g, w=w: a + w * g, grad_sum, grads)
    return loss_sum, grad_sum


def _accumulate_sums(
    loss_fn, params, x, y, micro
):  # another correct form: sum of (rows x mean), divide once
    parts = []
    for start in range(0, x.shape[0], micro):
        xb, yb = x[start : start + micro], y[start : start + micro]
        parts.append(
            jax.value_and_grad(lambda p, xb=xb, yb=yb: len(xb) * loss_fn(p, xb, yb))(params)
        )
    loss = sum(value for value, _ in parts) / x.shape[0]
    grads = jax.tree.map(lambda *gs: sum(gs) / x.shape[0], *[g for _, g in parts])
    return [loss, grads]  # a list instead of a tuple


def _unweighted(loss_fn, params, x, y, micro):
    parts = [
        jax.value_and_grad(loss_fn)(params, x[s : s + micro], y[s : s + micro])
        for s in range(0, x.shape[0], micro)
    ]
    k = len(parts)
    return sum(value for value, _ in parts) / k, jax.tree.map(
        lambda *gs: sum(gs) / k, *[g for _, g in parts]
    )


def _summed(loss_fn, params, x, y, micro):
    parts = [
        jax.value_and_grad(loss_fn)(params, x[s : s + micro], y[s : s + micro])
        for s in range(0, x.shape[0], micro)
    ]
    return sum(value for value, _ in parts), jax.tree.map(
        lambda *gs: sum(gs), *[g for _, g in parts]
    )


def _drops_the_rest(loss_fn, params, x, y, micro):
    k = x.shape[0] // micro
    parts = [
        jax.value_and_grad(loss_fn)(
            params, x[i * micro : (i + 1) * micro], y[i * micro : (i + 1) * micro]
        )
        for i in range(k)
    ]
    return sum(value for value, _ in parts) / k, jax.tree.map(
        lambda *gs: sum(gs) / k, *[g for _, g in parts]
    )


def _accumulate_checkpointed(loss_fn, params, x, y, micro):  # recomputes each forward pass
    return _accumulate(jax.checkpoint(loss_fn), params, x, y, micro)


def _one_grad_of_a_sum(loss_fn, params, x, y, micro):  # right values, every micro-batch kept alive
    def total(p):
        return sum(
            x[s : s + micro].shape[0] / x.shape[0] * loss_fn(p, x[s : s + micro], y[s : s + micro])
            for s in range(0, x.shape[0], micro)
        )

    return jax.value_and_grad(total)(params)


def _vmapped_grads(loss_fn, params, x, y, micro):  # right values when micro divides the batch
    xs, ys = x.reshape(-1, micro, *x.shape[1:]), y.reshape(-1, micro)
    loss, grads = jax.vmap(jax.value_and_grad(loss_fn), in_axes=(None, 0, 0))(params, xs, ys)
    return loss.mean(), jax.tree.map(lambda g: g.mean(0), grads)


def test_accumulate_accepts_correct_forms():
    assert lesson01.check_accumulate(_accumulate)
    assert lesson01.check_accumulate(_accumulate_sums)
    assert lesson01.check_accumulate(_accumulate_checkpointed)
    assert lesson01.check_accumulate(jax.jit(_accumulate, static_argnums=(0, 4)))
    # smaller micro-batches than allowed ("at most micro rows"): more passes, still one at a time
    half = lambda f, p, x, y, m: _accumulate(f, p, x, y, max(1, m // 2))  # noqa: E731
    assert lesson01.check_accumulate(half)
    assert lesson01.check_accumulate(lambda f, p, x, y, m: _accumulate(f, p, x, y, 1))


def test_accumulate_refuses_all_micro_batches_at_once():
    rejects(lesson01.check_accumulate, _one_grad_of_a_sum, match="forward pass started before")
    rejects(lesson01.check_accumulate, _vmapped_grads, match="differentiated together")


def test_accumulate_stub(monkeypatch, capsys):
    not_written(lesson01.check_accumulate, _stub, monkeypatch=monkeypatch, capsys=capsys)


@pytest.mark.parametrize("tolerance", TOLERANCES)
def test_accumulate_wrong_answers(monkeypatch, tolerance):
    use_tolerance(monkeypatch, tolerance)  # refused at this platform's tolerance, and at a TPU's
    assert lesson01.check_accumulate(_accumulate)
    rejects(
        lesson01.check_accumulate,
        lambda f, p, x, y, m: jax.value_and_grad(f)(p, x, y),
        match="rows at once",
    )
    rejects(lesson01.check_accumulate, _summed, match="3x the full-batch")
    rejects(lesson01.check_accumulate, _unweighted, match="last micro-batch has 2 rows")
    rejects(lesson01.check_accumulate, _drops_the_rest, match="do not drop it")
    rejects(
        lesson01.check_accumulate,
        lambda f, p, x, y, m: jax.tree.leaves(_accumulate(f, p, x, y, m)[1]),
        match="expected a pair|structure",
    )


def test_accumulate_accepts_a_checkpointed_sum():
    """One grad over a sum of checkpointed micro-losses keeps no activations: defensible, accepted."""

    def checkpointed_sum(loss_fn, params, x, y, micro):
        def total(p):
            return sum(
                x[s : s + micro].shape[0]
                / x.shape[0]
                * jax.checkpoint(loss_fn)(p, x[s : s + micro], y[s : s + micro])
                for s in range(0, x.shape[0], micro)
            )

        return jax.value_and_grad(total)(params)

    assert lesson01.check_accumulate(checkpointed_sum)


# ---------------------------------------------------------------- exercise 5

BLOCKS_RIGHT = {"best block": 4, "k=1": 17, "k=2": 10, "k=8": 10, "k=16": 17, "flops k=1": 4 / 3}


def test_block_memory_measured():
    measured = measure_blocks()
    temp = {k: measured[k][0] for k in lesson01.BLOCKS}
    assert min(temp, key=temp.get) == 4  # the square root of 16 layers
    assert abs(temp[1] - measured[None][0]) < 1 and abs(temp[16] - measured[None][0]) < 1
    assert all(
        abs(measured[k][1] - 4 / 3) < 0.02 for k in lesson01.BLOCKS
    )  # one extra forward pass


def test_block_memory_compiled_as_jax_0_12_compiles_it():
    """JAX 0.10.2's XLA:CPU merges a checkpoint's recomputation away unless its cse_barrier_expander pass
    is off (lesson 01, section 7); JAX 0.12's keeps it. The checker compiles with the pass off exactly where
    the default would merge."""
    import functools

    import jax

    from course_tools.checks import _lesson01_blocks as blocks

    w, x = (
        np.ones((blocks.WIDTH, blocks.WIDTH), np.float32),
        np.ones((blocks.ROWS, blocks.WIDTH), np.float32),
    )
    cpu = jax.devices("cpu")[0]
    w, x = jax.device_put(w, cpu), jax.device_put(x, cpu)

    def flops(block, options=None):
        lowered = jax.jit(jax.grad(functools.partial(blocks._loss, block=block))).lower(w, x)
        return lowered.compile(compiler_options=options).cost_analysis()["flops"]

    merged = abs(flops(4) / flops(None) - 1) < 0.02
    assert merged == blocks.barriers_merged() == (jax.__version_info__ < (0, 11)), jax.__version__
    assert merged == blocks.barriers_merged("cpu")
    # never on a TPU: XLA:TPU needs the pass (without it, "HLO opt-barrier is not implemented on TPU")
    assert not blocks.barriers_merged("tpu") and not blocks.barriers_merged("gpu")
    assert (
        abs(flops(4, blocks.KEEP_BARRIERS) / flops(None) - 4 / 3) < 0.02
    )  # with the pass off: 4/3


def test_block_memory_accepts_correct_forms():
    assert lesson01.check_block_memory(BLOCKS_RIGHT)
    plus_one = {**BLOCKS_RIGHT, "k=1": 18, "k=2": 11, "k=8": 11, "k=16": 18, "flops k=1": 1.33}
    assert lesson01.check_block_memory(plus_one)  # L/k + k + 1 (the input kept too), 1.33
    assert lesson01.check_block_memory({**BLOCKS_RIGHT, "best block": np.int64(4)})


def test_block_memory_stub(monkeypatch, capsys):
    not_written(
        lesson01.check_block_memory,
        dict.fromkeys(BLOCKS_RIGHT),
        monkeypatch=monkeypatch,
        capsys=capsys,
    )


def test_block_memory_wrong_answers():
    check = lesson01.check_block_memory
    finest = {**BLOCKS_RIGHT, "best block": 1, "k=1": 2}  # "checkpoint every layer: keep least"
    rejects(check, finest, match="2 of your 6 predictions")
    one_block = {**BLOCKS_RIGHT, "k=16": 1}  # "one checkpoint around everything keeps its input"
    rejects(check, one_block, match="1 of your 6")
    free = {**BLOCKS_RIGHT, "flops k=1": 1.0}  # "recomputing is free" / "no extra work at k=1"
    rejects(check, free, match="1 of your 6")
    per_layer = {**BLOCKS_RIGHT, "flops k=1": 2.0}  # "each layer recomputed: double the work"
    rejects(check, per_layer, match="1 of your 6")
    rejects(check, {**BLOCKS_RIGHT, "k=2": "ten"}, match="not a number")
    rejects(check, {k: v for k, v in BLOCKS_RIGHT.items() if k != "k=8"}, match="no prediction")

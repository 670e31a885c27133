"""Answers that the checkers of lessons 00-04 judge wrongly: input for fixing the checkers.

Not a pytest module: the name has no ``test_`` prefix, so pytest does not collect it. Each function below is one
learner's answer to one exercise, with a comment saying what is wrong with it (or why it is right) and which
checker it fools. ``DEFECTS`` lists them with the verdict a correct checker would give:

- ``"refuse"``: a wrong answer that the checker accepts;
- ``"accept"``: a right answer that the checker refuses, with a false message;
- ``"message"``: a wrong answer that the checker refuses, but for a reason that is not the answer's fault.

Run every answer through its checker, called as the notebook's check cell calls it, on 8 simulated CPU devices:

    .venv/bin/python tests/redteam_lessons00_04.py           # all of them
    .venv/bin/python tests/redteam_lessons00_04.py 02.3 04   # only the exercises whose id starts so

It prints each verdict and message, and marks with ``DEFECT`` every case where the checker still gets it wrong;
a fixed checker turns a line into ``ok``. The ``"message"`` cases print ``READ``: they are refused, and what
is to check is whether the message now names the answer's fault. Verdicts were recorded on JAX 0.12.0.1,
XLA:CPU, 8 simulated devices.
"""

import copy
import statistics
import sys
import time
from functools import cache, partial

FLAG = "--xla_force_host_platform_device_count"


# --------------------------------------------------------------------------------------------------------------
# 00.2 cpu_env (lesson00.check_cpu_env)


def cpu_env_copy_copy(n, env):
    # WRONG, accepted. copy.copy(os.environ) is an os._Environ that shares the caller's data: writing to it
    # changes os.environ itself (and calls putenv). The exercise's colleague calls cpu_env(4, os.environ),
    # yet the checker only passes plain dicts, where copy.copy happens to be a real copy.
    fresh = copy.copy(env)
    fresh.pop("JAX_NUM_CPU_DEVICES", None)
    kept = [f for f in fresh.get("XLA_FLAGS", "").split() if f.split("=", 1)[0] != FLAG]
    fresh["XLA_FLAGS"] = " ".join([*kept, f"{FLAG}={n}"])
    fresh["JAX_PLATFORMS"] = "cpu"
    return fresh


def cpu_env_replaces_count_2_only(n, env):
    # WRONG, accepted. Edits the flag by text, and only a stale count of 2 (the value in the exercise's story):
    # a user's --xla_force_host_platform_device_count=3 is kept and wins. Every test environment of the checker
    # holds a stale count of 2, so special-casing it passes.
    fresh = dict(env)
    fresh.pop("JAX_NUM_CPU_DEVICES", None)
    flags = fresh.get("XLA_FLAGS", "")
    if f"{FLAG}=2" in flags:
        flags = flags.replace(f"{FLAG}=2", f"{FLAG}={n}")
    elif FLAG not in flags:
        flags = f"{flags} {FLAG}={n}".strip()
    fresh["XLA_FLAGS"] = flags
    fresh["JAX_PLATFORMS"] = "cpu"
    return fresh


# --------------------------------------------------------------------------------------------------------------
# 00.3 split_and_sum (lesson00.check_split_and_sum)


def _blocks(x, devices):
    count, rows = len(devices), x.shape[0]
    if rows % count:
        raise ValueError(
            f"{rows} rows cannot be split evenly over {count} devices; use a multiple of {count}"
        )
    return rows // count


def split_and_sum_whole_x_to_host(x, devices, device):
    # WRONG, accepted. np.asarray(x) copies every row of x to the host before any block is cut: the spec says
    # only the blocks may leave x's device. The checker's message for jax.device_get(x) names np.asarray as
    # recorded, but np.asarray / np.array of the whole x are not (x.tolist() and device_get are refused).
    import jax
    import numpy as np

    host = np.asarray(x)
    k = _blocks(host, devices)
    parts = [jax.device_put(host[i * k : (i + 1) * k], d) for i, d in enumerate(devices)]
    partials = [p.sum(axis=0) for p in parts]
    moved = [jax.device_put(s, device) for s in partials]
    return parts, partials, sum(moved[1:], moved[0])


def split_and_sum_total_on_last_device(x, devices, device):
    # WRONG, accepted. The total is committed to devices[-1], not to the `device` argument. The checker always
    # asks for the last device, so ignoring the argument passes.
    import jax

    k = _blocks(x, devices)
    parts = [jax.device_put(x[i * k : (i + 1) * k], d) for i, d in enumerate(devices)]
    partials = [p.sum(axis=0) for p in parts]
    moved = [jax.device_put(s, devices[-1]) for s in partials]
    return parts, partials, sum(moved[1:], moved[0])


def split_and_sum_eight_devices(x, devices, device):
    # WRONG, accepted in an 8-device run. Hard-codes 8 devices (the notebook's default n_devices): the checker
    # tries only the run's own device list, never a shorter one such as devices[:3].
    import jax

    if x.shape[0] % 8:
        raise ValueError(f"{x.shape[0]} rows cannot be split over 8 devices; use a multiple of 8")
    k = x.shape[0] // 8
    parts = [jax.device_put(x[i * k : (i + 1) * k], devices[i]) for i in range(8)]
    partials = [p.sum(axis=0) for p in parts]
    moved = [jax.device_put(s, device) for s in partials]
    return parts, partials, sum(moved[1:], moved[0])


def split_and_sum_error_without_fix(x, devices, device):
    # WRONG (minor), accepted. The spec asks for a ValueError "that names both numbers and the fix"; this one
    # names the numbers only.
    if x.shape[0] % len(devices):
        raise ValueError(f"{x.shape[0]} rows, {len(devices)} devices")
    return _split_and_sum(x, devices, device)


def split_and_sum_float_total(x, devices, device):
    # WRONG (minor), accepted. The total of an int32 x comes back as float32; the checker's int32 case compares
    # values only ("int32: not at all"), not the dtype of the column sum.
    import jax.numpy as jnp

    parts, partials, total = _split_and_sum(x, devices, device)
    return parts, partials, total.astype(jnp.float32)


def _split_and_sum(x, devices, device):
    import jax

    k = _blocks(x, devices)
    parts = [jax.device_put(x[i * k : (i + 1) * k], d) for i, d in enumerate(devices)]
    partials = [p.sum(axis=0) for p in parts]
    moved = [jax.device_put(s, device) for s in partials]
    return parts, partials, sum(moved[1:], moved[0])


def split_and_sum_partials_added_on_host(x, devices, device):
    # RIGHT, refused with a false message. Only the partial sums leave their devices (to the host), are added
    # there, and the sum of them is put on `device`: the spec allows "partial sums (or sums of them)" to move.
    # Refused with "a sum of all the rows was moved from host to cpu:7: it was computed from x there, not from
    # the partial sums" - it was computed from the partial sums.
    import jax
    import numpy as np

    k = _blocks(x, devices)
    parts = [jax.device_put(x[i * k : (i + 1) * k], d) for i, d in enumerate(devices)]
    partials = [p.sum(axis=0) for p in parts]
    return (
        parts,
        partials,
        jax.device_put(np.sum([np.asarray(s) for s in partials], axis=0), device),
    )


def split_and_sum_device_put_of_lists(x, devices, device):
    # RIGHT, refused with a false message. jax.device_put(list_of_blocks, list_of_devices) puts block i on
    # devices[i] only (a pytree of devices matching the pytree of arrays; each part is committed to its own
    # device). Refused with "the rows of part 0 were moved to [CpuDevice(id=0), ..., CpuDevice(id=7)], not only
    # to cpu:0": the recorder takes the whole device list as every leaf's destination.
    import jax
    import jax.numpy as jnp

    k = _blocks(x, devices)
    parts = jax.device_put([x[i * k : (i + 1) * k] for i in range(len(devices))], list(devices))
    partials = [p.sum(axis=0) for p in parts]
    moved = jax.device_put(partials, [device] * len(partials))
    return parts, partials, jnp.stack(moved).sum(axis=0)


# --------------------------------------------------------------------------------------------------------------
# 01.1 dropout (lesson01.check_dropout)


def dropout_same_columns_every_row(key, x, rate):
    # WRONG, accepted. Exactly `rate` of the last axis is dropped, and the same columns in every row: the mask
    # is shared by all 60 x 40 leading positions (the classic bug of a mask drawn for one example and broadcast
    # over the batch). The checker tests purity, the dropped fraction and the scale, never that entries are
    # dropped independently (e.g. that two rows have different masks).
    import jax
    import jax.numpy as jnp

    d = x.shape[-1]
    keep = jax.random.permutation(key, d) >= int(round(rate * d))
    return jnp.where(keep, x / (1 - rate), 0)


def dropout_mask_per_column(key, x, rate):
    # WRONG, refused for a misleading reason. The same bernoulli mask of shape x.shape[-1:] for every row.
    # Refused only because its 25 draws happen to drop 80% instead of 60% with the checker's key; the hint
    # ("keep each entry with probability 1 - rate ... bernoulli's p") points at p, not at the mask's shape, and a
    # luckier key would pass it.
    import jax
    import jax.numpy as jnp

    keep = jax.random.bernoulli(key, 1 - rate, x.shape[-1:])
    return jnp.where(keep, x / (1 - rate), 0)


# --------------------------------------------------------------------------------------------------------------
# 01.3 safe_distance (lesson01.check_safe_distance)


def safe_distance_threshold(p, q):
    # WRONG, accepted. Treats every pair closer than ~3.2e-5 as coincident: at |p - q| = 1e-5 the value is 0
    # (not 1e-5) and the gradient is 0 (not a unit vector). The spec asks for "the exact gradient everywhere";
    # the checker probes only p == q and |p - q| = 1e-4. A guard like `d2 > 1e-12` passes the same way.
    import jax.numpy as jnp

    squared = jnp.sum((p - q) ** 2)
    positive = squared > 1e-9
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, squared, 1.0)), 0.0)


def safe_distance_small_epsilon(p, q):
    # WRONG, accepted. The "small epsilon" the exercise warns about, small enough to hide at 1e-4 (relative
    # error 5e-7) but 0.5% off at |p - q| = 1e-6 (9.589e-07 for 9.537e-07), which float32 represents well.
    import jax.numpy as jnp

    squared = jnp.sum((p - q) ** 2)
    return jnp.where(squared > 0, jnp.sqrt(squared + 1e-14), 0.0)


# --------------------------------------------------------------------------------------------------------------
# 01.4 accumulated_value_and_grad (lesson01.check_accumulate)


def accumulate_smaller_micro_batches(loss_fn, params, x, y, micro):
    # RIGHT, refused with a false message. Micro-batches of micro // 2 rows ("calls loss_fn on at most micro
    # rows at a time"), each backward pass finished before the next forward pass. Refused with "a micro-batch's
    # forward pass started before the previous one's backward pass ended (one grad of a sum of micro-batch
    # losses?)". The same happens with micro - 1 rows, 1 row, or the right loop run twice: the checker seems to
    # expect exactly ceil(rows / micro) forward/backward pairs and reports any other count as an overlap.
    import jax
    import jax.numpy as jnp

    micro = max(1, micro // 2)
    total = x.shape[0]
    loss_sum, grad_sum = 0.0, jax.tree.map(jnp.zeros_like, params)
    for start in range(0, total, micro):
        xb, yb = x[start : start + micro], y[start : start + micro]
        loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
        w = xb.shape[0] / total
        loss_sum = loss_sum + w * loss
        grad_sum = jax.tree.map(lambda a, g, w=w: a + w * g, grad_sum, grads)
    return loss_sum, grad_sum


# --------------------------------------------------------------------------------------------------------------
# 02.3 median_time (lesson02.check_median_time)


def _timed_calls(fn, args, repeats, wait):
    def one():
        begin = time.perf_counter()
        wait(fn(*args))
        return time.perf_counter() - begin

    one()  # warm-up
    return [one() for _ in range(repeats)]


def median_time_mean(fn, *args, repeats=5):
    # WRONG, accepted. Still returns the mean, as the colleague's version does (sum(times) / len(times)): the
    # exercise asks for the median. The checker's stand-in step takes the same time on every call, so mean,
    # min, max and median coincide; a stand-in with one slow call among the repeats would tell them apart.
    import jax

    times = _timed_calls(fn, args, repeats, jax.block_until_ready)
    return sum(times) / len(times)


def median_time_min(fn, *args, repeats=5):
    # WRONG, accepted: the minimum, not the median (same cause as median_time_mean).
    import jax

    return min(_timed_calls(fn, args, repeats, jax.block_until_ready))


def median_time_one_call(fn, *args, repeats=5):
    # WRONG, accepted: ignores `repeats` and times one call (same cause as median_time_mean).
    import jax

    return _timed_calls(fn, args, 1, jax.block_until_ready)[0]


def median_time_first_leaf(fn, *args, repeats=5):
    # WRONG, accepted. Waits only for the first leaf of the output: a step returning (params, metrics) is timed
    # until its first array is ready. The stand-in returns a single object, so this is never tested.
    import jax

    times = _timed_calls(fn, args, repeats, lambda out: jax.tree.leaves(out)[0].block_until_ready())
    return statistics.median(times)


def median_time_device_get(fn, *args, repeats=5):
    # RIGHT, refused with a false message. jax.device_get(out) waits for the result (and copies it): on a real
    # jitted 1500 x 1500 step it took 324 ms where block_until_ready took 325 ms and the dispatch 0.16 ms.
    # Refused with "median_time never waited for a result": the stand-in's output is not a jax.Array, so
    # device_get and np.asarray return at once. np.asarray(out) is refused the same way.
    import jax

    return statistics.median(_timed_calls(fn, args, repeats, jax.device_get))


# --------------------------------------------------------------------------------------------------------------
# 02.4 train_scan (lesson02.check_train_scan)


def _sgd_scan(loss_fn, params, xs, ys, lr, **scan_kwargs):
    import jax
    from jax import lax

    def step(p, batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, *batch)
        return jax.tree.map(lambda a, g: a - lr * g, p, grads), loss

    return lax.scan(step, params, (xs, ys), **scan_kwargs)


def train_scan_unrolled_by_xla(loss_fn, params, xs, ys, lr):
    # WRONG, accepted. lax.scan(..., unroll=True) keeps the jaxpr one body long, but XLA receives the loop
    # fully unrolled: the compiled HLO has 657 lines for 6 steps and 4758 for 24 (205 and 205 without
    # unroll). The checker prints "your scan 1.80 s, the same loop unrolled 2.42 s" and then "one program that
    # does not grow with the steps": it measures the jaxpr, not the compiled program.
    return _jitted("unrolled")(loss_fn, params, xs, ys, lr)


def train_scan_donating(loss_fn, params, xs, ys, lr):
    # RIGHT (section 6 teaches donation), refused without a verdict: the checker reuses the params it passed
    # and crashes with a bare "RuntimeError: Array has been deleted with shape=float32[2]" instead of saying
    # what is wrong (or copying its params before the call).
    return _jitted("donating")(loss_fn, params, xs, ys, lr)


@cache
def _jitted(
    kind,
):  # one jitted function per answer, made after the device setup (as a notebook cell would)
    import jax

    if kind == "unrolled":
        return jax.jit(partial(_sgd_scan, unroll=True), static_argnums=0)
    return jax.jit(_sgd_scan, static_argnums=0, donate_argnums=1)


# --------------------------------------------------------------------------------------------------------------
# 03.3 batch_norm (lesson03.check_batch_norm)


def batch_norm_frozen_statistics(x):
    # WRONG, accepted. The values are right, but stop_gradient cuts the gradient through the batch mean and
    # variance, which PyTorch's BatchNorm1d differentiates: on a 16 x 3 batch the input gradient differs by 0.95
    # (largest entry 2.8). The exercise is about a batch norm that "trains differently"; the checker compares
    # values only.
    from jax import lax

    mean = lax.stop_gradient(lax.pmean(x, "batch"))
    var = lax.stop_gradient(lax.pmean((x - mean) ** 2, "batch"))
    return (x - mean) * lax.rsqrt(var + 1e-5)


# --------------------------------------------------------------------------------------------------------------
# 03.4 clipped_mean_grad (lesson03.check_clipped_grad)


def clipped_mean_grad_no_clipping(loss_fn, params, xs, ys, max_norm):
    # WRONG, refused for a false reason: no clipping at all, yet the message says "the batch's mean gradient is
    # clipped, not each example's".
    import jax

    grads = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0))(params, xs, ys)
    return jax.tree.map(lambda g: g.mean(axis=0), grads)


# --------------------------------------------------------------------------------------------------------------
# 02.2 bucket_pad (lesson02.check_bucket_pad)


def bucket_pad_before(x):
    # WRONG, refused with a misleading message: pads before the rows and marks the last n rows. The message is
    # "the mask marks 3 rows as real for a batch of 3" (a right count stated as the fault); the fault is where
    # the rows and the mask's true entries are.
    import jax.numpy as jnp

    n = x.shape[0]
    b = 1 << (n - 1).bit_length()
    return jnp.pad(x, ((b - n, 0), (0, 0))), jnp.arange(b) >= b - n


def bucket_pad_nan(x):
    # Debatable (padding content is unspecified), refused with a false hint: NaN padding rows and a right mask.
    # The hint says "the mask must mark the real rows" - it does; the checker's masked mean multiplies by the
    # mask, so NaN * 0 poisons it.
    import jax.numpy as jnp

    n = x.shape[0]
    b = 1 << (n - 1).bit_length()
    return jnp.pad(x, ((0, b - n), (0, 0)), constant_values=jnp.nan), jnp.arange(b) < n


# --------------------------------------------------------------------------------------------------------------
# 04.3 accumulated_grads (lesson04.check_accumulated_grads)


def _micro_batches(batch, n_micro):
    import jax

    return jax.tree.map(lambda a: a.reshape((n_micro, a.shape[0] // n_micro) + a.shape[1:]), batch)


def accumulated_grads_stacked(loss_fn, params, batch, axis_name, n_micro):
    # WRONG, accepted. The scan returns every micro-batch's gradient stacked ([n_micro, ...] per leaf) and
    # averages them after the loop: n_micro copies of the gradient are alive at once, which is what gradient
    # accumulation exists to avoid. The checker's own hint says "nothing that grows with the number of
    # micro-batches may be carried or stacked by the loop", but its model has ~450 parameters against 1024 x 64
    # activations, so the stacked gradients do not show. With 128K-float parameters the compiled temporaries
    # grow 1.16 MB -> 4.28 MB -> 17.0 MB at n_micro 2 / 8 / 32 (the carried sum: 0.62 -> 0.55 -> 0.53 MB).
    import jax
    from jax import lax

    _, grads = lax.scan(
        lambda c, mb: (c, jax.grad(loss_fn)(params, mb)), 0, _micro_batches(batch, n_micro)
    )
    return lax.pmean(jax.tree.map(lambda g: g.mean(axis=0), grads), axis_name)


def accumulated_grads_all_gather(loss_fn, params, batch, axis_name, n_micro):
    # WRONG, accepted. No all-reduce at all: every device all-gathers every other device's gradient and
    # averages locally, receiving (n - 1) x the gradient bytes where a ring all-reduce sends 2 (n - 1) / n
    # (3.5x more on 8 devices). The checker prints "(0 array(s) reduced once)" next to its check mark.
    import jax
    import jax.numpy as jnp
    from jax import lax

    def add(total, mb):
        return jax.tree.map(jnp.add, total, jax.grad(loss_fn)(params, mb)), None

    total, _ = lax.scan(add, jax.tree.map(jnp.zeros_like, params), _micro_batches(batch, n_micro))
    return jax.tree.map(lambda g: lax.all_gather(g / n_micro, axis_name).mean(axis=0), total)


# --------------------------------------------------------------------------------------------------------------
# The cases, and a runner that calls each checker as its check cell does.

DEFECTS = [
    # (exercise, what a correct checker does, function, note)
    ("02.3", "refuse", median_time_mean, "mean, as in the bug being fixed"),
    ("02.3", "refuse", median_time_min, "minimum"),
    ("02.3", "refuse", median_time_one_call, "ignores repeats"),
    ("02.3", "refuse", median_time_first_leaf, "waits for the first output leaf only"),
    ("02.3", "accept", median_time_device_get, "device_get waits for a real step"),
    ("04.3", "refuse", accumulated_grads_stacked, "n_micro gradients stacked"),
    ("04.3", "refuse", accumulated_grads_all_gather, "all_gather instead of an all-reduce"),
    ("02.4", "refuse", train_scan_unrolled_by_xla, "scan(unroll=True): the compiled program grows"),
    ("02.4", "accept", train_scan_donating, "donated params crash the checker"),
    ("00.3", "refuse", split_and_sum_whole_x_to_host, "np.asarray(x) moves every row"),
    ("00.3", "refuse", split_and_sum_total_on_last_device, "ignores the device argument"),
    ("00.3", "refuse", split_and_sum_eight_devices, "hard-codes 8 devices"),
    ("00.3", "refuse", split_and_sum_error_without_fix, "error names no fix"),
    ("00.3", "refuse", split_and_sum_float_total, "int32 total becomes float32"),
    ("00.3", "accept", split_and_sum_partials_added_on_host, "partials added on the host"),
    ("00.3", "accept", split_and_sum_device_put_of_lists, "device_put of a list of blocks"),
    ("01.3", "refuse", safe_distance_threshold, "zero below |p - q| ~ 3e-5"),
    ("01.3", "refuse", safe_distance_small_epsilon, "epsilon 1e-14: 0.5% off at 1e-6"),
    ("00.2", "refuse", cpu_env_copy_copy, "copy.copy(os.environ) writes through"),
    ("00.2", "refuse", cpu_env_replaces_count_2_only, "special-cases a stale count of 2"),
    ("03.3", "refuse", batch_norm_frozen_statistics, "no gradient through the statistics"),
    ("01.1", "refuse", dropout_same_columns_every_row, "one mask shared by every row"),
    ("01.1", "message", dropout_mask_per_column, "refused by chance, hint about p"),
    ("01.4", "accept", accumulate_smaller_micro_batches, "micro // 2 rows per micro-batch"),
    ("03.4", "message", clipped_mean_grad_no_clipping, "no clipping, 'mean gradient is clipped'"),
    ("02.2", "message", bucket_pad_before, "'marks 3 rows as real for a batch of 3'"),
    ("02.2", "message", bucket_pad_nan, "'the mask must mark the real rows' (it does)"),
]


def _checker(exercise, devices):
    from course_tools.checks import lesson00, lesson01, lesson02, lesson03, lesson04

    return {
        "00.2": lambda fn: lesson00.check_cpu_env(fn),
        "00.3": lambda fn: lesson00.check_split_and_sum(fn, devices),
        "01.1": lambda fn: lesson01.check_dropout(fn),
        "01.3": lambda fn: lesson01.check_safe_distance(fn),
        "01.4": lambda fn: lesson01.check_accumulate(fn),
        "02.2": lambda fn: lesson02.check_bucket_pad(fn),
        "02.3": lambda fn: lesson02.check_median_time(fn),
        "02.4": lambda fn: lesson02.check_train_scan(fn),
        "03.3": lambda fn: lesson03.check_batch_norm(fn, devices),
        "03.4": lambda fn: lesson03.check_clipped_grad(fn),
        "04.3": lambda fn: lesson04.check_accumulated_grads(fn, devices),
    }[exercise]


def main(prefixes):
    import contextlib
    import io

    from course_lib.devices import setup_devices

    report = setup_devices(8, "cpu")
    still = 0
    for exercise, should, fn, note in DEFECTS:
        if prefixes and not any(exercise.startswith(p) for p in prefixes):
            continue
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                _checker(exercise, report.devices)(fn)
            verdict, message = "accepted", out.getvalue().strip().splitlines()[-1:]
        except Exception as e:  # an ExerciseError, or the checker's own crash
            verdict, message = "refused", [f"{type(e).__name__}: {e}".splitlines()[0]]
        if should == "message":  # refused either way: read whether the message now names the fault
            mark = "READ  " if verdict == "refused" else "DEFECT"
        else:
            mark = "ok    " if (verdict == "accepted") == (should == "accept") else "DEFECT"
        still += mark == "DEFECT"
        print(f"{mark} {exercise} {fn.__name__} ({note}): {verdict}; should {should}")
        print(f"         {' '.join(message)[:200]}")
    print(
        f"{still} case(s) judged wrongly; READ: a wrong answer refused, check that its message is now true"
    )


if __name__ == "__main__":
    main(sys.argv[1:])

"""Lesson 02, exercise 2: pad variable-length batches into power-of-two buckets.

Spec: ``bucket_pad(x) -> (x_padded, mask)`` for ``x`` float32 ``[n, d]`` (``n >= 1``): ``x_padded`` is
``[b, d]`` with ``b`` the smallest power of two ``>= n`` (so ``n <= b < 2n``: at most half the rows are
padding), ``x`` in its first ``n`` rows and finite values (zeros) in the others; ``mask`` is ``[b]``, true (or 1) at
the ``n`` real rows only. Its
outputs keep one dtype for every ``n``, so that a jitted step compiles once per bucket: for ``n`` = 1 … 40
that is 7 programs (1, 2, 4, …, 64 rows) where unpadded batches would need 40 and padding everything to
the largest batch (64) would waste up to 63 of 64 rows.

The checker runs a jitted masked mean on :data:`LENGTHS`, both ends of every bucket from 1 to 40 rows
(random values, width 4), and counts
its traces; a trace count above the number of buckets is explained by what changed inside a bucket (the
shape, a dtype, a weak type).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ._common import call_answer, fail

LENGTHS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 40)
"""The batch lengths tried, in order: both ends of every bucket from 1 to 64 rows."""


def _bucket(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _signature(a) -> tuple:
    import jax

    return (tuple(a.shape), str(a.dtype), bool(getattr(jax.typeof(a), "weak_type", False)))


def _judge_one(n: int, d: int, x: np.ndarray, out) -> tuple:
    if not isinstance(out, tuple | list) or len(out) != 2:
        fail("expected a pair (x_padded, mask)", "return both: the padded batch and the mask")
    xp, mask = out
    b = _bucket(n)
    rows = int(np.shape(xp)[0]) if np.ndim(xp) == 2 else -1
    if np.shape(xp)[1:] != (d,):
        fail(f"a batch of shape ({n}, {d}) came back as {tuple(np.shape(xp))}", "pad only the rows")
    if rows < n or rows & (rows - 1) or rows >= 2 * n and rows != 1:
        fail(
            f"a batch of {n} rows was padded to {rows} rows; the bucket for {n} is {b} rows",
            "pad to the smallest power of two that holds the rows: n <= b < 2n "
            "(1 << (n - 1).bit_length(), or a loop doubling b)",
        )
    if tuple(np.shape(mask)) != (rows,):
        fail(f"mask shape {tuple(np.shape(mask))}, expected ({rows},)", "one mask entry per row")
    real = np.asarray(mask).astype(bool)
    if real.sum() != n:
        fail(
            f"the mask marks {int(real.sum())} rows as real for a batch of {n}",
            "the mask is true at the first n positions only",
        )
    padded = np.asarray(xp)
    if not np.allclose(padded[:n], x):
        fail("the first rows of x_padded are not x", "keep x in the first n rows; pad after it")
    if not real[:n].all():
        fail(
            f"the mask marks {n} rows as real for a batch of {n}, but not the first {n}, where x is",
            "the mask is true at the first n positions only",
        )
    if not np.isfinite(padded[n:]).all():
        fail(
            f"the padding rows of a {n}-row batch hold NaN or inf",
            "a masked sum multiplies padding by 0, and NaN * 0 is NaN: pad with finite values (zeros)",
        )
    return _signature(xp), _signature(mask)


def _explain_traces(traces: int, signatures: dict, d: int) -> None:
    """More traces than buckets: say what changed inside a bucket."""
    for b, seen in signatures.items():
        if len(seen) > 1:
            (xa, ma), (xb, mb) = sorted(seen)[:2]
            part, one, other = ("x_padded", xa, xb) if xa != xb else ("mask", ma, mb)
            fail(
                f"the jitted step traced {traces} times for {len(signatures)} buckets (width {d}): in "
                f"the {b}-row bucket {part} came back as {one} and as {other} (shape, dtype, weak type)",
                "return the same shape and dtype for every batch of a bucket: a new dtype (or weak type) "
                "is a new compile just as a new shape is",
            )
    fail(
        f"the jitted step traced {traces} times for {len(signatures)} buckets (width {d})",
        "every batch of a bucket must reach the step with the same shapes and dtypes",
    )


def judge_bucket_pad(bucket_pad: Callable) -> int:
    """Run the spec's checks; returns the number of compiled programs (the buckets)."""
    import jax
    import jax.numpy as jnp

    traces = []

    @jax.jit
    def masked_mean(xp, mask):
        traces.append(xp.shape)  # runs only while tracing: one entry per compile
        m = mask.astype(xp.dtype)
        return (xp * m[:, None]).sum(0) / m.sum()

    rng = np.random.default_rng(0)
    for d in (4,):
        traces.clear()
        signatures: dict[int, set] = {}
        for n in LENGTHS:
            x = rng.normal(size=(n, d)).astype(np.float32)
            out = call_answer(f"bucket_pad(x of {n} rows)", bucket_pad, jnp.asarray(x))
            signatures.setdefault(_bucket(n), set()).add(_judge_one(n, d, x, out))
            got = np.asarray(masked_mean(*out))
            if not np.allclose(got, x.mean(0), rtol=1e-5, atol=1e-6):
                fail(
                    f"the masked mean of a {n}-row batch is wrong",
                    "the mask must mark the real rows",
                )
        if len(traces) > len(signatures):
            _explain_traces(len(traces), signatures, d)
    return len(signatures)

"""Lesson 04's memory probe for gradient accumulation: micro-batches exist to bound memory, so the answer's
compiled program (on one device, for a loss whose residuals dominate) must need fewer temporary bytes as the
number of micro-batches grows."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from course_lib.meshes import DATA

from ._common import fail

MEMORY_ROWS, MEMORY_MICRO = 1024, (2, 8)
"""The memory probe: one device's batch of rows, and the two micro-batch counts compared."""


def _temp_bytes(fn: Callable, device, loss_fn: Callable, n_micro: int) -> int:
    """Temporary bytes of the answer's compiled program on one device, for a wide loss (residuals dominate)."""
    k1, k2 = jax.random.split(jax.random.key(5))
    params = {
        "w1": jax.random.normal(k1, (3, 64)),
        "b1": jnp.zeros(64),
        "w2": jax.random.normal(k2, (64, 2)),
    }
    batch = (jnp.ones((1, MEMORY_ROWS, 3)), jnp.ones((1, MEMORY_ROWS, 2)))
    mapped = jax.pmap(
        lambda p, b: fn(loss_fn, p, b, DATA, n_micro),
        axis_name=DATA,
        in_axes=(None, 0),
        devices=[device],
    )
    return mapped.lower(params, batch).compile().memory_analysis().temp_size_in_bytes


def judge_memory(fn: Callable, device, loss_fn: Callable) -> str:
    """Micro-batches exist to bound memory: the program's temporaries must shrink as n_micro grows."""
    few, many = MEMORY_MICRO
    t_few, t_many = (_temp_bytes(fn, device, loss_fn, m) for m in MEMORY_MICRO)
    if t_many > 0.6 * t_few:
        fail(
            f"the compiled program needs {t_few:,} temporary bytes with n_micro={few} and {t_many:,} with "
            f"n_micro={many}: every micro-batch's activations are alive at once",
            "a Python loop, a vmap, or one jax.grad over a sum of the micro-batch losses becomes one program "
            "whose memory does not shrink; run the micro-batches one after another with lax.scan or "
            "lax.fori_loop, each taking its own jax.grad",
        )
    return f"temporaries {t_few:,} B with n_micro={few}, {t_many:,} B with {many}"

"""Lesson 01, exercise 5: predict the memory and FLOPs of ``jax.checkpoint`` around blocks of k layers.

The network is the lesson's section 7: 16 tanh layers sharing one ``f32[128, 128]`` weight, on 512 rows;
one *activation* is one layer's output, 512 × 128 × 4 bytes. For each block size the gradient is
compiled (not run) and measured: ``memory_analysis().temp_size_in_bytes`` in activations, and
``cost_analysis()["flops"]`` against the program without checkpointing. The programs are compiled for
the CPU backend (``jax.devices("cpu")``) on every host, so the numbers are XLA:CPU's wherever the lesson
runs: another compiler schedules memory differently. Under JAX 0.10.2 (the second environment) XLA:CPU
removes the optimization barriers around the recomputation (its pass ``cse_barrier_expander``) before a CSE
pass that merges the recomputation away (lesson 01, section 7): there the programs are compiled without
that pass (:data:`KEEP_BARRIERS`), as XLA:CPU of JAX 0.12 compiles them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from numbers import Number

import numpy as np

from ._common import fail, not_written

LAYERS, WIDTH, ROWS = 16, 128, 512
BLOCKS = (1, 2, 4, 8, 16)
"""The block sizes measured (every divisor of LAYERS)."""
BLOCK_QUESTIONS = ("best block", "k=1", "k=2", "k=8", "k=16", "flops k=1")
"""What the learner predicts: the block size with the least memory, the memory at four block sizes (in
activations), and the FLOPs at k=1 as a multiple of the FLOPs without checkpointing."""
ACTIVATION_TOLERANCE, RATIO_TOLERANCE = 1.5, 0.05
KEEP_BARRIERS = {"xla_disable_hlo_passes": "cse_barrier_expander"}
"""The compiler option that keeps JAX 0.10.2's XLA:CPU from merging a checkpoint's recomputation away."""


def barriers_merged(platform: str | None = None) -> bool:
    """Whether programs for ``platform`` (default: JAX's default backend) need :data:`KEEP_BARRIERS`: XLA:CPU
    under JAX < 0.11, which merges a checkpoint's recomputation away by default. Never on another
    platform: XLA:TPU needs ``cse_barrier_expander`` (without it: ``UNIMPLEMENTED: HLO opt-barrier is not
    implemented on TPU``, JAX 0.10.2, TPU v5e)."""
    import jax

    platform = platform or jax.default_backend()
    return platform == "cpu" and jax.__version_info__ < (0, 11)


def _loss(w, x, block):
    import jax
    import jax.numpy as jnp

    def run_block(x, w):
        for _ in range(block or 1):
            x = jnp.tanh(x @ w)
        return x

    step = jax.checkpoint(run_block) if block else run_block
    for _ in range(LAYERS // (block or 1)):
        x = step(x, w)
    return jnp.mean(x**2)


@functools.cache
def measure_blocks() -> dict:
    """``{block: (temporary memory in activations, FLOPs / FLOPs without checkpoint)}``, ``None`` = none."""
    import jax

    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(3)
    w = jax.device_put(rng.normal(size=(WIDTH, WIDTH)).astype(np.float32) / np.sqrt(WIDTH), cpu)
    x = jax.device_put(rng.normal(size=(ROWS, WIDTH)).astype(np.float32), cpu)
    activation = ROWS * WIDTH * 4
    options = KEEP_BARRIERS if barriers_merged("cpu") else None
    raw = {}
    for block in (None, *BLOCKS):
        lowered = jax.jit(jax.grad(functools.partial(_loss, block=block))).lower(w, x)
        compiled = lowered.compile(compiler_options=options)
        raw[block] = (
            compiled.memory_analysis().temp_size_in_bytes / activation,
            compiled.cost_analysis()["flops"],
        )
    return {block: (temp, flops / raw[None][1]) for block, (temp, flops) in raw.items()}


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Number | np.number):
        fail(
            f"the prediction for {name!r} is {value!r}, not a number",
            "write a number for every entry (a block size, a count of activations, a ratio such as 1.5)",
        )
    return float(value)


def judge_blocks(predictions: Mapping | None) -> dict:
    """The learner's predictions against :func:`measure_blocks`; returns the measurement, or fails with
    the number of wrong predictions (never which)."""
    hint = "write a number for every entry of block_predictions, then run this cell"
    values = dict(predictions or {})
    if all(v is None or v is Ellipsis for v in values.values()):
        not_written("the checkpoint predictions", hint)
    missing = [q for q in BLOCK_QUESTIONS if values.get(q) is None or values.get(q) is Ellipsis]
    if missing:
        fail(f"no prediction for {missing[0]!r}", hint)
    guesses = {q: _number(q, values[q]) for q in BLOCK_QUESTIONS}
    measured = measure_blocks()
    best = min(BLOCKS, key=lambda k: measured[k][0])
    wrong = int(guesses["best block"] != best)
    for q in ("k=1", "k=2", "k=8", "k=16"):
        wrong += abs(guesses[q] - measured[int(q[2:])][0]) > ACTIVATION_TOLERANCE
    wrong += abs(guesses["flops k=1"] - measured[1][1]) > RATIO_TOLERANCE
    if wrong:
        fail(
            f"{wrong} of your {len(BLOCK_QUESTIONS)} predictions are off (activations by more than "
            f"{ACTIVATION_TOLERANCE}, the FLOP ratio by more than {RATIO_TOLERANCE})",
            "with blocks of k layers, the gradient keeps each block's input until the backward pass "
            "reaches it, and while one block is recomputed, that block's k outputs; count both for each "
            "k. For the FLOPs: a backward pass costs about two forward passes; how many forward passes "
            "does a checkpointed gradient run, and does that depend on k?",
        )
    return measured

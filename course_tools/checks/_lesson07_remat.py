"""Lesson 07's exercise 2 (exported by :mod:`course_tools.checks.lesson07`): a gradient checkpoint that
saves nothing, and the block size that saves most.

The learner's loss is compiled under ``jax.value_and_grad`` for deep tanh MLPs of several depths; its
gradient is compared with the plain one's, and its temporaries (``memory_analysis()``) with those of
checkpointing blocks of about √L consecutive layers in the same form (a Python loop, or a `lax.scan`), which the
checker compiles itself on the same platform.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from course_lib.programs import jaxpr_equations

from ._common import call_answer, close, fail, matmul_rtol
from ._lesson01_blocks import KEEP_BARRIERS, barriers_merged

DEPTHS = (4, 9, 25)
"""The depths the exercise names: their best block sizes differ (2, 3, 5), so no one block size fits them
all."""
UNNAMED_DEPTHS = (12, 16, 20)
"""Each check also judges one of these, drawn at random: depths the exercise does not name, so a block
size looked up for the named depths does not pass."""
_BATCH, _WIDTH = 512, 32


def layer(h, w):
    """One layer of exercise 2's MLP: ``tanh(h @ w)``, h f32[batch, width], w f32[width, width]."""
    return jnp.tanh(h @ w)


def mlp_loss(weights, x):
    """The MLP's loss without checkpointing: ``mean(h_L ** 2)``, weights f32[L, width, width]."""
    h = x
    for i in range(weights.shape[0]):
        h = layer(h, weights[i])
    return jnp.mean(h**2)


def blocks_loss(weights, x, k: int):
    """The loss with every block of ``k`` consecutive layers under one ``jax.checkpoint`` (the last block
    shorter when ``k`` does not divide L)."""

    def block(h, w_block):
        for i in range(w_block.shape[0]):
            h = layer(h, w_block[i])
        return h

    h = x
    for start in range(0, weights.shape[0], k):
        h = jax.checkpoint(block)(h, weights[start : start + k])
    return jnp.mean(h**2)


def unnamed_depth() -> int:
    """One of :data:`UNNAMED_DEPTHS`, drawn at random (a fresh draw every check)."""
    return int(np.random.default_rng().choice(UNNAMED_DEPTHS))


def problem(depth: int):
    """``(weights f32[depth, 32, 32], x f32[512, 32])`` for a depth."""
    rng = np.random.default_rng(depth)  # NumPy: nothing to compile before the programs judged
    weights = rng.standard_normal((depth, _WIDTH, _WIDTH), np.float32) / np.float32(np.sqrt(_WIDTH))
    return jnp.asarray(weights), jnp.asarray(rng.standard_normal((_BATCH, _WIDTH), np.float32))


def activation_bytes() -> int:
    """Bytes of one layer's activation, ``[512, 32]`` float32: the unit the messages count in."""
    return _BATCH * _WIDTH * 4


def compiled_grad(loss: Callable, weights, x):
    """``jax.jit(jax.value_and_grad(loss))`` compiled for ``(weights, x)``.

    Under JAX 0.10.2 XLA:CPU removes the optimization barriers around a checkpoint's recomputation (its
    pass ``cse_barrier_expander``) before a CSE pass merges the recomputation away, so a checkpointed
    gradient there keeps more temporaries than the plain one (lesson 01, section 7); JAX 0.12's XLA:CPU
    keeps the barriers. Under JAX < 0.11 the programs are compiled without that pass
    (:data:`._lesson01_blocks.KEEP_BARRIERS`; a compiler that has no such pass runs as it would), which
    gives JAX 0.12's temporaries."""
    options = KEEP_BARRIERS if barriers_merged() else None
    return jax.jit(jax.value_and_grad(loss)).lower(weights, x).compile(compiler_options=options)


def temp_bytes(compiled) -> int:
    """Temporary bytes of a compiled program (per device, ``memory_analysis()``)."""
    return int(compiled.memory_analysis().temp_size_in_bytes)


def best_block(depth: int) -> int:
    """``round(√depth)``: the block size that makes ``depth / k + k`` (block inputs kept, plus one block's
    activations recomputed) smallest, to within one."""
    return max(1, round(float(np.sqrt(depth))))


@functools.cache
def reference(depth: int):
    """``(value, gradient, temporaries)`` of the loss with blocks of ``best_block(depth)`` layers."""
    weights, x = problem(depth)
    compiled = compiled_grad(functools.partial(blocks_loss, k=best_block(depth)), weights, x)
    value, grad = compiled(weights, x)
    return value, grad, temp_bytes(compiled)


@functools.cache
def plain_temps(depth: int) -> int:
    """Temporaries of the gradient without any checkpoint (compiled only to explain a refusal)."""
    return temp_bytes(compiled_grad(mlp_loss, *problem(depth)))


def scan_blocks_loss(weights, x, k: int):
    """The loss with the layers in a ``lax.scan`` over blocks of ``k`` consecutive layers, the scan's body
    under ``jax.checkpoint`` (the layers left over, L mod k, one more checkpointed block after it): the
    idiomatic scan-over-layers form, the reference for answers whose layers run in a loop."""

    def block(h, w_block):
        for i in range(w_block.shape[0]):
            h = layer(h, w_block[i])
        return h

    n_blocks = weights.shape[0] // k
    stacked = weights[: n_blocks * k].reshape((n_blocks, k) + weights.shape[1:])
    h, _ = jax.lax.scan(jax.checkpoint(lambda h, wb: (block(h, wb), None)), x, stacked)
    if weights.shape[0] % k:
        h = jax.checkpoint(block)(h, weights[n_blocks * k :])
    return jnp.mean(h**2)


@functools.cache
def scan_reference(depth: int) -> int:
    """Temporaries of :func:`scan_blocks_loss` with blocks of ``best_block(depth)`` layers."""
    loss = functools.partial(scan_blocks_loss, k=best_block(depth))
    return temp_bytes(compiled_grad(loss, *problem(depth)))


def layers_in_loops(fn: Callable, weights, x) -> int:
    """How many of the forward pass's layer applications (``tanh``) run inside a loop body (``lax.scan``,
    ``fori_loop``): each ``tanh`` of a body counted as often as the loop runs it."""
    return sum(
        times
        for e, times in jaxpr_equations(jax.make_jaxpr(fn)(weights, x))
        if e.primitive.name == "tanh" and times > 1
    )


def check_remat_loss(fn: Callable) -> list[tuple[int, float, float]]:
    """Judge a checkpointed loss (exercise 2).

    Spec: ``fn(weights, x)`` — weights f32[L, 32, 32] of ``L`` layers ``tanh(h @ w)``, x f32[512, 32] —
    returns :func:`mlp_loss`'s value, and for every depth of :data:`DEPTHS` and one of
    :data:`UNNAMED_DEPTHS` (drawn at random)

    - its value and its gradient w.r.t. the weights equal the plain loss's to 1e-5 (compared with the
      blocks' program, which computes the same numbers);
    - the compiled gradient's temporaries are at most 5 % above those of checkpointing blocks of
      ``round(√L)`` consecutive layers in the same form as the answer's (measured with
      ``memory_analysis()`` on this platform; any other split that does as well passes too): a Python loop
      of blocks (:func:`blocks_loss`), or, when all but fewer than ``round(√L)`` of the answer's layers run
      inside a loop body (``lax.scan``, ``fori_loop``), a scan over checkpointed blocks
      (:func:`scan_blocks_loss`) — a scan stacks what each iteration saves for the backward pass into
      arrays of its own, so the two forms compile to different temporaries (on XLA:CPU the scan's are
      larger); each is judged against the best of its own form.

    Returns ``[(depth, temporaries, reference temporaries)]`` in activations (:func:`activation_bytes`);
    raises ExerciseError naming the first broken rule.
    """
    act = activation_bytes()
    rows = []
    for depth in (*DEPTHS, unnamed_depth()):
        weights, x = problem(depth)
        compiled = call_answer(
            f"jax.value_and_grad(remat_loss) for {depth} layers", compiled_grad, fn, weights, x
        )
        value, g = call_answer(f"remat_loss for {depth} layers", compiled, weights, x)
        want_value, want_g, best = reference(depth)
        rtol = matmul_rtol()  # against the plain MLP: the platform's float32 matmul rounding
        if not close(value, want_value, rtol) or not close(g, want_g, rtol):
            fail(
                f"with {depth} layers the loss or its gradient differs from the plain MLP's",
                "jax.checkpoint changes what is stored, never the numbers: apply every layer "
                "tanh(h @ w) in order, once, and return mean(h ** 2)",
            )
        looped = layers_in_loops(fn, weights, x) > depth - best_block(depth)
        if looped:
            best = scan_reference(depth)
        mine = temp_bytes(compiled)
        rows.append((depth, mine / act, best / act))
        if mine > 1.05 * best:
            plain = plain_temps(depth)
            form = "in a loop like yours (lax.scan over checkpointed blocks) " if looped else ""
            fail(
                f"with {depth} layers the gradient's temporaries are {mine / act:.1f} activations "
                f"([512, 32] float32 each); without any checkpoint {plain / act:.1f}; the best split "
                f"into checkpointed blocks of consecutive layers {form}{best / act:.1f}",
                "jax.checkpoint keeps its function's inputs and recomputes the rest in the backward "
                "pass. Around one layer it keeps that layer's input, which plain autodiff kept anyway; "
                "around the whole loss it keeps only the inputs, but the backward pass then recomputes "
                "the whole forward pass and needs all its activations at once again. Checkpoint blocks of "
                "k layers: the backward pass then holds at most about the L/k block inputs plus one "
                "block's k activations: count what it holds as a function of k, and choose k from L",
            )
    return rows

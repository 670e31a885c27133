"""Checkers for ``07_debugging.ipynb``: predicted memory of a donating update, a gradient checkpoint that
saves nothing (debug this, then choose the block size), and a training loop that keeps the devices busy
while the host works.

None of them holds an answer: memory is measured with ``memory_analysis()`` (of the update; of the
checkpointed gradient, against every block size the checker compiles itself); the loop is observed through
the step, batch and log functions the checker hands it (when each step ran on the device, when the host
worked, and what overlapped).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from . import _lesson07_loop as _loop
from . import _lesson07_remat as _remat
from ._common import call_answer, checker, fail, passed

# ---- exercise 1: predict the memory of a donating update ---------------------------------------------------

DONATIONS = ((), (0,), (0, 2), (0, 1, 2))


def momentum_update(params, grads, velocity):
    """The update of exercise 1 (the question, as the notebook shows it): SGD with momentum."""
    velocity = jax.tree.map(lambda v, g: 0.9 * v + g, velocity, grads)
    params = jax.tree.map(lambda p, v: p - 0.01 * v, params, velocity)
    return params, velocity


def _measured_memory(donate: tuple[int, ...]) -> tuple[float, float, float]:
    rng = np.random.default_rng(len(donate))
    shapes = {"w": (int(rng.integers(200, 400)), 128), "b": (128,)}
    tree = lambda: {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}  # noqa: E731
    size = sum(int(np.prod(s)) * 4 for s in shapes.values())  # bytes of one tree
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Some donated buffers were not usable" for (0, 1, 2)
        mem = (
            jax.jit(momentum_update, donate_argnums=donate)
            .lower(tree(), tree(), tree())
            .compile()
            .memory_analysis()
        )
    return tuple(
        round(b / size, 2)
        for b in (mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes)
    )


_MEMORY_RULES = (
    "reread section 4 (High peak memory: measure it, then donate buffers): for each variant ask which "
    "buffers the program receives, which it returns, and which of the returned ones can be written "
    "into a donated buffer"
)


@checker
def check_memory_prediction(predict: Callable[[], dict]) -> bool:
    """Judge predicted memory of :func:`momentum_update` under four donations (exercise 1).

    Spec: ``predict()`` returns ``{donate_argnums: (argument, output, alias)}`` for each of
    :data:`DONATIONS`, in units of one tree's bytes, each within 0.05 of what ``memory_analysis()`` of
    ``jax.jit(momentum_update, donate_argnums=d)`` reports (trees of a random size, so the unit cannot be
    guessed from bytes). A wrong answer is told how many of the twelve numbers are wrong, never which.
    """
    got = call_answer("predict_memory", predict)
    if not isinstance(got, dict) or {
        tuple(k) if isinstance(k, (tuple, list)) else (k,) for k in got
    } != set(DONATIONS):
        fail(
            f"predict_memory returned {got!r}",
            f"return a dict with the keys {list(DONATIONS)}, each (argument, output, alias)",
        )
    got = {tuple(k) if isinstance(k, (tuple, list)) else (k,): v for k, v in got.items()}
    wrong = 0
    for donate in DONATIONS:
        measured = _measured_memory(donate)
        try:
            predicted = tuple(float(v) for v in got[donate])
            assert len(predicted) == 3
        except (TypeError, ValueError, AssertionError):
            fail(
                f"{donate}: {got[donate]!r} is not three numbers",
                "give (argument, output, alias) in units of one tree",
            )
        wrong += sum(abs(p - m) > 0.05 for p, m in zip(predicted, measured))
    if wrong:
        fail(
            f"{wrong} of your {3 * len(DONATIONS)} numbers differ from what memory_analysis() reports",
            _MEMORY_RULES,
        )
    return passed(
        "argument, output and alias bytes of all four variants, as memory_analysis() reports them"
    )


# ---- exercise 2: a checkpoint that saves nothing ----------------------------------------------------------

layer = _remat.layer
mlp_loss = _remat.mlp_loss


@checker
def check_remat_loss(fn: Callable) -> bool:
    """Exercise 2; the spec is :func:`course_tools.checks._lesson07_remat.check_remat_loss`'s."""
    rows = _remat.check_remat_loss(fn)
    said = "; ".join(
        f"{d} layers: {mine:.1f} (blocks of ~√L: {best:.1f})" for d, mine, best in rows
    )
    return passed(
        f"gradients equal the plain MLP's; temporaries in activations, {said} (memory_analysis() on "
        f"{jax.default_backend()})"
    )


# ---- exercise 3: keep the devices busy -----------------------------------------------------------------------


@checker
def check_train_loop(fn: Callable) -> bool:
    """Exercise 3; the spec is :func:`course_tools.checks._lesson07_loop.check_train_loop`'s."""
    overlapped, total, took = _loop.check_train_loop(fn)
    return passed(
        f"all {_loop.N_STEPS} steps logged in order with their losses; the devices computed during "
        f"{overlapped * 1e3:.0f} of the {total * 1e3:.0f} ms the host spent making batches "
        f"(the loop took {took:.2f} s)"
    )

"""Lesson 04's memory probe for gradient accumulation. Micro-batches exist to bound memory, judged two ways:

- on every platform, by the traced program (platform-independent): each micro-batch's forward pass (the
  probe loss's ``tanh`` on ``b // n_micro`` rows) must sit inside a loop body (``lax.scan``,
  ``lax.fori_loop``, ``lax.while_loop``, ``lax.map``), so that the micro-batches run one after another
  and one iteration's buffers serve every micro-batch; a Python loop, a ``vmap`` or one ``jax.grad`` of
  their summed losses put every forward pass into one straight-line program instead; and what that loop
  carries or stacks must not grow with ``n_micro`` (stacked per-micro-batch gradients do). A Python loop
  over ``jax.checkpoint``'d micro-batch losses is refused too, unlike in lesson 01's exercise 4, which runs
  eagerly, one operation after another in the order Python issues them: inside one compiled program the
  order is the compiler's, and XLA:CPU (JAX 0.12 and 0.10.2) keeps the same temporaries for it as for a
  plain Python loop, 540,696 B at both ``n_micro`` of the probe (``tests/test_checks_lesson04.py``);
- where the program is XLA:CPU's, also by its compiled temporary memory (``memory_analysis``), which must
  shrink as ``n_micro`` grows. Another compiler schedules buffers its own way, so elsewhere the bytes are
  printed, not judged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

from course_lib.meshes import DATA

from ._common import fail

MEMORY_ROWS, MEMORY_MICRO = 1024, (2, 8)
"""The memory probe: one device's batch of rows, and the two micro-batch counts compared."""
LOOPS = ("scan", "while")
CHECKPOINTS = ("checkpoint", "remat", "remat2")
"""The names ``jax.checkpoint``'s primitive has had (``remat2`` in JAX 0.10.2 and 0.12)."""


def _inputs():
    k1, k2 = jax.random.split(jax.random.key(5))
    params = {
        "w1": jax.random.normal(k1, (3, 64)),
        "b1": jnp.zeros(64),
        "w2": jax.random.normal(k2, (64, 2)),
    }
    return params, (jnp.ones((1, MEMORY_ROWS, 3)), jnp.ones((1, MEMORY_ROWS, 2)))


def _mapped(fn: Callable, device, loss_fn: Callable, n_micro: int):
    return jax.pmap(
        lambda p, b: fn(loss_fn, p, b, DATA, n_micro),
        axis_name=DATA,
        in_axes=(None, 0),
        devices=[device],
    )


def _walk(jaxpr, in_loop: bool = False) -> Iterator[tuple]:
    """(equation, inside a loop body) for every equation, nested programs included."""
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn, in_loop
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    yield from _walk(sub, in_loop or eqn.primitive.name in LOOPS)


def judge_loop(fn: Callable, device, loss_fn: Callable) -> None:
    """Every forward pass of the probe loss is inside a loop body (the platform-independent part)."""
    params, batch = _inputs()
    n_micro = MEMORY_MICRO[1]
    jaxpr = jax.make_jaxpr(_mapped(fn, device, loss_fn, n_micro))(params, batch)
    outside = [
        tuple(e.outvars[0].aval.shape)
        for e, in_loop in _walk(jaxpr)
        if e.primitive.name == "tanh" and not in_loop
    ]
    checkpointed = any(e.primitive.name in CHECKPOINTS for e, _ in _walk(jaxpr))
    if outside:
        fail(
            f"with n_micro={n_micro}, loss_fn's forward pass runs outside any loop ({len(outside)} "
            f"time(s), on activations of shape {outside[0]}): the micro-batches are in one "
            "straight-line program, where all their activations may be alive at once",
            (
                "jax.checkpoint around each micro-batch does not change that inside one compiled program: "
                "the order of its operations is the compiler's (run eagerly, as in lesson 01, it would be "
                "Python's); "
                if checkpointed
                else "a Python loop, a vmap or one jax.grad over a sum of the "
                "micro-batch losses does that; "
            )
            + "run the micro-batches one after another with lax.scan or lax.fori_loop, each taking its own "
            "jax.grad",
        )


def _has_forward(eqn) -> bool:
    """Whether the probe loss's forward pass (its tanh) runs inside ``eqn``'s nested programs."""
    return any(e.primitive.name == "tanh" for e, _ in _walk(_Eqns([eqn])))


class _Eqns:
    """A list of equations that :func:`_walk` walks like a jaxpr's."""

    def __init__(self, eqns):
        self.eqns = eqns


def loop_output_elements(fn: Callable, device, loss_fn: Callable, n_micro: int) -> int:
    """Elements (summed over arrays) that the loops over micro-batches carry or stack, for ``n_micro``."""
    import math

    params, batch = _inputs()
    jaxpr = jax.make_jaxpr(_mapped(fn, device, loss_fn, n_micro))(params, batch)
    return sum(
        math.prod(v.aval.shape)
        for e, in_loop in _walk(jaxpr)
        if e.primitive.name in LOOPS and not in_loop and _has_forward(e)
        for v in e.outvars
    )


def judge_growth(fn: Callable, device, loss_fn: Callable) -> None:
    """What the loop keeps must not grow with ``n_micro`` by more than a few scalars per micro-batch (its
    losses, say): n_micro stacked gradients are what accumulation exists to avoid (every platform)."""
    few, many = MEMORY_MICRO
    kept = {m: loop_output_elements(fn, device, loss_fn, m) for m in MEMORY_MICRO}
    if kept[many] - kept[few] > 16 * (many - few):
        fail(
            f"the loop over micro-batches carries or stacks {kept[few]:,} numbers with n_micro={few} and "
            f"{kept[many]:,} with n_micro={many}: it keeps something per micro-batch (each one's gradient?)",
            "keep only the running sum of gradients between micro-batches: nothing that grows with the "
            "number of micro-batches may be carried or stacked by the loop",
        )


def _temp_bytes(fn: Callable, device, loss_fn: Callable, n_micro: int) -> int:
    params, batch = _inputs()
    mapped = _mapped(fn, device, loss_fn, n_micro)
    return mapped.lower(params, batch).compile().memory_analysis().temp_size_in_bytes


def judge_memory(fn: Callable, device, loss_fn: Callable) -> str:
    """The loop (every platform), then the compiled temporaries (judged on XLA:CPU only); a summary."""
    judge_loop(fn, device, loss_fn)
    judge_growth(fn, device, loss_fn)
    few, many = MEMORY_MICRO
    t_few, t_many = (_temp_bytes(fn, device, loss_fn, m) for m in MEMORY_MICRO)
    summary = f"temporaries {t_few:,} B with n_micro={few}, {t_many:,} B with {many}"
    if device.platform != "cpu":
        return f"{summary} (XLA:{device.platform.upper()}'s schedule, not judged)"
    if t_many > 0.6 * t_few:
        unroll = unrolled(fn, device, loss_fn, many)
        fail(
            f"the compiled program needs {t_few:,} temporary bytes with n_micro={few} and {t_many:,} with "
            f"n_micro={many} (XLA:CPU): the memory does not shrink with smaller micro-batches",
            f"your loop over micro-batches is unrolled ({unroll} micro-batches per iteration with "
            f"n_micro={many}): unroll copies the body into straight-line code, where the copies' "
            "activations may be alive at once; leave unroll at its default, 1"
            if unroll > 1
            else "keep only the running sum of gradients between micro-batches: nothing that grows with "
            "the number of micro-batches may be carried or stacked by the loop",
        )
    return summary


def unrolled(fn: Callable, device, loss_fn: Callable, n_micro: int) -> int:
    """The largest ``unroll`` of the loops over micro-batches (a scan's parameter: ``unroll=True`` is its
    length; ``lax.fori_loop(..., unroll=)`` traces to such a scan); 1 when none is unrolled."""
    params, batch = _inputs()
    jaxpr = jax.make_jaxpr(_mapped(fn, device, loss_fn, n_micro))(params, batch)
    return max(
        (
            int(e.params.get("unroll", 1))
            for e, in_loop in _walk(jaxpr)
            if e.primitive.name in LOOPS and not in_loop and _has_forward(e)
        ),
        default=1,
    )

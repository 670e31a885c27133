"""Library functions held out of the student package: the learner's accepted answer runs in their place.

Some functions of :mod:`course_lib` are what an exercise asks the learner to write (lesson 10's ring
attention, for one). In the repository they are whole; in the student package
(``python -m course_tools.student --zip``) their bodies are cut out like a notebook's solutions: the body
sits between ``# BEGIN SOLUTION  # STUB: …`` and ``# END SOLUTION``, and the stub on the BEGIN line hands
the call to :func:`call`. The exercise's checker, once it accepts an answer, gives it to :func:`register`,
so the cells after the exercise (and the later lessons) run on the learner's own function.

Each held function is named in :data:`EXERCISES` with the exercise that writes it; calling it in the
package before that exercise is accepted raises :class:`HeldOut`, whose message names the exercise.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "EXERCISES",
    "REPLACED",
    "HeldOut",
    "call",
    "checkpoint_policy",
    "register",
    "registered",
    "unrolled_loops",
]

EXERCISES = {
    "splits.ring_attention": (
        "exercise 3 of lesson 10 (notebooks/10_transformers.ipynb, ring_attention)"
    ),
    "splits.zero3_blocks": "exercise 4 of lesson 10 (notebooks/10_transformers.ipynb, zero3_blocks)",
    "op_schedules.zb_h1": (
        "exercise 3 of lesson 11 (notebooks/11_pipeline_experts.ipynb, zb_h1_orders)"
    ),
}
"""The held functions (``module.name`` in :mod:`course_lib`) and the exercise that writes each."""

REPLACED = {
    "splits_zigzag.ring_attention_at": (
        "exercise 3 of lesson 10's ring with positions: the package computes its values with "
        "splits_zigzag._gathered_at (K, V and positions gathered whole, no ring)"
    ),
}
"""Functions whose body is held out too, but whose stub computes the same values another way (one the
exercise does not accept): their callers take arguments no exercise's answer takes."""

_ANSWERS: dict[str, Callable] = {}
_GIVEN = object()
"""``call``'s ``checkpoint`` when not given: the answer's own ``jax.checkpoint`` calls are left alone."""


class HeldOut(RuntimeError):
    """A held function was called before the learner's answer to its exercise was accepted."""


def register(name: str, fn: Callable) -> None:
    """Run ``fn`` wherever the student package calls the held function ``name`` (a checker calls this
    when it accepts an answer; in the repository, whose functions are whole, it changes nothing).

    Raises:
      KeyError: ``name`` is not in :data:`EXERCISES`.
    """
    if name not in EXERCISES:
        raise KeyError(f"{name} is not a held function; held: {', '.join(sorted(EXERCISES))}")
    _ANSWERS[name] = fn


def registered(name: str) -> Callable | None:
    """The answer registered for ``name``, or None."""
    return _ANSWERS.get(name)


def call(
    name: str, *args: Any, unroll: bool = False, checkpoint: Any = _GIVEN, **kwargs: Any
) -> Any:
    """``name``'s registered answer called with ``args`` and ``kwargs``: what a held function's stub runs.
    The answer takes the exercise's arguments; the library's own options become contexts around it:
    ``unroll`` writes its ``fori_loop`` and ``scan`` loops out (:func:`unrolled_loops`), ``checkpoint``
    (a policy, or None for no checkpoint) replaces its ``jax.checkpoint`` policy (:func:`checkpoint_policy`).

    Raises:
      HeldOut: no answer is registered; the message names the exercise that writes it.
    """
    fn = _ANSWERS.get(name)
    if fn is None:
        raise HeldOut(
            f"{name} is {EXERCISES[name]}: the student package holds its body out. Write it there "
            "and run its check: once the check accepts your answer, this function runs it"
        )
    with contextlib.ExitStack() as stack:
        if unroll:
            stack.enter_context(unrolled_loops())
        if checkpoint is not _GIVEN:
            stack.enter_context(checkpoint_policy(checkpoint))
        return fn(*args, **kwargs)


@contextlib.contextmanager
def checkpoint_policy(policy: Callable | None) -> Iterator[None]:
    """While the block runs, ``jax.checkpoint`` (and ``jax.remat``) use ``policy`` whatever policy they are
    given; with None they return the function unchecked (no checkpoint). What
    ``splits.zero3_blocks(…, policy=)`` compiles, for a registered answer that checkpoints its layer."""
    import jax

    real = jax.checkpoint, jax.remat

    def checkpoint(fun=None, *args, **kw):
        if fun is None:
            return functools.partial(checkpoint, *args, **kw)
        if policy is None:
            return fun
        return real[0](fun, *args, **{**kw, "policy": policy})

    jax.checkpoint = jax.remat = checkpoint
    try:
        yield
    finally:
        jax.checkpoint, jax.remat = real


@contextlib.contextmanager
def unrolled_loops() -> Iterator[None]:
    """While the block runs, ``jax.lax.fori_loop`` and ``jax.lax.scan`` with bounds known when traced are
    written out as Python loops (what ``splits.ring_attention(…, unroll=True)`` compiles): the unrolled
    form of a registered answer that loops with either. Code that imported them by name, and a function
    traced before (a ``jax.jit`` keeps its trace), are unchanged."""
    import jax

    real_fori, real_scan = jax.lax.fori_loop, jax.lax.scan

    @functools.wraps(real_fori)
    def fori_loop(lower, upper, body, init, **kw):
        if not (isinstance(lower, int) and isinstance(upper, int)):
            return real_fori(lower, upper, body, init, **kw)
        for i in range(lower, upper):
            init = body(i, init)
        return init

    @functools.wraps(real_scan)
    def scan(f, init, xs=None, length=None, reverse=False, **kw):
        leaves = jax.tree.leaves(xs)
        n = length if length is not None else (leaves[0].shape[0] if leaves else None)
        if not n:
            return real_scan(f, init, xs, length, reverse, **kw)
        ys = [None] * n
        for i in reversed(range(n)) if reverse else range(n):
            init, ys[i] = f(init, jax.tree.map(lambda a, i=i: a[i], xs))
        stacked = None if ys and ys[0] is None else jax.tree.map(lambda *a: jax.numpy.stack(a), *ys)
        return init, stacked

    jax.lax.fori_loop, jax.lax.scan = fori_loop, scan
    try:
        yield
    finally:
        jax.lax.fori_loop, jax.lax.scan = real_fori, real_scan

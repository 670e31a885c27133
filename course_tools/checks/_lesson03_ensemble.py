"""Lesson 03, exercise 1: an ensemble through ``vmap``, with stacked parameters and per-example keys.

Spec: ``ensemble(init, apply, init_key, dropout_key, x, members)`` returns ``(stacked, outputs)``:

- ``stacked``: the members' parameters, every leaf of ``init(k)`` with a leading axis of ``members``;
  member ``m`` equals ``init(jax.random.split(init_key, members)[m])``;
- ``outputs``: ``[members, batch, out]``; entry ``[m, b]`` is ``apply(params_m, k_mb, x[b])`` for member
  ``m``'s parameters, the whole batch ``x`` shared by every member, and ``k_mb =
  jax.random.split(jax.random.split(dropout_key, members)[m], batch)[b]`` — one key per member, split
  again into one key per example (``apply`` draws a dropout mask from it);
- ``apply`` is traced once (``vmap``, not a Python loop over members or examples).

The outputs are compared within ``course_lib.precision.float32_rtol()`` (1e-5 on XLA:CPU, 1.6e-2 on a
TPU, whose float32 matmuls multiply bfloat16 inputs): the reference computes one example at a time.

The checker's ``init`` and ``apply`` accept one member's parameters and one example only (their Python
bodies check the ranks), and count their runs; the answer is called under ``jax.jit`` (``init``, ``apply``
and ``members`` static), so its program is compiled once; the batch holds two identical examples, so a key
shared by the examples of a member shows as two identical outputs. (With JAX's default threefry keys,
``jax.random.fold_in(key, i)`` equals ``jax.random.split(key, n)[i]``: folding in the indices is the
same spec.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from ._common import call_answer, close, fail, matmul_rtol

D_IN, HIDDEN, D_OUT, MEMBERS, BATCH, RATE = 3, 16, 2, 4, 6, 0.5


@functools.cache
def _model():
    """(init, apply, runs): one pair for the process, so that their compiled programs are reused."""
    import jax
    import jax.numpy as jnp

    runs: list = []

    def init(key):
        if getattr(key, "shape", None) != ():
            raise TypeError(f"init takes ONE key, got a key array of shape {key.shape}")
        flat = jax.random.normal(key, (D_IN * HIDDEN + HIDDEN * D_OUT,))  # one draw: compiles fast
        return {
            "w": flat[: D_IN * HIDDEN].reshape(D_IN, HIDDEN) / np.sqrt(D_IN),
            "b": jnp.zeros(HIDDEN),
            "v": flat[D_IN * HIDDEN :].reshape(HIDDEN, D_OUT) / np.sqrt(HIDDEN),
        }

    def apply(params, key, x):
        runs.append(1)
        if params["w"].ndim != 2:
            raise TypeError(f"apply takes ONE member's params, got w of shape {params['w'].shape}")
        if x.ndim != 1 or getattr(key, "shape", None) != ():
            raise TypeError(
                f"apply takes ONE example and ONE key, got x {x.shape}, key {getattr(key, 'shape', key)}"
            )
        h = jnp.tanh(x @ params["w"] + params["b"])
        keep = jax.random.bernoulli(key, 1 - RATE, h.shape)
        return jnp.where(keep, h / (1 - RATE), 0.0) @ params["v"]

    def one(params, member_key, row, b):  # the reference's entry [m, b], one example at a time
        return apply(params, jax.random.split(member_key, BATCH)[b], row)

    return init, apply, runs, jax.jit(one), jax.jit(lambda k: init(k)["w"])


def _explain(e: BaseException):
    if isinstance(e, TypeError) and "ONE member's params" in str(e):
        return (
            f"apply received stacked parameters: {e}",
            "map over the members: the stacked leaves' leading axis is in_axes=0 of an outer vmap",
        )
    if isinstance(e, TypeError) and "ONE example" in str(e):
        return (
            f"apply received a batch: {e}",
            "map over the examples too: an inner vmap gives apply one row of x and one key",
        )
    if isinstance(e, ValueError) and "inconsistent sizes" in str(e) and "argument params" in str(e):
        return (
            f"vmap over the members found leaves of different lengths: {str(e).splitlines()[0][:120]}",
            "the parameters are not stacked: every leaf needs a leading axis of members (jax.vmap(init) "
            "over one key per member)",
        )
    if isinstance(e, TypeError) and "ONE key" in str(e):
        return (f"init received a key array: {e}", "vmap init over the member keys")
    return None


def _reference(stacked, key, x, shared=False):
    """Entry [m, b] by Python loops over members and examples, one compiled example at a time;
    ``shared``: every member splits ``key`` itself (a wrong answer's keys)."""
    import jax

    one = _model()[3]  # apply on one example, compiled once for the process
    member_keys = [key] * MEMBERS if shared else list(jax.random.split(key, MEMBERS))
    leaves = {name: np.asarray(leaf) for name, leaf in stacked.items()}
    out = np.zeros((MEMBERS, BATCH, D_OUT), np.float32)
    for m in range(MEMBERS):
        params = {name: leaf[m] for name, leaf in leaves.items()}
        for b in range(BATCH):
            out[m, b] = np.asarray(one(params, member_keys[m], x[b], b))
    return out


def _judge_stacked(stacked, init, key) -> None:
    import jax

    one = jax.eval_shape(init, key)
    if jax.tree.structure(stacked) != jax.tree.structure(one):
        fail(
            f"the parameters have the structure {jax.tree.structure(stacked)}",
            "return init's pytree, every leaf stacked",
        )
    for (path, leaf), ref in zip(
        jax.tree_util.tree_leaves_with_path(stacked), jax.tree.leaves(one)
    ):
        if np.shape(leaf) != (MEMBERS, *ref.shape):
            fail(
                f"leaf {jax.tree_util.keystr(path)} has shape {np.shape(leaf)}, expected "
                f"{(MEMBERS, *ref.shape)}",
                "every leaf gains a leading axis of members",
            )
    w = np.asarray(stacked["w"])
    if np.allclose(w, w[:1]):
        fail("every member has the same parameters", "split init_key: one key per member")
    first_leaf = _model()[4]
    for m, member_key in enumerate(jax.random.split(key, MEMBERS)):
        if not np.allclose(w[m], np.asarray(first_leaf(member_key)), atol=1e-6):
            fail(
                f"member {m} is not init(jax.random.split(init_key, members)[{m}])",
                "split init_key into one key per member and map init over them (jax.vmap(init))",
            )


def judge_ensemble(ensemble: Callable) -> None:
    """Apply the spec of the module docstring, or raise an ExerciseError."""
    import jax
    import jax.numpy as jnp

    init, apply, runs = _model()[:3]
    init_key, dropout_key = jax.random.key(11), jax.random.key(12)
    x = np.random.default_rng(4).normal(size=(BATCH, D_IN)).astype(np.float32)
    x[3] = x[0]  # two identical examples: their dropout masks must still differ
    runs.clear()
    out = call_answer(
        "ensemble(init, apply, init_key, dropout_key, x, 4)",
        jax.jit(ensemble, static_argnums=(0, 1, 5)),  # traced once: apply's runs are its traces
        init,
        apply,
        init_key,
        dropout_key,
        jnp.asarray(x),
        MEMBERS,
        explain=_explain,
    )
    traced = len(runs)
    if not isinstance(out, tuple | list) or len(out) != 2:
        fail("expected a pair (stacked parameters, outputs)", "return both, in that order")
    stacked, out = out
    _judge_stacked(stacked, init, init_key)
    want = _reference(stacked, dropout_key, x)
    shape = np.shape(out)
    if traced > 2:
        fail(
            f"apply's Python body ran {traced} times: a Python loop over members or examples",
            "vmap traces apply once for all of them: nest a vmap over examples in a vmap over members",
        )
    if shape == (BATCH, MEMBERS, D_OUT):
        fail(f"shape {shape}: the members' axis is second", "the outer vmap maps over the members")
    if shape != want.shape:
        fail(
            f"shape {shape}, expected {want.shape} (members, batch, out)",
            "one output per member and example",
        )
    got = np.asarray(out)
    rtol = matmul_rtol()  # the reference's matmuls are one example's, the answer's batched ones
    if close(got, want, rtol):
        return
    if np.allclose(got[:, 0], got[:, 3]):
        fail(
            "two identical examples got identical outputs: the examples of a member share one dropout key",
            "split each member's key into one key per example: jax.random.split(member_key, batch)",
        )
    if close(got, _reference(stacked, dropout_key, x, shared=True), rtol):
        fail(
            "every member draws the same dropout masks: the members share their example keys",
            "split dropout_key into one key per member first, then each member's key into one per "
            "example",
        )
    fail(
        "the outputs differ from the spec's: member m uses split(dropout_key, members)[m], example b "
        "split(that key, batch)[b]",
        "derive the keys exactly so, and give apply the member's params, the example's key and row",
    )

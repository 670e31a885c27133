"""Lesson 03, exercise 1: an ensemble through ``vmap``, with stacked parameters and per-example keys.

Spec: ``ensemble(init, apply, init_key, dropout_key, x, members)`` returns ``(stacked, outputs)``:

- ``stacked``: the members' parameters, every leaf of ``init(k)`` with a leading axis of ``members``;
  member ``m`` equals ``init(jax.random.split(init_key, members)[m])``;
- ``outputs``: ``[members, batch, out]``; entry ``[m, b]`` is ``apply(params_m, k_mb, x[b])`` for member
  ``m``'s parameters, the whole batch ``x`` shared by every member, and a key ``k_mb`` of its own for every
  (member, example) pair, derived from ``dropout_key`` alone (``apply`` draws a dropout mask from it).
  Any derivation of independent keys is right: ``split(split(dropout_key, members)[m], batch)[b]``, a
  ``fold_in`` of the indices, or one ``split(dropout_key, (members, batch))`` grid;
- ``apply`` is traced once (``vmap``, not a Python loop over members or examples).

The checker's ``apply`` returns the network's output followed by the dropout mask it drew (``HIDDEN`` 0/1
values), so the check reads every (member, example) mask from the outputs and judges the keys by them: all
``members × batch`` masks distinct (with ``HIDDEN`` = 48 random bits, two independent keys draw the same
mask with probability 2⁻⁴⁸), the same masks for another ``init_key``, other masks for another
``dropout_key``; and the network's output is compared with ``apply``'s for member ``m``'s parameters,
example ``b`` and that mask, computed in NumPy, within ``course_lib.precision.float32_rtol()`` (1e-5 on
XLA:CPU, 1.6e-2 on a TPU, whose float32 matmuls multiply bfloat16 inputs).

The checker's ``init`` and ``apply`` accept one member's parameters and one example only (their Python
bodies check the ranks), and count their runs; the answer is called under ``jax.jit`` (``init``, ``apply``
and ``members`` static), so its program is compiled once; the batch holds two identical examples, so a key
shared by the examples of a member shows as two identical masks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from ._common import call_answer, close, fail, matmul_rtol

D_IN, HIDDEN, D_OUT, MEMBERS, BATCH, RATE = 3, 48, 2, 4, 6, 0.5


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
        out = jnp.where(keep, h / (1 - RATE), 0.0) @ params["v"]
        return jnp.concatenate([out, keep.astype(out.dtype)])  # [D_OUT + HIDDEN]: the mask shown

    return init, apply, runs, jax.jit(lambda k: init(k)["w"])


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


def _from_masks(stacked, x, masks) -> np.ndarray:
    """The network part of entry [m, b]: member m's parameters on example b with mask ``masks[m, b]``."""
    w, b, v = (np.asarray(stacked[name], np.float64) for name in ("w", "b", "v"))
    h = np.tanh(np.einsum("bi,mih->mbh", x.astype(np.float64), w) + b[:, None, :])
    return np.einsum("mbh,mho->mbo", np.where(masks > 0.5, h / (1 - RATE), 0.0), v)


def _judge_masks(masks, again, other) -> None:
    """Every (member, example) its own mask; the masks set by dropout_key alone (see the docstring)."""
    flat = [row.tobytes() for row in masks.reshape(MEMBERS * BATCH, HIDDEN)]
    if len(set(flat)) == len(flat):
        pass
    elif any(np.array_equal(masks[m, 0], masks[m, 3]) for m in range(MEMBERS)):
        fail(
            "two identical examples got identical dropout masks: the examples of a member share one "
            "dropout key",
            "split each member's key into one key per example: jax.random.split(member_key, batch)",
        )
    elif np.array_equal(masks[0], masks[1]):
        fail(
            "every member draws the same dropout masks: the members share their example keys",
            "split dropout_key into one key per member first, then each member's key into one per "
            "example",
        )
    else:
        fail(
            "two (member, example) pairs drew the same dropout mask: their keys are the same",
            "give every example of every member a key of its own, all derived from dropout_key",
        )
    if not np.array_equal(again, masks):
        fail(
            "another init_key changed the dropout masks",
            "derive the dropout keys from dropout_key only; init_key is for the parameters",
        )
    if any(
        np.array_equal(a, b) for a, b in zip(other.reshape(-1, HIDDEN), masks.reshape(-1, HIDDEN))
    ):
        fail(
            "another dropout_key left some dropout masks as they were: they do not come from dropout_key",
            "derive every example's key from dropout_key (split it, or fold the indices into it)",
        )


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
    first_leaf = _model()[3]
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
    answer = jax.jit(ensemble, static_argnums=(0, 1, 5))  # traced once: apply's runs are its traces

    def call(i_key, d_key):
        return call_answer(
            "ensemble(init, apply, init_key, dropout_key, x, 4)",
            answer,
            *(init, apply, i_key, d_key, jnp.asarray(x), MEMBERS),
            explain=_explain,
        )

    out = call(init_key, dropout_key)
    traced = len(runs)
    if not isinstance(out, tuple | list) or len(out) != 2:
        fail("expected a pair (stacked parameters, outputs)", "return both, in that order")
    stacked, out = out
    _judge_stacked(stacked, init, init_key)
    shape, want_shape = np.shape(out), (MEMBERS, BATCH, D_OUT + HIDDEN)
    if traced > 2:
        fail(
            f"apply's Python body ran {traced} times: a Python loop over members or examples",
            "vmap traces apply once for all of them: nest a vmap over examples in a vmap over members",
        )
    if shape == (BATCH, MEMBERS, D_OUT + HIDDEN):
        fail(f"shape {shape}: the members' axis is second", "the outer vmap maps over the members")
    if shape != want_shape:
        fail(
            f"shape {shape}, expected {want_shape} (members, batch, out)",
            "one output of apply per member and example",
        )
    got = np.asarray(out)
    masks = got[..., D_OUT:]
    if not np.isin(masks, (0.0, 1.0)).all():
        fail(
            "the outputs are not apply's: its last values are a 0/1 mask",
            "return apply's outputs as they are",
        )
    if not close(got[..., :D_OUT], _from_masks(stacked, x, masks), matmul_rtol()):
        fail(
            "entry [m, b] is not apply(member m's parameters, a key, x[b])",
            "give apply the member's params, the example's key and the example's row x[b]",
        )
    again = np.asarray(call(jax.random.key(21), dropout_key)[1])[..., D_OUT:]
    other = np.asarray(call(init_key, jax.random.key(22))[1])[..., D_OUT:]
    _judge_masks(masks, again, other)

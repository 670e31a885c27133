"""Lesson 06's tensor-parallel checker (exported by :mod:`course_tools.checks.lesson06`): a
vocabulary-parallel cross-entropy to debug.

The cross-entropy is compared with optax on the whole logits; what it communicates is read from its jaxpr on
an abstract 2 x 4 mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from course_lib.meshes import DATA, MODEL
from course_lib.programs import jaxpr_equations

from ._common import call_answer, checker, fail, passed
from ._spmd import VMA_WORDS, abstract, auto_mesh, communicates

# ---- exercise 3: debug the vocabulary-parallel cross-entropy ---------------------------------------------

_B, _K = 6, 5  # examples; classes per model shard
_SIZE = {"apart": "on different scales per row (near +100 and near -100)"}


def public_name(primitive: str) -> str:
    """The lax function a collective primitive comes from (psum's primitive is psum_invariant, …)."""
    for prefix, public in (
        ("psum_scatter", "lax.psum_scatter"),
        ("reduce_scatter", "lax.psum_scatter"),
        ("psum", "lax.psum"),
        ("all_gather", "lax.all_gather"),
        ("all_to_all", "lax.all_to_all"),
        ("pmax", "lax.pmax"),
        ("pmin", "lax.pmin"),
    ):
        if primitive.startswith(prefix):
            return public
    return primitive


def _xent(logits, labels) -> np.ndarray:
    return np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def _xent_local_bug(logits: np.ndarray, labels: np.ndarray, m: int) -> np.ndarray:
    """The per-shard softmax's loss (the given bug), computed on the host for its hint."""
    k, out = logits.shape[1] // m, np.empty(len(labels), np.float32)
    for i, (row, y) in enumerate(zip(logits, labels)):
        block = row[(y // k) * k : (y // k + 1) * k].astype(np.float64)
        out[i] = np.log(np.exp(block - block.max()).sum()) + block.max() - block[y % k]
    return out


def _xent_values(fn: Callable, rng) -> None:
    """The per-example loss for 4 model shards (simulated with vmap): small and large logits, then rows
    on very different scales (half near +100, half near -100), where one shift for the whole batch leaves
    exp() of every class of a low row at 0."""
    for m in (4,):
        per_shard = jax.jit(jax.vmap(partial(fn, axis_name=MODEL), (0, None), axis_name=MODEL))
        for scale in (1.0, 100.0, "apart"):  # large logits overflow exp() without the max shift
            if scale == "apart":
                offsets = np.where(np.arange(_B) % 2, -100.0, 100.0)[:, None]
                logits = (offsets + 5 * rng.standard_normal((_B, m * _K))).astype(np.float32)
            else:
                logits = (scale * rng.standard_normal((_B, m * _K))).astype(np.float32)
            labels = rng.integers(0, m * _K, size=_B).astype(np.int32)
            labels[0], labels[1] = 0, m * _K - 1  # the first and the last class
            blocks = jnp.asarray(logits.reshape(_B, m, _K).transpose(1, 0, 2))  # [m, b, V/m]
            got = np.asarray(call_answer("tp_cross_entropy", per_shard, blocks, labels))
            want = _xent(logits, labels)
            if got.shape != (m, _B):
                fail(
                    f"the result has shape {got.shape[1:]} per shard",
                    "return f32[b], one loss per example",
                )
            if not np.all(np.isfinite(got)) and scale == "apart":
                fail(
                    "inf or nan for a batch whose rows lie on different scales (half near +100, half "
                    "near -100), though logits of size ~1 and ~100 drawn alike for every row were fine",
                    "the shift must be per example: a max over the whole batch (no axis=-1) is ~200 above "
                    "every logit of a low row, whose exp() are then all 0, and log(0) = -inf; shift each "
                    "example by its own maximum over the classes (max over the last axis), then lax.pmax "
                    "across the shards",
                )
            if not np.all(np.isfinite(got)):
                fail(
                    f"inf or nan for logits of size ~{scale:g}",
                    "exp() overflows: subtract the maximum over ALL classes (lax.pmax of the local maxima)",
                )
            if np.allclose(got, want[None], rtol=1e-4, atol=1e-4):
                continue
            if np.allclose(got, _xent_local_bug(logits, labels, m)[None], rtol=1e-4, atol=1e-4):
                fail(
                    f"with {m} model shards you still get the per-shard softmax's loss "
                    f"({got[0, 2]:.4f} instead of {want[2]:.4f})",
                    "log_softmax of the local block normalises over V/m classes only; log Σ exp must sum "
                    "over every shard's classes: lax.psum of the local sums",
                )
            fail(
                f"with {m} model shards and logits {_SIZE.get(scale, f'of size ~{scale:g}')} the loss "
                "differs from the full "
                f"softmax cross-entropy by up to {np.abs(got - want).max():.3g}",
                "every shard must shift by the same global max (lax.pmax), sum exp over all shards "
                "(lax.psum), and only the shard that owns a label contributes its logit (mask, then psum)",
            )


def _xent_gradient(fn: Callable, devices: Sequence[Any], rng) -> str:
    """Differentiable, and invariant over model, under shard_map on the real devices."""
    mesh = auto_mesh(devices)
    nd, nm = mesh.shape[DATA], mesh.shape[MODEL]
    logits = jnp.asarray(rng.standard_normal((_B * nd, _K * nm)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, _K * nm, size=_B * nd), jnp.int32)
    specs = dict(in_specs=(P(DATA, MODEL), P(DATA)), out_specs=P(DATA))
    mapped = jax.shard_map(partial(fn, axis_name=MODEL), mesh=mesh, **specs)
    try:
        got = jax.jit(jax.grad(lambda lg: jnp.sum(mapped(lg, labels))))(logits)
    except NotImplementedError as e:
        if "pmax" not in str(e):
            raise
        fail(
            "jax.grad fails: 'pmax' has no derivative",
            "the loss does not depend on the shift, so stop its gradient before the collective: "
            "lax.pmax(lax.stop_gradient(local_max), axis_name)",
        )
    except Exception as e:  # noqa: BLE001 - the learner's code may raise anything
        if any(w in str(e) for w in VMA_WORDS):
            fail(
                "under shard_map the loss still varies over the model axis",
                "psum the parts over axis_name",
            )
        fail(
            f"jax.grad raised {type(e).__name__}: {str(e)[:200]}",
            "run it under jax.grad on a small input",
        )
    want = jax.grad(lambda lg: optax.softmax_cross_entropy_with_integer_labels(lg, labels).sum())(
        logits
    )
    if not np.allclose(got, want, atol=1e-5):
        fail(
            "the gradient w.r.t. the logits is wrong",
            "it must be softmax(logits) - one_hot(labels): keep the shift out of it (lax.stop_gradient)",
        )
    return f"data={nd} x model={nm}"


def _xent_traffic(fn: Callable) -> None:
    """No collective moves more than one value per example (the logits stay split)."""
    mapped = jax.shard_map(
        partial(fn, axis_name=MODEL),
        mesh=abstract((2, 4), (DATA, MODEL)),
        in_specs=(P(DATA, MODEL), P(DATA)),
        out_specs=P((DATA, MODEL)),  # every shard's result kept: a result that varies still traces
    )
    args = (
        jax.ShapeDtypeStruct((2 * _B, 4 * 10), jnp.float32),
        jax.ShapeDtypeStruct((2 * _B,), jnp.int32),
    )
    big = {
        e.primitive.name
        for e, _ in jaxpr_equations(jax.make_jaxpr(mapped)(*args))
        if communicates(e) and any(getattr(v.aval, "size", 0) > _B for v in e.invars)
    }
    if big:
        fail(
            f"the logits travel: {sorted({public_name(b) for b in big})} moves more than one value per example",
            "no device should hold all the classes: communicate only [b]-sized maxima, sums and target logits",
        )


@checker
def check_tp_cross_entropy(fn: Callable, devices: Sequence[Any]) -> bool:
    """Judge a vocabulary-parallel cross-entropy (exercise 3).

    Spec: ``fn(logits_block, labels, axis_name)`` — logits f32[b, V/m] (this model shard's classes),
    labels i32[b] in [0, V) on every shard —

    - returns the per-example cross-entropy f32[b] over all V classes
      (``optax.softmax_cross_entropy_with_integer_labels`` on the whole logits), to 1e-4, on 4 model
      shards (simulated with ``vmap``), for logits of size ~1 and ~100 (where ``exp`` overflows without a
      global max shift) and for a batch whose rows lie near +100 and near -100 (where one shift for the
      whole batch leaves every exp() of a low row at 0), labels including the first and the last class;
    - under ``shard_map(check_vma=True)`` on a data × model mesh of ``devices``: is the same on every model
      shard (``out_specs=P(data)``) and differentiable, with the gradient w.r.t. the logits
      ``softmax - one_hot`` to 1e-5;
    - never moves more than one value per example through a collective (the logits stay split).
    """
    rng = np.random.default_rng(7)
    # the traffic first (traced only): a gathered answer's gradient fails with an obscure message, and
    # under JAX 0.10.2 so does running one (all_gather to="invarying", then optax's cross-entropy, raised
    # "AssertionError: ManualAxisType(...)" there; JAX 0.12 runs it)
    _xent_traffic(fn)
    _xent_values(fn, rng)
    mesh = _xent_gradient(fn, devices, rng)
    return passed(
        "the full-vocabulary cross-entropy with 4 model shards (logits up to ~100, rows on "
        "different scales), its gradient "
        f"on a {mesh} mesh, and only per-example values communicated"
    )

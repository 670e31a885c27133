"""Lesson 06's tensor-parallel checkers (exported by :mod:`course_tools.checks.lesson06`): a
vocabulary-parallel cross-entropy to debug, and a tensor-parallel MLP with the fewest collectives.

The cross-entropy is compared with optax on the whole logits, the MLP with ``jax.value_and_grad`` on one
device; what they communicate is read from their jaxprs on an abstract 4 x 2 (or 2 x 4) mesh.
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

from ._common import call_answer, checker, fail, passed, require
from ._spmd import VMA_WORDS, abstract, auto_mesh, axes_of, communicates, run_mapped

# ---- exercise 3: debug the vocabulary-parallel cross-entropy ---------------------------------------------

_B, _K = 6, 5  # examples; classes per model shard


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
    """The per-example loss for 4 model shards (simulated with vmap), small and large logits."""
    for m in (4,):
        per_shard = jax.jit(jax.vmap(partial(fn, axis_name=MODEL), (0, None), axis_name=MODEL))
        for scale in (1.0, 100.0):  # large logits overflow exp() without the max shift
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
                f"with {m} model shards and logits of size ~{scale:g} the loss differs from the full "
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
        out_specs=P(DATA),
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
            f"the logits travel: {sorted(big)} moves more than one value per example",
            "no device should hold all the classes: communicate only [b]-sized maxima, sums and target logits",
        )


@checker
def check_tp_cross_entropy(fn: Callable, devices: Sequence[Any]) -> bool:
    """``fn(logits_block, labels, axis_name)``: logits f32[b, V/m] (this model shard's classes), labels
    i32[b] in [0, V) on every shard. Must return the per-example cross-entropy f32[b] over all V classes,
    the same on every model shard, be differentiable, and never gather the logits."""
    rng = np.random.default_rng(7)
    _xent_values(fn, rng)
    mesh = _xent_gradient(fn, devices, rng)
    _xent_traffic(fn)
    return passed(
        "the full-vocabulary cross-entropy with 4 model shards (logits up to ~100), its gradient "
        f"on a {mesh} mesh, and only per-example values communicated"
    )


# ---- exercise 4: a tensor-parallel MLP, fewest collectives ------------------------------------------------

_D, _H, _O = 8, 8, 4  # input, hidden, output features
_SHAPES = {"w1": (_D, _H), "b1": (_H,), "w2": (_H, _O), "b2": (_O,)}


def _mlp_reference(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


def _splits_over(spec: P, axis: str) -> bool:
    return any(axis == a or (isinstance(a, tuple) and axis in a) for a in tuple(spec))


def _mlp_specs(layout: Callable) -> dict:
    specs = call_answer("mlp_layout", layout, DATA, MODEL)
    if not isinstance(specs, dict) or set(specs) != set(_SHAPES):
        fail(
            f"mlp_layout returned {specs!r}",
            "return {'w1': P(...), 'b1': P(...), 'w2': P(...), 'b2': P(...)}",
        )
    specs = {k: v if isinstance(v, P) else P(*v) for k, v in specs.items()}
    for k in ("w1", "w2"):
        if not _splits_over(specs[k], MODEL):
            fail(
                f"{k} is not split over {MODEL!r} ({specs[k]})",
                "tensor parallelism splits every weight matrix over the model axis (1/n_model per device)",
            )
    if any(_splits_over(s, DATA) for s in specs.values()):
        fail(
            "a parameter is split over the data axis",
            "here the parameters are split over model only",
        )
    return specs


def _mlp_values(fn: Callable, specs: dict, devices: Sequence[Any]) -> tuple[int, int]:
    mesh = auto_mesh(devices)
    nd, nm = mesh.shape[DATA], mesh.shape[MODEL]
    rng = np.random.default_rng(8)
    params = {k: jnp.asarray(rng.standard_normal(s) / 3, jnp.float32) for k, s in _SHAPES.items()}
    x = jnp.asarray(rng.standard_normal((4 * nd, _D)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((4 * nd, _O)), jnp.float32)
    want_loss, want = jax.value_and_grad(_mlp_reference)(params, x, y)
    specs_in = dict(in_specs=(specs, P(DATA, None), P(DATA, None)), out_specs=(P(), specs))
    mapped = jax.jit(
        jax.shard_map(partial(fn, data_axis=DATA, model_axis=MODEL), mesh=mesh, **specs_in)
    )
    hint = (
        "the loss must be the global mean (lax.pmean over data) of outputs completed over model (lax.psum "
        "of the row-parallel partial sums); differentiate that global loss"
    )
    got = run_mapped("tp_mlp_loss_and_grads", mapped, params, x, y, varies_hint=hint)
    try:
        loss, grads = got
        close = {k: bool(np.allclose(grads[k], want[k], rtol=1e-4, atol=1e-5)) for k in want}
        scaled = all(np.allclose(grads[k], nd * want[k], rtol=1e-4, atol=1e-5) for k in want)
    except (TypeError, ValueError, KeyError):
        fail("the result is not (loss, grads) with grads shaped like params", "return loss, grads")
    if not np.isclose(loss, want_loss, rtol=1e-4):
        if nm > 1 and np.isclose(
            loss, _mlp_reference({**params, "b2": nm * params["b2"]}, x, y), rtol=1e-4
        ):
            fail(
                f"b2 is counted {nm} times",
                "add the row-parallel layer's bias after the psum, once",
            )
        fail(
            f"loss {float(loss):.5f}, expected {float(want_loss):.5f}",
            "compare with the one-device MLP",
        )
    if nd > 1 and scaled:
        fail(
            f"gradients are n_data× ({nd}×) too large",
            "inside shard_map the gradient of the local loss is already summed over data: differentiate "
            "the global loss (lax.pmean over data), and do not pmean the gradients",
        )
    if not all(close.values()):
        fail(f"the gradients of {[k for k, ok in close.items() if not ok]} are wrong", hint)
    return nd, nm


def _model_collectives(fn: Callable, specs: dict) -> list[str]:
    """The collectives over model the step runs on an abstract data=4 x model=2 mesh."""
    mapped = jax.shard_map(
        partial(fn, data_axis=DATA, model_axis=MODEL),
        mesh=abstract((4, 2), (DATA, MODEL)),
        in_specs=(specs, P(DATA, None), P(DATA, None)),
        out_specs=(P(), specs),
    )
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in _SHAPES.items()}
    batch = jax.ShapeDtypeStruct((16, _D), jnp.float32), jax.ShapeDtypeStruct((16, _O), jnp.float32)
    return [
        e.primitive.name
        for e, times in jaxpr_equations(jax.make_jaxpr(mapped)(params, *batch))
        for _ in range(times)
        if communicates(e) and MODEL in axes_of(e)
    ]


@checker
def check_tp_mlp(layout: Callable[[str, str], dict], fn: Callable, devices: Sequence[Any]) -> bool:
    """``layout(data_axis, model_axis)`` gives the specs of ``{"w1", "b1", "w2", "b2"}``; ``fn(params,
    x_block, y_block, data_axis, model_axis)`` runs in ``shard_map`` (params by those specs, x and y
    ``P(data, None)``) and returns ``(loss, grads)``: the global mean squared error (``P()``) and its
    gradients laid out like the params. Both weight matrices must be split over ``model``; the step may
    communicate over ``model`` once."""
    layout = require("mlp_layout", layout, "write mlp_layout and tp_mlp_loss_and_grads in the cell")
    fn = require(
        "tp_mlp_loss_and_grads", fn, "write tp_mlp_loss_and_grads(params, x_block, y_block, …)"
    )
    specs = _mlp_specs(layout)
    nd, nm = _mlp_values(fn, specs, devices)
    comms = _model_collectives(fn, specs)
    if len(comms) > 1 or any(c.startswith("all_gather") for c in comms):
        fail(
            f"on a data=4 x model=2 mesh your step communicates over model {len(comms)} times ({comms})",
            "choose the layout so that one psum of the output completes the forward pass and the backward "
            "pass needs nothing over model: split the first layer's outputs, the second layer's inputs",
        )
    return passed(
        f"loss and gradients equal the one-device MLP on data={nd} x model={nm}; w1 and w2 split over "
        f"model; {len(comms)} collective over model"
    )

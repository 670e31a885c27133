"""Checkers for ``06_shard_map.ipynb``: predicted shapes and vma, a ring all-reduce built from ``ppermute``,
a vocabulary-parallel cross-entropy (debug this), and a stencil over a split signal with a halo exchange.
Each runs the learner's per-shard body in ``jax.shard_map`` with ``check_vma=True``.

None of them holds an answer: shapes and vma are measured by tracing the lesson's body; the ring is compared
with ``lax.psum`` and its traffic read from its jaxpr; the cross-entropy with optax on the whole logits; the
stencil with the same stencil on the whole signal, and its traffic read from its jaxpr.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from course_lib.meshes import DATA, MODEL
from course_lib.programs import jaxpr_equations

from ._common import call_answer, checker, fail, judged_on, passed
from ._lesson06_halo import check_halo_stencil as _check_halo
from ._lesson06_tp import check_tp_cross_entropy, public_name
from ._spmd import abstract, communicates, narrow_floats, precision_hint, run_mapped

__all__ = [
    "check_halo_stencil",
    "check_ring_all_reduce",
    "check_shapes_and_vma",
    "check_tp_cross_entropy",
]

# ---- exercise 1: predict shapes and vma ------------------------------------------------------------------


def lesson_body(x_block, w_block, record):
    """The body of exercise 1 (the question, as the notebook shows it): x f32[8·nd, 4·nm] with
    P(DATA, MODEL), w f32[4·nm, 6] with P(MODEL, None)."""
    xw = x_block @ w_block
    y = lax.psum(xw, MODEL)
    record(
        x=x_block,
        w=w_block,
        xw=xw,
        y=y,
        g=lax.all_gather(x_block, MODEL, axis=1, tiled=True),
        s=lax.psum_scatter(y, DATA, scatter_dimension=0, tiled=True),
        i=lax.axis_index(MODEL),
        wy=w_block + y.sum(),
    )
    return y


_PREDICT_MESHES = ((1, 1), (2, 2), (4, 2), (2, 3), (8, 1))
_PREDICT_RULES = (
    "a block is the global shape divided, dimension by dimension, by the size of the mesh axis its spec "
    "names there, and varies over the axes its spec names; an operation's result varies over the union of "
    "its inputs' vma; psum over an axis keeps the shape and removes the axis from the vma; "
    "all_gather(tiled=True) concatenates the blocks along its axis and counts as varying over that axis "
    "unless to='invarying'; psum_scatter(tiled=True) sums, then splits its dimension into pieces, a "
    "different piece per device; axis_index is a scalar that differs along its axis"
)
_NAMES = ("x", "w", "xw", "y", "g", "s", "i", "wy")


def _measure_shapes_and_vma(n_data: int, n_model: int) -> dict:
    seen = {}

    def record(**values):
        for k, v in values.items():
            t = jax.typeof(v)
            seen[k] = (tuple(t.shape), frozenset(t.manual_axis_type.varying))

    mesh = abstract((n_data, n_model), (DATA, MODEL))
    mapped = jax.shard_map(
        partial(lesson_body, record=record),
        mesh=mesh,
        in_specs=(P(DATA, MODEL), P(MODEL, None)),
        out_specs=P(DATA, None),
    )
    jax.eval_shape(
        mapped,
        jax.ShapeDtypeStruct((8 * n_data, 4 * n_model), jnp.float32),
        jax.ShapeDtypeStruct((4 * n_model, 6), jnp.float32),
    )
    return seen


def _as_vma(value) -> frozenset:
    if isinstance(value, str):
        return frozenset({value})
    return frozenset(str(a) for a in value)


def _parse_predicted(got, n_data: int, n_model: int, names) -> dict:
    if not isinstance(got, dict) or set(got) != set(names):
        fail(
            f"predict({n_data}, {n_model}) returned {type(got).__name__} with keys "
            f"{sorted(got) if isinstance(got, dict) else '-'}",
            f"return a dict with exactly the keys {sorted(names)}, each (shape tuple, set of axis names)",
        )
    out = {}
    for name in names:
        try:
            p_shape, p_vma = got[name]
            out[name] = (tuple(int(d) for d in p_shape), _as_vma(p_vma))
        except (TypeError, ValueError):
            fail(
                f"{name!r}: {got[name]!r} is not (shape, axes)",
                "write e.g. ((8, 4), {DATA, MODEL})",
            )
    return out


@checker
def check_shapes_and_vma(predict: Callable[[int, int], dict]) -> bool:
    """Judge predicted block shapes and vma of the values of :func:`lesson_body`.

    Spec: ``predict(n_data, n_model)`` returns ``{name: (block shape, set of mesh axes it varies over)}``
    for each of the eight values the body records, and for every mesh of :data:`_PREDICT_MESHES` (five
    shapes, axes of size 1 among them) both parts equal what tracing the body under ``shard_map`` on an
    abstract mesh of that shape shows (``jax.typeof``). A wrong answer is told how many of the eight values
    are wrong on some mesh, never which, nor on which mesh.
    """
    wrong = set()
    for n_data, n_model in _PREDICT_MESHES:
        got = call_answer("predict", predict, n_data, n_model)
        truth = _measure_shapes_and_vma(n_data, n_model)
        predicted = _parse_predicted(got, n_data, n_model, truth)
        wrong |= {name for name in truth if predicted[name] != truth[name]}
    if wrong:
        fail(
            f"{len(wrong)} of the {len(_NAMES)} values have a wrong shape or vma on at least one of the "
            f"{len(_PREDICT_MESHES)} meshes the check traces",
            _PREDICT_RULES + "; predict as a function of n_data and n_model, not for one mesh",
        )
    return passed(f"shapes and vma of all {len(_NAMES)} values, on meshes {list(_PREDICT_MESHES)}")


# ---- exercise 2: a ring all-reduce -----------------------------------------------------------------------

_RING = "ring"


def _ring_traffic(fn: Callable, n: int, block_shape: tuple[int, ...]) -> tuple[float, set]:
    """Bytes each device sends, read from the jaxpr on an n-device abstract mesh; and the collectives used."""
    mesh = abstract((n,), (_RING,))
    mapped = jax.shard_map(
        partial(fn, axis_name=_RING), mesh=mesh, in_specs=P(_RING), out_specs=P(_RING)
    )
    x = jax.ShapeDtypeStruct((n * block_shape[0], *block_shape[1:]), jnp.float32)
    hint = "return the summed block (lax.ppermute's result varies, like the block)"
    jaxpr = run_mapped(
        "ring_all_reduce under shard_map", jax.make_jaxpr(mapped), x, varies_hint=hint
    )
    sent, used = 0.0, set()
    for eqn, times in jaxpr_equations(jaxpr):
        name = eqn.primitive.name
        if name == "while" and _sends_in(eqn):
            fail(
                "a lax.while_loop sends with ppermute: its trip count is not in the program, so what "
                "each device sends cannot be counted",
                "write the steps as a Python for loop, lax.fori_loop with Python-int bounds (it traces "
                "to a scan) or lax.scan",
            )
        if communicates(eqn):
            used.add(name)
        if name == "ppermute":
            sent += times * sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.invars)
    return sent, used


def _sends_in(while_eqn) -> bool:
    """Whether a ``while`` equation's body or condition holds a ``ppermute`` (at any depth)."""
    subs = (while_eqn.params["body_jaxpr"], while_eqn.params["cond_jaxpr"])
    return any(e.primitive.name == "ppermute" for sub in subs for e, _ in jaxpr_equations(sub))


def _ring_values(fn: Callable, rng) -> None:
    """psum's values on rings of 3, 4 and 8, simulated with vmap (any number of devices)."""
    for n, block in ((3, (6,)), (4, (4, 3)), (8, (16,))):
        x = jnp.asarray(rng.standard_normal((n, *block)), jnp.float32)
        ring = jax.jit(jax.vmap(partial(fn, axis_name=_RING), axis_name=_RING))
        got = np.asarray(call_answer("ring_all_reduce", ring, x))
        want = np.broadcast_to(np.asarray(x).sum(0), x.shape)
        if got.shape != want.shape:
            fail(
                f"on a ring of {n}, a block {block} came back as {got.shape[1:]}",
                "return an array of the block's shape: every device ends with the whole sum",
            )
        if np.allclose(got, want, rtol=1e-5, atol=1e-5):
            continue
        if n > 1 and np.allclose(got, np.asarray(x), atol=1e-6):
            fail(
                f"on a ring of {n}, every device still holds its own block",
                "send with lax.ppermute, and add",
            )
        chunk_ok = np.isclose(got.reshape(n, n, -1), want.reshape(n, n, -1), atol=1e-5).all(-1)
        if chunk_ok.sum(1).max() == 1:
            fail(
                f"on a ring of {n}, each device holds the complete sum of one chunk only",
                "that is the reduce-scatter half: pass the complete chunks on around the ring n-1 more "
                "times (the all-gather half) so that every device gets all n",
            )
        narrow = narrow_floats(jax.make_jaxpr(ring)(x))
        if narrow:
            fail(
                f"on a ring of {n}, the result differs from psum by up to "
                f"{np.abs(got - want).max():.3g}",
                precision_hint(narrow),
            )
        fail(
            f"on a ring of {n}, the result differs from psum by up to {np.abs(got - want).max():.3g}",
            "each chunk must collect all n contributions: n-1 steps that add what arrives to your own "
            "copy of that chunk; track which chunk index arrives at step s from device i-1",
        )


@checker
def check_ring_all_reduce(fn: Callable) -> bool:
    """Judge a ring all-reduce built from ``lax.ppermute`` (exercise 2).

    Spec: ``fn(x_block, axis_name)`` (the block's first dimension a multiple of the axis size ``n``)

    - returns ``lax.psum(x_block, axis_name)`` — every device the sum of all blocks — on rings of 3, 4 and
      8 (simulated with ``vmap``), to 1e-5;
    - under ``shard_map(check_vma=True)`` on abstract rings of 8, 4 and 3 devices uses no collective but
      ``ppermute`` (``psum``, ``psum_scatter``, ``all_gather``… are what it re-implements);
    - sends at most ``2 (n-1)/n`` of its block per device on each of those rings (bytes of every
      ``ppermute`` operand, times the
      trip count of the ``scan`` holding it; a ``while_loop`` that sends is refused, its trip count is not
      in the program).
    """
    _ring_values(fn, np.random.default_rng(6))
    shares = {}
    for n in (
        8,
        4,
        3,
    ):  # shard_map's vma check and the communication, from the program on each ring
        block = (2 * n, 3)
        sent, used = _ring_traffic(fn, n, block)
        if used - {"ppermute"}:
            fail(
                f"the ring uses {sorted({public_name(u) for u in used - {'ppermute'}})}",
                "build it from lax.ppermute (and local arithmetic) only: psum, psum_scatter and "
                "all_gather are what you are re-implementing",
            )
        block_bytes = int(np.prod(block)) * 4
        ideal = 2 * (n - 1) / n * block_bytes
        if sent > ideal * 1.01:
            fail(
                f"on {n} devices each device sends {sent / block_bytes:.2f}× its block; a ring all-reduce "
                f"sends 2·(n-1)/n = {ideal / block_bytes:.2f}×",
                "split the block into n chunks and send one chunk per step: n-1 steps to sum "
                "(reduce-scatter), n-1 steps to share the sums (all-gather)",
            )
        shares[n] = sent / block_bytes
    return passed(
        "equals psum on rings of 3, 4 and 8; each device sends "
        + " / ".join(f"{share:.3f}×" for share in shares.values())
        + " its block on "
        + " / ".join(str(n) for n in shares)
        + " devices (shard_map, check_vma=True), by ppermute only"
    )


# ---- exercise 4: a stencil with a halo exchange ---------------------------------------------------------


@checker
@judged_on(2, "one device has no neighbours to exchange a halo with")
def check_halo_stencil(fn: Callable, devices) -> bool:
    """Exercise 4; the spec is :func:`course_tools.checks._lesson06_halo.check_halo_stencil`'s (on one
    device, judged in a fresh process with 8: :func:`course_tools.checks._common.judge_on`)."""
    judged, sent, halo = _check_halo(fn, devices)
    return passed(
        f"equals the stencil of the whole signal on {sorted(set(judged))} device(s); on 8 devices each "
        f"sends {sent} bytes, its halo ({halo}), by ppermute only"
    )

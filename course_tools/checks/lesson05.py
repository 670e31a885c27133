"""Checkers for ``05_sharding.ipynb``: placing a batch, shard shapes, a layout that needs no communication."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from course_lib.measure import count_collectives
from course_lib.meshes import DATA, MODEL, data_model_mesh

from ._common import as_ints, checker, fail, passed
from ._common import call_answer as _call


def _spec_of(x) -> Any:
    return getattr(getattr(x, "sharding", None), "spec", "no NamedSharding")


@checker
def check_place_batch(fn: Callable, devices: Sequence[Any]) -> bool:
    """``fn(x, mesh)`` must put ``x``'s rows over ``data``, replicated over ``model``, on a 2-D mesh."""
    mesh = data_model_mesh(devices, axis_type="explicit")
    rows = (
        2 * mesh.shape[DATA]
    )  # a multiple of the data-axis size, so the rows divide evenly (8 on 4 x 2)
    x = jnp.arange(rows * 6, dtype=jnp.float32).reshape(rows, 6)
    out = _call("place_batch(x, mesh)", fn, x, mesh)
    if not isinstance(out, jax.Array) or not np.array_equal(np.asarray(out), np.asarray(x)):
        fail(
            "the values changed (or the result is not a jax.Array)",
            "only move the data: jax.device_put(x, sharding)",
        )
    s = out.sharding
    want = NamedSharding(mesh, P(DATA))
    if s.is_equivalent_to(want, x.ndim):
        return passed(
            f"rows split over {DATA!r} ({mesh.shape[DATA]} ways), replicated over {MODEL!r}: {jax.typeof(out)}"
        )
    if s.is_fully_replicated:
        fail(
            "every device holds the whole batch",
            f"split the rows: jax.device_put(x, NamedSharding(mesh, jax.P({DATA!r})))",
        )
    if s.is_equivalent_to(NamedSharding(mesh, P(DATA, MODEL)), x.ndim):
        fail(
            "the columns are split over 'model' as well",
            "a batch is split over data only; leave the feature dimension whole: jax.P('data')",
        )
    if s.is_equivalent_to(NamedSharding(mesh, P(MODEL)), x.ndim):
        fail(
            "the rows are split over the 'model' axis",
            "use the data axis for the batch dimension: jax.P('data')",
        )
    fail(
        f"got spec {_spec_of(out)}",
        "use NamedSharding(mesh, jax.P('data')) on the mesh you were given",
    )


_CASES = [
    ((8, 6), P(DATA), {DATA: 4, MODEL: 2}),
    ((8, 6), P(None, MODEL), {DATA: 4, MODEL: 2}),
    ((8, 6), P(DATA, MODEL), {DATA: 4, MODEL: 2}),
    ((8, 6), P(), {DATA: 4, MODEL: 2}),
    ((8, 4), P(MODEL, DATA), {DATA: 2, MODEL: 4}),
    ((16, 4), P((DATA, MODEL)), {DATA: 4, MODEL: 2}),
    ((12, 6, 4), P(None, DATA, MODEL), {DATA: 3, MODEL: 2}),
]


def reference_shard_shape(global_shape: tuple, spec: P, mesh_shape: dict) -> tuple:
    """Per-device shard shape of an array of ``global_shape`` laid out by ``spec`` on a mesh of ``mesh_shape``."""
    out = list(global_shape)
    for dim, entry in enumerate(tuple(spec)):
        if entry is None:
            continue
        axes = entry if isinstance(entry, tuple) else (entry,)
        out[dim] //= math.prod(mesh_shape[a] for a in axes)
    return tuple(out)


@checker
def check_shard_shape(fn: Callable) -> bool:
    """``fn(global_shape, spec, mesh_shape)`` must return the per-device shard shape, as a tuple of ints."""
    for shape, spec, mesh_shape in _CASES:
        got = _call(f"shard_shape({shape}, {spec}, {mesh_shape})", fn, shape, spec, mesh_shape)
        want = reference_shard_shape(shape, spec, mesh_shape)
        got = as_ints(
            "shard_shape", got, "return a tuple of ints, one per dimension of global_shape"
        )
        if got == want:
            continue
        case = f"shard_shape({shape}, {spec}, {mesh_shape}) returned {got}, expected {want}"
        if len(got) != len(want):
            fail(
                case,
                "return one size per dimension of global_shape; a spec shorter than the shape leaves the rest whole",
            )
        if any(isinstance(e, tuple) for e in tuple(spec)):
            fail(
                case,
                "a tuple of axes splits one dimension over all of them: divide by the product of their sizes",
            )
        if len(tuple(spec)) == 0 or any(e is None for e in tuple(spec)):
            fail(
                case,
                "None (or a missing entry) means that dimension is not split: keep its full size",
            )
        fail(
            case,
            "divide each dimension by the size of the mesh axis named at that position in the spec",
        )
    return passed(
        f"all {len(_CASES)} shard shapes right (a tuple of axes divides by the product of their sizes)"
    )


@checker
def check_no_comm_placement(fn: Callable, devices: Sequence[Any]) -> bool:
    """``fn(x, w, mesh)`` must place x [batch, d] and w [d, h] so that ``x @ w`` splits its work over every
    device and the compiled program has no collective. The mesh has Auto axes (the compiler may insert
    communication)."""
    mesh = data_model_mesh(devices, axis_type="auto")
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (2 * mesh.shape[DATA], 6))  # rows: a multiple of the data-axis size
    w = jax.random.normal(
        kw, (6, 2 * mesh.shape[MODEL])
    )  # columns: a multiple of the model-axis size
    placed = _call("place(x, w, mesh)", fn, x, w, mesh)
    try:
        xp, wp = placed
    except (TypeError, ValueError):
        fail(f"returned {type(placed).__name__}", "return the pair (x_placed, w_placed)")
    matmul = jax.jit(lambda a, b: a @ b)
    compiled = matmul.lower(xp, wp).compile()
    counts = {k: v for k, v in count_collectives(compiled.as_text()).items() if v}
    out = compiled(xp, wp)
    if not np.allclose(np.asarray(out), np.asarray(x @ w), atol=1e-5):
        fail("x @ w changed value", "only move the arrays with jax.device_put; don't change them")
    w_spec = tuple(_spec_of(wp)) if isinstance(_spec_of(wp), P) else ()
    if counts:
        if len(w_spec) >= 1 and w_spec[0] is not None:
            fail(
                f"the compiled program communicates: {counts}",
                "w's contracted (row) dimension is split, so each device holds partial sums that XLA must "
                "all-reduce; split w's columns over 'model' instead: jax.P(None, 'model')",
            )
        fail(
            f"the compiled program communicates: {counts}",
            "place x's rows over 'data' (jax.P('data', None)) and w's columns over 'model' (jax.P(None, 'model'))",
        )
    s = out.sharding
    if not s.is_equivalent_to(NamedSharding(mesh, P(DATA, MODEL)), 2):
        if (
            mesh.shape[DATA] > 1
            and s.is_equivalent_to(NamedSharding(mesh, P(None, MODEL)), 2)
            or s.is_fully_replicated
        ):
            fail(
                f"the output's spec is {s.spec}: the batch is not split",
                "x is replicated, so every data shard computes the same rows; put x's rows on 'data'",
            )
        fail(
            f"the output's spec is {s.spec}: the columns are not split over 'model'",
            "w is replicated over 'model', so both model shards compute the same columns; "
            "split w's columns over 'model'",
        )
    return passed(
        f"x @ w runs as {s.spec} on a {dict(mesh.shape)} mesh with no collective in the compiled program"
    )

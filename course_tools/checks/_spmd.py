"""Pieces the lesson-06 checkers share: abstract meshes, the collectives a jaxpr uses, running a body."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, Mesh

from course_lib.meshes import data_model_mesh

from ._common import call_answer

_COLLECTIVE_PREFIXES = (
    "psum",
    "pmax",
    "pmin",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "ragged_all_to_all",
    "ppermute",
    "pbroadcast",
)


def communicates(eqn) -> bool:
    """A collective primitive (psum, psum_invariant, all_gather_invariant, …); pvary and axis_index move
    nothing."""
    return eqn.primitive.name.startswith(_COLLECTIVE_PREFIXES)


VMA_WORDS = ("out_specs", "vma", "varying", "replicat")


def axes_of(eqn) -> tuple:
    """The mesh axes a collective equation names."""
    names = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    return tuple(names) if isinstance(names, (tuple, list)) else (names,)


def abstract(shape: tuple[int, ...], names: tuple[str, ...]) -> AbstractMesh:
    """A mesh of any shape for tracing only (no devices needed), with Auto axes."""
    return AbstractMesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def auto_mesh(devices: Sequence[Any], shape: tuple[int, int] | None = None) -> Mesh:
    """A data x model mesh of ``devices`` with Auto axes (shard_map places unplaced inputs)."""
    return data_model_mesh(list(devices), shape, axis_type="auto")


def run_mapped(what: str, fn: Callable, *args, varies_hint: str):
    """``call_answer`` with hints for a wrong axis name, for a result that still varies, and for a
    ``lax.scan`` / ``fori_loop`` carry that starts invariant and comes back varying over the axis."""

    def explain(e: Exception):
        if isinstance(e, NameError):
            return f"{what} raised NameError: {e}", "use the axis names passed in as arguments"
        if "out_specs" in str(e) and any(w in str(e) for w in VMA_WORDS):
            return (
                f"{what}: shard_map says the result still varies across devices where out_specs "
                "promise one value",
                varies_hint,
            )
        if "carry" in str(e) and "manual axis types do not match" in str(e):
            return (
                f"{what}: a loop's carry starts the same on every device (jnp.zeros_like) but comes back "
                "varying over the mesh axis",
                "make the carry vary over the axis from the start: "
                "lax.pcast(x, axis_name, to='varying') on its initial value (lesson 06)",
            )
        return None

    return call_answer(what, fn, *args, explain=explain)


def narrow_floats(jaxpr) -> list[str]:
    """The floating dtypes narrower than float32 that any equation of ``jaxpr`` (nested ones included)
    produces: where a float32 answer loses precision (a chunk cast to bfloat16 before a ppermute…)."""
    from course_lib.programs import jaxpr_equations

    found = set()
    for eqn, _ in jaxpr_equations(jaxpr):
        for v in eqn.outvars:
            dtype = getattr(getattr(v, "aval", None), "dtype", None)
            if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
                found.add(str(dtype))
    return sorted(found)


def precision_hint(dtypes: list[str]) -> str:
    """The hint for a result off by rounding because the program computes in ``dtypes``."""
    return (
        f"the program computes or sends values in {', '.join(dtypes)}: the error is rounding, not which "
        "rows or chunks go where. Keep the block's float32 in every ppermute and every sum"
    )

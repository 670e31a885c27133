"""Probes of lesson 05's checkers for meshes with an axis of size 1, where the compiled program cannot show
what an answer would move: the exercise's programs measured again in a fresh process with simulated CPU
devices, and the gathers an answer's traced types reveal (Explicit axes put the sharding in the type)."""

from __future__ import annotations

import functools

from jax.sharding import AxisType

from course_lib import programs

from ._simulated import run_json

FULL_MESH = (2, 2)
"""With an axis of size 1 the predictions are also judged on a data=2 x model=2 mesh of simulated CPU devices
(a fresh process), where every axis can communicate."""

_MEASURE_FULL = """
import json, jax
from course_lib.meshes import data_model_mesh
from course_tools.checks.lesson05 import SHARDED_PROGRAMS, measure_collectives
mesh = data_model_mesh(jax.devices(), {shape}, axis_type="explicit")
print(json.dumps({{name: sorted(measure_collectives(name, mesh)) for name in SHARDED_PROGRAMS}}))
"""


@functools.cache
def measure_on_full_mesh() -> dict[str, set[tuple[str, str]]]:
    """``{name: {(op, axis)}}`` of every program on a :data:`FULL_MESH` mesh, in a fresh process."""
    found = run_json(_MEASURE_FULL.format(shape=FULL_MESH), FULL_MESH[0] * FULL_MESH[1])
    return {name: {tuple(pair) for pair in pairs} for name, pairs in found.items()}


def explicit_axes_of(aval) -> set:
    """The Explicit mesh axes of the mesh in ``aval``'s type (none inside an ``auto_axes`` region)."""
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if mesh is None:
        return set()
    return {a for a, k in zip(mesh.axis_names, mesh.axis_types) if k == AxisType.Explicit}


def dim_axes(aval) -> list[set]:
    """The mesh axes each dimension of ``aval`` is split over, read from its type (Explicit axes)."""
    spec = getattr(getattr(aval, "sharding", None), "spec", None) or ()
    dims = [*spec, *[None] * (len(getattr(aval, "shape", ())) - len(spec))]
    return [set() if d is None else {d} if isinstance(d, str) else set(d) for d in dims]


def typed_gathers(jaxpr) -> list[tuple[str, set]]:
    """``[(operation, axes lost)]``: the operations whose result type is split over fewer Explicit mesh axes
    than their operand's kept dimensions — gathers, which the compiled program shows only where the axis
    has more than one device. A reshard into an ``auto_axes`` region (whose types carry no Explicit axes)
    is the compiler's choice, not a gather, and is left out."""
    found = []
    for eqn, _ in programs.jaxpr_equations(jaxpr):
        name = eqn.primitive.name
        if name == "reshard" and eqn.invars:
            before, after = dim_axes(eqn.invars[0].aval), dim_axes(eqn.outvars[0].aval)
            lost = set().union(*[b - a for b, a in zip(before, after)])
            if lost & explicit_axes_of(eqn.outvars[0].aval):
                found.append((f"reshard {eqn.invars[0].aval} -> {eqn.outvars[0].aval}", lost))
        elif name == "dot_general":
            (lc, rc), _ = eqn.params["dimension_numbers"]
            kept = set()
            for var, drop in ((eqn.invars[0], set(lc)), (eqn.invars[1], set(rc))):
                kept |= set().union(*[a for i, a in enumerate(dim_axes(var.aval)) if i not in drop])
            out = set().union(*dim_axes(eqn.outvars[0].aval))
            if not kept <= out:
                found.append((f"dot_general -> {eqn.outvars[0].aval}", kept - out))
    return found

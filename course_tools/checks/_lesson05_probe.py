"""Probes of lesson 05's checkers for meshes with an axis of size 1, where the compiled program cannot show
what an answer would move: the exercise's programs measured again in a fresh process with simulated CPU
devices, and the gathers an answer's traced types reveal."""

from __future__ import annotations

import functools

import jax
from jax import P
from jax.sharding import AxisType, NamedSharding

from course_lib import programs
from course_lib.meshes import DATA, MODEL

from ._common import fail
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


def _explicit(aval) -> set:
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if mesh is None:
        return set()
    return {a for a, k in zip(mesh.axis_names, mesh.axis_types) if k == AxisType.Explicit}


def _dim_axes(aval) -> list[set]:
    """The mesh axes each dimension of ``aval`` is split over, read from its type (Explicit axes)."""
    spec = getattr(getattr(aval, "sharding", None), "spec", None) or ()
    dims = [*spec, *[None] * (len(getattr(aval, "shape", ())) - len(spec))]
    return [set() if d is None else {d} if isinstance(d, str) else set(d) for d in dims]


def typed_gathers(jaxpr) -> list[str]:
    """Operations whose result type is split over fewer mesh axes than their operand's kept dimensions:
    gathers that the compiled program shows only where the axis has more than one device."""
    found = []
    for eqn, _ in programs.jaxpr_equations(jaxpr):
        name = eqn.primitive.name
        if name == "reshard" and eqn.invars:
            before, after = _dim_axes(eqn.invars[0].aval), _dim_axes(eqn.outvars[0].aval)
            lost = set().union(*[b - a for b, a in zip(before, after)])
            if lost & _explicit(
                eqn.outvars[0].aval
            ):  # into an auto_axes region: the compiler's choice
                found.append(f"reshard {eqn.invars[0].aval} -> {eqn.outvars[0].aval}")
        elif name == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            kept = set()
            for var, drop in ((eqn.invars[0], set(lc)), (eqn.invars[1], set(rc))):
                kept |= set().union(
                    *[a for i, a in enumerate(_dim_axes(var.aval)) if i not in drop]
                )
            out = set().union(*_dim_axes(eqn.outvars[0].aval))
            if not kept <= out:
                found.append(f"dot_general -> {eqn.outvars[0].aval}")
    return found


def judge_types(fn, mesh, params, velocity, x, y, where) -> None:
    """On a mesh with an axis of size 1 the compiled program cannot show a gather; the types still do."""
    s = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    specs = {"w1": s(None, MODEL), "b1": s(MODEL), "w2": s(MODEL, None), "b2": s()}
    put = lambda tree: {k: jax.device_put(v, specs[k]) for k, v in tree.items()}  # noqa: E731
    args = (
        put(params),
        put(velocity),
        jax.device_put(x, s(DATA, None)),
        jax.device_put(y, s(DATA, None)),
    )
    with jax.set_mesh(mesh):
        gathers = typed_gathers(jax.make_jaxpr(fn)(*args, 0.1))
    if gathers:
        fail(
            f"the step gathers a sharded array {where}: {gathers[0]} (an axis of size 1 moves nothing here, "
            "but the type says what it would move on more devices)",
            "you resharded a weight or an activation (e.g. jax.reshard(..., P()) or out_sharding=P()): "
            "contract the model-split hidden dimension where it lies, with "
            "jnp.matmul(h, w2, out_sharding=P('data', None)); its partial sums become one all-reduce",
        )

"""An answer that writes the notebook's axis name instead of its ``axis_name`` argument: judged a second way.

Lesson 10's tensor-parallel MLP, ring attention and ZeRO-3 (``notebooks/10_transformers.ipynb``, exercises
1, 3, 4) and lesson 11's GPipe (``notebooks/11_pipeline_experts.ipynb``, exercise 1) take ``axis_name``;
their checkers run them on a mesh whose axis has the notebook's name (``"model"``, ``"context"``,
``"data"``, ``"stage"``), where ``lax.psum(y, "model")`` is right. :func:`judge_other_axis` runs the answer
once more on a mesh whose axis is called :data:`OTHER`:

- traced (no devices, nothing compiled) on an abstract mesh with two axes, :data:`OTHER` and the
  notebook's, ``axis_name`` = :data:`OTHER`, with ``check_vma=False`` (so that a sum over the wrong axis
  is traced rather than refused by the type check): a collective or ``lax.axis_index``/``axis_size`` of
  the program that names any other axis than :data:`OTHER` is refused, the axis named;
- run on real devices, the smallest case the checker has already judged, on a mesh whose only axis is
  :data:`OTHER`: an error there (an axis name written in is unbound) or other values are refused.

Lesson 11's expert exchange has meshes of other names of its own (:mod:`._lesson11_experts`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from course_lib.programs import jaxpr_equations

from ._common import call_answer, fail
from ._spmd import abstract

__all__ = ["OTHER", "judge_other_axis", "named_axes"]

OTHER = "other"
"""The axis name of the second run: no notebook's mesh has an axis of this name."""

_HINT = (
    "pass axis_name to every collective (lax.psum, lax.ppermute, lax.all_gather, …) and to "
    "lax.axis_index / lax.axis_size, and write no axis name in: the function must work whatever the "
    f"mesh calls its axis (the checker also runs it on an axis called {OTHER!r})"
)


def named_axes(jaxpr) -> dict[str, str]:
    """The mesh axes that the equations of ``jaxpr`` (nested ones included) name, each with the first
    primitive that names it (``psum``, ``ppermute``, ``axis_index``, …); positional (vmap) axes left out."""
    out: dict[str, str] = {}
    for eqn, _ in jaxpr_equations(jaxpr):
        if eqn.primitive.name == "shard_map":
            continue
        for key in ("axes", "axis_name"):
            names = eqn.params.get(key, ())
            names = names if isinstance(names, tuple | list | set | frozenset) else (names,)
            for name in names:
                if isinstance(name, str):
                    out.setdefault(name, eqn.primitive.name)
    return out


def _written_in(fn_name: str, notebook: str, trace: Callable[[Any], Any]) -> None:
    """Refuse an answer whose program, traced with ``axis_name`` = :data:`OTHER` on an abstract mesh
    (:data:`OTHER`: 2, ``notebook``: 2), names another axis. ``trace(mesh)``: its jaxpr there, traced with
    ``check_vma=False``. A trace that raises says nothing here (the run on devices judges it)."""
    try:
        jaxpr = trace(abstract((2, 2), (OTHER, notebook)))
    except Exception:  # noqa: BLE001 - the learner's code may raise anything; judged by the run
        return
    for axis, prim in named_axes(jaxpr).items():
        if axis != OTHER:
            fail(
                f"{fn_name} uses the axis name {axis!r} instead of its axis_name argument: on a mesh with "
                f"the axes {OTHER!r} and {notebook!r}, given axis_name={OTHER!r}, its program's {prim} "
                f"names {axis!r}",
                _HINT,
            )


def judge_other_axis(
    fn_name: str,
    notebook: str,
    trace: Callable[[Any], Any],
    run: Callable[[], Any],
    differ: Callable[[Any], str | None],
    case: str,
) -> None:
    """Refuse an answer right on the notebook's axis name that names the axis itself (module docstring).

    Args:
      fn_name: the answer's name in the messages (``"tp_mlp"``).
      notebook: the axis name the checker's other runs give it (``"model"``).
      trace: ``trace(mesh) -> ClosedJaxpr``: the answer with ``axis_name`` = :data:`OTHER` under
        ``shard_map(..., check_vma=False)`` on the abstract ``mesh``, traced (``jax.make_jaxpr``).
      run: the answer on a real mesh whose only axis is :data:`OTHER`, on a case already judged right
        with the notebook's axis name; returns what ``differ`` reads.
      differ: ``differ(result)``: None where the values equal the ones wanted, else how far off they are
        (``"by 1.2e+00"``).
      case: the case ``run`` runs, for the messages (``"on 2 devices"``).

    Raises:
      ExerciseError: the program names another axis, or raises or differs on the :data:`OTHER` mesh.
    """
    _written_in(fn_name, notebook, trace)
    where = f"on a mesh whose axis is called {OTHER!r} (axis_name={OTHER!r}, {case})"

    def explain(e: BaseException):
        unbound = re.search(r"unbound axis name: (\w+)", str(e))
        if unbound and unbound.group(1) != OTHER:
            return (
                f"{fn_name} uses the axis name {unbound.group(1)!r} instead of its axis_name argument: "
                f"{where} it raised {type(e).__name__}: {str(e)[:200]}",
                _HINT,
            )
        return (
            f"{fn_name} is right on a mesh whose axis is called {notebook!r}, but {where} it raised "
            f"{type(e).__name__}: {str(e)[:200] or '(no message)'}",
            _HINT,
        )

    got = call_answer(f"{fn_name} {where}", run, explain=explain)
    off = differ(got)
    if off is not None:
        fail(
            f"{fn_name} is right on a mesh whose axis is called {notebook!r}, but {where} its values "
            f"differ {off}: it depends on the axis's name",
            _HINT,
        )

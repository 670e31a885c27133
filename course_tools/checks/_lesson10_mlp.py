"""The tensor-parallel MLP's judge for :func:`course_tools.checks.lesson10.check_tp_mlp`
(``notebooks/10_transformers.ipynb``, exercise 1): the MLP's shapes, the device counts it runs on, the hint
for an output that is not the MLP's, and the collectives read from its jaxpr (one ``psum`` of the [T, D]
partial output, no other)."""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from course_lib import precision
from course_lib.meshes import MODEL, mesh_of

from ._axis_names import OTHER, judge_other_axis
from ._common import fail
from ._lesson10_ring import close, counted, precise

__all__ = ["MLP_D", "MLP_F", "MLP_T", "mlp_collectives", "mlp_counts", "mlp_hint", "mlp_shape"]
__all__ += ["mlp_mapped", "mlp_other_axis", "mlp_unreplicated"]


def _rounded(got, want, rtol) -> bool:
    return bool(np.allclose(got, want, rtol=rtol, atol=rtol))


MLP_D, MLP_F, MLP_T = 16, 48, 5  # F divides by 2, 3, 4 and 8; T is no shard's length


def mlp_hint(got, want, b2, n):
    """A true hint for a tensor-parallel MLP's output ``got`` on ``n`` devices (``want``: the MLP's)."""
    if precision.float64_runs() and _rounded(got, want, 1e-4):  # float64 inputs computed in float32
        fail(
            f"on {n} device(s) the output is near the MLP's but off by "
            f"{float(np.abs(got - want).max()):.1e}: something is computed in float32",
            "the inputs here are float64: compute in their dtype and cast nothing",
        )
    extra = float(np.sum((got - want).mean(0) * b2) / np.sum(b2 * b2))  # got = want + extra·b2?
    if abs(extra) > 1e-3 and close(got, want + extra * b2, 1e-8):
        fail(
            f"on {n} device(s) the output has w2's bias {round(extra + 1, 6) + 0.0:.3g} times",
            "the partial sums are added by the psum: w2's (replicated) bias must end up in the "
            "output exactly once, on any number of devices",
        )
    if n > 1 and close(got, (want - b2) / n + b2, 1e-8):
        fail(
            f"on {n} devices the output is the average of the devices' partial sums, not their sum",
            "each device's rows of w2 give one part of the product: the parts add up (lax.psum, not pmean)",
        )
    fail(
        f"on {n} device(s) the output differs from the MLP by {float(np.abs(got - want).max()):.2e} "
        "(random, non-zero biases here)",
        "check each step against transformer.mlp: w1's bias is this device's part of it, gelu comes "
        "before the row-parallel w2, and the bias of w2 is added once",
    )


_COLLECTIVES = ("psum", "pmax", "pmin", "all_gather", "all_to_all", "ppermute", "reduce_scatter")
"""Prefixes of the jaxpr's collective primitives (``psum_invariant``, ``all_gather_invariant``, …;
``lax.pmean`` traces to a ``psum`` and a division, ``lax.psum_scatter`` to ``reduce_scatter``)."""


def _gathered_said(shapes, n: int, form: str) -> str:
    """What the all-gathered ``shapes`` are, put in ``form``: this device's weight shards (w1's kernel
    [D, F/n] or bias [F/n], w2's kernel [F/n, D]: every device then computes the whole MLP) or activations
    (a reduce-scatter's pieces, the hidden units: the partial outputs travel split, not summed by a psum).
    Empty where nothing was gathered."""
    if not shapes:
        return ""
    f = MLP_F // n
    weights = {(MLP_D, f), (f,), (f, MLP_D)}
    if all(tuple(shape) in weights for shape in shapes):
        return form.format("with gathered weights every device computes the whole MLP")
    return form.format(
        "gathered activations: the [T, D] partial outputs are to be summed whole by one lax.psum, "
        "not split, gathered or reassembled"
    )


def mlp_collectives(jaxpr, n):
    """Refuse any collective but one ``psum`` of the [T, D] partial output (scalars aside)."""
    psums, others, gathered = 0, [], []
    for eqn, times in counted(jaxpr):
        name = eqn.primitive.name
        shapes = [tuple(v.aval.shape) for v in eqn.invars if getattr(v.aval, "size", 1) > 1]
        if not name.startswith(_COLLECTIVES) or not shapes:
            continue
        if (
            name.startswith("psum")
            and not name.startswith("psum_scatter")
            and shapes == [(MLP_T, MLP_D)]
        ):
            psums += times or 2
        else:
            listed = ", ".join("[" + ", ".join(map(str, s)) + "]" for s in shapes)
            others.append(f"{name} of {listed}")  # Python 3.11 (the TPU image's): no nested quotes
            if name.startswith("all_gather"):
                gathered += shapes
    want = (
        f"a tensor-parallel MLP (T={MLP_T}, D={MLP_D}, F={MLP_F}) sends one thing: the [T, D] "
        "partial output, summed over the devices by one lax.psum"
    )
    if others:
        fail(
            f"on {n} devices the program calls {'; '.join(others[:4])}; {want}, and moves no weights"
            + _gathered_said(gathered, n, " ({})"),
            "multiply by this device's shards only (x @ its columns of w1, + its part of w1's bias, "
            "gelu, @ its rows of w2) and add the devices' [T, D] partial outputs with one lax.psum",
        )
    if psums != 1:
        fail(
            f"on {n} devices the program sums [T, D] arrays over the devices {psums} times; {want}",
            "add the partial outputs of the row-parallel w2 with a single lax.psum (w2's bias once, "
            "after it)"
            if psums
            else "add the devices' [T, D] partial outputs with lax.psum",
        )


@functools.cache
def mlp_counts(n_devices: int) -> tuple[int, ...]:
    """Two device counts (the most of 8, 4, 2 present, and 3 or 2) so that a constant fitted to one fails."""
    top = max(c for c in (8, 4, 2, 1) if c <= n_devices)
    second = [c for c in (3, 2) if c <= n_devices and c != top][:1]
    return (top, *second)


def mlp_shape(got, n: int) -> None:
    """Refuse a tensor-parallel MLP's result that is not one [T, D] array (None, a dict, another shape)."""
    shape = getattr(got, "shape", None)
    if shape == (MLP_T, MLP_D) and np.issubdtype(np.asarray(got).dtype, np.number):
        return
    if got is None:
        said = "None (is a return missing?)"
    elif shape is None:
        said = f"a {type(got).__name__}"
    else:
        said = f"an array of shape {tuple(shape)}"
    fail(
        f"on {n} device(s) tp_mlp returned {said}; want the MLP's output, one [T, D] = "
        f"[{MLP_T}, {MLP_D}] array, the same on every device",
        "return the devices' summed partial outputs (lax.psum over the axis) plus w2's bias",
    )


def mlp_unreplicated(tp_mlp, mesh, n: int, *args):
    """``explain`` for :func:`course_tools.checks._common.call_answer`: when shard_map refuses the output as
    not replicated (its out_specs ``P()``) and the program, traced again without that check, gathers
    something, the gathering's own message (:func:`mlp_collectives`) instead of the generic one."""

    def explain(e: Exception):
        if not (isinstance(e, ValueError) and "out_specs" in str(e) and "replicat" in str(e)):
            return None
        try:
            jaxpr = jax.make_jaxpr(mlp_mapped(tp_mlp, mesh, check_vma=False))(*args)
        except Exception:  # noqa: BLE001 (the answer's first error is the one reported)
            return None
        gathers = [q for q, _ in counted(jaxpr) if q.primitive.name.startswith("all_gather")]
        if not gathers:
            return None
        shapes = [tuple(g.invars[0].aval.shape) for g in gathers]
        return (
            f"tp_mlp on {n} devices: shard_map refuses its output as not provably the same on every "
            "device (out_specs P()), and it all-gathers "
            + "; ".join(str(list(shape)) for shape in shapes[:3])
            + _gathered_said(shapes, n, ": {}"),
            "multiply by this device's shards only (x @ its columns of w1, + its part of w1's bias, "
            "gelu, @ its rows of w2) and add the devices' [T, D] partial outputs with one lax.psum: "
            "its result is the same on every device",
        )

    return explain


def mlp_mapped(tp_mlp, mesh, axis: str = MODEL, check_vma: bool = True):
    """``tp_mlp(x, p, axis)`` under ``shard_map`` on ``mesh``: x [T, D] replicated, w1's columns and bias
    and w2's rows split over ``axis``, w2's bias whole; the output [T, D] replicated."""
    spec = {
        "w1": {"kernel": P(None, axis), "bias": P(axis)},
        "w2": {"kernel": P(axis), "bias": P()},
    }
    return jax.shard_map(
        lambda x, p: tp_mlp(x, p, axis),
        mesh=mesh,
        in_specs=(P(), spec),
        out_specs=P(),
        check_vma=check_vma,
    )


def mlp_other_axis(tp_mlp, devices, n: int, x, p, got, jit) -> None:
    """Refuse a ``tp_mlp`` that names the mesh axis itself: the case ``x``, ``p``, whose output ``got`` on
    ``n`` devices of a ``"model"`` axis was right, again on ``n`` devices of an axis called :data:`OTHER`
    (:func:`._axis_names.judge_other_axis`); ``jit``: the checker's ``jax.jit``."""
    with precise():
        mesh = mesh_of({OTHER: n}, devices[:n], axis_type="auto")
        judge_other_axis(
            "tp_mlp",
            MODEL,
            lambda abstract: jax.make_jaxpr(mlp_mapped(tp_mlp, abstract, OTHER, False))(x, p),
            lambda: np.asarray(jit(mlp_mapped(tp_mlp, mesh, OTHER))(x, p)),
            lambda new: None if close(new, got, 1e-10) else f"by {np.abs(new - got).max():.2e}",
            f"{n} devices",
        )

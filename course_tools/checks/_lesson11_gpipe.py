"""GPipe's judge for :func:`course_tools.checks.lesson11.check_gpipe`
(``notebooks/11_pipeline_experts.ipynb``, exercise 1): the pipeline's values and gradients against the
stages applied in order on one device, under ``shard_map`` on the devices present, with hints for rows out of
place, missing or rounded; and its stage applications, sends and ``ppermute`` pairs read from its jaxpr on a
4-stage mesh traced without devices."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from course_lib import precision
from course_lib.meshes import STAGE, mesh_of
from course_lib.pipeline_measure import residual_stage
from course_lib.programs import jaxpr_equations

from ._axis_names import OTHER, judge_other_axis
from ._common import fail
from ._spmd import abstract, communicates, run_mapped

__all__ = [
    "ROWS",
    "SHAPE_CASE",
    "WIDTH",
    "check_pairs",
    "cond_collectives",
    "gpipe_structure",
    "gpipe_values",
]

WIDTH, ROWS = 8, 3  # an activation's width and rows per micro-batch
_K = 2  # layers per stage
_VALUE_CASES = (
    (4, 8),
    (2, 5),
    (3, 2),
    (1, 4),
)  # (p, m); those with p <= the devices present are run
SHAPE_CASE = (4, 8)  # traced on an abstract mesh (no devices needed): ticks and sends


def _jit(fn):
    """``jax.jit`` for a program run once or twice: on CPU without LLVM's optimisations (half the compile)."""
    cpu = jax.default_backend() == "cpu"
    return jax.jit(fn, compiler_options={"xla_backend_optimization_level": 0} if cpu else None)


def _rtol() -> float:
    """The float32 comparisons' relative tolerance: 1e-4 where matmuls compute in float32 (XLA:CPU), the
    platform's :func:`course_lib.precision.float32_rtol` where they round their inputs (XLA:TPU ~1.6e-2)."""
    return max(1e-4, precision.float32_rtol())


def _ref(stage, w_all, xs):
    """Every micro-batch through all layers in order, on one device: [m, rows, D]."""
    return jax.vmap(lambda x: stage(x, {"w": w_all}))(xs)


def _mapped(fn, mesh, stage, axis: str = STAGE, check_vma: bool = True):
    def body(w, xs):
        return fn(stage, {"w": w}, xs, axis)[None]  # [1, m, rows, D] per stage

    return jax.shard_map(
        body, mesh=mesh, in_specs=(P(axis), P()), out_specs=P(axis), check_vma=check_vma
    )


def _other_axis(fn, devices, stage, w, xs, got) -> None:
    """Refuse a pipeline that names the mesh axis itself: the case ``w``, ``xs`` whose last stage's ``got``
    on ``p`` devices of a ``"stage"`` axis was right, again on ``p`` devices of an axis called
    :data:`OTHER` (:func:`._axis_names.judge_other_axis`)."""
    p = w.shape[0] // _K
    mesh = mesh_of({OTHER: p}, devices[:p], axis_type="auto")
    judge_other_axis(
        "gpipe_forward",
        STAGE,
        lambda abstract: jax.make_jaxpr(_mapped(fn, abstract, stage, OTHER, False))(w, xs),
        lambda: np.asarray(_jit(_mapped(fn, mesh, stage, OTHER))(w, xs))[-1],
        lambda new: (
            None
            if np.allclose(new, got, rtol=_rtol(), atol=_rtol() / 10)
            else f"by {np.abs(new - got).max():.2e}"
        ),
        f"{p} stages, m = {xs.shape[0]}",
    )


def _row_map(got, want) -> list[int | None]:
    """For each row of ``got``, the row of ``want`` it equals (None: none)."""
    out = []
    for g in got:
        hits = [j for j, w in enumerate(want) if np.allclose(g, w, rtol=_rtol(), atol=_rtol() / 10)]
        out.append(hits[0] if hits else None)
    return out


def _diagnose_values(got, want, xs, stage, w_last, p, m):
    rows = _row_map(got, want)
    if rows == list(range(m)):
        return
    own = np.asarray(_jit(jax.vmap(lambda x: stage(x, {"w": w_last})))(xs))
    if p > 1 and np.allclose(got, own, rtol=_rtol(), atol=_rtol() / 10):
        fail(
            f"with p={p} stages the last stage returns its own layers applied to the inputs",
            "each stage must work on what the previous stage sent it: lax.ppermute(y, axis_name, "
            "[(i, i + 1) ...]) after each tick, and stage 0 alone reads xs",
        )
    zeros = [i for i in range(m) if rows[i] is None and not np.any(got[i])]
    if zeros and all(rows[i] == i for i in range(m) if i not in zeros):
        fail(
            f"with p={p}, m={m} rows {zeros} of the last stage's ys hold zeros; the others are right",
            "micro-batch i leaves the last stage at tick i + p - 1: with m + p - 1 ticks every row is "
            "written, the last at tick m + p - 2",
        )
    found = [(i, j) for i, j in enumerate(rows) if j is not None]
    if len(found) >= max(1, m - 1) and any(i != j for i, j in found):
        shift = {j - i for i, j in found}
        present = [j for _, j in found]
        twice = sorted({j for j in present if present.count(j) > 1})
        if twice:
            nowhere = sorted(set(range(m)) - set(present))
            what, hint = (
                f"micro-batch {', '.join(map(str, twice))} in more than one row"
                + (f", {', '.join(map(str, nowhere))} in none" if nowhere else ""),
                "stage 0 starts micro-batch t at tick t (xs[t]), each micro-batch once, and the last "
                "stage writes micro-batch i's output to row i",
            )
        elif rows == list(range(m))[::-1]:
            what, hint = (
                "the order reversed",
                "micro-batch i enters stage 0 at tick i and leaves the last stage at tick i + p - 1: "
                "write that output to row i",
            )
        elif len(shift) == 1:
            what, hint = (
                f"row i holds micro-batch i {'-' if min(shift) < 0 else '+'} {abs(min(shift))}",
                "the last stage finishes micro-batch i at tick i + p - 1: write its output to row i then",
            )
        else:
            what, hint = "", "keep micro-batch i's output in row i"
        held = ", ".join("none" if j is None else str(j) for j in rows)
        fail(
            f"with p={p}, m={m} the outputs are in the wrong rows: rows 0 … {m - 1} hold micro-batches "
            f"[{held}]" + (f" ({what})" if what else ""),
            hint,
        )
    if np.allclose(got, want, rtol=5e-2, atol=5e-2):
        fail(
            f"with p={p} stages and m={m} micro-batches every output is near the stages applied in "
            f"order, yet off by up to {np.abs(got - want).max():.3g}: the values are rounded somewhere",
            "an activation cast to a narrower dtype (a send, a buffer) loses digits; the pipeline should "
            "compute exactly what the stages compute",
        )
    fail(
        f"with p={p} stages and m={m} micro-batches the outputs differ from applying the stages in "
        f"order by up to {np.abs(got - want).max():.3g}",
        "at tick t stage 0 runs micro-batch t (from xs) and every other stage s runs what stage s - 1 "
        "sent it at the end of tick t - 1",
    )


def gpipe_values(fn, devices, rng):
    stage = residual_stage()
    ran = []
    for p, m in [c for c in _VALUE_CASES if c[0] <= len(devices)][:3]:
        w = jnp.asarray(rng.standard_normal((p * _K, WIDTH, WIDTH)) / np.sqrt(WIDTH), jnp.float32)
        xs = jnp.asarray(rng.standard_normal((m, ROWS, WIDTH)), jnp.float32)
        body = _mapped(fn, mesh_of({STAGE: p}, devices[:p], axis_type="auto"), stage)
        mapped = _jit(body)
        hint = "return ys [m, …] on every stage (the checker reads the last stage's)"
        got = run_mapped(f"gpipe_forward with p={p}, m={m}", mapped, w, xs, varies_hint=hint)
        if got.shape != (p, m, ROWS, WIDTH):
            fail(
                f"with p={p}, m={m} each stage returned shape {got.shape[1:]}",
                f"return ys of the shape of xs, {(m, ROWS, WIDTH)}: micro-batch i's output in row i",
            )
        want = _jit(partial(_ref, stage))(w, xs)
        _diagnose_values(np.asarray(got[-1]), np.asarray(want), xs, stage, w[-_K:], p, m)
        if p == min(
            c[0] for c in _VALUE_CASES if c[0] > 1
        ):  # the fewest stages, on another axis name
            _other_axis(fn, devices, stage, w, xs, np.asarray(got[-1]))
        ran.append((p, m))
        if len(ran) > 1:
            continue  # gradients: on the first case
        r = jnp.asarray(rng.standard_normal(xs.shape), jnp.float32)
        traced = _jit(
            jax.grad(lambda w, x, f=body, r=r: (f(w, x)[-1] * r).sum(), argnums=(0, 1))
        ).trace(w, xs)
        cond_collectives(traced.jaxpr, f"with p={p}, m={m} jax.grad of the pipeline")
        grads = traced.lower().compile()(w, xs)
        ref = _jit(jax.grad(lambda w, x, r=r: (_ref(stage, w, x) * r).sum(), argnums=(0, 1)))(w, xs)
        if not all(
            np.allclose(a, b, rtol=_rtol(), atol=_rtol()) for a, b in zip(grads, ref, strict=True)
        ):
            fail(
                f"with p={p}, m={m} the outputs are right but jax.grad through the pipeline is not",
                "keep every step differentiable: no lax.stop_gradient, no integer casts of activations",
            )
    return ran


def cond_collectives(jaxpr, what: str) -> None:
    """Refuse a collective inside a ``lax.cond``/``lax.switch`` branch chosen differently on different
    devices (the branch index varies over a mesh axis; where its variance is not in the program, any
    index): the devices that take the other branch never join it, and XLA:CPU waits for them, then aborts
    the process (on a gradient: ``psum_invariant``, the transpose of a replicated value read in a branch).
    Read from the jaxpr before the program runs; a cond whose index is the same on every device (a loop
    counter) may hold collectives."""
    for eqn, _ in jaxpr_equations(jaxpr):
        if eqn.primitive.name != "cond":
            continue
        vma = getattr(eqn.invars[0].aval, "vma", None)
        if vma is not None and not vma:
            continue  # the same branch on every device
        inside = sorted(
            {
                e.primitive.name
                for b in eqn.params["branches"]
                for e, _ in jaxpr_equations(b)
                if communicates(e)
            }
        )
        if inside:
            gradient = "jax.grad" in what
            fail(
                f"{what} holds {', '.join(inside)} inside a lax.cond branch that some devices take and "
                "others do not"
                + (
                    " (in the gradient, psum_invariant is the transpose of a value that is the same on "
                    "every device, such as xs, read inside the branch)"
                    if gradient and "psum_invariant" in inside
                    else ""
                )
                + ": a collective inside lax.cond's branch runs on some devices only, and the others "
                "would wait for it forever (XLA:CPU gives up after a while and aborts the process)",
                "choose values with jnp.where (each stage computes both, or reads both, and keeps one) "
                "and keep every collective (lax.ppermute, psum …) outside lax.cond",
            )


_OTHER_COLLECTIVES = {
    "psum": "an all-reduce (psum)",
    "psum_invariant": "an all-reduce (psum)",
    "pmax": "an all-reduce (pmax)",
    "pmin": "an all-reduce (pmin)",
    "all_gather": "an all-gather",
    "all_gather_invariant": "an all-gather",
    "reduce_scatter": "a reduce-scatter",
    "all_to_all": "an all-to-all",
    "ragged_all_to_all": "an all-to-all",
}
"""Collectives a GPipe forward has no use for: it only sends activations to the next stage."""


def gpipe_structure(fn) -> tuple[float, float, float, set[tuple[int, int]]]:
    """Stage applications, sends and bytes sent per device, and the (source, destination) pairs of every
    ``ppermute``, from the jaxpr on an abstract 4-stage mesh."""
    p, m = SHAPE_CASE
    mapped = _mapped(fn, abstract((p,), (STAGE,)), residual_stage())
    w = jax.ShapeDtypeStruct((p * _K, WIDTH, WIDTH), jnp.float32)
    xs = jax.ShapeDtypeStruct((m, ROWS, WIDTH), jnp.float32)
    hint = "return ys [m, …] on every stage"
    jaxpr = run_mapped(
        "gpipe_forward on a 4-stage mesh", jax.make_jaxpr(mapped), w, xs, varies_hint=hint
    )
    cond_collectives(jaxpr, "on 4 stages the pipeline")
    dots = sent = sends = 0.0
    pairs: set[tuple[int, int]] = set()
    for eqn, times in jaxpr_equations(jaxpr):
        name = eqn.primitive.name
        if name == "while" and any(
            e.primitive.name == "ppermute"
            for sub in (eqn.params["body_jaxpr"],)
            for e, _ in jaxpr_equations(sub)
        ):
            fail(
                "a lax.while_loop sends with ppermute: its trip count is not in the program",
                "loop over the ticks with a Python for loop, lax.fori_loop with Python-int bounds, or "
                "lax.scan",
            )
        if name in _OTHER_COLLECTIVES:
            fail(
                f"on 4 stages the pipeline also runs {_OTHER_COLLECTIVES[name]} over the stage axis",
                "GPipe's forward moves nothing but each tick's activation from a stage to the next: any "
                "other collective is traffic the pipeline does not need",
            )
        if name == "dot_general":
            dots += times
        if name == "ppermute":
            sends += times
            sent += times * sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.invars)
            pairs |= {(int(a), int(b)) for a, b in eqn.params["perm"]}
    return dots / _K, sends, sent, pairs


def check_pairs(pairs: set[tuple[int, int]], p: int) -> None:
    """GPipe's forward sends stage i's output to stage i + 1 and nowhere else: fail on any other pair, or
    on a stage that never sends to the next one."""
    forward = {(i, i + 1) for i in range(p - 1)}
    extra, missing = sorted(pairs - forward), sorted(forward - pairs)
    want = "[(i, i + 1) for i in range(p - 1)]"
    if extra == [(p - 1, 0)]:
        fail(
            f"on p={p} stages the ppermute also sends from the last stage back to stage 0 (the pair "
            f"({p - 1}, 0)): a ring, one activation per tick more than GPipe sends",
            "the last stage's output goes into ys and stage 0 reads only xs, so nothing needs to reach "
            f"stage 0: the pairs are {want}, without ({p - 1}, 0)",
        )
    if extra and all(b == (a - 1) % p for a, b in extra):
        fail(
            f"on p={p} stages the ppermute sends to the previous stage: pairs {extra}",
            "in the forward each stage's output goes to the next stage, s -> s + 1: the pairs are "
            f"{want} (jax.grad sends the cotangents back by itself)",
        )
    if extra:
        fail(
            f"on p={p} stages the ppermute sends along pairs that are not a stage and the next: {extra}",
            f"GPipe sends stage i's output to stage i + 1 only: the pairs are {want}",
        )
    if pairs and missing:
        cut = ", ".join(f"{a} -> {b}" for a, b in missing)
        fail(
            f"on p={p} stages no ppermute sends {cut}: what that stage computes never reaches the next",
            f"every stage but the last sends its output to the next: the pairs are {want}",
        )

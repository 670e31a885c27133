"""Checkers for ``11_pipeline_experts.ipynb``: a GPipe forward pipeline built from ``ppermute`` (a project),
the bubble and stash of schedules predicted before they are read from the tables, and a router whose
silent bug only shows when experts fill up.

None of them holds an answer: the pipeline is compared with applying the stages in order on one device
(values and gradients, under ``shard_map`` on the devices present) and its ticks and sends are read from its
jaxpr on a 4-stage mesh traced without devices; the predictions are compared with the tables of
:mod:`course_lib.schedules`; the router with :func:`course_lib.moe.route` on capacities that drop.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from course_lib import moe, pipeline_measure, schedules
from course_lib.meshes import STAGE, mesh_of
from course_lib.pipeline_measure import residual_stage
from course_lib.programs import jaxpr_equations

from ._common import call_answer, checker, fail, passed
from ._spmd import abstract, run_mapped

__all__ = ["check_gpipe", "check_predict_pipeline", "check_router"]

# ---- exercise 1 (project): GPipe ------------------------------------------------------------------------

_D, _ROWS, _K = 8, 3, 2  # width, rows per micro-batch, layers per stage
_VALUE_CASES = (
    (4, 8),
    (2, 5),
    (3, 2),
    (1, 4),
)  # (p, m); those with p <= the devices present are run
_SHAPE_CASE = (4, 8)  # traced on an abstract mesh (no devices needed): ticks and sends


def _jit(fn):
    """``jax.jit`` for a program run once or twice: on CPU without LLVM's optimisations (half the compile)."""
    cpu = jax.default_backend() == "cpu"
    return jax.jit(fn, compiler_options={"xla_backend_optimization_level": 0} if cpu else None)


def _ref(stage, w_all, xs):
    """Every micro-batch through all layers in order, on one device: [m, rows, D]."""
    return jax.vmap(lambda x: stage(x, {"w": w_all}))(xs)


def _mapped(fn, mesh, stage):
    def body(w, xs):
        return fn(stage, {"w": w}, xs, STAGE)[None]  # [1, m, rows, D] per stage

    return jax.shard_map(body, mesh=mesh, in_specs=(P(STAGE), P()), out_specs=P(STAGE))


def _row_map(got, want) -> list[int | None]:
    """For each row of ``got``, the row of ``want`` it equals (None: none)."""
    out = []
    for g in got:
        hits = [j for j, w in enumerate(want) if np.allclose(g, w, rtol=1e-4, atol=1e-5)]
        out.append(hits[0] if hits else None)
    return out


def _diagnose_values(got, want, xs, stage, w_last, p, m):
    rows = _row_map(got, want)
    if rows == list(range(m)):
        return
    own = np.asarray(_jit(jax.vmap(lambda x: stage(x, {"w": w_last})))(xs))
    if p > 1 and np.allclose(got, own, rtol=1e-4, atol=1e-5):
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


def _values(fn, devices, rng):
    stage = residual_stage()
    ran = []
    for p, m in [c for c in _VALUE_CASES if c[0] <= len(devices)][:3]:
        w = jnp.asarray(rng.standard_normal((p * _K, _D, _D)) / np.sqrt(_D), jnp.float32)
        xs = jnp.asarray(rng.standard_normal((m, _ROWS, _D)), jnp.float32)
        body = _mapped(fn, mesh_of({STAGE: p}, devices[:p], axis_type="auto"), stage)
        mapped = _jit(body)
        hint = "return ys [m, …] on every stage (the checker reads the last stage's)"
        got = run_mapped(f"gpipe_forward with p={p}, m={m}", mapped, w, xs, varies_hint=hint)
        if got.shape != (p, m, _ROWS, _D):
            fail(
                f"with p={p}, m={m} each stage returned shape {got.shape[1:]}",
                f"return ys of the shape of xs, {(m, _ROWS, _D)}: micro-batch i's output in row i",
            )
        want = _jit(partial(_ref, stage))(w, xs)
        _diagnose_values(np.asarray(got[-1]), np.asarray(want), xs, stage, w[-_K:], p, m)
        ran.append((p, m))
        if len(ran) > 1:
            continue  # gradients: on the first case
        r = jnp.asarray(rng.standard_normal(xs.shape), jnp.float32)
        grads = _jit(jax.grad(lambda w, x, f=body, r=r: (f(w, x)[-1] * r).sum(), argnums=(0, 1)))(
            w, xs
        )
        ref = _jit(jax.grad(lambda w, x, r=r: (_ref(stage, w, x) * r).sum(), argnums=(0, 1)))(w, xs)
        if not all(
            np.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(grads, ref, strict=True)
        ):
            fail(
                f"with p={p}, m={m} the outputs are right but jax.grad through the pipeline is not",
                "keep every step differentiable: no lax.stop_gradient, no integer casts of activations",
            )
    return ran


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


def _structure(fn) -> tuple[float, float, float, set[tuple[int, int]]]:
    """Stage applications, sends and bytes sent per device, and the (source, destination) pairs of every
    ``ppermute``, from the jaxpr on an abstract 4-stage mesh."""
    p, m = _SHAPE_CASE
    mapped = _mapped(fn, abstract((p,), (STAGE,)), residual_stage())
    w = jax.ShapeDtypeStruct((p * _K, _D, _D), jnp.float32)
    xs = jax.ShapeDtypeStruct((m, _ROWS, _D), jnp.float32)
    hint = "return ys [m, …] on every stage"
    jaxpr = run_mapped(
        "gpipe_forward on a 4-stage mesh", jax.make_jaxpr(mapped), w, xs, varies_hint=hint
    )
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


def _check_pairs(pairs: set[tuple[int, int]], p: int) -> None:
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


@checker
def check_gpipe(gpipe_forward: Callable, devices: Sequence[Any]) -> bool:
    """``gpipe_forward(stage_fn, stage_params, xs, axis_name)`` run on each stage of ``axis_name``:
    stage ``s`` holds its layers, ``xs`` [m, …] holds every micro-batch; the last stage must return
    ``ys`` [m, …] with micro-batch ``i`` through all stages in row ``i``, differentiably, in ``m + p - 1``
    ticks of one stage application each, sending one activation per tick from each stage to the next
    (the ``ppermute`` pairs ``(i, i + 1)``: no pair back, no wrap-around from the last stage to stage 0)."""
    ticks, sends, sent, pairs = _structure(gpipe_forward)
    p, m = _SHAPE_CASE
    _check_pairs(pairs, p)  # read from the 4-stage program: caught however few devices are present
    ran = _values(gpipe_forward, list(devices), np.random.default_rng(11))
    act = _ROWS * _D * 4
    if sends == 0:
        fail(
            "on 4 stages the pipeline never calls lax.ppermute",
            "after each tick, send each stage's output to the next stage with lax.ppermute",
        )
    if ticks == m * p:
        fail(
            f"on p={p} stages with m={m} micro-batches each stage applies its layers {m * p:.0f} times: "
            "each micro-batch crosses every stage before the next one starts",
            f"overlap them: at tick t stage 0 starts micro-batch t; {m + p - 1} ticks in all (m + p - 1)",
        )
    if ticks != m + p - 1:
        if ticks < m + p - 1:
            hint = (
                f"{ticks:.0f} ticks are too few: micro-batch m - 1 enters stage 0 at tick m - 1 and leaves "
                "the last stage at tick m + p - 2, so the last p - 1 ticks drain the pipeline"
            )
        elif ticks > sent / act + 1.5:  # more applications than sends: several per tick
            hint = (
                "the stage runs more than once in a tick (each application is a stage's whole work)"
            )
        else:
            hint = (
                f"{ticks:.0f} ticks: after tick m + p - 2 the last stage has finished micro-batch m - 1, "
                "so a later tick's work fills no output"
            )
        fail(
            f"on p={p} stages with m={m} micro-batches each stage applies its layers {ticks:.0f} times; "
            f"GPipe needs m + p - 1 = {m + p - 1}",
            hint,
        )
    if sent > (m + p - 1) * act:
        fail(
            f"on p={p} stages each device sends {sent / act:.0f} activations' worth per step; "
            f"GPipe sends one activation per tick ({m + p - 1})",
            "send only the stage's output of this tick, not a buffer of outputs",
        )
    where = f"on {len(devices)} device(s) at (p, m) = {ran}" if ran else "(no devices to run it on)"
    return passed(
        f"equals the stages applied in order (values and gradients) {where}; on a 4-stage mesh, "
        f"{ticks:.0f} ticks for m = 8 (m + p - 1) and {sent / act:.0f} activations sent by ppermute, each "
        "from a stage to the next"
    )


# ---- exercise 2: predict the bubble and the stash ----------------------------------------------------------

_PREDICT_CASES = 12
"""How many cases :func:`check_predict_pipeline` draws at every call (4 per schedule)."""

_LIBRARY = (schedules.__file__, pipeline_measure.__file__)
"""The modules that build and measure the tables: a prediction must not call into them."""


def _predict_cases(rng: np.random.Generator) -> list[tuple[str, int, int, int]]:
    """Cases drawn afresh: each schedule at a few stage counts, with fewer and with more micro-batches than
    the stages (1F1B: ``m <= p``, ``p < m < 2p - 1`` and ``m >= 2p``), so that each typical formula is wrong
    somewhere; circular with ``m`` a multiple of ``p`` and ``v`` of 2 to 4."""
    out = []
    for _ in range(4):
        p = int(rng.integers(1, 9))
        out.append(("gpipe", p, int(rng.integers(1, 3 * p + 5)), 1))
    for kind in ("between", "many", "few", "many"):
        p = int(rng.integers(3 if kind == "between" else 2, 9))
        lo, hi = {"between": (p + 1, 2 * p - 1), "many": (2 * p, 4 * p + 1), "few": (1, p + 1)}[
            kind
        ]
        m = rng.integers(lo, hi)  # p < m < 2p - 1, m >= 2p, or m <= p
        out.append(("1f1b", p, int(m), 1))
    for _ in range(4):
        p = int(rng.integers(1, 7))
        out.append(("circular", p, p * int(rng.integers(1, 4)), int(rng.integers(2, 5))))
    return out


def _call_unaided(what: str, predict: Callable, *args):
    """``predict(*args)``, refused if it calls into the library that builds the tables it predicts."""
    seen: list[str] = []

    def watch(frame, event, arg):
        if event == "call" and frame.f_code.co_filename in _LIBRARY:
            seen.append(frame.f_code.co_name)

    old = sys.getprofile()
    sys.setprofile(watch)
    try:
        got = call_answer(what, predict, *args)
    finally:
        sys.setprofile(old)
    if seen:
        fail(
            f"{what} calls course_lib's schedules ({seen[0]}): it reads the tables it is asked to predict",
            "predict from p, m and v alone: a prediction is what you expect before you build the table",
        )
    return got


def _pair(got, what):
    if isinstance(got, dict) and {"bubble", "stash"} <= set(got):
        got = (got["bubble"], got["stash"])
    try:
        bubble, stash = got
        return float(bubble), float(stash)
    except (TypeError, ValueError):
        fail(f"{what} returned {got!r}", "return (bubble fraction, stash) — e.g. (0.25, 6)")


@checker
def check_predict_pipeline(predict: Callable, *, seed: int | None = None) -> bool:
    """``predict(name, p, m, v) -> (bubble, stash)`` for schedules ``"gpipe"``, ``"1f1b"``, ``"circular"``
    (``v`` chunks; 1 for the others): the bubble fraction (F cost 1, B cost 2) and the most micro-batch
    inputs one stage holds at once, compared with the tables of :mod:`course_lib.schedules` on
    :data:`_PREDICT_CASES` cases drawn afresh at every call (``seed``: for tests), so that a table of
    answers fitted to the checker's replies does not pass; says how many bubbles and stashes are wrong,
    not which. A ``predict`` that calls into the schedules' library is refused."""
    cases = _predict_cases(np.random.default_rng(seed))
    bubbles = stashes = wrong = 0
    for name, p, m, v in cases:
        what = f"predict({name!r}, {p}, {m}, {v})"
        bubble, stash = _pair(_call_unaided(what, predict, name, p, m, v), "predict")
        sched = schedules.make(name, p, m, v)
        truth = (schedules.bubble_fraction(sched), int(sched.in_flight().max()))
        bad_bubble, bad_stash = not abs(bubble - truth[0]) < 1e-3, stash != truth[1]
        bubbles, stashes, wrong = (
            bubbles + bad_bubble,
            stashes + bad_stash,
            wrong + (bad_bubble or bad_stash),
        )
    if wrong:
        fail(
            f"{wrong} of {len(cases)} cases are wrong ({bubbles} bubbles, {stashes} stashes; the cases "
            "are drawn anew at every check)",
            "work a small case out by hand (p = 2 or 3, a few micro-batches): the bubble is the share of "
            "the ticks' work (F 1, B 2, on every stage) that is idle; the stash is the most inputs one "
            "stage holds between a micro-batch's F and its B",
        )
    return passed(f"bubble and stash right in all {len(cases)} cases drawn (GPipe, 1F1B, circular)")


# ---- exercise 3: the router --------------------------------------------------------------------------------

_ROUTER_CASES = (
    (64, 8, 2, 0.5),
    (64, 8, 2, 1.0),
    (64, 8, 2, 4.0),
    (64, 8, 1, 0.75),
    (48, 12, 2, 1.0),
    (40, 10, 1, 1.5),
)
"""(tokens, experts, k, capacity factor): mostly one shape per k (each operation compiles once per shape),
and two with more experts and other token counts, so that an answer written for the notebook's 8 experts
fails."""


def _routing(got, what) -> moe.Routing:
    try:
        return moe.Routing(*(jnp.asarray(a) for a in got))
    except TypeError:
        fail(
            f"{what} returned {type(got).__name__}",
            "return (expert, slot, keep, gate), each [N, k]",
        )


def _places(expert: np.ndarray, n_experts: int, order: str) -> np.ndarray:
    """Each choice's place in its expert's buffer when places are counted in ``order``: "choice" (every
    first choice, then every second, tokens in order within a choice: the rule), "token" (a token's
    choices one after the other) or "each choice" (a count of its own for each choice)."""
    n, k = expert.shape
    out = np.zeros_like(expert)
    seq = (
        [(i, c) for c in range(k) for i in range(n)]
        if order != "token"
        else [(i, c) for i in range(n) for c in range(k)]
    )
    count = np.zeros((k if order == "each choice" else 1, n_experts), int)
    for i, c in seq:
        row = c if order == "each choice" else 0
        out[i, c] = count[row, expert[i, c]]
        count[row, expert[i, c]] += 1
    return out


def _router_hint(r, ref, logits, k, cap) -> tuple[str, str]:
    if not np.array_equal(r.expert, ref.expert):
        return (
            "chooses other experts",
            "take the k largest router probabilities, largest first (lax.top_k)",
        )
    if not np.allclose(r.gate, ref.gate, rtol=1e-5, atol=1e-6):
        raw = lax.top_k(jax.nn.softmax(logits, axis=-1), k)[0]
        if np.allclose(r.gate, raw, rtol=1e-5):
            return (
                "gives gates that do not sum to 1",
                "renormalise the k probabilities over the k choices",
            )
        return (
            "gives other gates",
            "the gates are the chosen experts' probabilities, renormalised over the k",
        )
    slot, want, expert = np.asarray(r.slot), np.asarray(ref.slot), np.asarray(ref.expert)
    kept = np.asarray(ref.keep)
    if np.array_equal(slot, want + 1):
        if np.array_equal(np.asarray(r.keep), slot < cap):
            return (
                "gives every expert's first choice place 1, so a full expert keeps capacity - 1 choices",
                "the places are the rows of an expert's buffer [capacity, D], 0 … capacity-1: with places "
                "from 1 a full expert's row 0 is never filled",
            )
        return (
            "gives every expert's first choice place 1",
            "the places are the rows of an expert's buffer [capacity, D]: 0 … capacity-1",
        )
    if not np.array_equal(np.where(kept, slot, 0), np.where(kept, want, 0)):
        e = logits.shape[1]
        if np.array_equal(slot, _places(expert, e, "each choice")):
            return (
                "counts places for each choice on its own: an expert's second choices start again at "
                "place 0, on rows its first choices already fill",
                "one count per expert over all the choices: an expert's second choices take the places "
                "after all of its first choices",
            )
        if np.array_equal(slot, _places(expert, e, "token")):
            return (
                "places the choices token by token (a token's second choice before the next token's first)",
                "every token's first choice before any second choice; within a choice, tokens in order",
            )
        miscounted = [
            x
            for x in range(e)
            if sorted(slot[expert == x].tolist()) != list(range(int((expert == x).sum())))
        ]
        if not miscounted:
            return (
                "gives each expert the places 0, 1, 2, … but to its choices in another order",
                "every token's first choice before any second choice; within a choice, tokens in order",
            )
        return (
            f"gives the choices of expert(s) {miscounted} places that are not 0, 1, 2, … one each",
            f"count the places of every one of the E = {e} experts (logits.shape[1]): an expert's choices "
            "get 0, 1, 2, … in the order of the rule",
        )
    keep = np.asarray(r.keep)
    if np.array_equal(slot, want) and np.array_equal(keep, slot <= cap):
        return (
            "keeps a choice whose place equals the capacity",
            f"places are 0 … capacity-1 = {cap - 1}",
        )
    extra, lost = int((keep & ~kept).sum()), int((~keep & kept).sum())
    return (
        f"keeps {extra} choice(s) the rule drops and drops {lost} it keeps",
        "keep a choice exactly when its place is below the capacity",
    )


@checker
def check_router(route: Callable) -> bool:
    """``route(logits [N, E], k, capacity) -> (expert, slot, keep, gate)`` as :func:`course_lib.moe.route`,
    on capacities that drop choices and ones that drop none."""
    rng = np.random.default_rng(23)
    for n, e, k, cf in _ROUTER_CASES:
        logits = jnp.asarray(rng.standard_normal((n, e)), jnp.float32)
        cap = moe.capacity(n, e, k, cf)
        what = f"route(logits [{n}, {e}], k={k}, capacity={cap})"
        r = _routing(call_answer(what, route, logits, k, cap), what)
        ref = moe.route(logits, k, cap)
        if any(a.shape != b.shape for a, b in zip(r, ref, strict=True)):
            fail(
                f"{what} returned shapes {[tuple(a.shape) for a in r]}",
                f"each is [N, k] = [{n}, {k}]",
            )
        same = (
            np.array_equal(r.expert, ref.expert)
            and np.array_equal(r.keep, ref.keep)
            and np.array_equal(np.where(ref.keep, r.slot, 0), np.where(ref.keep, ref.slot, 0))
            and np.allclose(r.gate, ref.gate, rtol=1e-5, atol=1e-6)
        )
        if not same:
            dropped = int((~np.asarray(ref.keep)).sum())
            problem, hint = _router_hint(r, ref, logits, k, cap)
            fail(f"{what} {problem} ({dropped} of {n * k} choices should be dropped)", hint)
    return passed(
        f"routes as the reference on {len(_ROUTER_CASES)} cases, with and without dropped choices"
    )


def moe_output(
    route: Callable, x: jax.Array, p: dict, *, k: int, capacity_factor: float
) -> jax.Array:
    """The MoE MLP on one device with ``route`` as its router (the notebook runs the given router with it)."""
    flat = x.reshape(-1, x.shape[-1])
    e = p["router"]["kernel"].shape[1]
    cap = moe.capacity(flat.shape[0], e, k, capacity_factor)
    r = moe.Routing(*route(flat @ p["router"]["kernel"], k, cap))
    return moe.combine(moe.experts(p, moe.dispatch(flat, r, e, cap)), r).reshape(x.shape)

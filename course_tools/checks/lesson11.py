"""Checkers for ``11_pipeline_experts.ipynb``: a GPipe forward pipeline built from ``ppermute`` (a project),
the bubble and stash of schedules predicted before they are read from the tables, ZB-H1's orders built by
hand (:mod:`._lesson11_zb`), a router whose silent bug only shows when experts fill up, and the
``all_to_all`` exchange of a MoE layer whose experts sit beside data (:mod:`._lesson11_experts`), its bytes
predicted first (:mod:`._lesson11_exchange`).

None of them holds an answer: the pipeline is compared with applying the stages in order on one device
(values and gradients, under ``shard_map`` on the devices present) and its ticks and sends are read from its
jaxpr on a 4-stage mesh traced without devices; the predictions are compared with the tables of
:mod:`course_lib.schedules`; the router with :func:`course_lib.moe.route` on capacities that drop. The
pipeline and the router are run with the library functions they are compared with (``pipeline.forward`` and
``train``; ``moe.route``) replaced by stubs that raise (:mod:`._unaided`): an answer that calls them is
refused, and the predictions may not call into the schedules' modules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from course_lib import moe, op_schedules, pipeline, pipeline_measure, pipeline_memory, schedules

from ._common import checker, fail, judged_on, passed
from ._lesson11_exchange import check_exchange_bytes
from ._lesson11_experts import check_expert_exchange
from ._lesson11_gpipe import ROWS, SHAPE_CASE, WIDTH, check_pairs, gpipe_structure, gpipe_values
from ._lesson11_zb import check_zb_h1_orders
from ._unaided import call_outside, call_unaided, unaided

__all__ = [
    "check_gpipe",
    "check_predict_pipeline",
    "check_zb_h1_orders",
    "check_router",
    "check_exchange_bytes",
    "check_expert_exchange",
]

# ---- exercise 1 (project): GPipe ------------------------------------------------------------------------


_EXECUTORS = (pipeline.forward, pipeline.train)
"""The library's pipeline executors: exercise 1 asks the learner to write what they do."""

_EXECUTOR_HINT = (
    "the exercise is to write the pipeline: loop over the m + p - 1 ticks yourself with lax.axis_index, "
    "lax.axis_size and lax.ppermute instead of running course_lib.pipeline's executor"
)

_METADATA_BYTES = 16
"""What a GPipe tick may send beyond its activation: four 4-byte scalars (a micro-batch id, a valid flag);
a buffer of outputs is far more (one activation here is ``ROWS·WIDTH·4`` = 96 bytes)."""


@checker
@judged_on(
    4,
    "the values are compared up to p = 4 stages, where a row or tick off only on more stages than 2 "
    "or 3 shows; a pipeline of one stage sends nothing, so what its sends carry (a narrower dtype) "
    "is unseen",
)
def check_gpipe(gpipe_forward: Callable, devices: Sequence[Any]) -> bool:
    """``gpipe_forward(stage_fn, stage_params, xs, axis_name)`` run on each stage of ``axis_name``:
    stage ``s`` holds its layers, ``xs`` [m, …] holds every micro-batch; the last stage must return
    ``ys`` [m, …] with micro-batch ``i`` through all stages in row ``i``, differentiably, in ``m + p - 1``
    ticks of one stage application each, sending one activation per tick from each stage to the next
    (the ``ppermute`` pairs ``(i, i + 1)``: no pair back, no wrap-around from the last stage to stage 0),
    plus at most :data:`_METADATA_BYTES` per tick. It is run with ``course_lib.pipeline``'s executors
    (``forward``, ``train``) replaced by functions that raise: an answer that calls them is refused; so is
    one that names the axis itself (run again on an axis called "other", :mod:`._axis_names`) or whose
    forward or gradient holds a collective in a ``lax.cond`` branch that only some stages take (read from
    the jaxpr before it runs: :func:`._lesson11_gpipe.cond_collectives`)."""
    # run with the library's executors off; the pairs are read from the 4-stage program, so a wrong pair
    # is caught however few devices are present
    with unaided("gpipe_forward", _EXECUTORS, _EXECUTOR_HINT):
        ticks, sends, sent, pairs = gpipe_structure(gpipe_forward)
        p, m = SHAPE_CASE
        check_pairs(pairs, p)
        ran = gpipe_values(gpipe_forward, list(devices), np.random.default_rng(11))
    act = ROWS * WIDTH * 4
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
    if sent > (m + p - 1) * (act + _METADATA_BYTES):
        fail(
            f"on p={p} stages each device sends {sent:.0f} bytes per step, {sent / act:.2f} activations "
            f"of {act} bytes; GPipe sends one activation per tick ({m + p - 1}, {(m + p - 1) * act} "
            f"bytes), plus at most {_METADATA_BYTES} bytes of metadata per tick (a micro-batch id, a flag)",
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

_LIBRARY = {
    module.__file__: module.__name__.rsplit(".", 1)[-1]
    for module in (schedules, pipeline_measure, op_schedules, pipeline_memory)
}
"""The modules that build, measure and state the schedules' tables (their closed forms too:
``op_schedules.predicted_bubble``, ``predicted_in_flight``): a prediction must not call into them."""


def _predict_cases(rng: np.random.Generator) -> list[tuple[str, int, int, int]]:
    """Cases drawn afresh: each schedule at a few stage counts, with fewer and with more micro-batches than
    the stages (lockstep 1F1B: ``m <= p``, ``p < m < 2p - 1`` and ``m >= 2p``), so that each typical formula is wrong
    somewhere; circular with ``m`` a multiple of ``p`` and ``v`` of 2 to 4. GPipe and circular have
    ``m > p`` in one case at least (drawn again where none has), where a formula that puts ``p`` for ``m``
    (a circular stash ``v·p``) is wrong."""
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
        out.append(("1f1b_lockstep", p, int(m), 1))
    for _ in range(4):
        p = int(rng.integers(1, 7))
        out.append(("circular", p, p * int(rng.integers(1, 4)), int(rng.integers(2, 5))))
    for kind in (
        "gpipe",
        "circular",
    ):  # each with m > p at least once (where m = p, p stands for m)
        if not any(c[0] == kind and c[2] > c[1] for c in out):
            last = max(i for i, c in enumerate(out) if c[0] == kind)
            _, p, _, v = out[last]
            m = (
                int(rng.integers(p + 1, 3 * p + 5))
                if kind == "gpipe"
                else p * int(rng.integers(2, 4))
            )
            out[last] = (kind, p, m, v)
    return out


def _call_unaided(what: str, predict: Callable, *args):
    """``predict(*args)``, refused if it calls into the library that builds the tables it predicts, or if it
    switches off or replaces the profile hook that watches those calls (``_unaided.call_outside``)."""
    return call_outside(
        what, predict, _LIBRARY,
        ("calls course_lib's schedules", ": it reads the tables it is asked to predict, or their closed forms"),
        "predict from p, m and v alone: a prediction is what you expect before you build the table", *args,
    )  # fmt: skip


def _pair(got, what, p):
    """``(bubble, stash)`` from an answer: the bubble a number, the stash ``p`` numbers (one per stage)."""
    if isinstance(got, dict) and {"bubble", "stash"} <= set(got):
        got = (got["bubble"], got["stash"])
    try:
        bubble, stash = got
        bubble = float(bubble)
    except (TypeError, ValueError):
        fail(
            f"{what} returned {got!r}",
            "return (bubble fraction, stash per stage) — e.g. (0.25, [3, 1])",
        )
    try:
        if np.ndim(stash) != 1 or len(stash) != p:
            raise ValueError
        return bubble, [float(x) for x in stash]
    except (TypeError, ValueError):
        fail(
            f"{what} returned the stash {stash!r}",
            f"the stash is one number per stage: a list of p = {p} numbers, stage 0 first",
        )


@checker
def check_predict_pipeline(predict: Callable, *, seed: int | None = None) -> bool:
    """``predict(name, p, m, v) -> (bubble, stash)`` for schedules ``"gpipe"``, ``"1f1b_lockstep"``, ``"circular"``
    (``v`` chunks; 1 for the others): the bubble fraction (F cost 1, B cost 2) and, per stage, the most
    micro-batch inputs it holds at once (``p`` numbers, stage 0 first; ``sched.in_flight()``), compared
    with the tables of :mod:`course_lib.schedules` on
    :data:`_PREDICT_CASES` cases drawn afresh at every call (``seed``: for tests), so that a table of
    answers fitted to the checker's replies does not pass; says how many bubbles and stashes are wrong,
    not which. A ``predict`` that calls into the schedules' library is refused."""
    cases = _predict_cases(np.random.default_rng(seed))
    bubbles = stashes = wrong = 0
    for name, p, m, v in cases:
        what = f"predict({name!r}, {p}, {m}, {v})"
        bubble, stash = _pair(_call_unaided(what, predict, name, p, m, v), what, p)
        sched = schedules.make(name, p, m, v)
        truth = (schedules.bubble_fraction(sched), sched.in_flight().tolist())
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
            "the ticks' work (F 1, B 2, on every stage) that is idle; a stage's stash is the most "
            "inputs it holds between a micro-batch's F and its B: count it for each stage",
        )
    return passed(
        f"bubble and stash right in all {len(cases)} cases drawn (GPipe, lockstep 1F1B, circular)"
    )


# ---- exercise 4: the router --------------------------------------------------------------------------------

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
    except (
        TypeError,
        ValueError,
    ) as e:  # not four parts; a part that is not numbers (strings, ragged)
        parts = f" ({type(e).__name__}: {str(e)[:80]})" if isinstance(e, ValueError) else ""
        fail(
            f"{what} returned {type(got).__name__}{parts}",
            "return (expert, slot, keep, gate), each an array of numbers [N, k]",
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


_ROUTER_REPORTS: dict[str, int] = {}
"""How often :func:`check_router` has reported each kind of mistake in this kernel: the first report of a
places-one-late router asks where to look, a later one names the mistake."""


def _one_place_late() -> tuple[str, str]:
    """The reply to a router whose places start at 1 (the given router's): a question first, then the name."""
    seen = _ROUTER_REPORTS["one late"] = _ROUTER_REPORTS.get("one late", 0) + 1
    if seen == 1:
        return (
            "keeps fewer choices than the rule where an expert fills up",
            "which places do a full expert's choices get, and which rows does its buffer [capacity, D] "
            "have? Print slot and keep for one expert chosen more than capacity times",
        )
    return (
        "lets a full expert keep capacity - 1 choices, one fewer than its capacity",
        "its places start at 1, not 0: the first choice of an expert takes row 1, so row 0 of its buffer "
        "[capacity, D] stays empty and its last choice finds no row",
    )


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
            return _one_place_late()
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


def _router_dtypes(r: moe.Routing, what: str) -> None:
    """expert and slot index the experts' buffers: integers. (keep may be bool, or 0/1 in any dtype: the MoE
    layer only multiplies by it, and its values are checked.)"""
    for name in ("expert", "slot"):
        dt = getattr(r, name).dtype
        if not jnp.issubdtype(dt, jnp.integer):
            fail(
                f"{what} returned {name} as {dt}: {name} is used as an index",
                f"{name} picks places in the experts' buffers (expert × capacity + slot), and an index "
                "must be an integer: return it as an integer array (such as int32), cast nothing to float",
            )


_ROUTE_HINT = (
    "the exercise is to find the bug in the given router (route_given) and return its "
    "routing fixed: keep its lax.top_k of the softmax and its cumulative count of each "
    "expert's places, and correct the line that breaks the rule, instead of calling moe.route"
)


@checker
def check_router(route: Callable) -> bool:
    """``route(logits [N, E], k, capacity) -> (expert, slot, keep, gate)`` as :func:`course_lib.moe.route`,
    on capacities that drop choices and ones that drop none. A ``route`` that calls ``moe.route`` is
    refused: it is run with ``moe.route`` replaced by a function that raises; a call to a copy of
    its bytecode is refused too (:mod:`._unaided`: a function over its code object, or its source
    compiled unchanged beside its module's imports). A copy of its source otherwise (the given
    router fixed, the library's edited or pasted into a cell without those imports) is judged like
    any other answer, by what it returns."""
    rng = np.random.default_rng(23)
    for n, e, k, cf in _ROUTER_CASES:
        logits = jnp.asarray(rng.standard_normal((n, e)), jnp.float32)
        cap = moe.capacity(n, e, k, cf)
        what = f"route(logits [{n}, {e}], k={k}, capacity={cap})"
        r = _routing(call_unaided(what, route, (moe.route,), _ROUTE_HINT, logits, k, cap), what)
        ref = moe.route(logits, k, cap)
        if any(a.shape != b.shape for a, b in zip(r, ref, strict=True)):
            fail(
                f"{what} returned shapes {[tuple(a.shape) for a in r]}",
                f"each is [N, k] = [{n}, {k}]",
            )
        _router_dtypes(r, what)
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

"""Lesson 11's exercise 5: the all_to_all dispatch and return of a MoE layer in the expert × data layout.

The answer ``moe_layer(x, p, axis_name, k, capacity_factor)`` runs inside ``shard_map`` over a 2-D mesh
(tokens split over both axes, experts over ``axis_name``). It is judged by what it computes and sends,
never by its text:

- its output against :func:`course_lib.moe.moe_mlp` on one device with one group per device, at a
  capacity that drops choices, on two meshes: ``data × expert`` = 2 × 4 (2 × 2 on 4 devices) and, with
  other axis names, ``rows × ep`` = 2 × 2 (an answer that names an axis itself instead of ``axis_name`` fails there);
  on 4 to 7 devices a third, ``data × expert`` = 1 × 4, so that an expert axis of 4 is judged there too;
- the arrays it hands to ``moe.experts`` and ``moe.combine`` (recorded while it runs), for a hint that
  names the dimension that is wrong;
- the compiled program's collectives: exactly two all-to-alls' bytes on the expert axis and nothing on the
  other (an ``all_gather`` sends ``n`` times more), all of them all-to-alls (``n - 1`` ppermutes send the
  same bytes in ``n - 1`` rounds); the hint names what the collectives found say;
- the gradient of ``<output, r>`` in the tokens, the router and the experts' weights on the first mesh,
  against the one-device MoE's (an exchange behind ``lax.stop_gradient`` has the right values);
- outputs off by less than :data:`ROUNDED` of the largest are told they are rounded (a bfloat16 exchange),
  not misplaced.

It runs with :mod:`course_lib.moe_layout`'s exchange and layer and :func:`course_lib.moe.moe_mlp_ep` replaced
by stubs that raise (:mod:`._unaided`). Fewer than 4 devices cannot hold both axes: the verdict then comes
from a fresh process with 8 simulated CPU devices (:func:`._common.judged_on`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from course_lib import comms, moe, moe_layout
from course_lib.meshes import mesh_of

from ._common import call_answer, checker, close, fail, judged_on, passed
from ._unaided import unaided

__all__ = ["check_expert_exchange"]

E, K, D, F, N, CF = 8, 2, 16, 32, 16, 1.0
"""Experts, choices per token, width, hidden width, tokens per device, capacity factor (drops choices)."""

_MESHES = ((("data", 2), ("expert", 4)), (("rows", 2), ("ep", 2)))
"""(data-like axis, expert axis) with sizes (the expert axis 2 on 4 devices): the second with names no
notebook uses."""

_WIDE = (("data", 1), ("expert", 4))
"""The mesh added on 4 to 7 devices: an expert axis of 4, as the 2 × 4 mesh has on 8."""

_INIT = jax.jit(lambda key: moe.init_moe(key, D, F, E))
_ONCE = {"xla_backend_optimization_level": 0}
"""XLA:CPU without LLVM's optimisations for programs run once (half the compile, the same values)."""

_FORBIDDEN = (
    moe_layout.to_experts,
    moe_layout.from_experts,
    moe_layout.moe_mlp_ep_dp,
    moe.moe_mlp_ep,
)

_HINT = (
    "the exercise is to write the exchange: call jax.lax.all_to_all yourself instead of "
    "course_lib.moe_layout's to_experts / from_experts / moe_mlp_ep_dp or moe.moe_mlp_ep"
)

_LAYOUT_HINT = (
    "give moe.experts [E/n, n·C, D] (or [E/n, n, C, D]): this device's E/n experts first, then the places "
    "from device 0, 1, … of axis_name. A tiled lax.all_to_all splits one dimension into n blocks (block j "
    "to device j: here the experts) and concatenates what arrives along another (here the places, device "
    "0's first); if it concatenates along the experts' dimension instead, the source device comes first "
    "([n·E/n, C, D]): reshape to [n, E/n, C, D] and transpose the experts in front before merging. The way "
    "back undoes it, ending in [E, C, D] expert-major on the device whose tokens they are"
)


@contextlib.contextmanager
def _recording(seen: dict):
    """While the block runs, ``moe.experts`` and ``moe.combine`` record the shapes they are given."""
    experts, combine = moe.experts, moe.combine

    def rec_experts(p, h):
        seen.setdefault("experts", tuple(h.shape))
        return experts(p, h)

    def rec_combine(y, r):
        seen.setdefault("combine", tuple(y.shape))
        return combine(y, r)

    moe.experts, moe.combine = rec_experts, rec_combine
    try:
        yield
    finally:
        moe.experts, moe.combine = experts, combine


def _explain(names: tuple[str, str], seen: dict, cap: int, n_e: int):
    def explain(err: BaseException):
        text = str(err)
        unbound = re.search(r"unbound axis name: (\w+)", text)
        if unbound and unbound.group(1) not in names:
            return (
                f"moe_layer names the mesh axis {unbound.group(1)!r}, which this mesh ({names[0]!r} × "
                f"{names[1]!r}) does not have",
                "exchange over axis_name, the argument (the expert axis), not a name written in",
            )
        problem = _shape_problem(seen, cap, n_e)
        if problem is None and "all_to_all" in text:
            problem = (
                f"moe_layer's lax.all_to_all raised {type(err).__name__}: {text[:300]}",
                _LAYOUT_HINT,
            )
        return problem

    return explain


def _shape_problem(seen: dict, cap: int, n_e: int) -> tuple[str, str] | None:
    got = seen.get("experts")
    if got is not None and (got[0] != E // n_e or int(np.prod(got[1:-1])) != n_e * cap):
        return (
            f"moe.experts is given an array of shape {got}; with E = {E} experts on {n_e} devices and "
            f"C = {cap} places it needs this device's {E // n_e} experts first and {n_e}·{cap} places",
            _LAYOUT_HINT,
        )
    back = seen.get("combine")
    if back is not None and back != (E, cap, D):
        return (
            f"moe.combine is given an array of shape {back}; it needs [E, C, D] = [{E}, {cap}, {D}] "
            "(every expert's places of this device's tokens)",
            "on the way back, exchange the experts' outputs so that each device gets its own places of "
            "every expert, and reshape to [E, C, D] if your layout had a separate source dimension",
        )
    return None


def _run(moe_layer: Callable, names: tuple[str, str], sizes: tuple[int, int], devices, rng):
    """The answer's output and compiled program on one mesh, and the one-device reference."""
    mesh = mesh_of(dict(zip(names, sizes, strict=True)), devices[: sizes[0] * sizes[1]], "auto")
    n = sizes[0] * sizes[1]
    # host arrays: placing them on the mesh needs no program (a device array would be sliced by one per leaf)
    p = jax.device_get(_INIT(jax.random.key(int(rng.integers(1 << 30)))))
    x = rng.standard_normal((n * N, D)).astype(np.float32)
    body = lambda x, p: moe_layer(x, p, names[1], K, CF)  # noqa: E731
    specs = (P(names), moe.expert_specs(p, names[1]))
    once = _ONCE if jax.default_backend() == "cpu" else None
    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(names)), compiler_options=once
    )
    seen: dict = {}
    cap = moe.capacity(N, E, K, CF)
    what = f"moe_layer on a {names[0]} × {names[1]} = {sizes[0]} × {sizes[1]} mesh"
    with _recording(seen):
        compiled = call_answer(
            what, lambda: fn.lower(x, p).compile(), explain=_explain(names, seen, cap, sizes[1])
        )
    got = compiled(x, p)
    want = jax.jit(lambda x, p: moe.moe_mlp(x, p, k=K, capacity_factor=CF, n_groups=n))(x, p)
    return got, want, compiled, mesh, seen, cap, (x, p, body, specs)


UNTILED = (
    "its gradient not judged: JAX cannot differentiate an untiled lax.all_to_all whose split_axis and "
    "concat_axis differ (its transpose expects other shapes), a tiled one it can"
)
"""What the pass message says when the answer's backward raises JAX's own error (JAX 0.12)."""


def _judge_grads(mesh, names: tuple[str, str], run: tuple) -> str:
    """The gradient of ``<layer(x), r>`` in ``x``, the router and the experts' weights against the
    one-device MoE's: an exchange the backward cannot pass (``lax.stop_gradient``) keeps the values.
    Returns what the pass message says of the gradient."""
    x, p, body, specs = run
    n = int(np.prod(list(mesh.shape.values())))
    r = np.random.default_rng(36).standard_normal(x.shape).astype(np.float32)
    layer = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(names))
    ref = lambda x, p: moe.moe_mlp(x, p, k=K, capacity_factor=CF, n_groups=n)  # noqa: E731
    once = _ONCE if jax.default_backend() == "cpu" else None

    def grads(fn):
        return jax.jit(jax.grad(lambda x, p: (fn(x, p) * r).sum(), (0, 1)), compiler_options=once)

    what = f"jax.grad of moe_layer on the {names[0]} × {names[1]} mesh"
    try:
        got = grads(layer)(x, p)
    except ValueError as err:
        if "Expected cotangent type" in str(err):
            return UNTILED  # JAX's own transpose of an untiled all_to_all, not the answer's
        got = call_answer(what, grads(layer), x, p)  # raises again, as an ExerciseError with a hint
    want = grads(ref)(x, p)
    leaves = [("the tokens x", got[0], want[0])] + [
        (f"params{jax.tree_util.keystr(path)}", g, w)
        for (path, g), w in zip(
            jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(want[1]), strict=True
        )
    ]
    wrong = [name for name, g, w in leaves if not close(g, w)]
    if wrong:
        fail(
            f"the outputs are right, but jax.grad through moe_layer on the {names[0]} × {names[1]} mesh "
            f"is not the one-device MoE's for {', '.join(wrong)}",
            "keep the exchange differentiable: no lax.stop_gradient and no integer casts of the buffer or "
            "the experts' outputs (lax.all_to_all's gradient is the all_to_all back, which JAX derives)",
        )
    return "and its gradient on the first"


def _judge_bytes(compiled, mesh, names, cap: int) -> None:
    """Exactly two all-to-alls' bytes on the expert axis, nothing on the other, and all of it all-to-alls."""
    n_e = mesh.shape[names[1]]
    ops = [c for c in comms.collectives(compiled.as_text(), dict(mesh.shape)) if c.sent_bytes]
    sent = comms.sent_by_axis(ops)
    kinds = sorted({c.kind for c in ops})
    want = {names[1]: 2 * (n_e - 1) / n_e * E * cap * D * 4}
    what = f"on the {names[0]} × {names[1]} mesh each device sends {sent} bytes per axis ({', '.join(kinds)})"
    if not comms.same_by_axis(sent, want):
        fail(
            f"{what}; the two exchanges of the buffer [E, C, D] = [{E}, {cap}, {D}] (float32) send {want}",
            "exchange with two lax.all_to_all over axis_name only: "
            + _bytes_hint(kinds, sent, names),
        )
    if kinds != ["all-to-all"]:
        fail(
            f"{what}: the right bytes, but not by all-to-alls",
            "one lax.all_to_all each way: n-1 ppermutes (collective-permutes) send the same bytes in n-1 "
            "rounds, each with its own latency, where one all-to-all moves every block at once",
        )


def _bytes_hint(kinds: list[str], sent: dict, names: tuple[str, str]) -> str:
    """What the collectives found say about the bytes: a gather or a sum, the other axis, or extra data."""
    hints = []
    if {"all-gather", "all-reduce", "reduce-scatter"} & set(kinds):
        hints.append(
            "an all_gather or a psum (or psum_scatter) sends every device's whole buffer, or the experts' "
            "weights when those are gathered: many times what an all_to_all sends"
        )
    if any(axis != names[1] for axis in sent):
        hints.append("nothing needs to cross the other axis")
    if not hints:
        hints.append(
            "all-to-alls that carry more, or less, than the dispatch buffer [E, C, D] and the experts' "
            "outputs [E/n, n·C, D], in float32: send those arrays themselves, nothing beside them"
        )
    return "; ".join(hints)


ROUNDED = 0.05
"""Largest error, relative to the largest output, of an answer whose values are only rounded (an exchange in
bfloat16: 2⁻⁸ per element); a place computed by another expert or returned to another token is off by about
the outputs' own size."""


def _judge_rounding(got, want) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    if err < ROUNDED:
        fail(
            f"the outputs are near the one-device MoE's but off by {err:.1e} of the largest (more than "
            "this platform's matmul rounding), as when every place is computed by its expert and comes back "
            "at a lower precision",
            "exchange the float32 buffer and outputs as they are: a cast to bfloat16 or float16 around "
            "lax.all_to_all rounds every value sent",
        )


def _expert_size(want: int, room: int) -> int:
    """The expert axis of a mesh: at most ``want`` and ``room`` devices, and a divisor of the E experts
    (on 6 or 7 devices, 2 × 3 would leave 8 experts unsplittable: 2 × 2 is used)."""
    size = min(want, room)
    while E % size:
        size -= 1
    return size


@judged_on(4, "fewer than 4 devices cannot hold a data axis and an expert axis of 2 or more each")
def _check(moe_layer: Callable, devices: Sequence[Any]) -> bool:
    rng = np.random.default_rng(35)
    graded = ""
    # on 4 to 7 devices the expert axis of the 2 × 2 meshes is 2, where a place sent to device j + 2's
    # slot is sent home: a 1 × 4 mesh as well gives an expert axis of 4
    wide = len(devices) < 8
    for axes in _MESHES + ((_WIDE,) if wide else ()):
        names, sizes = tuple(a for a, _ in axes), tuple(s for _, s in axes)
        sizes = (sizes[0], _expert_size(sizes[1], len(devices) // sizes[0]))  # 2 x 2 on 4 to 7
        with unaided("moe_layer", _FORBIDDEN, _HINT):
            got, want, compiled, mesh, seen, cap, run = _run(moe_layer, names, sizes, devices, rng)
        if tuple(got.shape) != tuple(want.shape):
            fail(
                f"moe_layer returned {tuple(got.shape)} per mesh; want {tuple(want.shape)}",
                "return moe.combine(back, r): one row per token of this device",
            )
        if not close(got, want):
            _judge_rounding(got, want)
            problem = _shape_problem(seen, cap, sizes[1])
            wrong = float(np.mean(~np.isclose(np.asarray(got), np.asarray(want), atol=1e-3)))
            fail(
                f"on the {names[0]} × {names[1]} = {sizes[0]} × {sizes[1]} mesh, {wrong:.0%} of the "
                "outputs differ from the one-device MoE (one group per device)"
                + (f"; {problem[0]}" if problem else "")
                + ": an expert computes places that are not its own, or they return to other places",
                _LAYOUT_HINT,
            )
        _judge_bytes(compiled, mesh, names, cap)
        if axes == _MESHES[0]:  # the gradient on the first mesh only: one more compile
            with unaided("moe_layer", _FORBIDDEN, _HINT):
                graded = _judge_grads(mesh, names, run)
    shown = f"2 × {_expert_size(4, len(devices) // 2)}" + (" mesh, a 1 × 4" if wide else "")
    return passed(
        f"equals the one-device MoE (a capacity that drops choices) on a data × expert = {shown} mesh and "
        f"a 2 × 2 mesh with other axis names ({graded}); each device sends two all-to-alls' bytes on "
        "the expert axis and nothing on the other"
    )


@checker
def check_expert_exchange(moe_layer: Callable, devices: Sequence[Any]) -> bool:
    """``moe_layer(x [N, D], p, axis_name, k, capacity_factor) -> [N, D]`` inside ``shard_map`` with the
    tokens split over two axes and the experts over ``axis_name``: the MoE MLP whose dispatch buffer
    ``[E, C, D]`` goes to the experts' devices and comes back with ``lax.all_to_all`` (the module docstring
    says how it is judged)."""
    return _check(moe_layer, devices)

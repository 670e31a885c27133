"""Checkers for ``10_transformers.ipynb``, numbered as its exercises: 1 (debug) a tensor-parallel MLP whose
silent bug hides behind zero biases, 2 (predict) the bytes and activation memory of tensor vs sequence
parallelism predicted before the measurement, 3 (project) ring attention built from ``ppermute``, 4 per-layer
ZeRO-3 on the transformer's blocks (its gathers and bytes predicted first:
:mod:`._lesson10_zero3_predict`), 5 the TP degree beyond which a block is communication-bound, and the
optional project: ring attention's backward pass with ``jax.custom_vjp`` (:mod:`._lesson10_vjp`).

None of them holds an answer, and each refuses an answer that calls into :mod:`course_lib.splits` (the
library that computes it). The MLP is compared with :func:`course_lib.transformer.mlp` on two device counts
and its jaxpr must hold one psum of the [T, D] output and no other collective. The predictions
(:mod:`._lesson10_predict`) are compared with :func:`course_lib.splits.predict_tp_sp`, for XLA:CPU and
XLA:TPU, on cases drawn afresh. Ring attention is compared with single-device causal attention in
float64 on random inputs on rings of 2 and 8 devices (on fewer than 8, in a fresh process with 8
simulated CPU devices; in float32 within ``precision.float32_rtol`` on XLA:TPU, which emulates
float64, and the MLP likewise), with B, S, H and Dh all different; its sends (loop bodies counted
per iteration) and largest intermediate are read from its jaxpr on rings of 2, 4 and 8 traced
without devices, the bytes one device holds at once from its jaxpr on a ring of 32, and its compiled
temporaries on two rings (they must not grow with the ring). ZeRO-3 is compiled and its gradients,
collectives (trip-weighted bytes) and ``memory_analysis()`` compared with data parallelism's with
each block under ``jax.checkpoint``. The MLP, ring attention and ZeRO-3 are also traced and run on
an axis called "other" (:mod:`._axis_names`): an answer that writes the notebook's axis name instead
of its ``axis_name`` is refused."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from course_lib import splits, splits_zigzag, transformer
from course_lib.meshes import CONTEXT, DATA, MODEL, mesh_of
from course_lib.programs import jaxpr_equations

from . import _lesson10_mlp as _mlp
from ._common import call_answer, checker, fail, judged_on, passed, registers
from ._lesson10_mlp import MLP_D, MLP_F, MLP_T, mlp_collectives, mlp_counts, mlp_hint, mlp_shape
from ._lesson10_predict import check_predict_tp_sp
from ._lesson10_ring import RING_B as _B
from ._lesson10_ring import RING_DH as _DH
from ._lesson10_ring import RING_H as _H
from ._lesson10_ring import RING_S as _S
from ._lesson10_ring import RINGS as _RINGS
from ._lesson10_ring import (
    attention_mapped,
    close,
    counted,
    device_program,
    held_bytes,
    masked_attention,
    nbytes,
    precise,
    ring_diagnose,
    ring_large_scores,
    ring_low_scores_and_grads,
    ring_other_axis,
    ring_temporaries,
    sends_in_cond,
)
from ._lesson10_time import check_tp_critical_degree
from ._lesson10_vjp import check_ring_vjp
from ._lesson10_zero3 import (
    dp_compiled,
    z_held,
    z_other_axis,
    z_policy_obeyed,
    z_setup,
    z_step,
    z_upfront,
    z_values,
    z_wire,
)
from ._lesson10_zero3 import policy_name as _policy_name
from ._lesson10_zero3_predict import check_predict_zero3
from ._spmd import abstract

__all__ = ["check_tp_mlp", "check_predict_tp_sp", "check_ring_attention", "check_zero3"]
__all__ += ["check_tp_critical_degree", "check_ring_vjp", "check_predict_zero3"]

_ONCE = {"xla_backend_optimization_level": 0}


def _jit(fn):
    cpu = jax.default_backend() == "cpu"
    return jax.jit(fn, compiler_options=_ONCE if cpu else None)


_UNAIDED = {
    "ring_attention": "pass the key/value blocks round the ring yourself (lax.ppermute) and merge each "
    "block into the running softmax (jnp)",
    "zero3_blocks": "gather each layer's parameters yourself inside the scan (lax.all_gather) under "
    "jax.checkpoint; course_lib.transformer's layers may compute the block",
    "tp_mlp": "compute the two matmuls on this device's shard (jnp) and add the partial sums yourself "
    "(lax.psum)",
}
"""What each exercise's answer is built from instead of course_lib.splits (the hint of a lookup)."""


_SPLITS = {
    module.__file__: module.__name__.rsplit(".", 1)[-1] for module in (splits, splits_zigzag)
}
"""The modules of the lesson's splits, by file: an answer that calls into them is refused."""


def _call_unaided(what: str, fn: Callable, *args, name: str, explain=None):
    """``fn(*args)`` (tracing included), refused if it calls into :mod:`course_lib.splits` or
    :mod:`course_lib.splits_zigzag` (whose ``ring_attention_at`` is the ring with positions beside K and V)."""
    seen: list[str] = []

    def watch(frame, event, arg):
        if event == "call" and frame.f_code.co_filename in _SPLITS:
            seen.append(f"{_SPLITS[frame.f_code.co_filename]}.{frame.f_code.co_name}")

    old = sys.getprofile()
    sys.setprofile(watch)
    try:
        got = call_answer(what, fn, *args, explain=explain)
    finally:
        sys.setprofile(old)
    if seen:
        fail(
            f"{what} calls course_lib.{seen[0]}: the exercise asks for {name} built without "
            "course_lib.splits or course_lib.splits_zigzag",
            _UNAIDED.get(name, f"write {name} yourself"),
        )
    return got


# ---- exercise 3 (project): ring attention ------------------------------------------------------------------


def _explain_ring(what, e):
    if "ppermute" in str(e) and isinstance(e, ValueError):
        return (
            f"{what} raised ValueError: {str(e)[:200]}",
            "the ring has lax.axis_size(axis_name) devices (the checker tries 2, 4 and 8): build the "
            "ppermute pairs and the number of steps from it",
        )
    if "shape" in str(e).lower() and isinstance(e, (TypeError, ValueError)):
        return (
            f"{what} raised {type(e).__name__}: {str(e)[:200]}",
            f"here B={_B}, H={_H}, Dh={_DH} and the block length all differ: check the order of each "
            "array's axes (scores [B, H, Sq, Sk], running max and sum [B, H, Sq], q/k/v [B, S/n, H, Dh])",
        )
    return None


def _ring_values(fn, devices, rng) -> list[int]:
    ran = []
    present = [c for c in (1, *_RINGS) if c <= len(devices)]
    for c in sorted({present[min(1, len(present) - 1)], present[-1]}):  # 2 and the most, or 1
        mesh = mesh_of({CONTEXT: c}, list(devices)[:c], axis_type="auto")
        with precise():  # float64, or float32 where float64 does not run (XLA:TPU)
            q, k, v = (rng.standard_normal((_B, _S, _H, _DH)) for _ in range(3))
            mapped = _jit(attention_mapped(fn, mesh))
            what = f"ring_attention on {c} device(s)"
            args = map(jnp.asarray, (q, k, v))
            got = _call_unaided(
                what,
                mapped,
                *args,
                name="ring_attention",
                explain=functools.partial(_explain_ring, what),
            )
            got = np.asarray(got)
        if got.shape != q.shape:
            fail(
                f"on {c} device(s) the result has shape {got.shape}; want {q.shape}",
                "return this device's queries' outputs, [B, S/n, H, Dh], like q",
            )
        if not close(got, masked_attention(q, k, v, np.tri(_S, dtype=bool)), 1e-10):
            ring_diagnose(got, q, k, v, c)
        if not ran:  # the smallest ring again, on an axis of another name
            ring_other_axis(fn, devices, c, (q, k, v), got, _jit)
        if c == present[-1]:
            ring_large_scores(mapped, what, q, k, v, _call_unaided)
            ring_low_scores_and_grads(mapped, what, rng, _call_unaided)
        ran.append(c)
    return ran


def _ring_jaxpr(fn, c, shape):
    mapped = attention_mapped(fn, abstract((c,), (CONTEXT,)))
    arg = jax.ShapeDtypeStruct(shape, jnp.float32)
    what = f"ring_attention on a {c}-device mesh"
    return _call_unaided(what, jax.make_jaxpr(mapped), arg, arg, arg, name="ring_attention",
                         explain=functools.partial(_explain_ring, what))  # fmt: skip


def _ring_unrolls(fn) -> None:
    """Refuse a ring whose loop the student package cannot write out: it runs the accepted answer for
    ``splits.ring_attention``, and the lesson's later cells call that with ``unroll=True``, which
    replaces ``jax.lax.fori_loop`` and ``jax.lax.scan`` while the answer runs
    (:func:`course_lib.held.unrolled_loops`); a loop called by a name imported from ``jax.lax`` stays."""
    from course_lib import held

    with held.unrolled_loops():
        jaxpr = _ring_jaxpr(fn, 4, (_B, _S, _H, _DH))
    loops = sorted({e.primitive.name for e, _ in jaxpr_equations(jaxpr)} & {"while", "scan"})
    if loops:
        fail(
            f"on a ring of 4 devices, with jax.lax.fori_loop and jax.lax.scan written out while "
            f"ring_attention runs, its program still holds a {loops[0]} loop: one called by a name "
            "imported from jax.lax (the student package runs your function for splits.ring_attention, "
            "and the lesson's later cells ask it for unroll=True, the steps written out)",
            "call the loop as lax.fori_loop(…) or lax.scan(…), looked up in jax.lax when the ring runs, "
            "not as a name imported from it",
        )


def _ring_structure(fn, c) -> tuple[float | None, int, str | None, bool]:
    """Bytes sent by ppermute (loop bodies counted per trip; None where a while_loop's trip count cannot
    be read), the largest intermediate's elements, any other collective moving arrays and whether a
    ppermute sits inside a ``lax.cond``, from the jaxpr on an abstract ring of ``c`` devices (float32)."""
    jaxpr = _ring_jaxpr(fn, c, (_B, _S, _H, _DH))
    sent, other, biggest = 0.0, None, 0
    for eqn, times in counted(jaxpr):
        name = eqn.primitive.name
        if name == "shard_map":
            continue
        moved = sum(getattr(v.aval, "size", 1) for v in eqn.invars)
        if (
            name.startswith(("all_gather", "all_to_all", "psum", "reduce_scatter", "pmax"))
            and moved > 1
        ):
            other = other or name
        if name == "ppermute" and sent is not None:
            sent = None if times is None else sent + times * sum(map(nbytes, eqn.invars))
        biggest = max([biggest, *(int(getattr(v.aval, "size", 0)) for v in eqn.outvars)])
    return sent, biggest, other, sends_in_cond(jaxpr)


_MEM_RING, _MEM_B, _MEM_BLK, _MEM_H, _MEM_DH = 32, 1, 8, 2, 4
"""The ring whose memory is read: 32 devices, blocks of 8 positions (S = 256), Dh = 4, so that one block's
scores [B, H, 8, 8] and its K and V [B, 8, H, 4] ×2 are the same size (2,048 bytes in float32). The bound is
half the whole sequence's K and V, 16 blocks: a ring that keeps every block (or every block's scores)
holds over 32 (measured: 50), an online-softmax ring about 6 (q, the K and V it holds and receives, the
scores, the output; measured 5–6 for the reference, a scan, a while_loop)."""


def _ring_memory(fn) -> tuple[int, int, int]:
    """(bytes held at once by one device, the bound, the full sequence's K and V bytes) on the abstract
    ring :data:`_MEM_RING` in float32, the program run in the order written."""
    c, blk = _MEM_RING, _MEM_BLK
    jaxpr = _ring_jaxpr(fn, c, (_MEM_B, c * blk, _MEM_H, _MEM_DH))
    kv = 2 * _MEM_B * blk * _MEM_H * _MEM_DH * 4
    return held_bytes(device_program(jaxpr)), c * kv // 2, c * kv


@registers("splits.ring_attention")
@checker
@judged_on(
    8,
    "one device has no ring, and the rings of 2 and 4 that fewer than 8 devices hold miss a block "
    "index right on short rings only (such as min(t, 3) for step t)",
)
def check_ring_attention(ring_attention: Callable, devices: Sequence[Any]) -> bool:
    """Exercise 3 (project): ring attention.

    ``ring_attention(q, k, v, axis_name)`` with q/k/v [B, S/n, H, Dh] (sequence split over
    ``axis_name``) must return causal attention's output for this device's queries, [B, S/n, H, Dh],
    sending only key/value blocks round the ring (``n - 1`` of each, with at most 16 bytes a step beside
    them, such as the block's index; no other collective) and holding
    nothing of the full sequence's size. Values on rings of 2 and 8 devices (on
    fewer than 8 the checker judges in a fresh process with 8 simulated devices, ``judged_on``; on
    the ring of 8 also with scores near +1,000 and with every score near -1,000, where exp overflows
    or underflows unless the running maximum of the scores is subtracted; and its gradients: a
    ``lax.while_loop`` ring is refused); a ``ppermute`` in ``lax.cond`` counts on every iteration;
    structure on abstract rings of 2, 4 and 8 from the jaxpr (a ``scan`` or ``fori_loop`` body's sends
    counted ``length`` times, a ``while_loop``'s as many times as its counter runs; one whose counter
    cannot be run is refused); the bytes one device holds at once, its operations run in the order
    written (:func:`held_bytes`), on an abstract ring of 32 (:data:`_MEM_RING`), at most half the whole
    sequence's K and V; the compiled temporaries on two rings must not grow (:func:`ring_temporaries`).
    An answer calling :mod:`course_lib.splits` is refused."""
    ran = _ring_values(ring_attention, list(devices), np.random.default_rng(10))
    for c in _RINGS:
        sent, biggest, other, in_cond = _ring_structure(ring_attention, c)
        blk = _S // c
        kv = 2 * _B * blk * _H * _DH * 4  # one K and one V block, float32
        if other:
            fail(
                f"on {c} devices the program calls {other} on arrays: ring attention moves data only by "
                "passing blocks to the next device",
                "keep one key/value block at a time and pass it to the next device with lax.ppermute",
            )
        limit = 3 * max(kv // 8, _B * _H * blk * blk)  # a few blocks; the whole sequence is c×
        if biggest > limit:
            fail(
                f"on {c} devices an intermediate has {biggest:,} elements, more than a few key/value "
                f"blocks ({kv // 8:,} elements for K and V) or one block's scores: memory grows with the "
                "full sequence",
                "score this device's queries against one key/value block at a time",
            )
        if sent is None:
            fail(
                f"on {c} devices the ppermutes sit in a lax.while_loop whose number of iterations the "
                "checker cannot read from the program (its condition is not a counter that starts from a "
                "constant), so it cannot count the bytes sent; each device must send "
                f"(n - 1) × {kv:,} = {(c - 1) * kv:,} bytes (one K and one V block a step, float32)",
                "loop over range(n - 1) in Python, or with lax.fori_loop(0, n - 1, …) or lax.scan "
                "(bounds known when traced: jax.grad can differentiate them, not a while_loop)",
            )
        if sent > (c - 1) * kv and in_cond:
            fail(
                f"on {c} devices a ppermute sits inside lax.cond: the checker cannot tell how often a "
                "branch runs, so it counts the send on every iteration of the loop around it, "
                f"{sent:,.0f} bytes, more than the (n - 1) × {kv:,} = {(c - 1) * kv:,} bytes each device "
                "must send (one K and one V block a step, float32)",
                "write the loop so that it sends n - 1 times without lax.cond: n - 1 iterations that "
                "fold a block and send it, the last block folded after the loop",
            )
        if not 0 <= sent - (c - 1) * kv <= 16 * (c - 1):  # 16 bytes a step beside K, V: an index
            more = "more" if sent > (c - 1) * kv else "fewer"
            fail(
                f"on {c} devices each device sends {sent:,.0f} bytes with ppermute (loop bodies counted "
                f"once per iteration): {more} than the K and V blocks it must pass on, (n - 1) × {kv:,} = "
                f"{(c - 1) * kv:,} bytes (one K and one V block a step, float32)",
                "each device needs the n - 1 other devices' blocks, one per step; a block received at "
                "the last step is never used, and only K and V travel (not the queries or outputs), "
                "once each",
            )
    held, bound, full = _ring_memory(ring_attention)
    if held > bound:
        fail(
            f"on a ring of {_MEM_RING} devices (blocks of {_MEM_BLK} positions, float32) one device holds "
            f"{held:,} bytes at once, its operations run in the order written; the whole sequence's K "
            f"and V are {full:,} bytes, and the bound is half of that ({bound:,}), where an online ring "
            "holds a few blocks: the device keeps something of the whole sequence's size (such as "
            "every block, or every block's scores, until the end)",
            "fold each block into a running maximum, sum and output as it arrives (the online "
            "softmax: rescale what is summed when the maximum grows) and let it go before the next",
        )
    _ring_unrolls(ring_attention)
    rings, temps = ring_temporaries(ring_attention, list(devices), _call_unaided) or ((), {})
    return passed(
        f"ring attention and its gradients equal causal attention's on {' and '.join(map(str, ran))} device(s); "
        f"on rings of {', '.join(map(str, _RINGS))} it sends n - 1 K/V blocks and holds no array of the full sequence; "
        f"on a ring of {_MEM_RING} one device holds at most {held:,} bytes at once (whole K and V: {full:,})"
        + "".join(f"; compiled temporaries {temps[c]:,} bytes on a ring of {c}" for c in rings))  # fmt: skip


# ---- exercise 4: ZeRO-3 ---------------------------------------------------------------------------------


@registers("splits.zero3_blocks")
@checker
@judged_on(2, "on one device a ZeRO-3 step has no collectives to judge")
def check_zero3(zero3_blocks: Callable, devices: Sequence[Any]) -> bool:
    """Exercise 4: ZeRO-3, one layer at a time.

    ``zero3_blocks(x, blocks, axis_name)``: x [B, S, D] this device's batch, ``blocks`` this device's
    shards (each leaf [L, d/n, …], :func:`course_lib.splits.zero3_specs`); run the L blocks gathering each
    layer's parameters just before it, and gathering them again in the backward pass. Judged on the
    devices present (4, else 2, else 1): loss and gradients against data parallelism; no gather of all
    layers at once; in the compiled gradient step (loop bodies counted per layer) no all-reduce but the
    loss's, the gradients reduce-scattered ((n-1)/n of the parameter bytes) and the parameters gathered
    twice (forward and backward: 3(n-1)/n on the wire in all, less what the backward needs no more); and
    what it holds beside its outputs — ``memory_analysis()``'s arguments + temporaries (:func:`z_held`;
    the outputs, smaller under ZeRO-3, are left out) — below data parallelism's with each block under
    ``jax.checkpoint`` saving nothing (an answer with any policy, such as ``dots_saveable``, is
    compared with that same data-parallel step, and its hint names the answer's policy).
    An answer calling :mod:`course_lib.splits` is refused."""
    n = max(c for c in (4, 2, 1) if c <= len(devices))
    blocks, x, cfg = z_setup(n)
    mesh = mesh_of({DATA: n}, list(devices)[:n], axis_type="auto")
    zf = z_step(lambda x, b: zero3_blocks(x, b, DATA), mesh, n, splits.zero3_specs(blocks, DATA))
    what = f"zero3_blocks on {n} device(s)"
    traced = _call_unaided(what, zf.trace, blocks, x, name="zero3_blocks")
    zc = call_answer(what, lambda: traced.lower().compile())
    dpc = dp_compiled(tuple(list(devices)[:n]))
    z_values(dpc, zc, blocks, x, n)
    z_upfront(traced.jaxpr, blocks, n)
    z_other_axis(zero3_blocks, devices, n, splits.zero3_specs)
    p_bytes = splits.block_bytes(blocks)
    wire = z_wire(zc.as_text(), mesh, n, p_bytes)
    z_policy_obeyed(zero3_blocks, mesh, n, splits.zero3_specs(blocks, DATA), traced.jaxpr)
    mz, md = zc.memory_analysis(), dpc.memory_analysis()
    held_z, held_dp = z_held(mz), z_held(md)
    policies = sorted(
        {
            _policy_name(eqn.params["policy"])
            for eqn, _ in jaxpr_equations(traced.jaxpr)
            if eqn.params.get("policy") not in (None, jax.checkpoint_policies.nothing_saveable)
        }
    )
    dp = "data parallelism's, each block under jax.checkpoint saving nothing"
    if held_z >= held_dp:
        yours = (
            f" (your jax.checkpoint's policy, {', '.join(policies)}, keeps what it saves for the "
            "backward pass)"
            if policies
            else ""
        )
        fail(
            f"on {n} devices the ZeRO-3 step holds {held_z:,} bytes (arguments + temporaries), no less "
            f"than {dp} ({held_dp:,}), although its arguments are {mz.argument_size_in_bytes:,} bytes "
            f"to {md.argument_size_in_bytes:,}: more than one gathered layer is whole at once, or more "
            f"activations are kept{yours}",
            "gather one layer at a time inside the step over the layers, each layer's gather and block "
            "in its own jax.checkpoint'ed function (not one around all the layers), saving nothing",
        )
    mine = f"; yours saves with {', '.join(policies)}" if policies else ""
    return passed(
        f"ZeRO-3 on {n} devices: gradients equal data parallelism's; per device "
        f"{wire.get('all-gather', 0):,.0f} bytes all-gathered and {wire.get('reduce-scatter', 0):,.0f} "
        f"reduce-scattered; arguments {mz.argument_size_in_bytes:,} bytes vs {md.argument_size_in_bytes:,}, "
        f"arguments + temporaries {held_z:,} vs {held_dp:,} for data parallelism with each "
        f"block under jax.checkpoint saving nothing{mine}"
    )


# ---- exercise 1 (debug): the tensor-parallel MLP ------------------------------------------------------------


@checker
@judged_on(
    3,
    "on one device a bias summed n times is summed once; two give one count, where a bias over 2 is right",
)
def check_tp_mlp(tp_mlp: Callable, devices: Sequence[Any]) -> bool:
    """Exercise 1 (debug): a tensor-parallel MLP.

    ``tp_mlp(x, p, axis_name)``: x [T, D] replicated, ``p`` this device's MLP shard (``w1`` columns and
    bias split, ``w2`` rows split, ``w2``'s bias whole) must equal :func:`course_lib.transformer.mlp` on
    the whole parameters, with random (not zero) biases, in float64, on two device counts (the most of
    8, 4, 2 present, and 3 or 2), and its jaxpr there must hold one collective: a ``psum`` of the
    [T, D] partial output (no gathered weights or activations, no second sum). An answer calling
    :mod:`course_lib.splits` is refused."""
    rng = np.random.default_rng(4)
    d, f = MLP_D, MLP_F
    counts = mlp_counts(len(devices))
    for n in counts:
        mesh = mesh_of({MODEL: n}, list(devices)[:n], axis_type="auto")
        with precise():
            p = {
                "w1": {"kernel": rng.standard_normal((d, f)), "bias": rng.standard_normal(f)},
                "w2": {"kernel": rng.standard_normal((f, d)), "bias": rng.standard_normal(d)},
            }
            p = jax.tree.map(jnp.asarray, p)
            x = jnp.asarray(rng.standard_normal((MLP_T, d)))
            mapped = _mlp.mlp_mapped(tp_mlp, mesh)
            what = f"tp_mlp on {n} device(s)"
            explain = _mlp.mlp_unreplicated(tp_mlp, mesh, n, x, p)
            got = _call_unaided(what, _jit(mapped), x, p, name="tp_mlp", explain=explain)
            mlp_shape(got, n)
            got, want = np.asarray(got), np.asarray(transformer.mlp(x, p))
            jaxpr = jax.make_jaxpr(mapped)(x, p) if n > 1 else None
        if not close(got, want, 1e-10):
            mlp_hint(got, want, np.asarray(p["w2"]["bias"]), n)
        if jaxpr is not None:
            mlp_collectives(jaxpr, n)
    _mlp.mlp_other_axis(
        tp_mlp, list(devices), n, x, p, got, _jit
    )  # the last (smallest) case, renamed
    return passed(
        f"the tensor-parallel MLP equals the MLP on {' and '.join(map(str, counts))} device(s) with "
        "random biases, and sends only the [T, D] partial output through one psum"
    )

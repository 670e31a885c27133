"""Ring attention's judge for :func:`course_tools.checks.lesson10.check_ring_attention`
(``notebooks/10_transformers.ipynb``, exercise 3): the rings' shapes, causal attention in NumPy and the hint
for values that are not its, and the reading of a program's jaxpr: every equation with how many times it
runs (a ``scan`` body ``length`` times, a ``while_loop`` body as many times as its counter allows, found by
running the counter) and the most bytes the program holds at once, its equations run in the order written.
The tensor-parallel MLP's checker reads its collectives with :func:`counted` too."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from course_lib import precision, transformer
from course_lib.meshes import CONTEXT, mesh_of
from course_lib.programs import jaxpr_equations

from ._axis_names import OTHER, judge_other_axis
from ._common import fail

__all__ = [
    "attention_mapped",
    "ring_large_scores",
    "ring_other_axis",
    "RINGS",
    "RING_B",
    "RING_DH",
    "RING_H",
    "RING_S",
    "close",
    "counted",
    "device_program",
    "held_bytes",
    "masked_attention",
    "nbytes",
    "precise",
    "ring_diagnose",
    "ring_grads",
    "ring_low_scores",
    "ring_low_scores_and_grads",
    "ring_temporaries",
    "sends_in_cond",
]

# all different; S = 8·7 = 56 (blocks of 28, 14, 7 on 2, 4, 8 devices)
RING_B, RING_H, RING_DH, RING_BLK8 = 3, 2, 5, 7
RING_S = 8 * RING_BLK8
RINGS = (2, 4, 8)


def precise():
    """The context the lesson-10 checkers compute their values in: ``jax.enable_x64`` where float64 runs
    (:func:`course_lib.precision.float64_runs`); nothing on XLA:TPU, whose float64 is emulated (programs
    take minutes to compile): there the inputs become float32 and :func:`close` takes the platform's
    float32 tolerance."""
    return precision.parity_x64()


def close(got, want, atol: float, rtol: float = 0.0, equal_nan: bool = False) -> bool:
    """Whether ``got`` equals ``want`` (NumPy float64, computed on the host) as the checkers judge it.

    Where float64 runs: ``np.allclose(got, want, rtol, atol)``, as strict as written. Where it does not
    (XLA:TPU): within ``float32_rtol()`` of ``max |want|`` (the values computed in float32; a TPU's float32
    matmul multiplies bfloat16 inputs)."""
    if precision.float64_runs():
        return bool(np.allclose(got, want, rtol=rtol, atol=atol, equal_nan=equal_nan))
    scale = float(np.nanmax(np.abs(want))) if np.size(want) else 1.0
    bound = precision.float32_rtol() * (scale or 1.0)
    return bool(np.allclose(got, want, rtol=0, atol=bound, equal_nan=equal_nan))


def _rounded(got, want, rtol) -> bool:
    return bool(np.allclose(got, want, rtol=rtol, atol=rtol))


def masked_attention(q, k, v, visible):
    """Softmax attention of every query against every key where ``visible`` [S, S] (NumPy, float64)."""
    s = np.einsum("bqhk,bthk->bhqt", q, k) / np.sqrt(q.shape[-1])
    s = np.where(visible, s, -np.inf)
    mx = s.max(-1, keepdims=True)
    w = np.exp(s - np.where(np.isfinite(mx), mx, 0.0))
    w = w / np.maximum(w.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bhqt,bthk->bqhk", w, v)


def ring_diagnose(got, q, k, v, c):
    """A true hint for ring attention's values ``got`` on ``c`` devices that are not causal attention's."""
    i, j = np.arange(RING_S)[:, None], np.arange(RING_S)[None, :]
    blk = RING_S // c
    want = masked_attention(q, k, v, i >= j)
    if close(got, masked_attention(q, k, v, np.ones_like(i >= j)), 1e-8, 1e-5):
        fail(
            f"on {c} devices every query attends to every key: the causal mask is missing",
            "mask key j for query i where i < j, with the blocks' global positions",
        )
    if c > 1 and close(got, masked_attention(q, k, v, (i % blk) >= (j % blk)), 1e-8, 1e-5):
        fail(
            f"on {c} devices the mask compares positions within a block, the same for every block",
            "compare global positions: a query's and a key's index in the whole sequence, from the "
            "device that holds the block and the position in it",
        )
    if c > 1 and close(
        got, masked_attention(q, k, v, (i >= j) | (i // blk != j // blk)), 1e-8, 1e-5
    ):
        fail(
            f"on {c} devices the queries see keys of later blocks: only the diagonal block is masked",
            "the blocks that reach a device by wrapping round the ring (from later devices) are in "
            "its future: mask them entirely, not only the diagonal block",
        )
    if close(got, masked_attention(q, k, v, i > j), 1e-8, 1e-5, equal_nan=True):
        fail(
            f"on {c} device(s) no query sees its own key: the mask hides the diagonal",
            "query i sees key j where j <= i, its own position included",
        )
    if precision.float64_runs() and _rounded(got, want, 1e-4):  # float64 inputs computed in float32
        fail(
            f"on {c} device(s) the values are near causal attention's but off by "
            f"{float(np.abs(got - want).max()):.1e}: something is computed in float32",
            "the inputs here are float64: make every array you create with q.dtype (jnp.full, "
            "jnp.zeros) and cast nothing",
        )
    block = [close(got[:, r * blk : (r + 1) * blk], want[:, r * blk : (r + 1) * blk], 1e-10, 1e-5)
             for r in range(c)]  # fmt: skip
    if c > 1 and block[0] and not all(block[1:]):
        fail(
            f"on {c} devices the first device's queries (they see only their own block) are right, "
            "later devices' are not",
            "check how blocks received from other devices are masked (their global positions) and "
            "combined: one softmax over all keys (running maximum and sum, rescaled when the maximum "
            "grows, divided once at the end)",
        )
    fail(
        f"on {c} device(s) the values differ from single-device causal attention by "
        f"{float(np.nanmax(np.abs(got - want))):.2e}",
        "check the scale 1/sqrt(Dh), the mask and the running softmax on a 2-device mesh",
    )


def ring_low_scores(mapped, what, rng, call):
    """The ring ``mapped`` on inputs where every score is near -1,000 (q near a·u, k near -a·u): exp of
    a score minus anything far above it (a running maximum started at 0) underflows to 0 in float64
    (below ~-745); an online softmax from -inf subtracts a score the query sees and stays exact."""
    u = np.ones(RING_DH) / np.sqrt(RING_DH)
    a = np.sqrt(1000.0 * np.sqrt(RING_DH))
    q, k = (
        s * a * u + 0.2 * rng.standard_normal((RING_B, RING_S, RING_H, RING_DH)) for s in (1, -1)
    )
    v = rng.standard_normal(q.shape)
    with precise():
        got = np.asarray(call(what, mapped, *map(jnp.asarray, (q, k, v)), name="ring_attention"))
    want = masked_attention(q, k, v, np.tri(RING_S, dtype=bool))
    if close(got, want, 1e-8):
        return
    under = (
        "exp(s - m) underflows to 0 when m is far above every score, as a running maximum started "
        "at a constant such as 0 is"
    )
    start = "start the running maximum at -inf, or at the first block's maximum"
    if not np.isfinite(got).all():
        fail(
            f"{what}: right on ordinary inputs and with scores near +1,000, but where every score a "
            "query sees is near -1,000 the result is not finite",
            f"{under}: the weights then sum to 0, and 0/0 is NaN; {start}",
        )
    fail(
        f"{what}: right on ordinary inputs and with scores near +1,000, but where every score a query "
        f"sees is near -1,000 the result is off by {float(np.abs(got - want).max()):.2e}",
        f"{under} ({start}); and masked scores must weigh nothing next to scores near -1,000: fill "
        "them with -inf, or a value far below any score such as -1e30",
    )


def _explain_grad(what):
    def explain(e):
        if "Reverse-mode differentiation does not work" not in str(e):
            return None
        return (
            f"{what}: jax.grad cannot differentiate it ({str(e)[:160]}): right values, but a ring "
            "attention that cannot be trained",
            "loop with bounds known when traced: lax.fori_loop(0, n - 1, …) with Python ints (it "
            "becomes a scan), lax.scan, or a Python for; a lax.while_loop has no reverse-mode derivative",
        )

    return explain


def ring_grads(mapped, what, rng, call):
    """The gradients of ``sum(mapped(q, k, v) * cot)`` with respect to q, k and v against those of
    :func:`course_lib.transformer.causal_attention` on one device (float64 where it runs, else the
    platform's float32 tolerance). Refuses an answer ``jax.grad`` cannot differentiate (a ring written with
    ``lax.while_loop``) with a hint naming the loops that can be, and one whose gradients differ.

    Raises:
      ExerciseError: either refusal.
    """
    shape = (RING_B, RING_S, RING_H, RING_DH)
    with precise():
        q, k, v, cot = (jnp.asarray(rng.standard_normal(shape)) for _ in range(4))

        def grads(attention):
            loss = lambda q, k, v: jnp.sum(attention(q, k, v) * cot)  # noqa: E731
            return jax.grad(loss, argnums=(0, 1, 2))

        what_g = f"jax.grad of {what}"
        # differentiated inside one jit of its own: JAX 0.10.2 allows compiler options (the checker's
        # jit of the ring) only on the outermost jit
        inner = jax.jit(grads(getattr(mapped, "__wrapped__", mapped)))
        got = call(what_g, inner, q, k, v, name="ring_attention", explain=_explain_grad(what_g))
        want = grads(transformer.causal_attention)(q, k, v)
        got, want = ([np.asarray(g) for g in gs] for gs in (got, want))
    for name, g, w in zip("qkv", got, want):
        if not close(g, w, 1e-9):
            fail(
                f"{what_g}: the values are right but the gradient with respect to {name} is off by "
                f"{float(np.abs(g - w).max()):.2e} against single-device causal attention",
                "the gradient flows back through every step: do not stop_gradient or round what the "
                "loop carries, and let the masked scores weigh exactly 0 (fill them with -inf)",
            )


def attention_mapped(fn, mesh, axis: str = CONTEXT, check_vma: bool = True):
    """``fn(q, k, v, axis)`` under ``shard_map`` on ``mesh``: q/k/v [B, S, H, Dh] split over ``axis`` along
    the sequence, the output likewise."""
    spec = P(None, axis)
    return jax.shard_map(
        lambda q, k, v: fn(q, k, v, axis),
        mesh=mesh,
        in_specs=(spec, spec, spec),
        out_specs=spec,
        check_vma=check_vma,
    )


def ring_large_scores(mapped, what, q, k, v, call):
    """The same ring on queries scaled so that scores reach about 1,000, where exp overflows in float64
    (above ~709): an online softmax subtracts its running maximum and stays exact. ``call``: the checker's
    ``call_answer`` that refuses the library."""
    q = q * 400.0
    with precise():
        got = np.asarray(call(what, mapped, *map(jnp.asarray, (q, k, v)), name="ring_attention"))
    want = masked_attention(q, k, v, np.tri(q.shape[1], dtype=bool))
    if not close(got, want, 1e-8):
        fail(
            f"{what}: right on ordinary inputs, but with scores near 1,000 the result is "
            f"{'not finite' if not np.isfinite(got).all() else 'off'}",
            "exp of a score above ~709 overflows even in float64: keep the running maximum of the "
            "scores and exponentiate the scores minus it (the online softmax), rescaling what is summed",
        )


def ring_other_axis(fn, devices, c: int, qkv, got, jit) -> None:
    """Refuse a ring that names the mesh axis itself: the inputs ``qkv`` (float64 where it runs), whose
    output ``got`` on a ``"context"`` ring of ``c`` devices was right, again on ``c`` devices of an axis
    called :data:`OTHER` (:func:`._axis_names.judge_other_axis`); ``jit``: the checker's ``jax.jit``."""
    with precise():
        args = tuple(map(jnp.asarray, qkv))
        mesh = mesh_of({OTHER: c}, list(devices)[:c], axis_type="auto")
        judge_other_axis(
            "ring_attention",
            CONTEXT,
            lambda abstract: jax.make_jaxpr(attention_mapped(fn, abstract, OTHER, False))(*args),
            lambda: np.asarray(jit(attention_mapped(fn, mesh, OTHER))(*args)),
            lambda new: None if close(new, got, 1e-10) else f"by {np.abs(new - got).max():.2e}",
            f"a ring of {c} devices",
        )


def ring_low_scores_and_grads(mapped, what, rng, call):
    """:func:`ring_low_scores`, then :func:`ring_grads`, on the same ring."""
    ring_low_scores(mapped, what, rng, call)
    ring_grads(mapped, what, rng, call)


def sends_in_cond(jaxpr) -> bool:
    """Whether a ``ppermute`` of ``jaxpr`` sits inside a ``lax.cond`` branch (:func:`counted` counts it
    on every run of the code around the ``cond``, whichever branch runs)."""
    return any(
        e.primitive.name == "ppermute"
        for eqn, _ in counted(jaxpr)
        if eqn.primitive.name == "cond"
        for branch in eqn.params["branches"]
        for e, _ in counted(branch)
    )


_LOOP_CAP = 10_000
"""The most iterations :func:`_while_trips` runs a ``while_loop``'s counter for."""


def _is_var(v) -> bool:
    return not hasattr(v, "val")  # a Literal carries its value


def _slice(jaxpr, wanted: set) -> tuple[list, set]:
    """The equations of ``jaxpr`` that ``wanted`` (its variables) depend on, and the inputs they read."""
    need, kept = set(wanted), []
    for eqn in reversed(jaxpr.eqns):
        if any(v in need for v in eqn.outvars):
            kept.append(eqn)
            need |= {v for v in eqn.invars if _is_var(v)}
    return kept[::-1], need


def _run(eqns, env: dict) -> dict:
    for eqn in eqns:
        args = [env[v] if _is_var(v) else v.val for v in eqn.invars]
        out = eqn.primitive.bind(*args, **eqn.params)
        env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]))
    return env


def _static(v, outer) -> Any:
    """The value of ``v`` (an operand in ``outer``) if it is computed from constants only, else raises."""
    if not _is_var(v):
        return v.val
    eqns, need = _slice(outer, {v})
    if need & set(outer.invars):
        raise ValueError("depends on the program's inputs")
    return _run(eqns, {})[v]


def _while_trips(eqn, outer) -> int | None:
    """How many times a ``while`` equation's body runs, when its condition depends only on loop-carried
    values that start from constants and that the body computes from each other (a counter): run that
    part of the loop. None when it cannot be read."""
    cond, body = eqn.params["cond_jaxpr"], eqn.params["body_jaxpr"]
    nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    ops = eqn.invars
    cond_consts, body_consts, init = ops[:nc], ops[nc : nc + nb], ops[nc + nb :]
    carry_in = body.jaxpr.invars[nb:]
    try:
        c_eqns, c_need = _slice(cond.jaxpr, set(cond.jaxpr.outvars))
        used = {i for i, v in enumerate(cond.jaxpr.invars[nc:]) if v in c_need}
        while True:
            b_eqns, b_need = _slice(body.jaxpr, {body.jaxpr.outvars[i] for i in used})
            more = used | {i for i, v in enumerate(carry_in) if v in b_need}
            if more == used:
                break
            used = more
        env_c = dict(zip(cond.jaxpr.constvars, cond.consts))
        env_c |= {v: _static(o, outer) for v, o in zip(cond.jaxpr.invars[:nc], cond_consts)
                  if v in c_need}  # fmt: skip
        env_b = dict(zip(body.jaxpr.constvars, body.consts))
        env_b |= {v: _static(o, outer) for v, o in zip(body.jaxpr.invars[:nb], body_consts)
                  if v in b_need}  # fmt: skip
        carry = {i: _static(init[i], outer) for i in used}
        for trips in range(_LOOP_CAP):
            env = env_c | {cond.jaxpr.invars[nc + i]: x for i, x in carry.items()}
            if not bool(_run(c_eqns, env)[cond.jaxpr.outvars[0]]):
                return trips
            env = _run(b_eqns, env_b | {carry_in[i]: x for i, x in carry.items()})
            carry = {i: env[body.jaxpr.outvars[i]] for i in used}
    except Exception:  # noqa: BLE001 - a condition that is not a plain counter
        return None
    return None


def counted(jaxpr, times: int | None = 1):
    """Every equation of ``jaxpr`` (nested ones included) with how many times it runs: a ``scan`` body
    ``length`` times, a ``while_loop`` body as many times as its counter allows (None: not readable)."""
    jx = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jx.eqns:
        yield eqn, times
        name, reps = eqn.primitive.name, times
        if name == "scan" and times is not None:
            reps = times * int(eqn.params["length"])
        elif name == "while":
            trips = _while_trips(eqn, jx)
            reps = None if times is None or trips is None else times * trips
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
                    yield from counted(sub, reps)


def nbytes(v) -> int:
    aval = getattr(v, "aval", None)
    return int(getattr(aval, "size", 0)) * getattr(getattr(aval, "dtype", None), "itemsize", 0)


def held_bytes(jaxpr) -> int:
    """The most bytes a program holds at once when it runs its equations in the order written: each value
    from the equation that makes it to its last use (a loop's or call's body adds its own peak)."""
    jx = getattr(jaxpr, "jaxpr", jaxpr)
    last = {}
    for i, eqn in enumerate(jx.eqns):
        last |= {v: i for v in eqn.invars if _is_var(v)}
    last |= {v: len(jx.eqns) for v in jx.outvars if _is_var(v)}
    live = {v for v in (*jx.constvars, *jx.invars)}
    now = peak = sum(map(nbytes, live))
    for i, eqn in enumerate(jx.eqns):
        inner = 0
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                sj = getattr(sub, "jaxpr", sub)
                if hasattr(sj, "eqns"):
                    edge = sum(map(nbytes, (*sj.invars, *sj.outvars)))
                    inner = max(inner, held_bytes(sj) - edge)
        made = sum(nbytes(v) for v in eqn.outvars)
        peak = max(peak, now + made + inner)
        now += made
        live |= set(eqn.outvars)
        dead = {v for v in live if last.get(v, -1) <= i}
        now -= sum(map(nbytes, dead))
        live -= dead
    return peak


def device_program(jaxpr):
    """The body of the first ``shard_map`` in ``jaxpr``: the program one device runs."""
    for eqn, _ in jaxpr_equations(jaxpr):
        if eqn.primitive.name == "shard_map":
            return eqn.params["jaxpr"]
    return jaxpr


_TEMP_B, _TEMP_BLK, _TEMP_H, _TEMP_DH = 1, 8, 2, 4
"""The rings whose compiled temporaries :func:`ring_temporaries` reads: blocks of 8 positions, float32 (one
K or V block: 256 bytes)."""


def ring_temporaries(fn, devices, call) -> tuple[tuple[int, int], dict[int, int]] | None:
    """The ring compiled (``memory_analysis()``) for two rings of the devices present at a fixed block size
    — ``max(3, c // 2)`` and ``c``, the most devices up to 8 (a ring of 2 runs its loop once, and XLA
    removes a loop of one trip) — refused when its temporaries grow by a K/V block or more per device
    added: an unrolled ring (a Python ``for``, ``unroll=True``) lets the scheduler issue every ``ppermute``
    first and hold every block (XLA:CPU, blocks of 8: +4 blocks from 3 to 4 devices, +10 from 4 to 8); a
    ``fori_loop`` or ``scan`` body holds one step (growth ≤ 0). None where fewer than 4 devices are
    present or the backend reports no memory.

    Returns:
      ``((small, big), {ring: temporary bytes})``.

    Raises:
      ExerciseError: the temporaries grow.
    """
    big = min(len(devices), max(RINGS))
    if big < 4:
        return None
    rings, temps = (max(3, big // 2), big), {}
    kv = _TEMP_B * _TEMP_BLK * _TEMP_H * _TEMP_DH * 4
    options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
    for c in rings:
        mesh = mesh_of({CONTEXT: c}, list(devices)[:c], axis_type="auto")
        mapped = jax.jit(attention_mapped(fn, mesh), compiler_options=options)
        arg = jax.ShapeDtypeStruct((_TEMP_B, c * _TEMP_BLK, _TEMP_H, _TEMP_DH), jnp.float32)
        compiled = call(f"ring_attention compiled for a ring of {c} devices",
                        lambda *a, f=mapped: f.lower(*a).compile(),
                        arg, arg, arg, name="ring_attention")  # fmt: skip
        memory = compiled.memory_analysis()
        if memory is None:
            return None
        temps[c] = int(memory.temp_size_in_bytes)
    small, big = rings
    growth = (temps[big] - temps[small]) / kv / (big - small)
    if growth >= 1:
        fail(
            f"compiled by XLA:{jax.default_backend().upper()} for rings of {small} and {big} devices (blocks "
            f"of {_TEMP_BLK} positions, float32), your ring's temporaries grow from {temps[small]:,} to "
            f"{temps[big]:,} bytes: {growth:.1f} K/V blocks more for every device added. The values are "
            "right, but the program holds the blocks it receives, not one step's",
            "an unrolled ring (a Python for, or unroll=True) lets the compiler issue every ppermute "
            "first and keep every block; loop with lax.fori_loop(0, n - 1, …) or lax.scan, whose body "
            "holds one step whatever the ring's length",
        )
    return rings, temps

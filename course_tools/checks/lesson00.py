"""Checkers for ``00_setup.ipynb``: where results live, an environment for a fresh process, rows split by hand.

Each checker measures instead of comparing with a stored answer: the placement cases run on real devices
(or in a fresh 2-device process when this one has a single device), the environment is tried in a fresh
process, and the hand-made split is compared with the layout JAX itself gives a row-sharded array.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ._common import call_answer, checker, fail, not_written, passed
from ._lesson00_moves import RecordMoves, judge_moves

# ---------------------------------------------------------------- exercise 1: where results live

PLACEMENT_SETUP = """
a = jnp.arange(3.0)                         # made by jnp: uncommitted, on the default device
b = jax.device_put(jnp.arange(3.0), last)   # committed to the last device
c = jax.device_put(jnp.arange(3.0), first)  # committed to the first device
"""
PLACEMENT_CASES = (
    "jnp.zeros_like(b)",
    "jax.jit(jnp.add)(a, b)",
    "np.asarray(b) + c",
    "jax.device_put(b) + c",
    "jax.device_put(b, first) + c",
)
"""The expressions whose placement the learner predicts: "first", "last" or "error"."""

_PLACEMENT_HINTS = {  # how to look, not the answer
    "jnp.zeros_like(b)": "print jnp.zeros_like(b).devices() and .committed: does a new array made from b "
    "take more from b than its shape and dtype?",
    "jax.jit(jnp.add)(a, b)": "a jitted call places its work by the same rule as an eager one: which of a "
    "and b is committed?",
    "np.asarray(b) + c": "print type(np.asarray(b)): does that object live on a device, and can it be "
    "committed?",
    "jax.device_put(b) + c": "print jax.device_put(b).devices() and .committed: does device_put without a "
    "device change either of them?",
    "jax.device_put(b, first) + c": "print jax.device_put(b, first).devices() and .committed, then apply "
    "the rule for two committed inputs",
}

_MEASURE = """
import json, jax, jax.numpy as jnp, numpy as np
def measure(first, last, setup, cases):
    scope = {"jax": jax, "jnp": jnp, "np": np, "first": first, "last": last}
    exec(setup, scope)
    out = {}
    for case in cases:
        try:
            (device,) = eval(case, scope).devices()
        except ValueError as e:
            if "incompatible devices" not in str(e):
                raise
            out[case] = "error"
            continue
        out[case] = "first" if device == first else "last" if device == last else str(device)
    return out
"""


def measure_placement(devices: Sequence[Any]) -> dict[str, str]:
    """Where each of ``PLACEMENT_CASES`` lands, run on ``devices[0]`` / ``devices[-1]`` (or, with a single
    device, in a fresh process with 2 CPU devices)."""
    if len(devices) >= 2:
        scope: dict[str, Any] = {}
        exec(_MEASURE, scope)
        return scope["measure"](devices[0], devices[-1], PLACEMENT_SETUP, PLACEMENT_CASES)
    code = _MEASURE + textwrap.dedent(f"""
        d = jax.devices()
        print(json.dumps(measure(d[0], d[-1], {PLACEMENT_SETUP!r}, {list(PLACEMENT_CASES)!r})))
    """)
    run = _run_python(code, {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2"})
    return json.loads(run.stdout)


@checker
def check_placement(predictions: Mapping[str, str] | None, devices: Sequence[Any]) -> bool:
    """Exercise 1: predict, for each of ``PLACEMENT_CASES``, where its result lives.

    Args:
      predictions: ``{expression: "first" | "last" | "error"}``; the stub leaves every value ``None``.
      devices: ``report.devices``; with a single device the cases run in a fresh 2-device process.

    Raises:
      ExerciseError: a missing or unknown entry, or a wrong prediction (the hint says how to look).
    """
    hint = 'write "first", "last" or "error" for every expression, then run this cell'
    values = dict(predictions or {})
    if all(v is None or v is Ellipsis for v in values.values()):
        not_written("the placement table", hint)
    guesses = {}
    for case in PLACEMENT_CASES:
        guess = values.get(case)
        if guess is None or guess is Ellipsis:
            fail(f"no prediction for {case!r}", hint)
        guesses[case] = str(guess).strip().lower()
        if guesses[case] not in ("first", "last", "error"):
            fail(f"the prediction for {case!r} is {guess!r}", hint)
    measured = measure_placement(list(devices))
    wrong = [c for c in PLACEMENT_CASES if guesses[c] != measured[c]]
    if wrong:
        more = f" ({len(wrong) - 1} other prediction(s) wrong too)" if len(wrong) > 1 else ""
        fail(
            f"your prediction {guesses[wrong[0]]!r} for {wrong[0]!r} is not what JAX does{more}",
            _PLACEMENT_HINTS[wrong[0]],
        )
    for case in PLACEMENT_CASES:
        print(f"  {case:30s} -> {measured[case]}")
    where = "on this run's devices" if len(devices) >= 2 else "in a fresh 2-device process"
    return passed(f"all {len(PLACEMENT_CASES)} placements predicted (measured {where})")


# ---------------------------------------------------------------- exercise 2: debug cpu_env

COUNT_FLAG = "--xla_force_host_platform_device_count"
_DEVICE_VARS = ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS")


def _clean_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _DEVICE_VARS}


def _run_python(
    code: str, extra: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None
):
    """Run ``code`` in a fresh Python; ``env`` replaces the environment, ``extra`` adds to a clean one."""
    environment = dict(env) if env is not None else {**_clean_environ(), **(extra or {})}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120
    )


def _count_settings(env: Mapping[str, str]) -> list[str]:
    flags = env.get("XLA_FLAGS", "").split()
    counts = [
        f.split("=", 1)[1] if "=" in f else "" for f in flags if f.split("=", 1)[0] == COUNT_FLAG
    ]
    return counts + ([env["JAX_NUM_CPU_DEVICES"]] if "JAX_NUM_CPU_DEVICES" in env else [])


def _judge_env(n: int, env: Mapping[str, str], before: Mapping[str, str], out: Any) -> None:
    """The properties of ``cpu_env(n, env)``'s result and of ``env`` afterwards, or an ExerciseError."""
    if dict(env) != dict(before):
        changed = sorted(k for k in set(env) | set(before) if env.get(k) != before.get(k))
        fail(
            f"cpu_env({n}, env) changed the caller's mapping ({', '.join(changed)})",
            "called with os.environ, that edits this very process: build a new dict and edit that",
        )
    if out is env:
        fail(f"cpu_env({n}, env) returned the mapping it was given", "return a new dict")
    if not isinstance(out, Mapping) or not all(isinstance(v, str) for v in out.values()):
        fail(
            f"cpu_env({n}, env) returned {type(out).__name__}",
            "return a dict of str -> str, like os.environ",
        )
    lost = [k for k in env if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES") and k not in out]
    if lost:
        fail(
            f"the variable {lost[0]} was dropped",
            "start from a copy of env, so every variable is kept",
        )
    if out.get("JAX_PLATFORMS") != "cpu":
        fail(
            f"JAX_PLATFORMS is {out.get('JAX_PLATFORMS')!r}",
            "set JAX_PLATFORMS=cpu: on a GPU host the count flag would simulate devices nobody uses",
        )
    old = [f for f in env.get("XLA_FLAGS", "").split() if f.split("=", 1)[0] != COUNT_FLAG]
    dropped = [f for f in old if f not in out.get("XLA_FLAGS", "").split()]
    if dropped:
        fail(
            f"the flag {dropped[0]} the user had set is gone from XLA_FLAGS",
            "XLA_FLAGS holds several flags separated by spaces: keep the others, replace only the count",
        )
    flags = [f for f in out.get("XLA_FLAGS", "").split() if f.split("=", 1)[0] == COUNT_FLAG]
    if len(flags) > 1:
        fail(
            f"XLA_FLAGS holds {len(flags)} count flags ({' '.join(flags)})",
            "XLA silently takes the last, a reader the first: remove the old flag before adding yours",
        )
    settings = _count_settings(out)
    if not settings:
        fail(f"cpu_env({n}, env) sets no device count", f"add {COUNT_FLAG}={n} to XLA_FLAGS")
    if any(s != str(n) for s in settings):
        stale = out.get("JAX_NUM_CPU_DEVICES", str(n)) != str(n)
        fail(
            f"cpu_env({n}, env) leaves a device count of {'/'.join(settings)}",
            "JAX_NUM_CPU_DEVICES is still set from before, and it silently wins over XLA_FLAGS: drop it "
            "(or set it to n)"
            if stale
            else "use the argument n, not a constant",
        )


@checker
def check_cpu_env(cpu_env: Callable[[int, Mapping[str, str]], Mapping[str, str]]) -> bool:
    """Exercise 2: ``cpu_env(n, env)`` returns a NEW environment in which a fresh process sees ``n`` CPU devices.

    It must leave ``env`` unchanged, keep every other variable and XLA flag, and leave no setting that
    silently overrides the count (``JAX_NUM_CPU_DEVICES`` wins over ``XLA_FLAGS``). The hardest case is
    also run in a fresh process.

    Raises:
      ExerciseError: the caller's mapping modified, a variable or flag lost, two count settings that
        disagree, a duplicate count flag, the CPU backend not forced, or the fresh process sees another count.
    """
    cases = [
        (3, {"COURSE_MARKER": "kept", "XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}),
        (2, {"COURSE_MARKER": "kept"}),
        (
            5,
            {
                "XLA_FLAGS": f"{COUNT_FLAG}=2 --xla_dump_to=/tmp/xla_dump",
                "JAX_NUM_CPU_DEVICES": "2",
            },
        ),
    ]
    for n, extra in cases:
        env = {**_clean_environ(), **extra}
        before = dict(env)
        _judge_env(n, env, before, call_answer(f"cpu_env({n}, env)", cpu_env, n, env))
    n, extra = cases[-1]
    fresh = call_answer(f"cpu_env({n}, env)", cpu_env, n, {**_clean_environ(), **extra})
    run = _run_python("import jax; print(jax.device_count(), jax.default_backend())", env=fresh)
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or [""])[-1][:200]
        fail(
            f"a fresh process with your environment failed: {last}",
            "print the XLA_FLAGS you build and check that every flag starts with '--'",
        )
    if run.stdout.split() != [str(n), "cpu"]:
        fail(
            f"a fresh process with your environment sees {run.stdout.strip()!r}, expected '{n} cpu'",
            "print the environment you return and look for a second device-count setting",
        )
    return passed(f"cpu_env keeps the caller's settings, and a fresh process sees {n} CPU devices")


# ---------------------------------------------------------------- exercise 3: split and sum by hand


def _jax_layout(x, devices) -> list:
    """What JAX does: the shards of ``x`` row-sharded over a 1-D mesh of ``devices``, in device order."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    sharded = jax.device_put(
        x, NamedSharding(Mesh(np.array(devices), ("rows",)), PartitionSpec("rows"))
    )
    by_device = {s.device: np.asarray(s.data) for s in sharded.addressable_shards}
    return [by_device[d] for d in devices]


def _where(a) -> str:
    import jax

    return (
        str(sorted(str(d) for d in a.devices())) if isinstance(a, jax.Array) else type(a).__name__
    )


def _judge_parts(parts, x_np, devices) -> None:
    import jax

    n = len(devices)
    if not isinstance(parts, list | tuple) or len(parts) != n:
        got = len(parts) if isinstance(parts, list | tuple) else type(parts).__name__
        fail(
            f"split_and_sum gave {got} part(s) for {n} devices",
            "return a list with one array per device",
        )
    for i, (part, want, d) in enumerate(zip(parts, _jax_layout(x_np, devices), devices)):
        if not isinstance(part, jax.Array) or part.devices() != {d} or not part.committed:
            fail(
                f"part {i} lives on {_where(part)} (committed: {getattr(part, 'committed', False)}), "
                f"expected {d}",
                "commit each block to its own device (device_put with a device): "
                "slicing leaves a block uncommitted on the default device",
            )
        got = np.asarray(part)
        if got.shape != want.shape or not np.array_equal(got, want):
            interleaved = got.shape == want.shape and np.array_equal(got, x_np[i::n])
            fail(
                f"part {i} holds other rows than JAX's shard on {d} (shape {got.shape}, "
                f"expected {want.shape})",
                "JAX gives device i the i-th contiguous block of rows, not every n-th row"
                if interleaved
                else "split the leading axis into n equal contiguous blocks",
            )
        if part.dtype != x_np.dtype:
            fail(
                f"part {i} has dtype {part.dtype}, the input {x_np.dtype}",
                "copy the rows, do not convert them",
            )


def _adding_across_devices(e: BaseException):
    if isinstance(e, ValueError) and "incompatible devices" in str(e):
        return (
            "split_and_sum raised 'incompatible devices'",
            "arrays committed to different devices are "
            "not combined where they are: bring the partial sums to the target device first",
        )
    return None


def _judge_sums(out, parts, devices, target) -> None:
    import jax

    partials, total = out
    if not isinstance(partials, list | tuple) or len(partials) != len(parts):
        fail(f"expected {len(parts)} partial sums, one per part", "sum every part on its own")
    for i, (partial, part, d) in enumerate(zip(partials, parts, devices)):
        if not isinstance(partial, jax.Array) or partial.devices() != {d}:
            fail(
                f"partial sum {i} was computed on {_where(partial)}, not on {d} where part {i} lives",
                "sum each part where it lives (work on a committed array runs on its device); move only "
                "the small partial sums, never the rows",
            )
        if not np.allclose(np.asarray(partial), np.asarray(part).sum(0), rtol=1e-5, atol=1e-4):
            fail(f"partial sum {i} is not the column sum of part {i}", "sum over the rows: axis 0")
    if not isinstance(total, jax.Array) or total.devices() != {target} or not total.committed:
        fail(
            f"the total lives on {_where(total)} (committed: {getattr(total, 'committed', False)}), "
            f"expected {target}",
            "move the partial sums to the target device with device_put, then add them",
        )


def _indivisible(split_and_sum, devices) -> None:
    import jax.numpy as jnp

    n, rows = len(devices), 2 * len(devices) + 1
    try:
        out = split_and_sum(jnp.zeros((rows, 2)), devices, devices[0])
    except ValueError as e:
        if str(rows) not in str(e) or str(n) not in str(e):
            fail(
                f"the error for {rows} rows on {n} devices says {str(e)!r}",
                "name both numbers and the fix, "
                "e.g. '9 rows cannot be split over 4 devices; use a multiple of 4'",
            )
        return
    except Exception as e:  # noqa: BLE001 - any other error is the wrong one
        fail(
            f"{rows} rows on {n} devices raised {type(e).__name__}: {str(e)[:120]}",
            "check the row count first and raise ValueError naming the numbers",
        )
    parts = (
        out[0] if isinstance(out, tuple | list) and out and isinstance(out[0], list | tuple) else []
    )
    held = sum(int(np.shape(p)[0]) for p in parts)
    fail(
        f"{rows} rows on {n} devices gave parts holding {held} rows and no error",
        "JAX refuses an uneven split too: raise ValueError when the rows do not divide by the devices",
    )


@checker
def check_split_and_sum(split_and_sum: Callable, devices: Sequence[Any]) -> bool:
    """Exercise 3 (project): ``split_and_sum(x, devices, device) -> (parts, partials, total)``, by hand.

    ``parts[i]`` is the i-th contiguous block of rows, committed to ``devices[i]`` — compared with the shards
    JAX makes for ``NamedSharding(Mesh(devices, ("rows",)), P("rows"))``; ``partials[i]`` is the column sum of
    ``parts[i]``, computed where that part lives; ``total`` is their sum, committed to ``device``. Every
    ``jax.device_put`` is recorded: a row-sized array that changes device must be a partial sum going to the
    target (not a sum of ``x`` computed elsewhere and moved afterwards). Rows not
    divisible by the device count raise ``ValueError`` naming both numbers. Float32 and int32 inputs.

    Raises:
      ExerciseError: a part or partial sum on the wrong device or uncommitted, rows interleaved or out of
        order, a dtype changed, no (or another) error for indivisible rows, the total wrong or elsewhere, or
        arrays on different devices combined without moving them ("incompatible devices"), a partial sum or
        the total computed from ``x`` on another device and then moved.
    """
    devices = list(devices)
    n, target = len(devices), devices[-1]
    rng = np.random.default_rng(0)
    inputs = [
        rng.normal(size=(2 * n, 3)).astype(np.float32),
        rng.integers(0, 99, (3 * n, 2, 2)).astype(np.int32),
    ]
    gap = 0.0
    for x_np in inputs:
        import jax.numpy as jnp

        with RecordMoves() as record:
            out = call_answer(
                "split_and_sum(x, devices, device)",
                split_and_sum,
                jnp.asarray(x_np),
                devices,
                target,
                explain=_adding_across_devices,
            )
        if not isinstance(out, tuple | list) or len(out) != 3:
            fail(
                "split_and_sum should return (parts, partials, total)",
                "return all three, in that order",
            )
        _judge_parts(out[0], x_np, devices)
        _judge_sums(out[1:], out[0], devices, target)
        judge_moves(record.moves, out[1], devices, target, x_np.shape[1:])
        total = np.asarray(out[2], np.float64)
        if not np.allclose(total, x_np.sum(0), rtol=1e-5, atol=1e-4):
            fail("the total is not the column sum of x", "add all the partial sums")
        if (
            x_np.dtype == np.float32
        ):  # another order of additions than one jnp.sum (lesson section 1)
            gap = float(
                np.max(np.abs(total - np.asarray(jnp.sum(jnp.asarray(x_np), axis=0), np.float64)))
            )
    if n > 1:
        _indivisible(split_and_sum, devices)
    print(
        f"  float32: your total and jnp.sum(x, axis=0) differ by at most {gap:.1e}; int32: not at all"
    )
    return passed(
        f"your split matches JAX's row sharding on {n} device(s), and each sum ran where its rows live"
    )

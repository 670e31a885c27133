"""Checkers for ``00_setup.ipynb``: where results live, an environment for a fresh process, rows split by hand.

Each checker measures instead of comparing with a stored answer: the placement cases run on real devices
(or in a fresh 2-device process when this one has a single device), the environment is tried in a fresh
process, and the hand-made split is compared with the layout JAX itself gives a row-sharded array.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ._common import call_answer, checker, fail, judged_on, not_written, passed
from ._lesson00_env import judge_cpu_env
from ._lesson00_env import run_python as _run_python
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

_PLACEMENT_HINT = (  # how to look, the same whichever prediction is wrong
    "for each expression, print its inputs' .devices() and .committed first, then apply section 2's rule: "
    "committed inputs decide where the work runs, uncommitted ones follow them, committed inputs on "
    "different devices are an error; ask what a new array made from b (zeros_like), a NumPy array and "
    "device_put without a device each take from their input"
)

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

    Spec: every prediction equals what the expression gives when run on two devices (``"first"``,
    ``"last"``, or ``"error"`` for JAX's "incompatible devices"). A wrong answer is told how many
    predictions are wrong, never which (so guessing costs a run per guess), with one hint on how to look.

    Args:
      predictions: ``{expression: "first" | "last" | "error"}``; the stub leaves every value ``None``.
      devices: ``report.devices``; with a single device the cases run in a fresh 2-device process.

    Raises:
      ExerciseError: a missing or unknown entry, or wrong predictions (their number, and how to look).
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
    wrong = sum(guesses[c] != measured[c] for c in PLACEMENT_CASES)
    if wrong:
        fail(
            f"{wrong} of your {len(PLACEMENT_CASES)} predictions are not what JAX does",
            _PLACEMENT_HINT,
        )
    for case in PLACEMENT_CASES:
        print(f"  {case:30s} -> {measured[case]}")
    where = "on this run's devices" if len(devices) >= 2 else "in a fresh 2-device process"
    return passed(f"all {len(PLACEMENT_CASES)} placements predicted (measured {where})")


# ---------------------------------------------------------------- exercise 2: debug cpu_env


@checker
def check_cpu_env(cpu_env: Callable[[int, Mapping[str, str]], Mapping[str, str]]) -> bool:
    """Exercise 2: ``cpu_env(n, env)`` returns a NEW environment in which a fresh process sees ``n`` CPU devices.

    Spec (``_lesson00_env``'s docstring has it in full): ``env`` unchanged; every other variable kept (the
    user's ``JAX_*`` ones too) and every other XLA flag; ``JAX_PLATFORMS=cpu``; the count a fresh process
    gets — ``JAX_NUM_CPU_DEVICES`` if set (it wins), else the last count flag — is ``n``. Tried on three
    environments (one with ``JAX_ENABLE_X64``, one with a stale count flag and a stale
    ``JAX_NUM_CPU_DEVICES``); the hardest one is also run in a fresh process.

    Raises:
      ExerciseError: the caller's mapping modified, a variable or flag lost or changed, the CPU backend not
        forced, or a count other than n (naming the setting that decides it), or the fresh process sees
        another count.
    """
    n = judge_cpu_env(cpu_env)
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
            "move the partial sums to the target device (the `device` argument) with device_put, then add them",
        )


_FIX_WORDS = (
    "multiple",
    "divisible",
    "pad",
    "drop",
    "trim",
    "remove",
    "use ",
    "add ",
    "choose",
    "pick",
)
"""Words of which an error message that names a fix holds at least one ("use a multiple of 4", "pad x")."""


def _indivisible(split_and_sum, devices) -> None:
    import jax.numpy as jnp

    n, rows = len(devices), 2 * len(devices) + 1
    try:
        out = split_and_sum(jnp.zeros((rows, 2)), devices, devices[0])
    except ValueError as e:
        text = str(e).lower()
        if str(rows) not in text or str(n) not in text or not any(w in text for w in _FIX_WORDS):
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
@judged_on(
    2, "on one device every part, partial sum and total is on that device, so no transfer shows"
)
def check_split_and_sum(split_and_sum: Callable, devices: Sequence[Any]) -> bool:
    """Exercise 3 (project): ``split_and_sum(x, devices, device) -> (parts, partials, total)``, by hand.

    Spec:

    - ``parts[i]`` is the i-th contiguous block of rows, committed to ``devices[i]``, of x's dtype — compared
      with the shards JAX makes for ``NamedSharding(Mesh(devices, ("rows",)), P("rows"))``;
    - ``partials[i]`` is the column sum of ``parts[i]``, on the device where that part lives;
    - ``total`` is the column sum of all rows, committed to ``device``, built from the partial sums: every
      transfer is recorded (``_lesson00_moves``) and the only arrays that may leave x's device are the
      blocks, each to its own device; after that only row-sized sums of partial sums move, from a device
      where those partial sums are; nothing larger than a row goes to the host;
    - rows not divisible by the device count raise ``ValueError`` naming both numbers.

    Judged on a float32 and an int32 input (x uncommitted on the default device, as in the notebook) on the
    run's devices, the target being the last device, then a middle one; then on a shorter device list in
    reverse order (2 or 3 devices); the total must keep x's dtype; the indivisible case with ``2n + 1``
    rows, whose error must name both numbers and a fix ("use a multiple of n").

    Raises:
      ExerciseError: a part or partial sum on the wrong device or uncommitted, rows interleaved or out of
        order, a dtype changed, no (or another) error for indivisible rows, the total wrong or elsewhere,
        arrays on different devices combined without moving them ("incompatible devices"), a sum computed
        from x's rows on another device and moved, rows moved anywhere but to their own device, or rows
        copied to the host.
    """
    import jax.numpy as jnp

    devices = list(devices)
    n = len(devices)
    rng = np.random.default_rng(0)
    # (x, the devices passed, the target device): the run's devices with the last and a middle one as the
    # target, then (with 2 devices or more) a shorter list in reverse order, so no device count, order or
    # target can be assumed
    runs = [
        (rng.normal(size=(2 * n, 3)).astype(np.float32), devices, devices[-1]),
        (rng.integers(0, 99, (3 * n, 2, 2)).astype(np.int32), devices, devices[(n - 1) // 2]),
    ]
    if n >= 2:
        fewer = devices[: max(2, min(3, n - 1))][::-1]
        runs.append((rng.normal(size=(2 * len(fewer), 3)).astype(np.float32), fewer, devices[-1]))
    gap = 0.0
    for x_np, these, target in runs:
        x = jnp.asarray(x_np)
        with RecordMoves() as record:
            out = call_answer(
                f"split_and_sum(x, devices, device) with {len(these)} devices",
                split_and_sum,
                x,
                list(these),
                target,
                explain=_adding_across_devices,
            )
        if not isinstance(out, tuple | list) or len(out) != 3:
            fail(
                "split_and_sum should return (parts, partials, total)",
                "return all three, in that order",
            )
        _judge_parts(out[0], x_np, these)
        _judge_sums(out[1:], out[0], these, target)
        judge_moves(record.moves, x_np, out[0], out[1], these)
        if out[2].dtype != x_np.dtype:
            fail(
                f"the total of a {x_np.dtype} x has dtype {out[2].dtype}",
                f"add the partial sums as they are: the column sum of {x_np.dtype} rows is {x_np.dtype}",
            )
        total = np.asarray(out[2], np.float64)
        if not np.allclose(total, x_np.sum(0), rtol=1e-5, atol=1e-4):
            fail("the total is not the column sum of x", "add all the partial sums")
        if x_np.dtype == np.float32 and these is devices:  # another order of additions (section 1)
            reference = np.asarray(jnp.sum(x, axis=0), np.float64)
            gap = float(np.max(np.abs(total - reference)))
    if n > 1:
        _indivisible(split_and_sum, devices)
    print(
        f"  float32: your total and jnp.sum(x, axis=0) differ by at most {gap:.1e}; int32: not at all"
    )
    return passed(
        f"your split matches JAX's row sharding on {n} device(s), each sum ran where its rows live, and "
        "only partial sums moved"
    )

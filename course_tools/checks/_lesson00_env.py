"""Lesson 00, exercise 2: ``cpu_env(n, env)``, the environment of a fresh process that simulates n CPU devices.

The spec (what a right answer must do), each part exercised by the test environments below:

1. ``env`` is left unchanged (it may be ``os.environ``: the checker passes an :class:`Environ`, which
   behaves like it, so ``copy.copy(env)`` writes through as it does on ``os.environ``), and a NEW mapping of
   str to str is returned;
2. every variable of ``env`` other than ``XLA_FLAGS``, ``JAX_NUM_CPU_DEVICES`` and ``JAX_PLATFORMS`` is kept
   with its value — the user's own ``JAX_*`` settings too (``JAX_ENABLE_X64``, a compilation cache);
3. every XLA flag of ``env`` other than the device-count flag is kept;
4. ``JAX_PLATFORMS=cpu``;
5. the device count a fresh process gets is ``n``. It is decided as JAX and XLA decide it (each rule checked
   in a fresh process by the tests): ``JAX_NUM_CPU_DEVICES`` when it is set — it silently wins over
   ``XLA_FLAGS`` — else the LAST ``--xla_force_host_platform_device_count`` flag, else 1. So
   ``JAX_NUM_CPU_DEVICES=n`` with a stale count flag left in ``XLA_FLAGS`` is right, and so is dropping the
   variable and replacing the flag. The stale count flags of the test environments differ (6 and 2), so
   editing one value by text does not pass. The environment of the hardest case is also run in a fresh
   process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

from ._common import call_answer, fail

COUNT_FLAG = "--xla_force_host_platform_device_count"
DEVICE_VARS = ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS")

CASES = (
    (3, {"COURSE_MARKER": "kept", "XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}),
    (2, {"COURSE_MARKER": "kept", "JAX_ENABLE_X64": "1", "XLA_FLAGS": f"{COUNT_FLAG}=6"}),
    (
        5,
        {
            "XLA_FLAGS": f"{COUNT_FLAG}=2 --xla_dump_to=/tmp/xla_dump",
            "JAX_NUM_CPU_DEVICES": "2",
            "JAX_DEFAULT_PRNG_IMPL": "threefry2x32",
        },
    ),
)
"""(n, the variables the environment holds besides this process's own, device settings removed)."""


class Environ(os._Environ):
    """A mapping that behaves as ``os.environ`` does — ``copy.copy`` of it shares its data, ``.copy()`` gives
    a dict — without writing to this process's environment (no ``putenv``). The answer is called with one,
    as the exercise's colleague calls it with ``os.environ``."""

    def __init__(self, data: Mapping[str, str]):
        real = os.environ
        encoded = {real.encodekey(k): real.encodevalue(v) for k, v in data.items()}
        super().__init__(
            encoded, real.encodekey, real.decodekey, real.encodevalue, real.decodevalue
        )

    def __setitem__(self, key, value):
        self._data[self.encodekey(key)] = self.encodevalue(value)

    def __delitem__(self, key):
        del self._data[self.encodekey(key)]


def clean_environ() -> dict[str, str]:
    """This process's environment without its device settings."""
    return {k: v for k, v in os.environ.items() if k not in DEVICE_VARS}


def run_python(
    code: str, extra: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None
):
    """Run ``code`` in a fresh Python; ``env`` replaces the environment, ``extra`` adds to a clean one."""
    environment = dict(env) if env is not None else {**clean_environ(), **(extra or {})}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120
    )


def count_flags(env: Mapping[str, str]) -> list[str]:
    """The values of the device-count flags in ``env["XLA_FLAGS"]``, in order."""
    flags = env.get("XLA_FLAGS", "").split()
    return [
        f.split("=", 1)[1] if "=" in f else "" for f in flags if f.split("=", 1)[0] == COUNT_FLAG
    ]


def effective_count(env: Mapping[str, str]) -> tuple[str, str]:
    """(the device count a fresh process gets from ``env``, which setting decides it)."""
    if "JAX_NUM_CPU_DEVICES" in env:
        return env["JAX_NUM_CPU_DEVICES"], "JAX_NUM_CPU_DEVICES"
    flags = count_flags(env)
    if flags:
        return flags[-1], "the last count flag in XLA_FLAGS"
    return "1", "no setting at all (the default)"


def _judge_kept(n: int, env: Mapping[str, str], before: Mapping[str, str], out: Any) -> None:
    """Parts 1–4 of the spec, or an ExerciseError."""
    if dict(env) != dict(before):
        changed = sorted(k for k in set(env) | set(before) if env.get(k) != before.get(k))
        fail(
            f"cpu_env({n}, env) changed the caller's mapping ({', '.join(changed)})",
            "called with os.environ, that edits this very process: build a new dict (dict(env); "
            "copy.copy(os.environ) shares its data) and edit that",
        )
    if out is env:
        fail(f"cpu_env({n}, env) returned the mapping it was given", "return a new dict")
    if not isinstance(out, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in out.items()
    ):
        fail(
            f"cpu_env({n}, env) returned {type(out).__name__} (or a value that is not a str)",
            "return a dict of str -> str, like os.environ",
        )
    lost = [k for k in env if k not in DEVICE_VARS and out.get(k) != env[k]]
    if lost:
        fail(
            f"the variable {lost[0]} ({env[lost[0]]!r}) was dropped or changed",
            "start from a copy of env, so every variable the user set is kept",
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


def _judge_count(
    n: int, out: Mapping[str, str], counts: dict[int, str], env: Mapping[str, str]
) -> None:
    """Part 5: the count a fresh process would get, with what decides it."""
    got, source = effective_count(out)
    if got == str(n):
        return
    stale = count_flags(env)
    if source == "JAX_NUM_CPU_DEVICES" and env.get("JAX_NUM_CPU_DEVICES") == got:
        hint = (
            "JAX_NUM_CPU_DEVICES is still set from before, and it silently wins over XLA_FLAGS: drop it, "
            "or set it to n"
        )
    elif source == "JAX_NUM_CPU_DEVICES":
        same = len(set(counts.values())) == 1 and len(counts) > 1
        hint = (
            f"your JAX_NUM_CPU_DEVICES is {got!r}"
            + (" for every n you were given" if same else f" for n = {n}")
            + ": its value does not follow n; set it from the argument, str(n)"
        )
    elif len(count_flags(out)) > 1:
        hint = (
            "XLA_FLAGS holds several count flags and XLA takes the last: remove the old one first"
        )
    elif stale and got == stale[-1] and f"{COUNT_FLAG}={got}" in out.get("XLA_FLAGS", "").split():
        hint = (
            f"XLA_FLAGS already held a count flag ({COUNT_FLAG}={got}) and it is still there: replace "
            "the count flag whatever its value"
        )
    elif source.startswith("no setting"):
        hint = f"add {COUNT_FLAG}=n to XLA_FLAGS (or set JAX_NUM_CPU_DEVICES=n)"
    elif len(set(counts.values())) == 1 and len(counts) > 1:
        hint = (
            "the count is the same for every n you were given: use the argument n, not a constant"
        )
    else:
        hint = f"set the count from the argument n (decided here by {source})"
    fail(f"cpu_env({n}, env) gives a fresh process {got} device(s), decided by {source}", hint)


def judge_cpu_env(cpu_env: Callable[[int, Mapping[str, str]], Mapping[str, str]]) -> int:
    """Judge ``cpu_env`` on :data:`CASES` and run the hardest case's environment in a fresh process;
    returns the device count that process reported."""
    counts, outs, envs = {}, {}, {}
    for n, extra in CASES:
        env = Environ({**clean_environ(), **extra})
        before = dict(env)
        out = call_answer(f"cpu_env({n}, env)", cpu_env, n, env)
        _judge_kept(n, env, before, out)
        counts[n], outs[n], envs[n] = effective_count(out)[0], dict(out), before
    for n, _ in CASES:
        _judge_count(n, outs[n], counts, envs[n])
    n, _ = CASES[-1]
    run = run_python("import jax; print(jax.device_count(), jax.default_backend())", env=outs[n])
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or [""])[-1][:200]
        fail(
            f"a fresh process with your environment failed: {last}",
            "print the XLA_FLAGS you build and check that every flag starts with '--'",
        )
    if run.stdout.split() != [str(n), "cpu"]:
        fail(
            f"a fresh process with your environment sees {run.stdout.strip()!r}, expected '{n} cpu'",
            "print the environment you return and look for another device-count setting",
        )
    return n

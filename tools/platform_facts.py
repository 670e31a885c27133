"""Print the platform facts that lessons 01, 02 and 07 assert, on whatever backend JAX starts (one device).

Run it on an accelerator before the notebooks, to see why a cell would fail there:

    python tools/platform_facts.py

It prints, each on one line: the float32 tolerance (``course_lib.precision.float32_rtol``) and the largest
relative error of a float32 matmul against float64 (lesson 01); ``log(1 + e^x)``'s autodiff at 100 and
``check_grads`` of its hand-written rule (lesson 01, section 8); the entry kernels of a small jitted function
and the bytes an 840 × 840 donation aliases against the argument's (lesson 02); the profile's processes,
threads and how many module events a jitted step leaves on device 0 (lesson 07, sections 9 and 10). Nothing
is asserted: this is a probe, not a test.
"""

from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.test_util import check_grads

from course_lib.precision import float32_rtol, float64_runs, matmul_precision
from course_lib.programs import hlo_kernels, hlo_memory_moves


def _line(name: str, value) -> None:
    print(f"{name:36s} {value}", flush=True)


def lesson01() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(512, 512)), rng.normal(size=(512, 512))
    got = np.asarray(jnp.asarray(a, jnp.float32) @ jnp.asarray(b, jnp.float32), np.float64)
    want = a @ b
    _line("float32_rtol / matmul precision", f"{float32_rtol():.2e} / {matmul_precision()}")
    _line(
        "f32 matmul 512^2 max rel. error",
        f"{np.max(np.abs(got - want)) / np.max(np.abs(want)):.2e}",
    )

    @jax.custom_jvp
    def stable(x):
        return jnp.log1p(jnp.exp(x))

    stable.defjvp(lambda p, t: (stable(p[0]), jax.nn.sigmoid(p[0]) * t[0]))
    naive = jax.grad(lambda x: jnp.log1p(jnp.exp(x)))(100.0)
    _line(
        "exp(100) | naive grad | stable grad",
        f"{jnp.exp(100.0)} | {naive} | {jax.grad(stable)(100.0)}",
    )
    for dtype, eps in (("float64", None), ("float32", 1e-2)):
        try:
            with jax.enable_x64(dtype == "float64"):
                check_grads(stable, (jnp.asarray(0.7, dtype),), order=1, eps=eps)
            result = "passes"
        except AssertionError as e:
            result = "FAILS: " + " ".join(str(e).split())[:160]
        _line(f"check_grads {dtype}", f"{result} (float64_runs: {float64_runs()})")


def lesson02() -> None:
    hlo = jax.jit(lambda x, s: jnp.sqrt(jnp.sum(x**2)) * s).lower(jnp.arange(4.0), 1.0).compile()
    _line("entry kernels of a scaled norm", dict(hlo_kernels(hlo.as_text())))
    _line("its copies between memory spaces", dict(hlo_memory_moves(hlo.as_text())))
    for shape in ((840, 256), (840, 840), (1024, 1024)):
        big = jnp.ones(shape)
        memory = (
            jax.jit(lambda v: 0.9 * v + 1.0, donate_argnums=0)
            .lower(big)
            .compile()
            .memory_analysis()
        )
        _line(
            f"donation {shape}",
            f"alias {memory.alias_size_in_bytes:,} argument {memory.argument_size_in_bytes:,} "
            f"nbytes {big.nbytes:,}",
        )


def lesson07() -> None:
    w = jnp.ones((512, 512)) / 512
    step = jax.jit(lambda x: jax.lax.fori_loop(0, 64, lambda i, h: jnp.tanh(h @ w), x))
    x = jnp.ones((1024, 512))
    step(x).block_until_ready()
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(3):
                step(x).block_until_ready()
        path = max(Path(d).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
        events = json.loads(gzip.open(path).read())["traceEvents"]
    meta = [e for e in events if e.get("ph") == "M" and "name" in e.get("args", {})]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in meta}
    timed = [e for e in events if e.get("ph") == "X"]
    threads: dict = {}
    for e in timed:
        key = (names.get((e["pid"], None), "?"), names.get((e["pid"], e.get("tid")), "?"))
        threads.setdefault(key, [0, set()])
        threads[key][0] += 1
        threads[key][1].update(e.get("args", {}))
    for (process, thread), (count, args) in sorted(threads.items()):
        _line(f"{process[:20]} | {thread[:14]}", f"{count} events, args {sorted(args)[:8]}")
    callers = {
        names.get((e["pid"], e.get("tid"))) for e in timed if e["name"].startswith("PjitFunction")
    }
    _line("threads with PjitFunction events", callers)


if __name__ == "__main__":
    _line("backend, devices", f"{jax.default_backend()}, {jax.devices()}")
    lesson01()
    lesson02()
    lesson07()

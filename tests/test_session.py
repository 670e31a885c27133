"""The test session's own settings (root conftest): the compile flags, which runs get them, and one
persistent compilation cache shared by every device count."""

import json
import os
import subprocess
import sys
import textwrap

import matrix
import pytest

_COMPILE = """
    import json, os, runpy, sys
    if sys.argv[2] == "shared":
        runpy.run_path(os.path.join(os.environ["IPYTHONDIR"], "profile_default", "startup", "00-course-tests.py"))
    import jax, jax.numpy as jnp, jax.monitoring
    jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))
    seen = []
    jax.monitoring.register_event_listener(lambda event, **kw: seen.append(event))
    (jnp.arange(5.0) * 3).block_until_ready()  # one device: device 0 at any count
    total = jax.jit(lambda x: x.sum(), out_shardings=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    mesh = jax.make_mesh((len(jax.devices()),), ("d",))
    x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, jax.P("d")))
    jax.jit(lambda x: (x * 2).sum())(x).block_until_ready()  # every device: another program at each count
    print(json.dumps({k: seen.count("/jax/compilation_cache/" + k) for k in ("cache_hits", "cache_misses")}))
"""


def _compile(n: int, cache, shared: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES",)}
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_COMPILE), str(n), "shared" if shared else "jax"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_one_device_programs_compile_once_for_every_device_count(tmp_path):
    # JAX's own key holds the CPU client's device count: the same one-device program misses at another count
    first, other = _compile(4, tmp_path / "jax", False), _compile(2, tmp_path / "jax", False)
    assert first["cache_hits"] == 0 and other["cache_hits"] == 0 and other["cache_misses"] >= 3
    # the session's key: the one-device programs (the product, its broadcast, ...) are loaded at 2 and 1;
    # the program over every device is a new one at each count (its partitions are in the key)
    first = _compile(4, tmp_path / "shared", True)
    assert first["cache_hits"] == 0 and first["cache_misses"] >= 3
    for n in (2, 1):
        again = _compile(n, tmp_path / "shared", True)
        assert again["cache_hits"] >= 2 and again["cache_misses"] >= 1, (n, again)
    again = _compile(4, tmp_path / "shared", True)
    assert again["cache_misses"] == 0, again


def test_nbmake_keeps_the_shell_flags_only_when_asked(monkeypatch):
    for value, keeps in (("0", False), ("1", True)):
        monkeypatch.setenv(matrix.NBMAKE_SHELL_FLAGS, value)
        assert matrix.nbmake_keeps_shell_flags() is keeps
    monkeypatch.delenv(matrix.NBMAKE_SHELL_FLAGS)
    assert not matrix.nbmake_keeps_shell_flags()
    monkeypatch.setenv(matrix.NBMAKE_SHELL_FLAGS, "yes")
    with pytest.raises(ValueError, match="COURSE_NBMAKE_SHELL_FLAGS='yes' is not 0 or 1"):
        matrix.nbmake_keeps_shell_flags()


def test_the_session_compiles_fast_and_nbmake_can_run_what_a_learner_runs(monkeypatch):
    session = os.environ["XLA_FLAGS"]
    assert "--xla_backend_optimization_level=0" in session.split()
    assert os.environ["COURSE_XLA_FLAGS_CHECKED"] == session  # the kernels do not probe them again
    seen = []
    for shell in ("", "--xla_cpu_use_thunk_runtime=true"):
        monkeypatch.setenv("COURSE_SHELL_XLA_FLAGS", shell)
        matrix.with_shell_flags(lambda: seen.append(os.environ.get("XLA_FLAGS")))()
        assert seen.pop() == (shell or None) and os.environ["XLA_FLAGS"] == session

    def fails():
        raise RuntimeError("a cell failed")

    with pytest.raises(RuntimeError):
        matrix.with_shell_flags(fails)()
    assert os.environ["XLA_FLAGS"] == session


def test_the_tests_make_commands_run_as_from_a_shell():
    # make test LOAD=1: make's command-line variables and depth would reach every make a test runs
    assert not {"MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES", "MAKELEVEL"} & set(os.environ)

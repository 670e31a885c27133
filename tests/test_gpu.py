"""GPU tests (marked ``gpu``): device setup with real GPUs, and every strategy's parity with single-device jit.

Skipped, with the reason, where JAX has no GPU backend; ``tools/gpu_check.sh`` runs them with
``COURSE_REQUIRE_GPU=1``, which turns that skip into a failure. The test session itself runs on simulated CPU
devices (``tests/conftest.py`` fixes the CPU backend before JAX starts), so every check runs in a fresh Python
process whose JAX starts on the GPUs: ``python tests/test_gpu.py CHECK OUT.json`` writes one JSON object, which
the tests read (and copy to ``$COURSE_GPU_RESULTS_DIR`` when it is set: the GPU reference run keeps them).

Parity, on the tiny profile over all visible GPUs, per precision (``course_lib.parity`` for the rules):

- ``float32`` with XLA's default matmul precision (TF32 allowed on recent GPUs): the loss of each of the first
  5 steps within :data:`GPU_TRAJECTORY_RTOL` (2e-2, the GPU tolerance ``notebooks/08_lab.ipynb`` states)
  of A's; one-step numbers recorded, not asserted;
- ``float32`` with ``jax_default_matmul_precision="highest"`` (no TF32): one-step parity within
  ``parity.TOLERANCES["float32"]``, the rule measured on CPU, and the same trajectory rule;
- ``bfloat16`` mixed precision: one-step parity within ``parity.TOLERANCES["bfloat16"]``;
- ``float64``: the whole trajectory within ``parity.TOLERANCES["float64"].trajectory`` (same mathematics).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # this checkout's course_lib, not another installed copy
GPU_TRAJECTORY_RTOL = 2e-2
"""Relative loss difference allowed over the first :data:`TRAJECTORY_STEPS` steps on GPU (08_lab's rule)."""
TRAJECTORY_STEPS = 5
CONFIGS = {  # name: (precision, jax_default_matmul_precision or None for XLA's default)
    "float32": ("float32", None),
    "float32_highest": ("float32", "highest"),
    "bfloat16": ("bfloat16", None),
    "float64": ("float64", None),
}
REQUIRE_GPU = os.environ.get("COURSE_REQUIRE_GPU", "") == "1"
pytestmark = pytest.mark.gpu


def _gpu_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_PLATFORM_NAME")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # one check at a time, small arrays
    return env


def _no_gpu_reason() -> str | None:
    """Why JAX has no GPU backend here (None: it has one). Cheap first: no CUDA plugin, no probe."""
    try:
        importlib.metadata.version("jax-cuda12-plugin")
    except importlib.metadata.PackageNotFoundError:
        return "no GPU backend: the CUDA build of JAX (jax-cuda12-plugin) is not installed"
    code = "import jax; print(jax.default_backend(), jax.device_count())"
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_gpu_env(), timeout=300
    )
    backend = r.stdout.split()[0] if r.returncode == 0 and r.stdout.split() else None
    if backend == "gpu":
        return None
    said = (r.stderr.strip().splitlines() or ["nothing"])[-1][:300]
    nvsmi = "found" if shutil.which("nvidia-smi") else "not found"
    return f"no GPU backend: JAX's backend is {backend!r} (nvidia-smi {nvsmi}; JAX said: {said})"


if __name__ != "__main__":  # collected by pytest (the checks below run as a script)
    _REASON = _no_gpu_reason()
    if _REASON is not None:
        if REQUIRE_GPU:
            pytest.fail(f"COURSE_REQUIRE_GPU=1 but {_REASON}", pytrace=False)
        pytest.skip(_REASON, allow_module_level=True)


_RESULTS: dict[str, dict] = {}


def _run_check(name: str, tmp_path_factory) -> dict:
    """The JSON of ``python tests/test_gpu.py name`` (run once per session)."""
    if name not in _RESULTS:
        out = tmp_path_factory.mktemp("gpu") / f"{name}.json"
        cmd = [sys.executable, str(Path(__file__)), name, str(out)]
        r = subprocess.run(
            cmd, capture_output=True, text=True, env=_gpu_env(), cwd=ROOT, timeout=600
        )
        assert r.returncode == 0 and out.exists(), f"{name} check failed:\n{r.stdout}\n{r.stderr}"
        _RESULTS[name] = json.loads(out.read_text())
        keep = os.environ.get("COURSE_GPU_RESULTS_DIR")
        if keep:
            shutil.copy(out, Path(keep) / f"gpu_test_{name}.json")
    return _RESULTS[name]


def _strategy_keys() -> list[str]:
    from course_lib import strategies

    return [k for k in strategies.CNN_KEYS if k != "jit"]


def test_device_setup_uses_the_real_gpus(tmp_path_factory):
    r = _run_check("setup", tmp_path_factory)
    assert r["platform"] == "gpu" and not r["simulated"], r
    assert r["n_devices"] == r["n_available"] == r["jax_device_count"] >= 1, r
    assert set(r["device_platforms"]) == {"gpu"}, r
    assert "only" in r["too_many_error"] and "GPU" in r["too_many_error"], r
    assert r["psum_ok"], r
    assert r["memory_stats"], (
        "GPU devices report memory_stats (measure.peak_device_memory reads them)"
    )


@pytest.mark.parametrize("key", _strategy_keys())
def test_float32_parity_at_the_gpu_tolerance(tmp_path_factory, key):
    r = _run_check("float32", tmp_path_factory)["strategies"][key]
    assert "error" not in r, r
    assert r["trajectory_rel"] <= GPU_TRAJECTORY_RTOL, r


@pytest.mark.parametrize("key", _strategy_keys())
def test_float32_highest_one_step_parity(tmp_path_factory, key):
    from course_lib import parity

    tol = parity.TOLERANCES["float32"]
    r = _run_check("float32_highest", tmp_path_factory)["strategies"][key]
    assert "error" not in r, r
    assert r["trajectory_rel"] <= GPU_TRAJECTORY_RTOL, r
    assert r["one_step_loss_rel"] <= tol.one_step_loss, r
    assert r["one_step_update_rel"] <= tol.one_step_update, r


@pytest.mark.parametrize("key", _strategy_keys())
def test_bfloat16_one_step_parity(tmp_path_factory, key):
    from course_lib import parity

    tol = parity.TOLERANCES["bfloat16"]
    r = _run_check("bfloat16", tmp_path_factory)["strategies"][key]
    assert "error" not in r, r
    assert r["one_step_loss_rel"] <= tol.one_step_loss, r
    assert r["one_step_update_rel"] <= tol.one_step_update, r


@pytest.mark.parametrize("key", _strategy_keys())
def test_float64_trajectory_parity(tmp_path_factory, key):
    from course_lib import parity

    r = _run_check("float64", tmp_path_factory)["strategies"][key]
    assert "error" not in r, r
    assert r["trajectory_all_rel"] <= parity.TOLERANCES["float64"].trajectory, r


# ---- the checks, each in its own process: python tests/test_gpu.py CHECK OUT.json [cpu] ----------------
# With "cpu" they run on 4 simulated CPU devices: a rehearsal of the checks themselves, not a GPU result.
PLATFORM = sys.argv[3] if __name__ == "__main__" and len(sys.argv) > 3 else "gpu"


def _count() -> int:
    import jax

    return len(jax.devices("gpu")) if PLATFORM == "gpu" else 4


def _setup_check() -> dict:
    import jax
    import jax.numpy as jnp

    from course_lib.devices import DeviceSetupError, setup_devices

    n = _count()
    report = setup_devices(n, platform=PLATFORM)
    try:
        setup_devices(n + 1, platform=PLATFORM)
        too_many = "no error"
    except DeviceSetupError as e:
        too_many = str(e)
    total = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i", devices=report.devices)(
        jnp.arange(n, dtype=jnp.float32)
    )
    return {
        **report.as_dict(),
        "jax_device_count": jax.device_count(),
        "device_platforms": sorted({d.platform for d in report.devices}),
        "too_many_error": too_many,
        "psum_ok": bool((jax.device_get(total) == n * (n - 1) / 2).all()),
        "memory_stats": bool(report.devices[0].memory_stats()),
    }


def _parity_check(name: str) -> dict:
    import jax
    import numpy as np

    from course_lib import config, parity, steps, strategies
    from course_lib import precision as precision_lib
    from course_lib.devices import setup_devices

    precision, matmul = CONFIGS[name]
    if matmul is not None:
        jax.config.update("jax_default_matmul_precision", matmul)
    report = setup_devices(_count(), platform=PLATFORM)
    cfg = config.resolve_profile("tiny", PLATFORM, n_devices=report.n_devices)
    with precision_lib.enabled(precision):
        start = config.init_run(cfg, 0)
        opt = steps.make_optimizer(cfg.learning_rate)
        state0 = precision_lib.cast_params(steps.init_state(start.params, opt), precision)
        host = [
            precision_lib.cast_batch(jax.device_get(b), precision) for b in _batches(start, cfg)
        ]

        def build(key, devices):
            return strategies.build(
                key, start.graphdef, start.params, opt, devices, precision=precision
            )

        a = build("jit", report.devices[:1])
        states, losses = [jax.device_get(state0)], []
        for b in host:
            new, m = a.step(a.place_state(states[-1]), jax.device_put(b, a.batch_sharding))
            states.append(jax.device_get(new))
            losses.append(float(np.asarray(m["loss"]).ravel()[0]))
        rows = {}
        for key in strategies.CNN_KEYS:
            if key == "jit":
                continue
            try:
                rows[key] = _one_strategy(build(key, report.devices), host, states, losses)
            except Exception as e:  # recorded: the test names the strategy and the error
                rows[key] = {"error": f"{type(e).__name__}: {e}"[:500]}
    return {
        "precision": precision,
        "matmul_precision": precision_lib.matmul_precision(),
        "n_devices": report.n_devices,
        "device_kind": report.device_kind,
        "profile": cfg.name,
        "global_batch": cfg.global_batch,
        "steps": cfg.steps,
        "reference_losses": losses,
        "tolerances": {
            **parity.TOLERANCES[precision].__dict__,
            "gpu_trajectory": GPU_TRAJECTORY_RTOL,
        },
        "strategies": rows,
    }


def _batches(start, cfg):
    from course_lib import data

    return data.batches(start.dataset, start.data_key, cfg.steps, cfg.global_batch)


def _one_strategy(s, host, states, ref_losses) -> dict:
    """Trajectory from the start and one step from each of A's states, of strategy ``s``."""
    import jax
    import numpy as np

    from course_lib import parity

    def to_step(b):
        return s.to_step_batch(jax.device_put(b, s.batch_sharding))

    def loss_of(m):
        return float(np.asarray(m["loss"]).ravel()[0])

    state, losses = s.place_state(states[0]), []
    for b in host:
        state, m = s.step(state, to_step(b))
        losses.append(loss_of(m))
    rel = parity.relative_diff(losses, ref_losses)
    one_loss = one_update = 0.0
    worst_leaf = ""
    for k, b in enumerate(host):
        new, m = s.step(s.place_state(states[k]), to_step(b))
        d, leaf = parity.update_diff(s.host_params(new), states[k + 1].params, states[k].params)
        one_loss = max(one_loss, abs(loss_of(m) - ref_losses[k]) / abs(ref_losses[k]))
        if d >= one_update:
            one_update, worst_leaf = d, leaf
    return {
        "mesh": s.mesh,
        "n_devices": s.n_devices,
        "losses": losses,
        "trajectory_rel": float(rel[:TRAJECTORY_STEPS].max()),
        "trajectory_all_rel": float(rel.max()),
        "one_step_loss_rel": one_loss,
        "one_step_update_rel": one_update,
        "worst_leaf": worst_leaf,
    }


if __name__ == "__main__":
    check, out_path = sys.argv[1], sys.argv[2]
    result = _setup_check() if check == "setup" else _parity_check(check)
    Path(out_path).write_text(json.dumps(result, indent=2, default=str))

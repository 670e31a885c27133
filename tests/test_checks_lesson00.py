"""The checkers of lesson 00 (course_tools.checks.lesson00) accept correct answers in several forms and
reject typical wrong ones, each with its own hint; an unwritten answer prints its hint (or raises under
COURSE_STRICT_CHECKS=1)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
from checking import not_written
from checking import rejects_written as rejects
from checking import stub as _stub

from course_tools.checks import lesson00

# ---------------------------------------------------------------- exercise 1

RIGHT = {
    "jnp.zeros_like(b)": "last",
    "jax.jit(jnp.add)(a, b)": "last",
    "np.asarray(b) + c": "first",
    "jax.device_put(b) + c": "error",
    "jax.device_put(b, first) + c": "first",
}


def test_placement_is_measured(report):
    assert lesson00.measure_placement(report.devices) == RIGHT
    assert lesson00.measure_placement(report.devices[:1]) == RIGHT  # a fresh 2-device process


def test_placement_accepts_the_measured_placements(report):
    assert lesson00.check_placement(RIGHT, report.devices)
    assert lesson00.check_placement({k: f" {v.upper()} " for k, v in RIGHT.items()}, report.devices)


def test_placement_stub(report, monkeypatch, capsys):
    not_written(
        lesson00.check_placement,
        dict.fromkeys(RIGHT),
        report.devices,
        monkeypatch=monkeypatch,
        capsys=capsys,
    )


def test_placement_wrong_answers(report):
    devices = report.devices
    default_device = dict.fromkeys(RIGHT, "first")  # "new arrays always go to the default device"
    rejects(
        lesson00.check_placement, default_device, devices, match=r"zeros_like.*\n.*shape and dtype"
    )
    host_keeps_device = {**RIGHT, "np.asarray(b) + c": "last"}
    rejects(
        lesson00.check_placement,
        host_keeps_device,
        devices,
        match=r"np.asarray.*\n.*type\(np.asarray",
    )
    put_moves_home = {**RIGHT, "jax.device_put(b) + c": "first"}
    rejects(
        lesson00.check_placement,
        put_moves_home,
        devices,
        match=r"device_put\(b\) \+ c.*\n.*without a",
    )
    rejects(
        lesson00.check_placement,
        {**RIGHT, "jnp.zeros_like(b)": "GPU 0"},
        devices,
        match="first.*last",
    )
    rejects(
        lesson00.check_placement,
        {**RIGHT, "jnp.zeros_like(b)": None},
        devices,
        match="no prediction",
    )


# ---------------------------------------------------------------- exercise 2

FLAG = "--xla_force_host_platform_device_count"


def _reference_env(n, env):
    fresh = dict(env)
    fresh.pop("JAX_NUM_CPU_DEVICES", None)
    kept = [f for f in fresh.get("XLA_FLAGS", "").split() if f.split("=", 1)[0] != FLAG]
    fresh["XLA_FLAGS"] = " ".join([*kept, f"{FLAG}={n}"])
    fresh["JAX_PLATFORMS"] = "cpu"
    return fresh


def _both_settings(n, env):  # another correct form: JAX_NUM_CPU_DEVICES set to n as well
    return {**_reference_env(n, env), "JAX_NUM_CPU_DEVICES": str(n)}


def _buggy_original(n, env):
    env["XLA_FLAGS"] = f"{FLAG}={n}"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _copy_but_overwrite(n, env):
    return {**env, "XLA_FLAGS": f"{FLAG}={n}", "JAX_PLATFORMS": "cpu"}


def _keeps_stale_count(n, env):
    kept = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(FLAG)]
    return {**env, "XLA_FLAGS": " ".join([*kept, f"{FLAG}={n}"]), "JAX_PLATFORMS": "cpu"}


def _appends_a_second_flag(n, env):
    fresh = {k: v for k, v in env.items() if k != "JAX_NUM_CPU_DEVICES"}
    fresh["XLA_FLAGS"] = (fresh.get("XLA_FLAGS", "") + f" {FLAG}={n}").strip()
    return {**fresh, "JAX_PLATFORMS": "cpu"}


def _forgets_the_backend(n, env):
    return {k: v for k, v in _reference_env(n, env).items() if k != "JAX_PLATFORMS"}


def test_cpu_env_accepts_correct_forms():
    assert lesson00.check_cpu_env(_reference_env)
    assert lesson00.check_cpu_env(_both_settings)


def test_cpu_env_stub(monkeypatch, capsys):
    not_written(lesson00.check_cpu_env, _stub, monkeypatch=monkeypatch, capsys=capsys)


def test_cpu_env_wrong_answers():
    before = dict(os.environ)
    rejects(lesson00.check_cpu_env, _buggy_original, match="changed the caller's mapping")
    assert dict(os.environ) == before  # the checker never hands the learner os.environ itself
    rejects(lesson00.check_cpu_env, _copy_but_overwrite, match=r"fast_math=false .*gone")
    rejects(
        lesson00.check_cpu_env,
        _keeps_stale_count,
        match=r"count of 5/2\n.*JAX_NUM_CPU_DEVICES is still",
    )
    rejects(lesson00.check_cpu_env, _appends_a_second_flag, match="2 count flags")
    rejects(lesson00.check_cpu_env, _forgets_the_backend, match="JAX_PLATFORMS")
    rejects(
        lesson00.check_cpu_env, lambda n, env: _reference_env(8, env), match="use the argument n"
    )


# ---------------------------------------------------------------- exercise 3


def _split(x, devices):
    n, rows = len(devices), x.shape[0]
    if rows % n:
        raise ValueError(
            f"{rows} rows cannot be split evenly over {n} devices; use a multiple of {n}"
        )
    k = rows // n
    return [jax.device_put(x[i * k : (i + 1) * k], d) for i, d in enumerate(devices)]


def _sums(parts, device):
    partials = [p.sum(axis=0) for p in parts]
    moved = [jax.device_put(s, device) for s in partials]
    return partials, jax.device_put(sum(moved[1:], moved[0]), device)


def answer(split, sums):
    def split_and_sum(x, devices, device):
        parts = split(x, devices)
        return (parts, *sums(parts, device))

    return split_and_sum


def _split_with_jnp_split(x, devices):  # another correct form
    if x.shape[0] % len(devices):
        raise ValueError(f"rows={x.shape[0]} is not a multiple of {len(devices)} devices")
    return [jax.device_put(b, d) for b, d in zip(jnp.split(x, len(devices)), devices)]


def _sums_stacked(parts, device):  # another correct form: one stack, one sum
    partials = [jnp.sum(p, axis=0) for p in parts]
    return partials, jnp.stack([jax.device_put(s, device) for s in partials]).sum(0)


def test_split_and_sum_accepts_correct_forms(report):
    for devices in (report.devices, report.devices[:3], report.devices[:1]):
        assert lesson00.check_split_and_sum(answer(_split, _sums), devices)
    assert lesson00.check_split_and_sum(
        answer(_split_with_jnp_split, _sums_stacked), report.devices
    )
    as_list = lambda x, ds, d: list(answer(_split, _sums)(x, ds, d))
    assert lesson00.check_split_and_sum(as_list, report.devices)


def test_split_and_sum_stub(report, monkeypatch, capsys):
    not_written(
        lesson00.check_split_and_sum, _stub, report.devices, monkeypatch=monkeypatch, capsys=capsys
    )


def _uncommitted(x, devices):
    k = x.shape[0] // len(devices)
    return [x[i * k : (i + 1) * k] for i in range(len(devices))]


def _interleaved(x, devices):
    return [jax.device_put(x[i :: len(devices)], d) for i, d in enumerate(devices)]


def _drops_rows(x, devices):
    k = x.shape[0] // len(devices)
    return [jax.device_put(x[i * k : (i + 1) * k], d) for i, d in enumerate(devices)]


def _adds_in_place(parts, device):  # adds partial sums committed to different devices
    partials = [p.sum(axis=0) for p in parts]
    return partials, jax.device_put(sum(partials[1:], partials[0]), device)


def _moves_the_rows(parts, device):
    moved = [jax.device_put(p, device) for p in parts]
    partials = [m.sum(axis=0) for m in moved]
    return partials, jax.device_put(sum(partials[1:], partials[0]), device)


def _total_on_the_host(parts, device):
    partials = [p.sum(axis=0) for p in parts]
    return partials, sum(np.asarray(s) for s in partials) + jnp.zeros(())


def _total_from_x(x, devices, device):  # the right total, summed from x and moved afterwards
    parts = _split(x, devices)
    partials = [p.sum(axis=0) for p in parts]
    return parts, partials, jax.device_put(x.sum(axis=0), device)


def _partials_from_x(x, devices, device):  # right partial sums, computed on x's device, then moved
    parts, k = _split(x, devices), x.shape[0] // len(devices)
    partials = [jax.device_put(x[i * k : (i + 1) * k].sum(0), d) for i, d in enumerate(devices)]
    return parts, partials, _sums(parts, device)[1]


def test_split_and_sum_refuses_sums_made_elsewhere(report):
    check = lesson00.check_split_and_sum
    for devices in (report.devices, report.devices[:2]):
        if len(devices) > 1:
            rejects(check, _total_from_x, devices, match="none of the partial sums")
            rejects(check, _partials_from_x, devices, match="computed somewhere else")


def test_split_and_sum_wrong_answers(report):
    devices = report.devices
    check = lesson00.check_split_and_sum
    rejects(check, answer(_uncommitted, _sums), devices, match="commit each block")
    rejects(check, answer(_uncommitted, _sums), devices[:1], match="commit each block")
    rejects(check, answer(_interleaved, _sums), devices, match="not every n-th row")
    rejects(check, answer(_drops_rows, _sums), devices, match="no error")
    cast = lambda x, ds: [
        jax.device_put(p.astype(jnp.float32), d) for p, d in zip(_split(x, ds), ds)
    ]
    rejects(check, answer(cast, _sums), devices, match="dtype")
    rejects(
        check, answer(_split, _adds_in_place), devices, match="bring the partial sums to the target"
    )
    rejects(check, answer(_split, _moves_the_rows), devices, match="never the rows")
    rejects(check, answer(_split, _total_on_the_host), devices, match="total lives on")
    rejects(
        check,
        lambda x, ds, d: answer(_split, _sums)(x, ds, d)[:2],
        devices,
        match="parts, partials, total",
    )

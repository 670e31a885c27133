"""The checkers of lesson 00 (course_tools.checks.lesson00) accept correct answers in several forms and
reject typical wrong ones, each with its own hint; an unwritten answer prints its hint (or raises under
COURSE_STRICT_CHECKS=1)."""

import concurrent.futures
import copy
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checking import not_written
from checking import rejects_written as rejects
from checking import stub as _stub

from course_tools.checks import ExerciseError, lesson00
from course_tools.checks._buffer311 import NoBufferProtocol
from course_tools.checks._lesson00_env import CASES, clean_environ, effective_count, run_python

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
    rejects(lesson00.check_placement, default_device, devices, match="3 of your 5 predictions")
    host_keeps_device = {**RIGHT, "np.asarray(b) + c": "last"}
    rejects(lesson00.check_placement, host_keeps_device, devices, match="1 of your 5 predictions")
    put_moves_home = {**RIGHT, "jax.device_put(b) + c": "first"}  # "device_put(b) uncommits b"
    rejects(lesson00.check_placement, put_moves_home, devices, match="1 of your 5")
    zeros_default = {**RIGHT, "jnp.zeros_like(b)": "first"}  # the review's wrong answer
    rejects(lesson00.check_placement, zeros_default, devices, match="1 of your 5")
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


def test_placement_never_names_the_wrong_case(report):
    """A predict checker says how many are wrong, not which: the message is the same for any one error."""
    messages = set()
    for case in RIGHT:
        wrong = {**RIGHT, case: "first" if RIGHT[case] != "first" else "last"}
        with pytest.raises(ExerciseError) as e:
            lesson00.check_placement(wrong, report.devices)
        messages.add(str(e.value))
    assert len(messages) == 1, messages
    assert not any(case in next(iter(messages)) for case in RIGHT)


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


def _sets_the_variable(
    n, env
):  # another correct form: the variable wins, the stale flag is harmless
    return {**env, "JAX_NUM_CPU_DEVICES": str(n), "JAX_PLATFORMS": "cpu"}


def _drops_jax_variables(n, env):  # "clean out JAX": the user's JAX_ENABLE_X64 is lost too
    fresh = {k: v for k, v in env.items() if not k.startswith("JAX_")}
    return _reference_env(n, fresh)


def _prepends_the_flag(n, env):  # the new flag first: XLA takes the last, the stale one
    fresh = {k: v for k, v in env.items() if k != "JAX_NUM_CPU_DEVICES"}
    fresh["XLA_FLAGS"] = f"{FLAG}={n} " + fresh.get("XLA_FLAGS", "")
    return {**fresh, "JAX_PLATFORMS": "cpu"}


def _stringly(n, env):  # a number where os.environ needs a str
    return {**_reference_env(n, env), "JAX_NUM_CPU_DEVICES": n}


def _shallow_copy(
    n, env
):  # copy.copy of os.environ shares its data: the caller's mapping is edited
    fresh = copy.copy(env)
    fresh.pop("JAX_NUM_CPU_DEVICES", None)
    kept = [f for f in fresh.get("XLA_FLAGS", "").split() if f.split("=", 1)[0] != FLAG]
    fresh["XLA_FLAGS"] = " ".join([*kept, f"{FLAG}={n}"])
    fresh["JAX_PLATFORMS"] = "cpu"
    return fresh


def _replaces_count_2_only(n, env):  # edits the flag by text, for the stale count of the story only
    fresh = dict(env)
    fresh.pop("JAX_NUM_CPU_DEVICES", None)
    flags = fresh.get("XLA_FLAGS", "")
    if f"{FLAG}=2" in flags:
        flags = flags.replace(f"{FLAG}=2", f"{FLAG}={n}")
    elif FLAG not in flags:
        flags = f"{flags} {FLAG}={n}".strip()
    return {**fresh, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


def _environ_copy_method(n, env):  # another correct form: os.environ.copy() is a dict
    fresh = env.copy()
    fresh.pop("JAX_NUM_CPU_DEVICES", None)
    kept = [f for f in fresh.get("XLA_FLAGS", "").split() if f.split("=", 1)[0] != FLAG]
    return {**fresh, "XLA_FLAGS": " ".join([*kept, f"{FLAG}={n}"]), "JAX_PLATFORMS": "cpu"}


def test_cpu_env_accepts_correct_forms():
    assert lesson00.check_cpu_env(_reference_env)
    assert lesson00.check_cpu_env(_sets_the_variable)  # the review's refused right answer
    assert lesson00.check_cpu_env(_appends_a_second_flag)  # XLA takes the last flag: n
    assert lesson00.check_cpu_env(_environ_copy_method)


def test_cpu_env_stub(monkeypatch, capsys):
    not_written(lesson00.check_cpu_env, _stub, monkeypatch=monkeypatch, capsys=capsys)


NOTEBOOK_CELLS = """
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance(colors="nocolor")
shell.run_cell("from course_tools.checks import lesson00")
for answer in ("lambda n, env: dict(env)", "lambda n, env: 1 / 0"):
    failed = shell.run_cell(f"lesson00.check_cpu_env({answer})").error_in_exec
    print("the cell raised", type(failed).__name__)
"""


def test_a_wrong_answer_shows_its_hint_not_the_checkers_traceback_in_a_notebook():
    # what a notebook shows under a wrong answer is IPython's display of the error: the message and its
    # hint, not the checker's frames (nor those of a learner's error it wraps) above them
    r = subprocess.run(
        [sys.executable, "-c", NOTEBOOK_CELLS], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    shown = r.stdout.splitlines()
    assert len(shown) == 6 and "Traceback" not in r.stdout and "File " not in r.stdout, r.stdout
    assert shown[0] == "ExerciseError: ✗ JAX_PLATFORMS is None", r.stdout
    assert shown[1].startswith("  hint: set JAX_PLATFORMS=cpu")
    assert (
        shown[3].startswith("ExerciseError: ✗ cpu_env(") and "raised ZeroDivisionError" in shown[3]
    )
    assert shown[4] == "  hint: run it on a small input in a cell and read the error"
    # the cell still fails: a run of the notebook (papermill) stops at a wrong answer
    assert shown[2] == shown[5] == "the cell raised ExerciseError"


def test_cpu_env_wrong_answers():
    before = dict(os.environ)
    rejects(lesson00.check_cpu_env, _buggy_original, match="changed the caller's mapping")
    assert dict(os.environ) == before  # the checker never hands the learner os.environ itself
    rejects(lesson00.check_cpu_env, _copy_but_overwrite, match=r"fast_math=false .*gone")
    rejects(
        lesson00.check_cpu_env,
        _keeps_stale_count,
        match=r"(?s)cpu_env\(5, env\) gives a fresh process 2 device\(s\), decided by JAX_NUM_CPU_DEVICES\n.*drop it",
    )
    rejects(
        lesson00.check_cpu_env, _drops_jax_variables, match=r"the variable JAX_\w+ .*was dropped"
    )
    rejects(lesson00.check_cpu_env, _prepends_the_flag, match="XLA takes the last")
    rejects(lesson00.check_cpu_env, _forgets_the_backend, match="JAX_PLATFORMS")
    rejects(lesson00.check_cpu_env, _stringly, match="not a str")
    rejects(lesson00.check_cpu_env, _shallow_copy, match="changed the caller's mapping")
    assert dict(os.environ) == before
    rejects(
        lesson00.check_cpu_env,
        _replaces_count_2_only,
        match=r"(?s)cpu_env\(2, env\) gives a fresh process 6 .*already held a count flag",
    )
    rejects(
        lesson00.check_cpu_env, lambda n, env: _reference_env(8, env), match="use the argument n"
    )


def _variable_hard_coded(n, env):  # the red team's H2: both settings, as the constant 4
    fresh = dict(env)
    kept = [f for f in fresh.get("XLA_FLAGS", "").split() if f.split("=", 1)[0] != FLAG]
    fresh["XLA_FLAGS"] = " ".join([*kept, f"{FLAG}=4"])
    return {**fresh, "JAX_NUM_CPU_DEVICES": "4", "JAX_PLATFORMS": "cpu"}


def test_cpu_env_names_a_constant_count_variable():
    with pytest.raises(ExerciseError) as e:
        lesson00.check_cpu_env(_variable_hard_coded)
    assert "decided by JAX_NUM_CPU_DEVICES" in str(e.value)
    assert "'4' for every n" in str(e.value) and "does not follow n" in str(e.value)
    assert "from before" not in str(e.value)


def test_the_count_rule_is_what_a_fresh_process_sees():
    """effective_count (JAX_NUM_CPU_DEVICES wins, else the last flag) against real processes."""
    stale = {**clean_environ(), **CASES[2][1]}  # a stale count flag and JAX_NUM_CPU_DEVICES=2
    answers = (_sets_the_variable, _prepends_the_flag)
    code = "import jax; print(jax.device_count())"
    envs = [answer(5, stale) for answer in answers] + [_both_settings(4, stale)]
    with concurrent.futures.ThreadPoolExecutor(len(envs)) as pool:  # one fresh process each
        runs = list(pool.map(lambda env: run_python(code, env=env), envs))
    for env, run in zip(envs, runs):
        assert run.stdout.strip() == effective_count(env)[0], (env, run.stderr[-300:])
    assert [run.stdout.strip() for run in runs] == ["5", "2", "4"]


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


def _sums_from_zeros(parts, device):  # another correct form: an uncommitted zeros accumulator
    partials = [p.sum(axis=0) for p in parts]
    total = jnp.zeros(parts[0].shape[1:], parts[0].dtype)
    for s in partials:
        total = total + jax.device_put(s, device)
    return partials, total


def _split_asarray(x, devices):  # jnp.asarray(x[:k], device=devices[0]) stays uncommitted: refused
    k = x.shape[0] // len(devices)
    return [jnp.asarray(x[i * k : (i + 1) * k], device=d) for i, d in enumerate(devices)]


def _sums_to_device(
    parts, device
):  # another correct form: to_device, and jnp.asarray(device=) of the
    # partial already on the target (jnp.asarray of an array committed elsewhere raises on JAX 0.12)
    partials = [p.sum(axis=0) for p in parts]
    moved = [
        jnp.asarray(p, device=device) if p.devices() == {device} else p.to_device(device)
        for p in partials
    ]
    return partials, functools.reduce(jnp.add, moved)


def _split_by_sharding(x, devices):  # another correct form: lesson 05's layout, then its shards
    if x.shape[0] % len(devices):
        raise ValueError(f"{x.shape[0]} rows, {len(devices)} devices: use a multiple")
    mesh = jax.sharding.Mesh(np.array(devices), ("rows",))
    spread = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P("rows")))
    by_device = {s.device: s.data for s in spread.addressable_shards}
    return [by_device[d] for d in devices]


def _tree_sum(parts, device):  # another correct form: pairwise sums on the way to the target
    partials = [p.sum(axis=0) for p in parts]
    level = list(partials)
    while len(level) > 1:
        pairs = [(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        merged = [b + jax.device_put(a, next(iter(b.devices()))) for a, b in pairs]
        level = merged + ([level[-1]] if len(level) % 2 else [])
    return partials, jax.device_put(level[0], device)


def _sums_added_on_host(
    parts, device
):  # another correct form: only the partial sums visit the host
    partials = [p.sum(axis=0) for p in parts]
    return partials, jax.device_put(np.sum([np.asarray(s) for s in partials], axis=0), device)


def _split_by_list_put(x, devices):  # another correct form: one device_put of a list to a list
    if x.shape[0] % len(devices):
        raise ValueError(f"{x.shape[0]} rows on {len(devices)} devices: use a multiple of them")
    k = x.shape[0] // len(devices)
    return jax.device_put([x[i * k : (i + 1) * k] for i in range(len(devices))], list(devices))


def _sums_by_list_put(parts, device):
    partials = [p.sum(axis=0) for p in parts]
    return partials, jnp.stack(jax.device_put(partials, [device] * len(partials))).sum(axis=0)


def test_split_and_sum_accepts_correct_forms(report):
    for devices in (report.devices, report.devices[:3]):
        assert lesson00.check_split_and_sum(answer(_split, _sums), devices)
    for split, sums in (
        (_split_with_jnp_split, _sums_stacked),
        (_split, _sums_from_zeros),
        (_split, _sums_to_device),
        (_split_by_sharding, _sums),
        (_split, _tree_sum),
        (_split, _sums_added_on_host),
        (_split_by_list_put, _sums_by_list_put),
    ):
        assert lesson00.check_split_and_sum(answer(split, sums), report.devices), split
    as_list = lambda x, ds, d: list(answer(_split, _sums)(x, ds, d))
    assert lesson00.check_split_and_sum(as_list, report.devices)


def _split_and_sum(x, devices, device):  # a top-level def, as a notebook cell has it
    parts = _split(x, devices)
    return (parts, *_sums(parts, device))


def test_split_and_sum_on_one_device_is_judged_on_eight(report, capsys):
    """One device shows no transfer: the answer is judged in a fresh process with 8 simulated devices,
    where a total summed from x and moved is refused (the red team's D1 got a ✓ at 1 device)."""
    one = report.devices[:1]
    assert lesson00.check_split_and_sum(_split_and_sum, one)
    assert "judged in a fresh process on 8 simulated CPU devices" in capsys.readouterr().out
    rejects(
        lesson00.check_split_and_sum,
        _total_from_x,
        one,
        match="(?s)sum of all the rows was moved.*judged in a fresh process on 8",
    )


def _sums_in_bfloat16(parts, device):  # the red team's D2: partial sums cast, then moved and added
    partials = [p.sum(axis=0) for p in parts]
    return partials, sum(jax.device_put(s.astype(jnp.bfloat16), device) for s in partials)


def test_split_and_sum_names_the_dtype_of_a_cast_sum(report):
    """A partial sum cast to bfloat16 before it moves is still a sum of partial sums: the hint names the
    dtype, not "no sum of partial sums"."""
    for devices in (report.devices, report.devices[:2]):
        rejects(
            lesson00.check_split_and_sum,
            answer(_split, _sums_in_bfloat16),
            devices,
            match="row-sized bfloat16 array .* float32 x are float32",
        )


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


def _total_moves_every_row(x, devices, device):  # the review's: right values, x moved whole
    parts = _split(x, devices)
    return parts, [p.sum(0) for p in parts], jax.device_put(x, device).sum(0)


def _total_by_asarray(x, devices, device):  # the review's: summed where x is, moved by jnp.asarray
    parts = _split(x, devices)
    return parts, [p.sum(0) for p in parts], jnp.asarray(x.sum(0), device=device)


def _total_by_to_device(x, devices, device):
    parts = _split(x, devices)
    return parts, [p.sum(0) for p in parts], x.to_device(device).sum(0)


def _total_by_jit(x, devices, device):  # an implicit copy: jit with out_shardings moves x's rows
    parts = _split(x, devices)
    target = jax.sharding.SingleDeviceSharding(device)
    return parts, [p.sum(0) for p in parts], jax.jit(lambda v: v.sum(0), out_shardings=target)(x)


def _total_via_host(x, devices, device):
    parts = _split(x, devices)
    return parts, [p.sum(0) for p in parts], jax.device_put(np.asarray(x).sum(0), device)


def _total_added_to_zeros(x, devices, device):  # the red team's W1: x's sum copied by an addition
    parts = _split(x, devices)
    total = jnp.zeros(x.shape[1:], x.dtype, device=device) + x.sum(0)
    return parts, [p.sum(0) for p in parts], total


def _total_added_from_the_host(x, devices, device):  # W2: the same through the host
    parts = _split(x, devices)
    total = jnp.zeros(x.shape[1:], x.dtype, device=device) + np.asarray(x.sum(0))
    return parts, [p.sum(0) for p in parts], total


def _sums_added_to_zeros(parts, device):  # a correct form: zeros on the target plus moved partials
    partials = [p.sum(axis=0) for p in parts]
    total = jnp.zeros(parts[0].shape[1:], parts[0].dtype, device=device)
    for s in partials:
        total = total + np.asarray(s)
    return partials, total


def test_split_and_sum_refuses_a_total_copied_by_an_operation(report):
    check = lesson00.check_split_and_sum
    for devices in (report.devices, report.devices[:2]):
        rejects(check, _total_added_to_zeros, devices, match="sum of all the rows.*implicitly")
        rejects(check, _total_added_from_the_host, devices, match="sum of all the rows.*host")
        for _ in range(2):  # also once the operations are compiled and cached
            assert check(answer(_split, _sums_added_to_zeros), devices)


def _parts_after_moving_x(x, devices, device):  # every device gets every row, then slices its own
    k = x.shape[0] // len(devices)
    parts = [jax.device_put(x, d)[i * k : (i + 1) * k] for i, d in enumerate(devices)]
    return (parts, *_sums(parts, device))


def test_split_and_sum_refuses_sums_made_elsewhere(report):
    check = lesson00.check_split_and_sum
    for devices in (report.devices, report.devices[:2]):
        rejects(check, _total_from_x, devices, match="sum of all the rows was moved")
        rejects(check, _partials_from_x, devices, match="computed there \\(from x\\)")
        rejects(check, _total_moves_every_row, devices, match="every row of x was moved")
        rejects(check, _total_by_asarray, devices, match="sum of all the rows was moved")
        rejects(check, _total_by_to_device, devices, match="every row of x was moved")
        rejects(check, _total_by_jit, devices, match="every row of x was moved")
        rejects(check, _total_via_host, devices, match="was copied from cpu:0 to the host")
    rejects(check, _parts_after_moving_x, report.devices, match="every row of x was moved")
    rejects(check, _split_on_the_host, report.devices, match=r"shape \(16, 3\) .*to the host")


def _split_on_the_host(x, devices, device):  # np.asarray(x) copies every row to the host first
    host = np.asarray(x)
    parts = _split(host, devices)
    return (parts, *_sums(parts, device))


def _total_on_the_last_device(parts, device):  # ignores the device argument
    partials = [p.sum(axis=0) for p in parts]
    last = next(iter(parts[-1].devices()))
    return partials, functools.reduce(jnp.add, [jax.device_put(s, last) for s in partials])


def _split_over_eight(x, devices):  # hard-codes the notebook's 8 devices
    if x.shape[0] % 8:
        raise ValueError(f"{x.shape[0]} rows cannot be split over 8 devices; use a multiple of 8")
    k = x.shape[0] // 8
    return [jax.device_put(x[i * k : (i + 1) * k], devices[i]) for i in range(8)]


def _split_error_without_fix(x, devices):
    if x.shape[0] % len(devices):
        raise ValueError(f"{x.shape[0]} rows, {len(devices)} devices")
    return _split(x, devices)


def _float_total(parts, device):
    partials, total = _sums(parts, device)
    return partials, total.astype(jnp.float32)


def test_split_and_sum_wrong_answers(report):
    devices = report.devices
    check = lesson00.check_split_and_sum
    rejects(check, answer(_uncommitted, _sums), devices, match="commit each block")
    rejects(check, answer(_uncommitted, _sums), devices[:2], match="commit each block")
    rejects(check, answer(_split_asarray, _sums), devices, match="part 0 .*committed: False")
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
    rejects(check, answer(_split, _total_on_the_last_device), devices, match="expected cpu:3")
    rejects(check, answer(_split_over_eight, _sums), devices, match="with 3 devices raised")
    rejects(check, answer(_split_error_without_fix, _sums), devices, match="the error for 17 rows")
    rejects(check, answer(_split, _float_total), devices, match="int32 x has dtype float32")
    rejects(
        check,
        lambda x, ds, d: answer(_split, _sums)(x, ds, d)[:2],
        devices,
        match="parts, partials, total",
    )


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python >= 3.12 wraps ArrayImpl.__buffer__")
def test_no_buffer_protocol_withholds_and_gives_back_a_cpu_arrays_buffer():
    """Python 3.11: while lesson 00's tracker runs, NumPy reads a CPU array through _value (recorded),
    and afterwards through its buffer again."""
    from jax._src import array

    x = jnp.arange(3.0)
    with NoBufferProtocol(array.ArrayImpl):
        with pytest.raises(TypeError):
            memoryview(x)
        np.testing.assert_array_equal(np.asarray(x), [0.0, 1.0, 2.0])
    assert memoryview(x).shape == (3,)


@pytest.mark.skipif(sys.version_info < (3, 12), reason="Python 3.11 has no __buffer__ to wrap")
def test_no_buffer_protocol_is_refused_where_buffer_can_be_wrapped():
    with pytest.raises(RuntimeError, match="wrap ArrayImpl.__buffer__ there"):
        NoBufferProtocol(type(jnp.arange(3.0)))

"""Multi-process JAX on localhost (course_tools.launcher running course_lib.distributed's workers): 2 processes
x 4 simulated CPU devices reproduce the
lab's 1 process x 8 devices; a failing worker is named and nothing outlives the launcher; bad arguments fail
before anything starts.

Tolerances: the cross-process all-reduce (gloo) may add in another order than the in-process one, so values
agree to float32 rounding, not bit for bit (notebooks/08_lab.ipynb, section 3): losses within 1e-5 relative,
final parameters within 1e-5 absolute (measured: ~1e-7), over 3 SGD steps of the tiny profile.
"""

import os
import re
import signal
import sys
import time

import jax
import numpy as np
import pytest
from flax import traverse_util

from course_lib import distributed
from course_lib.config import PROFILES
from course_lib.lab import run_strategy
from course_tools import launcher, launcher_cli

STEPS = 3
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return distributed.prepare_inputs(tmp_path_factory.mktemp("inputs"), "tiny", STEPS, seed=0)


@pytest.fixture(scope="module")
def two_by_four(inputs, tmp_path_factory):
    return launcher.launch(
        2, 4, inputs=inputs, steps=STEPS, timeout_s=240, out_dir=tmp_path_factory.mktemp("run")
    )


def _no_survivors(pids):
    """No worker, and no process in a worker's process group, is alive (zombies count as dead)."""
    return launcher.survivors(pids) == []


def test_survivors_sees_a_live_process_group_and_not_a_dead_one():
    import subprocess
    import sys

    p = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True
    )
    try:
        assert launcher.survivors([p.pid]) == [p.pid]
    finally:
        p.kill()
        p.wait()
    assert launcher.survivors([p.pid]) == []


@pytest.mark.parametrize("key", distributed.MULTIHOST_STRATEGIES)
def test_two_processes_match_one_process_eight_devices(report, two_by_four, key):
    ref = run_strategy(
        key, report.devices, PROFILES["tiny"], steps=STEPS, progress=False
    )  # 1 process x 8
    got = two_by_four.losses[key]
    np.testing.assert_allclose(got, ref.losses, rtol=LOSS_RTOL)
    assert got[-1] < got[0]  # it trains
    flat = traverse_util.flatten_dict(ref.params, sep="/")
    assert set(flat) == set(two_by_four.params[key])
    for name, want in flat.items():
        np.testing.assert_allclose(
            two_by_four.params[key][name], want, atol=PARAM_ATOL, rtol=0, err_msg=name
        )


def test_the_group_is_one_global_mesh(two_by_four):
    outs = two_by_four.outputs
    assert [o["process_id"] for o in outs] == [0, 1] and all(o["process_count"] == 2 for o in outs)
    assert all(len(o["local_devices"]) == 4 for o in outs)
    assert (
        outs[0]["global_devices"] == outs[1]["global_devices"]
        and len(outs[0]["global_devices"]) == 8
    )
    assert [d.split("@")[1] for d in outs[0]["global_devices"]] == ["0"] * 4 + [
        "1"
    ] * 4  # process-major
    for key in distributed.MULTIHOST_STRATEGIES:
        # each process fed its own half of the batch, and both read the same replicated loss
        assert [o["strategies"][key]["rows"] for o in outs] == [[0, 16], [16, 32]]
        assert outs[0]["strategies"][key]["losses"] == outs[1]["strategies"][key]["losses"]
    assert outs[0]["strategies"]["shard_map"]["mesh"] == "data=4 x model=2"
    assert (
        "params_summary" in outs[0] and "params_summary" not in outs[1]
    )  # saved from process 0 only
    assert _no_survivors(set(two_by_four.pids))


def test_every_worker_builds_the_hybrid_mesh_and_restores_the_groups_checkpoint(two_by_four):
    """data across the 2 processes, model inside each; a checkpoint written by both processes (one folder
    each), restored onto another layout with every local shard exact (course_lib.group_checkpoint)."""
    outs = two_by_four.outputs
    grid = outs[0]["hybrid_mesh"]
    assert [[d.split("@")[1] for d in row] for row in grid] == [["0"] * 4, ["1"] * 4]
    assert outs[1]["hybrid_mesh"] == grid
    for o in outs:
        c = o["checkpoint"]
        assert c["max_abs_error"] == 0 and c["shards_checked"] == 12  # w, b, step on 4 devices
        assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(c["written"])
        assert c["restored"]["w"] == str(jax.P("model", "data"))


def test_failing_worker_is_named_and_nothing_is_left(inputs, tmp_path, capsys):
    with pytest.raises(launcher.WorkerFailed) as info:
        launcher.launch(
            2,
            4,
            inputs=inputs,
            steps=STEPS,
            fail_process=1,
            fail_stage="train",
            timeout_s=120,
            out_dir=tmp_path,
            progress=True,
        )
    assert re.search(
        r"^process 1 of 2 exited \(exit status 1\) after \d+\.\d s$", capsys.readouterr().out, re.M
    )
    err = info.value
    assert err.process_id == 1 and err.returncode == 1
    assert "process 1 of 2 failed" in str(err) and "failing on purpose" in str(
        err
    )  # its last lines are quoted
    assert len(err.pids) == 2 and _no_survivors(
        set(err.pids)
    )  # process 0, blocked on its peer, was killed too


def test_timeout_stops_every_worker(inputs, tmp_path):
    with pytest.raises(
        launcher.WorkerTimeout, match=r"timeout_s=0.5 s; processes \[0, 1\]"
    ) as info:
        launcher.launch(2, 4, inputs=inputs, steps=STEPS, timeout_s=0.5, out_dir=tmp_path)
    assert _no_survivors(set(info.value.pids))


def test_bad_arguments_fail_before_anything_starts(inputs):
    with pytest.raises(ValueError, match="n_processes=0 must be a positive integer"):
        launcher.launch(0, 4, inputs=inputs)
    with pytest.raises(ValueError, match="local_devices=0 must be a positive integer"):
        launcher.launch(2, 0, inputs=inputs)
    with pytest.raises(ValueError, match="global batch 32 is not divisible by 12 data shards"):
        launcher.launch(
            3, 4, inputs=inputs
        )  # 12 devices: the tiny profile's batch of 32 does not split
    with pytest.raises(
        ValueError, match="fail_process=2 must be None or a process id in \\[0, 2\\)"
    ):
        launcher.launch(2, 4, inputs=inputs, fail_process=2)
    with pytest.raises(ValueError, match="hold 3 steps"):
        launcher.launch(2, 4, inputs=inputs, steps=5)


def test_worker_env_strips_device_settings():
    env = launcher.worker_env(
        {
            "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
            "JAX_NUM_CPU_DEVICES": "8",
            "JAX_PLATFORMS": "gpu",
            "PATH": "/bin",
        }
    )
    assert "XLA_FLAGS" not in env and "JAX_NUM_CPU_DEVICES" not in env
    assert env["JAX_PLATFORMS"] == "cpu" and env["PATH"] == "/bin"


def test_a_used_output_folder_is_kept(inputs, tmp_path):
    (tmp_path / "process_0.log").write_text("an earlier launch")
    with pytest.raises(launcher.WorkerTimeout) as info:
        launcher.launch(2, 4, inputs=inputs, steps=STEPS, timeout_s=0.5, out_dir=tmp_path)
    assert (tmp_path / "process_0.log").read_text() == "an earlier launch"
    assert _no_survivors(set(info.value.pids))


# --- Ctrl-C, a worker killed by the system, output folders, the environment -----------------------------


def _launch_job(tmp_path):
    import faults

    cmd = [sys.executable, "-m", "course_tools.launcher", "launch", "-P", "2", "-D", "2"]
    job = faults.Job(cmd + ["--out", str(tmp_path / "run")])
    job.wait_for(lambda: sum(" worker " in c for _, c in faults.leftovers(job.tag, 0)) == 2)
    return job


def test_ctrl_c_stops_every_worker_with_one_message(tmp_path):
    import faults

    job = _launch_job(tmp_path)
    job.signal(signal.SIGINT)
    rc, out, err, took = job.finish()
    assert rc == 130 and took < 15, (rc, took, err)
    assert err.strip() == (
        f"interrupted: all 2 worker(s) stopped, none is left; their logs are in {tmp_path / 'run'}"
    ), err
    assert faults.leftovers(job.tag) == []


@pytest.fixture
def ctrl_c_raises():
    """Ctrl-C raises KeyboardInterrupt in this test, whatever handler the test runner's process has."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_ctrl_c_as_a_worker_starts_still_stops_that_worker(
    inputs, tmp_path, monkeypatch, ctrl_c_raises
):
    # Ctrl-C landing between the last worker's exec and its entry in the launcher's list: the signal is
    # held for those few lines, so the cleanup it starts stops that worker too
    real_popen, started = launcher.subprocess.Popen, []

    def popen_then_ctrl_c(cmd, *args, **kwargs):
        proc = real_popen(cmd, *args, **kwargs)
        if "--process-id" not in cmd:
            return proc  # another command (git, for the run's record)
        started.append(proc.pid)
        if len(started) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return proc

    monkeypatch.setattr(launcher.subprocess, "Popen", popen_then_ctrl_c)
    with pytest.raises(
        launcher.LaunchInterrupted, match=r"interrupted: all 2 worker\(s\) stopped"
    ) as e:
        launcher.launch(2, 2, inputs=inputs, steps=STEPS, out_dir=tmp_path / "run")
    assert sorted(e.value.pids) == sorted(started) and _no_survivors(started)


def test_a_signal_held_by_deferring_signals_arrives_when_the_block_ends(ctrl_c_raises):
    from course_tools.processes import deferring_signals

    reached = []
    with pytest.raises(KeyboardInterrupt):
        with deferring_signals():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            reached.append("end of block")
    assert reached == ["end of block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_worker_killed_by_the_system_is_named_with_its_signal(tmp_path):
    import faults

    job = _launch_job(tmp_path)
    job.t_signal = time.monotonic()
    for pid, cmd in faults.leftovers(job.tag, 0):
        if "--process-id 1" in cmd:
            os.kill(pid, signal.SIGKILL)
    rc, out, err, took = job.finish()
    assert rc == 2 and took < 15, (rc, took, err)
    assert (
        "process 1 of 2 failed (killed by SIGKILL: the operating system does this when memory"
        in err
    )
    assert "Traceback" not in err and faults.leftovers(job.tag) == []


def test_an_output_folder_that_cannot_be_written_is_refused_before_anything(inputs, tmp_path):
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(ValueError, match=r"output folder .*afile is a file, not a folder"):
        launcher.launch(2, 4, inputs=inputs, out_dir=tmp_path / "afile" / "run")
    with pytest.raises(
        ValueError, match=r"cannot write the output folder .*afile/sub \(Not a directory"
    ):
        launcher.launch(2, 4, inputs=inputs, out_dir=tmp_path / "afile" / "sub" / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_each_launch_claims_its_own_output_folder(tmp_path):
    first = launcher._output_folder(tmp_path / "run")
    second = launcher._output_folder(tmp_path / "run")  # the first is claimed, though still empty
    assert (first.name, second.name) == ("run", "run-2")
    assert all((p / "run.json").exists() for p in (first, second))


def test_without_an_output_folder_a_launch_writes_a_new_one_in_the_build_folder(
    tmp_path, monkeypatch
):
    # not a temporary folder left behind in /tmp on every launch: the build folder, named and kept
    monkeypatch.setenv("COURSE_BUILD_DIR", str(tmp_path))
    first, second = launcher._output_folder(None), launcher._output_folder(None)
    assert (first, second) == (tmp_path / "multihost", tmp_path / "multihost-2")


def test_a_jax_option_that_changes_the_numbers_stops_the_launch(inputs, tmp_path):
    import jax

    from course_lib.devices import DeviceSetupError

    jax.config.update("jax_debug_key_reuse", True)
    try:
        with pytest.raises(DeviceSetupError, match=r"jax_debug_key_reuse=True \(set in code\)"):
            launcher.launch(2, 4, inputs=inputs, out_dir=tmp_path / "run")
    finally:
        jax.config.update("jax_debug_key_reuse", False)
    assert not (tmp_path / "run").exists()


def test_the_command_says_what_it_starts_and_when_each_process_ends(tmp_path, capsys):
    # a launch runs for up to timeout_s: the command says at once what it started and where the logs go,
    # then a line as each process exits; a used --out folder is kept, and the command says where it wrote
    used = tmp_path / "run"
    used.mkdir()
    (used / "process_0.log").write_text("an earlier launch")
    assert (
        launcher_cli.main(["launch", "-P", "2", "-D", "2", "--check-only", "--out", str(used)]) == 0
    )
    out, err = capsys.readouterr()
    new = tmp_path / "run-2"
    lines = out.splitlines()
    assert lines[:2] == [
        f"the output folder {used} already holds files (process_0.log); nothing there is overwritten: "
        f"this run writes to {new} instead",
        f"starting 2 process(es) x 2 simulated CPU devices (4 in all, check only); timeout 240 s; "
        f"logs in {new}/process_<i>.log",
    ], out
    ended = [
        line for line in lines if re.fullmatch(r"process [01] of 2 exited .* after \d+\.\d s", line)
    ]
    assert sorted(ended)[0].startswith("process 0 of 2 exited (exit status 0)"), out
    assert sorted(ended)[1].startswith("process 1 of 2 exited (exit status 0)"), out
    assert lines.index(ended[-1]) < lines.index(
        next(x for x in lines if x.startswith("process 0: local"))
    )
    assert (used / "process_0.log").read_text() == "an earlier launch" and err == ""


def test_the_losses_printed_say_what_they_are(capsys, tmp_path):
    run = launcher.MultiProcessRun(
        n_processes=2,
        local_devices=4,
        losses={"shard_map": [2.4, 2.3]},
        outputs=({"process_id": 0, "local_devices": ["cpu:0"]},),
        params={},
        wall_s=1.0,
        pids=(),
        out_dir=str(tmp_path),
    )
    launcher_cli._print_run(run, check_only=False)
    assert "shard_map: loss before each of its 2 updates (process 0): [2.4, 2.3]" in (
        capsys.readouterr().out
    )


def test_every_launcher_option_has_help_and_the_notebook_default(capsys):
    """`launch --help` explains every option, and its defaults are lesson 09's parameters (one rule)."""
    import inspect

    from course_lib.config import MULTIHOST_PARAMS

    with pytest.raises(SystemExit) as e:
        launcher_cli.main(["launch", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--n-processes",
        "--local-devices",
        "--steps",
        "--timeout-s",
        "--check-only",
        "--out",
    ):
        line = text[text.index(flag) :].split("\n  -")[0]
        assert len(line.split()) > 3, f"{flag} has no help text: {line!r}"
    for name in ("n_processes", "steps", "timeout_s"):
        default = MULTIHOST_PARAMS[name].default
        assert f"(default: {default})" in text, (name, default)
    assert (
        inspect.signature(launcher.launch).parameters["timeout_s"].default
        == MULTIHOST_PARAMS["timeout_s"].default
    )

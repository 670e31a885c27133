"""tools/gpu_check.sh on a machine without GPUs: its help, argument errors, the "no GPU found" stop before
anything is installed, the refusal to overwrite a results folder, and the plan of a dry run.

A fake ``nvidia-smi`` (named by ``GPU_CHECK_NVIDIA_SMI``) plays a GPU host's driver; a fake python records
whether the script got as far as using the course environment (it must not, in any of these cases).
"""

import datetime
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import disks
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
H100_CSV = "{i}, NVIDIA H100 80GB HBM3, 81559 MiB, 575.57.08, 00000000:{i}9:00.0"


def run(*args, env=None, timeout=60, cwd=None):
    full = {**os.environ, **(env or {})}
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=timeout,
        cwd=cwd,
    )


def fake_nvidia_smi(tmp_path, n_gpus=2, fail=None):
    lines = "\n".join(H100_CSV.format(i=i) for i in range(n_gpus))
    body = f'echo "{fail}" >&2; exit 9' if fail else f"cat <<'EOF'\n{lines}\nEOF"
    path = tmp_path / "nvidia-smi"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return {"GPU_CHECK_NVIDIA_SMI": str(path)}


@pytest.fixture
def fake_python(tmp_path):
    """A python that leaves a mark when called: the script must stop before it uses the environment."""
    mark = tmp_path / "python-was-called"
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\ntouch {mark}\nexit 1\n")
    path.chmod(0o755)
    return path, mark


def test_the_script_is_valid_bash_and_executable():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    assert os.access(SCRIPT, os.X_OK)
    assert "set -euo pipefail" in SCRIPT.read_text()


def test_help_says_what_it_does():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    for word in (
        "Usage:",
        "--out",
        "--skip-install",
        "--timeout",
        "no GPU found",
        "data/gpu_reference",
    ):
        assert word in r.stdout, word


@pytest.mark.parametrize(
    "args, message",
    [
        (["--frobnicate"], "unknown argument '--frobnicate'; see tools/gpu_check.sh --help"),
        (["--timeout", "soon"], "--timeout 'soon' is not a whole number of seconds"),
        (["--timeout", "0"], "--timeout '0' is not a whole number of seconds"),
        (["--out"], "--out needs a value"),
        (["--out", "--skip-install"], "--out needs a value"),
        (["--lab-param", "steps"], "--lab-param 'steps' is not NAME=VALUE"),
        (["--wheelhouse", "/no/such/folder"], "--wheelhouse '/no/such/folder' is not a folder"),
        (["--rehearse"], "--rehearse needs --out DIR"),
    ],
)
def test_bad_arguments_exit_2_with_one_clear_message(args, message):
    r = run(*args, timeout=10)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1


def test_no_nvidia_smi_means_no_gpu_found_before_anything_is_installed(tmp_path, fake_python):
    py, mark = fake_python
    env = {"GPU_CHECK_NVIDIA_SMI": str(tmp_path / "no-such-nvidia-smi")}
    r = run("--python", str(py), "--out", str(tmp_path / "out"), env=env, timeout=10)
    assert r.returncode == 3, r.stderr
    assert "no GPU found" in r.stderr and "no-such-nvidia-smi" in r.stderr
    assert "Nothing was installed" in r.stderr
    assert not mark.exists() and not (tmp_path / "out").exists()


@pytest.mark.skipif(
    shutil.which("nvidia-smi", path="/usr/bin:/bin") is not None, reason="nvidia-smi in /usr/bin"
)
def test_a_path_without_nvidia_smi_means_no_gpu_found(tmp_path, fake_python):
    py, mark = fake_python
    env = {"PATH": "/usr/bin:/bin", "GPU_CHECK_NVIDIA_SMI": "nvidia-smi"}
    r = run("--python", str(py), env=env, timeout=10)
    assert r.returncode == 3 and "no GPU found: looked for 'nvidia-smi'" in r.stderr, r.stderr
    assert not mark.exists()


def test_a_driver_that_fails_means_no_gpu_found(tmp_path, fake_python):
    py, mark = fake_python
    said = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    env = fake_nvidia_smi(tmp_path, fail=said)
    r = run("--python", str(py), env=env, timeout=10)
    assert r.returncode == 3 and "no GPU found" in r.stderr and said in r.stderr, r.stderr
    assert not mark.exists()


def test_no_gpu_listed_and_hidden_gpus_mean_no_gpu_found(tmp_path, fake_python):
    py, mark = fake_python
    r = run("--python", str(py), env=fake_nvidia_smi(tmp_path, n_gpus=0), timeout=10)
    assert r.returncode == 3 and "lists none" in r.stderr, r.stderr
    env = {**fake_nvidia_smi(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    r = run("--python", str(py), env=env, timeout=10)
    assert r.returncode == 3 and "CUDA_VISIBLE_DEVICES" in r.stderr, r.stderr
    assert not mark.exists()


def test_an_existing_results_folder_is_never_overwritten(tmp_path, fake_python):
    py, mark = fake_python
    out = tmp_path / "earlier-run"
    out.mkdir()
    (out / "summary.txt").write_text("an earlier GPU reference run\n")
    r = run("--python", str(py), "--out", str(out), env=fake_nvidia_smi(tmp_path), timeout=10)
    assert r.returncode == 4, r.stderr
    assert f"refusing to overwrite '{out}'" in r.stderr and "--out" in r.stderr
    assert [p.name for p in out.iterdir()] == ["summary.txt"] and not mark.exists()


def test_dry_run_plans_the_pinned_cuda_build_and_a_new_dated_folder(tmp_path, fake_python):
    py, mark = fake_python
    env = {
        **fake_nvidia_smi(tmp_path),
        **disks.fake_df(tmp_path, 10_000),
    }  # room for the CUDA wheels
    r = run("--dry-run", "--python", str(py), env=env, timeout=10)
    assert r.returncode == 0, r.stderr
    pin = re.search(r"^jax==(\S+)", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    assert f"jax[cuda12]=={pin}" in r.stdout and f"jaxlib=={pin}" in r.stdout
    today = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    folder = ROOT / "data" / "gpu_reference" / f"{today}-h100-80gb-hbm3-x2"
    assert f"results folder   : {folder} (new)" in r.stdout
    assert "2 x NVIDIA H100 80GB HBM3" in r.stdout and "on 2 1 GPU(s)" in r.stdout
    stems = ("10_transformers", "11_pipeline_experts", "12_transformer_lab")
    planned = next(line for line in r.stdout.splitlines() if line.startswith("transformer runs"))
    assert all(f"notebooks/{s}.ipynb" in planned for s in stems) and planned.endswith("on 2 GPU(s)")
    assert all((ROOT / "notebooks" / f"{s}.ipynb").exists() for s in stems)
    assert not folder.exists() and not mark.exists()


def test_jax_without_a_gpu_backend_stops_before_writing(tmp_path):
    # A GPU host whose environment has the CPU build of JAX (this one's), and --skip-install.
    out = tmp_path / "out"
    env = {**fake_nvidia_smi(tmp_path), "JAX_PLATFORMS": "cpu"}
    r = run("--skip-install", "--python", sys.executable, "--out", str(out), env=env, timeout=120)
    assert r.returncode == 5, (r.stdout, r.stderr)
    assert "JAX sees no GPU: its backend is 'cpu'" in r.stderr and "drop --skip-install" in r.stderr
    assert not out.exists()


def test_a_rehearsal_plans_simulated_devices_and_no_install(tmp_path, fake_python):
    # --rehearse runs every step after the install on simulated CPU devices (minutes: run by hand, not here).
    py, mark = fake_python
    out = tmp_path / "rehearsal"
    r = run("--rehearse", "--dry-run", "--python", str(py), "--out", str(out), timeout=10)
    assert r.returncode == 0, r.stderr
    assert "install          : skipped" in r.stdout and "profile tiny" in r.stdout
    assert not out.exists() and not mark.exists()


def test_a_relative_out_folder_is_where_the_command_was_typed(tmp_path, fake_python):
    py, _ = fake_python
    r = run("--dry-run", "--python", str(py), "--out", "run1", env=fake_nvidia_smi(tmp_path),
            cwd=tmp_path, timeout=10)  # fmt: skip
    assert r.returncode == 0 and f"results folder   : {tmp_path}/run1 (new)" in r.stdout, r.stderr


def test_a_second_check_on_the_same_day_gets_a_new_folder(tmp_path, fake_python):
    py, mark = fake_python
    today = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    first = tmp_path / "results" / f"{today}-h100-80gb-hbm3-x2"
    first.mkdir(parents=True)
    (first / "summary.txt").write_text("the morning's check\n")
    env = {**fake_nvidia_smi(tmp_path), "GPU_CHECK_RESULTS_ROOT": str(tmp_path / "results")}
    r = run("--dry-run", "--skip-install", "--python", str(py), env=env, timeout=10)
    assert r.returncode == 0, r.stderr
    assert f"results folder   : {first}-2 (new)" in r.stdout
    (tmp_path / "results" / f"{first.name}-2").mkdir()
    r = run("--dry-run", "--skip-install", "--python", str(py), env=env, timeout=10)
    assert f"results folder   : {first}-3 (new)" in r.stdout, r.stdout
    assert (first / "summary.txt").read_text() == "the morning's check\n" and not mark.exists()


def test_a_results_folder_that_cannot_be_written_stops_before_the_install(tmp_path, fake_python):
    py, mark = fake_python
    with disks.read_only(tmp_path / "ro") as ro:
        r = run(
            "--python", str(py), "--out", str(ro / "gpu"), env=fake_nvidia_smi(tmp_path), timeout=10
        )
    assert r.returncode == 4, (r.stdout, r.stderr)
    assert f"cannot write the results folder '{ro}/gpu'" in r.stderr and "--out" in r.stderr
    assert "Nothing was installed" in r.stderr and not mark.exists()


@pytest.mark.parametrize(
    "free_mb, skip_install, message",
    [
        (20, True, "only 20 MB free for the results folder"),
        (1000, False, "only 1000 MB free for the course environment (for the CUDA build of JAX)"),
    ],
    ids=["results", "install"],
)
def test_too_little_room_stops_before_the_install(
    tmp_path, fake_python, free_mb, skip_install, message
):
    py, mark = fake_python
    env = {**fake_nvidia_smi(tmp_path), **disks.fake_df(tmp_path, free_mb)}
    args = ["--skip-install"] if skip_install else []
    r = run(*args, "--python", str(py), "--out", str(tmp_path / "out"), env=env, timeout=10)
    assert r.returncode == 4 and message in r.stderr, (r.stdout, r.stderr)
    assert "Nothing was installed" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists() and not mark.exists()

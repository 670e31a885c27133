"""The two environments (README, "Two environments"): tools/check_python.py picks the requirements file for
the Python that builds a venv and finds a working Python 3.11; the two requirements files pin the same
packages, and pyproject admits both JAX versions."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_python", ROOT / "tools" / "check_python.py")
check_python = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_python)


def pins(name: str) -> dict[str, str]:
    text = (ROOT / name).read_text()
    return dict(re.findall(r"^([A-Za-z0-9_.\[\]-]+)==(\S+)", text, re.MULTILINE))


def test_each_python_gets_its_requirements_file():
    assert check_python.requirements_file((3, 13)) == "requirements.txt"
    assert check_python.requirements_file((3, 12)) == "requirements.txt"
    assert check_python.requirements_file((3, 11)) == "requirements-py311.txt"
    assert check_python.requirements_file((3, 10)) is None


def test_the_two_requirements_files_pin_the_same_packages():
    default, second = pins("requirements.txt"), pins("requirements-py311.txt")
    assert list(default) == list(second)  # the same names, in the same order
    assert default["jax"] == default["jaxlib"] and default["jax"].startswith("0.12.")
    assert second["jax"] == second["jaxlib"] == "0.10.2"  # the TPU image's JAX
    assert second["flax"] == "0.12.8" and second["optax"] == default["optax"]
    differ = {name for name in default if default[name] != second[name]}
    assert differ == {"jax", "jaxlib", "flax", "numpy", "sphinx"}, (
        differ
    )  # each says why on its line
    text = (ROOT / "requirements-py311.txt").read_text()
    assert all(re.search(rf"^{n}==\S+  # .*3\.12", text, re.M) for n in differ - {"jax", "jaxlib"})


def test_pyproject_admits_both_environments():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'requires-python = ">=3.11"' in text and '"jax>=0.10.2,<0.13"' in text
    assert 'target-version = "py311"' in text  # ruff flags syntax Python 3.11 cannot parse


def test_the_requirements_option_names_the_file_for_this_python():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "check_python.py"), "--requirements"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and out.stdout.strip() == check_python.requirements_file(), out


def _script(path: Path, body: str) -> str:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_finding_python_311_runs_each_candidate(tmp_path, monkeypatch):
    shim = _script(tmp_path / "shim", "echo 'pyenv: python3.11: command not found' >&2; exit 127")
    other = _script(tmp_path / "other", "echo False; echo /usr/bin/python3.12")
    for fake in (shim, other):  # a failing pyenv shim, another Python: neither counts
        assert check_python._python_311(fake) is None
    assert check_python._python_311(str(tmp_path / "missing")) is None
    real = check_python.find_python_311()
    if real is None:
        pytest.skip("no Python 3.11 on this machine")
    monkeypatch.setenv("PYTHON311", shim)  # a bad $PYTHON311 falls through to the others
    assert check_python.find_python_311() == real
    assert check_python._python_311(real) == real


def test_an_older_python_is_refused_with_the_fix():
    old = [
        f"{os.path.expanduser('~/.pyenv/versions')}/{v}/bin/python3" for v in ("3.10.13", "3.9.18")
    ]
    old = [p for p in old if os.path.exists(p)]
    if not old:
        pytest.skip("no Python older than 3.11 here")
    out = subprocess.run(
        [old[0], str(ROOT / "tools" / "check_python.py")], capture_output=True, text=True
    )
    assert out.returncode == 1 and "needs Python >= 3.12 (or 3.11" in out.stderr
    assert "make PYTHON=python3.12" in out.stderr

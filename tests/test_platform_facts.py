"""tools/platform_facts.py: on XLA:CPU it prints what lessons 01, 02 and 07 assert there."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_platform_facts_on_cpu():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "platform_facts.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    ).stdout
    lines = {line[:36].strip(): line[36:].strip() for line in out.splitlines()}
    assert lines["backend, devices"].startswith("cpu")
    assert lines["float32_rtol / matmul precision"] == "1.00e-05 / default"
    assert lines["exp(100) | naive grad | stable grad"] == "inf | nan | 1.0"
    assert lines["check_grads float64"].startswith("passes")
    assert lines["check_grads float32"].startswith("passes")
    assert lines["entry kernels of a scaled norm"] == "{'fusion': 1}"
    assert lines["donation (840, 840)"] == "alias 2,822,400 argument 2,822,400 nbytes 2,822,400"
    assert "python" in lines["threads with PjitFunction events"]  # the main thread's name

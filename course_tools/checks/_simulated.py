"""Measurements on simulated CPU devices in a fresh Python process: what a checker runs when the notebook's
devices are too few for a mistake to show (one device, or a mesh axis of size 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_json(code: str, n_devices: int, timeout_s: float = 120, path: Sequence[str] = ()) -> Any:
    """Run ``code`` in a fresh Python with ``n_devices`` simulated CPU devices (this checkout first on the
    path, then the folders ``path``) and return the JSON value its last printed line holds."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env |= {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(n_devices)}
    env["PYTHONPATH"] = os.pathsep.join([_ROOT, *path, *filter(None, [env.get("PYTHONPATH")])])
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout_s
    )
    if run.returncode:
        raise RuntimeError(
            f"a measurement on {n_devices} simulated devices failed:\n{run.stderr[-2000:]}"
        )
    return json.loads(run.stdout.strip().splitlines()[-1])

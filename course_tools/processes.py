"""Operating-system plumbing of a local multi-process run: ports, environments, process groups, logs.

Used by :mod:`course_tools.launcher`; nothing here is JAX.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
"""The repository: the workers run from here, with it on ``PYTHONPATH``."""

# Environment variables that would change a worker's device count or backend behind its back.
_STRIP_ENV = (
    "XLA_FLAGS",
    "JAX_NUM_CPU_DEVICES",
    "JAX_PLATFORMS",
    "JAX_PLATFORM_NAME",
    "CUDA_VISIBLE_DEVICES",
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "COURSE_MULTIHOST_FAIL",
)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (bind to port 0, read the port the OS chose, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def worker_env(base: dict | None = None) -> dict:
    """The environment for a CPU worker: ``base`` (default ``os.environ``) without the variables that fix a
    device count or backend (``XLA_FLAGS``, ``JAX_NUM_CPU_DEVICES``, ``JAX_PLATFORMS``, …), plus
    ``JAX_PLATFORMS=cpu`` and this repository on ``PYTHONPATH``."""
    env = dict(os.environ if base is None else base)
    for name in _STRIP_ENV:
        env.pop(name, None)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def survivors(pids: Sequence[int]) -> list[int]:
    """Processes still alive (zombies excluded) among ``pids`` or in the process groups they lead.

    Uses ``psutil`` when installed, else ``/proc``, else ``os.kill(pid, 0)`` on the pids alone.

    Returns:
      The live pids, sorted; ``[]`` means nothing a launch started is left.
    """
    pids = {int(p) for p in pids}
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        found = set()
        for proc in psutil.process_iter(["pid", "status"]):
            try:
                if proc.info["status"] != psutil.STATUS_ZOMBIE and (
                    proc.pid in pids or os.getpgid(proc.pid) in pids
                ):
                    found.add(proc.pid)
            except (psutil.Error, OSError):
                continue
        return sorted(found)
    if os.path.isdir("/proc"):
        return sorted(_proc_survivors(pids))
    return sorted(_signal_survivors(pids))  # pragma: no cover - neither psutil nor /proc


def _proc_survivors(pids: set[int]) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, ... after "pid (comm) "
        if fields[0] != "Z" and (int(entry) in pids or int(fields[2]) in pids):
            found.add(int(entry))
    return found


def _signal_survivors(pids: set[int]) -> set[int]:  # pragma: no cover - neither psutil nor /proc
    found = set()
    for pid in pids:
        try:
            os.kill(pid, 0)
            found.add(pid)
        except ProcessLookupError:
            pass
        except PermissionError:
            found.add(pid)
    return found


def tail(path: str | Path, n_lines: int = 15) -> str:
    """The last ``n_lines`` lines of a text file ('' when it does not exist)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip("\n").splitlines()[-n_lines:])


def stop(procs: list[subprocess.Popen], grace_s: float = 3.0) -> None:
    """Terminate each worker's process group (SIGTERM, then SIGKILL) and reap every worker."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _killpg(p, signal.SIGTERM)
    deadline = time.perf_counter() + grace_s
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        # SIGKILL the whole group even when the leader has exited: a child it started may still be there.
        _killpg(p, signal.SIGKILL)
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process in uninterruptible sleep
            pass


def _killpg(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # start_new_session=True: the group id is the worker's pid
    except (ProcessLookupError, PermissionError):
        pass

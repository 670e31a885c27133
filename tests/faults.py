"""Helpers for the fault tests: small notebooks that need no JAX, a course command run as a terminal job
(its own process group), signals sent at a chosen moment, and the processes a run leaves behind.

A run is tagged with a unique environment variable; its kernel and everything the kernel starts inherit
it, so ``leftovers(tag)`` finds exactly this run's processes (never anyone else's) in ``/proc``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import nbformat

PARAMETERS = "n_devices = 8\nplatform = 'auto'"
SLOW = "import pathlib, time\npathlib.Path({flag!r}).touch()\nfor _ in range(600):\n    time.sleep(0.1)"
"""A cell that says it started (it creates ``flag``) and then runs for a minute."""


def make_notebook(path: Path, *cells: str, parameters: str = PARAMETERS) -> Path:
    """A notebook with a ``parameters`` cell and ``cells``, kernel ``python3``."""
    nb = nbformat.v4.new_notebook()
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(parameters)] + [
        nbformat.v4.new_code_cell(c) for c in cells
    ]
    nb.cells[0].metadata["tags"] = ["parameters"]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def command_driver(tmp: Path, module: str = "course_tools.run") -> list[str]:
    """``python driver.py NOTEBOOKS ARGS…``: the real command line of ``module`` (its ``command``, what
    ``python -m`` runs), on another notebook folder."""
    driver = tmp / "driver.py"
    driver.write_text(
        textwrap.dedent(f"""
        import sys
        from pathlib import Path
        import {module} as m
        m.NOTEBOOKS = Path(sys.argv[1])
        m.command(sys.argv[2:])
        """)
    )
    return [sys.executable, str(driver)]


class Job:
    """A command started as a terminal starts a job: its own process group, a tag in its environment."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        self.tag = uuid.uuid4().hex
        full_env = {**os.environ, "COURSE_FAULT_TAG": self.tag, **(env or {})}
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full_env,
            start_new_session=True,
        )
        self.t_signal = None

    def wait_for(self, condition, timeout: float = 120.0) -> None:
        """Poll ``condition()`` until true; fail if the job ended first or time ran out."""
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                out, err = self.proc.communicate()
                raise AssertionError(
                    f"the job ended first (rc {self.proc.returncode}):\n{err.decode()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError("timed out waiting for the moment to signal")
            time.sleep(0.05)

    def signal(self, sig: int, again_after: float | None = None) -> None:
        """Send ``sig`` to the whole group (Ctrl-C in a terminal is SIGINT to the foreground group)."""
        self.t_signal = time.monotonic()
        os.killpg(self.proc.pid, sig)
        if again_after is not None:
            time.sleep(again_after)
            os.killpg(self.proc.pid, sig)

    def finish(self, timeout: float = 60.0) -> tuple[int, str, str, float]:
        """``(exit code, stdout, stderr, seconds from the signal to the exit)``."""
        out, err = self.proc.communicate(timeout=timeout)
        took = time.monotonic() - self.t_signal if self.t_signal else float("nan")
        return self.proc.returncode, out.decode(), err.decode(), took

    def kernels(self) -> list[int]:
        return [pid for pid, cmd in leftovers(self.tag) if "ipykernel" in cmd]


def leftovers(tag: str, settle_s: float = 3.0) -> list[tuple[int, str]]:
    """Live (not zombie) processes carrying ``tag``, after up to ``settle_s`` for them to go."""
    deadline = time.monotonic() + settle_s
    while True:
        found = _tagged(tag)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _tagged(tag: str) -> list[tuple[int, str]]:
    needle = f"COURSE_FAULT_TAG={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if needle not in Path(f"/proc/{entry}/environ").read_bytes():
                continue
            stat = Path(f"/proc/{entry}/stat").read_text()
            if stat[stat.rindex(")") + 2] == "Z":
                continue
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        found.append((int(entry), cmd))
    return found


def cells(path: Path) -> list[dict]:
    """The code cells of an executed notebook: ``{"count", "status", "errors"}`` each."""
    nb = json.loads(path.read_text())
    return [
        {
            "count": c.get("execution_count"),
            "status": c["metadata"].get("papermill", {}).get("status"),
            "errors": [
                o.get("evalue", "") for o in c.get("outputs", []) if o["output_type"] == "error"
            ],
        }
        for c in nb["cells"]
        if c["cell_type"] == "code"
    ]


def kill_kernel_when_started(job: Job, flag: Path) -> None:
    """SIGKILL the job's kernel once its slow cell runs (what the out-of-memory killer does)."""
    job.wait_for(flag.exists)
    job.t_signal = time.monotonic()
    for pid in job.kernels():
        os.kill(pid, signal.SIGKILL)

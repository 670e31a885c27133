"""Operating-system plumbing of the course's commands: process groups, signals, exit statuses, ports,
environments and logs (output folders: :mod:`course_tools.folders`).

Used by :mod:`course_tools.launcher` (a local multi-process run) and :mod:`course_tools.run` /
:mod:`course_tools.execution` (notebook runs); nothing here is JAX.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from .folders import (  # noqa: F401 - the folder plumbing's old home: imported from here too
    CLAIM_FILE,
    MIN_FREE_MB,
    FolderError,
    check_folder,
    claim_run_dir,
)

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


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (a CI job cancelled, ``timeout``, ``kill``): handled like Ctrl-C, exit status 143."""


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated`, so it gets Ctrl-C's clean path (the kernel or
    the workers stopped, one message) instead of killing the command without a word.

    Python raises a signal's ``KeyboardInterrupt`` in whatever code runs at that moment; when that is a
    garbage-collection callback (JAX installs one) or a ``__del__``, Python prints "Exception ignored in"
    and goes on as if no key was pressed. Within the block such a swallowed interrupt is delivered again
    (:func:`_redeliver_swallowed_interrupts`)."""

    def raise_terminated(signum, frame):
        raise Terminated("stopped by SIGTERM")

    try:
        old = signal.signal(signal.SIGTERM, raise_terminated)
    except ValueError:  # not the main thread
        yield
        return
    previous_hook, timers = sys.unraisablehook, []
    sys.unraisablehook = _redeliver_swallowed_interrupts(previous_hook, timers)
    try:
        yield
    finally:
        try:  # an interrupt swallowed in the block's last moments is raised here, handlers still set
            for timer in list(timers):
                timer.join()
        finally:
            sys.unraisablehook = previous_hook
            signal.signal(signal.SIGTERM, old)


REDELIVER_AFTER_S = 0.05
"""How long a swallowed interrupt waits before it is sent again (the collection that swallowed it ends)."""


def _redeliver_swallowed_interrupts(previous, timers: list):
    """An ``sys.unraisablehook`` that sends a swallowed Ctrl-C (SIGINT) or :class:`Terminated` (SIGTERM)
    to this process again, from a timer thread (kept in ``timers``, which the block waits for), so that it
    is raised in the main thread's next ordinary bytecode; any other unraisable exception goes to
    ``previous``."""

    def hook(unraisable):
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            term = issubclass(unraisable.exc_type, Terminated)
            signum = signal.SIGTERM if term else signal.SIGINT
            timer = threading.Timer(REDELIVER_AFTER_S, os.kill, (os.getpid(), signum))
            timers.append(timer)
            timer.start()
            return
        previous(unraisable)

    return hook


@contextlib.contextmanager
def deferring_signals(signums: Sequence[int] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Within the block Ctrl-C and SIGTERM are held and delivered when it ends: a process started in the
    block is in the caller's list before the signal's handler runs, so the cleanup that handler starts
    stops it too. Outside the main thread the block runs unprotected."""
    got: list[tuple[int, object]] = []
    old = {}
    try:
        for s in signums:
            old[s] = signal.signal(s, lambda n, f: got.append((n, f)))
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if got:
            n, frame = got[0]
            handler = old[n]
            if callable(handler):
                handler(n, frame)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(n)


@contextlib.contextmanager
def ignoring_sigint() -> Iterator[None]:
    """Within the block Ctrl-C is ignored: a second Ctrl-C must not cut short the few seconds of cleanup
    (stopping a kernel or the workers, writing the time table) that the first one started."""
    try:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: nothing to protect
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def describe_exit(code: int | None) -> str:
    """An exit status in words: ``-9`` → "killed by SIGKILL: the operating system does this when memory
    runs out, and so does kill -9"; ``1`` → "exit status 1"."""
    if code is None:
        return "still running"
    if code >= 0:
        return f"exit status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = {
        "SIGKILL": ": the operating system does this when memory runs out, and so does kill -9",
        "SIGSEGV": ": a crash in compiled code",
        "SIGABRT": ": an abort in compiled code, e.g. a failed allocation or an invalid XLA flag",
    }.get(name, "")
    return f"killed by {name}{hint}"


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


def stop(procs: list[subprocess.Popen], grace_s: float = 2.0) -> None:
    """Stop each worker's process group (SIGINT, then SIGKILL after ``grace_s``) and reap every worker.

    SIGINT, not SIGTERM: JAX's preemption notifier catches SIGTERM in a worker and keeps it running, while
    SIGINT reaches the worker's own handler, which exits at once.
    """
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _killpg(p, signal.SIGINT)
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

"""Run a command on a busy machine: N CPU-bound processes beside it, stopped when it ends.

    python tools/cpu_load.py --busy 2 -- .venv/bin/python -m pytest tests/test_run.py
    make test LOAD=2          # the whole suite beside 2 busy processes (what this is for)

Learners' laptops and shared CI runners are busy machines: a timing assert, a timeout or a time limit that
holds only on an idle machine fails there. Each busy process is a pure-Python loop at normal priority (it
competes for a core like any other job; it allocates nothing and writes nothing) that ends on its own when
this script is gone, even after a SIGKILL. When the command ends, the script prints the load average
measured while it ran and the command's time, and exits with the command's exit status (130 on Ctrl-C,
143 on SIGTERM: the command gets the signal too, being in the same process group).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time

MARKER = "course-cpu-load"
"""The last argument of every busy process's command line: ``ps``/``pgrep -f`` find them by it."""
BUSY_LOOP = (
    "import os, sys\n"
    "parent = int(sys.argv[1])\n"
    "while os.getppid() == parent:\n"  # its parent gone (even killed with SIGKILL): it ends too
    "    for _ in range(1_000_000):\n"
    "        pass\n"
)


def start_busy(n: int) -> list[subprocess.Popen]:
    """``n`` busy processes, children of this one."""
    cmd = [sys.executable, "-c", BUSY_LOOP, str(os.getpid()), MARKER]
    return [subprocess.Popen(cmd, stdin=subprocess.DEVNULL) for _ in range(n)]


def stop_busy(procs: list[subprocess.Popen]) -> None:
    """Kill and reap the busy processes."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def load_average() -> float:
    """The 1-minute load average (0.0 where the system does not report one)."""
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover - not on Linux or macOS
        return 0.0


def main(argv: list[str] | None = None) -> int:
    """Parse ``--busy N -- COMMAND...``, run COMMAND beside N busy processes; return its exit status."""
    ap = argparse.ArgumentParser(
        prog="python tools/cpu_load.py",
        description=__doc__.splitlines()[0],
        usage="%(prog)s [--busy N] -- COMMAND [ARG ...]",
    )
    ap.add_argument(
        "--busy",
        type=int,
        default=os.cpu_count() or 1,
        help="busy processes beside the command (default: one per core)",
    )
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to run after --, e.g. -- python -m pytest tests/test_run.py")
    if args.busy < 0:
        ap.error(f"--busy {args.busy}: give 0 or more busy processes")
    cores = os.cpu_count() or 1
    shown = " ".join(shlex.quote(c) for c in command).replace("\n", " ")
    shown = shown if len(shown) <= 100 else shown[:97] + "..."
    print(f"cpu_load: {args.busy} busy process(es) beside `{shown}` on {cores} core(s)", flush=True)
    stop, proc, busy, samples, t0 = {"signal": None}, None, [], [], time.monotonic()

    def forward(signum, frame):
        # Ctrl-C in a terminal reaches the whole process group, the command included; a SIGTERM (a CI job
        # cancelled, `timeout`) may come to this process alone: it is passed on.
        stop["signal"] = signum
        if signum == signal.SIGTERM and proc is not None and proc.poll() is None:
            proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        busy = start_busy(args.busy)  # after the handlers: a signal from now on stops them too
        proc = subprocess.Popen(command)
        if stop["signal"] is not None:  # it came before the command started: pass it on now
            proc.send_signal(stop["signal"])
        while proc.poll() is None:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                samples.append(load_average())
        code = proc.returncode
    except FileNotFoundError as e:
        print(f"cpu_load: cannot run {command[0]!r}: {e.strerror}", file=sys.stderr)
        code = 127
    finally:
        stop_busy(busy)
        for s, h in old.items():
            signal.signal(s, h)
    samples.append(load_average())
    print(
        f"cpu_load: the command took {time.monotonic() - t0:.0f} s beside {args.busy} busy "
        f"process(es); 1-minute load average while it ran {min(samples):.1f} to {max(samples):.1f} "
        f"on {cores} core(s); exit status {code}",
        flush=True,
    )
    if stop["signal"] is not None and code < 0:
        return 128 + stop["signal"]
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())

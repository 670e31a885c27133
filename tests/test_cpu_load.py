"""tools/cpu_load.py: the busy processes run while the command runs and are gone after it, whatever way
it ends; the command's exit status comes back; the load it ran under is printed."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "cpu_load.py"
sys.path.insert(0, str(ROOT / "tools"))
import cpu_load  # noqa: E402

# the command counts the busy processes (by their marker) and how much CPU they got while it slept
COUNT = (
    "import os, sys, time\n"
    "def busy():\n"
    "    found = []\n"
    "    for pid in filter(str.isdigit, os.listdir('/proc')):\n"
    "        try:\n"
    "            cmd = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')\n"
    "            if cmd[-3:-1] == [str(os.getppid()).encode(), sys.argv[1].encode()]:\n"
    "                found.append(int(open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[11]))\n"
    "        except OSError:\n"
    "            pass\n"
    "    return found\n"
    "before = busy(); time.sleep(1.0); after = busy()\n"
    "print('COUNT', len(before), sum(after) - sum(before))\n"
    "sys.exit(int(sys.argv[2]))\n"
)


def _run(*args, timeout=60):
    """``(completed process, its pid)`` of ``cpu_load.py ARGS``."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), proc.pid


def _busy_left(parent: int) -> list[int]:
    """The live busy processes that ``parent`` (a cpu_load.py process) started: the suite itself may run
    beside other busy processes (make test LOAD=2)."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if cmd[-3:-1] == [str(parent).encode(), cpu_load.MARKER.encode()] and state != "Z":
            left.append(int(pid))
    return left


def test_the_busy_processes_run_beside_the_command_and_are_gone_after_it():
    r, pid = _run("--busy", "2", "--", sys.executable, "-c", COUNT, cpu_load.MARKER, "3")
    assert r.returncode == 3, r.stderr  # the command's own exit status
    count, ticks = (int(x) for x in re.search(r"COUNT (\d+) (\d+)", r.stdout).groups())
    assert count == 2 and ticks > 20, r.stdout  # two of them, using the CPU (clock ticks in 1 s)
    assert "beside 2 busy process(es); 1-minute load average while it ran" in r.stdout
    assert _busy_left(pid) == []


def test_zero_busy_processes_and_bad_arguments():
    r, _ = _run("--busy", "0", "--", sys.executable, "-c", COUNT, cpu_load.MARKER, "0")
    assert r.returncode == 0 and "COUNT 0 0" in r.stdout, r.stdout
    r, _ = _run("--busy", "2")
    assert r.returncode == 2 and "give the command to run after --" in r.stderr
    r, pid = _run("--busy", "1", "--", "no-such-command-here")
    assert r.returncode == 127 and "cannot run 'no-such-command-here'" in r.stderr
    assert _busy_left(pid) == []


def test_sigterm_stops_the_command_and_the_busy_processes():
    proc = subprocess.Popen(
        [
            sys.executable,
            str(SCRIPT),
            "--busy",
            "2",
            "--",
            sys.executable,
            "-c",
            "import time; time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while len(_busy_left(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 143 and "exit status -15" in out, out
    assert _busy_left(proc.pid) == []


def test_a_sigterm_before_the_command_starts_still_stops_it(monkeypatch, capsys):
    # SIGTERM landing after the busy processes start and before the command does: the command, started
    # next, gets it at once instead of running its 60 s
    real_start = cpu_load.start_busy

    def start_then_sigterm(n):
        procs = real_start(n)
        os.kill(os.getpid(), signal.SIGTERM)
        return procs

    monkeypatch.setattr(cpu_load, "start_busy", start_then_sigterm)
    old = signal.getsignal(signal.SIGTERM)
    t0 = time.monotonic()
    try:
        code = cpu_load.main(
            ["--busy", "1", "--", sys.executable, "-c", "import time; time.sleep(60)"]
        )
    finally:
        signal.signal(signal.SIGTERM, old)
    assert code == 143 and time.monotonic() - t0 < 20, code
    assert "exit status -15" in capsys.readouterr().out


def test_busy_processes_end_on_their_own_when_the_script_is_killed():
    proc = subprocess.Popen(
        [
            sys.executable,
            str(SCRIPT),
            "--busy",
            "1",
            "--",
            sys.executable,
            "-c",
            "import time; time.sleep(60)",
        ],
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while not _busy_left(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # no cleanup can run: the loop sees its parent gone
    proc.wait()
    deadline = time.monotonic() + 30
    while _busy_left(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _busy_left(proc.pid) == []
    os.killpg(proc.pid, signal.SIGKILL)  # the sleeping command


def test_the_suite_summary_names_its_groups():
    """The closing summary's groups (conftest.group_of): the matrix, nbmake, the checkers' tests, the rest."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "root_conftest", Path(__file__).resolve().parent.parent / "conftest.py"
    )
    root = importlib.util.module_from_spec(spec)
    env = dict(os.environ)
    try:
        spec.loader.exec_module(root)  # it sets the session's variables again: put them back after
    finally:
        os.environ.clear()
        os.environ.update(env)
    assert root.group_of("tests/test_invariance.py::test_notebook_runs[08_lab-n4]") == "matrix"
    assert root.group_of("notebooks/08_lab.ipynb::") == "nbmake"
    assert root.group_of("tests/test_checks_lesson04.py::test_x") == "checkers"
    assert root.group_of("tests/test_costs.py::test_x") == "other"
    lines = root.cpu_table({"a.py": 30.0, "b.py": 10.0}, top=1)
    assert lines[0].startswith("CPU time of the tests: 40 s") and "the other 1 files" in lines[-1]

"""course_tools.execution: one notebook under papermill, kept whole and explained when it cannot finish.

The notebooks here need no JAX: a kernel starts in a second or two, so each case costs seconds.
"""

import errno
import json
import os
import subprocess
import sys

import faults
import pytest

from course_tools import execution
from course_tools.execution import KernelDied, NotebookFailed, RunRefused, execute


def test_a_run_keeps_the_kernel_output_out_of_the_terminal(tmp_path, capfd):
    nb = faults.make_notebook(
        tmp_path / "ok.ipynb", "import os, sys\nprint('fd2', file=sys.__stderr__)"
    )
    out = tmp_path / "out" / "ok.ipynb"
    out.parent.mkdir()
    seconds = execute(nb, out, {"n_devices": 2}, progress=False)
    assert seconds > 0 and [c["status"] for c in faults.cells(out)] == ["completed"] * 3
    err = capfd.readouterr().err
    assert "without encryption" not in err and "fd2" not in err  # the kernel's own output ...
    log = (tmp_path / "out" / "ok.kernel.log").read_text()
    assert "fd2" in log  # ... is in the kernel log beside the notebook
    assert (
        "without encryption" not in log
    )  # its channels are encrypted: ipykernel has nothing to warn of
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "ok.ipynb",
        "ok.kernel.log",
    ]  # no temp files


def test_a_run_whose_kernel_said_nothing_leaves_no_empty_log(tmp_path):
    nb = faults.make_notebook(tmp_path / "quiet.ipynb", "x = 1")
    out = tmp_path / "out" / "quiet.ipynb"
    out.parent.mkdir()
    execute(nb, out, {"n_devices": 2}, progress=False)
    # No empty log. (On a busy machine a kernel's ZMQ teardown can still race with its shutdown, about 1 in
    # 40 runs here, and print an error while exiting: that log, not empty, is kept. jupyter_client's SIGINT
    # at shutdown, the other source of such lines, is no longer sent: see execution._kernel_manager_class.)
    left = [p for p in out.parent.iterdir() if p.name != "quiet.ipynb"]
    assert all(p.name == "quiet.kernel.log" and p.stat().st_size > 0 for p in left), left


def test_a_failing_cell_names_the_notebook_and_the_cell(tmp_path):
    nb = faults.make_notebook(tmp_path / "bad.ipynb", "x = 1", "raise ValueError('global batch 9')")
    with pytest.raises(
        NotebookFailed, match=r"bad.ipynb failed in cell \[3\] with ValueError: global batch 9"
    ):
        execute(nb, tmp_path / "bad-out.ipynb", {}, progress=False)


@pytest.mark.parametrize(
    "cell, signal_name",
    [
        ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "SIGKILL"),
        ("import os\nos.abort()", "SIGABRT"),
    ],
    ids=["killed", "aborted"],
)
def test_a_dying_kernel_is_named_with_its_cell_and_its_signal(tmp_path, cell, signal_name):
    nb = faults.make_notebook(tmp_path / "dies.ipynb", "x = 1", cell, "print('never')")
    out = tmp_path / "dies-out.ipynb"
    with pytest.raises(KernelDied) as e:
        execute(nb, out, {}, progress=False)
    msg = str(e.value)
    assert (
        "the kernel running dies.ipynb died in cell [3]" in msg
        and f"killed by {signal_name}" in msg
    )
    assert str(out) in msg and "Traceback" not in msg
    kept = faults.cells(
        out
    )  # the notebook up to that cell, the dead cell marked failed, the rest pending
    assert [c["status"] for c in kept] == ["completed", "completed", "failed", "pending"]
    assert kept[2]["errors"] and "the kernel died" in kept[2]["errors"][0]


def test_memory_running_out_inside_python_is_the_cells_error(tmp_path):
    # An address-space limit in the kernel: the allocation fails as a MemoryError in that cell (a real OOM
    # kill is a SIGKILL: the test above).
    cell = (
        "import resource\nsoft, hard = resource.getrlimit(resource.RLIMIT_AS)\n"
        "resource.setrlimit(resource.RLIMIT_AS, (2**31, hard))\nbytearray(2**32)"
    )
    nb = faults.make_notebook(tmp_path / "oom.ipynb", cell)
    with pytest.raises(NotebookFailed, match=r"oom.ipynb failed in cell \[2\] with MemoryError"):
        execute(nb, tmp_path / "oom-out.ipynb", {}, progress=False)


def test_a_misspelt_parameter_is_refused_before_a_kernel_starts(tmp_path):
    nb = faults.make_notebook(tmp_path / "p.ipynb", "print(n_devices)")
    with pytest.raises(
        RunRefused,
        match=r"has no parameter 'n_device' \(did you mean 'n_devices'\?\).*n_devices, platform",
    ):
        execute(nb, tmp_path / "p-out.ipynb", {"n_device": 2}, progress=False)
    assert not (tmp_path / "p-out.ipynb").exists()


def test_a_python3_kernel_of_another_environment_is_refused(tmp_path, monkeypatch):
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    other = tmp_path / "other-env" / "bin" / "python"  # an interpreter that is not this one
    other.parent.mkdir(parents=True)
    other.write_text("#!/bin/sh\necho /elsewhere\n")
    other.chmod(0o755)
    argv = [str(other), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "other", "language": "python"})
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    with pytest.raises(
        RunRefused, match=r"runs .*other-env/bin/python, not this environment's .*JUPYTER_PATH"
    ):
        execution.check_kernel()
    argv[0] = "python"  # what ipykernel installs: jupyter_client starts it with this interpreter
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "ok", "language": "python"})
    )
    execution.check_kernel()


def test_a_full_disk_leaves_the_last_complete_notebook(tmp_path, monkeypatch):
    nb = faults.make_notebook(tmp_path / "full.ipynb", "x = 1", "y = 2", "z = 3")
    out = tmp_path / "full-out.ipynb"
    real_replace, saves = os.replace, []

    def replace(src, dst):
        saves.append(dst)
        if len(saves) >= 6:  # the disk fills up after a few saves
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(execution.os, "replace", replace)
    with pytest.raises(
        NotebookFailed,
        match=r"cannot write .*full-out.ipynb \(No space left on device; .* MB free there\)",
    ):
        execute(nb, out, {}, progress=False)
    kept = json.loads(out.read_text())  # valid JSON: a complete earlier version
    assert "".join(kept["cells"][0]["source"]).startswith("n_devices")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temporary file left


def test_environment_for_the_kernel_only(tmp_path):
    cell = "import os\nprint(os.environ.get('COURSE_X'), os.environ.get('COURSE_STRICT_CHECKS'))"
    nb = faults.make_notebook(tmp_path / "env.ipynb", cell)
    out = tmp_path / "env-out.ipynb"
    assert os.environ["COURSE_STRICT_CHECKS"] == "1"  # the root conftest sets it for the session
    execute(nb, out, {}, progress=False, env={"COURSE_X": "set", "COURSE_STRICT_CHECKS": None})
    printed = "".join(json.loads(out.read_text())["cells"][1]["outputs"][0]["text"])
    assert printed.strip() == "set None" and "COURSE_X" not in os.environ


GC_INTERRUPT = """
import gc, os, signal, sys, threading, time
from course_tools.processes import terminate_as_interrupt

gc.disable()  # no automatic collection before the one below (gc.collect() still runs the callbacks)
cut_short = []


def slow_collection(phase, info):  # a collection callback (JAX installs one) that takes two seconds
    if phase == "start":
        gc.callbacks.remove(slow_collection)
        t = time.time()
        try:
            while time.time() - t < 2.0:
                pass
        except BaseException as e:
            cut_short.append(type(e).__name__)  # the signal did land inside the callback
            raise


gc.callbacks.append(slow_collection)
signum = signal.SIGTERM if sys.argv[1] == "SIGTERM" else signal.SIGINT
try:
    with terminate_as_interrupt():
        threading.Timer(0.2, os.kill, (os.getpid(), signum)).start()  # arrives inside the callback
        gc.collect()
        time.sleep(float(sys.argv[2]))  # 0: the block ends at once, before the interrupt is sent again
    print("not interrupted", cut_short)
except KeyboardInterrupt as e:
    print("interrupted:", type(e).__name__, cut_short)
"""


@pytest.mark.parametrize("then", ["5", "0"], ids=["block-goes-on", "block-ends"])
@pytest.mark.parametrize(
    "signame, raised", [("SIGINT", "KeyboardInterrupt"), ("SIGTERM", "Terminated")]
)
def test_an_interrupt_swallowed_by_a_collection_callback_is_delivered_again(
    tmp_path, signame, raised, then
):
    # Without the redelivery Python prints "Exception ignored in: <function slow_collection ...>" and the
    # run goes on: a Ctrl-C while the kernel starts was lost that way (JAX's collection callback).
    script = tmp_path / "gc_interrupt.py"
    script.write_text(GC_INTERRUPT)
    done = subprocess.run(
        [sys.executable, str(script), signame, then], capture_output=True, text=True, timeout=30
    )
    assert done.stdout.strip() == f"interrupted: {raised} [{raised!r}]", (done.stdout, done.stderr)


def test_a_kernel_that_dies_while_starting_is_started_again(tmp_path, monkeypatch):
    # Several kernels starting at once: one can lose a port it was handed and exit before it answers
    import papermill

    real, starts = papermill.execute_notebook, []

    def port_lost_once(*args, **kwargs):
        starts.append(1)
        if len(starts) == 1:
            raise RuntimeError("Kernel died before replying to kernel_info")
        return real(*args, **kwargs)

    monkeypatch.setattr(papermill, "execute_notebook", port_lost_once)
    nb = faults.make_notebook(tmp_path / "ok.ipynb", "x = 1")
    execute(nb, tmp_path / "out.ipynb", {}, progress=False)
    assert (
        len(starts) == 2
        and [c["status"] for c in faults.cells(tmp_path / "out.ipynb")][-1] == "completed"
    )
    assert "kernel start 1 failed" in (tmp_path / "out.kernel.log").read_text()


def test_a_kernel_that_never_starts_is_named_after_its_last_start(tmp_path, monkeypatch):
    import papermill

    def never(*args, **kwargs):
        raise RuntimeError("Kernel died before replying to kernel_info")

    monkeypatch.setattr(papermill, "execute_notebook", never)
    nb = faults.make_notebook(tmp_path / "ok.ipynb", "x = 1")
    with pytest.raises(KernelDied, match="died before its first cell: Kernel died before replying"):
        execute(nb, tmp_path / "out.ipynb", {}, progress=False)
    log = (tmp_path / "out.kernel.log").read_text()
    assert log.count("failed") == execution.KERNEL_STARTS - 1

"""course_tools.run: the course commands end to end with papermill, and how they end when a run cannot
finish (Ctrl-C, SIGTERM, a kernel killed by the system, a build folder that cannot be used, two runs at the
same moment); the course run of 00 and 08, rendered as a book and checked in a real headless browser.

The fault cases run the real command line (``main``) in its own process group, as a terminal runs a job,
on small notebooks that need no JAX; the lab's real runs come from the invariance matrix (tests/matrix.py).
"""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import book_browser
import disks
import faults
import matrix
import pandas as pd
import pytest

from course_lib import strategies
from course_tools import folders, processes, results, run, site
from course_tools import params as nb_params
from course_tools.execution import RunRefused


@pytest.fixture(scope="module")
def course_run():
    """The 2-device papermill run of 00_setup and the lab (tiny, with the scaling sweep) as ``make course``
    runs them; the book tests below render the same folder, the matrix uses it at 2 devices."""
    return matrix.course_run()


def test_course_run_writes_a_time_table(course_run):
    timings = pd.read_csv(course_run / "timings.csv")
    assert (
        list(timings["notebook"]) == ["00_setup.ipynb", "08_lab.ipynb"]
        and (timings["status"] == "ok").all()
    )
    assert (course_run / "00_setup.ipynb").exists()
    claim = json.loads((course_run / processes.CLAIM_FILE).read_text())
    assert claim["pid"] > 0 and claim["started"]


def test_the_time_table_of_a_stopped_run_names_what_did_not_finish(tmp_path, capsys):
    planned = ["00_setup.ipynb", "01_grad.ipynb", "02_jit.ipynb", "03_vmap.ipynb"]
    rows = [
        {"notebook": "00_setup.ipynb", "seconds": 12.3, "status": "ok"},
        {"notebook": "01_grad.ipynb", "seconds": float("nan"), "status": "interrupted"},
    ]
    run._write_timings(tmp_path, rows, planned)
    out = capsys.readouterr().out
    assert "nan" not in out.lower(), out
    assert re.search(r"00_setup.ipynb +12.3  ok", out), out
    assert re.search(r"01_grad.ipynb +-  interrupted", out), out
    assert re.search(r"02_jit.ipynb +-  not run", out) and "03_vmap.ipynb" in out, out
    said = "total 12 s for the 1 notebook(s) that finished; 01_grad.ipynb interrupted, 2 not run"
    assert said in out, out
    assert list(pd.read_csv(tmp_path / "timings.csv")["status"]) == ["ok", "interrupted"]
    # stopped in the first notebook: nothing finished, and the table says so rather than "total 0 s"
    table = run.timings_table([{**rows[1], "notebook": "00_setup.ipynb"}], planned)
    assert table.endswith(
        "total 0 s for the 0 notebook(s) that finished; 00_setup.ipynb interrupted, 3 not run"
    )
    assert run.timings_table(rows[:1], planned[:1]).endswith(
        "total 12 s for the 1 notebook(s) that finished"
    )


def test_scaling_runs_the_lab_once_per_count_and_draws_the_study(tmp_path, monkeypatch):
    # The lab's real runs at 1 and 8 devices are the matrix's; this lab notebook hands them over, so what is
    # tested here is the command: one kernel and one folder per count, the study aggregated and drawn.
    labs = {n: str(matrix.lab_results(n)) for n in (1, 8)}
    faults.make_notebook(
        tmp_path / "notebooks" / "08_lab.ipynb",
        f"import shutil\nshutil.copytree({labs!r}[n_devices], results_dir, dirs_exist_ok=True)",
        parameters="n_devices = 8\nplatform = 'auto'\nprofile = 'auto'\nresults_dir = 'auto'\n"
        "overwrite = False\nscaling = True",
    )
    _fake_lab12(tmp_path)
    monkeypatch.setattr(run, "NOTEBOOKS", tmp_path / "notebooks")
    out = run.run_scaling(
        ["1", "8"], platform="cpu", profile="tiny", build=str(tmp_path), progress=False
    )
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["n1", "n8"]
    lm = pd.read_csv(
        out / "lm_study.csv"
    )  # the transformer lab ran at each count too, into n<k>/lab12
    assert lm["n_devices"].tolist() == [1, 8] and lm["run"].tolist() == ["n1", "n8"]
    table = pd.read_csv(out / "study.csv")
    assert set(table["strategy"]) == set(strategies.CNN_KEYS) - {
        "jit"
    }  # every parallel CNN strategy
    assert sorted(table["n_devices"].unique()) == [1, 8]
    one = table[table.n_devices == 1]
    assert one["efficiency"].tolist() == pytest.approx(
        [1.0] * len(one)
    )  # by definition at 1 device
    assert (table["efficiency"] > 0).all() and (out / "study.png").stat().st_size > 10_000


def test_second_run_goes_to_a_new_folder_and_bad_input_is_refused(tmp_path, capsys):
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / results.RESULTS_FILE).write_text("strategy\nmine\n")
    assert run.main(["lab", "--n-devices", "eight", "--build", str(tmp_path)]) == 1
    assert "n_devices='eight' is not an integer" in capsys.readouterr().err
    assert run.main(["lab", "--n-devices", "0", "--build", str(tmp_path)]) == 1
    assert (tmp_path / "lab" / results.RESULTS_FILE).read_text() == "strategy\nmine\n"
    assert not (tmp_path / "lab-2").exists()  # refused before any folder was made


def test_a_failing_lab_names_the_cell(tmp_path):
    with pytest.raises(
        run.NotebookFailed,
        match=r"08_lab.ipynb failed in cell \[\d+\] with ValueError: .*global batch 9(.|\n)*kept in",
    ):
        run.run_lab(
            2,
            platform="cpu",
            profile="tiny",
            build=str(tmp_path),
            extra={"global_batch": 9},
            progress=False,
        )


def test_a_misspelt_lab_parameter_is_refused_before_a_folder_is_made(tmp_path):
    with pytest.raises(
        RunRefused, match=r"08_lab.ipynb has no parameter 'n_device' \(did you mean 'n_devices'"
    ):
        run.run_lab(2, platform="cpu", profile="tiny", build=str(tmp_path), extra={"n_device": 4})
    assert list(tmp_path.iterdir()) == []


# --- build folders --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build, message",
    [
        ("", "the build folder is empty"),
        ("{tmp}/afile", "build folder {tmp}/afile is a file, not a folder"),
        ("{tmp}/afile/sub", "cannot write the build folder {tmp}/afile/sub (Not a directory)"),
        ("/proc/course-build", "cannot write the build folder /proc/course-build"),
    ],
    ids=["empty", "a-file", "under-a-file", "cannot-be-created"],
)
def test_a_build_folder_that_cannot_be_used_is_refused_before_anything(
    tmp_path, capsys, build, message
):
    (tmp_path / "afile").write_text("mine")
    build = build.format(tmp=tmp_path)
    assert run.main(["course", "--only", "00", "--n-devices", "2", "--build", build]) == 1
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in err and "--build DIR (make: BUILD=DIR)" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing made
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_read_only_build_folder_is_refused(tmp_path, capsys):
    with disks.read_only(
        tmp_path / "ro"
    ) as ro:  # a read-only file system for root, permissions else
        assert run.main(["lab", "--build", str(ro)]) == 1
    err = capsys.readouterr().err
    assert (
        f"cannot write the build folder {ro} (" in err and "--build DIR (make: BUILD=DIR)" in err
    ), err


def test_a_build_folder_without_room_is_refused(tmp_path, capsys, monkeypatch):
    disks.fake_free(monkeypatch, 3)
    assert run.main(["lab", "--build", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "only 3.0 MB free for the build folder" in err and "this step writes about 2 MB" in err
    assert run.main(["course", "--only", "00", "--build", str(tmp_path)]) == 1
    assert "this step writes about 12 MB" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_runs_started_at_the_same_moment_get_separate_folders(tmp_path):
    barrier, got = threading.Barrier(6), []

    def start():
        barrier.wait()
        got.append(run.run_folder(tmp_path, "lab"))

    threads = [threading.Thread(target=start) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 6 and {p.name for p in got} == {
        "lab",
        "lab-2",
        "lab-3",
        "lab-4",
        "lab-5",
        "lab-6",
    }
    # and two processes, started together as two terminals would: each waits for the other to be ready
    code = (
        "import pathlib, sys, time; from course_tools import run; pathlib.Path(sys.argv[1]).touch()\n"
        "while not pathlib.Path(sys.argv[2]).exists(): time.sleep(0.001)\n"
        "print(run.run_folder(sys.argv[3], 'course'))"
    )
    go = tmp_path / "go"
    procs = []
    for i in range(2):
        argv = [sys.executable, "-c", code, str(tmp_path / f"ready-{i}"), str(go), str(tmp_path)]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True))
    deadline = time.monotonic() + 120
    while (
        not all((tmp_path / f"ready-{i}").exists() for i in range(2))
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    go.touch()
    said = [p.communicate(timeout=60)[0].strip().splitlines() for p in procs]
    folders = {lines[-1] for lines in said}
    assert folders == {str(tmp_path / "course"), str(tmp_path / "course-2")}
    # the run sent to course-2 says why, in one line
    notes = [line for lines in said for line in lines[:-1]]
    assert notes == [
        f"the results folder {tmp_path / 'course'} already holds files ({run.CLAIM_FILE}); "
        f"nothing there is overwritten: this run writes to {tmp_path / 'course-2'} instead"
    ], said


# --- Ctrl-C, SIGTERM, a kernel killed: one message, the notebook kept, nothing left running ------------


@pytest.fixture
def two_notebooks(tmp_path):
    """A course of a quick notebook and a slow one (its slow cell creates ``flag`` when it starts)."""
    nbs, flag = tmp_path / "notebooks", tmp_path / "started"
    faults.make_notebook(nbs / "00_quick.ipynb", "print('quick')")
    faults.make_notebook(
        nbs / "01_slow.ipynb", faults.SLOW.format(flag=str(flag)), "print('never')"
    )
    cmd = faults.command_driver(tmp_path) + [
        str(nbs),
        "course",
        "--n-devices",
        "2",
        "--platform",
        "cpu",
    ]
    return cmd + ["--build", str(tmp_path / "build")], flag, tmp_path / "build" / "course"


def _one_clean_message(err: str, first: str, *fragments: str) -> None:
    """stderr holds progress bars and then one message: ``first`` once, ``fragments`` in it, no traceback."""
    assert "Traceback" not in err and "without encryption" not in err, err
    message = [line for line in err.splitlines() if line.strip() and "Executing:" not in line]
    assert first in message[0] and err.count(first) == 1, err
    assert err.count("kept in") == 1 and all(f in err for f in fragments), err


def _kept_notebook(course, status: str) -> None:
    timings = pd.read_csv(course / "timings.csv")
    assert list(timings["status"]) == ["ok", status]
    kept = faults.cells(course / "01_slow.ipynb")  # the notebook up to the stopped cell
    assert [c["status"] for c in kept] == ["completed", "completed", "failed", "pending"]


@pytest.mark.parametrize("twice", [False, True], ids=["once", "twice"])
def test_ctrl_c_mid_cell_ends_in_seconds_with_the_notebook_and_cell_named(two_notebooks, twice):
    cmd, flag, course = two_notebooks
    job = faults.Job(cmd)
    job.wait_for(flag.exists)
    job.signal(signal.SIGINT, again_after=0.5 if twice else None)
    rc, out, err, took = job.finish()
    assert rc == 130 and took < 20, (rc, took, err)
    _one_clean_message(
        err, "01_slow.ipynb interrupted in cell [3] `import pathlib, time`", f"kept in {course}"
    )
    _kept_notebook(course, "interrupted")
    assert faults.leftovers(job.tag) == []


def test_sigterm_is_handled_like_ctrl_c(two_notebooks):
    cmd, flag, course = two_notebooks
    job = faults.Job(cmd)
    job.wait_for(flag.exists)
    job.signal(signal.SIGTERM)
    rc, out, err, took = job.finish()
    assert rc == 143 and took < 20, (rc, took, err)
    _one_clean_message(err, "01_slow.ipynb stopped by SIGTERM in cell [3]")
    _kept_notebook(course, "stopped by SIGTERM")
    assert faults.leftovers(job.tag) == []


def test_a_kernel_killed_by_the_system_is_named_with_its_cell(two_notebooks):
    cmd, flag, course = two_notebooks
    job = faults.Job(cmd)
    faults.kill_kernel_when_started(job, flag)
    rc, out, err, took = job.finish()
    assert rc == 1 and took < 20, (rc, took, err)
    _one_clean_message(
        err,
        "the kernel running 01_slow.ipynb died in cell [3]",
        "killed by SIGKILL: the operating system",
    )
    _kept_notebook(course, "kernel died")
    assert faults.leftovers(job.tag) == []


def test_ctrl_c_while_the_kernel_starts(two_notebooks):
    cmd, flag, course = two_notebooks
    job = faults.Job(cmd[:-2] + ["--only", "01", "--build", cmd[-1]])  # the slow notebook alone
    job.wait_for(
        (course / "01_slow.kernel.log").exists
    )  # opened just before the kernel is launched
    job.signal(signal.SIGINT)
    started = flag.exists()
    rc, out, err, took = job.finish()
    assert rc == 130 and took < 20 and not started, (rc, took, err)
    _one_clean_message(err, "01_slow.ipynb interrupted before its first cell")
    assert faults.leftovers(job.tag) == []


def _fake_lab12(tmp_path):
    """A stand-in for notebooks/12_transformer_lab.ipynb: writes one lm_results.csv row."""
    faults.make_notebook(
        tmp_path / "notebooks" / "12_transformer_lab.ipynb",
        "import pathlib\npathlib.Path(results_dir).mkdir(parents=True, exist_ok=True)\n"
        "pathlib.Path(results_dir, 'lm_results.csv').write_text(f'layout,n_devices\\ndp,{n_devices}\\n')",
        parameters="n_devices = 8\nplatform = 'auto'\nresults_dir = 'auto'\nglobal_batch = 16\noverwrite = False",
    )


def test_an_interrupted_scaling_study_keeps_the_completed_runs(tmp_path):
    flag = tmp_path / "started"
    _fake_lab12(tmp_path)
    faults.make_notebook(
        tmp_path / "notebooks" / "08_lab.ipynb",
        "import pathlib\npathlib.Path(results_dir, 'lab_results.csv').write_text('strategy\\njit\\n')",
        f"if n_devices > 1:\n    import pathlib, time\n    pathlib.Path({str(flag)!r}).touch()\n"
        "    time.sleep(60)",
        parameters="n_devices = 8\nplatform = 'auto'\nprofile = 'auto'\nresults_dir = 'auto'\n"
        "overwrite = False\nscaling = True",
    )
    cmd = faults.command_driver(tmp_path) + [
        str(tmp_path / "notebooks"),
        "scaling",
        "--counts",
        "1",
        "2",
    ]
    job = faults.Job(cmd + ["--platform", "cpu", "--build", str(tmp_path / "build")])
    job.wait_for(flag.exists)
    job.signal(signal.SIGINT)
    rc, out, err, took = job.finish()
    study = tmp_path / "build" / "scaling"
    assert rc == 130 and "08_lab.ipynb interrupted in cell [4]" in err, err
    assert f"completed runs kept: {study / 'n1'}; no study was written" in err
    assert (study / "n1" / "lab_results.csv").exists() and not (study / "study.csv").exists()
    assert faults.leftovers(job.tag) == []


def test_a_python3_kernel_of_another_environment_is_refused_before_a_folder_is_made(tmp_path):
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    argv = ["/usr/bin/false", "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "x", "language": "python"})
    )
    env = {**os.environ, "JUPYTER_PATH": str(tmp_path / "jupyter")}
    cmd = [
        sys.executable,
        "-m",
        "course_tools.run",
        "course",
        "--only",
        "00",
        "--build",
        str(tmp_path / "b"),
    ]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "runs /usr/bin/false, not this environment's" in r.stderr, r.stderr
    assert "JUPYTER_PATH" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "b").exists()


# --- the course run as a book (Sphinx), checked in headless Chromium: pages load, links resolve, plots show ---


@pytest.fixture(scope="module")
def rendered(course_run, tmp_path_factory):
    """``python -m course_tools.site`` on the 00 + 08 run into a used folder: the book goes to a new one beside it."""
    tmp = tmp_path_factory.mktemp("site")
    (tmp / "site").mkdir()
    (tmp / "site" / "mine.txt").write_text("keep")
    assert (
        site.main([str(course_run), str(tmp / "site"), "--strict"]) == 0
    )  # --strict: any Sphinx warning fails
    assert [p.name for p in (tmp / "site").iterdir()] == ["mine.txt"]
    assert sorted(p.name for p in tmp.iterdir()) == [
        "site",
        "site-2",
    ]  # nothing else written beside them
    return tmp / "site-2"


def test_site_book_of_a_course_run_in_the_browser(rendered, course_run, tmp_path):
    book = rendered
    lessons = book_browser.LESSONS
    browser = book_browser.Browser(tmp_path)
    visits = {}
    try:
        with book_browser.serve(book) as base:
            for page in sorted(book.glob("*.html")):
                visits[page.stem] = v = browser.visit(base + page.name)
                book_browser.check_page(v, book, base)
            found = browser.search(base, "shard_map")
    finally:
        browser.close()
    assert set(visits) == {
        "index",
        "genindex",
        "search",
        "lab-report",
        "run",
        "instructor-guide",
        *lessons,
    }
    for stem in (
        lessons
    ):  # every lesson page, executed or not: the whole course in the sidebar, prev / next
        v = visits[stem]
        assert book_browser.sidebar_lessons(v) == lessons, stem
        assert len(v.prev_next) == 2, stem
        assert bool(v.page_toc) == (stem in ("00_setup", "08_lab")), (
            stem
        )  # per-page contents of a lesson
    assert "06_shard_map.html" in found[:3], found
    # executed lessons: the run's outputs and plots; the injected parameters as a note, not as code
    lab, setup = visits["08_lab"], visits["00_setup"]
    assert "lab finished in" in lab.text
    assert (
        sum(i["src"].endswith(".png") for i in lab.images) >= 3
    )  # loss curves, comparison, scaling
    assert "Run with n_devices=2, platform='cpu'" in setup.text and "# Parameters" not in setup.text
    assert "profile='tiny'" in lab.text and "results_dir='course/lab'" in lab.text
    assert "n_devices = 8" in setup.text  # the notebook's own parameters cell stays as code
    assert "https://docs.jax.dev/en/latest/jit-compilation.html" in visits["02_jit"].links
    assert "100%" in lab.text and "0%|" not in lab.text  # tqdm bars as their final text
    # lessons this run did not execute: a page that says so
    for stem in set(lessons) - {"00_setup", "08_lab"}:
        assert "(not in this run)" in visits[stem].text and "make course" in visits[stem].text, stem
    # the lab report: this run's tables and plots, and the reference run beside them, labelled
    report = visits["lab-report"]
    assert (
        "This run" in report.text
        and "Reference run" in report.text
        and "reference_cpu_8sim.csv" in report.text
    )
    res = pd.read_csv(course_run / "lab" / results.RESULTS_FILE)
    for label, ms in zip(res["label"], res["step_time_s"] * 1e3):
        assert label in report.text and f"{ms:.1f}" in report.text
    assert (
        "Not comparable row by row" in report.text
    )  # tiny profile at 2 devices vs the 8-device CPU reference
    shown = [i["src"].rsplit("/", 1)[-1] for i in report.images]
    assert {"loss_curves.png", "comparison.png", "scaling.png"} <= set(shown) and len(
        shown
    ) >= 5  # + reference
    assert "simulated CPU devices" in report.text
    # the run's metadata, as the notebooks reported it
    run_page = visits["run"].text
    assert re.search(r"device count\s+2 used, of 2 available", run_page), run_page[:2000]
    assert (
        re.search(r"simulated\s+yes", run_page)
        and "0.12.0.1" in run_page
        and "timings.csv" in run_page
    )
    home = visits["index"].text
    assert "2 simulated CPU devices" in home and "Not in this run" in home
    for lesson in site.course_map():  # the course map links every lesson's official JAX pages
        assert all(d["url"] in visits["index"].links for d in lesson["jax_docs"]), lesson["stem"]


def test_site_refuses_to_overwrite(rendered, course_run, tmp_path):
    with pytest.raises(FileExistsError, match="not empty"):
        site.build_site(course_run, rendered)
    with pytest.raises(FileNotFoundError, match="make course"):
        site.build_site(tmp_path, tmp_path / "out")


# --- the second time, a full disk: one message, the run marked, the newest finished run found -----------


@pytest.fixture
def quick_course(tmp_path, monkeypatch):
    """A course of three notebooks that need no JAX, run in this process by ``run.main``."""
    nbs = tmp_path / "notebooks"
    faults.make_notebook(nbs / "00_quick.ipynb", "print('quick')")
    faults.make_notebook(nbs / "01_big.ipynb", "print('x' * 1000)", "print('more')")
    faults.make_notebook(nbs / "02_last.ipynb", "print('last')")
    monkeypatch.setattr(run, "NOTEBOOKS", nbs)
    return ["course", "--n-devices", "2", "--platform", "cpu", "--build", str(tmp_path / "build")]


def test_a_course_run_twice_goes_to_two_folders_and_the_book_reads_the_newest(
    quick_course, tmp_path, capsys
):
    build = tmp_path / "build"
    assert run.main(quick_course) == 0
    assert "already holds files" not in capsys.readouterr().out
    assert run.main(quick_course) == 0
    said = capsys.readouterr().out  # the used folder is named, and where the second run went
    assert f"the results folder {build / 'course'} already holds files (" in said, said
    assert f"nothing there is overwritten: this run writes to {build / 'course-2'} instead" in said
    first, second = (folders.read_run(build / n) for n in ("course", "course-2"))
    assert first.status == second.status == "ok" and first.started <= second.started
    import argparse

    newest = site._source(argparse.Namespace(source=None, newest_in=str(build), student=False))
    assert newest == build / "course-2"
    said = capsys.readouterr().out
    assert (
        said.startswith(f"the book of the course run {build / 'course-2'} (started ")
        and "ended ok" in said
    )
    assert "note:" not in said
    named = site._source(
        argparse.Namespace(source=str(build / "course"), newest_in=None, student=False)
    )
    said = capsys.readouterr().out
    assert (
        named == build / "course"
        and f"note: a newer course run exists: {build / 'course-2'}" in said
    )


def test_a_full_disk_mid_course_ends_with_one_message_and_the_run_marked(
    quick_course, tmp_path, capsys, monkeypatch
):
    real_replace, saves = os.replace, []

    def replace(src, dst):  # the disk fills after 01_big's first saves
        saves.extend([dst] if str(dst).endswith("01_big.ipynb") else [])
        if len(saves) > 3 and str(dst).endswith("01_big.ipynb"):
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    assert run.main(quick_course) == 1
    err = capsys.readouterr().err
    course = tmp_path / "build" / "course"
    assert err.count("error:") == 1 and "Traceback" not in err, err
    said = f"01_big.ipynb: cannot write {course / '01_big.ipynb'} (No space left on device; "
    assert said in err and " MB free there) in cell [" in err, err
    assert f"kept in {course}" in err and "run.json there records how the run ended" in err
    assert list(pd.read_csv(course / "timings.csv")["status"]) == ["ok", "FAILED"]
    assert folders.read_run(course).status == "FAILED"
    assert json.loads((course / "01_big.ipynb").read_text())["cells"]  # its last complete save
    assert not [p for p in course.iterdir() if p.name.endswith(".tmp")]


def test_a_disk_that_fills_up_leaves_a_run_the_book_passes_over(
    quick_course, tmp_path, capsys, monkeypatch
):
    build = tmp_path / "build"
    with disks.small_disk(build, mb=2):
        # the room checks pass (1 MB): the disk fills while the executed notebook is saved
        monkeypatch.setattr(folders, "MIN_FREE_MB", 1)
        monkeypatch.setitem(folders.WRITES_MB, "course", 1)
        nbs = run.NOTEBOOKS
        faults.make_notebook(nbs / "01_big.ipynb", "print('x' * 3_000_000)", "print('more')")
        code = run.main(quick_course)
        err = capsys.readouterr().err
        assert code == 1 and "No space left on device" in err and "Traceback" not in err, err
        info = folders.read_run(build / "course")
        assert info.status in ("unfinished", "FAILED") and not info.running
        with pytest.raises(FileNotFoundError, match="no finished course run"):
            folders.newest_run(build, "course")


def test_a_course_run_still_running_is_not_made_into_a_book(tmp_path):
    import argparse

    folder = folders.claim_run_dir(lambda: results.prepare_results_dir(tmp_path / "course"))
    with pytest.raises(ValueError, match="is still running: build its book when it has ended"):
        site._source(argparse.Namespace(source=str(folder), newest_in=None, student=False))


@pytest.mark.notebook
@pytest.mark.parametrize("folder", ["read-only", "small-disk"])
def test_the_lab_through_papermill_stops_in_its_setup_cell_when_results_cannot_be_saved(
    tmp_path, folder
):
    # papermill ... -p results_dir DIR: the notebook's own setup cell checks DIR (the library call it
    # makes, results.prepare_results_dir), before any strategy trains
    out = tmp_path / "08_lab.ipynb"
    where = (
        disks.read_only(tmp_path / "ro")
        if folder == "read-only"
        else disks.small_disk(tmp_path / "small", 4)
    )
    params = {"n_devices": 2, "platform": "cpu", "profile": "tiny", "scaling": False}
    with where as results_dir:
        with pytest.raises(run.NotebookFailed) as e:
            run.execute(
                run.NOTEBOOKS / "08_lab.ipynb",
                out,
                {**params, "results_dir": str(results_dir)},
                progress=False,
            )
        assert list(results_dir.iterdir()) == []
    message = str(e.value)
    expected = (
        f"cannot write the results folder {results_dir} ("
        if folder == "read-only"
        else f"only 4.0 MB free for the results folder {results_dir}"
    )
    assert "08_lab.ipynb failed in cell [4] with FolderError: " + expected in message, message
    assert "-p results_dir DIR" in message
    ran = [c for c in faults.cells(out) if c["count"]]
    assert (
        len(ran) == 4
    )  # parameters, injected parameters, device setup, imports and the results folder


@pytest.mark.parametrize("only", [["0"], ["00", "88"], ["8"]])
def test_only_names_notebooks_or_is_refused(tmp_path, capsys, only):
    assert run.main(["course", "--only", *only, "--build", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "names no notebook: give their numbers (00 01" in err and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "only, chosen",
    [
        (["10", "11"], ["10", "11"]),
        (["10,11"], ["10", "11"]),
        (["10, 12", "00"], ["00", "10", "12"]),
    ],
)
def test_only_takes_numbers_separated_by_spaces_or_commas(only, chosen):
    got = run.chosen_notebooks(run.course_notebooks(), only)
    assert [p.name[:2] for p in got] == chosen


def test_only_with_commas_names_the_part_that_names_no_notebook(tmp_path, capsys):
    assert run.main(["course", "--only", "00,88", "--build", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "--only '88' names no notebook" in err and "spaces or commas" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("n", range(1, 9))
def test_the_transformer_labs_batch_splits_over_every_layout_that_fits(n, capsys):
    from course_lib import lm_layouts, lm_runs, strategies

    batch = nb_params.lab12_batch(n)
    keys = [k for k in strategies.LAYOUT_KEYS if lm_layouts.mesh_axes(k, n)]
    lm_runs.check_run(keys, n, batch, 1)  # raises where a layout cannot split the batch
    assert (batch == nb_params.LAB12_BATCH) == (n in (1, 2, 4, 8)), (n, batch)
    assert ("note:" in capsys.readouterr().out) == (batch != nb_params.LAB12_BATCH)


@pytest.mark.parametrize("n_micro", [0, "x"])
def test_lesson_11_refuses_a_micro_batch_count_in_its_setup_cell(tmp_path, n_micro):
    # papermill -p n_micro 0 (or -r n_micro x): refused in the cell that reads it, before any program runs
    out = tmp_path / "11.ipynb"
    with pytest.raises(run.NotebookFailed) as e:
        run.execute(
            run.NOTEBOOKS / "11_pipeline_experts.ipynb",
            out,
            {"n_devices": 2, "platform": "cpu", "n_micro": n_micro},
            progress=False,
        )
    assert (
        f"ValueError: n_micro={n_micro!r}: the pipeline needs a positive whole multiple of its 2 "
        "stages; use n_micro=" in str(e.value)
    )
    # parameters, papermill's injected parameters, device setup, imports, then the sizes cell that refuses
    assert len([c for c in faults.cells(out) if c["count"]]) <= 5


@pytest.mark.parametrize("n", [0, -1, 2.5])
def test_the_transformer_labs_batch_needs_a_device_count(n):
    with pytest.raises(
        ValueError, match=f"n_devices={n!r}: the transformer lab needs 1 device or more"
    ):
        nb_params.lab12_batch(n)


def test_a_course_run_prints_the_transformer_labs_batch_note_once(tmp_path, monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(run, "execute", lambda nb, out, params, progress: ran.append(params) or 1.0)
    run.run_course(3, platform="cpu", build=str(tmp_path), only=["12"], progress=False)
    out = capsys.readouterr().out
    assert out.count("note: the transformer lab's global batch 16") == 1, out
    assert [p["global_batch"] for p in ran] == [18]

"""The Makefile: every option README lists for a target reaches the command it runs, an option a target
does not take is refused by name, bad values stop make, and a target run a second time works.

``make -n`` prints the commands a target would run without running them (a second or less each); the
``make student`` cases run for real into a temporary build folder (a few seconds each).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)


def make(*args, cwd=ROOT, dry=True, timeout=120):
    """``make [-n] ARGS`` with this session's environment as VENV (never rebuilt: ``-o``)."""
    venv = [f"VENV={VENV}", "-o", f"{VENV}/.installed"]
    cmd = ["make", "--no-print-directory", *(["-n"] if dry else []), *venv, *args]
    # Under `make test` this make is a sub-make: MAKELEVEL and MAKEFLAGS would make it print "Entering
    # directory" lines and inherit the outer make's flags, so it runs as a make of its own.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def readme_options() -> dict[str, list[str]]:
    """``{target: [options]}`` from README's table "Every command: its options, and the second time"."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Every command: its options") :]
    section = section[: section.index("\n## ", 4)]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and (m := re.fullmatch(r"`make (\S+)`", cells[0])):
            table[m.group(1)] = re.findall(r"`([A-Z][A-Z0-9_]*)`", cells[1])
    return table


def makefile_options() -> dict[str, list[str]]:
    text = (ROOT / "Makefile").read_text()
    return {
        m.group(1): m.group(2).split()
        for m in re.finditer(r"^OPTIONS_(\S+) :=[ \t]*(.*)$", text, re.M)
    }


def test_readme_lists_every_target_with_the_options_the_makefile_takes():
    readme, makefile = readme_options(), makefile_options()
    assert set(readme) == set(makefile) - {"help", "clean-venv"}, (readme, makefile)
    for target, options in readme.items():
        assert sorted(options) == sorted(makefile[target]), target


PROBES = {  # a value that shows up in the printed command when the option is honoured
    "N_DEVICES": ("3", "--n-devices 3"),
    "PLATFORM": ("cpu", "--platform cpu"),
    "PROFILE": ("tiny", "--profile tiny"),
    "BUILD": ("/tmp/probe-build", "/tmp/probe-build"),
    "ONLY": ("04", "--only 04"),
    "COUNTS": ("1 3", "--counts 1 3"),
    "COURSE": ("/tmp/probe-course", "site /tmp/probe-course"),
    "STUDENT": ("1", "--student notebooks"),
    "OVERWRITE": ("1", "--overwrite"),
    "PYTEST_ARGS": ("-k probe", " -k probe"),
    "LOAD": ("3", "tools/cpu_load.py --busy 3 --"),
    "MATRIX": ("3", 'COURSE_MATRIX_COUNTS="3"'),
    "JUPYTER_DIR": ("/tmp/probe-dir", "--ServerApp.root_dir=/tmp/probe-dir"),
    "PY311": ("/tmp/probe-python3.11", "JAX 0.10.2 on /tmp/probe-python3.11 in .venv311"),
    "SINCE": ("HEAD~2", "tools/affected.py --since HEAD~2"),
}


@pytest.mark.parametrize(
    "target, option",
    [(t, o) for t, options in readme_options().items() for o in options],
)
def test_every_option_readme_lists_reaches_the_command(target, option):
    value, shown = PROBES[option]
    r = make(target, f"{option}={value}")
    assert r.returncode == 0, r.stderr
    assert shown in r.stdout, (target, option, r.stdout)


@pytest.mark.parametrize(
    "args, refused, options",
    [
        (["lab", "ONLY=00"], "ONLY=00", "BUILD N_DEVICES PLATFORM PROFILE"),
        (["lab", "N_DEVICE=4"], "N_DEVICE=4", "BUILD N_DEVICES PLATFORM PROFILE"),  # misspelt
        (["student", "PROFILE=tiny"], "PROFILE=tiny", "BUILD OVERWRITE"),
        (["test", "N_DEVICES=2"], "N_DEVICES=2", "LOAD PY311 PYTEST_ARGS"),
        (["check", "LOAD=1"], "LOAD=1", "PYTEST_ARGS SINCE"),
        (["jupyter", "BUILD=x"], "BUILD=x", "JUPYTER_DIR"),
        (["site", "ONLY=08"], "ONLY=08", "BUILD COURSE STUDENT"),
        (
            ["lab", "site", "COUNTS=1"],
            "COUNTS=1",
            "BUILD COURSE N_DEVICES PLATFORM PROFILE STUDENT",
        ),
        (["setup", "LOAD=1"], "LOAD=1", "none"),
    ],
    ids=lambda v: v if isinstance(v, str) else " ".join(v),
)
def test_an_option_the_target_does_not_take_is_refused_by_name(args, refused, options):
    r = make(*args)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    name = refused.split("=")[0]
    assert f"takes no {name} (given: {refused}): its options are {options} besides" in r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["site", "STUDENT=yes"], "STUDENT=yes is not 0 or 1"),
        (["student", "OVERWRITE=true"], "OVERWRITE=true is not 0 or 1"),
        (["test", "LOAD=many"], "LOAD=many is not a number of busy processes"),
        (["labs"], "there is no target 'labs': the targets are help setup lab"),
        (
            ["site", "STUDENT=1", "COURSE=build/course"],
            "builds the student version from notebooks/",
        ),
    ],
)
def test_bad_values_stop_make_with_one_message(args, message):
    r = make(*args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_zero_means_no(tmp_path):
    assert "--student" not in make("site", "STUDENT=0").stdout
    assert "--overwrite" not in make("student", "OVERWRITE=0").stdout
    assert "cpu_load" not in make("test", "LOAD=0").stdout


def test_make_test_runs_the_second_environment_or_says_why_not():
    """After the suite in VENV, make test runs the unit tests and every notebook in .venv311 (JAX 0.10.2 on
    Python 3.11): with a Python 3.11 it finds, with the one PY311 names; PY311=0 skips it, and without any
    Python 3.11 it says so in capitals (README, "Two environments")."""
    named = make("test", "PY311=/tmp/probe-python3.11").stdout
    second = ".venv311/bin/python -m pytest tests notebooks --ignore=tests/test_invariance.py"
    assert second in named
    assert named.index(f"{VENV}/bin/python -m pytest") < named.index(second)  # after the suite
    skipped = make("test", "PY311=0")
    assert second not in skipped.stdout and "was skipped: PY311=0" in skipped.stdout
    none = make("test", "PYTHON=/bin/false")  # its check_python.py --find-3.11 finds nothing
    assert second not in none.stdout and "NO PYTHON 3.11 FOUND" in none.stdout


def test_make_site_reads_the_newest_course_run_unless_one_is_named():
    assert "course_tools.site --newest-in build build/site" in make("site").stdout
    assert (
        "course_tools.site build/course-2 build/site"
        in make("site", "COURSE=build/course-2").stdout
    )


def test_make_student_twice_replaces_the_handout_with_overwrite_1(tmp_path):
    build = tmp_path / "build"
    first = make("student", f"BUILD={build}", dry=False)
    assert first.returncode == 0, first.stderr
    zip_path, notebooks = build / "jax-course-student.zip", build / "student"
    made = zip_path.stat().st_mtime_ns
    again = make("student", f"BUILD={build}", dry=False)
    assert again.returncode == 2 and "make student OVERWRITE=1" in again.stderr, again.stderr
    assert zip_path.stat().st_mtime_ns == made
    edited = notebooks / "01_grad.ipynb"
    edited.write_text(edited.read_text().replace("Exercise: write this part", "my answer", 1))
    third = make("student", f"BUILD={build}", "OVERWRITE=1", dry=False)
    assert third.returncode == 0, third.stderr
    assert zip_path.stat().st_mtime_ns != made
    assert "my answer" not in edited.read_text()  # the handout is the course's again
    (kept,) = notebooks.glob("edited-*/01_grad.ipynb")  # and the learner's edit is kept
    assert (
        "my answer" in kept.read_text()
        and f"kept the edited 01_grad.ipynb in {kept.parent}" in third.stdout
    )


def test_make_jupyter_starts_kernels_with_encrypted_channels_and_checks_a_student_folder():
    printed = make("jupyter", "JUPYTER_DIR=build/student").stdout
    assert "--KernelManager.transport_encryption=auto" in printed  # no "running without encryption"
    assert "course_tools.student notebooks --check build/student" in printed

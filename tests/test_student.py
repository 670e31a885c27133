"""The student-version generator: stubs for solutions, an earlier version replaced only on request (a
learner's edits kept), full disks, and the package handed out, unpacked and run as a course of its own."""

import errno
import json
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import disks
import nbformat
import pytest

from course_tools import student

SOLVED = """def f(x):
    # BEGIN SOLUTION
    return 2 * x
    # END SOLUTION

y = 1
# BEGIN SOLUTION  # STUB: z = None
z = f(y)
# END SOLUTION"""


def test_strip_solutions_replaces_blocks_with_stubs():
    out, n = student.strip_solutions(SOLVED)
    assert n == 2
    assert "2 * x" not in out and "z = f(y)" not in out
    assert '    raise NotImplementedError("Exercise: write this part")' in out
    assert "\nz = None" in out and "y = 1" in out


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ("# BEGIN SOLUTION\nx = 1", "without END"),
        ("x = 1\n# END SOLUTION", "without BEGIN"),
        ("# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION", "nested"),
    ],
)
def test_unbalanced_markers_are_errors(bad, fragment):
    with pytest.raises(ValueError, match=fragment):
        student.strip_solutions(bad, "nb.ipynb cell 3")


def test_generate_never_overwrites_without_asking(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SOLVED)])
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", text="old output")]
    nbformat.write(nb, src / "a.ipynb")
    done = student.generate(src, tmp_path / "out")
    assert [(p.name, n) for p, n in done] == [("a.ipynb", 2)]
    got = nbformat.read(tmp_path / "out" / "a.ipynb", 4)
    assert got.cells[0].outputs == [] and "exercise" in got.cells[0].metadata["tags"]
    with pytest.raises(FileExistsError, match="--overwrite"):
        student.generate(src, tmp_path / "out")
    assert student.main([str(src), str(tmp_path / "out")]) == 2
    assert student.main([str(src), str(tmp_path / "out"), "--overwrite"]) == 0


@pytest.mark.parametrize("line", ["#BEGIN SOLUTION", "# begin solution", "#  END SOLUTION"])
def test_near_markers_are_errors_not_leaks(line):
    with pytest.raises(ValueError, match="is not a marker"):
        student.strip_solutions(f"x = 1\n{line}\ny = 2", "nb cell 1")


def test_generate_refuses_to_replace_the_solutions_and_writes_nothing_on_errors(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    nbformat.write(
        nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SOLVED)]), src / "a.ipynb"
    )
    with pytest.raises(ValueError, match="would replace the solution notebooks"):
        student.generate(src, src, overwrite=True)
    assert "2 * x" in nbformat.read(src / "a.ipynb", 4).cells[0].source
    nbformat.write(
        nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("# BEGIN SOLUTION\nx = 1")]),
        src / "b.ipynb",
    )
    with pytest.raises(ValueError, match="b.ipynb cell 0"):
        student.generate(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- the second time: an earlier student version replaced on request, a learner's edits kept -----------


def _source(tmp_path, *cells):
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    for name, source in cells:
        nbformat.write(
            nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)]), src / name
        )
    return src


def test_overwrite_replaces_keeps_edits_and_drops_lessons_that_are_gone(tmp_path, capsys):
    src = _source(tmp_path, ("01_a.ipynb", SOLVED), ("02_b.ipynb", SOLVED), ("03_c.ipynb", SOLVED))
    dst = tmp_path / "student"
    student.generate(src, dst)
    (dst / "mine.ipynb").write_text("{}")  # the learner's own notebook
    edited = dst / "02_b.ipynb"
    edited.write_text(edited.read_text().replace("Exercise: write this part", "my answer"))
    (src / "03_c.ipynb").unlink()  # a lesson removed from the course
    with pytest.raises(FileExistsError, match=r"make student OVERWRITE=1"):
        student.generate(src, dst)
    student.generate(src, dst, overwrite=True)
    (kept,) = dst.glob("edited-*/02_b.ipynb")
    assert "my answer" in kept.read_text() and "my answer" not in edited.read_text()
    out = capsys.readouterr().out
    assert f"kept the edited 02_b.ipynb in {kept.parent}" in out
    assert f"replaced 2 earlier student notebook(s) in {dst}: 01_a.ipynb, 02_b.ipynb" in out
    assert sorted(p.name for p in dst.glob("*.ipynb")) == ["01_a.ipynb", "02_b.ipynb", "mine.ipynb"]
    manifest = json.loads((dst / student.MANIFEST).read_text())
    assert sorted(manifest["notebooks"]) == ["01_a.ipynb", "02_b.ipynb"]
    assert student.stale_note(dst, src) is None
    nbformat.write(
        nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 2")]), src / "01_a.ipynb"
    )
    note = student.stale_note(dst, src)
    assert (
        "were made from another version" in note and "01_a.ipynb" in note and "OVERWRITE=1" in note
    )


def test_a_full_disk_midway_names_the_folder_and_leaves_no_manifest(tmp_path, monkeypatch):
    src = _source(tmp_path, ("01_a.ipynb", SOLVED), ("02_b.ipynb", SOLVED))
    dst = tmp_path / "student"
    student.generate(src, dst)
    real_replace = os.replace

    def replace(a, b):
        if str(b).endswith("02_b.ipynb"):
            raise OSError(errno.ENOSPC, "No space left on device", str(b))
        real_replace(a, b)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match=rf"cannot write {dst} \(No space left on device.*incomplete"):
        student.generate(src, dst, overwrite=True)
    assert not (dst / student.MANIFEST).exists()
    assert not [p for p in dst.iterdir() if p.name.endswith(".tmp")]


def test_a_student_folder_without_room_is_refused_before_writing(tmp_path, monkeypatch):
    src = _source(tmp_path, ("01_a.ipynb", SOLVED))
    disks.fake_free(monkeypatch, 5)
    with pytest.raises(ValueError, match="only 5.0 MB free for the student folder"):
        student.generate(src, tmp_path / "student")
    assert not list((tmp_path / "student").glob("*.ipynb"))


# --- the package handed out: a working course on its own -------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """``make student``'s zip, unpacked into a new folder: the package's root."""
    tmp = tmp_path_factory.mktemp("package")
    zip_path = student.package(ROOT, tmp / "jax-course-student.zip")
    with zipfile.ZipFile(zip_path) as z:
        z.extractall(tmp / "unpacked")
    return tmp / "unpacked" / student.TOP


def _in_package(package, *cmd, timeout=120):
    """A command in the unpacked package, with this session's environment as its ``.venv`` (never rebuilt)
    and the package's own ``course_lib`` / ``course_tools`` first on the path (what `make setup` there
    installs), kernels included."""
    env = {**os.environ, "PYTHONPATH": str(package)}
    for name in (
        "COURSE_BUILD_DIR",
        "COURSE_STRICT_CHECKS",
    ):  # the package's own build/; a learner's
        env.pop(name, None)  # checkers print "not written yet" and go on
    if cmd[0] == "make":
        cmd = ("make", f"VENV={VENV}", "-o", f"{VENV}/.installed", *cmd[1:])
    return subprocess.run(
        cmd, cwd=package, env=env, capture_output=True, text=True, timeout=timeout
    )


def _readme_commands(readme: str) -> list[str]:
    """The commands the README names: `make ...` spans and the lines of its bash blocks."""
    spans = re.findall(r"`((?:make|\.venv/bin/\S+) [^`]*)`", readme)
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    lines = [line.split("  #")[0].strip() for b in blocks for line in b.splitlines()]
    return sorted({c for c in spans + lines if c})


def test_the_package_readme_names_only_what_the_package_holds(package):
    readme = (package / "README.md").read_text()
    assert readme == (ROOT / "docs" / "student-README.md").read_text()
    assert not (package / "tests").exists() and "make test" not in readme and "tests/" not in readme
    commands = _readme_commands(readme)
    makes = [c for c in commands if c.startswith("make ")]
    assert {c.split()[1] for c in makes} >= {
        "jupyter",
        "lab",
        "course",
        "site",
        "scaling",
        "bench",
        "help",
    }
    for command in makes:  # the target is there and takes the options given
        if command.split()[1] in ("jupyter", "help"):
            continue
        r = _in_package(package, "make", "-n", *shlex.split(command)[1:])
        assert r.returncode == 0 and "not part of the student package" not in r.stdout, (
            command,
            r.stderr,
        )
    for command in commands:  # every module and file a command names is in the package
        for module in re.findall(r"-m (course_\w+\.\w+)", command):
            assert (package / (module.replace(".", "/") + ".py")).is_file(), command
        for path in re.findall(r"\b((?:notebooks|tools|deploy|docs)/[\w./-]+)", command):
            assert (package / path).exists(), (command, path)
    for path in re.findall(
        r"`((?:notebooks|course_lib|course_tools|deploy|docs|tools|data)/[\w./-]*)`", readme
    ):
        assert (package / path).exists(), path
    assert sorted(p.name for p in (package / "notebooks").glob("*.ipynb")) == sorted(
        p.name for p in (ROOT / "notebooks").glob("*.ipynb")
    )


def test_the_course_only_targets_say_so_in_the_package(package):
    for target in ("test", "check"):
        r = _in_package(package, "make", target)
        assert r.returncode == 2, (target, r.stderr)
        assert f"make {target} is not part of the student package" in r.stderr, r.stderr
    for target in ("student", "check", "matrix", "reference"):
        assert f"make {target}" not in _in_package(package, "make", "help").stdout
    assert (
        "make student"
        in subprocess.run(["make", "help"], cwd=ROOT, capture_output=True, text=True).stdout
    )


@pytest.mark.notebook
def test_the_package_runs_a_lesson_and_makes_its_book(package):
    # the README's commands for real, in the unpacked folder: a course run (00 at one device) and its book
    r = _in_package(
        package, "make", "course", "ONLY=00", "N_DEVICES=1", "PLATFORM=cpu", timeout=300
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    run_folder = package / "build" / "course"
    assert (run_folder / "00_setup.ipynb").exists()
    r = _in_package(package, "make", "site", timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "the book of the course run build/course (started " in r.stdout
    assert (package / "build" / "site" / "00_setup.html").exists()
    r = _in_package(package, VENV / "bin" / "python", "-m", "course_tools.launcher", "--help")
    assert r.returncode == 0 and "launch" in r.stdout


def test_check_of_a_missing_folder_says_to_make_the_student_version_first(tmp_path, capsys):
    missing = tmp_path / "student"
    assert student.main(["notebooks", "--check", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"no folder {missing} to open" in err and "make student" in err

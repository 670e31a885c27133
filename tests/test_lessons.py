"""Lessons (every notebook but the lab): notebook conventions, exercise markup, and the student version.

- Hygiene (fast): parameters cell first, device setup second, no outputs, generic kernelspec, no
  ``raises-exception`` cells (papermill would stop at them), at least three exercises, each solution cell
  followed by a cell tagged ``exercise-check``.
- Student version (slow, marked ``notebook``): generated with ``course_tools.student``, executed top to
  bottom; the only cells that fail are the exercise checks, and every one of them fails.
"""

import ast
import re
from pathlib import Path

import matrix
import nbformat
import pytest
from IPython.core.displayhook import DisplayHook

from course_tools.student import BEGIN, END, student_notebook

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted(
    p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb") if p.stem != "08_lab"
)


def test_the_lessons_of_the_map_exist():
    assert LESSONS[:8] == [
        "00_setup",
        "01_grad",
        "02_jit",
        "03_vmap",
        "04_pmap",
        "05_sharding",
        "06_shard_map",
        "07_debugging",
    ]


def _read(name):
    return nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


@pytest.mark.parametrize("name", LESSONS)
def test_conventions(name):
    nb = _read(name)
    assert nb.metadata["kernelspec"] == {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    cells = _code_cells(nb)
    first, second = cells[0], cells[1]
    assert "parameters" in first.metadata.get("tags", [])
    tree = ast.parse(first.source)
    assert all(isinstance(s, ast.Assign) and isinstance(s.targets[0], ast.Name) for s in tree.body)
    assigned = {s.targets[0].id: ast.literal_eval(s.value) for s in tree.body}
    assert assigned["n_devices"] == 8 and assigned["platform"] == "auto"
    assert (
        "setup_devices(n_devices, platform" in second.source and "import jax" not in second.source
    )
    # the lessons that time compiles switch a persistent compilation cache off; the others keep it
    assert ("measures_compiles=True" in second.source) == (name in matrix.TIMES_COMPILES)
    for c in cells:
        assert c.outputs == [] and c.execution_count is None
        assert "raises-exception" not in c.metadata.get(
            "tags", []
        )  # papermill fails on any error output


@pytest.mark.parametrize("name", LESSONS)
def test_exercises_are_marked(name):
    nb = _read(name)
    cells = _code_cells(nb)
    solution_cells = [i for i, c in enumerate(cells) if "# BEGIN SOLUTION" in c.source]
    assert len(solution_cells) >= 3
    for i in solution_cells:
        check = cells[i + 1]
        assert "exercise-check" in check.metadata.get("tags", []), check.source
        assert f"lesson{name[:2]}.check_" in check.source
    student, replaced = student_notebook(nb, name)
    assert replaced == len(solution_cells)
    assert "BEGIN SOLUTION" not in "".join(c.source for c in student.cells)


CHECKER_CALL = re.compile(r"lesson\d\d\.check_\w+")


@pytest.mark.parametrize("name", [*LESSONS, "08_lab", "12_transformer_lab"])
def test_no_check_cell_shows_the_checkers_bool(name):
    """A checker prints its verdict and returns True or False (tests and ``if check(...):`` cells read it);
    a cell whose last line is the bare call would show that bool under the verdict, so it ends in ``;``,
    which IPython reads as "show no value" (its own test, ``DisplayHook.semicolon_at_end_of_expression``)."""
    calls = 0
    for cell in _code_cells(_read(name)):
        tree = ast.parse(cell.source)
        last = tree.body[-1] if tree.body else None
        if isinstance(last, ast.Expr) and isinstance(last.value, ast.Call):
            if CHECKER_CALL.fullmatch(ast.unparse(last.value.func)):
                calls += 1
                assert DisplayHook.semicolon_at_end_of_expression(cell.source), cell.source
    assert calls or name == "12_transformer_lab", name  # lab 12's check cells are `if check(...):`


def _commands(markdown: str) -> set[str]:
    """The shell commands a Markdown text gives: its ```bash blocks' lines (comments dropped) and its inline
    code that starts with ``make``, ``.venv/bin/``, ``.venv311/bin/`` or ``python`` (whitespace as one
    space: a span may break across lines)."""
    blocks = re.findall(r"```bash\n(.*?)```", markdown, re.S)
    found = {line.split(" #")[0].strip() for b in blocks for line in b.splitlines()}
    prose = re.sub(r"```.*?```", "", markdown, flags=re.S)
    found |= {" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)}
    return {c for c in found if c.startswith(("make ", ".venv/bin/", ".venv311/bin/", "python "))}


def test_lesson_00_gives_the_readmes_accelerator_commands():
    """Lesson 00's Colab/Kaggle section gives README's commands, no others (the student package's README
    too: the lesson ships there): README's installs of an accelerator's JAX, each one, and nothing else."""
    (section,) = [c.source for c in _read("00_setup").cells if c.get("id") == "colab-kaggle"]
    ours = _commands(section)
    readme = (ROOT / "README.md").read_text()
    student = (ROOT / "docs" / "student-README.md").read_text()
    accelerators = readme[readme.index("## Running on accelerators") :]
    accelerators = accelerators[: accelerators.index("\n## ")]
    installs = {c for c in _commands(accelerators) if 'pip install "jax[' in c}
    assert len(installs) == 3, installs  # TPU (JAX 0.12, JAX 0.10.2 on Python 3.11), CUDA 12
    assert {c for c in ours if "pip install" in c} == installs
    assert ours - _commands(readme) == set() and ours - _commands(student) == set()
    words = ("Colab", "Kaggle", "`platform`", '"tpu"', '"gpu"', "Python 3.11", "JAX 0.10.2")
    assert [w for w in words if w not in section] == []


def _solution_sizes(nb) -> list[int]:
    """Lines of code (not blank, not comments) in each exercise's solution cell, in order."""
    sizes = []
    for cell in _code_cells(nb):
        inside, lines, found = False, 0, False
        for line in cell.source.splitlines():
            if BEGIN.match(line):
                inside = found = True
            elif END.match(line):
                inside = False
            elif inside and line.strip() and not line.strip().startswith("#"):
                lines += 1
        if found:
            sizes.append(lines)
    return sizes


@pytest.mark.parametrize("name", [*LESSONS, "08_lab"])
def test_exercise_floors(name):
    """At least three exercises per lesson, at most one a one-liner, and one project of 8 lines or more;
    the lab: at least two, one of them a whole strategy of 15 lines or more."""
    sizes = _solution_sizes(_read(name))
    print(f"{name}: {len(sizes)} exercises, solution lines {sizes}")
    if name == "08_lab":
        assert len(sizes) >= 2 and max(sizes) >= 15, sizes
        return
    assert len(sizes) >= 3, sizes
    assert sum(n <= 1 for n in sizes) <= 1, f"more than one one-line exercise: {sizes}"
    assert max(sizes) >= 8, f"no project exercise (8 lines or more): {sizes}"


@pytest.mark.notebook
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xdist_group(f"matrix-n{matrix.STUDENT_COUNT}"))
        for n in LESSONS
    ],
)
def test_student_version_runs_to_the_end_with_every_check_printing_its_hint(name):
    # The matrix's run of the lesson at STUDENT_COUNT devices is its student version (tests/matrix.py).
    assert matrix.runs_student_version(name, matrix.STUDENT_COUNT)
    folder = matrix.notebook_run(name, matrix.STUDENT_COUNT)
    student = nbformat.read(folder / f"{name}.ipynb", as_version=4)
    assert "BEGIN SOLUTION" not in "".join(c.source for c in student.cells)
    errors = [
        (c.source[:80], o.ename, o.evalue[:200])
        for c in _code_cells(student)
        for o in c.outputs
        if o.output_type == "error"
    ]
    assert not errors, errors
    checks = [c for c in _code_cells(student) if "exercise-check" in c.metadata.get("tags", [])]
    assert checks
    for c in checks:
        text = "".join(o.get("text", "") for o in c.outputs if o.output_type == "stream")
        assert "not written yet" in text and "hint:" in text, (c.source, text)


def test_student_package_has_no_solution_text(tmp_path):
    import zipfile

    from course_tools.student import package, solution_lines

    zip_path = package(ROOT, tmp_path / "student.zip")
    with zipfile.ZipFile(zip_path) as z:
        names = z.namelist()
        assert (
            "jax-course/course_tools/checks/_common.py" in names
            and "jax-course/requirements.txt" in names
            and "jax-course/requirements-py311.txt" in names  # make setup with Python 3.11 needs it
        )
        for name in LESSONS:
            text = z.read(f"jax-course/notebooks/{name}.ipynb").decode()
            solved = "\n".join(c.source for c in _code_cells(_read(name)))
            leaked = [line for line in solution_lines(solved) if line in text]
            assert not leaked, (name, leaked[:3])
            assert "BEGIN SOLUTION" not in text
    with pytest.raises(FileExistsError, match="--overwrite"):
        package(ROOT, zip_path)


def test_show_error_returns_the_error_and_refuses_success(capsys):
    from course_tools.checks import show_error

    err = show_error(int, "eight")
    assert isinstance(err, ValueError) and "ValueError: invalid literal" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="expected an error"):
        show_error(int, "8")


def _solution_blocks(nb) -> list[list[str]]:
    """Each solution block's distinctive lines (stripped, 20 characters or more, not comments)."""
    blocks = []
    for cell in _code_cells(nb):
        block = None
        for line in cell.source.splitlines():
            if BEGIN.match(line):
                block = []
            elif END.match(line) and block is not None:
                blocks.append(block)
                block = None
            elif block is not None and len(line.strip()) >= 20 and not line.strip().startswith("#"):
                block.append(line.strip())
    return [b for b in blocks if b]


def test_no_file_of_the_student_package_holds_a_solution(tmp_path):
    """Everything in the zip (the library and the checkers too), not only the notebooks: no file holds
    half or more of any solution's distinctive lines."""
    import zipfile

    from course_tools.student import package

    with zipfile.ZipFile(package(ROOT, tmp_path / "student.zip")) as z:
        texts = {}
        for name in z.namelist():
            try:
                texts[name] = z.read(name).decode()
            except UnicodeDecodeError:
                continue
    worst = []
    for name in [*LESSONS, "08_lab"]:
        for block in _solution_blocks(_read(name)):
            share, where = max(
                (sum(line in t for line in block) / len(block), f) for f, t in texts.items()
            )
            worst.append((share, name, where))
            assert share < 0.5, f"{where} holds {share:.0%} of a solution of {name}: {block[:3]}"
    print("largest share of a solution in one packaged file:", max(worst))

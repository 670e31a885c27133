"""The student-version generator."""

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

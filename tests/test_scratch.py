"""Lessons 07 and 09 write to the temporary folder — 07 its profiler traces (``jax-trace-*``), 09 its scratch
folder (``course-09-*``: the inputs, the workers' outputs, a checkpoint) — and remove what they wrote by the
end of the run."""

import matrix
import pytest

from course_tools.execution import execute


@pytest.mark.notebook
def test_lesson_07_leaves_no_trace_folder():
    tmp = matrix.notebook_run("07_debugging", matrix.COUNTS[0]) / "tmp"  # the run's own TMPDIR
    assert tmp.is_dir()
    assert not sorted(p.name for p in tmp.iterdir()), "left in the temporary folder"


@pytest.mark.notebook
def test_lesson_09_leaves_no_scratch_folder(tmp_path):
    # A run of its own: the matrix's runs keep the scratch folder (COURSE_KEEP_SCRATCH=1) for the comparisons.
    (tmp_path / "tmp").mkdir()
    execute(
        matrix.NOTEBOOKS[matrix.MULTIHOST],
        tmp_path / "09.ipynb",
        {"n_devices": 1, "platform": "cpu"},
        progress=False,
        env={"TMPDIR": str(tmp_path / "tmp"), "COURSE_KEEP_SCRATCH": None},
    )
    assert not sorted(p.name for p in (tmp_path / "tmp").iterdir()), "left in the temporary folder"

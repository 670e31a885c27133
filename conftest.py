"""Root pytest configuration: everything a test run writes goes to a temporary build folder.

Notebooks executed by nbmake inherit ``COURSE_BUILD_DIR`` (their kernels start from this process's
environment), so the lab's ``results_dir="auto"`` writes there, never into the reader's ``build/``.
"""

import os
import tempfile

os.environ.setdefault("COURSE_BUILD_DIR", tempfile.mkdtemp(prefix="course-test-build-"))
# The solution notebooks must answer every exercise: an answer left unwritten fails their run instead of
# printing its hint (the student-version tests unset this).
os.environ.setdefault("COURSE_STRICT_CHECKS", "1")

"""Root pytest configuration: everything a test run writes goes to a temporary build folder.

Notebooks executed by nbmake inherit ``COURSE_BUILD_DIR`` (their kernels start from this process's
environment), so the lab's ``results_dir="auto"`` writes there, never into the reader's ``build/``.
"""

import os
import tempfile

os.environ.setdefault("COURSE_BUILD_DIR", tempfile.mkdtemp(prefix="course-test-build-"))

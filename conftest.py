"""Root pytest configuration: everything a test run writes goes to a temporary build folder.

Notebooks executed by nbmake inherit ``COURSE_BUILD_DIR`` (their kernels start from this process's
environment), so the lab's ``results_dir="auto"`` writes there, never into the reader's ``build/``.
"""

import os
import tempfile

_CACHE_VARIABLES = ("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "JAX_ENABLE_COMPILATION_CACHE")

os.environ.setdefault("COURSE_BUILD_DIR", tempfile.mkdtemp(prefix="course-test-build-"))
# The solution notebooks must answer every exercise: an answer left unwritten fails their run instead of
# printing its hint (the student-version tests unset this).
os.environ.setdefault("COURSE_STRICT_CHECKS", "1")

# One persistent compilation cache for the whole session (its kernels, the checkers' subprocesses, the
# multi-process workers and the tests inherit these variables): a program that one run compiled is loaded
# by every later run of the same program on the same device count (nbmake's lessons and their student
# versions, a lab's own repeats, the checkers' 4-device subprocesses) instead of being compiled again.
# The lessons that assert on compile times they measure switch it off in their setup cell
# (setup_devices(..., measures_compiles=True); tests/matrix.py TIMES_COMPILES).
# Always a folder of this session's own (the pytest-xdist workers inherit the controller's choice): a cache
# the shell names is not filled with the tests' programs, and no cache setting from the shell applies.
if "COURSE_TEST_JAX_CACHE" not in os.environ:
    for var in [v for v in os.environ if v.startswith(_CACHE_VARIABLES)]:
        del os.environ[var]
    os.environ["COURSE_TEST_JAX_CACHE"] = tempfile.mkdtemp(
        prefix="jax-cache-", dir=os.environ["COURSE_BUILD_DIR"]
    )
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["COURSE_TEST_JAX_CACHE"]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # the lessons' small programs too
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

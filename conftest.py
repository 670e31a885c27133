"""Root pytest configuration: everything a test run writes goes to a temporary build folder.

Notebooks executed by nbmake inherit ``COURSE_BUILD_DIR`` (their kernels start from this process's
environment), so the lab's ``results_dir="auto"`` writes there, never into the reader's ``build/``.
"""

import os
import shutil
import tempfile

_CACHE_VARIABLES = ("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "JAX_ENABLE_COMPILATION_CACHE")

# A build folder of this session's own (the pytest-xdist workers inherit it): removed when the session
# passes, kept and named when it fails. One the shell names is the shell's, and left alone.
_MADE_BUILD_DIR = "COURSE_BUILD_DIR" not in os.environ
if _MADE_BUILD_DIR:  # (setdefault would make a folder in every worker, and leave it)
    os.environ["COURSE_BUILD_DIR"] = tempfile.mkdtemp(prefix="course-test-build-")
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


def _owns_build_dir(config) -> bool:
    return _MADE_BUILD_DIR and not hasattr(
        config, "workerinput"
    )  # the controller, not an xdist worker


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _owns_build_dir(config) and exitstatus != 0:
        terminalreporter.write_line(
            f"the session's build folder is kept for a look: {os.environ['COURSE_BUILD_DIR']}"
        )


def pytest_sessionfinish(session, exitstatus):
    """A passing session leaves nothing in the temporary folder (its runs and compilation cache are
    hundreds of MB)."""
    if _owns_build_dir(session.config) and exitstatus == 0:
        shutil.rmtree(os.environ["COURSE_BUILD_DIR"], ignore_errors=True)

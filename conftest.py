"""Root pytest configuration: everything a test run writes goes to a temporary build folder.

Notebooks executed by nbmake inherit ``COURSE_BUILD_DIR`` (their kernels start from this process's
environment), so the lab's ``results_dir="auto"`` writes there, never into the reader's ``build/``.
The summary ends with the CPU time the tests took, by file (:func:`cpu_table`); with ``COURSE_CPU_JSON=path``
every test's CPU seconds are also written to that JSON file.
"""

import json
import os
import resource
import shutil
import tempfile

import pytest

# `make test LOAD=1` starts pytest from make, whose variables (MAKEFLAGS, MAKEOVERRIDES: "LOAD=1") and depth
# (MAKELEVEL) every child would inherit: a test's own `make bench` would be refused ("takes no LOAD") and
# print make's "Entering directory" lines. The tests' make commands run as from a shell.
for _var in ("MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES", "MAKELEVEL"):
    os.environ.pop(_var, None)

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

# --- compile time: most of the suite's CPU time is XLA:CPU compiling hundreds of small programs per run ----
# The session compiles with LLVM's optimisations off (the HLO passes, and so every partitioning, collective,
# FLOP and buffer the lessons read, are unchanged; the code runs a little slower): measured on the papermill
# runs of notebooks 06, 08, 10 and 11 at 4 devices, 9-25% less CPU time. nbmake's runs of the notebooks as
# committed compile so too, and load the programs the matrix compiled; make test's second environment runs
# them with the shell's flags (COURSE_NBMAKE_SHELL_FLAGS=1, tests/matrix.py), so that every notebook still
# runs once exactly as a learner runs it. The kernels do not probe these flags again (course_lib.devices.FLAGS_CHECKED).
FAST_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_parallel_codegen_split_count=1",
)
SHELL_XLA_FLAGS = "COURSE_SHELL_XLA_FLAGS"
if SHELL_XLA_FLAGS not in os.environ:  # the controller; the xdist workers inherit both variables
    os.environ[SHELL_XLA_FLAGS] = os.environ.get("XLA_FLAGS", "")
    _given = os.environ[SHELL_XLA_FLAGS].split()
    _names = {f.split("=", 1)[0] for f in _given}
    _ours = [f for f in FAST_COMPILE_FLAGS if f.split("=", 1)[0] not in _names]  # the shell's win
    os.environ["XLA_FLAGS"] = " ".join([*_given, *_ours])
os.environ["COURSE_XLA_FLAGS_CHECKED"] = os.environ["XLA_FLAGS"]

# --- one compiled program for every device count ------------------------------------------------------------
# JAX's persistent cache key holds the CPU client's topology, i.e. its device count, so a program compiled on
# 4 simulated devices is compiled again on 1, 2 and 8, even when it runs on one device (most of a lesson's
# small programs) or on the same devices. The device assignment, the number of partitions and the program
# itself are in the key anyway: in this session the topology is replaced by the devices the program runs on
# (platform, kind and id), on CPU only. Every kernel runs SHARE_ACROSS_COUNTS at its start (an IPython
# startup file in the session's own IPYTHONDIR); so do the test processes. A JAX without this private
# function compiles as before.
SHARE_ACROSS_COUNTS = """
def _course_share_programs_across_device_counts():
    try:
        from jax._src import cache_key
    except ImportError:
        return
    original = getattr(cache_key, "_hash_accelerator_config", None)
    hash_string = getattr(cache_key, "_hash_string", None)
    if original is None or hash_string is None or getattr(original, "course_shared", False):
        return

    def by_devices(hash_obj, accelerators):
        devices = list(accelerators.flat)
        if not devices or any(d.platform != "cpu" for d in devices):
            return original(hash_obj, accelerators)
        for d in devices:
            hash_string(hash_obj, f"cpu:{d.device_kind}:{d.id}")

    by_devices.course_shared = True
    cache_key._hash_accelerator_config = by_devices


_course_share_programs_across_device_counts()
"""
if "COURSE_TEST_IPYTHONDIR" not in os.environ:
    _ipython = os.path.join(os.environ["COURSE_BUILD_DIR"], "ipython")
    os.makedirs(os.path.join(_ipython, "profile_default", "startup"), exist_ok=True)
    with open(
        os.path.join(_ipython, "profile_default", "startup", "00-course-tests.py"), "w"
    ) as _f:
        _f.write(SHARE_ACROSS_COUNTS)
    with open(os.path.join(_ipython, "profile_default", "ipython_kernel_config.py"), "w") as _f:
        _f.write(
            "c.HistoryManager.enabled = False  # many kernels at once: no shared history file\n"
        )
    os.environ["COURSE_TEST_IPYTHONDIR"] = _ipython
os.environ["IPYTHONDIR"] = os.environ["COURSE_TEST_IPYTHONDIR"]
exec(SHARE_ACROSS_COUNTS)


def _owns_build_dir(config) -> bool:
    return _MADE_BUILD_DIR and not hasattr(
        config, "workerinput"
    )  # the controller, not an xdist worker


# --- where the suite's time goes: CPU seconds per test, whatever the load ----------------------------------
# On a shared machine wall times say little; CPU time (this process and every child it waited for: the
# notebooks' kernels, their multi-process workers, the checkers' subprocesses) does not grow with the load.
# Each test's CPU, setup to teardown, travels in its report (pytest-xdist sends it to the controller), and the
# summary adds them up: the suite is CPU-bound, so on 2 idle cores its wall time is about the total / 2.
CPU_KEY = "cpu_s"
_CPU_START = pytest.StashKey[float]()
_CPU_BY_FILE: dict[str, float] = {}
_CPU_BY_TEST: dict[str, float] = {}


def _cpu_now() -> float:
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_CPU_START] = _cpu_now()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "teardown" and _CPU_START in item.stash:
        item.user_properties.append((CPU_KEY, round(_cpu_now() - item.stash[_CPU_START], 2)))
    yield


_BY_GROUP: dict[
    str, list[float]
] = {}  # group -> [CPU seconds, seconds the tests took (summed over workers)]


def group_of(nodeid: str) -> str:
    """The suite's groups, for its closing summary: ``matrix`` (the notebooks under papermill at 1, 2, 4
    devices, tests/test_invariance.py), ``nbmake`` (every notebook as committed), ``checkers``
    (tests/test_checks_*.py) and ``other``."""
    path = nodeid.split("::")[0]
    if path.endswith(".ipynb"):
        return "nbmake"
    if path.endswith("test_invariance.py"):
        return "matrix"
    if path.rsplit("/", 1)[-1].startswith("test_checks_"):
        return "checkers"
    return "other"


def pytest_runtest_logreport(report):
    group = _BY_GROUP.setdefault(group_of(report.nodeid), [0.0, 0.0])
    group[1] += report.duration
    for key, value in report.user_properties if report.when == "teardown" else ():
        if key == CPU_KEY:
            group[0] += float(value)
        if key == CPU_KEY:
            _CPU_BY_TEST[report.nodeid] = float(value)
            where = report.nodeid.split("::")[0]
            if "::test_notebook_runs[" in report.nodeid:  # the matrix's runs, by device count
                where += f" runs at n={report.nodeid.rsplit('-n', 1)[1].rstrip(']')}"
            _CPU_BY_FILE[where] = _CPU_BY_FILE.get(where, 0.0) + float(value)


def cpu_table(by_file: dict[str, float], top: int = 15) -> list[str]:
    """The summary's lines: the total CPU seconds, the 2-core estimate, the ``top`` files by CPU."""
    total = sum(by_file.values())
    lines = [
        f"CPU time of the tests: {total:,.0f} s (on 2 idle cores at least {total / 2:,.0f} s of wall time, "
        "plus the workers' start-up)"
    ]
    ranked = sorted(by_file.items(), key=lambda kv: -kv[1])
    lines += [f"  {s:8,.1f} s  {f}" for f, s in ranked[:top]]
    if len(ranked) > top:
        rest = sum(s for _, s in ranked[top:])
        lines.append(f"  {rest:8,.1f} s  the other {len(ranked) - top} files")
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _CPU_BY_FILE and not hasattr(config, "workerinput"):
        for line in cpu_table(_CPU_BY_FILE):
            terminalreporter.write_line(line)
        terminalreporter.write_line(
            "by group (CPU seconds; seconds the tests took, summed over workers):"
        )
        for name, (cpu, took) in sorted(_BY_GROUP.items(), key=lambda kv: -kv[1][0]):
            terminalreporter.write_line(f"  {name:8s} {cpu:8,.1f} s CPU  {took:8,.1f} s")
        if os.environ.get("COURSE_CPU_JSON"):  # every test's CPU seconds, for a closer look
            with open(os.environ["COURSE_CPU_JSON"], "w") as f:
                json.dump(dict(sorted(_CPU_BY_TEST.items(), key=lambda kv: -kv[1])), f, indent=1)
            terminalreporter.write_line(f"each test's CPU seconds: {os.environ['COURSE_CPU_JSON']}")
    if _owns_build_dir(config) and exitstatus != 0:
        terminalreporter.write_line(
            f"the session's build folder is kept for a look: {os.environ['COURSE_BUILD_DIR']}"
        )


def pytest_sessionfinish(session, exitstatus):
    """A passing session leaves nothing in the temporary folder (its runs and compilation cache are
    hundreds of MB)."""
    if _owns_build_dir(session.config) and exitstatus == 0:
        shutil.rmtree(os.environ["COURSE_BUILD_DIR"], ignore_errors=True)

"""The notebook runs of the invariance matrix, made once per test session and shared by every test that
needs them, whichever pytest-xdist worker asks first.

A run is a folder under ``$COURSE_BUILD_DIR/matrix`` (the root conftest makes that folder for the whole
session; the workers inherit the variable). :func:`ensure` makes it under an exclusive ``flock``: a second
process asking for the same run waits for it instead of repeating it, and a run that failed fails again at
once with the same message instead of being retried.

Counts: ``COURSE_MATRIX_COUNTS`` (default ``"1 2 4"``; e.g. ``3`` for the odd-count promise). The fourth
count, 8, is the default ``pytest`` run's nbmake column: nbmake executes every notebook as committed (8
simulated devices) and its run of notebook 09 is the matrix's 09 at 8 (:func:`nbmake_stands_in`); the lab's
tiny profile, compared across counts, runs under papermill at 8 as well (the lab as committed is its larger
default profile).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from course_lib import config
from course_tools import params as nb_params
from course_tools import run
from course_tools.execution import execute

BASE = Path(os.environ["COURSE_BUILD_DIR"]) / "matrix"
COUNTS = tuple(int(c) for c in os.environ.get("COURSE_MATRIX_COUNTS", "1 2 4").split())
"""The counts at which every notebook runs under papermill with ``n_devices`` injected."""
NOTEBOOKS = {p.stem: p for p in run.course_notebooks()}
LAB, MULTIHOST = "08_lab", "09_multihost"
DEFAULTS_COUNT = 8
"""nbmake's count: the notebooks as committed run on 8 simulated CPU devices."""


def _tiny_batch(n: int) -> int:
    with contextlib.redirect_stdout(io.StringIO()):  # its note on a rounded batch
        return config.resolve_profile("tiny", "cpu", n_devices=n).global_batch


COMPARED = (
    (*COUNTS, DEFAULTS_COUNT)
    if DEFAULTS_COUNT not in COUNTS and _tiny_batch(DEFAULTS_COUNT) == _tiny_batch(COUNTS[0])
    else COUNTS
)
"""The counts whose results are compared: the matrix's and nbmake's; the first is the reference. (At
counts that do not divide the tiny profile's batch of 32, e.g. ``MATRIX=3``, the batch is rounded up and
the losses differ: 8 is then left out.)"""
STUDENT_COUNT = 1
"""The count at which the matrix runs each lesson's **student version** (solutions replaced by stubs, no
strict checks: every checker prints "not written yet" and the run goes on). That run is both the lesson at
this count — every cell but the solutions, with its own asserts — and the student version's run to the end
(``tests/test_lessons.py``), instead of two runs. The solutions themselves run at the other counts and at 8
(nbmake); the checkers are also tested on their own (``tests/test_checks_*.py``)."""
LABS = ("08_lab",)
"""The capstone labs: their student versions are not run here (their exercises are whole strategies)."""
TIMES_COMPILES = ("02_jit", "07_debugging")
SCRATCH_CHECKED = ("07_debugging", MULTIHOST)
"""The lessons that write to the temporary folder (profiler traces; 09's scratch folder): each matrix run
of them gets one of its own, ``<run>/tmp``, and test_scratch checks what they leave there."""
"""The lessons that time compiles: their setup switches the session's persistent compilation cache (root
conftest) off (``setup_devices(..., measures_compiles=True)``)."""
PRESET_ENV = {1: {"MPLBACKEND": "Agg"}, 4: {"JAX_NUM_CPU_DEVICES": "2"}}
"""Variables a user may bring, preset for the runs at a count: a non-inline plot backend (the plots must
still appear, see test_invariance) and another device count (setup_devices must override it)."""


class RunFailed(AssertionError):
    """A shared run failed (earlier, perhaps in another process): its message, repeated."""


@contextlib.contextmanager
def _locked(name: str):
    BASE.mkdir(parents=True, exist_ok=True)
    with open(BASE / f"{name.replace('/', '_')}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure(name: str, produce: Callable[[Path], object]) -> Path:
    """``BASE/name``, made by ``produce(folder)`` once per session; waits while another process makes it."""
    folder = BASE / name
    with _locked(name):
        failed = BASE / f"{name.replace('/', '_')}.failed"
        if failed.exists():
            raise RunFailed(failed.read_text())
        if not (folder / ".done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            try:
                produce(folder)
            except Exception as e:
                failed.write_text(f"{name}: {e}")
                raise
            (folder / ".done").touch()
    return folder


def course_run() -> Path:
    """``make course`` at 2 devices for 00 and the lab (tiny, with its scaling sweep): the course command's
    own test and the book's input (test_run), and the matrix's runs of 00 and 08 at 2 devices."""

    def produce(folder: Path):
        lab = {"profile": "tiny", "scaling": True}
        made = run.run_course(
            2, platform="cpu", build=str(folder), only=["00", "08"], progress=False, lab_params=lab
        )
        (folder / "course.json").write_text(json.dumps({"course": str(made)}))

    folder = ensure("course-n2", produce)
    return Path(json.loads((folder / "course.json").read_text())["course"])


def parameters(stem: str, n: int, folder: Path) -> dict:
    """The papermill parameters of ``stem`` at ``n`` devices (the lab: profile tiny, no scaling sweep)."""
    injected = {"n_devices": n, "platform": "cpu"}
    if stem == LAB:
        injected.update(profile="tiny", scaling=False, results_dir=str(folder / "lab"))
    if (
        stem == nb_params.LAB12.removesuffix(".ipynb")
        and nb_params.lab12_batch(n) != nb_params.LAB12_BATCH
    ):
        injected["global_batch"] = nb_params.lab12_batch(
            n
        )  # e.g. MATRIX=3: a batch its layouts split
    return injected


def runs_student_version(stem: str, n: int) -> bool:
    """True when the matrix's run of ``stem`` at ``n`` devices is its student version (:data:`STUDENT_COUNT`)."""
    return n == STUDENT_COUNT and stem not in LABS


def _student_copy(stem: str, folder: Path) -> Path:
    """The student version of ``stem``, written to ``folder/src`` (the kernel's working folder)."""
    import nbformat

    from course_tools.student import student_notebook

    nb, _ = student_notebook(nbformat.read(NOTEBOOKS[stem], as_version=4), stem)
    (folder / "src").mkdir()
    path = folder / "src" / f"{stem}.ipynb"
    nbformat.write(nb, path)
    return path


def notebook_run(stem: str, n: int) -> Path:
    """The folder holding ``stem`` executed at ``n`` devices.

    The lab runs at profile tiny without its scaling sweep; notebooks 07 and 09 get a temporary folder of
    their own, ``<folder>/tmp`` (what a run leaves there is tested); 09 is told to keep its scratch folder
    there (its inputs and the workers' ``process_<i>.json``, which :func:`multihost_outputs` reads). At
    :data:`STUDENT_COUNT` a lesson runs as its student version (:func:`runs_student_version`).
    """
    if n == 2 and stem in ("00_setup", LAB):
        return course_run()

    def produce(folder: Path):
        env = dict(PRESET_ENV.get(n, {}))
        if (
            stem in SCRATCH_CHECKED
        ):  # a temporary folder of its own: what the run leaves there shows
            (folder / "tmp").mkdir()
            env["TMPDIR"] = str(folder / "tmp")
        if stem == MULTIHOST:
            env["COURSE_KEEP_SCRATCH"] = "1"  # 09 keeps its workers' outputs for multihost_outputs
        nb = NOTEBOOKS[stem]
        if runs_student_version(stem, n):
            nb = _student_copy(stem, folder)
            # as a learner runs it: an unwritten answer prints its hint
            env["COURSE_STRICT_CHECKS"] = None
        execute(nb, folder / nb.name, parameters(stem, n, folder), progress=False, env=env)

    return ensure(f"n{n}/{stem}", produce)


@contextlib.contextmanager
def nbmake_stands_in(stem: str):
    """Around nbmake's run of ``stem`` as committed: when that is the matrix's run of it at 8 devices (09,
    whose committed defaults are 8 CPU devices, and 8 is not a papermill count), record it as that run —
    its scratch folder is the run's ``tmp`` — instead of running it a second time under papermill. A run
    the comparisons already made is left alone (nbmake then runs on its own)."""
    if stem != MULTIHOST or DEFAULTS_COUNT in COUNTS or not _defaults_are(stem, DEFAULTS_COUNT):
        yield
        return
    name = f"n{DEFAULTS_COUNT}/{stem}"
    folder, failed = BASE / name, BASE / f"{name.replace('/', '_')}.failed"
    with _locked(name):
        if not ((folder / ".done").exists() or failed.exists()):
            shutil.rmtree(folder, ignore_errors=True)
            (folder / "tmp").mkdir(parents=True)
            before = {k: os.environ.get(k) for k in ("TMPDIR", "COURSE_KEEP_SCRATCH")}
            os.environ["TMPDIR"] = str(folder / "tmp")  # the kernel nbmake starts inherits it
            os.environ["COURSE_KEEP_SCRATCH"] = "1"  # and keeps its scratch folder there
            try:
                yield
            except BaseException as e:
                failed.write_text(f"{name} (nbmake's run of {stem}.ipynb): {e}")
                raise
            finally:
                for k, v in before.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            (folder / ".done").touch()
            return
    yield


def _defaults_are(stem: str, n: int) -> bool:
    """True when ``stem`` as committed runs on ``n`` simulated CPU devices (no GPU in the test session)."""
    import jax
    import papermill as pm

    declared = {name: p["default"] for name, p in pm.inspect_notebook(str(NOTEBOOKS[stem])).items()}
    cpu = (
        declared.get("platform", "'auto'").strip("'\"") in ("auto", "cpu")
        and jax.default_backend() == "cpu"
    )
    return cpu and declared.get("n_devices") == str(n)


def lab_results(n: int) -> Path:
    """The tiny-profile lab's results folder at ``n`` devices."""
    return notebook_run(LAB, n) / "lab"


def multihost_outputs(n: int) -> list[dict]:
    """Process 0's output of every launch notebook 09 made at ``n`` devices that trained (with losses)."""
    found = sorted((notebook_run(MULTIHOST, n) / "tmp").rglob("process_0.json"))
    outputs = [json.loads(p.read_text()) for p in found]
    return [o for o in outputs if o.get("strategies")]


NBMAKE_SHELL_FLAGS = "COURSE_NBMAKE_SHELL_FLAGS"
"""``COURSE_NBMAKE_SHELL_FLAGS=1``: nbmake runs the notebooks with the shell's ``XLA_FLAGS`` (LLVM's
optimisations on, as a learner runs them) instead of the session's fast-compile flags. make test sets it for
the second environment's run, so that every notebook is still run once per ``make test`` exactly as a learner
runs it (on JAX 0.10.2); in the course's environment nbmake compiles as the matrix does, and loads every
program the matrix's runs at 1, 2 and 4 devices compiled (e.g. notebook 11 at 8 devices after its run at 4:
40 of 267 programs compiled, 60 CPU-s, against 259 and 117 CPU-s with the shell's flags)."""


def nbmake_keeps_shell_flags() -> bool:
    """True when nbmake's runs keep the shell's ``XLA_FLAGS`` (:data:`NBMAKE_SHELL_FLAGS` is ``1``)."""
    value = os.environ.get(NBMAKE_SHELL_FLAGS, "0")
    if value not in ("0", "1"):
        raise ValueError(
            f"{NBMAKE_SHELL_FLAGS}={value!r} is not 0 or 1 (1: nbmake keeps the shell's flags)"
        )
    return value == "1"


def with_shell_flags(runtest: Callable[[], object]) -> Callable[[], None]:
    """``runtest`` (nbmake's run of a notebook as committed) with the shell's ``XLA_FLAGS``: the kernel it
    starts from this process's environment runs what a learner runs, not the session's fast-compile flags
    (root conftest ``FAST_COMPILE_FLAGS``)."""

    def run():
        session = os.environ["XLA_FLAGS"]
        os.environ["XLA_FLAGS"] = os.environ["COURSE_SHELL_XLA_FLAGS"]
        if not os.environ["XLA_FLAGS"]:
            del os.environ["XLA_FLAGS"]
        try:
            runtest()
        finally:
            os.environ["XLA_FLAGS"] = session

    return run

"""The notebook runs of the invariance matrix, made once per test session and shared by every test that
needs them, whichever pytest-xdist worker asks first.

A run is a folder under ``$COURSE_BUILD_DIR/matrix`` (the root conftest makes that folder for the whole
session; the workers inherit the variable). :func:`ensure` makes it under an exclusive ``flock``: a second
process asking for the same run waits for it instead of repeating it, and a run that failed fails again at
once with the same message instead of being retried.

Counts: ``COURSE_MATRIX_COUNTS`` (default ``"1 2 4 8"``; e.g. ``3`` for the odd-count promise).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from course_tools import run
from course_tools.execution import execute

BASE = Path(os.environ["COURSE_BUILD_DIR"]) / "matrix"
COUNTS = tuple(int(c) for c in os.environ.get("COURSE_MATRIX_COUNTS", "1 2 4 8").split())
NOTEBOOKS = {p.stem: p for p in run.course_notebooks()}
LAB, MULTIHOST = "08_lab", "09_multihost"
DEFAULTS_COUNT = 8
"""At this count every notebook runs exactly as committed (no parameter injected): what a learner gets by
opening it, and what nbmake used to check. A lesson whose defaults are this count on the CPU is not run a
second time with the parameters injected; the lab is (its tiny profile is the one compared across counts)."""
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


def parameters(stem: str, n: int, folder: Path, defaults: bool = False) -> dict:
    """The papermill parameters of ``stem`` at ``n`` devices (none for the as-committed run)."""
    if stem == LAB:
        lab = {"results_dir": str(folder / "lab")}
        return (
            lab
            if defaults
            else {"n_devices": n, "platform": "cpu", "profile": "tiny", "scaling": False, **lab}
        )
    return {} if defaults else {"n_devices": n, "platform": "cpu"}


def notebook_run(stem: str, n: int, defaults: bool = False) -> Path:
    """The folder holding ``stem`` executed at ``n`` devices (``defaults``: as committed, no parameters).

    The lab runs at profile tiny without its scaling sweep; notebook 09's scratch folders (its inputs and
    the workers' ``process_<i>.json``) go to ``<folder>/tmp``.
    """
    if n == 2 and stem in ("00_setup", LAB) and not defaults:
        return course_run()
    if n == DEFAULTS_COUNT and stem != LAB and not defaults and _defaults_are(stem, n):
        defaults = True  # the same run: share it
    name = f"n{n}{'-defaults' if defaults else ''}/{stem}"

    def produce(folder: Path):
        env = {} if defaults else dict(PRESET_ENV.get(n, {}))
        if stem == MULTIHOST:
            (folder / "tmp").mkdir()
            env["TMPDIR"] = str(folder / "tmp")
        nb = NOTEBOOKS[stem]
        execute(
            nb, folder / nb.name, parameters(stem, n, folder, defaults), progress=False, env=env
        )

    return ensure(name, produce)


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
    """Process 0's output of every launch notebook 09 made at ``n`` devices (the working run first)."""
    found = sorted((notebook_run(MULTIHOST, n) / "tmp").glob("course-09-*/run*/process_0.json"))
    return [json.loads(p.read_text()) for p in found]

"""Output folders of the course's commands: checked before work starts, claimed by one run, described
afterwards, found again.

Every command that writes (``course_tools.run`` lab / course / scaling, the book, the student package, the
lab's results folder, the multi-process launcher, ``tools/make_reference.py``) checks its folder first
with :func:`check_folder`: writable (a file is written and removed: permission bits do not tell, root
ignores them, a read-only mount shows them writable) and with room for what the step writes
(:data:`WRITES_MB`, measured). A run folder is claimed with :func:`claim_run_dir`, which writes
:data:`CLAIM_FILE` (start time, process, host, command, the git commit of the course) and
:func:`finish_run` adds how it ended. A command that reads an earlier run (``make site`` reads a course
run) names it with :func:`describe` and says when a newer one exists or the run is of another commit
(:func:`newest_run`, :func:`notes_on`).

Taught by none of the notebooks: plumbing of the course's commands.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

MIN_FREE_MB = 50
"""Free space every output folder needs before a step starts, whatever the step writes: room for logs and
temporary files beside the outputs."""
WRITES_MB = {
    "lab": 2,  # an executed lab at the CPU profile with its CSVs and plots: 0.7 MB (tiny), 1.5 MB (cpu)
    "course": 12,  # ten executed notebooks and the lab's results: about 6 MB
    "book": 60,  # the Sphinx book of a course run: about 25 MB, and as much again while it is staged
    "student": 4,  # the student notebooks (0.5 MB) and the zip (0.4 MB)
}
"""What each step writes, in MB: about twice the size measured on the reference machine (the sizes grow
with the outputs a lesson prints). :func:`check_folder` asks for at least this much free space."""

CLAIM_FILE = "run.json"
"""Written first, exclusively, into a run folder: which command owns it (start time, pid, host, command,
git commit), then how it ended (:func:`finish_run`)."""


class FolderError(ValueError):
    """An output folder that cannot be used; the message names it and the fix."""


def free_mb(path: str | os.PathLike) -> float:
    """Free space in MB on the file system holding ``path`` (its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free / 2**20


def check_folder(
    path: str | os.PathLike,
    what: str = "build folder",
    fix: str = "",
    writes_mb: float = 0,
) -> Path:
    """Make sure ``path`` is a folder this process can write, with room for a step; create it if needed.

    Args:
      path: the folder.
      what: its name in messages ("build folder", "results folder", ...).
      fix: what to do instead, for the message ("give a writable folder with --build DIR").
      writes_mb: what the step will write there, MB; at least ``max(MIN_FREE_MB, writes_mb)`` must be free.

    Raises:
      FolderError (a ``ValueError``): a file in the way, a folder that cannot be created or written, or
        too little free space; the message names the folder, the cause and ``fix``.
    """
    path = Path(path)
    fix = fix or "choose another folder"
    if not str(path).strip():
        raise FolderError(f"the {what} is empty; give a folder such as 'build'")
    made = [p for p in (path, *path.parents) if not p.exists()]  # removed again when refused
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except FileExistsError:
        raise FolderError(f"the {what} {path} is a file, not a folder: {fix}") from None
    except OSError as e:
        raise FolderError(f"cannot write the {what} {path} ({e.strerror or e}): {fix}") from None
    need = max(MIN_FREE_MB, writes_mb)
    free = free_mb(path)
    if free < need:
        for folder in made:  # innermost first: only the empty folders this check made
            with contextlib.suppress(OSError):
                folder.rmdir()
        step = f"this step writes about {writes_mb:g} MB and " if writes_mb else ""
        raise FolderError(
            f"only {free:.1f} MB free for the {what} {path}; {step}a run needs at least {need:g} MB "
            f"free: make room there, or {fix}"
        )
    return path


class WriteFailed(OSError):
    """Writing an output failed (a full disk, a quota, a folder made read-only): ``OSError(errno,
    message)`` whose text is the message alone (:func:`write_error`), without the ``[Errno 28]`` prefix."""

    def __str__(self) -> str:
        return str(self.strerror)


def write_error(error: OSError, target: str | os.PathLike, fix: str = "") -> str:
    """One sentence for an ``OSError`` met while writing ``target`` (a full disk, a quota, a folder made
    read-only): what could not be written, why, how much room is left there, and ``fix``."""
    target = Path(target)
    why = error.strerror or str(error)
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            why += f"; {free_mb(target.parent):.1f} MB free there"
        except OSError:
            pass
    return f"cannot write {target} ({why})" + (f": {fix}" if fix else "")


def source_version(root: Path = REPO_ROOT) -> dict:
    """``{"commit": <40 hex digits> or None, "dirty": bool or None}`` of the course in ``root`` (None
    outside a git checkout, e.g. in the student package)."""

    def git(*args):
        try:
            r = subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit or not re.fullmatch(r"[0-9a-f]{40}", commit):
        return {"commit": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def claim_run_dir(choose, what: str = "run folder") -> Path:
    """A run folder that belongs to this process alone, even when another run starts at the same moment.

    ``choose()`` returns a candidate (e.g. :func:`course_tools.results.prepare_results_dir`, which gives an
    unused folder or a fresh sibling). The folder is this run's once :data:`CLAIM_FILE` is created in it
    with ``O_EXCL``; a run that loses that race asks ``choose()`` again and gets the next sibling.

    Raises:
      FolderError: the folder cannot be written (named, with the fix).
    """
    version = source_version()
    for _ in range(100):
        folder = Path(choose())
        try:
            fd = os.open(folder / CLAIM_FILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            continue  # another run claimed it between its choice and ours
        except OSError as e:
            raise FolderError(f"cannot write the {what} {folder} ({e.strerror or e})") from None
        claim = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
            **version,
        }
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(claim, f, indent=1)
        except OSError as e:
            raise FolderError(f"cannot write the {what} {folder} ({e.strerror or e})") from None
        return folder
    raise FolderError(f"could not claim a {what}: 100 candidates were taken")  # pragma: no cover


def finish_run(folder: Path, status: str) -> None:
    """Record how the run in ``folder`` ended (``"ok"``, ``"FAILED"``, ``"interrupted"``, ...) in its
    :data:`CLAIM_FILE`; on a full disk the claim stays as it was (the run then reads as unfinished)."""
    path = Path(folder) / CLAIM_FILE
    try:
        claim = json.loads(path.read_text())
        claim.update(ended=time.strftime("%Y-%m-%dT%H:%M:%S%z"), status=status)
        write_atomic(path, json.dumps(claim, indent=1))
    except (OSError, ValueError):
        pass


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and ``os.replace``: a full
    disk or a kill leaves the previous version, never a truncated file (and no temporary file)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(
            fd, 0o666 & ~_umask()
        )  # what open() would give: mkstemp's 0600 hides it from others
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def removed_on_failure(folder: Path, made: bool = True) -> Iterator[Path]:
    """Within the block ``folder`` is being filled; if the block raises (a full disk, Ctrl-C), what it
    wrote is removed: the whole folder when this process ``made`` it, else nothing (the caller's)."""
    try:
        yield folder
    except BaseException:
        if made:
            shutil.rmtree(folder, ignore_errors=True)
        raise


def scratch_folder(prefix: str = "course-") -> Path:
    """A new folder in the temporary folder, removed when this Python process exits (a notebook's kernel:
    when it is shut down or restarted), for files a lesson makes and reads back at once (profiler traces,
    prepared inputs, checkpoints). ``tempfile.mkdtemp`` alone leaves one behind on every run."""
    import atexit

    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


# --- finding and describing earlier runs -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What :data:`CLAIM_FILE` says about a run folder.

    Attributes:
      folder: the run folder.
      started: ISO time it started ('' when unknown); ended: when it ended ('' while running or when it
        stopped without a word: killed, a full disk).
      status: ``"ok"``, ``"FAILED"``, ``"interrupted"``, ... or ``"unfinished"``.
      commit: the course's git commit it ran (None outside a checkout); dirty: uncommitted changes.
      pid, host: the process that made it.
    """

    folder: Path
    started: str
    ended: str
    status: str
    commit: str | None
    dirty: bool | None
    pid: int | None
    host: str

    @property
    def running(self) -> bool:
        """Its process is still alive on this host (a run in progress)."""
        if self.ended or self.pid is None or self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def read_run(folder: str | os.PathLike) -> RunInfo:
    """The :class:`RunInfo` of ``folder``; a folder without a readable claim reads as started at its
    modification time, status ``"unknown"``."""
    folder = Path(folder)
    try:
        claim = json.loads((folder / CLAIM_FILE).read_text())
    except (OSError, ValueError):
        try:
            mtime = time.localtime(folder.stat().st_mtime)
        except OSError:  # no such folder: the reader's command says so
            mtime = None
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z", mtime) if mtime else ""
        claim = {"started": started, "status": "unknown"}
    return RunInfo(
        folder=folder,
        started=str(claim.get("started", "")),
        ended=str(claim.get("ended", "")),
        status=str(claim.get("status", "unfinished")),
        commit=claim.get("commit"),
        dirty=claim.get("dirty"),
        pid=claim.get("pid"),
        host=str(claim.get("host", "")),
    )


def describe(info: RunInfo) -> str:
    """``build/course-2 (started 2026-05-01 10:02, commit 249b2f6, ended ok)``."""
    when = info.started.replace("T", " ")[:16]
    commit = f"commit {info.commit[:7]}" if info.commit else "no git commit recorded"
    if info.dirty:
        commit += " with uncommitted changes"
    how = "still running" if info.running else f"ended {info.status}"
    how = "how it ended not recorded" if info.status == "unknown" else how
    return f"{info.folder} ({f'started {when}' if when else 'start unknown'}, {commit}, {how})"


def runs_beside(build: str | os.PathLike, name: str) -> list[RunInfo]:
    """The run folders ``<build>/<name>`` and ``<build>/<name>-<k>``, oldest first (by start time)."""
    build = Path(build)
    pattern = re.compile(rf"{re.escape(name)}(-\d+)?")
    found = [
        read_run(p) for p in build.glob(f"{name}*") if p.is_dir() and pattern.fullmatch(p.name)
    ]
    return sorted(found, key=lambda r: (r.started, r.folder.name))


def newest_run(build: str | os.PathLike, name: str) -> RunInfo:
    """The newest run ``<build>/<name>[-k]`` that ended ``ok`` (or, when none did, the newest that
    recorded no end: a run folder made before run folders recorded one).

    Raises:
      FileNotFoundError: there is none (the message says what runs exist and how to make one).
    """
    runs = runs_beside(build, name)
    # runs made before run folders recorded their end read "unknown": taken only when no run ended ok
    done = [r for r in runs if r.status == "ok"] or [r for r in runs if r.status == "unknown"]
    if not done:
        others = "; ".join(describe(r) for r in runs) or "none"
        raise FileNotFoundError(
            f"no finished {name} run in {build} (runs there: {others}); run `make {name}` first, or name "
            f"a run folder"
        )
    return done[-1]


def notes_on(info: RunInfo, name: str) -> list[str]:
    """What a reader of the run in ``info`` should know: a newer run of the same kind beside it, an older
    one that ended ``ok`` with notebooks this one lacks (e.g. after ``make course ONLY="12"``), a run of
    another commit than the course's checkout now, a run that did not end ``ok``."""
    notes = []
    newer = [
        r for r in runs_beside(info.folder.parent, name) if r.started > info.started and r != info
    ]
    if newer:
        notes.append(f"a newer {name} run exists: {describe(newer[-1])}")
    mine = {p.name for p in info.folder.glob("*.ipynb")}
    for older in reversed(runs_beside(info.folder.parent, name)):  # the newest first
        extra = sorted({p.name for p in older.folder.glob("*.ipynb")} - mine)
        if older.started < info.started and older.status == "ok" and extra:
            notes.append(
                f"this run has no {', '.join(extra)}; the older run {describe(older)} has: "
                f"make site COURSE={older.folder} makes the book of that one"
            )
            break
    now = source_version()
    if info.commit and now["commit"] and info.commit != now["commit"]:
        notes.append(
            f"the run is of commit {info.commit[:7]}, the course here is at {now['commit'][:7]}: "
            f"its notebooks may differ from notebooks/"
        )
    if info.running:
        notes.append(f"the run is still running (process {info.pid})")
    elif info.status not in ("ok", "unknown"):
        notes.append(
            f"the run ended {info.status}: the notebooks after the failing one are missing"
        )
    return notes

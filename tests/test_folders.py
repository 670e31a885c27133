"""course_tools.folders and the results files: output folders checked before work starts (writable, with
room for what the step writes), files never half-written on a full disk, run folders that say which run
they are, and the newest run found with what a reader should know about it.

Full disks: ``disks.fake_free`` for the checks made before work starts; ``disks.small_disk`` (a real tmpfs
of a few MB, root only) for a disk that fills up while writing.
"""

import errno
import json
import os
import time

import disks
import pandas as pd
import pytest

from course_tools import folders, results


def test_a_folder_with_too_little_room_is_refused_naming_what_the_step_writes(
    tmp_path, monkeypatch
):
    disks.fake_free(monkeypatch, 30)
    with pytest.raises(folders.FolderError) as e:
        folders.check_folder(tmp_path / "book", "book folder", "give another folder", writes_mb=60)
    assert str(e.value) == (
        f"only 30.0 MB free for the book folder {tmp_path / 'book'}; this step writes about 60 MB and a "
        "run needs at least 60 MB free: make room there, or give another folder"
    )
    disks.fake_free(monkeypatch, 55)
    folders.check_folder(tmp_path / "lab", writes_mb=2)  # 50 MB is the floor: room for logs
    with pytest.raises(folders.FolderError, match="needs at least 60 MB"):
        folders.check_folder(tmp_path / "book", writes_mb=60)


def test_a_read_only_folder_is_refused_whoever_runs(tmp_path):
    with disks.read_only(tmp_path / "ro") as ro:
        with pytest.raises(folders.FolderError, match=rf"cannot write the results folder {ro} \("):
            folders.check_folder(ro, "results folder")
        with pytest.raises(folders.FolderError, match=r"cannot write the results folder .*ro/lab"):
            results.prepare_results_dir(
                ro / "lab"
            )  # cannot be created there: named, not a traceback
    assert not (tmp_path / "ro" / "lab").exists()


def test_the_labs_results_folder_is_checked_before_the_lab_trains(tmp_path, monkeypatch):
    # notebooks/08_lab.ipynb calls prepare_results_dir in its setup cell: the check is the library's
    disks.fake_free(monkeypatch, 10)
    with pytest.raises(folders.FolderError, match="only 10.0 MB free for the results folder") as e:
        results.prepare_results_dir(tmp_path / "lab")
    assert "-p results_dir DIR" in str(e.value)


def test_a_full_disk_leaves_the_previous_results_file_and_no_temporary_file(tmp_path):
    with disks.small_disk(tmp_path / "disk", mb=1) as disk:
        path = results.write_csv([{"a": 1}], disk / results.RESULTS_FILE)
        (disk / "filler").write_bytes(b"x" * (1024 * 1024 - 64 * 1024))  # nearly full
        big = pd.DataFrame({"a": range(200_000)})
        with pytest.raises(OSError) as e:
            results.write_csv(big, path)
        assert e.value.errno == errno.ENOSPC
        message = str(e.value)
        assert (
            f"cannot write {path} (No space left on device;" in message
            and "MB free there" in message
        )
        assert "-p results_dir DIR" in message and "Traceback" not in message
        assert pd.read_csv(path)["a"].tolist() == [1]  # the previous version
        assert sorted(p.name for p in disk.iterdir()) == ["filler", results.RESULTS_FILE]


def test_write_atomic_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "notes.txt"
    folders.write_atomic(path, "first")
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())  # readable as open() makes it

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError):
        folders.write_atomic(path, "second")
    assert path.read_text() == "first" and [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --- run folders: which run, of which commit, how it ended ---------------------------------------------


def test_a_claimed_run_records_its_commit_and_how_it_ended(tmp_path):
    folder = folders.claim_run_dir(lambda: results.prepare_results_dir(tmp_path / "course"))
    claim = json.loads((folder / folders.CLAIM_FILE).read_text())
    assert claim["commit"] == folders.source_version()["commit"]
    assert claim["commit"] is None or len(claim["commit"]) == 40
    info = folders.read_run(folder)
    assert info.running and info.status == "unfinished"  # this process, still going
    assert "still running" in folders.describe(info)
    folders.finish_run(folder, "ok")
    info = folders.read_run(folder)
    assert not info.running and info.status == "ok" and info.ended
    assert folders.describe(info).startswith(f"{folder} (started 20")
    assert folders.describe(info).endswith(", ended ok)")


def _fake_run(build, name, started, status="ok", commit=None, pid=None):
    folder = build / name
    folder.mkdir(parents=True)
    claim = {"started": started, "pid": pid or 2**22 + 7, "host": "elsewhere", "commit": commit}
    if status != "unfinished":
        claim.update(ended=started, status=status)
    (folder / folders.CLAIM_FILE).write_text(json.dumps(claim))
    return folder


def test_the_newest_finished_run_is_found_and_a_newer_failed_one_is_named(tmp_path):
    now = folders.source_version()["commit"]
    _fake_run(tmp_path, "course", "2026-05-01T10:00:00+0000", commit=now)
    _fake_run(tmp_path, "course-2", "2026-05-02T10:00:00+0000", commit=now)
    _fake_run(tmp_path, "course-3", "2026-05-03T10:00:00+0000", status="FAILED", commit=now)
    _fake_run(tmp_path, "course-4", "2026-05-04T10:00:00+0000", status="unfinished", commit=now)
    (tmp_path / "courses").mkdir()  # not a run of this name
    newest = folders.newest_run(tmp_path, "course")
    assert newest.folder == tmp_path / "course-2"
    notes = folders.notes_on(newest, "course")
    assert notes == [
        f"a newer course run exists: {folders.describe(folders.read_run(tmp_path / 'course-4'))}"
    ]
    assert "ended unfinished" in notes[0]
    old = folders.notes_on(folders.read_run(tmp_path / "course"), "course")
    assert "course-4" in old[0]
    failed = folders.notes_on(folders.read_run(tmp_path / "course-3"), "course")
    assert any("the run ended FAILED" in n for n in failed)


def test_an_older_run_with_notebooks_the_newest_lacks_is_named(tmp_path):
    now = folders.source_version()["commit"]
    full = _fake_run(tmp_path, "course", "2026-05-01T10:00:00+0000", commit=now)
    part = _fake_run(tmp_path, "course-2", "2026-05-02T10:00:00+0000", commit=now)
    for nb in ("10_transformers", "11_pipeline_experts", "12_transformer_lab"):
        (full / f"{nb}.ipynb").write_text("{}")
    (part / "12_transformer_lab.ipynb").write_text("{}")
    notes = folders.notes_on(folders.newest_run(tmp_path, "course"), "course")
    assert notes == [
        "this run has no 10_transformers.ipynb, 11_pipeline_experts.ipynb; the older run "
        f"{folders.describe(folders.read_run(full))} has: make site COURSE={full} makes the book of that one"
    ]
    assert folders.notes_on(folders.read_run(full), "course")[0].startswith("a newer course run")


def test_a_run_of_another_commit_is_said_to_be_one(tmp_path):
    if folders.source_version()["commit"] is None:
        pytest.skip("not a git checkout")
    info = folders.read_run(
        _fake_run(tmp_path, "course", "2026-05-01T10:00:00+0000", commit="0" * 40)
    )
    (note,) = folders.notes_on(info, "course")
    assert note.startswith("the run is of commit 0000000, the course here is at ")


def test_no_finished_run_says_what_is_there(tmp_path):
    with pytest.raises(
        FileNotFoundError, match="no finished course run in .*run `make course` first"
    ):
        folders.newest_run(tmp_path, "course")
    _fake_run(tmp_path, "course", "2026-05-01T10:00:00+0000", status="interrupted")
    with pytest.raises(FileNotFoundError, match=r"runs there: .*course \(started 2026-05-01 10:00"):
        folders.newest_run(tmp_path, "course")


def test_a_folder_without_a_claim_reads_as_unknown(tmp_path):
    (tmp_path / "course").mkdir()
    info = folders.read_run(tmp_path / "course")
    assert info.status == "unknown" and info.started.startswith(time.strftime("%Y"))
    assert folders.read_run(tmp_path / "missing").started == ""


def test_a_scratch_folder_is_removed_when_the_process_exits(tmp_path):
    import subprocess
    import sys

    code = (
        "from course_tools import folders\n"
        "d = folders.scratch_folder('jax-trace-'); (d / 'trace.json').write_text('{}'); print(d)"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    made = r.stdout.strip()
    assert r.returncode == 0 and made.startswith(f"{tmp_path}/jax-trace-"), r.stderr
    assert not os.path.exists(made) and list(tmp_path.iterdir()) == []


def test_a_notebooks_scratch_folder_is_gone_when_its_run_ends(tmp_path):
    import faults

    from course_tools.execution import execute

    made = tmp_path / "made.txt"
    cell = (
        "from course_tools import folders\n"
        f"d = folders.scratch_folder('course-09-'); (d / 'x').write_text('1'); open({str(made)!r}, 'w').write(str(d))"
    )
    nb = faults.make_notebook(tmp_path / "scratch.ipynb", cell)
    execute(nb, tmp_path / "out.ipynb", {}, progress=False)
    folder = made.read_text()
    assert "course-09-" in folder and not os.path.exists(folder)


def test_runs_that_recorded_no_end_are_taken_only_when_none_ended_ok(tmp_path):
    (tmp_path / "course").mkdir()  # an older run folder: no run.json
    info = folders.newest_run(tmp_path, "course")
    assert info.folder == tmp_path / "course" and "how it ended not recorded" in folders.describe(
        info
    )
    _fake_run(tmp_path, "course-2", "2000-01-01T00:00:00+0000")
    assert folders.newest_run(tmp_path, "course").folder == tmp_path / "course-2"

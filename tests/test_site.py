"""The course book (``make site``): staging of the notebooks, the run's metadata, refusals; the student book
built from ``notebooks/`` and checked in headless Chromium. The book of a real course run is checked in
tests/test_lab_runs.py, which runs one."""

import errno
import html
import re
import shutil
import subprocess

import book_browser
import disks
import nbformat
import pytest

from course_tools import book, site, student, tpu_reference


def _nb(cells, executed=True, **metadata):
    nb = nbformat.v4.new_notebook()
    nb.metadata.update(
        {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        **metadata,
    )
    for kind, source, tags, outputs in cells:
        if kind == "markdown":
            nb.cells.append(nbformat.v4.new_markdown_cell(source))
        else:
            cell = nbformat.v4.new_code_cell(source, outputs=outputs or [])
            cell.execution_count = 1 if executed else None
            cell.metadata["tags"] = tags
            nb.cells.append(cell)
    return nb


LESSON = {
    "stem": "02_jit",
    "number": "02",
    "title": "jit",
    "teaches": "tracing",
    "jax_docs": [
        {
            "title": "Just-in-time compilation",
            "url": "https://docs.jax.dev/en/latest/jit-compilation.html",
        }
    ],
}


def test_course_map_lists_every_notebook_with_official_jax_pages():
    lessons = site.course_map()
    assert [lesson["stem"] for lesson in lessons] == book_browser.LESSONS
    assert (
        sorted(p.stem for p in (site.ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
        == book_browser.LESSONS
    )
    for lesson in lessons:
        assert lesson["jax_docs"] and all(
            d["url"].startswith("https://docs.jax.dev/en/latest/") for d in lesson["jax_docs"]
        )


def test_the_device_report_a_notebook_prints_is_read_back(report):
    nb = _nb(
        [
            (
                "code",
                "print(report)",
                [],
                [nbformat.v4.new_output("stream", name="stdout", text=str(report) + "\n")],
            )
        ]
    )
    got = book.device_report(nb)
    assert got == {
        "platform": report.platform,
        "simulated": report.simulated,
        "n_devices": report.n_devices,
        "n_available": report.n_available,
        "device_kind": report.device_kind,
        "jax_version": report.jax_version,
        "jaxlib_version": report.jaxlib_version,
        "python_version": report.python_version,
        "host_cpus": report.host_cpus,
    }
    assert got["n_devices"] == 8 and got["simulated"] is True
    assert (
        book.device_report(
            _nb(
                [
                    (
                        "code",
                        "print(1)",
                        [],
                        [nbformat.v4.new_output("stream", name="stdout", text="1\n")],
                    )
                ]
            )
        )
        is None
    )


def test_injected_parameters_become_a_run_with_note_and_progress_bars_text(tmp_path):
    run = tmp_path / "course-3"
    run.mkdir()
    widget = {
        "application/vnd.jupyter.widget-view+json": {
            "model_id": "bar",
            "version_major": 2,
            "version_minor": 0,
        },
        "text/plain": "A: 0%|          | 0/20",
    }
    state = {
        "bar": {
            "model_name": "HBoxModel",
            "state": {"children": ["IPY_MODEL_l", "IPY_MODEL_p", "IPY_MODEL_r"]},
        },
        "l": {"model_name": "HTMLModel", "state": {"value": "A:\u2007100%"}},
        "p": {"model_name": "FloatProgressModel", "state": {"value": 20.0, "max": 20.0}},
        "r": {"model_name": "HTMLModel", "state": {"value": "\u200720/20\u2007[00:01&lt;00:00]"}},
    }
    nb = _nb(
        [
            ("markdown", "# 02 · jit\n\nIntro.", None, None),
            ("code", "n_devices = 8  # default\nplatform = 'auto'", ["parameters"], None),
            (
                "code",
                f'# Parameters\nn_devices = 2\nplatform = "cpu"\nresults_dir = "{run.resolve()}/lab"\n',
                ["injected-parameters"],
                None,
            ),
            ("code", "train()", [], [nbformat.v4.new_output("display_data", data=widget)]),
        ],
        widgets={"application/vnd.jupyter.widget-state+json": {"state": state}},
    )
    nbformat.write(nb, run / "02_jit.ipynb")
    got = site._lesson_notebook(run / "02_jit.ipynb", LESSON, run, student=False)
    sources = [c.source for c in got.cells]
    assert not any("injected-parameters" in c.metadata.get("tags", []) for c in got.cells)
    note = next(c for c in got.cells if "run-with" in c.source)
    assert (
        note.cell_type == "markdown"
        and "`n_devices=2`" in note.source
        and "`platform='cpu'`" in note.source
    )
    assert (
        "`results_dir='course-3/lab'`" in note.source
    )  # a path inside the run, not this machine's path
    assert (
        got.cells[1].cell_type == "markdown"
        and "https://docs.jax.dev/en/latest/jit-compilation.html" in sources[1]
    )
    params = next(c for c in got.cells if "parameters" in c.metadata.get("tags", []))
    assert params.cell_type == "code" and params.source.startswith(
        "n_devices = 8"
    )  # the notebook's own cell stays
    assert "widgets" not in got.metadata
    assert got.cells[-1].outputs == [
        nbformat.v4.new_output("stream", name="stdout", text="A: 100% 20/20 [00:01<00:00]\n")
    ]
    # the student version drops the injected cell without a note (nothing was run)
    got = site._lesson_notebook(run / "02_jit.ipynb", LESSON, run, student=True)
    assert not any("run-with" in c.source or "# Parameters" in c.source for c in got.cells)


def test_refusals_name_the_problem_and_leave_nothing(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="make course"):
        site.build_site(empty, tmp_path / "out")
    unexecuted = tmp_path / "unexecuted"
    unexecuted.mkdir()
    nbformat.write(_nb([("code", "x = 1", [], None)], executed=False), unexecuted / "01_grad.ipynb")
    with pytest.raises(ValueError, match=r"01_grad.ipynb has not been executed.*--student"):
        site.build_site(unexecuted, tmp_path / "out")
    nbformat.write(_nb([("code", "x = 1", [], None)]), unexecuted / "10_extra.ipynb")
    with pytest.raises(
        ValueError, match=r"10_extra.ipynb is not in the course map.*course_map.toml"
    ):
        site.build_site(unexecuted, tmp_path / "out")
    used = tmp_path / "used"
    used.mkdir()
    (used / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not empty"):
        site.build_site(unexecuted, used)
    assert [p.name for p in used.iterdir()] == ["mine.txt"]
    # the command: an error, and the folder it made for the book is not left behind
    assert site.main([str(empty), str(tmp_path / "site")]) == 2
    assert "error: no NN_name.ipynb notebooks" in capsys.readouterr().err
    assert not (tmp_path / "site").exists()
    assert not (tmp_path / "out").exists()


# --- the student book, in a browser ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def student_book(tmp_path_factory):
    out = tmp_path_factory.mktemp("student") / "site"
    pages = site.build_site(site.ROOT / "notebooks", out, student=True, strict=True)
    return out, pages


def test_student_book_has_no_solutions_and_no_outputs(student_book):
    out, pages = student_book
    assert [p.name for p in pages] == ["index.html", *(f"{s}.html" for s in book_browser.LESSONS)]
    assert not (out / "lab-report.html").exists() and not (out / "instructor-guide.html").exists()
    solutions = 0
    for stem in book_browser.LESSONS:
        source = nbformat.read(site.ROOT / "notebooks" / f"{stem}.ipynb", as_version=4)
        page = html.unescape(
            re.sub(r"<[^>]+>", "", (out / f"{stem}.html").read_text(encoding="utf-8"))
        )
        shipped = nbformat.read(
            out / "_sources" / f"{stem}.ipynb", as_version=4
        )  # the download button's file
        assert not any(c.get("outputs") for c in shipped.cells), stem
        for cell in source.cells:
            for line in student.solution_lines(cell.source):
                solutions += 1
                assert line not in page, f"{stem}: solution line in the student book: {line!r}"
                assert not any(line in c.source for c in shipped.cells), (
                    f"{stem}: solution in _sources: {line!r}"
                )
        stubs, _ = student.student_notebook(source, stem)
        for cell in stubs.cells:
            if "exercise" in cell.metadata.get("tags", []):
                for line in filter(str.strip, cell.source.splitlines()):
                    assert line.strip() in page, (
                        f"{stem}: the exercise's stub is not on the page: {line!r}"
                    )
    assert solutions > 30  # the lessons' solutions were really looked for


def test_student_book_in_the_browser(student_book, tmp_path):
    out, pages = student_book
    browser = book_browser.Browser(tmp_path)
    try:
        with book_browser.serve(out) as base:
            for page in sorted(out.glob("*.html")):
                v = browser.visit(base + page.name)
                book_browser.check_page(v, out, base)
                if page.stem in book_browser.LESSONS:
                    assert book_browser.sidebar_lessons(v) == book_browser.LESSONS, page.name
                    assert len(v.prev_next) == (
                        1 if page.stem == book_browser.LESSONS[-1] else 2
                    ), page.name
                    assert v.page_toc, f"{page.name}: no per-page contents"
                    assert "student version" in v.text
            home = browser.visit(base + "index.html", screenshot=False)
            assert "Student version" in home.text and "Lab report" not in home.text
            found = browser.search(base, "shard_map")
            assert "06_shard_map.html" in found[:3], found
    finally:
        browser.close()


def test_run_pages_state_the_devices_and_the_failed_and_missing_notebooks(tmp_path, report):
    run = tmp_path / "course-2"
    run.mkdir()
    printed = nbformat.v4.new_output("stream", name="stdout", text=str(report) + "\n")
    for stem, exception in (("00_setup", None), ("01_grad", True)):
        nb = _nb(
            [("markdown", f"# {stem}", None, None), ("code", "print(report)", [], [printed])],
            papermill={
                "start_time": "2026-12-01T08:44:55.4+00:00",
                "end_time": "2026-12-01T08:46:01.0+00:00",
                "parameters": {"n_devices": 8, "platform": "cpu"},
                "exception": exception,
                "version": "2.7.0",
            },
        )
        nbformat.write(nb, run / f"{stem}.ipynb")
    (run / "timings.csv").write_text(
        "notebook,seconds,status\n00_setup.ipynb,23.1,ok\n01_grad.ipynb,,FAILED\n"
    )
    staging = tmp_path / "src"
    staging.mkdir()
    notebooks = {p.stem: p for p in run.glob("*.ipynb")}
    site._stage(run, notebooks, site.course_map(), staging, student=False)
    home = (staging / "index.md").read_text()
    assert "8 simulated CPU devices (JAX 0.12.0.1), 2026-12-01" in home
    assert "01_grad failed in this run" in home and "Not in this run:\n02_jit, 03_vmap" in home
    page = (staging / "run.md").read_text()
    assert "| device count | 8 used, of 8 available |" in page and "| simulated | yes |" in page
    assert "| date (UTC) | 2026-12-01 08:44 to 2026-12-01 08:46 |" in page
    assert (
        "| {doc}`00_setup <00_setup>` | ok | 23 s | 2026-12-01 08:44 | "
        "`n_devices=8`, `platform='cpu'` | 8 × cpu (simulated) |" in page
    )
    assert "| {doc}`01_grad <01_grad>` | FAILED | — |" in page
    assert (staging / "02_jit.md").read_text().startswith("# 02 · jit (not in this run)")
    report_page = (staging / "lab-report.md").read_text()
    assert (
        "The CNN lab (08) was not part of this course run" in report_page
        and "## Reference run" in report_page
    )
    assert (staging / "reference" / "comparison.png").stat().st_size > 10_000
    # the committed TPU reference beside it: the chip, the versions, which notebooks ran there
    tpu = tpu_reference.newest()  # the newest committed run folder
    assert (
        "## TPU reference" in report_page
        and f"`data/tpu_reference/{tpu.folder.name}`" in report_page
    )
    assert tpu_reference.device(tpu.folder)["chip"] in report_page
    assert f"JAX {tpu_reference.versions(tpu.folder)['jax']}" in report_page
    first = tpu_reference.notebooks(tpu.folder).iloc[0]
    assert f"| {first['notebook']} |" in report_page
    assert (staging / "tpu" / "notebooks.png").stat().st_size > 10_000
    if tpu_reference.newest(with_lab=True) is None:
        assert "No TPU reference committed so far has lab results" in report_page
    else:
        assert "### The lab on the TPU" in report_page


# --- a full disk while the book is built: one message, nothing half-written left -------------------------


@pytest.fixture
def one_lesson(tmp_path, monkeypatch):
    """A folder of one lesson for the student book, and Sphinx stood in for by a quick fake."""
    src = tmp_path / "src"
    src.mkdir()
    nbformat.write(
        _nb([("markdown", "# 00 · setup", None, None), ("code", "x = 1", [], None)]),
        src / "00_setup.ipynb",
    )

    def fake_sphinx(staging, doctrees, out, student, strict):
        out.mkdir(parents=True)
        for name in ("index.html", "00_setup.html", "search.html"):
            (out / name).write_text("<html></html>")

    monkeypatch.setattr(site, "_sphinx", fake_sphinx)
    return src


def test_the_book_is_built_into_a_new_folder_each_time(one_lesson, tmp_path, capsys):
    out = tmp_path / "site"
    assert site.main(["--student", str(one_lesson), str(out)]) == 0
    capsys.readouterr()
    assert site.main(["--student", str(one_lesson), str(out)]) == 0
    assert (out / "index.html").exists() and (tmp_path / "site-2" / "index.html").exists()
    said = capsys.readouterr().out.splitlines()[
        0
    ]  # the folder in use is named, and where the book went
    assert said.startswith(f"the book folder {out} already holds files (")
    assert said.endswith(f"; nothing there is overwritten: this run writes to {out}-2 instead")


def test_a_disk_that_fills_while_the_book_is_moved_leaves_no_half_book(
    one_lesson, tmp_path, capsys, monkeypatch
):
    real_move, moved = shutil.move, []

    def move(src, dst):
        if moved:
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        moved.append(dst)
        return real_move(src, dst)

    monkeypatch.setattr(site.shutil, "move", move)
    out = tmp_path / "site"
    assert site.main(["--student", str(one_lesson), str(out)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"error: cannot write {out} (No space left on device; ")
        and "make room there" in err
    )
    assert len(err.strip().splitlines()) == 1 and "Errno" not in err
    assert moved and not out.exists()  # what was moved is removed with the folder made for it


def test_sphinx_running_out_of_space_is_one_message_naming_the_temporary_folder(
    one_lesson, tmp_path, capsys, monkeypatch
):
    monkeypatch.undo()  # the real _sphinx, a Sphinx process that fails as a full disk makes it fail
    traceback = (
        "Traceback (most recent call last):\n  ...\nOSError: [Errno 28] No space left on device\n"
    )
    monkeypatch.setattr(
        site.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 2, "", traceback)
    )
    out = tmp_path / "site"
    assert site.main(["--student", str(one_lesson), str(out)]) == 2
    err = capsys.readouterr().err
    assert "error: the book could not be staged: no space left in the temporary folder " in err, err
    assert "point TMPDIR at a folder with room" in err and "Traceback" not in err
    assert not out.exists()


def test_a_book_folder_without_room_is_refused_before_anything_is_staged(
    one_lesson, tmp_path, capsys, monkeypatch
):
    disks.fake_free(monkeypatch, 30)
    assert site.main(["--student", str(one_lesson), str(tmp_path / "site")]) == 2
    err = capsys.readouterr().err
    assert "only 30.0 MB free for the book folder" in err and "writes about 60 MB" in err
    assert not (tmp_path / "site").exists()

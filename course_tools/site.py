"""The course as a book: a course run's executed notebooks rendered by Sphinx (myst-nb, sphinx-book-theme).

    python -m course_tools.site build/course build/site                 # a course run (make course)
    python -m course_tools.site --student notebooks build/site-student  # the student version

The book's Sphinx configuration and its page templates are in ``docs/book/``. This module stages the sources
in a temporary folder — the run's notebooks as they were executed (never executed again), the pages rendered
from ``docs/book/pages/`` with the run's metadata and results, the lab's plots — and runs Sphinx on them.
Taught by none of the notebooks: it is the course's publishing step.
"""

from __future__ import annotations

import argparse
import errno
import html
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

if (
    __name__ == "__main__"
):  # the command's own process only: why, in docs/book/conf.py (about 2 s of CPU)
    sys.modules.setdefault("rfc3987_syntax", None)

import nbformat  # noqa: E402

from . import book, folders, results, tpu_reference  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "docs" / "book"
"""The book's Sphinx configuration (``conf.py``), course map (``course_map.toml``) and page templates."""
INSTRUCTOR_GUIDE = ROOT / "docs" / "instructor-guide.md"


def course_map() -> list[dict]:
    """The lessons in reading order, from ``docs/book/course_map.toml``.

    Returns:
      One dict per notebook: ``stem`` (``"06_shard_map"``), ``number`` (``"06"``), ``title``, ``teaches``
      and ``jax_docs`` (a list of ``{"title", "url"}`` links to the official JAX documentation).
    """
    with open(BOOK / "course_map.toml", "rb") as f:
        lessons = tomllib.load(f)["lesson"]
    return [{**lesson, "number": lesson["stem"][:2]} for lesson in lessons]


def build_site(
    source: str | Path, out: str | Path, student: bool = False, strict: bool = False
) -> list[Path]:
    """Build the book of ``source`` into the empty folder ``out``; return its pages, the home page first.

    Args:
      source: a course run (``make course`` writes ``build/course``: executed ``NN_name.ipynb``, ``lab/``
        with the lab's results files and plots, ``timings.csv``), or with ``student=True`` a folder of
        notebooks to render as the student version (``notebooks``: their solutions are replaced by stubs
        with ``course_tools.student`` and their outputs cleared).
      out: the folder for the HTML (``out/index.html`` is the home page). It must be empty or not exist.
      student: build the student version: exercises without solutions, no outputs, no run pages.
      strict: fail on any Sphinx warning (the tests use it).

    Returns:
      The HTML pages in reading order: home, the ten lessons, then (course run) the lab report, the run's
      metadata and the instructor guide.

    Raises:
      FileNotFoundError: ``source`` holds no ``NN_name.ipynb`` notebooks.
      FileExistsError: ``out`` exists and is not empty (choose a new folder; nothing is overwritten).
      ValueError: a notebook of a course run was never executed (render a course run, or pass
        ``student=True``), or a notebook is not in ``docs/book/course_map.toml``.
      RuntimeError: Sphinx failed (its messages are in the error).
    """
    source, out = Path(source), Path(out)
    notebooks = {p.stem: p for p in sorted(source.glob("[0-9][0-9]_*.ipynb"))}
    if not notebooks:
        hint = (
            "a folder of notebooks such as notebooks/"
            if student
            else "a course run; run `make course` first"
        )
        raise FileNotFoundError(f"no NN_name.ipynb notebooks in {source}; give {hint}")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; give a new folder for the site")
    lessons = course_map()
    unknown = sorted(set(notebooks) - {lesson["stem"] for lesson in lessons})
    if unknown:
        raise ValueError(
            f"{unknown[0]}.ipynb is not in the course map; add it to {BOOK / 'course_map.toml'}"
        )
    with tempfile.TemporaryDirectory(prefix="course-book-") as tmp:
        staging = Path(tmp) / "src"
        staging.mkdir()
        if student:
            from course_tools import student as student_version

            student_version.generate(source, Path(tmp) / "student", overwrite=True)
            notebooks = {stem: Path(tmp) / "student" / p.name for stem, p in notebooks.items()}
        _stage(source, notebooks, lessons, staging, student)
        # Built beside the staging folder, then moved: myst-nb writes a jupyter_execute/ folder next to
        # Sphinx's output folder, which must not land beside the reader's ``out``.
        _sphinx(staging, Path(tmp) / "doctrees", Path(tmp) / "html" / "book", student, strict)
        out.mkdir(parents=True, exist_ok=True)
        for item in (Path(tmp) / "html" / "book").iterdir():
            try:
                shutil.move(item, out / item.name)
            except OSError as e:  # a full disk: main removes what was moved
                raise folders.WriteFailed(
                    e.errno, folders.write_error(e, out, "make room there")
                ) from None
    names = ["index", *(lesson["stem"] for lesson in lessons)]
    if not student:
        names += ["lab-report", "run", "instructor-guide"]
    return [out / f"{name}.html" for name in names]


# --- staging: the sources Sphinx reads --------------------------------------------------------------------


def _stage(
    source: Path, notebooks: dict[str, Path], lessons: list[dict], staging: Path, student: bool
) -> None:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(BOOK / "pages"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    missing = [lesson for lesson in lessons if lesson["stem"] not in notebooks]
    for lesson in lessons:
        lesson["missing"] = lesson in missing
        if lesson["missing"]:
            page = env.get_template("not-run.md.jinja").render(
                lesson=lesson,
                folder=source.name,
                label="not in this book" if student else "not in this run",
            )
            (staging / f"{lesson['stem']}.md").write_text(page, encoding="utf-8")
        else:
            nb = _lesson_notebook(notebooks[lesson["stem"]], lesson, source, student)
            nbformat.write(nb, staging / f"{lesson['stem']}.ipynb")
    # in the student package (no tests/, no solutions) the book names the commands the package has
    context = {"student": student, "lessons": lessons, "in_package": not (ROOT / "tests").is_dir()}
    if not student:
        run = book.run_context(
            source, [n for n in lessons if not n["missing"]], [n["stem"] for n in missing]
        )
        lab, ref = book.lab_context(source, staging), book.reference_context(staging)
        if lab:
            ref["comparable"], ref["difference"] = book.comparable(lab["rows"], ref["rows"])
        context.update(
            run=run, lab=lab, ref=ref, simulated=run["simulated"], results_file=results.RESULTS_FILE,
            tpu=tpu_reference.context(staging),
        )  # fmt: skip
        for name in ("lab-report", "run"):
            (staging / f"{name}.md").write_text(
                env.get_template(f"{name}.md.jinja").render(**context), encoding="utf-8"
            )
        shutil.copyfile(INSTRUCTOR_GUIDE, staging / "instructor-guide.md")
    (staging / "index.md").write_text(
        env.get_template("index.md.jinja").render(**context), encoding="utf-8"
    )


def _lesson_notebook(
    path: Path, lesson: dict, run_folder: Path, student: bool
) -> nbformat.NotebookNode:
    """The notebook as the book shows it: papermill's injected-parameters cell replaced by a "run with" note
    (dropped in the student version), a line of official JAX documentation links after the title cell."""
    nb = nbformat.read(path, as_version=4)
    if not student and not any(
        c.cell_type == "code" and c.get("execution_count") for c in nb.cells
    ):
        raise ValueError(
            f"{path} has not been executed: give a course run (`make course` writes build/course), "
            f"or build the student version (--student)"
        )
    cells = []
    for cell in nb.cells:
        if "injected-parameters" in cell.metadata.get("tags", []):
            if not student:
                cells.append(nbformat.v4.new_markdown_cell(_run_with_note(cell.source, run_folder)))
            continue
        cells.append(cell)
    links = " · ".join(f"[{d['title']}]({d['url']})" for d in lesson["jax_docs"])
    cells.insert(
        1,
        nbformat.v4.new_markdown_cell(f":::{{seealso}}\nOfficial JAX documentation: {links}\n:::"),
    )
    nb.cells = cells
    _widgets_as_text(nb)
    return nb


def _widgets_as_text(nb: nbformat.NotebookNode) -> None:
    """Progress bars (tqdm's ipywidgets) as the text of their final state, and no widget state left: the book
    loads no widget JavaScript from the network, and a finished bar reads "20/20", not its first frame."""
    state = (
        nb.metadata.pop("widgets", {})
        .get("application/vnd.jupyter.widget-state+json", {})
        .get("state", {})
    )

    def text(model_id: str) -> str:
        model = state.get(model_id.removeprefix("IPY_MODEL_"), {})
        s = model.get("state", {})
        if model.get("model_name") == "HBoxModel":
            return " ".join(t for t in (text(c) for c in s.get("children", [])) if t)
        if model.get("model_name") == "HTMLModel":
            return (
                html.unescape(re.sub(r"<[^>]+>", "", str(s.get("value", ""))))
                .replace("\u2007", " ")
                .strip()
            )
        return ""

    for cell in nb.cells:
        outputs = []
        for o in cell.get("outputs", []):
            view = o.get("data", {}).get("application/vnd.jupyter.widget-view+json")
            if view is None:
                outputs.append(o)
            elif line := text(view.get("model_id", "")):
                outputs.append(nbformat.v4.new_output("stream", name="stdout", text=line + "\n"))
        if "outputs" in cell:
            cell.outputs = outputs


def _run_with_note(injected_source: str, run_folder: Path) -> str:
    values = ", ".join(
        f"`{k}={book.short_value(v, run_folder)!r}`"
        for k, v in book.assignments(injected_source).items()
    )
    return (
        f":::{{container}} run-with\nRun with {values}: the parameters papermill passed to this notebook in "
        f"this course run (the `parameters` cell above holds the notebook's defaults).\n:::"
    )


def _sphinx(staging: Path, doctrees: Path, out: Path, student: bool, strict: bool) -> None:
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-c", str(BOOK), "-d", str(doctrees)]
    cmd += ["-t", "student"] if student else []
    cmd += ["-W", "--keep-going"] if strict else []
    proc = subprocess.run([*cmd, str(staging), str(out)], capture_output=True, text=True)
    if proc.returncode != 0 and re.search(
        r"No space left on device|Errno 28|Disk quota exceeded", proc.stderr
    ):
        # Sphinx's traceback is not the reader's business: where it ran out of room, and the fix
        where = staging.parent
        raise folders.WriteFailed(
            errno.ENOSPC,
            f"the book could not be staged: no space left in the temporary folder {where} "
            f"({folders.free_mb(where):.1f} MB free): {TMP_FIX}",
        )
    if proc.stderr:
        print(proc.stderr, file=sys.stderr, end="")
    if proc.returncode != 0:
        raise RuntimeError(f"Sphinx failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def main(argv: list[str] | None = None) -> int:
    """``python -m course_tools.site SOURCE OUT`` (or ``--newest-in BUILD OUT``); returns the exit status:
    0 built, 2 refused or failed (one message), 130 Ctrl-C."""
    ap = argparse.ArgumentParser(
        prog="python -m course_tools.site", description=__doc__.splitlines()[0]
    )
    ap.add_argument(
        "source",
        nargs="?",
        help="a course run (make course writes build/course); with --student, a folder of notebooks",
    )
    ap.add_argument(
        "out",
        help="folder for the book (if it is already used, a new sibling such as site-2 is made)",
    )
    ap.add_argument(
        "--newest-in",
        metavar="BUILD",
        help="instead of SOURCE: the newest course run under BUILD that ended ok (what make site reads)",
    )
    ap.add_argument(
        "--student",
        action="store_true",
        help="the student version: solutions replaced by stubs, no outputs",
    )
    ap.add_argument("--strict", action="store_true", help="fail on any Sphinx warning")
    args = ap.parse_args(argv)
    out = None
    try:
        source = _source(args)
        out = results.prepare_results_dir(
            args.out, writes_mb=folders.WRITES_MB["book"], what="book folder", fix=OUT_FIX
        )
        folders.check_folder(
            tempfile.gettempdir(), "temporary folder", TMP_FIX, folders.WRITES_MB["book"]
        )
        with folders.removed_on_failure(out):  # made (or found empty) for this book
            pages = build_site(source, out, student=args.student, strict=args.strict)
    except (OSError, ValueError, RuntimeError, KeyboardInterrupt) as e:
        if out is not None and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # made for this build and left empty
        print("interrupted" if isinstance(e, KeyboardInterrupt) else f"error: {e}", file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 2
    print(
        f"{len(pages)} pages in {out}; open {out / 'index.html'} (or serve it: python -m http.server -d {out})"
    )
    return 0


TMP_FIX = "point TMPDIR at a folder with room (Sphinx stages the book there)"
OUT_FIX = "give another folder for the book (make: BUILD=DIR)"


def _source(args) -> Path:
    """The folder the book is made of; for a course run, named with its date and commit, and what a
    reader should know about it (a newer run beside it, another commit) printed as notes.

    Raises:
      ValueError: neither or both of SOURCE and ``--newest-in``; a run still running.
      FileNotFoundError: ``--newest-in`` found no finished course run.
    """
    if (args.source is None) == (args.newest_in is None):
        raise ValueError("give a course run folder, or --newest-in BUILD (not both)")
    if args.student:
        if args.newest_in is not None:
            raise ValueError("--student builds from a folder of notebooks such as notebooks/")
        return Path(args.source)
    info = (
        folders.newest_run(args.newest_in, "course")
        if args.newest_in is not None
        else folders.read_run(args.source)
    )
    if info.running:
        raise ValueError(
            f"{folders.describe(info)} is still running: build its book when it has ended"
        )
    print(f"the book of the course run {folders.describe(info)}")
    for note in folders.notes_on(info, "course"):
        print(f"note: {note}")
    return info.folder


if __name__ == "__main__":
    sys.exit(main())

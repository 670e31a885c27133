"""Generate the student version of the notebooks: solutions replaced by stubs the checkers reject.

In a solution notebook, an exercise's answer sits between two marker lines in a code cell::

    def cosine_similarity(a, b):
        # BEGIN SOLUTION
        return jnp.dot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b))
        # END SOLUTION

The student version keeps everything else and replaces the lines between the markers (markers included)
by ``raise NotImplementedError("Exercise: write this part")`` at the same indentation (or by the text after
``# STUB:`` on the BEGIN line, e.g. ``# BEGIN SOLUTION  # STUB: result = None``). Run::

    python -m course_tools.student notebooks build/student

Outputs are cleared; an earlier student version is replaced only with ``--overwrite`` (``make student
OVERWRITE=1``), and a notebook edited since it was written is kept in ``DST/edited-<date>/``.

The zip (``--zip``) strips the library too: a ``course_lib`` function that answers an exercise has its body
between the same markers, and the package's module keeps the stub on the BEGIN line
(:func:`library_source`), a call of :func:`course_lib.held.call` that runs the answer the exercise's checker
accepted (registered with :func:`course_lib.held.register`) or raises :class:`course_lib.held.HeldOut`
naming the exercise. The repository keeps the whole functions (:data:`course_lib.held.EXERCISES` lists them).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

import nbformat

from . import folders

BEGIN = re.compile(r"^(?P<indent>\s*)# BEGIN SOLUTION(?:\s*#\s*STUB:\s*(?P<stub>.*))?\s*$")
END = re.compile(r"^\s*# END SOLUTION\s*$")
# Anything that looks like a marker but is not one exactly ("#BEGIN SOLUTION", "# begin solution") would
# leave a solution in the student version: it is an error, not silently passed through.
NEAR_MARKER = re.compile(r"^\s*#\s*(BEGIN|END)\s+SOLUTION", re.IGNORECASE)
DEFAULT_STUB = 'raise NotImplementedError("Exercise: write this part")'


def strip_solutions(source: str, where: str = "cell") -> tuple[str, int]:
    """Replace every marked solution block in ``source``; return the new source and the number replaced.

    Raises:
      ValueError: a BEGIN without END (or the reverse), naming ``where``.
    """
    out, count, inside = [], 0, False
    for line in source.splitlines():
        if NEAR_MARKER.match(line) and not (BEGIN.match(line) or END.match(line)):
            raise ValueError(
                f"{where}: {line.strip()!r} is not a marker; write '# BEGIN SOLUTION' / '# END SOLUTION' exactly"
            )
        m = BEGIN.match(line)
        if m:
            if inside:
                raise ValueError(f"{where}: nested '# BEGIN SOLUTION'")
            inside = True
            out.append(m.group("indent") + (m.group("stub") or DEFAULT_STUB).rstrip())
            count += 1
        elif END.match(line):
            if not inside:
                raise ValueError(f"{where}: '# END SOLUTION' without BEGIN")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: '# BEGIN SOLUTION' without END")
    return "\n".join(out), count


def student_notebook(
    nb: nbformat.NotebookNode, name: str = "notebook"
) -> tuple[nbformat.NotebookNode, int]:
    """A copy of ``nb`` with solutions stripped and outputs cleared; returns it and the solutions replaced."""
    nb = nbformat.from_dict(nb)
    total = 0
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        cell.source, n = strip_solutions(cell.source, f"{name} cell {i}")
        total += n
        cell.outputs, cell.execution_count = [], None
        if n:
            tags = cell.metadata.setdefault("tags", [])
            if "exercise" not in tags:
                tags.append("exercise")
    return nb, total


MANIFEST = ".student.json"
"""Written last into a student folder: the solution notebooks' commit and, per notebook written, a hash of
its text — so that a later run can tell a learner's edits from its own files."""
OVERWRITE_HINT = "to replace: pass --overwrite (make student OVERWRITE=1)"


def generate(src: Path, dst: Path, overwrite: bool = False) -> list[tuple[Path, int]]:
    """Write the student version of every ``*.ipynb`` in ``src`` to ``dst``.

    With ``overwrite``, the notebooks in ``dst`` are replaced one by one (each atomically). A notebook this
    command wrote earlier and someone edited since (a learner's work) is first kept in
    ``dst/edited-<date>/``; a student notebook of a lesson no longer in ``src`` is removed (kept there too
    when edited); other files in ``dst`` are left alone. :data:`MANIFEST` records what was written.

    Raises:
      FileExistsError: a student notebook exists and ``overwrite`` is False (nothing is written then).
      FileNotFoundError: ``src`` has no notebooks.
      ValueError: ``dst`` is ``src``, or a notebook's markers are wrong (nothing is written then).
      FolderError (a ``ValueError``): ``dst`` cannot be written or has no room (before anything is written).
      OSError: writing failed midway (a full disk): the message names the folder, which holds no manifest
        until a run completes.
    """
    src, dst = Path(src), Path(dst)
    notebooks = sorted(src.glob("*.ipynb"))
    if not notebooks:
        raise FileNotFoundError(f"no notebooks in {src}")
    if dst.resolve() == src.resolve():
        raise ValueError(
            f"the student version would replace the solution notebooks in {src}; give another folder"
        )
    earlier = sorted(dst.glob("*.ipynb")) if dst.is_dir() else []
    if earlier and not overwrite:
        raise FileExistsError(
            f"{len(earlier)} student notebook(s) exist already in {dst}, e.g. {earlier[0].name}; "
            + OVERWRITE_HINT
        )
    # Convert everything first: a marker error in any notebook leaves nothing half-written.
    converted = [(p, *student_notebook(nbformat.read(p, as_version=4), p.name)) for p in notebooks]
    texts = {p.name: nbformat.writes(nb) for p, nb, _ in converted}
    folders.check_folder(dst, "student folder", "give another folder", folders.WRITES_MB["student"])
    written = _read_manifest(dst).get("notebooks", {})
    (dst / MANIFEST).unlink(missing_ok=True)  # until this run completes
    try:
        kept = _keep_edits(dst, earlier, written, set(texts))
        for name, text in texts.items():
            folders.write_atomic(dst / name, text)
    except OSError as e:
        raise folders.WriteFailed(
            e.errno, folders.write_error(e, dst, "make room and run it again (it is incomplete)")
        ) from None
    manifest = {
        "source": str(src.resolve()),
        **folders.source_version(),
        "notebooks": {name: _digest(text) for name, text in texts.items()},
    }
    folders.write_atomic(dst / MANIFEST, json.dumps(manifest, indent=1))
    for path in kept:
        print(f"kept the edited {path.name} in {path.parent}")
    replaced = [p.name for p in earlier if p.name in texts]
    if replaced:
        print(
            f"replaced {len(replaced)} earlier student notebook(s) in {dst}: {', '.join(replaced)}"
        )
    return [(dst / p.name, n) for p, _, n in converted]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _read_manifest(folder: Path) -> dict:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def _keep_edits(dst: Path, earlier: list[Path], written: dict, names: set[str]) -> list[Path]:
    """Before ``dst``'s notebooks are replaced: move aside each one whose text is not what this command
    wrote (edited since, or written before manifests existed), remove the ones of lessons gone from the
    source. Returns where the edited ones went."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    kept = []
    for path in earlier:
        ours = written.get(path.name) == _digest(path.read_text(encoding="utf-8"))
        if not ours and (path.name in names or path.name in written):
            target = dst / f"edited-{stamp}" / path.name
            target.parent.mkdir(exist_ok=True)
            os.replace(path, target)
            kept.append(target)
        elif ours and path.name not in names:
            path.unlink()  # a lesson no longer in the course
    return kept


def stale_note(folder: Path, src: Path) -> str | None:
    """Why the student notebooks in ``folder`` are not the student version of ``src`` as it is now (made
    from other solution notebooks, or incomplete), or None when they are (or ``folder`` is not a student
    folder)."""
    manifest = _read_manifest(folder)
    if not manifest:
        return None
    now = {}
    for p in sorted(Path(src).glob("*.ipynb")):
        try:
            now[p.name] = _digest(nbformat.writes(student_notebook(nbformat.read(p, 4))[0]))
        except ValueError:
            return None
    changed = sorted(
        n
        for n in set(now) | set(manifest["notebooks"])
        if now.get(n) != manifest["notebooks"].get(n)
    )
    if not changed:
        return None
    return (
        f"the student notebooks in {folder} were made from another version of {src} "
        f"(commit {(manifest.get('commit') or '?')[:7]}; differ: {', '.join(changed)}); "
        f"make them again: make student OVERWRITE=1"
    )


def solution_lines(source: str) -> list[str]:
    """The non-trivial lines inside the solution blocks of ``source`` (stripped, at least 12 characters)."""
    lines, inside = [], False
    for line in source.splitlines():
        if BEGIN.match(line):
            inside = True
        elif END.match(line):
            inside = False
        elif inside and len(line.strip()) >= 12:
            lines.append(line.strip())
    return lines


PACKAGE_FILES = {
    "README.md": "docs/student-README.md",  # the package's README names only what the package holds
    "requirements.txt": "requirements.txt",
    "requirements-py311.txt": "requirements-py311.txt",  # the second environment: JAX 0.10.2 on Python 3.11
    "pyproject.toml": "pyproject.toml",
    "Makefile": "Makefile",  # in a folder without tests/, its course-only targets say so
    ".python-version": ".python-version",
    "environment.yml": "environment.yml",
    "docs/instructor-guide.md": "docs/instructor-guide.md",  # a page of the book of a course run
    "tools/check_python.py": "tools/check_python.py",
    "tools/bench_strategies.py": "tools/bench_strategies.py",
}
"""Files of the student package: ``{path in the package: path in the repository}``."""
PACKAGE_DIRS = ("course_lib", "course_tools", "data", "deploy", "docs/book")
"""Folders copied whole (but caches and hidden files)."""
TOP = "jax-course"
"""The package's top folder."""


def package(root: Path, zip_path: Path, overwrite: bool = False) -> Path:
    """A zip to hand out: the student notebooks (as ``notebooks/``) and what running them needs — the
    libraries, the data, the book's sources, the Makefile and a README of its own
    (``docs/student-README.md``) that names only commands the package can run.

    Raises:
      FileExistsError: ``zip_path`` exists and ``overwrite`` is False.
      FolderError: the zip's folder or the temporary folder cannot be written or has no room.
      OSError: writing the zip failed (a full disk): no zip and no partial file is left.
    """
    import tempfile
    import zipfile

    root, zip_path = Path(root), Path(zip_path)
    if zip_path.exists() and not overwrite:
        raise FileExistsError(f"{zip_path} exists; {OVERWRITE_HINT}")
    writes = folders.WRITES_MB["student"]
    folders.check_folder(zip_path.parent, "folder of the zip", "give another --zip", writes)
    tmp_zip = zip_path.with_name(f".{zip_path.name}.tmp")
    try:
        with tempfile.TemporaryDirectory(prefix="course-student-") as tmp:
            generate(root / "notebooks", Path(tmp), overwrite=True)
            with zipfile.ZipFile(tmp_zip, "w", zipfile.ZIP_DEFLATED) as z:
                for nb in sorted(Path(tmp).glob("*.ipynb")):
                    z.write(nb, f"{TOP}/notebooks/{nb.name}")
                for inside, source in sorted(_package_files(root).items()):
                    if inside.startswith(HELD_IN) and inside.endswith(".py"):
                        text = (root / source).read_text(encoding="utf-8")
                        z.writestr(f"{TOP}/{inside}", library_source(text, inside))
                    else:
                        z.write(root / source, f"{TOP}/{inside}")
        os.replace(tmp_zip, zip_path)
    except BaseException as e:
        tmp_zip.unlink(missing_ok=True)
        if isinstance(e, OSError) and not isinstance(e, (FileNotFoundError, folders.WriteFailed)):
            raise folders.WriteFailed(
                e.errno, folders.write_error(e, zip_path, "make room there")
            ) from None
        raise
    return zip_path


HELD_IN = "course_lib/"
"""The folder whose ``.py`` files the package strips of solutions (:func:`library_source`)."""


def library_source(text: str, where: str = "module") -> str:
    """A library module as the student package holds it: each marked block cut out and replaced by its
    stub (:func:`strip_solutions`); unchanged when it has none.

    Raises:
      ValueError: unbalanced markers, or a module that no longer parses once stripped (naming ``where``).
    """
    stripped, n = strip_solutions(text, where)
    if not n:
        return text
    try:
        ast.parse(stripped, where)
    except SyntaxError as e:
        raise ValueError(
            f"{where}: stripped of its solutions, line {e.lineno} does not parse"
        ) from None
    return stripped + "\n"


def _package_files(root: Path) -> dict[str, str]:
    files = dict(PACKAGE_FILES)
    for d in PACKAGE_DIRS:
        for f in sorted((root / d).rglob("*")):
            rel = f.relative_to(root)
            hidden = any(part.startswith(".") or part == "__pycache__" for part in rel.parts)
            if f.is_file() and not hidden and f.suffix != ".pyc":
                files[str(rel)] = str(rel)
    missing = [s for s in files.values() if not (root / s).is_file()]
    if missing:
        raise FileNotFoundError(f"the student package needs {missing[0]}, which {root} lacks")
    return files


def main(argv: list[str] | None = None) -> int:
    """``python -m course_tools.student [SRC] [DST] [--zip ZIP] [--overwrite]``; 0 done, 2 refused."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", nargs="?", default="notebooks")
    parser.add_argument("dst", nargs="?", default="build/student")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier student version (edited notebooks are kept in DST/edited-<date>/)",
    )
    parser.add_argument(
        "--zip",
        help="also write a zip to hand out (student notebooks + course_lib + course_tools + setup files)",
    )
    parser.add_argument(
        "--check",
        metavar="FOLDER",
        help="only say whether FOLDER's student notebooks are the student version of SRC as it is now",
    )
    args = parser.parse_args(argv)
    try:
        if args.check:
            if not Path(args.check).is_dir():
                raise FileNotFoundError(
                    f"no folder {args.check} to open; the student notebooks are made by `make student` "
                    f"(into build/student), then `make jupyter JUPYTER_DIR=build/student`"
                )
            note = stale_note(Path(args.check), Path(args.src))
            if note:
                print(f"note: {note}")
            return 0
        if args.zip and Path(args.zip).exists() and not args.overwrite:
            raise FileExistsError(f"{args.zip} exists; {OVERWRITE_HINT}")
        for path, n in generate(Path(args.src), Path(args.dst), args.overwrite):
            print(f"{path}: {n} solution(s) replaced")
        if args.zip:
            root = Path(args.src).resolve().parent
            again = Path(args.zip).exists()
            made = package(root, Path(args.zip), args.overwrite)
            print(f"wrote {made}" + (" (replaced the earlier zip)" if again else ""))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

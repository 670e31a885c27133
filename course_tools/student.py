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

Outputs are cleared; an existing output file is replaced only with ``--overwrite``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

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


def generate(src: Path, dst: Path, overwrite: bool = False) -> list[tuple[Path, int]]:
    """Write the student version of every ``*.ipynb`` in ``src`` to ``dst``.

    Raises:
      FileExistsError: an output file exists and ``overwrite`` is False (nothing is written then).
      FileNotFoundError: ``src`` has no notebooks.
      ValueError: ``dst`` is ``src``, or a notebook's markers are wrong (nothing is written then).
    """
    src, dst = Path(src), Path(dst)
    notebooks = sorted(src.glob("*.ipynb"))
    if not notebooks:
        raise FileNotFoundError(f"no notebooks in {src}")
    if dst.resolve() == src.resolve():
        raise ValueError(
            f"the student version would replace the solution notebooks in {src}; give another folder"
        )
    if not overwrite:
        clash = [str(dst / p.name) for p in notebooks if (dst / p.name).exists()]
        if clash:
            raise FileExistsError(
                f"{len(clash)} student notebook(s) exist already, e.g. {clash[0]}; pass --overwrite to replace them"
            )
    # Convert everything first: a marker error in any notebook leaves nothing half-written.
    converted = [(p, *student_notebook(nbformat.read(p, as_version=4), p.name)) for p in notebooks]
    dst.mkdir(parents=True, exist_ok=True)
    done = []
    for p, nb, n in converted:
        nbformat.write(nb, dst / p.name)
        done.append((dst / p.name, n))
    return done


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


PACKAGE_FILES = (
    "README.md",
    "requirements.txt",
    "pyproject.toml",
    "Makefile",
    ".python-version",
    "environment.yml",
)
PACKAGE_DIRS = ("course_lib", "course_tools", "data", "tools")


def package(root: Path, zip_path: Path, overwrite: bool = False) -> Path:
    """A zip to hand out: the student notebooks (as ``notebooks/``) plus what they need to run.

    Raises:
      FileExistsError: ``zip_path`` exists and ``overwrite`` is False.
    """
    import tempfile
    import zipfile

    root, zip_path = Path(root), Path(zip_path)
    if zip_path.exists() and not overwrite:
        raise FileExistsError(f"{zip_path} exists; pass --overwrite to replace it")
    zip_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        generate(root / "notebooks", Path(tmp), overwrite=True)
        tmp_zip = zip_path.with_suffix(".zip.tmp")
        with zipfile.ZipFile(tmp_zip, "w", zipfile.ZIP_DEFLATED) as z:
            for nb in sorted(Path(tmp).glob("*.ipynb")):
                z.write(nb, f"jax-course/notebooks/{nb.name}")
            for name in PACKAGE_FILES:
                if (root / name).exists():
                    z.write(root / name, f"jax-course/{name}")
            for d in PACKAGE_DIRS:
                for f in sorted((root / d).rglob("*")):
                    if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc":
                        z.write(f, f"jax-course/{f.relative_to(root)}")
        tmp_zip.replace(zip_path)
    return zip_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", nargs="?", default="notebooks")
    parser.add_argument("dst", nargs="?", default="build/student")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace existing student notebooks"
    )
    parser.add_argument(
        "--zip",
        help="also write a zip to hand out (student notebooks + course_lib + course_tools + setup files)",
    )
    args = parser.parse_args(argv)
    try:
        if args.zip and Path(args.zip).exists() and not args.overwrite:
            raise FileExistsError(f"{args.zip} exists; pass --overwrite to replace it")
        for path, n in generate(Path(args.src), Path(args.dst), args.overwrite):
            print(f"{path}: {n} solution(s) replaced")
        if args.zip:
            root = Path(args.src).resolve().parent
            print(f"wrote {package(root, Path(args.zip), args.overwrite)}")
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

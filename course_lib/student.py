"""Generate the student version of the notebooks: solutions replaced by stubs the checkers reject.

In a solution notebook, an exercise's answer sits between two marker lines in a code cell::

    def cosine_similarity(a, b):
        # BEGIN SOLUTION
        return jnp.dot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b))
        # END SOLUTION

The student version keeps everything else and replaces the lines between the markers (markers included)
by ``raise NotImplementedError("Exercise: write this part")`` at the same indentation (or by the text after
``# STUB:`` on the BEGIN line, e.g. ``# BEGIN SOLUTION  # STUB: result = None``). Run::

    python -m course_lib.student notebooks build/student

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
DEFAULT_STUB = 'raise NotImplementedError("Exercise: write this part")'


def strip_solutions(source: str, where: str = "cell") -> tuple[str, int]:
    """Replace every marked solution block in ``source``; return the new source and the number replaced.

    Raises:
      ValueError: a BEGIN without END (or the reverse), naming ``where``.
    """
    out, count, inside = [], 0, False
    for line in source.splitlines():
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


def student_notebook(nb: nbformat.NotebookNode, name: str = "notebook") -> tuple[nbformat.NotebookNode, int]:
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
    """
    src, dst = Path(src), Path(dst)
    notebooks = sorted(src.glob("*.ipynb"))
    if not notebooks:
        raise FileNotFoundError(f"no notebooks in {src}")
    if not overwrite:
        clash = [str(dst / p.name) for p in notebooks if (dst / p.name).exists()]
        if clash:
            raise FileExistsError(f"{len(clash)} student notebook(s) exist already, e.g. {clash[0]}; pass --overwrite to replace them")
    dst.mkdir(parents=True, exist_ok=True)
    done = []
    for p in notebooks:
        nb, n = student_notebook(nbformat.read(p, as_version=4), p.name)
        nbformat.write(nb, dst / p.name)
        done.append((dst / p.name, n))
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", nargs="?", default="notebooks")
    parser.add_argument("dst", nargs="?", default="build/student")
    parser.add_argument("--overwrite", action="store_true", help="replace existing student notebooks")
    args = parser.parse_args(argv)
    try:
        for path, n in generate(Path(args.src), Path(args.dst), args.overwrite):
            print(f"{path}: {n} solution(s) replaced")
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a change touches: the test files and notebooks ``make check`` runs for the files a contributor changed.

Derived from the files themselves, not from a hand-kept list: every Python file in ``course_lib/``,
``course_tools/``, ``tests/`` and ``tools/`` and every notebook's code cells are parsed (``ast``) for the
modules they import (``from course_lib import aot`` imports ``course_lib``, ``course_lib.aot``; a relative
import is resolved in its package; a string naming a module, ``"-m course_tools.worker"``, counts too). A test
file or notebook is touched when a changed file is in its imports, followed through the project's modules
(notebook 03 imports ``course_tools.checks.lesson03``, which imports ``course_tools.checks._common``, …). A
changed file that is not a module (a notebook, a data file, README.md) touches the files whose text names it
(its file name; a notebook by its stem too). A changed test file or notebook touches itself.

Files that configure every test (:data:`EVERYTHING`) touch every test file and notebook. The files
:data:`LEFT_TO_MAKE_TEST` (each runs every notebook again, or the whole course, or makes environments:
minutes each) are never picked: ``make test`` runs them. :data:`ALWAYS` (static checks of every file, a few
seconds) always run.

``python tools/affected.py [--since REV] [FILE ...]``: the changed files are FILE ... when given, otherwise
``git diff --name-only REV`` (the working tree against REV, default ``HEAD``: the uncommitted changes) plus the
untracked files git does not ignore. Prints the test files and notebooks to run, one per line (nothing when
the change touches none); ``--explain`` prints, on stderr, which changed file touched each.
Errors: a REV git does not know exits with status 2 and names it.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("course_lib", "course_tools")
EVERYTHING = ("conftest.py", "tests/conftest.py", "pyproject.toml", "requirements.txt")
"""Changed, these reach every test: the session's setup, pytest's options, the pinned packages."""
LEFT_TO_MAKE_TEST = (
    "test_invariance.py",
    "test_lessons.py",
    "test_student.py",
    "test_site.py",
    "test_jupyterlab.py",
    "test_run.py",
    "test_make.py",
    "test_checks_devices.py",
)
"""Left to ``make test``: the matrix (every notebook at 1, 2, 4), every student version, the book, the course
runner's fault tests, the Makefile's real runs, a fresh 8-device process per answer judged."""
ALWAYS = ("tests/test_layout.py", "tests/test_hygiene.py", "tests/test_affected.py")
"""Static checks of every module and notebook (sizes, pointers, notebook conventions): seconds."""
MODULE_NAME = re.compile(r"\b(course_(?:lib|tools)(?:\.\w+)+)\b")


def module_of(path: str) -> str | None:
    """``course_lib/aot.py`` -> ``course_lib.aot``; ``tests/matrix.py`` -> ``matrix`` (the tests import their
    helpers by name); None for a file that is no module."""
    p = Path(path)
    if p.suffix != ".py":
        return None
    if p.parts[0] in PACKAGES:
        parts = list(p.with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    if p.parts[0] == "tests" and len(p.parts) == 2:
        return p.stem
    return None


def _code(path: Path) -> str:
    """A file's Python source; a notebook's code cells, its IPython lines (``%``, ``!``) left out."""
    if path.suffix != ".ipynb":
        return path.read_text()
    cells = json.loads(path.read_text())["cells"]
    lines = [
        line
        for c in cells
        if c["cell_type"] == "code"
        for line in "".join(c["source"]).splitlines()
        if not line.lstrip().startswith(("%", "!"))
    ]
    return "\n".join(lines)


def imports(path: Path, rel: str) -> set[str]:
    """The modules ``path`` imports, each with its parent packages (``a.b.c`` -> ``a``, ``a.b``, ``a.b.c``)."""
    source = _code(path)
    names = set(MODULE_NAME.findall(source))
    package = (module_of(rel) or "").rsplit(".", 0 if rel.endswith("__init__.py") else 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return {".".join(n.split(".")[: i + 1]) for n in names if n for i in range(n.count(".") + 1)}


def project_files() -> list[str]:
    """Every module, test file, tool and notebook of the project, relative to the root."""
    found = [*PACKAGES, "tests", "tools"]
    files = [p for d in found for p in (ROOT / d).rglob("*.py")]
    files += (ROOT / "notebooks").glob("*.ipynb")
    return sorted(str(p.relative_to(ROOT)) for p in files if "__pycache__" not in p.parts)


def is_target(rel: str) -> bool:
    """A file ``make check`` can run: a test file (not left to make test) or a notebook."""
    p = Path(rel)
    if p.parts[0] == "notebooks":
        return p.suffix == ".ipynb"
    return p.parts[0] == "tests" and p.name.startswith("test_") and p.name not in LEFT_TO_MAKE_TEST


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """``{file: the modules it imports}`` for every :func:`project_files` file (read once per process)."""
    return {f: imports(ROOT / f, f) for f in project_files()}


def touched(changed: list[str]) -> dict[str, str]:
    """``{target: the changed file that touches it}`` for the test files and notebooks to run."""
    graph = import_graph()
    files = list(graph)
    hits: dict[str, str] = {t: "always" for t in ALWAYS if (ROOT / t).exists()}
    for change in changed:
        if change in EVERYTHING or change.startswith("requirements"):
            hits.update({f: change for f in files if is_target(f) and f not in hits})
            continue
        direct = {f for f in files if f == change}
        if (module := module_of(change)) is not None:
            direct |= {f for f, names in graph.items() if module in names}
        else:  # not a module: the test files and notebooks that name it (not followed further)
            name = Path(change).name
            words = {name} | ({Path(name).stem} if name.endswith(".ipynb") else set())
            named = {f for f in files if is_target(f) and any(w in _code(ROOT / f) for w in words)}
            hits.update(
                {f: change for f in sorted(direct | named) if is_target(f) and f not in hits}
            )
            continue
        reached, todo = set(direct), list(direct)
        while todo:  # the files that import a reached module, and so on
            module = module_of(todo.pop())
            for f, names in graph.items():
                if module and module in names and f not in reached:
                    reached.add(f)
                    todo.append(f)
        for f in sorted(reached):
            if is_target(f):
                hits.setdefault(f, change)
    return dict(sorted(hits.items(), key=lambda kv: (kv[0].startswith("notebooks"), kv[0])))


def changed_files(since: str) -> list[str]:
    """The files changed against ``since`` (committed or not) and the untracked ones, relative to the root."""

    def git(*args: str) -> list[str]:
        r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        if r.returncode:
            print(
                f"tools/affected.py: git {' '.join(args)} failed: {r.stderr.strip()} (SINCE={since}"
                " must be a revision git knows, e.g. SINCE=main or SINCE=HEAD~3)",
                file=sys.stderr,
            )
            sys.exit(2)
        return r.stdout.splitlines()

    diff = git("diff", "--name-only", since, "--")
    return sorted(set(diff + git("ls-files", "--others", "--exclude-standard")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="the changed files (default: git's)")
    parser.add_argument(
        "--since", default="HEAD", help="the revision to diff against (default HEAD)"
    )
    parser.add_argument("--explain", action="store_true", help="say on stderr why each is picked")
    args = parser.parse_args(argv)
    changed = args.files or changed_files(args.since)
    hits = touched(changed)
    for change in changed:
        if Path(change).parent.name == "tests" and Path(change).name in LEFT_TO_MAKE_TEST:
            print(
                f"tools/affected.py: {change} changed: left to make test (or run it alone:"
                f" .venv/bin/python -m pytest {change})",
                file=sys.stderr,
            )
    for target, why in hits.items():
        print(target)
        if args.explain:
            print(f"  {target}: {why}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The code's shape: two layers, modules short enough to read in one sitting, pointers that resolve."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("course_lib", "course_tools")
MODULES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80
CHECKERS = ("checks",)
"""The exercise checkers (course_tools/checks): each one tries a right answer against many stand-ins and names
every wrong answer it knows, so a module may hold 500 lines and a checker 100."""
MAX_CHECKER_FILE_LINES, MAX_CHECKER_FUNCTION_LINES = 500, 100


def test_there_are_modules():
    assert {p.name for p in MODULES} >= {
        "strategies.py",
        "distributed.py",
        "launcher.py",
        "config.py",
    }


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_modules_and_functions_are_short(path):
    text = path.read_text()
    checker = path.parent.name in CHECKERS
    max_file = MAX_CHECKER_FILE_LINES if checker else MAX_FILE_LINES
    max_function = MAX_CHECKER_FUNCTION_LINES if checker else MAX_FUNCTION_LINES
    assert len(text.splitlines()) <= max_file, f"{path.name}: {len(text.splitlines())} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            assert length <= max_function, (
                f"{path.name}:{node.lineno} {node.name} is {length} lines"
            )


def test_the_lesson_library_never_imports_the_toolkit():
    for path in (ROOT / "course_lib").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "course_tools" for n in names), (
                f"{path.name} imports {names}"
            )


def test_no_pointer_to_files_outside_the_repository():
    # The course's design notes are not part of the repository: code and docs point to notebooks instead.
    needle = "design" + "/"
    places = [*PACKAGES, "data", "tools", "docs", "deploy", "tests", "notebooks"]
    files = [
        p
        for d in places
        for p in (ROOT / d).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    ]
    files += [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml"]
    found = [str(p.relative_to(ROOT)) for p in files if needle in p.read_text(errors="replace")]
    assert not found, f"pointers to {needle}* in {found}"

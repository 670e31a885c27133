"""The code's shape: two layers, modules short enough to read in one sitting, pointers that resolve."""

import ast
import json
import re
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


def _readme_headings(text: str) -> list[str]:
    """The headings of a Markdown text, outside its fenced code blocks."""
    headings, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#+ (.+)", line)):
            headings.append(m.group(1).strip())
    return headings


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _sources(path: Path) -> str:
    if path.suffix == ".ipynb":  # the cells' text, not the JSON's escaped quotes
        cells = json.loads(path.read_text())["cells"]
        return "\n".join("".join(c["source"]) for c in cells)
    return path.read_text(errors="replace")


SECTION_NAMED = re.compile(r"""README(?:\.md)?(?:, |'s \w+ )["']([^"'\n]+)["']""")
"""A README section named in words: the name in quotes after ``README,`` or ``README's table``."""
ANCHOR_NAMED = re.compile(r"README\.md#([\w-]+)")


def test_every_readme_section_named_elsewhere_exists():
    # a heading is named by its text, or by its part before a colon ("Tests" for "Tests: every notebook…")
    headings = _readme_headings((ROOT / "README.md").read_text())
    names = set(headings) | {h.split(":")[0] for h in headings}
    anchors = {_anchor(h) for h in headings}
    places = [*PACKAGES, "tools", "docs", "deploy", "tests", "notebooks", ".ci"]
    suffixes = {".py", ".md", ".ipynb", ".txt", ".yml", ".toml", ".sh", ""}
    files = [p for d in places for p in (ROOT / d).rglob("*") if p.is_file()]
    files = [p for p in files if p.suffix in suffixes and "__pycache__" not in p.parts]
    files += [ROOT / n for n in ("README.md", "Makefile", "pyproject.toml", "environment.yml")]
    files += sorted(ROOT.glob("requirements*.txt"))
    named, missing = [], []
    for path in files:
        text, where = _sources(path), str(path.relative_to(ROOT))
        for name in SECTION_NAMED.findall(text):
            named.append((where, name))
            missing += [] if name in names else [(where, name)]
        for anchor in ANCHOR_NAMED.findall(text):
            missing += [] if anchor in anchors else [(where, f"#{anchor}")]
    for anchor in re.findall(r"\]\(#([\w-]+)\)", (ROOT / "README.md").read_text()):
        missing += [] if anchor in anchors else [("README.md", f"#{anchor}")]
    assert {"requirements.txt", "Makefile"} <= {w for w, _ in named}, named  # the scan finds them
    assert not missing, f"README has no such section: {missing}; its headings: {headings}"

"""tools/affected.py: the test files and notebooks ``make check`` runs for a change, derived from imports."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import affected  # noqa: E402

NOTEBOOKS = sorted(f"notebooks/{p.name}" for p in (ROOT / "notebooks").glob("*.ipynb"))


def picked(*changed: str) -> set[str]:
    return set(affected.touched(list(changed)))


def test_a_checker_touches_its_lesson_and_its_tests_only():
    got = picked("course_tools/checks/lesson03.py")
    assert {"notebooks/03_vmap.ipynb", "tests/test_checks_lesson03.py"} <= got
    assert not {"notebooks/04_pmap.ipynb", "tests/test_checks_lesson04.py"} & got


def test_a_module_is_followed_through_the_modules_that_import_it():
    # _common is imported by every lesson's checker, not by the notebooks themselves
    got = picked("course_tools/checks/_common.py")
    assert set(NOTEBOOKS) <= got
    assert {f"tests/test_checks_lesson{i:02d}.py" for i in range(13)} <= got
    # tokens: the transformer lessons import it, the first eight do not
    got = picked("course_lib/tokens.py")
    assert {"notebooks/10_transformers.ipynb", "tests/test_tokens.py"} <= got
    assert "notebooks/03_vmap.ipynb" not in got


def test_a_notebook_or_a_test_file_touches_itself_and_the_static_checks_always_run():
    got = picked("notebooks/05_sharding.ipynb", "tests/test_tokens.py")
    assert got == {"notebooks/05_sharding.ipynb", "tests/test_tokens.py", *affected.ALWAYS}
    assert picked("README.md") >= set(affected.ALWAYS)


def test_the_session_setup_touches_everything_but_what_is_left_to_make_test():
    got = picked("conftest.py")
    assert set(NOTEBOOKS) <= got and "tests/test_steps.py" in got
    assert not {f"tests/{name}" for name in affected.LEFT_TO_MAKE_TEST} & got


@pytest.mark.parametrize(
    "line, module",
    [
        (
            "from course_lib import aot, steps as s",
            {"course_lib", "course_lib.aot", "course_lib.steps"},
        ),
        ("import course_lib.devices", {"course_lib", "course_lib.devices"}),
        ("cmd = ['-m', 'course_tools.worker']", {"course_tools", "course_tools.worker"}),
    ],
)
def test_imports_read_every_form(tmp_path, line, module):
    (tmp_path / "x.py").write_text(line + "\n")
    assert affected.imports(tmp_path / "x.py", "tools/x.py") >= module


def test_relative_imports_resolve_in_their_package():
    got = affected.imports(
        ROOT / "course_tools/checks/lesson03.py", "course_tools/checks/lesson03.py"
    )
    assert "course_tools.checks._common" in got


def test_an_unknown_revision_is_named():
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools/affected.py"), "--since", "no-such-rev"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "SINCE=no-such-rev must be a revision git knows" in r.stderr

"""The Python that builds a course environment, and the requirements file it gets.

The course has two environments (README, "Two environments"):
  - Python >= 3.12: JAX 0.12 (requirements.txt), the one the course is written for;
  - Python 3.11: JAX 0.10.2 (requirements-py311.txt), the JAX of the TPU image this course was run on
    (JAX >= 0.11 requires Python 3.12, so 3.11 cannot have 0.12).

    python tools/check_python.py                  exit 1 with the fix on an older Python, else say which file
    python tools/check_python.py --requirements   print only the requirements file for this Python
    python tools/check_python.py --find-3.11      print the path of a working Python 3.11, or nothing

This script runs under whatever Python make finds, so it keeps to syntax every Python 3 parses.
"""

import glob
import os
import shutil
import subprocess
import sys

REQUIREMENTS = {(3, 11): "requirements-py311.txt"}
"""The requirements file of each older Python the course supports; newer ones use requirements.txt."""


def requirements_file(version=None):
    """The requirements file for ``version`` (``sys.version_info[:2]``), or None for a Python too old."""
    version = tuple(version or sys.version_info[:2])
    if version >= (3, 12):
        return "requirements.txt"
    return REQUIREMENTS.get(version)


def _python_311(candidate):
    """``candidate``'s real interpreter path when it runs and is Python 3.11, else None.

    A pyenv shim named python3.11 exists on PATH even where the folder's .python-version selects another
    Python, and then fails when run: every candidate is run, not trusted by name. One without ensurepip
    (Debian's python3.11 without python3.11-venv) cannot build a venv and does not count."""
    try:
        out = subprocess.run(
            [
                candidate,
                "-c",
                "import sys, ensurepip; print(sys.version_info[:2] == (3, 11)); print(sys.executable)",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split()
    if out.returncode == 0 and len(lines) == 2 and lines[0] == "True":
        return lines[1]
    return None


def find_python_311():
    """The path of a working Python 3.11, or None: $PYTHON311, pyenv's 3.11.x (newest first), python3.11
    on PATH, /usr/bin/python3.11, /usr/local/bin/python3.11."""
    candidates = [os.environ.get("PYTHON311", "")]
    pyenv_root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    found = glob.glob(os.path.join(pyenv_root, "versions", "3.11.*", "bin", "python3.11"))
    candidates += sorted(
        found, key=lambda p: [int(x) for x in p.split("/")[-3].split(".") if x.isdigit()]
    )[::-1]
    candidates += [
        shutil.which("python3.11") or "",
        "/usr/bin/python3.11",
        "/usr/local/bin/python3.11",
    ]
    for candidate in candidates:
        path = candidate and _python_311(candidate)
        if path:
            return path
    return None


def main(argv):
    if argv[1:] == ["--find-3.11"]:
        print(find_python_311() or "")
        return
    found = sys.version.split()[0]
    requirements = requirements_file()
    if requirements is None:
        sys.exit(
            f"error: the course needs Python >= 3.12 (or 3.11 for its second environment), but {sys.executable}\n"
            f"is Python {found}. JAX >= 0.11 requires Python 3.12; on older Pythons pip silently installs an older\n"
            "JAX, which lacks APIs the course uses. Fix: install Python 3.12 (e.g. `pyenv install 3.12` — this\n"
            "repo's .python-version selects 3.12.1 — or your OS package), then run `make PYTHON=python3.12 ...`,\n"
            "or `conda env create -f environment.yml`."
        )
    if argv[1:] == ["--requirements"]:
        print(requirements)
    elif argv[1:]:
        sys.exit(f"error: unknown arguments {argv[1:]}: use --requirements, --find-3.11 or none")
    elif requirements == "requirements.txt":
        print(f"Python {found} OK: JAX 0.12, the course's environment ({requirements})")
    else:
        print(
            f"Python {found} OK: the second environment, JAX 0.10.2 ({requirements}); the course is written "
            'for JAX 0.12 on Python >= 3.12 (README, "Two environments")'
        )


if __name__ == "__main__":
    main(sys.argv)

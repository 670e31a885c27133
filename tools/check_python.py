"""Exit with a clear message when the Python that will build the course environment is older than 3.12."""

import sys

if sys.version_info < (3, 12):  # noqa: UP036 - this script runs under whatever Python make finds
    found = sys.version.split()[0]
    sys.exit(
        f"error: the course needs Python >= 3.12, but {sys.executable} is Python {found}.\n"
        "JAX >= 0.11 requires Python 3.12; on older Pythons pip silently installs jax 0.10.2, which lacks APIs the\n"
        "course uses. Fix: install Python 3.12 (e.g. `pyenv install 3.12` — this repo's .python-version selects\n"
        "3.12.1 — or your OS package), then run `make PYTHON=python3.12 ...`, or `conda env create -f environment.yml`."
    )
print(f"Python {sys.version.split()[0]} OK")

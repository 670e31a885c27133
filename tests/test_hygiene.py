"""Notebook hygiene: the conventions every notebook follows."""

import ast
import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert any(p.name == "08_lab.ipynb" for p in NOTEBOOKS)


@pytest.fixture(params=NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def nb(request):
    return request.param, json.loads(request.param.read_text())


def code_cells(d):
    return [c for c in d["cells"] if c["cell_type"] == "code"]


def src(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def test_first_code_cell_is_parameters_with_plain_assignments(nb):
    path, d = nb
    first = code_cells(d)[0]
    assert "parameters" in first["metadata"].get("tags", []), (
        f"{path.name}: first code cell not tagged 'parameters'"
    )
    tree = ast.parse(src(first))
    assert tree.body and all(
        isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant) for s in tree.body
    ), f"{path.name}: the parameters cell must hold only plain assignments of constants"
    names = {t.id for s in tree.body for t in s.targets}
    assert "n_devices" in names


def test_device_setup_comes_before_anything_touches_jax(nb):
    path, d = nb
    cells = code_cells(d)
    assert "setup_devices(" in src(cells[1]), (
        f"{path.name}: the second code cell must set up devices"
    )
    for c in cells[:2]:
        assert "import jax" not in src(c) and "from jax" not in src(c), (
            f"{path.name}: JAX imported before device setup"
        )


def test_no_outputs_committed(nb):
    path, d = nb
    for c in code_cells(d):
        assert not c.get("outputs") and c.get("execution_count") is None, (
            f"{path.name}: committed outputs"
        )


def test_every_cell_has_a_unique_id(nb):
    # nbformat >= 4.5 warns "Cell is missing an id field, this will become a hard error" on every command
    # that reads a notebook without them (make course, make student, papermill)
    path, d = nb
    ids = [c.get("id") for c in d["cells"]]
    missing = [i for i, x in enumerate(ids) if not x]
    assert not missing, (
        f"{path.name}: cells {missing} have no id (nbformat.validator.normalize adds them)"
    )
    assert len(set(ids)) == len(ids), f"{path.name}: cell ids repeat"
    assert (d["nbformat"], d["nbformat_minor"]) >= (4, 5), f"{path.name}: ids need nbformat 4.5"


def test_generic_kernelspec(nb):
    path, d = nb
    assert d["metadata"]["kernelspec"]["name"] == "python3", (
        f"{path.name}: kernelspec is not python3"
    )


def test_notebook_names_follow_the_map(nb):
    path, _ = nb
    assert path.name[:2].isdigit() and path.name[2] == "_"

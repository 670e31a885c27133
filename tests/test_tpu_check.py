"""The in-process notebook runner (course_tools.inprocess) and tools/tpu_check.sh on a machine without a TPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from course_tools import inprocess

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "tpu_check.sh"


def notebook(tmp_path, *cells):
    """A notebook whose first code cell is tagged parameters; ``cells`` are (source, tags) pairs."""
    nb = {
        "cells": [
            {"cell_type": "markdown", "id": "m", "metadata": {}, "source": "# a notebook"},
            *[
                {
                    "cell_type": "code",
                    "id": f"c{i}",
                    "metadata": {"tags": list(tags)},
                    "execution_count": None,
                    "outputs": [],
                    "source": src,
                }
                for i, (src, tags) in enumerate(cells)
            ],
        ],
        "metadata": {
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(nb))
    return path


def test_parameters_are_injected_after_the_parameters_cell(tmp_path):
    src = notebook(
        tmp_path, ("n_devices = 8\nname = 'x'", ["parameters"]), ("print(n_devices, name)", [])
    )
    out = tmp_path / "out.ipynb"
    report = inprocess.execute(src, out, {"n_devices": 2}, echo=False)
    assert report["ok"] and report["failed_cell"] is None
    cells = json.loads(out.read_text())["cells"]
    assert "injected-parameters" in cells[2]["metadata"]["tags"]
    assert cells[3]["outputs"][0]["text"] == "2 x\n"
    assert json.loads(src.read_text())["cells"][1]["outputs"] == []  # the source is not changed


def test_an_unknown_parameter_is_refused_with_the_known_names(tmp_path):
    src = notebook(tmp_path, ("n_devices = 8", ["parameters"]))
    with pytest.raises(
        inprocess.InProcessRefused, match="no parameter n_device: .* assigns n_devices"
    ):
        inprocess.execute(src, tmp_path / "out.ipynb", {"n_device": 2}, echo=False)
    assert not (tmp_path / "out.ipynb").exists()


def test_a_failing_cell_stops_the_run_and_is_named(tmp_path):
    src = notebook(
        tmp_path,
        ("n = 1", ["parameters"]),
        ("1 / 0", ["raises-exception"]),  # expected
        ("assert n == 2, 'n is not 2'", []),
        ("print('never')", []),
    )
    report = inprocess.execute(src, tmp_path / "out.ipynb", echo=False)
    assert not report["ok"] and report["failed_cell"] == 3
    assert report["error"] == "AssertionError: n is not 2"
    assert len(report["cells"]) == 3  # the last cell did not run
    kept = json.loads((tmp_path / "out.ipynb").read_text())["cells"]
    assert kept[3]["outputs"][-1]["ename"] == "AssertionError"
    report = inprocess.execute(src, tmp_path / "out.ipynb", echo=False, keep_going=True)
    assert report["failed_cell"] == 3 and len(report["cells"]) == 4


def test_plots_and_tables_are_kept_as_rich_outputs(tmp_path):
    src = notebook(
        tmp_path,
        ("n = 1", ["parameters"]),
        ("import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()", []),
        ("import pandas as pd\ndisplay(pd.DataFrame({'a': [1]}))", []),
    )
    inprocess.execute(src, tmp_path / "out.ipynb", echo=False)
    cells = json.loads((tmp_path / "out.ipynb").read_text())["cells"]
    assert any("image/png" in o.get("data", {}) for o in cells[2]["outputs"])
    assert any("text/html" in o.get("data", {}) for o in cells[3]["outputs"])


def test_a_cell_ending_in_a_semicolon_shows_no_value_as_in_a_kernel(tmp_path):
    # the lessons' check cells end in ";": the checker prints its verdict, its True is not shown again
    src = notebook(
        tmp_path,
        ("n = 1", ["parameters"]),
        ("print('✓ right')\nn == 1;  # checked", []),
        ("n == 1", []),
    )
    inprocess.execute(src, tmp_path / "out.ipynb", echo=False)
    cells = json.loads((tmp_path / "out.ipynb").read_text())["cells"]
    assert [o["text"] for o in cells[2]["outputs"]] == ["✓ right\n"]
    assert "True" in cells[3]["outputs"][0]["text"]  # without one, the value is shown


def test_the_command_line_exit_status(tmp_path):
    src = notebook(tmp_path, ("n = 1", ["parameters"]), ("assert n == 1", []))
    run = lambda *a: subprocess.run(
        [sys.executable, "-m", "course_tools.inprocess", str(src), str(tmp_path / "o.ipynb"), *a],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run("--report", str(tmp_path / "r.json")).returncode == 0
    assert json.loads((tmp_path / "r.json").read_text())["ok"]
    assert run("-p", "n", "2").returncode == 1
    refused = run("-p", "m", "2")
    assert refused.returncode == 2 and "no parameter m" in refused.stderr


def sh(*args):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT)


def test_tpu_check_help_and_bad_arguments():
    assert "The course's TPU check" in sh("--help").stdout
    for args, message in [
        (["--frobnicate"], "unknown argument '--frobnicate'"),
        (["--timeout", "soon"], "--timeout soon is not a positive number"),
        (["--lab-param", "steps"], "--lab-param steps is not NAME=VALUE"),
        (["--rehearse"], "--rehearse needs --out"),
    ]:
        r = sh(*args)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)


def test_tpu_check_without_a_tpu_stops_before_installing(tmp_path):
    r = sh("--python", sys.executable, "--out", str(tmp_path / "ref"))
    assert r.returncode == 3 and "no TPU found (JAX's backend: cpu" in r.stderr
    assert not (tmp_path / "ref").exists()


def test_tpu_check_rehearses_the_mfu_step_at_the_tiny_size(tmp_path):
    import csv

    out = tmp_path / "ref"
    r = sh("--rehearse", "--steps", "mfu", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "mfu rc=0" in (out / "steps.txt").read_text()
    rows = list(csv.DictReader((out / "lm_mfu" / "mfu.csv").open()))
    # both settings of remat at batch 2, on the CPU: timed, no MFU claimed
    assert [(r["config"], r["batch"], r["remat"], r["fits"]) for r in rows] == [
        ("tiny", "2", "True", "True"),
        ("tiny", "2", "False", "True"),
    ]
    assert all(float(r["step_s"]) > 0 and r["mfu"] == "" and r["platform"] == "cpu" for r in rows)
    assert all(float(r["last_loss"]) < float(r["first_loss"]) for r in rows)

"""tools/make_reference.py: refusals before the lab runs (settings that are not the default reference's,
files that exist, a data folder that cannot be written), and what it writes. The lab run itself is
stood in for: it is the course runner's, tested in tests/test_run.py."""

import importlib.util

import disks
import pandas as pd
import pytest

from course_tools import folders, results, run

ROOT = results.PROJECT_ROOT
spec = importlib.util.spec_from_file_location(
    "make_reference", ROOT / "tools" / "make_reference.py"
)
make_reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_reference)


@pytest.fixture
def no_lab(monkeypatch):
    """The lab must not run in these cases."""

    def refuse(*args, **kwargs):
        raise AssertionError("the lab ran")

    monkeypatch.setattr(run, "run_lab", refuse)


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "DATA_DIR", tmp_path / "data")
    (tmp_path / "data").mkdir()
    return tmp_path / "data"


def test_the_default_name_is_only_written_at_the_default_settings(no_lab, data_dir, capsys):
    assert make_reference.main(["--n-devices", "4"]) == 2
    err = capsys.readouterr().err
    assert "reference_cpu_8sim is the 8-device CPU reference" in err and "give --name" in err


def test_an_existing_reference_is_replaced_only_with_overwrite(no_lab, data_dir, capsys):
    (data_dir / "reference_cpu_8sim.csv").write_text("mine\n")
    assert make_reference.main([]) == 2
    assert "make reference OVERWRITE=1" in capsys.readouterr().err
    assert (data_dir / "reference_cpu_8sim.csv").read_text() == "mine\n"


def test_a_data_folder_that_cannot_be_written_is_refused_before_the_lab(
    no_lab, tmp_path, monkeypatch, capsys
):
    with disks.read_only(tmp_path / "ro") as ro:
        monkeypatch.setattr(results, "DATA_DIR", ro)
        assert make_reference.main(["--name", "mine"]) == 2
    assert f"cannot write the data folder {ro}" in capsys.readouterr().err


def test_what_it_writes_says_how_when_and_of_which_commit(data_dir, tmp_path, capsys):
    lab = tmp_path / "lab-3"
    lab.mkdir()
    pd.DataFrame({"strategy": ["jit"], "step_time_s": [0.1]}).to_csv(
        lab / results.RESULTS_FILE, index=False
    )
    pd.DataFrame({"strategy": ["pmap"], "n_devices": [2]}).to_csv(
        lab / results.SCALING_FILE, index=False
    )
    targets = [data_dir / "mine.csv", data_dir / "mine_scaling.csv"]
    make_reference.write(lab, targets, ("8", "cpu", "auto"))
    header = targets[0].read_text().splitlines()[:2]
    assert header[0] == (
        "# Reference lab run MEASURED by this project: python tools/make_reference.py --n-devices 8 "
        "--platform cpu --profile auto"
    )
    commit = folders.source_version()["commit"]
    assert f"; commit {(commit or 'unknown')[:12]}" in header[1] and "lab run lab-3;" in header[1]
    assert results.load_reference("mine.csv")["strategy"].tolist() == ["jit"]
    assert f"(recorded {header[1].split()[2].rstrip(';')})" in results.reference_note("mine.csv")
    assert pd.read_csv(targets[1], comment="#")["strategy"].tolist() == ["pmap"]
    assert "replaced" not in capsys.readouterr().out
    make_reference.write(
        lab, targets, ("8", "cpu", "auto")
    )  # again (--overwrite): each file says so
    out = capsys.readouterr().out
    assert all(f"wrote {t} (replaced the earlier reference file)" in out for t in targets), out

"""The lab run end to end with papermill (as a batch study would), at 1, 2 and 8 devices, tiny profile."""

import pandas as pd
import pytest

from course_lib import results, run


@pytest.mark.parametrize("n", [1, 2, 8])
def test_lab_with_papermill(tmp_path, n):
    # The scaling sweep at 8 devices is exercised by the nbmake run of the notebook; here n=2 covers it.
    out = run.run_lab(n, platform="cpu", profile="tiny", build=str(tmp_path), progress=False,
                      extra={"scaling": n == 2})
    assert out == tmp_path / "lab"
    res = pd.read_csv(out / results.RESULTS_FILE)
    assert set(results.RESULT_COLUMNS) <= set(res.columns)
    assert list(res["strategy"]) == ["jit", "pmap", "shard_map", "sharded_jit", "shard_map_article"]
    assert res.loc[res.strategy != "jit", "n_devices"].eq(n).all() and (res["profile"] == "tiny").all()
    assert (res["steps"] == 6).all() and (res["samples_per_s"] > 0).all() and (res["bytes_per_device"] > 0).all()
    curves = pd.read_csv(out / results.CURVES_FILE)
    assert len(curves) == 5 * 6 and set(curves.columns) == {"strategy", "step", "loss"}
    for png in ("loss_curves.png", "comparison.png"):
        assert (out / png).stat().st_size > 10_000
    assert (out / "08_lab.ipynb").exists()
    if n == 2:
        scaling = pd.read_csv(out / results.SCALING_FILE)
        assert sorted(scaling["n_devices"].unique()) == [1, 2]
        assert set(scaling["strategy"]) == {"pmap", "shard_map", "sharded_jit"}
        assert (out / "scaling.png").stat().st_size > 10_000
    else:
        assert not (out / results.SCALING_FILE).exists()


def test_second_run_goes_to_a_new_folder_and_bad_input_is_refused(tmp_path, capsys):
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / results.RESULTS_FILE).write_text("strategy\nmine\n")
    assert run.main(["lab", "--n-devices", "eight", "--build", str(tmp_path)]) == 1
    assert "n_devices='eight' is not an integer" in capsys.readouterr().err
    assert run.main(["lab", "--n-devices", "0", "--build", str(tmp_path)]) == 1
    assert (tmp_path / "lab" / results.RESULTS_FILE).read_text() == "strategy\nmine\n"
    assert not (tmp_path / "lab-2").exists()  # refused before any folder was made


def test_a_failing_lab_names_the_cell(tmp_path):
    with pytest.raises(run.NotebookFailed, match=r"08_lab.ipynb failed in cell \[\d+\] with ValueError: .*global batch 9"):
        run.run_lab(2, platform="cpu", profile="tiny", build=str(tmp_path), extra={"global_batch": 9}, progress=False)

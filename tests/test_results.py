"""Results files (never silently overwritten) and the references in data/."""

import pandas as pd
import pytest

from course_tools import results


def test_results_dir_is_never_silently_overwritten(tmp_path, capsys):
    first = results.prepare_results_dir(tmp_path / "lab")
    assert first == tmp_path / "lab"
    results.write_csv([{"a": 1}], first / results.RESULTS_FILE)
    assert capsys.readouterr().out == ""  # a new folder: nothing to say
    second = results.prepare_results_dir(tmp_path / "lab")
    assert second == tmp_path / "lab-2" and second.is_dir()
    assert (
        capsys.readouterr().out
        == (  # one line: the folder in use, and where the run writes instead
            f"the results folder {first} already holds files ({results.RESULTS_FILE}); nothing there is "
            f"overwritten: this run writes to {second} instead\n"
        )
    )
    results.write_csv([{"a": 2}], second / results.RESULTS_FILE)
    assert results.prepare_results_dir(tmp_path / "lab") == tmp_path / "lab-3"
    capsys.readouterr()
    assert results.prepare_results_dir(tmp_path / "lab", overwrite=True) == first
    assert pd.read_csv(first / results.RESULTS_FILE)["a"].tolist() == [1]  # untouched until written
    said = f"overwrite=True: {first} already holds results files or plots ({results.RESULTS_FILE});"
    assert said in capsys.readouterr().out  # one line saying what may be replaced
    assert results.prepare_results_dir(tmp_path / "fresh", overwrite=True)
    assert "overwrite=True" not in capsys.readouterr().out  # nothing there: nothing said


def test_results_dir_errors(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        results.prepare_results_dir(tmp_path / "file")
    with pytest.raises(ValueError, match="results_dir is empty"):
        results.prepare_results_dir("")


def test_resolve_results_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("COURSE_BUILD_DIR", str(tmp_path))
    assert results.resolve_results_dir("auto") == tmp_path / "lab"
    assert results.resolve_results_dir("build/x") == results.PROJECT_ROOT / "build/x"
    assert results.resolve_results_dir(tmp_path / "abs") == tmp_path / "abs"


def test_write_csv_checks_columns(tmp_path):
    with pytest.raises(ValueError, match="lack the columns \\['strategy'"):
        results.write_csv([{"x": 1}], tmp_path / "r.csv", required=results.RESULT_COLUMNS)
    with pytest.raises(ValueError, match="no rows"):
        results.write_csv([], tmp_path / "r.csv")
    with pytest.raises(FileNotFoundError, match="run notebooks/08_lab.ipynb"):
        results.load_results(tmp_path)


def test_article_figures_are_marked_reported_not_measured():
    art = results.load_reference("article")
    assert list(art["strategy"]) == ["jit", "pmap", "shard_map"]
    assert (art["measured"] == False).all()  # noqa: E712
    assert art["samples_per_s"].tolist() == [320, 1980, 2560]
    text = (results.DATA_DIR / "article_reported.csv").read_text()
    assert "NOT MEASURED" in text
    with pytest.raises(FileNotFoundError, match="present in data/"):
        results.load_reference("nope")


def test_reference_cpu_run_has_metadata_and_contract_columns():
    ref = results.load_reference("cpu")
    assert set(results.RESULT_COLUMNS) <= set(ref.columns)
    assert set(ref["strategy"]) >= {"jit", "pmap", "shard_map", "sharded_jit"}
    assert (ref["platform"] == "cpu").all() and (ref["n_devices"].max() == 8)


def test_a_folder_with_the_readers_files_is_not_written_into(tmp_path):
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "notes.txt").write_text("mine")
    assert results.prepare_results_dir(tmp_path / "lab") == tmp_path / "lab-2"
    (tmp_path / "empty").mkdir()
    assert (
        results.prepare_results_dir(tmp_path / "empty") == tmp_path / "empty"
    )  # an interrupted run left nothing


def _lm_tables(**change):
    one = lambda cols: [dict.fromkeys(cols, 1)]  # noqa: E731
    tables = {k: one(cols) for k, cols in results.LM_COLUMNS.items()}
    tables["model"][0]["is_model"] = True
    return {**tables, **change}


def test_the_transformer_lab_writes_its_tables_to_a_fresh_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("COURSE_BUILD_DIR", str(tmp_path))
    first = results.prepare_results_dir("auto", name="lab12")
    assert first == tmp_path / "lab12"
    paths = results.write_lm_results(first, _lm_tables())
    assert [p.name for p in paths] == list(results.LM_FILES.values())
    for p, cols in zip(paths, results.LM_COLUMNS.values(), strict=True):
        assert tuple(pd.read_csv(p).columns) == cols
    assert (
        results.prepare_results_dir("auto", name="lab12") == tmp_path / "lab12-2"
    )  # never over it


def test_the_transformer_lab_tables_are_checked(tmp_path):
    with pytest.raises(ValueError, match="lack the columns \\['parity_f64'\\]"):
        bad = [{c: 1 for c in results.LM_RESULT_COLUMNS if c != "parity_f64"}]
        results.write_lm_results(tmp_path, _lm_tables(results=bad))
    with pytest.raises(ValueError, match="is a model \\(is_model=True\\)"):
        results.write_lm_results(
            tmp_path, _lm_tables(model=[dict.fromkeys(results.LM_MODEL_COLUMNS, False)])
        )
    with pytest.raises(ValueError, match="writes the tables"):
        results.write_lm_results(tmp_path, {"results": []})
    with pytest.raises(ValueError, match="no rows to write to .*lm_memory.csv"):
        results.write_lm_results(tmp_path, _lm_tables(memory=[]))


def test_a_run_without_collectives_writes_an_empty_bytes_table(tmp_path):
    # one device on XLA:TPU: every mesh axis has size 1 and the compiler keeps no collective to list
    paths = results.write_lm_results(tmp_path, _lm_tables(bytes=[]))
    written = pd.read_csv(paths[list(results.LM_FILES).index("bytes")])
    assert written.empty and tuple(written.columns) == results.LM_BYTES_COLUMNS

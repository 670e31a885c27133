"""Measurement, results files, plots and lab profiles."""

import math

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import pandas as pd
import pytest

matplotlib.use("Agg")

from course_lib import lab, measure, plots  # noqa: E402
from course_tools import results  # noqa: E402


def test_timing_summary():
    t = measure.Timing.from_samples([0.3, 0.1, 0.2, 0.4, 0.5])
    assert t.median_s == 0.3 and t.min_s == 0.1 and t.max_s == 0.5 and t.n == 5
    assert math.isclose(t.iqr_s, 0.45 - 0.15)
    with pytest.raises(ValueError, match="no timing samples"):
        measure.Timing.from_samples([])


def test_time_calls_synchronises_and_counts():
    calls = []
    f = jax.jit(lambda x: x @ x)
    x = jnp.ones((64, 64))
    t = measure.time_calls(lambda: calls.append(1) or f(x), repeats=3, warmup=2)
    assert len(calls) == 5 and t.n == 3 and t.median_s > 0
    with pytest.raises(ValueError, match="repeats=0"):
        measure.time_calls(lambda: f(x), repeats=0)


def test_compile_and_analyse_matmul_flops_and_memory():
    x = jnp.ones((128, 128), jnp.float32)
    compiled, stats = measure.compile_and_analyse(lambda: jax.jit(lambda a: a @ a).lower(x))
    assert stats.flops_per_device == pytest.approx(2 * 128**3, rel=0.01)
    assert stats.argument_bytes == 128 * 128 * 4 and stats.output_bytes == 128 * 128 * 4
    assert stats.compile_s > 0 and stats.collectives_str() == "none"
    np.testing.assert_allclose(compiled(x), x @ x)


def test_collectives_are_counted_in_a_sharded_program(report):
    from jax.sharding import NamedSharding, PartitionSpec as P
    from course_lib.meshes import DATA, data_mesh

    mesh = data_mesh(report.devices, axis_type="auto")
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P(DATA)))
    _, stats = measure.compile_and_analyse(lambda: jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, P())).lower(x))
    assert stats.collectives["all-reduce"] >= 1


def test_count_collectives_text():
    text = """
  %all-reduce.1 = f32[4] all-reduce(f32[4] %p), replica_groups={}
  %ag = f32[8] all-gather-start(f32[4] %x), dimensions={0}
  %agd = f32[8] all-gather-done(%ag)
  %cp = f32[4] collective-permute(f32[4] %y)
"""
    c = measure.count_collectives(text)
    assert c == {"all-reduce": 1, "all-gather": 1, "reduce-scatter": 0, "collective-permute": 1, "all-to-all": 0}


def test_human_bytes_and_peak_memory(report):
    assert measure.human_bytes(1536) == "1.5 KiB" and measure.human_bytes(None) == "n/a"
    assert measure.peak_device_memory(report.devices) is None  # CPU has no allocator stats


def test_results_dir_is_never_silently_overwritten(tmp_path):
    first = results.prepare_results_dir(tmp_path / "lab")
    assert first == tmp_path / "lab"
    results.write_csv([{"a": 1}], first / results.RESULTS_FILE)
    second = results.prepare_results_dir(tmp_path / "lab")
    assert second == tmp_path / "lab-2" and second.is_dir()
    results.write_csv([{"a": 2}], second / results.RESULTS_FILE)
    assert results.prepare_results_dir(tmp_path / "lab") == tmp_path / "lab-3"
    assert results.prepare_results_dir(tmp_path / "lab", overwrite=True) == first
    assert pd.read_csv(first / results.RESULTS_FILE)["a"].tolist() == [1]  # untouched until written


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


def test_profiles():
    assert lab.resolve_profile("auto", "cpu").name == "cpu"
    gpu = lab.resolve_profile("auto", "gpu")
    assert (gpu.image_size, gpu.global_batch) == (128, 512)  # the source article's setting
    assert lab.resolve_profile("cpu", "cpu", steps="7").steps == 7
    assert lab.resolve_profile("cpu", "cpu", steps=0).steps == lab.PROFILES["cpu"].steps
    assert lab.resolve_profile("tiny", "cpu", global_batch=16).global_batch == 16
    with pytest.raises(ValueError, match="profile='huge'"):
        lab.resolve_profile("huge", "cpu")
    with pytest.raises(ValueError, match="steps='eight'"):
        lab.resolve_profile("cpu", "cpu", steps="eight")
    with pytest.raises(ValueError, match="must exceed the 2 warm-up steps"):
        lab.resolve_profile("cpu", "cpu", steps=2)
    with pytest.raises(ValueError, match="global_batch=-4"):
        lab.resolve_profile("cpu", "cpu", global_batch=-4)


def test_run_strategy_row_has_the_contract_columns(report):
    cfg = lab.resolve_profile("tiny", "cpu")
    run = lab.run_strategy("sharded_jit", report.devices[:2], cfg, report=report, progress=False)
    assert set(results.RESULT_COLUMNS) <= set(run.row)
    assert run.row["n_devices"] == 2 and run.row["mesh"] == "data=2" and run.row["steps"] == cfg.steps
    assert len(run.losses) == cfg.steps and len(run.step_times_s) == cfg.steps
    assert run.row["samples_per_s"] == pytest.approx(cfg.global_batch / run.row["step_time_s"])
    assert run.row["flops_per_step"] > 0 and "all-reduce" in run.row["collectives"]
    assert run.row["platform"] == "cpu" and run.row["jax_version"] == jax.__version__


def test_scaling_sweep_skips_indivisible_counts(report, capsys):
    cfg = lab.resolve_profile("tiny", "cpu", global_batch=6)
    rows = lab.scaling_sweep(report.devices[:4], cfg, keys=("sharded_jit",), counts=[1, 2, 4], progress=False)
    assert [r["n_devices"] for r in rows] == [1, 2]
    assert "global batch 6 is not divisible by 4 data shards" in capsys.readouterr().out


def test_plots_draw_what_they_are_given():
    curves = pd.DataFrame(results.curves_rows({"jit": [3.0, 2.0, 1.0], "pmap": [3.0, 2.0, 1.0]}))
    ax = plots.loss_curves(curves)
    assert len(ax.lines) == 2
    rows = pd.DataFrame([
        {"strategy": s, "n_devices": n, "samples_per_s": 100.0 * n ** 0.5, "step_time_s": 0.1, "bytes_per_device": 2**20,
         "achieved_flops_per_s": 1e9, "simulated": True}
        for s in ("pmap", "sharded_jit") for n in (1, 2, 4)])
    ax = plots.scaling(rows)
    assert len(ax.lines) == 3 and "relative" in ax.get_ylabel()
    eff = plots.scaling_efficiency(rows)
    assert eff.loc[eff.n_devices == 4, "efficiency"].tolist() == pytest.approx([0.5, 0.5])
    fig = plots.comparison(rows[rows.n_devices == 4], reference=rows[rows.n_devices == 1])
    assert len(fig.axes) == 4 and len(fig.axes[0].patches) == 4
    matplotlib.pyplot.close("all")


@pytest.mark.parametrize("value, expected", [(True, True), ("False", False), ("true", True), (0, 0), ("1", True)])
def test_parse_bool(value, expected):
    assert lab.parse_bool(value, "overwrite") is bool(expected)


def test_parse_bool_rejects_other_values():
    with pytest.raises(ValueError, match="overwrite='maybe' is not a yes/no value"):
        lab.parse_bool("maybe", "overwrite")


def test_check_divisibility_names_strategy_and_numbers():
    cfg = lab.resolve_profile("tiny", "cpu", global_batch=9)
    with pytest.raises(ValueError, match="strategy 'pmap' on 2 devices: global batch 9 is not divisible by 2"):
        lab.check_divisibility(cfg, 2)
    lab.check_divisibility(lab.resolve_profile("tiny", "cpu"), 8)


def test_a_folder_with_the_readers_files_is_not_written_into(tmp_path):
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "notes.txt").write_text("mine")
    assert results.prepare_results_dir(tmp_path / "lab") == tmp_path / "lab-2"
    (tmp_path / "empty").mkdir()
    assert results.prepare_results_dir(tmp_path / "empty") == tmp_path / "empty"  # an interrupted run left nothing


@pytest.mark.parametrize("n, batch", [(1, 64), (2, 64), (3, 66), (4, 64), (5, 80), (6, 72), (7, 84), (8, 64)])
def test_default_batch_fits_any_device_count(n, batch, capsys):
    cfg = lab.resolve_profile("cpu", "cpu", n_devices=n)
    assert cfg.global_batch == batch
    assert ("note: global batch 64 ->" in capsys.readouterr().out) == (batch != 64)
    with pytest.raises(ValueError, match="global batch 64 is not divisible by 3"):
        lab.check_divisibility(lab.resolve_profile("cpu", "cpu", global_batch=64, n_devices=3), 3)


@pytest.mark.parametrize("bad", ["three", -1, 1.5, True])
def test_seed_is_checked(bad):
    with pytest.raises(ValueError, match="seed="):
        lab.parse_seed(bad)
    assert lab.parse_seed("3") == 3 and lab.parse_seed(0) == 0

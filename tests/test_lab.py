"""The lab's runs: one measured run per strategy, the scaling sweep, the divisibility check."""

import jax
import pytest

from course_lib import config, lab
from course_tools import results


def test_run_strategy_row_has_the_contract_columns(report):
    cfg = config.resolve_profile("tiny", "cpu")
    run = lab.run_strategy("sharded_jit", report.devices[:2], cfg, report=report, progress=False)
    assert set(results.RESULT_COLUMNS) <= set(run.row)
    assert (
        run.row["n_devices"] == 2 and run.row["mesh"] == "data=2" and run.row["steps"] == cfg.steps
    )
    assert len(run.losses) == cfg.steps and len(run.step_times_s) == cfg.steps
    assert run.row["samples_per_s"] == pytest.approx(cfg.global_batch / run.row["step_time_s"])
    assert run.row["flops_per_step"] > 0 and "all-reduce" in run.row["collectives"]
    assert run.row["platform"] == "cpu" and run.row["jax_version"] == jax.__version__


def test_scaling_sweep_skips_indivisible_counts(report, capsys):
    cfg = config.resolve_profile("tiny", "cpu", global_batch=6)
    rows = lab.scaling_sweep(
        report.devices[:4], cfg, keys=("sharded_jit",), counts=[1, 2, 4], progress=False
    )
    assert [r["n_devices"] for r in rows] == [1, 2]
    assert "global batch 6 is not divisible by 4 data shards" in capsys.readouterr().out


def test_check_divisibility_names_strategy_and_numbers():
    cfg = config.resolve_profile("tiny", "cpu", global_batch=9)
    with pytest.raises(
        ValueError, match="strategy 'pmap' on 2 devices: global batch 9 is not divisible by 2"
    ):
        lab.check_divisibility(cfg, 2)
    lab.check_divisibility(config.resolve_profile("tiny", "cpu"), 8)

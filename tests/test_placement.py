"""The grid of where each kind of array lives (course_lib.placement, notebooks/08_lab.ipynb section 4.1)."""

import matplotlib

matplotlib.use("Agg")

import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from course_lib import placement  # noqa: E402


def _table():
    whole = dict(param_bytes_per_device=800, grad_bytes_per_device=800, opt_state_bytes_per_device=1600,
                 activation_bytes_per_device=6400, local_batch=64)  # fmt: skip
    rows = [
        {"strategy": "jit", **whole},
        {"strategy": "pmap", **whole, "activation_bytes_per_device": 800, "local_batch": 8},
        {"strategy": "fsdp", "param_bytes_per_device": 100, "grad_bytes_per_device": 100,
         "opt_state_bytes_per_device": 200, "activation_bytes_per_device": 800, "local_batch": 8},
        {"strategy": "shard_map", "param_bytes_per_device": 400, "grad_bytes_per_device": 400,
         "opt_state_bytes_per_device": 800, "activation_bytes_per_device": 1700, "local_batch": 16},
        {"strategy": "shard_map_article", "param_bytes_per_device": 700, "grad_bytes_per_device": 700,
         "opt_state_bytes_per_device": 1400, "activation_bytes_per_device": 2000, "local_batch": 16},
    ]  # fmt: skip
    return pd.DataFrame(rows)


def test_shares_compose_the_zero_stages_from_b_and_e():
    g = placement.shares(_table())
    assert list(g.columns) == ["pmap", "zero1", "zero2", "fsdp", "shard_map", "shard_map_article"]
    assert (g["pmap"][["parameters", "gradients", "optimizer state"]] == 1).all()
    assert g.loc["optimizer state", "zero1"] == 1 / 8 and g.loc["gradients", "zero1"] == 1
    assert g.loc["gradients", "zero2"] == 1 / 8 and g.loc["parameters", "zero2"] == 1
    assert (g["fsdp"][["parameters", "gradients", "optimizer state", "batch"]] == 1 / 8).all()
    assert g.loc["batch", "shard_map"] == 1 / 4
    assert g.loc["parameters", "shard_map_article"] == 7 / 8  # C′ (C2 absent: not drawn)


def test_labels_name_whole_one_over_n_and_shares_in_between():
    assert placement.label(1.0) == "whole"
    assert placement.label(0.125) == "1/8"
    assert placement.label(0.188) == "19% (1/5.3)"
    assert placement.label(0.0) == "none"


def test_grid_draws_a_cell_per_kind_and_strategy():
    g = placement.shares(_table())
    fig = placement.grid(g, 8)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert len(texts) == g.size and texts.count("whole") == 6
    assert "DP × TP,\nconv1 only (C′)" in [t.get_text() for t in fig.axes[0].get_xticklabels()]


def test_shares_need_a_and_b_and_e():
    with pytest.raises(KeyError, match="fsdp"):
        placement.shares(_table()[lambda t: t.strategy != "fsdp"])

"""Lab 08's time model at the source article's setting (course_lib.lab_scale, notebooks/08_lab.ipynb 6.6)."""

import pytest

from course_lib import costs, lab_scale, strategies
from course_lib.config import resolve_profile

KEYS = ("pmap", "sharded_jit", "fsdp", "shard_map", "shard_map_pairs")


def test_each_step_is_the_time_model_of_the_predicted_collectives():
    cfg = resolve_profile("gpu", "gpu")
    table = lab_scale.article_scale_steps(cfg, ("A100", "H100"), KEYS)
    assert list(table.index) == list(KEYS)
    assert list(table.columns) == [
        "collectives", "A100 step ms", "A100 α ms", "H100 step ms", "H100 α ms",
    ]  # fmt: skip
    flops = costs.model_flops_per_step(cfg.model, cfg.global_batch) / 8
    for key in KEYS:
        t = strategies.predict_comm(key, cfg.model, cfg.global_batch, 8, platform="gpu")
        h100 = costs.FABRICS["H100"]
        step = costs.step_time(flops, None, t, h100, "float32")
        assert table.loc[key, "collectives"] == len(t)
        assert table.loc[key, "H100 step ms"] == pytest.approx(step["no_overlap_s"] * 1e3)
        # α: every ring step of every collective pays the link's latency once
        steps = sum((2 if c.kind == "all-reduce" else 1) * (c.group_size - 1) for c in t)
        alpha_ms = steps * h100.link.latency_s * 1e3
        assert table.loc[key, "H100 α ms"] == pytest.approx(alpha_ms, rel=1e-9)


def test_a_latency_override_moves_only_the_alpha_part():
    cfg = resolve_profile("gpu", "gpu")
    own = lab_scale.article_scale_steps(cfg, ("A100",), KEYS)
    at_1us = lab_scale.article_scale_steps(cfg, ("A100",), KEYS, latency_s=1e-6)
    ratio = 1e-6 / costs.FABRICS["A100"].link.latency_s
    expected = (own["A100 α ms"] * ratio).to_numpy()
    assert at_1us["A100 α ms"].to_numpy() == pytest.approx(expected, rel=1e-9)
    moved = own["A100 step ms"] - at_1us["A100 step ms"]
    assert moved.to_numpy() == pytest.approx((own["A100 α ms"] - at_1us["A100 α ms"]).to_numpy())
    with pytest.raises(KeyError):
        lab_scale.article_scale_steps(cfg, ("V100",), KEYS)

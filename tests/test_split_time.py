"""Time beside bytes for lesson 10's splits (course_lib.split_time): the analytic counts against the
transformer's own parameters and XLA:CPU's cost analysis, the communication-bound degree against
costs.step_time, the ring matmul's plan, and the async windows read from XLA:TPU's reference program."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from course_lib import aot, costs, split_time, splits, transformer

LESSON = transformer.TransformerConfig(16, 16, 32, 8, 64, 2)


@pytest.mark.parametrize("cfg", [LESSON, transformer.TINY, transformer.CPU])
def test_block_param_bytes_are_the_transformers(cfg):
    params = jax.eval_shape(lambda: transformer.init_model(jax.random.key(0), cfg)[1])
    assert split_time.block_param_bytes(cfg, 4) == splits.block_bytes(params["blocks"])


def test_block_flops_are_the_matmuls_xla_counts():
    """XLA:CPU's cost analysis of one block counts the matmuls and the elementwise work: a little more."""
    cfg = transformer.CPU
    params = jax.eval_shape(lambda: transformer.init_model(jax.random.key(0), cfg)[1])
    layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params["blocks"])
    x = jax.ShapeDtypeStruct((2, cfg.seq_len, cfg.d_model), jnp.float32)
    counted = jax.jit(transformer.block).lower(x, layer).compile().cost_analysis()["flops"]
    predicted = split_time.block_flops(cfg, 2)
    assert predicted <= counted < 1.1 * predicted


def test_split_costs():
    cfg, n = transformer.GPU, 8
    tp, sp = (split_time.split_cost(k, cfg, 16, n) for k in ("tp", "sp"))
    assert tp.flops == sp.flops and tp.sent_bytes == pytest.approx(sp.sent_bytes)
    act = 16 * cfg.seq_len * cfg.d_model * 2
    assert tp.sent_bytes == pytest.approx(2 * 2 * (n - 1) / n * act)
    ring, uly = (split_time.split_cost(k, cfg, 16, n) for k in ("ring", "ulysses"))
    assert ring.sent_bytes / uly.sent_bytes == pytest.approx(n / 2)
    assert ring.flops == pytest.approx(uly.flops)  # every score, on every device
    dp, z3 = (split_time.split_cost(k, cfg, 16, n) for k in ("dp", "zero3"))
    assert z3.sent_bytes / dp.sent_bytes == pytest.approx(
        1.5
    ) and z3.flops / dp.flops == pytest.approx(4 / 3)
    assert split_time.split_cost("tp", cfg, 16, 1).flops_per_byte == float("inf")
    with pytest.raises(ValueError, match="n_heads=16 divisible"):
        split_time.split_cost("tp", cfg, 16, 3)
    with pytest.raises(ValueError, match="one of"):
        split_time.split_cost("pp", cfg, 16, 2)


def test_fabric_ratio():
    v5e, h100 = costs.FABRICS["TPU v5e"], costs.FABRICS["H100"]
    assert split_time.fabric_ratio(v5e) == pytest.approx(197e12 / 100e9)
    assert split_time.fabric_ratio(v5e, both_ways=False) == pytest.approx(197e12 / 50e9)
    assert split_time.fabric_ratio(h100) == split_time.fabric_ratio(h100, both_ways=False)


@pytest.mark.parametrize("fabric", ["TPU v5e", "H100", "A100"])
@pytest.mark.parametrize("kind", ["tp", "sp", "ring", "ulysses"])
def test_comm_bound_degree_agrees_with_step_time(kind, fabric):
    """The first valid degree at which step_time's collectives outlast the matmuls (None: none up to 1024)."""
    fab, cfg = costs.FABRICS[fabric], dataclasses.replace(transformer.GPU, seq_len=32768)
    n = split_time.comm_bound_degree(kind, cfg, 4, fab)
    degrees = split_time.valid_degrees(kind, cfg, 4)
    bound = [
        split_time.timing(split_time.split_cost(kind, cfg, 4, d), fab)["comm_bound"]
        for d in degrees
    ]
    assert n == next((d for d, b in zip(degrees, bound) if b), None)


@pytest.mark.parametrize("fabric", ["TPU v5e", "TPU v5p", "H100"])
def test_tp_critical_degree_is_where_step_time_turns(fabric):
    """Without latency, TP turns communication-bound at the first degree past the closed form's n*."""
    fab = costs.FABRICS[fabric]
    fab = dataclasses.replace(fab, link=dataclasses.replace(fab.link, latency_s=0.0))
    cfg = transformer.TransformerConfig(1024, 4096, 8192, 64, 32768, 2)
    star = split_time.tp_critical_degree(cfg, fab)
    first = min(n for n in split_time.valid_degrees("tp", cfg, 2) if n > star)
    assert split_time.comm_bound_degree("tp", cfg, 2, fab) == first


def test_ring_matmul_plan():
    v5e, h100 = costs.FABRICS["TPU v5e"], costs.FABRICS["H100"]
    uni = split_time.ring_matmul_plan("allgather", 8192, 2048, 2048, 8, v5e)
    bidi = split_time.ring_matmul_plan("bidirectional", 8192, 2048, 2048, 8, v5e)
    rs = split_time.ring_matmul_plan("reducescatter", 8192, 2048, 2048, 8, v5e)
    assert (uni["permutes"], bidi["permutes"], rs["permutes"]) == (7, 14, 7)
    assert uni["chunk_flops"] == 2 * 1024 * 2048 * 2048 == 2 * bidi["chunk_flops"]
    assert uni["step_s"] == pytest.approx(bidi["step_s"])
    # half a block each way on a ring: each step's sends take about half as long (α aside)
    assert bidi["permute_s"] - v5e.link.latency_s == pytest.approx(
        (uni["permute_s"] - v5e.link.latency_s) / 2
    )
    assert bidi["overlap_s"] < uni["overlap_s"] <= uni["no_overlap_s"]
    # through a switch the two halves share the device's bandwidth: no gain
    assert split_time.ring_matmul_plan("bidirectional", 8192, 2048, 2048, 8, h100)["permute_s"] == (
        pytest.approx(
            split_time.ring_matmul_plan("allgather", 8192, 2048, 2048, 8, h100)["permute_s"]
        )
    )
    with pytest.raises(ValueError, match="divide by 16"):
        split_time.ring_matmul_plan("bidirectional", 8, 4, 4, 8, v5e)


def test_async_windows_of_xla_tpus_collective_matmul():
    """The committed XLA:TPU program (v5e:2x4): each of the 7 sends is a start/done pair with one matmul
    scheduled between the two."""
    windows = split_time.async_windows(aot.hlo_text("lesson10.collective_matmul"))
    assert [w["op"] for w in windows] == ["collective-permute"] * 7
    assert all(w["matmuls"] == 1 for w in windows)
    assert split_time.async_windows(aot.hlo_text("lesson10.allgather_matmul")) == []


def test_window_counts_of_xla_tpus_rings():
    def counts(name):
        return split_time.window_counts(split_time.async_windows(aot.hlo_text(f"lesson10.{name}")))

    bidi, rs = counts("collective_matmul_bidi"), counts("collective_matmul_rs")
    keys = ("windows", "overlapped", "in_flight", "waiting")
    assert [bidi[k] for k in keys] == [14, 14, 2, 0]
    assert [rs[k] for k in keys] == [7, 6, 1, 1]
    assert rs["matmuls"] == [0] + [1] * 6
    assert counts("matmul_reducescatter") == dict(
        windows=0, overlapped=0, matmuls=[], in_flight=0, waiting=0
    )


def test_window_counts_of_a_written_schedule():
    hlo = """HloModule m

%mm (a: f32[2,2], b: f32[2,2]) -> f32[2,2] {
  %a = f32[2,2] parameter(0)
  %b = f32[2,2] parameter(1)
  ROOT %d = f32[2,2] dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[2,2]) -> f32[2,2] {
  %x = f32[2,2] parameter(0)
  %s0 = (f32[2,2], f32[2,2]) collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}
  %s1 = (f32[2,2], f32[2,2]) collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}
  %f0 = f32[2,2] fusion(%x, %x), kind=kOutput, calls=%mm
  %d0 = f32[2,2] collective-permute-done(%s0)
  %d1 = f32[2,2] collective-permute-done(%s1)
  ROOT %f1 = f32[2,2] fusion(%d1, %f0), kind=kOutput, calls=%mm
}
"""
    windows = split_time.async_windows(hlo)
    assert [w["start"] for w in windows] == ["s0", "s1"]
    assert [w["done_feeds_matmul"] for w in windows] == [False, True]
    got = split_time.window_counts(windows)
    assert got == dict(windows=2, overlapped=2, matmuls=[1, 1], in_flight=2, waiting=0)


def test_bound_degrees_and_their_table():
    """Section 6's table: transformer.GPU (batch 16) and at 131,072 tokens (batch 1), on v5e ICI and H100
    NVLink: each split's first bound degree, 'beyond H' where TP's n* exceeds the heads, 'none' where no
    degree up to 1024 is bound, and TP's n*."""
    models = {
        "gpu": (transformer.GPU, 16),
        "long": (dataclasses.replace(transformer.GPU, seq_len=131072), 1),
    }
    fabrics = {k: costs.FABRICS[k] for k in ("TPU v5e", "H100")}
    degree = split_time.bound_degrees(models, fabrics)
    assert set(degree) == {
        (m, f, k) for m in models for f in fabrics for k in split_time.SPLITS_BOUND
    }
    assert [degree["gpu", "TPU v5e", k] for k in split_time.SPLITS_BOUND] == [8, 8, 2, 4]
    assert [degree["gpu", "H100", k] for k in split_time.SPLITS_BOUND] == [4, 4, 2, 2]
    assert [degree["long", "TPU v5e", k] for k in split_time.SPLITS_BOUND] == [None, None, 64, None]
    table = split_time.degree_table(models, fabrics, degree)
    assert table.loc[("long", "H100"), "tp"] == "beyond H"  # n* 33.6 above H = 16
    assert table.loc[("long", "H100"), "ulysses"] == "none"
    assert list(table["n* (TP)"]) == [4.64, 4.26, 37.39, 33.6]
    assert table.loc[("gpu", "TPU v5e"), "D"] == transformer.GPU.d_model

"""Costs from shapes and datasheets (course_lib.costs): peak FLOP/s per GPU kind, MFU, the step-time model,
and the activations the backward pass keeps."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest

from course_lib import comms, costs, measure, model
from course_lib.config import PROFILES


@pytest.mark.parametrize(
    "kind, precision, matmul, tflops, name",
    [
        ("NVIDIA H100 80GB HBM3", "float32", "default", 494.7, "H100 SXM"),
        ("NVIDIA H100 80GB HBM3", "float32", "float32", 67.0, "H100 SXM"),
        ("NVIDIA H100 80GB HBM3", "float32", "highest", 67.0, "H100 SXM"),
        ("NVIDIA H100 80GB HBM3", "bfloat16", "default", 989.4, "H100 SXM"),
        ("NVIDIA H100 PCIe", "bfloat16", "default", 756.0, "H100 PCIe"),
        ("NVIDIA H100 NVL", "float32", "default", 417.5, "H100 NVL"),
        ("NVIDIA H200", "bfloat16", "default", 989.4, "H200"),
        ("NVIDIA H200 NVL", "bfloat16", "default", 835.5, "H200 NVL"),  # not the SXM's figure
        ("NVIDIA H200 NVL", "float32", "default", 417.5, "H200 NVL"),
        ("NVIDIA A100-SXM4-80GB", "float32", "default", 156.0, "A100 SXM4 80GB"),
        ("NVIDIA A100-PCIE-40GB", "bfloat16", "default", 312.0, "A100 40GB"),
        ("NVIDIA A100 80GB PCIe", "float32", "tensorfloat32", 156.0, "A100 PCIe 80GB"),
        ("TPU v5 lite", "bfloat16", "default", 197.0, "TPU v5e"),
        ("TPU v5 lite", "float32", "default", 197.0, "TPU v5e"),  # one bf16 pass per float32 matmul
        ("TPU v5 lite", "float32", "high", 197.0 / 3, "TPU v5e"),  # three passes
        ("TPU v5 lite", "float32", "highest", 197.0 / 6, "TPU v5e"),  # six passes
        ("TPU v5", "bfloat16", "default", 459.0, "TPU v5p"),
        ("TPU v5p", "bfloat16", "default", 459.0, "TPU v5p"),
        ("TPU v6 lite", "bfloat16", "default", 918.0, "TPU v6e"),
        ("NVIDIA A10", "float32", "float32", 31.2, "A10"),  # not matched by the A100 entry
        ("NVIDIA A40", "bfloat16", "default", 149.7, "A40"),
        ("NVIDIA L40S", "bfloat16", "default", 362.05, "L40S"),
        ("NVIDIA GeForce RTX 4090", "bfloat16", "default", 165.2, "RTX 4090"),
        ("Tesla V100-SXM2-16GB", "float32", "default", 15.7, "V100 SXM2"),  # no TF32 on Volta
    ],
)
def test_peak_flops_per_device_kind(kind, precision, matmul, tflops, name):
    peak, entry = costs.peak_flops(kind, precision, matmul)
    assert peak == pytest.approx(tflops * 1e12) and entry.name == name and entry.source


def test_the_table_gives_memory_and_links_with_sources():
    # (name, dense bf16 TFLOP/s, HBM GiB, HBM bytes/s, link bytes/s one way) as the vendors' pages give them
    checked = {
        "TPU v5e": (197.0, 16, 819e9, 200e9),
        "TPU v5p": (459.0, 95, 2765e9, 600e9),
        "TPU v6e": (918.0, 32, 1638e9, 400e9),
        "A100 SXM4 80GB": (312.0, 80, 2.039e12, 300e9),
        "A100 40GB": (312.0, 40, 1.555e12, None),
        "H100 SXM": (989.4, 80, 3.35e12, 450e9),
        "H200": (989.4, 141, 4.8e12, 450e9),
    }
    table = {p.name: p for p in costs.PEAKS}
    for name, (bf16, gib, hbm_s, link_s) in checked.items():
        p = table[name]
        assert p.peak_bf16_flops_per_s == bf16 * 1e12 and p.hbm_bytes == gib * 2**30, name
        assert (p.hbm_bytes_per_s, p.link_bytes_per_s) == (hbm_s, link_s), name
        assert p.source and p.url.startswith("https://"), name
    assert costs.chip_for("NVIDIA H100 80GB HBM3") is table["H100 SXM"]
    assert costs.chip_for("cpu") is None


def test_no_peak_where_none_is_known():
    assert costs.peak_flops("cpu", "float32") == (None, None)
    assert costs.peak_flops("NVIDIA Made-Up GPU", "float32") == (None, None)
    assert costs.peak_flops("Tesla V100-SXM2-16GB", "bfloat16")[0] is None  # Volta has no bf16 rate
    assert costs.peak_flops("NVIDIA H100 80GB HBM3", "float64")[0] is None
    assert math.isnan(costs.mfu(1e9, 0.01, None))
    assert costs.mfu(1e12, 0.01, 200e12) == pytest.approx(0.5)  # 1e14 FLOP/s of 2e14


def test_valid_taps_leave_out_the_padding():
    assert costs.valid_taps(32) == 94**2  # (3 s - 2)^2, against 9 s^2 = 9216 with the padding
    assert costs.valid_taps(1) == 1 and costs.valid_taps(2) == 16
    assert costs.valid_taps(5, kernel=1) == 25


def test_model_flops_count_the_work_a_step_needs():
    cpu = PROFILES["cpu"].model
    parts = costs.model_flops_breakdown(cpu)
    assert "conv1 input gradient" not in parts  # nobody needs the images' gradient
    assert parts["conv2 input gradient"] == parts["conv2 forward"] == 2 * 46**2 * 32 * 64
    assert parts["dense1 forward"] == 2 * 1024 * 128
    per_image = sum(parts.values())
    assert per_image == 42_083_328 and costs.model_flops_per_step(cpu, 64) == 64 * per_image
    # the 3 x forward rule counts the padding taps and conv1's input gradient: 15 % more here
    assert 3 * model.flops_per_example(cpu) / per_image == pytest.approx(1.154, abs=1e-3)


def test_the_critical_batch_when_part_of_the_traffic_grows_with_the_batch():
    v5e = costs.FABRICS["TPU v5e"]
    grads = comms.transfer("all-reduce", "data", 4, 4e8, "gradients")
    acts = comms.transfer("all-reduce", "model", 2, 1e7, "activations")
    flops, hbm = 197e12 * 0.01, 819e9 * 0.02  # HBM-bound: 20 ms
    # nothing grows: the library's critical_size
    t = costs.step_time(flops, hbm, [grads], v5e, "bfloat16")
    alone = costs.critical_batch(16, flops, hbm, [grads], v5e, "bfloat16")
    assert math.isclose(alone, costs.critical_size(16, t))
    # the activations grow with the batch: at b* the roofline equals the communication, to rounding
    both, grows = [grads, acts], [False, True]
    b = costs.critical_batch(16, flops, hbm, both, v5e, "bfloat16", grows=grows)
    at = costs.scaled_step_time(b / 16, flops, hbm, both, v5e, "bfloat16", grows=grows)
    assert math.isclose(at["roofline_s"], at["comm_s"], rel_tol=1e-9) and b > alone
    # traffic that grows faster than the roofline: communication-bound at every batch; none: 0
    big = dataclasses.replace(acts, size_bytes=1e12)
    assert costs.critical_batch(16, flops, hbm, [big], v5e, "bfloat16", grows=[True]) == math.inf
    assert costs.critical_batch(16, flops, hbm, [], v5e, "bfloat16") == 0.0
    with pytest.raises(ValueError, match="one per transfer"):
        costs.scaled_step_time(2, flops, hbm, both, v5e, "bfloat16", grows=[True])


def test_residual_activations_from_shapes():
    cpu = PROFILES["cpu"].model
    # per image: conv blocks 40960 + 20480 + 5120, dense 138 values; the input images are an argument
    assert costs.residual_activation_bytes(None, cpu, 8) == 66_698 * 8 * 4
    assert costs.residual_activation_bytes("pairs", cpu, 16, 2) == 4_047_488 - 3072 * 16 * 4
    assert costs.residual_activation_bytes("gather", cpu, 16, 2) == 3_282_176 - 3072 * 16 * 4
    assert costs.residual_activation_bytes(None, cpu, 8, value_bytes=2) == 66_698 * 8 * 2
    with pytest.raises(ValueError, match="unknown layout 'ring'"):
        costs.residual_activation_bytes("ring", cpu, 8)


# ---- time beside bytes ----------------------------------------------------------------------------------


def test_collective_time_on_a_ring_and_on_a_switch():
    ici, nvlink = costs.LINKS["ICI v5e"], costs.LINKS["NVLink 4"]
    gb = 1e9
    # a bidirectional ring sends half each way: 2(n-1)/n S over 2 x 50 GB/s, plus 2(n-1) steps of 1 µs
    assert math.isclose(
        costs.collective_time("all-reduce", 8, gb, ici), 14e-6 + 2 * 7 / 8 * gb / 100e9
    )
    assert math.isclose(
        costs.collective_time("all-gather", 8, gb, nvlink), 7 * 10e-6 + 7 / 8 * gb / 450e9
    )
    # a reduce-scatter's S is its operand: the same bytes as the all-gather of the result
    assert math.isclose(
        costs.collective_time("reduce-scatter", 8, gb, ici),
        costs.collective_time("all-gather", 8, gb, ici),
    )
    assert costs.collective_time("all-reduce", 1, gb, ici) == 0.0
    assert math.isclose(costs.collective_time("collective-permute", 8, gb, ici), 1e-6 + gb / 50e9)
    with pytest.raises(ValueError, match="unknown collective"):
        costs.collective_time("broadcast", 8, gb, ici)


def test_an_all_to_all_on_a_ring_costs_a_quarter_of_the_all_gather_of_its_shard():
    # the scaling book: on a bidirectional ring an all-to-all is ~1/4 of an all-gather of the same shard
    ici = dataclasses.replace(costs.LINKS["ICI v5e"], latency_s=0.0)
    for n in (8, 64):
        shard = 1e6
        a2a = costs.collective_time("all-to-all", n, shard, ici)
        gather = costs.collective_time("all-gather", n, n * shard, ici)
        assert 0.24 < a2a / gather < 0.30, (n, a2a / gather)
    # on a switch it sends (n-1)/n of its shard: cheaper than the gather by a factor n
    nv = dataclasses.replace(costs.LINKS["NVLink 4"], latency_s=0.0)
    ratio = costs.collective_time("all-to-all", 8, 1e6, nv) / costs.collective_time(
        "all-gather", 8, 8e6, nv
    )
    assert math.isclose(ratio, 1 / 8)


def test_step_time_bounds_and_the_critical_size():
    v5e = costs.FABRICS["TPU v5e"]
    grads = comms.transfer("all-reduce", "data", 8, 4e8, "gradients")
    t = costs.step_time(197e12 * 0.01, 819e9 * 0.001, [grads], v5e, "bfloat16")
    assert math.isclose(t["compute_s"], 0.01) and math.isclose(t["memory_s"], 0.001)
    assert t["bound"] == "compute" and t["roofline_s"] == t["compute_s"]
    comm = costs.collective_time("all-reduce", 8, 4e8, v5e.link)
    assert math.isclose(t["comm_s"], comm) and t["comm_by_axis"] == {"data": t["comm_s"]}
    assert math.isclose(t["overlap_s"], max(0.01, comm))
    assert math.isclose(t["no_overlap_s"], 0.01 + comm)
    # compute grows with the per-device batch, the gradients' all-reduce does not
    critical = costs.critical_size(16, t)
    assert math.isclose(critical, 16 * comm / 0.01)
    at = costs.step_time(197e12 * 0.01 * critical / 16, None, [grads], v5e, "bfloat16")
    assert math.isclose(at["compute_s"], at["comm_s"])
    # the data axis across nodes: the slowest link of a collective's axes carries it
    two_tier = costs.FABRICS["H100"].with_axis("data", costs.LINKS["InfiniBand NDR"])
    slow = costs.step_time(0, None, [grads], two_tier, "bfloat16")
    fast = costs.step_time(0, None, [grads], costs.FABRICS["H100"], "bfloat16")
    assert slow["comm_s"] > 8 * fast["comm_s"]
    with pytest.raises(ValueError, match="no peak rate for precision='float64'"):
        costs.step_time(1, None, [], v5e, "float64")


def test_step_time_reads_a_compiled_programs_collectives():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    w = jax.device_put(jnp.ones((256, 256)), jax.NamedSharding(mesh, jax.P()))
    x = jax.device_put(jnp.ones((64, 256)), jax.NamedSharding(mesh, jax.P("data")))
    grad = jax.jit(jax.grad(lambda w, x: jnp.sum((x @ w) ** 2)))
    _, stats = measure.compile_and_analyse(lambda: grad.lower(w, x), dict(mesh.shape))
    t = costs.step_time(stats.flops_per_device, stats.bytes_accessed, stats.transfers,
                        costs.FABRICS["TPU v5e"], "float32", matmul_precision="default")  # fmt: skip
    expected = costs.collective_time("all-reduce", 8, 256 * 256 * 4, costs.LINKS["ICI v5e"])
    assert math.isclose(t["comm_s"], expected)


def test_comm_split_sums_to_the_step_times_communication():
    ici = costs.FABRICS["TPU v5e"]
    ts = [
        comms.transfer("all-to-all", "expert", 4, 4096, "dispatch"),
        comms.transfer("all-reduce", "data", 2, 1 << 20, "grads"),
    ]
    latency, bandwidth = costs.comm_split(ts, ici)
    whole = costs.step_time(1e9, None, ts, ici)["comm_s"]
    assert latency > 0 and bandwidth > 0
    assert math.isclose(latency + bandwidth, whole, rel_tol=1e-12)
    assert costs.comm_split([], ici) == (0.0, 0.0)


def test_a_fabric_with_another_latency_changes_every_link_and_nothing_else():
    from course_lib import chips

    base = costs.FABRICS["H100"].with_axis("data", chips.LINKS["InfiniBand NDR"])
    zero = base.with_latency(0.0)
    assert zero.link.latency_s == 0.0 and dict(zero.axis_links)["data"].latency_s == 0.0
    assert zero.link.bytes_per_s == base.link.bytes_per_s and zero.chip == base.chip
    assert dict(zero.axis_links)["data"].bytes_per_s == dict(base.axis_links)["data"].bytes_per_s

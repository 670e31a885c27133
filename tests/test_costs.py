"""Costs from shapes and datasheets (course_lib.costs): peak FLOP/s per GPU kind, MFU, the step-time model,
and the activations the backward pass keeps."""

import math

import pytest

from course_lib import costs, model
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
        ("NVIDIA A100-SXM4-80GB", "float32", "default", 156.0, "A100"),
        ("NVIDIA A100-PCIE-40GB", "bfloat16", "default", 312.0, "A100"),
        ("NVIDIA A100 80GB PCIe", "float32", "tensorfloat32", 156.0, "A100"),
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


def test_step_time_model():
    h100 = costs.DEVICE_PROFILES["H100"]
    t = costs.step_time_model(
        494.7e9, 450e6, h100, "float32"
    )  # 1 ms of compute, 1 ms of communication
    assert t["compute_s"] == pytest.approx(1e-3) and t["comm_s"] == pytest.approx(1e-3)
    assert t["step_s"] == pytest.approx(2e-3)
    roofline = costs.step_time_model(494.7e9, 0, h100, "float32", bytes_accessed=6.7e9)
    assert roofline["compute_s"] == pytest.approx(2e-3)  # memory-bound: 6.7 GB at 3.35 TB/s
    fp32 = costs.step_time_model(67e9, 0, h100, "float32", matmul_precision="highest")
    assert fp32["compute_s"] == pytest.approx(1e-3)  # FP32 rate, not TF32
    # the assumed latency per collective: 3 collectives of 1.3 MB cost more than their bytes
    lat = costs.step_time_model(0, 1.3e6, h100, "float32", n_collectives=3)
    assert lat["latency_s"] == pytest.approx(3 * costs.COLLECTIVE_LATENCY_S)
    assert lat["comm_s"] == pytest.approx(lat["bandwidth_s"] + lat["latency_s"])
    assert lat["latency_s"] > lat["bandwidth_s"]
    with pytest.raises(ValueError, match="no peak for precision='float64'"):
        costs.step_time_model(1, 1, h100, "float64")


def test_residual_activations_from_shapes():
    cpu = PROFILES["cpu"].model
    # per image: conv blocks 40960 + 20480 + 5120, dense 138 values; the input images are an argument
    assert costs.residual_activation_bytes(None, cpu, 8) == 66_698 * 8 * 4
    assert costs.residual_activation_bytes("pairs", cpu, 16, 2) == 4_047_488 - 3072 * 16 * 4
    assert costs.residual_activation_bytes("gather", cpu, 16, 2) == 3_282_176 - 3072 * 16 * 4
    assert costs.residual_activation_bytes(None, cpu, 8, value_bytes=2) == 66_698 * 8 * 2
    with pytest.raises(ValueError, match="unknown layout 'ring'"):
        costs.residual_activation_bytes("ring", cpu, 8)


def test_the_device_profiles_use_their_own_gpus_peaks():
    assert costs.DEVICE_PROFILES["A100"].peak.name == "A100"
    assert costs.DEVICE_PROFILES["H100"].peak.name == "H100 SXM"

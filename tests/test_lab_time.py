"""The lab's time model (course_lib.lab_time) and its roofline plot: the fabric chosen, which collectives grow
with the batch, a row's columns from a compiled program's numbers, the narrow-matmul estimate."""

import dataclasses
import math
import types

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from course_lib import comms, costs, lab_time, plots
from course_lib.config import PROFILES

matplotlib.use("Agg")


def test_the_fabric_is_the_chip_it_runs_on_or_a_named_prediction():
    key, fabric, predicted = lab_time.fabric_for("TPU v5 lite", "tpu")
    assert (key, predicted) == ("TPU v5e", False) and fabric is costs.FABRICS["TPU v5e"]
    assert lab_time.fabric_for("NVIDIA H100 80GB HBM3", "gpu")[:3:2] == ("H100", False)
    assert lab_time.fabric_for("cpu", "cpu") == ("TPU v5e", costs.FABRICS["TPU v5e"], True)
    assert lab_time.fabric_for("cpu", "cpu", "H100")[0] == "H100"
    assert lab_time.fabric_for("NVIDIA L40S", "gpu")[2]  # a chip no fabric describes: a prediction
    with pytest.raises(ValueError, match="target='v4' is not a fabric"):
        lab_time.fabric_for("cpu", "cpu", "v4")


def _collective(kind, axes, n, dims, name="c"):
    size = 4 * int(np.prod(dims))
    return comms.Collective(
        kind, axes, n, (("f32", dims),), size, comms.ring_bytes(kind, size, n), name
    )


def test_what_grows_with_the_batch():
    shapes = comms.param_shapes(PROFILES["cpu"].model)
    kernel = shapes["conv2"]["kernel"]
    data_only = [
        _collective("all-gather", ("data",), 8, kernel),
        _collective("all-gather", ("data",), 8, (8, 16, 16, 64)),
    ]
    assert lab_time.grows_with_batch(data_only, shapes) == [
        False,
        True,
    ]  # a parameter, an activation
    bias = comms.Collective(
        "all-reduce", ("data",), 8, (("f32", (1, 10)), ("f32", ())), 44, 77.0, "ar"
    )
    assert lab_time.grows_with_batch([bias], shapes) == [
        False
    ]  # dense2's bias gradient, kept [1, 10]
    two_d = [
        _collective("all-reduce", ("data",), 4, (3, 3, 32, 32)),
        _collective("all-reduce", ("model",), 2, (16, 10)),
    ]
    assert lab_time.grows_with_batch(two_d, shapes) == [False, True]  # fmt: skip


def test_a_rows_time_columns_from_the_program():
    shapes = comms.param_shapes(PROFILES["cpu"].model)
    grads = _collective("all-reduce", ("data",), 8, shapes["dense1"]["kernel"])
    stats = types.SimpleNamespace(
        flops_per_device=197e12 * 1e-3, bytes_accessed=819e9 * 2e-3, transfers=(grads,)
    )
    cols = lab_time.time_columns(stats, 8, shapes, "bfloat16", "default", "cpu", "cpu", 0.5)
    assert set(cols) == set(lab_time.TIME_COLUMNS) and cols["model_is_prediction"]
    assert math.isclose(cols["model_compute_s"], 1e-3) and math.isclose(
        cols["model_memory_s"], 2e-3
    )
    assert cols["model_bound"] == "HBM" and math.isnan(
        cols["model_error"]
    )  # a CPU time tests no TPU model
    assert math.isclose(cols["arithmetic_intensity"], 197e12 * 1e-3 / (819e9 * 2e-3))
    assert math.isclose(cols["ridge_flops_per_byte"], 197e12 / 819e9)
    t = costs.step_time(
        stats.flops_per_device, stats.bytes_accessed, [grads], costs.FABRICS["TPU v5e"]
    )
    assert math.isclose(cols["model_critical_batch"], costs.critical_size(8, t))
    on_chip = lab_time.time_columns(
        stats, 8, shapes, "bfloat16", "default", "TPU v5 lite", "tpu", 4e-3
    )
    assert math.isclose(on_chip["model_error"], 4e-3 / t["no_overlap_s"] - 1)
    f64 = lab_time.time_columns(stats, 8, shapes, "float64", "default", "cpu", "cpu", 0.5)
    assert math.isnan(f64["model_compute_s"]) and f64["model_bound"] == "no float64 peak"  # fmt: skip


def test_the_narrow_matmul_estimate():
    cfg = PROFILES["gpu"].model
    peak = 197e12
    full = costs.model_flops_per_step(cfg, 256) / peak
    narrow = lab_time.narrow_matmul_s(cfg, 256, peak)
    assert narrow > full  # narrow channels fill part of the matrix unit
    assert math.isclose(
        lab_time.narrow_matmul_s(cfg, 256, peak, mxu=1), full
    )  # a unit of width 1 is full
    assert set(costs.model_flops_breakdown(cfg)) <= set(lab_time.matmul_widths(cfg))


def test_the_roofline_plot():
    rows = pd.DataFrame({"strategy": ["jit", "pmap"], "arithmetic_intensity": [5.0, 6.0],
                         "flops_per_device": [1e9, 1e8], "model_roofline_s": [1e-3, 1e-4],
                         "step_time_s": [1e-2, 1e-3]})  # fmt: skip
    ax = plots.roofline(rows, 197e12, 819e9, measured=True)
    assert (
        ax.get_xscale() == "log" and len(ax.lines) == 2 + 2 * 2
    )  # roof, ridge, a point and a hollow each
    with pytest.raises(ValueError, match="no row has a finite"):
        plots.roofline(rows.assign(arithmetic_intensity=np.nan), 197e12, 819e9)


def _chip_row(**over):
    row = dict(strategy="jit", device_kind="TPU v5 lite", platform="tpu", n_devices=1,
               precision="bfloat16", matmul_precision="default", flops_per_device=197e9,
               bytes_accessed_per_device=819e6 * 2, step_time_s=2.4e-3, mfu=0.4)  # fmt: skip
    return {**row, **over}


def test_against_measured_sets_the_roofline_beside_the_step():
    t = lab_time.against_measured(
        [_chip_row(), _chip_row(strategy="big", bytes_accessed_per_device=1e6)]
    )
    jit, big = t.loc["jit"], t.loc["big"]
    assert jit["compute_s"] == pytest.approx(1e-3) and jit["memory_s"] == pytest.approx(2e-3)
    assert jit["model_s"] == pytest.approx(2e-3) and jit["bound"] == "HBM"
    assert jit["error"] == pytest.approx(0.2) and jit["mfu"] == 0.4
    assert jit["mfu_roofline"] == pytest.approx(0.48)  # the model FLOPs in the roofline time
    assert big["bound"] == "compute" and big["model_s"] == pytest.approx(1e-3)


def test_against_measured_refuses_a_cpu_time_or_several_devices():
    with pytest.raises(ValueError, match="'cpu' \\(cpu\\).*no test of the model"):
        lab_time.against_measured([_chip_row(device_kind="cpu", platform="cpu")])
    with pytest.raises(ValueError, match="8 devices.*one-device rows"):
        lab_time.against_measured([_chip_row(n_devices=8)])


def test_the_committed_tpu_run_is_hbm_bound_within_30_percent():
    t = lab_time.against_measured(pd.read_csv(lab_time.TPU_LAB_RESULTS))
    assert len(t) == 8 and (t["bound"] == "HBM").all() and (t["error"].abs() < 0.3).all()


def test_explain_step_in_words():
    cfg = PROFILES["gpu"].model
    row = {
        "flops_per_device": 2e11, "bytes_accessed_per_device": 4e9, "model_compute_s": 1e-3,
        "model_memory_s": 5e-3, "model_roofline_s": 5e-3, "step_time_s": 6e-3, "model_bound": "HBM",
        "model_error": 0.2,
    }  # fmt: skip
    args = (cfg, 512, 197e12, 819e9)
    text = lab_time.explain_step(row, *args, "TPU v5 lite", "tpu", "bfloat16")
    assert "5.00 ms" in text and "+20%" in text and "within 30 %" in text
    far = {**row, "step_time_s": 1e-2, "model_error": 1.0}
    assert "Narrow channels" in lab_time.explain_step(far, *args, "TPU v5 lite", "tpu", "bfloat16")
    gpu = lab_time.explain_step(far, *args, "NVIDIA H100", "gpu", "bfloat16")
    assert "Narrow" not in gpu and "estimate is a TPU's" in gpu
    assert lab_time.mxu_width("TPU v6e") == 256 and lab_time.mxu_width("TPU v5 lite") == 128


def test_describe_mfu_in_words():
    row = {"model_flops_per_step": 2e11, "step_time_s": 0.01, "mfu": 0.1, "peak_flops_per_device": 197e12,
           "matmul_precision": "default"}  # fmt: skip
    text = lab_time.describe_mfu(
        row, 150e12, 197e12, "TPU v5 lite", "tpu", "bfloat16", (32, 64, 128)
    )
    assert "20.0 TFLOP/s; MFU 10.0%" in text and "76% of the 197 TFLOP/s" in text
    assert "fill 25%, 50%, 100% of a 128 x 128" in text
    gpu = lab_time.describe_mfu(row, 150e12, None, "NVIDIA H100", "gpu", "bfloat16", (32, 64, 128))
    assert "matrix unit" not in gpu and "bf16 peak" not in gpu


def test_the_critical_batch_figure_draws_both_crossings():
    fabric = costs.FABRICS["TPU v5e"]
    no_alpha = dataclasses.replace(fabric, link=dataclasses.replace(fabric.link, latency_s=0.0))
    gathers = [_collective("all-gather", ("data",), 8, (3, 3, 32, 64)) for _ in range(4)]
    stats = types.SimpleNamespace(
        flops_per_device=4e9, bytes_accessed=6e8, transfers=gathers + gathers[:1]
    )
    grows = [False] * 4 + [True]  # four parameters' gathers, one activation's
    args = (stats.flops_per_device, stats.bytes_accessed, stats.transfers)
    fig = lab_time.critical_batch_figure(16, stats, fabric, "bfloat16", grows=grows, title="E")
    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels[:3] == ["roofline r·b", "communication a + c·b", "communication, α = 0"]
    assert labels[-1] == "this run's batch: 16" and ax.get_title() == "E"
    b = ax.get_lines()[0].get_xdata()
    roof, comm, comm0 = (ax.get_lines()[k].get_ydata() for k in range(3))
    assert np.allclose(roof / b, roof[0] / b[0]) and comm[0] > comm0[0] > 0  # r·b; α: fixed part
    assert np.allclose(np.diff(comm), np.diff(comm0))  # the same slope c
    assert ax.get_xscale() == ax.get_yscale() == "log"
    for name, fab, line in (("with α", fabric, comm), ("α = 0", no_alpha, comm0)):
        b_star = costs.critical_batch(16, *args, fab, "bfloat16", grows=grows)
        assert 0 < b_star < b[-1] and f"b* {name}: {b_star:.1f}" in labels
        gap = np.interp(b_star, b, roof - line)  # the lines cross at b*
        assert abs(gap) <= 1e-9 * np.interp(b_star, b, roof)
    plt.close(fig)
    silent = types.SimpleNamespace(flops_per_device=4e9, bytes_accessed=6e8, transfers=[])
    fig = lab_time.critical_batch_figure(4, silent, fabric, "bfloat16", grows=[])  # one device
    assert [line.get_label() for line in fig.axes[0].get_lines()][-1] == "this run's batch: 4"
    plt.close(fig)

"""Pictures of schedules, layers, the stash and the experts' load: drawn, with the right cells."""

import dataclasses

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from course_lib import pipeline_diagrams as PD  # noqa: E402
from course_lib import schedules as S  # noqa: E402


@pytest.mark.parametrize(
    "sched", [S.gpipe(4, 8), S.one_f_one_b(4, 8), S.circular(2, 4, 2)], ids=lambda s: s.name
)
def test_schedule_draws_every_cell(sched):
    fig = PD.schedule(sched)
    ax = fig.axes[0]
    busy = (sched.f_mb >= 0) | (sched.b_mb >= 0)
    both = (sched.f_mb >= 0) & (sched.b_mb >= 0)
    # one patch per cell, two where a stage runs both lanes at once
    assert len(ax.patches) == busy.size + both.sum()
    assert len(ax.texts) == (sched.f_mb >= 0).sum() + (sched.b_mb >= 0).sum()
    assert sched.name in ax.get_title(loc="left") and "bubble" in ax.get_title(loc="left")
    plt.close(fig)


def test_schedule_from_a_trace_matches_the_table():
    sched = S.one_f_one_b(2, 3)
    trace = np.stack([sched.f_mb, sched.f_chunk, sched.b_mb, sched.b_chunk], axis=1)  # [T, 4, p]
    arrays = PD.trace_arrays(trace)
    np.testing.assert_array_equal(arrays["b_mb"], sched.b_mb)
    fig = PD.schedule(arrays, title="from the run")
    assert fig.axes[0].get_title(loc="left") == "from the run"
    forward_only = PD.trace_arrays(trace[:, :2])
    assert (forward_only["b_mb"] == -1).all()
    with pytest.raises(ValueError, match="expected"):
        PD.trace_arrays(np.zeros((3, 3)))
    plt.close("all")


def test_layers_in_flight_expert_load_and_drops():
    fig = PD.layers(8, 4, 2)
    assert len(fig.axes[0].patches) >= 8
    with pytest.raises(ValueError, match="do not split"):
        PD.layers(6, 4)
    fig = PD.in_flight([S.gpipe(4, 8), S.one_f_one_b(4, 8)])
    assert [line.get_label() for line in fig.axes[0].lines] == [
        "gpipe (peak 8)",
        "1f1b_lockstep (peak 7)",
    ]
    fig = PD.expert_load(np.array([5, 1, 3, 7]), 4)
    assert "4 of 16 choices dropped" in fig.axes[0].get_title(loc="left")
    fig = PD.drops([0.5, 1.0, 2.0], [0.5, 0.1, 0.0], [0.6, 0.2, 0.0])
    assert len(fig.axes[0].lines) == 2
    plt.close("all")


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb_h1"])
def test_ops_draws_every_cell_of_a_one_operation_table(name):
    from course_lib import op_schedules as O

    sched = O.make(name, 4, 8, 2 if name == "interleaved" else 1)
    fig = PD.ops(sched)
    ax = fig.axes[0]
    assert len(ax.patches) == sched.op.size  # one patch per cell, idle ones grey
    assert len(ax.texts) == (sched.op != O.IDLE).sum()
    hatched = sum(1 for patch in ax.patches if patch.get_hatch())
    assert hatched == (sched.op == O.W).sum()
    assert f"bubble {O.measured_bubble(sched):.1%}" in ax.get_title(loc="left")
    drawn = PD.op_trace(np.stack([sched.op, sched.mb, sched.chunk], 1))
    assert (drawn["op"] == sched.op).all()
    with pytest.raises(ValueError, match=r"expected \[T, 3, p\]"):
        PD.op_trace(np.zeros((3, 4, 2)))
    plt.close(fig)


def test_expert_exchange_draws_every_row_and_names_the_shapes():
    fig = PD.expert_exchange(8, 3, 4)
    ax = fig.axes[0]
    assert len(ax.patches) == 2 * 4 * 8  # n·E rows before, n·(E/n)·n pieces after
    title = ax.get_title(loc="left")
    assert "[8, 3, D]" in title and "[2, 12, D]" in title
    # below, device 1 holds experts 2 and 3, one piece from each of the 4 devices per row
    after = [p for p in ax.patches if p.get_y() < 2]
    assert len(after) == 4 * 2 * 4
    with pytest.raises(ValueError, match="multiple of n_devices=3"):
        PD.expert_exchange(8, 3, 3)
    plt.close("all")


def test_tp_stage_draws_five_all_reduces_and_the_predicted_totals():
    predicted = {"model": {"count": 21, "sent": 1234.0}, "stage": {"count": 9, "sent": 999.0}}
    fig = PD.tp_stage(2, 8192, 1024, predicted)
    ax = fig.axes[0]
    assert len(ax.patches) == 21
    assert sum(p.get_facecolor()[:3] == (214 / 255, 39 / 255, 40 / 255) for p in ax.patches) == 5
    texts = [t.get_text() for t in ax.texts]
    assert sum("8,192 B" in t for t in texts) == 6  # 4 all-reduces, one send each way
    assert "21 collectives" in ax.get_title(loc="left")
    plt.close(fig)
    with pytest.raises(ValueError, match="n_model"):
        PD.tp_stage(0, 8192, 1024)


@pytest.mark.parametrize("p, m", [(2, 2), (4, 8), (2, 1), (1, 3)])
def test_sends_are_the_collective_permutes_the_model_counts(p, m):
    # lab 12's pp_dp: as many sends over stage as lm_costs.predict_bytes has collective-permutes, each an
    # arrow from every stage but the last along its direction
    from course_lib import lm_costs, transformer

    sched = S.gpipe(p, m)
    ticks = PD.send_ticks(sched)
    cfg = dataclasses.replace(transformer.TINY, n_layers=4)
    sent = lm_costs.predict_bytes(
        "pp_dp", cfg, 8 * m, {"data": 1, "stage": p}, itemsize=4, n_micro=m
    )
    assert (
        len(ticks) == sum(t.kind == "collective-permute" for t in sent) == 2 * (m + p - 2) * (p > 1)
    )
    # forward sends end forward ticks before the last; backward ones start after the forward lane
    tf = sched.forward_ticks()
    assert all(t < tf - 1 for t, step in ticks if step > 0)
    assert all(tf <= t < sched.ticks - 1 for t, step in ticks if step < 0)
    fig = PD.sends(sched)
    ax = fig.axes[0]
    arrows = [a for a in ax.texts if getattr(a, "arrow_patch", None) is not None]
    assert len(arrows) == len(ticks) * (p - 1)
    assert "arrow: a send over stage" in ax.get_xlabel()
    plt.close(fig)

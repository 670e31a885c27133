"""The one-operation executor against one device, in float64: every schedule, masked and switched; its
slots, its trace, its memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from course_lib import op_schedules as O
from course_lib import pipeline as PL
from course_lib import pipeline_measure as PM
from course_lib import pipeline_ops as PO
from course_lib.meshes import STAGE, mesh_of


def _mesh(report, p):
    return mesh_of({STAGE: p}, report.devices[:p], axis_type="auto")


@pytest.mark.parametrize(
    "name, p, v, mode",
    [
        (n, 4, 2 if n == "interleaved" else 1, mode)
        for n in ("gpipe", "1f1b", "interleaved", "zb_h1")
        for mode in PO.MODES
    ]
    + [
        ("1f1b", 1, 1, "cond"),
        ("interleaved", 2, 2, "masked"),
        ("zb_h1", 2, 1, "cond"),
        ("breadth_first", 2, 2, "cond"),
    ],  # fmt: skip
)
def test_every_schedule_equals_one_device(report, residual, name, p, v, mode):
    params, xs, r, loss, (g_params, g_xs) = residual
    with jax.enable_x64(True):
        sched = O.make(name, p, xs.shape[0], v)
        step = PO.build_step(_mesh(report, p), STAGE, sched, PM.residual_stage(), mode=mode)
        got_loss, grads, dxs, trace = step(PL.chunked(params, v), xs, r)
        assert abs(float(got_loss - loss)) < 1e-10
        assert float(jnp.abs(PL.unchunked(grads)["w"] - g_params["w"]).max()) < 1e-10
        assert float(jnp.abs(dxs - g_xs).max()) < 1e-10
    trace = np.asarray(trace)  # [T, 3, p]: what each device ran is the table
    assert (trace[:, 0] == sched.op).all() and (trace[:, 1] == sched.mb).all()
    assert O.measured_bubble(trace[:, 0]) == pytest.approx(O.predicted_bubble(name, p, 4, v))


def test_plan_slots_hold_each_value_from_arrival_to_last_use():
    for sched in (O.pipedream_flush(4, 8), O.zb_h1(4, 8), O.interleaved(4, 8, 2), O.gpipe(3, 5)):
        pl = PO.plan(sched)
        flight = O.measured_in_flight(sched)
        # an input that arrives before its F waits in a slot: at most one more than in flight
        assert flight.max() <= pl.n_x <= flight.max() + 1
        rows = pl.rows
        for s in range(sched.n_stages):
            where = {}  # slot -> (mb, chunk) now held in it
            for t in range(sched.ticks):
                op, i, c, xs = (int(a) for a in rows[t, s, :4])
                if op != O.IDLE and not (op == O.F and s == 0 and c == 0):
                    assert where[xs] == (i, c), (sched.name, s, t)
                if op == O.F and s == 0 and c == 0:
                    where[xs] = (i, c)
                sender = s - 1 if s > 0 else sched.n_stages - 1
                if rows[t, s, 5] < pl.n_x:  # an input arrives from the previous (virtual) stage
                    i2, c2 = int(rows[t, sender, 1]), int(rows[t, sender, 2]) + (s == 0)
                    where[int(rows[t, s, 5])] = (i2, c2)
    assert PO.plan(O.pipedream_flush(4, 8)).n_x == 4  # p, whatever m
    assert PO.plan(O.pipedream_flush(4, 16)).n_x == 4
    assert PO.plan(O.gpipe(4, 16)).n_x == 16


def test_masked_work_exceeds_useful_work_by_the_lockstep_cells():
    cost = {"F": 1.0, "B": 3.0, "B_split": 2.0, "W": 2.0}
    g = PO.work(O.gpipe(4, 8), cost)
    assert g == {"useful": 8 * 4.0, "masked": 11 * 1.0 + 11 * 3.0}
    for name in ("1f1b", "interleaved", "zb_h1"):
        w = PO.work(O.make(name, 4, 8, 2 if name == "interleaved" else 1), cost)
        assert w["masked"] > 1.5 * w["useful"]


def test_memory_of_1f1b_does_not_grow_with_m_and_gpipe_does(report):
    p, act = 4, jax.ShapeDtypeStruct((32, 16), jnp.float32)
    params = PM.init_residual(jax.random.key(0), 2 * p, 16)
    temps = {}
    for name in ("1f1b", "gpipe"):
        for m in (4, 8):
            xs = jax.ShapeDtypeStruct((m, *act.shape), act.dtype)
            step = PO.build_step(_mesh(report, p), STAGE, O.make(name, p, m), PM.residual_stage(),
                                 mode="cond", input_grads=False)  # fmt: skip
            mem = step.lower(PL.chunked(params, 1), xs, xs).compile().memory_analysis()
            temps[name, m] = mem.temp_size_in_bytes
    act = 32 * 16 * 4
    # 1F1B: no more inputs held at 8 than at 4 (what grows with the ticks is the trace: int32 [T, 3])
    assert 0 <= temps["1f1b", 8] - temps["1f1b", 4] < act
    assert temps["gpipe", 8] - temps["gpipe", 4] >= 4 * act  # four more inputs held, at least


def test_bad_mode_and_wrong_axis(report, residual):
    params, xs, r, *_ = residual
    with pytest.raises(ValueError, match="mode='fast' is not one of"):
        PO.build_step(_mesh(report, 4), STAGE, O.gpipe(4, 4), PM.residual_stage(), mode="fast")(
            PL.chunked(params, 1), xs, r
        )
    with pytest.raises(ValueError, match="has 2 stages but axis 'stage' has 4 devices"):
        PO.build_step(_mesh(report, 4), STAGE, O.gpipe(2, 4), PM.residual_stage())(
            PL.chunked(params, 1), xs, r
        )

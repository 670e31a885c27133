"""The one-operation executor against one device, in float64: every schedule, masked and switched; its
slots, its trace, its memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

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
    _equals_one_device(report, residual, name, p, v, mode, PM.residual_stage())


@pytest.mark.parametrize(
    "name, p, mode",
    [(n, p, mode) for n in O.OP_SCHEDULES for p in (2, 4) for mode in PO.MODES],
)
def test_every_schedule_with_a_split_stage_equals_one_device(report, residual, name, p, mode):
    # a split stage: ZB-H1's B saves each layer's input and matmul cotangent, its W only multiplies them;
    # the fused schedules call it as the plain stage function
    v = 2 if name in ("interleaved", "breadth_first") else 1
    _equals_one_device(report, residual, name, p, v, mode, PM.residual_stage(split=True))


def _equals_one_device(report, residual, name, p, v, mode, stage):
    params, xs, r, loss, (g_params, g_xs) = residual
    with jax.enable_x64(True):
        sched = O.make(name, p, xs.shape[0], v)
        step = PO.build_step(_mesh(report, p), STAGE, sched, stage, mode=mode)
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


def test_split_stage_backward_is_the_vjp():
    with jax.enable_x64(True):
        chunk = PM.init_residual(jax.random.key(0), 3, 8, jnp.float64)
        x, dy = (jax.random.normal(jax.random.key(k), (2, 5, 8), jnp.float64) for k in (1, 2))
        stage = PM.residual_stage(split=True)
        assert PO.is_split_stage(stage) and not PO.is_split_stage(PM.residual_stage())
        dx, saved = stage.backward_input(x, chunk, dy)
        assert saved["h"].shape == saved["g"].shape == (3, 2, 5, 8)  # 2k activations
        d_chunk = stage.backward_weight(saved, chunk)
        want_chunk, want_x = jax.vjp(lambda c, h: PM.residual_stage()(h, c), chunk, x)[1](dy)
        assert float(jnp.abs(stage(x, chunk) - PM.residual_stage()(x, chunk)).max()) == 0
        assert float(jnp.abs(dx - want_x).max()) < 1e-12
        assert float(jnp.abs(d_chunk["w"] - want_chunk["w"]).max()) < 1e-12


def test_split_stage_w_costs_one_forward_and_zb_h1_the_work_of_1f1b():
    chunk, x = PM.init_residual(jax.random.key(0), 4, 64), jnp.ones((128, 64), jnp.float32)
    # cost_analysis counts a loop's body once: rolled, every operation is counted for one layer
    for unroll in (False, True):
        plain, split = (
            PO.op_flops(PM.residual_stage(unroll, split=sp), chunk, x) for sp in (False, True)
        )
        assert plain["F"] == split["F"] and plain["B"] == split["B"]
        assert 2.5 < plain["W"] / plain["F"] < 3.1  # the W that starts from the output's cotangent
        assert 0.95 < split["W"] / split["F"] < 1.05  # dW_l = h_l^T g_l: one matmul per layer
        assert (
            1.95 < split["B_split"] / split["F"] < 2.1
        )  # recompute, then the input-gradient chain
        one_f = PO.work(O.pipedream_flush(4, 8), split)["useful"]
        assert PO.work(O.zb_h1(4, 8), plain)["useful"] > 1.3 * one_f
        assert abs(PO.work(O.zb_h1(4, 8), split)["useful"] / one_f - 1) < 0.03


def _check_saving_slots(sched, pl):
    """Replay ``pl`` stage by stage: every read finds the value it needs in its slot."""
    p, rows = sched.n_stages, pl.rows
    for s in range(p):
        held = {}  # (buffer, slot) -> (mb, chunk)
        for t in range(sched.ticks):
            op, i, c, xs, dys, _, _, sv = (int(a) for a in rows[t, s])
            top = s == p - 1 and c == sched.n_chunks - 1
            if op == O.F:
                if s == 0 and c == 0:
                    held["x", xs] = (i, c)
                assert held["x", xs] == (i, c)
                if top:
                    held["dy", dys] = (i, c)  # the last stage's F makes the output's cotangent
            if op == O.B:
                assert held["x", xs] == held["dy", dys] == (i, c), (sched.name, s, t)
                held["sv", sv] = (i, c)
            if op == O.W:
                assert held["sv", sv] == (i, c) and xs == pl.n_x and dys == pl.n_dy, (
                    sched.name,
                    s,
                    t,
                )
            for col, buf, nb, spare in ((5, "x", s - 1, pl.n_x), (6, "dy", s + 1, pl.n_dy)):
                if rows[t, s, col] < spare:  # an arrival from a neighbour
                    held[buf, int(rows[t, s, col])] = (
                        int(rows[t, nb % p, 1]),
                        int(rows[t, nb % p, 2]),
                    )


def test_plan_of_a_split_stage_keeps_what_b_saves_from_b_to_w():
    for p, m in ((2, 4), (4, 8), (4, 16), (3, 5)):
        sched = O.zb_h1(p, m)
        pl, plain = PO.plan(sched, split_stage=True), PO.plan(sched)
        _check_saving_slots(sched, pl)
        # W of micro-batch i runs after the B of i + s on stage s: stage p-1 holds p saved at most
        assert pl.n_saved == min(m, p) and plain.n_saved == 0
        # the input and the cotangent now live only until B: never more slots than before
        assert pl.n_x <= plain.n_x and pl.n_dy == 1 < plain.n_dy
    assert (
        PO.plan(O.pipedream_flush(4, 8), split_stage=True).n_saved == 0
    )  # a fused B saves nothing


def test_a_plan_for_the_other_stage_kind_is_refused(report, residual):
    params, xs, r, *_ = residual
    sched = O.zb_h1(4, 4)
    body = lambda prm, x, rr: PO.run(PM.residual_stage(split=True), PO._inner, prm, {}, x, rr, sched, STAGE,  # noqa: E731
                                     the_plan=PO.plan(sched))[0]  # fmt: skip
    spec = PL.stage_spec(STAGE)
    f = jax.shard_map(body, mesh=_mesh(report, 4), in_specs=(spec, P(), P()), out_specs=P(STAGE))
    with pytest.raises(ValueError, match="n_saved=0 for a stage that is split"):
        f(PL.chunked(params, 1), xs, r)

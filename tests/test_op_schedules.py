"""One-operation-per-tick schedules (GPipe, PipeDream-Flush 1F1B, interleaved 1F1B, ZB-H1): valid tables,
tick counts, bubbles and micro-batches in flight as the closed forms say."""

import numpy as np
import pytest

from course_lib import op_schedules as O

CASES = [(1, 1), (1, 4), (2, 2), (2, 4), (3, 6), (4, 4), (4, 8), (4, 16), (8, 8)]


@pytest.mark.parametrize("p, m", CASES)
def test_gpipe_and_1f1b_ticks_bubble_and_in_flight(p, m):
    for name in ("gpipe", "1f1b"):
        sched = O.make(name, p, m)
        O.validate(sched)
        assert sched.ticks == 2 * (m + p - 1) and not sched.split
        assert O.measured_bubble(sched) == pytest.approx((p - 1) / (m + p - 1))
        assert O.measured_bubble(sched) == pytest.approx(O.predicted_bubble(name, p, m))
        assert O.measured_in_flight(sched).tolist() == O.predicted_in_flight(name, p, m)
    assert O.measured_in_flight(O.gpipe(p, m)).tolist() == [m] * p
    # PipeDream-Flush: at most p - s micro-batches in flight on stage s, whatever m
    assert O.measured_in_flight(O.pipedream_flush(p, m)).tolist() == [
        min(m, p - s) for s in range(p)
    ]


@pytest.mark.parametrize("p, m", [(1, 3), (2, 2), (2, 4), (3, 6), (4, 4), (4, 8), (4, 16), (8, 8)])
def test_zb_h1_fills_two_thirds_of_the_1f1b_bubble_with_1f1b_peak_memory(p, m):
    sched = O.zb_h1(p, m)
    O.validate(sched)
    assert sched.split and sched.ticks == 3 * m + p - 1
    assert (sched.op == O.IDLE).sum(0).tolist() == [p - 1] * p  # (p-1)·T_F idle per stage
    assert O.measured_bubble(sched) == pytest.approx(O.predicted_bubble("zb_h1", p, m))
    flush = O.pipedream_flush(p, m)
    if p > 1:
        assert O.measured_bubble(sched) < O.measured_bubble(flush)
    # idle stage-time: (p-1)·1 tick against 1F1B's (p-1)·(F + B + W) = 3(p-1) ticks of the same units
    assert (sched.op == O.IDLE).sum(0)[0] * 3 == 3 * (p - 1)
    assert O.measured_in_flight(sched).max() == O.measured_in_flight(flush).max() == min(m, p)


@pytest.mark.parametrize(
    "p, m, v", [(2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (4, 8, 3), (1, 3, 2)]
)
def test_interleaved_bubble_and_in_flight(p, m, v):
    sched = O.interleaved(p, m, v)
    O.validate(sched)
    assert sched.ticks == 2 * (v * m + p - 1)
    assert O.measured_bubble(sched) == pytest.approx((p - 1) / (v * m + p - 1))
    idle = (sched.op == O.IDLE).sum() / p  # idle ticks per stage, over the ideal 2·v·m
    assert idle / (2 * v * m) == pytest.approx((p - 1) / (v * m))  # Narayanan et al.: (p-1)/(v·m)
    assert O.measured_in_flight(sched).tolist() == O.predicted_in_flight("interleaved", p, m, v)
    # depth-first: stage 0 runs p micro-batches through chunk 0, then the same p through chunk 1
    first = [(int(sched.mb[t, 0]), int(sched.chunk[t, 0])) for t in range(sched.ticks)
             if sched.op[t, 0] == O.F][: v * min(p, m)]  # fmt: skip
    assert first == [(j, c) for c in range(v) for j in range(min(p, m))]


@pytest.mark.parametrize("p, m, v", [(4, 8, 2), (2, 4, 3), (4, 4, 2), (1, 2, 2)])
def test_breadth_first_holds_every_chunk_input_with_the_interleaved_bubble(p, m, v):
    sched = O.breadth_first(p, m, v)
    O.validate(sched)
    assert O.measured_bubble(sched) == pytest.approx(O.measured_bubble(O.interleaved(p, m, v)))
    assert O.measured_in_flight(sched).tolist() == [v * m] * p
    f0 = [
        (int(sched.mb[t, 0]), int(sched.chunk[t, 0]))
        for t in range(sched.ticks)
        if sched.op[t, 0] == O.F
    ]
    assert f0 == [
        (i, c) for c in range(v) for i in range(m)
    ]  # every micro-batch through chunk 0 first
    # the last chunk's backwards all come first: its weight gradients are complete early
    b0 = [int(sched.chunk[t, 0]) for t in range(sched.ticks) if sched.op[t, 0] == O.B]
    assert b0 == [c for c in reversed(range(v)) for _ in range(m)]


def test_every_schedule_within_ten_percent_of_its_prediction_at_4_8():
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb_h1", 1)):
        got = O.measured_bubble(O.make(name, 4, 8, v))
        assert abs(got / O.predicted_bubble(name, 4, 8, v) - 1) < 0.10, name
    assert O.measured_bubble(O.zb_h1(4, 8)) < O.measured_bubble(O.pipedream_flush(4, 8))


def test_validate_names_a_broken_table():
    sched = O.pipedream_flush(3, 3)
    op = sched.op.copy()
    t = int(np.nonzero(op[:, 1] == O.F)[0][0])
    op[[t, t - 1], 1] = op[[t - 1, t], 1]  # stage 1's first F a tick early
    mb, ch = sched.mb.copy(), sched.chunk.copy()
    mb[[t, t - 1], 1], ch[[t, t - 1], 1] = mb[[t - 1, t], 1], ch[[t - 1, t], 1]
    broken = O.OpSchedule(**{**sched.__dict__, "op": op, "mb": mb, "chunk": ch})
    with pytest.raises(
        ValueError, match="F of micro-batch 0, chunk 0 on stage 1 at tick 0 needs the F of stage 0"
    ):
        O.validate(broken)
    dropped = O.OpSchedule(**{**sched.__dict__, "op": np.where(sched.op == O.B, 0, sched.op)})
    with pytest.raises(ValueError, match="B is not run once per"):
        O.validate(dropped)


def test_make_and_bad_input():
    assert O.make("interleaved", 2, 4, 2).n_chunks == 2
    with pytest.raises(ValueError, match="not one of"):
        O.make("dualpipe", 2, 4)
    with pytest.raises(ValueError, match="needs 'interleaved'"):
        O.make("zb_h1", 2, 4, 2)
    with pytest.raises(ValueError, match="n_micro=6 is not a multiple of n_stages=4; use m = 4"):
        O.interleaved(4, 6)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="must be a positive integer"):
            O.pipedream_flush(bad, 4)
    with pytest.raises(ValueError, match="not one of"):
        O.predicted_bubble("circular", 2, 4)


@pytest.mark.parametrize("p,m", [(1, 3), (2, 4), (3, 5), (4, 8)])
def test_timed_gives_the_bubble_in_time(p, m):
    """1F1B with a fused backward of 2 T_F idles (p-1)(T_F+T_B) = 3(p-1) per stage; ZB-H1 at
    T_F = T_B = T_W idles p-1 (Qi et al. 2023); GPipe idles as 1F1B; each stage busy 3m."""
    F, B, W = O.F, O.B, O.W
    flush = O.timed(O.pipedream_flush(p, m), {F: 1, B: 2})
    gpipe = O.timed(O.gpipe(p, m), {F: 1, B: 2})
    zb = O.timed(O.zb_h1(p, m), {F: 1, B: 1, W: 1})
    assert flush["idle"] == gpipe["idle"] == [3 * (p - 1)] * p
    assert zb["idle"] == [p - 1] * p and zb["busy"] == [3 * m] * p
    assert zb["step"] == O.zb_h1(p, m).ticks  # unit lengths: the table's ticks
    # a longer backward lengthens 1F1B's bubble: (p-1)(T_F + T_B)
    assert O.timed(O.pipedream_flush(p, m), {F: 1, B: 3})["idle"] == [4 * (p - 1)] * p


def test_timed_names_a_missing_duration():
    with pytest.raises(ValueError, match=r"no length for \['W'\]"):
        O.timed(O.zb_h1(2, 4), {O.F: 1, O.B: 1})


def _orders(sched):
    """Each stage's operations in the table's order, ``(op, mb)``."""
    cols = zip(sched.op.T, sched.mb.T, strict=True)
    return [[(int(o), int(i)) for o, i in zip(ops, mbs, strict=True) if o] for ops, mbs in cols]


@pytest.mark.parametrize("p, m", [(1, 3), (2, 2), (3, 7), (4, 8)])
def test_from_orders_rebuilds_the_tables_from_their_orders(p, m):
    for sched, split in (
        (O.zb_h1(p, m), True),
        (O.pipedream_flush(p, m), False),
        (O.gpipe(p, m), False),
    ):
        again = O.from_orders("again", p, m, _orders(sched), split=split)
        assert np.array_equal(again.op, sched.op) and np.array_equal(again.mb, sched.mb)
        assert again.split == split and again.n_chunks == 1
        O.validate(again)
    # entries may be lists, numpy integers, or carry chunk 0
    loose = [[[np.int64(o), i, 0] for o, i in order] for order in _orders(O.zb_h1(p, m))]
    assert np.array_equal(O.from_orders("loose", p, m, loose).op, O.zb_h1(p, m).op)


def test_from_orders_names_the_bad_entry():
    F, B, W = O.F, O.B, O.W
    good = _orders(O.zb_h1(2, 2))  # stage 0: F0 F1 B0 W0 B1 W1
    bad = {
        "must be a list of one list per stage \\(2\\), not \\[\\[": good[:1],
        "not None": None,
        r"orders\[0\]\[6\] = \(4, 0\) is not an \(op, micro_batch\) with op one of F = 1, B = 2, W = 3 and "
        "0 <= micro_batch < 2": [good[0] + [(4, 0)], good[1]],
        r"orders\[1\]\[6\] = \(1, 2\) is not": [good[0], good[1] + [(F, 2)]],
        r"orders\[0\]\[6\] = \(1, 0, 1\) is not": [good[0] + [(F, 0, 1)], good[1]],
        r"orders\[0\]\[6\] = \(True, 0\) is not": [good[0] + [(True, 0)], good[1]],
        r"orders\[0\]\[6\] = 1 is not": [good[0] + [1], good[1]],
        r"stage 0 runs the F of micro-batch 1 twice \(\[1\], \[6\]\)": [
            good[0] + [(F, 1)],
            good[1],
        ],
        "stage 1's order has no W of micro-batch 1: each stage runs the F/B/W of each micro-batch once": [
            good[0],
            [x for x in good[1] if x != (W, 1)],
        ],
        r"stage 0 runs the W of micro-batch 0 \(orders\[0\]\[2\]\) before its B \(\[3\]\), whose result": [
            [(F, 0), (F, 1), (W, 0), (B, 0), (B, 1), (W, 1)],
            good[1],
        ],
    }
    for match, orders in bad.items():
        with pytest.raises(ValueError, match=match):
            O.from_orders("mine", 2, 2, orders)
    with pytest.raises(ValueError, match=r"op one of F = 1, B = 2 and .* \(W needs split=True\)"):
        O.from_orders("fused", 2, 2, good, split=False)


def test_from_orders_names_what_each_stage_waits_for_in_a_deadlock():
    F, B, W = O.F, O.B, O.W
    stage0 = [(F, 0), (B, 0), (W, 0), (F, 1), (B, 1), (W, 1)]  # no warm-up forward
    stage1 = [(F, 0), (F, 1), (B, 0), (W, 0), (B, 1), (W, 1)]  # waits for F1, sent after B0
    with pytest.raises(
        RuntimeError,
        match="mine: the orders deadlock at tick 2: stage 0 waits to run the B of micro-batch 0, which "
        "needs the B of micro-batch 0 on stage 1; stage 1 waits to run the F of micro-batch 1, which needs "
        "the F of micro-batch 1 on stage 0$",
    ):
        O.from_orders("mine", 2, 2, [stage0, stage1])

"""Pipeline schedules as tables: every schedule valid, its bubble and stash as the closed forms say."""

import numpy as np
import pytest

from course_lib import schedules as S

CASES = [(1, 1), (1, 4), (2, 1), (2, 4), (3, 5), (4, 8), (4, 16), (8, 8)]


@pytest.mark.parametrize("p, m", CASES)
def test_gpipe_and_1f1b_are_valid_with_the_gpipe_bubble(p, m):
    for sched in (S.gpipe(p, m), S.one_f_one_b(p, m)):
        S.validate(sched)
        for costs in ((1, 2), (1, 1), (1, 3.5)):
            assert S.bubble_fraction(sched, *costs) == pytest.approx((p - 1) / (m + p - 1))
    g, f = S.gpipe(p, m), S.one_f_one_b(p, m)
    assert g.ticks == 2 * (m + p - 1) and f.ticks == m + 2 * p - 2
    assert list(g.in_flight()) == [m] * p and g.n_slots == m and g.mirrored()
    assert list(f.in_flight()) == [min(m, 2 * (p - 1 - s) + 1) for s in range(p)]
    assert f.n_slots == min(m, 2 * p - 1)


@pytest.mark.parametrize("p, m, v", [(2, 2, 2), (2, 4, 3), (4, 8, 2), (4, 4, 4), (1, 3, 2)])
def test_circular_is_valid_with_its_bubble(p, m, v):
    sched = S.circular(p, m, v)
    S.validate(sched)
    assert sched.mirrored() and sched.ticks == 2 * (v * m + p - 1)
    assert S.bubble_fraction(sched) == pytest.approx(S.gpipe_bubble(p, m, v))
    assert list(sched.in_flight()) == [v * m] * p
    # device s runs chunk c of every micro-batch once, and chunk c is virtual stage c·p + s
    assert sorted(
        zip(sched.f_mb[sched.f_mb >= 0], sched.f_chunk[sched.f_mb >= 0], strict=True)
    ) == sorted((i, c) for i in range(m) for c in range(v) for _ in range(p))


def test_circular_needs_whole_groups_of_micro_batches():
    with pytest.raises(ValueError, match="n_micro=6 is not a multiple of n_stages=4"):
        S.circular(4, 6, 2)


def test_busy_has_no_bubble_and_is_not_a_pipeline():
    sched = S.busy(4, 8)
    assert not sched.is_pipeline and S.bubble_fraction(sched) == 0.0
    with pytest.raises(
        ValueError, match="busy: F of micro-batch 0, chunk 0 on stage 1 at tick 0 needs its input"
    ):
        S.validate(sched)


def test_segments_and_lanes_of_1f1b():
    sched = S.one_f_one_b(4, 8)
    assert sched.segments() == [(0, 3, True, False), (3, 11, True, True), (11, 14, False, True)]
    assert S.lockstep_cost(sched, 1, 2) == 11 * 1 + 11 * 2


def test_slots_are_reused_only_after_the_tick_that_frees_them():
    sched = S.one_f_one_b(2, 6)
    for s in range(2):
        held = {}
        for t in range(sched.ticks):
            if sched.f_mb[t, s] >= 0:
                assert sched.f_slot[t, s] not in held.values()
                held[int(sched.f_mb[t, s])] = int(sched.f_slot[t, s])
            if sched.b_mb[t, s] >= 0:
                assert held.pop(int(sched.b_mb[t, s])) == sched.b_slot[t, s]
        assert not held


def test_validate_names_a_broken_table():
    sched = S.gpipe(3, 4)
    f_mb = sched.f_mb.copy()
    f_mb[[2, 3], 2] = f_mb[
        [3, 2], 2
    ]  # the last stage reads micro-batches 0 and 1 at the wrong ticks
    broken = S.Schedule(**{**sched.__dict__, "f_mb": f_mb})
    with pytest.raises(
        ValueError,
        match="micro-batch 1, chunk 0 on stage 2 at tick 2 needs its input from tick 1, but it was made at tick 2",
    ):
        S.validate(broken)


def test_make_and_bad_sizes():
    assert S.make("circular", 2, 4, 2).n_chunks == 2 and S.make("gpipe", 2, 4).name == "gpipe"
    with pytest.raises(ValueError, match="not one of"):
        S.make("zero-bubble", 2, 4)
    with pytest.raises(
        ValueError, match=r"'1f1b' is not one of \['1f1b_lockstep'.*PipeDream-Flush"
    ):
        S.make("1f1b", 2, 4)
    with pytest.raises(ValueError, match="needs 'circular'"):
        S.make("1f1b_lockstep", 2, 4, 2)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="must be a positive integer"):
            S.gpipe(bad, 4)
    assert S.gpipe_bubble(4, 8) == pytest.approx(3 / 11)
    assert np.issubdtype(S.gpipe(2, 2).f_mb.dtype, np.integer)


@pytest.mark.parametrize("n_micro, p, want", [(8, 4, 8), ("8", 4, 8), (" 6 ", 2, 6), (1, 1, 1)])
def test_micro_batches_accepts_a_multiple_of_the_stages(n_micro, p, want):
    assert S.micro_batches(n_micro, p) == want


@pytest.mark.parametrize(
    "n_micro, p, near", [(0, 2, 2), ("x", 2, 4), (6, 4, 4), (-3, 2, 2), (True, 1, 1), (2.5, 2, 4)]
)
def test_micro_batches_refuses_with_the_count_to_use(n_micro, p, near):
    with pytest.raises(ValueError, match=f"use n_micro={near}$"):
        S.micro_batches(n_micro, p)

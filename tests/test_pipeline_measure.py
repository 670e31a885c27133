"""Measuring pipelines: the bubble from compiled FLOPs, the stash from memory_analysis, the sends from the
HLO, each equal (or within a stated margin) to the prediction from the table; the time fit's arithmetic."""

import jax
import jax.numpy as jnp
import pytest

from course_lib import pipeline as PL
from course_lib import pipeline_measure as PM
from course_lib import schedules as S
from course_lib.meshes import STAGE, mesh_of

P_STAGES, M, D, N = 2, 4, 128, 64


@pytest.fixture(scope="module")
def setup(report):
    mesh = mesh_of({STAGE: P_STAGES}, report.devices[:P_STAGES], axis_type="auto")
    params = PM.init_residual(jax.random.key(0), 2 * P_STAGES, D)
    xs = jax.random.normal(jax.random.key(1), (M, N, D))
    return mesh, params, xs


@pytest.mark.parametrize("name, v", [("gpipe", 1), ("1f1b_lockstep", 1), ("circular", 2)])
def test_flops_bubble_is_the_predicted_one(setup, name, v):
    mesh, params, xs = setup
    sched = S.make(name, P_STAGES, M, v)
    got = PM.flops_bubble(mesh, STAGE, sched, params, xs)
    assert got["predicted"] == pytest.approx(S.gpipe_bubble(P_STAGES, M, v))
    # the compiled step does the lockstep work of the table, and a little more (masks, the loss, the
    # gradient sums): under 3 %; its bubble is then a little larger than predicted
    lockstep = got["useful"] / (1 - got["predicted"])
    assert 1.0 <= got["total"] / lockstep < 1.03
    assert got["predicted"] <= got["bubble"] < got["predicted"] + 0.03
    assert got["total"] > got["useful"] > 0
    assert got["permute_bytes"] == PM.permute_bytes(sched, N * D * 4)


def test_analysis_options_change_neither_flops_nor_memory(setup):
    mesh, params, xs = setup
    step = PM.build_train(mesh, STAGE, S.one_f_one_b(P_STAGES, M), PM.residual_stage())
    lowered = step.lower(PL.chunked(params), xs, xs)
    plain, fast = lowered.compile(), lowered.compile(PM.ANALYSIS_OPTIONS)
    assert plain.cost_analysis()["flops"] == fast.cost_analysis()["flops"]
    assert plain.memory_analysis().temp_size_in_bytes == fast.memory_analysis().temp_size_in_bytes


def test_lane_flops_count_one_forward_and_its_backward():
    chunk = PM.init_residual(jax.random.key(0), 1, D)
    f, b = PM.lane_flops(PM.residual_stage(unroll=True), chunk, jnp.zeros((N, D)))
    matmul = 2 * N * D * D
    assert matmul <= f < 1.2 * matmul  # one matmul and a tanh
    assert 3 * matmul <= b < 3.6 * matmul  # the recomputed forward and two matmuls back


@pytest.mark.parametrize(
    "name, v, slots_per_mb", [("gpipe", 1, 1), ("1f1b_lockstep", 1, 0), ("circular", 2, 2)]
)
def test_the_stash_is_what_grows_with_micro_batches(setup, name, v, slots_per_mb):
    mesh, params, _ = setup
    got = PM.stash_growth(
        mesh, STAGE, name, M, v, params, jax.ShapeDtypeStruct((N, D), jnp.float32)
    )
    assert got["predicted"] == slots_per_mb * M * N * D * 4
    assert got["measured"] == got["predicted"]


def test_time_bubble_arithmetic_and_interleaved_times():
    # t = ticks·c + o: busy m=4 → 4c + o, busy 2m → 8c + o, GPipe p=2 → 5c + o
    c, o = 0.01, 0.003
    got = PM.time_bubble({"busy": 4 * c + o, "busy2": 8 * c + o, "gpipe": 5 * c + o}, 4)
    assert got["c"] == pytest.approx(c) and got["o"] == pytest.approx(o)
    assert got["gpipe"] == pytest.approx(1 / 5)
    times = PM.interleaved_times({"a": lambda: jnp.ones(3), "b": lambda: jnp.zeros(3)}, repeats=3)
    assert set(times) == {"a", "b"} and all(t.n == 3 and t.median_s > 0 for t in times.values())
    # per round, then the median: a round whose busy runs were slowed by a burst does not move it
    rounds = {
        "busy": [4 * c + o, 4 * c + o, 40 * c],
        "busy2": [8 * c + o] * 3,
        "gpipe": [5 * c + o] * 3,
    }
    got = PM.time_bubbles(rounds, 4)
    assert got["gpipe"] == pytest.approx(1 / 5) and got["c"] == pytest.approx(c)


def test_median_ratio_pairs_rounds():
    # round 2 was slowed for both calls alike: the per-round ratio stays 1.25, the median too
    samples = {"gpipe": [1.25, 1.25, 12.5, 1.0], "busy": [1.0, 1.0, 10.0, 1.0]}
    assert PM.median_ratio(samples, "gpipe", "busy") == pytest.approx(1.25)
    with pytest.raises(ValueError, match="time them together"):
        PM.median_ratio({"a": [1.0], "b": [1.0, 2.0]}, "a", "b")


def test_lowered_flops_counts_a_matmul_and_a_loop_body_once():
    x = jnp.ones((8, 16), jnp.float32)
    w = jnp.ones((16, 4), jnp.float32)
    assert PM.lowered_flops(lambda a, b: a @ b, x, w) == 2 * 8 * 16 * 4
    # a fori_loop of 5 matmuls: the body counts once (plus the loop's own few operations), not 5 times
    looped = lambda a: jax.lax.fori_loop(0, 5, lambda i, h: h @ jnp.eye(16), a)
    one_body = 2 * 8 * 16 * 16
    assert one_body <= PM.lowered_flops(looped, x) < 2 * one_body

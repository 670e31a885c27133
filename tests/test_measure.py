"""Measurement: timing, compiled-program statistics, collectives, memory, scaling efficiency."""

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from course_lib import measure


def test_timing_summary():
    t = measure.Timing.from_samples([0.3, 0.1, 0.2, 0.4, 0.5])
    assert t.median_s == 0.3 and t.min_s == 0.1 and t.max_s == 0.5 and t.n == 5
    assert math.isclose(t.iqr_s, 0.45 - 0.15)
    with pytest.raises(ValueError, match="no timing samples"):
        measure.Timing.from_samples([])


def test_time_calls_synchronises_and_counts():
    calls = []
    f = jax.jit(lambda x: x @ x)
    x = jnp.ones((64, 64))
    t = measure.time_calls(lambda: calls.append(1) or f(x), repeats=3, warmup=2)
    assert len(calls) == 5 and t.n == 3 and t.median_s > 0
    with pytest.raises(ValueError, match="repeats=0"):
        measure.time_calls(lambda: f(x), repeats=0)


def test_time_calls_reads_the_clock_it_is_given():
    # process_time counts this process's CPU time: a sleep, which waits without working, hardly counts.
    wall = measure.time_calls(lambda: time.sleep(0.05), repeats=2, warmup=0)
    cpu = measure.time_calls(lambda: time.sleep(0.05), repeats=2, warmup=0, clock=time.process_time)
    assert wall.min_s >= 0.05 and cpu.max_s < 0.02
    now = [0.0]  # a fake clock that only the call moves on: the reads surround each timed call

    def work():
        now[0] += 3.0

    t = measure.time_calls(work, repeats=4, warmup=1, clock=lambda: now[0])
    assert t.min_s == t.max_s == 3.0 and t.n == 4 and now[0] == 15.0
    with pytest.raises(TypeError, match=r"clock=\d.* is not callable.*time.perf_counter"):
        measure.time_calls(work, clock=time.perf_counter())  # the clock's value, not the clock
    with pytest.raises(TypeError, match="fn=.* is not callable"):
        measure.time_calls(work())  # the call's result, not the call


def test_alternating_rounds_time_every_call_in_each_round_in_wall_and_cpu_time():
    order = []
    out = measure.alternating(
        {
            "sleep": lambda: order.append("sleep") or time.sleep(0.02),
            "spin": lambda: order.append("spin") or sum(range(200_000)),
        },
        rounds=3,
        warmup=1,
    )
    assert order == ["sleep", "spin"] * 4  # round by round, the warm-up round untimed
    assert out["sleep"]["wall"].n == 3 and out["sleep"]["wall"].min_s >= 0.02
    assert out["sleep"]["cpu"].max_s < 0.01  # waiting is not work
    assert out["spin"]["cpu"].median_s > 0
    with pytest.raises(ValueError, match="rounds=0"):
        measure.alternating({"x": lambda: None}, rounds=0)
    with pytest.raises(ValueError, match="calls not empty"):
        measure.alternating({})


def test_compile_and_analyse_matmul_flops_and_memory():
    x = jnp.ones((128, 128), jnp.float32)
    compiled, stats = measure.compile_and_analyse(lambda: jax.jit(lambda a: a @ a).lower(x))
    assert stats.flops_per_device == pytest.approx(2 * 128**3, rel=0.01)
    assert stats.argument_bytes == 128 * 128 * 4 and stats.output_bytes == 128 * 128 * 4
    assert stats.compile_s > 0 and stats.collectives_str() == "none"
    np.testing.assert_allclose(compiled(x), x @ x)


def test_collectives_are_counted_in_a_sharded_program(report):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from course_lib.meshes import DATA, data_mesh

    mesh = data_mesh(report.devices, axis_type="auto")
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P(DATA)))
    _, stats = measure.compile_and_analyse(
        lambda: jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, P())).lower(x)
    )
    assert stats.collectives["all-reduce"] >= 1


def test_count_collectives_text():
    text = """
  %all-reduce.1 = f32[4] all-reduce(f32[4] %p), replica_groups={}
  %ag = f32[8] all-gather-start(f32[4] %x), dimensions={0}
  %agd = f32[8] all-gather-done(%ag)
  %cp = f32[4] collective-permute(f32[4] %y)
"""
    c = measure.count_collectives(text)
    assert c == {
        "all-reduce": 1,
        "all-gather": 1,
        "reduce-scatter": 0,
        "collective-permute": 1,
        "all-to-all": 0,
    }


def test_human_bytes_and_peak_memory(report):
    assert measure.human_bytes(1536) == "1.5 KiB" and measure.human_bytes(None) == "n/a"
    assert measure.peak_device_memory(report.devices) is None  # CPU has no allocator stats


class _FakeGpu:
    """A device whose allocator reports ``stats`` (a GPU's memory_stats() keys)."""

    def __init__(self, **stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_allocator_snapshot_and_own_peak():
    from course_lib import measure

    assert measure.allocator_snapshot(jax.devices()) is None  # CPU: no allocator statistics
    a = _FakeGpu(bytes_in_use=100, peak_bytes_in_use=500, bytes_limit=1000, pool_bytes=1000)
    b = _FakeGpu(bytes_in_use=300, peak_bytes_in_use=400, bytes_limit=1000)
    snap = measure.allocator_snapshot([a, b])
    assert snap == {
        "bytes_in_use": 300,
        "peak_bytes_in_use": 500,
        "bytes_limit": 1000,
        "pool_bytes": 1000,
    }
    before = {"bytes_in_use": 300, "peak_bytes_in_use": 500}
    assert (
        measure.own_peak(before, {"bytes_in_use": 300, "peak_bytes_in_use": 900}) == 600
    )  # the run raised it
    assert (
        measure.own_peak(before, {"bytes_in_use": 300, "peak_bytes_in_use": 500}) is None
    )  # unknown: not 500
    assert measure.own_peak(None, None) is None
    settings = measure.allocator_settings()
    assert set(settings) == set(measure.ALLOCATOR_ENV)
    assert all(v.startswith("unset") or v for v in settings.values())


def test_compile_and_analyse_sizes_the_collectives(report):
    from course_lib import data, model, steps, strategies

    g, p = model.init_model(jax.random.key(0), model.TINY)
    opt = steps.make_optimizer()
    s = strategies.build("sharded_jit", g, p, opt, report.devices)
    state = s.place_state(steps.init_state(p, opt))
    batch = s.batches(data.SyntheticImages(image_size=16), jax.random.key(1), 1, 16)[0]
    _, stats = measure.compile_and_analyse(lambda: s.lower(state, batch), s.mesh_axes)
    (c,) = stats.transfers
    assert (
        c.kind == "all-reduce"
        and c.axes == ("data",)
        and c.size_bytes == (model.param_count(p) + 1) * 4
    )
    assert stats.sent_bytes == pytest.approx(2 * 7 / 8 * c.size_bytes) and stats.bytes_accessed > 0


def test_matmul_ceiling_counts_two_n_cubed_per_matmul(report):
    flops = measure.matmul_ceiling(report.devices[0], n=64, repeats=2, chain=2)
    assert math.isfinite(flops) and flops > 0
    with pytest.raises(ValueError, match="n=0"):
        measure.matmul_ceiling(report.devices[0], n=0)

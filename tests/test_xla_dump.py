"""XLA's own records of a compile (course_lib.xla_dump): the HLO after SPMD partitioning and what the
temporaries hold, read under the test session's persistent compilation cache (root conftest), which would
serve a cached program without its dumps."""

import jax
import jax.numpy as jnp
import pytest

from course_lib import config, steps, strategies, xla_dump


def _lowered(key, devices, profile="tiny", precision="float32"):
    cfg = config.PROFILES[profile]
    start = config.init_run(cfg, 0)
    opt = steps.make_optimizer()
    s = strategies.build(key, start.graphdef, start.params, opt, devices, precision=precision)
    state = s.place_state(steps.init_state(start.params, opt))
    batch = s.batches(start.dataset, start.data_key, 1, cfg.global_batch)[0]
    return s.lower(state, batch)


def test_dumps_are_written_though_the_program_was_compiled_and_cached_before(report):
    f = jax.jit(lambda x: jnp.sin(x) @ x.T)
    x = jnp.ones((32, 32))
    f.lower(x).compile()  # now in the persistent cache (and in memory)
    for _ in range(2):  # and twice in a row: each compile writes its own dump
        compiled, dump = xla_dump.compile_with_dump(f.lower(x))
        assert "preallocated-temp" in dump.buffer_assignment and dump.live_range
        assert "sine" in dump.after_optimizations
    assert jax.config.jax_enable_compilation_cache  # switched on again after
    assert compiled(x).shape == (32, 32)


def test_the_peak_temporaries_of_a_step_and_their_element_types(report):
    compiled, dump = xla_dump.compile_with_dump(_lowered("jit", report.devices[:1]))
    where, live = xla_dump.peak_temporaries(dump)
    total = xla_dump.occupied_bytes(live)
    # the peak of the live values is the temporary slab memory_analysis reports (to a few bytes of padding)
    assert 0.9 * compiled.memory_analysis().temp_size_in_bytes <= total
    assert total <= compiled.memory_analysis().temp_size_in_bytes
    by_dtype = xla_dump.bytes_by_dtype(live)
    assert set(by_dtype) >= {"f32", "s32"} and sum(by_dtype.values()) >= total
    # XLA:CPU's max-pool backward: iotas the size of each pool's input, one per dimension
    iotas = [v for v in live if v.dtype == "s32" and v.name.startswith("wrapped_iota")]
    assert iotas and all(v.start <= where <= v.end for v in live)
    assert list(by_dtype) == sorted(by_dtype, key=lambda k: -by_dtype[k])


def test_the_partitioner_asks_for_bfloat16_gradient_all_reduces_in_sharded_jit(report):
    _, d = xla_dump.compile_with_dump(_lowered("sharded_jit", report.devices, precision="bfloat16"))
    after = xla_dump.collective_dtypes(d.after_spmd)
    assert after.count("bf16") == 10 and after.count("f32") == 1  # 10 gradient leaves; the loss
    promoted = xla_dump.collective_dtypes(d.after_optimizations)
    assert set(promoted) == {"f32"}  # XLA:CPU's AllReducePromotion sums them in float32
    _, c = xla_dump.compile_with_dump(_lowered("shard_map", report.devices, precision="bfloat16"))
    grads = xla_dump.collective_dtypes(c.after_spmd, group_size=4)  # over data (data=4 x model=2)
    assert grads and set(grads) == {"f32"}
    _, e = xla_dump.compile_with_dump(_lowered("fsdp", report.devices, precision="bfloat16"))
    kinds = ("all-reduce", "reduce-scatter")
    assert set(xla_dump.collective_dtypes(e.after_spmd, kinds)) == {"f32"}


def test_shared_bytes_count_once():
    v = xla_dump.TempValue
    a, b = v("a{}", "f32", (4,), 16, 0, 3, offset=0), v("b{}", "f32", (4,), 16, 3, 5, offset=0)
    c = v("c{}", "s32", (2,), 8, 1, 4, offset=12)
    assert xla_dump.occupied_bytes([a, b]) == 16  # b writes into a's buffer
    assert xla_dump.occupied_bytes([a, c]) == 20  # 4 bytes of overlap


def test_a_dump_without_buffer_assignment_is_refused(monkeypatch):
    monkeypatch.setattr(xla_dump, "_read", lambda folder, pattern: "")
    with pytest.raises(RuntimeError, match="no buffer assignment"):
        xla_dump.compile_with_dump(jax.jit(jnp.sin).lower(1.0))

"""Precision of a run (course_lib.precision): dtypes of parameters and activations, and where the bfloat16
cast sits relative to shard_map's implicit broadcast (which decides the dtype of the gradient all-reduce)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from course_lib import config, precision, steps, strategies


def test_check_names_the_choices():
    assert precision.check("bfloat16") == "bfloat16"
    with pytest.raises(
        ValueError, match=r"precision='fp16' is not one of \['float32', 'float64', 'bfloat16'\]"
    ):
        precision.check("fp16")


def test_casts():
    params = {"w": jnp.ones((2, 2)), "step": jnp.zeros((), jnp.int32)}
    with precision.enabled("float64"):
        p64 = precision.cast_params(params, "float64")
        assert p64["w"].dtype == jnp.float64 and p64["step"].dtype == jnp.int32
    assert (
        precision.cast_params(params, "bfloat16")["w"].dtype == jnp.float32
    )  # master weights stay f32
    images, labels = precision.cast_batch((jnp.ones((2, 3)), jnp.zeros(2, jnp.int32)), "float32")
    assert images.dtype == jnp.float32 and labels.dtype == jnp.int32
    assert precision.matmul_precision() == "default"


def test_compute_in_bfloat16_computes_in_bf16_and_returns_f32():
    seen = {}

    def apply_fn(p, x):
        seen["dtypes"] = (p["w"].dtype, x.dtype)
        return x @ p["w"]

    f = precision.compute_in(apply_fn, "bfloat16")
    out = jax.jit(f)({"w": jnp.ones((3, 2))}, jnp.ones((4, 3)))
    assert seen["dtypes"] == (jnp.bfloat16, jnp.bfloat16) and out.dtype == jnp.float32
    assert precision.compute_in(apply_fn, "float32") is apply_fn


def test_bf16_gradients_are_all_reduced_in_float32_inside_shard_map(report):
    # Strategy C in bfloat16, lowered (before XLA:CPU turns every bf16 collective into f32): the activation
    # psums move bfloat16, the gradient all-reduce over data moves float32.
    cfg = config.PROFILES["tiny"]
    start = config.init_run(cfg, 0)
    opt = steps.make_optimizer()
    s = strategies.build(
        "shard_map_pairs", start.graphdef, start.params, opt, report.devices, precision="bfloat16"
    )
    state = s.place_state(steps.init_state(start.params, opt))
    batch = s.batches(start.dataset, start.data_key, 1, cfg.global_batch)[0]
    text = s.lower(state, batch).as_text()
    types = re.findall(
        r"\}\) : \(tensor<([^>]*)>\) -> ", text
    )  # operand type of each stablehlo.all_reduce
    activations = [t for t in types if t.endswith("bf16")]
    gradients = [t for t in types if t.endswith("f32")]
    assert len(activations) == 3 and len(gradients) == 11, types  # 10 parameter leaves and the loss
    run_params = jax.device_get(s.host_params(s.step(state, batch)[0]))
    assert all(np.asarray(x).dtype == np.float32 for x in jax.tree.leaves(run_params))


def test_float32_rtol_follows_the_platforms_matmul_rounding():
    assert precision.float32_rtol("cpu") == precision.FLOAT32_RTOL_FLOOR
    # a TPU's default float32 matmul multiplies bfloat16 inputs: 8 roundings of 2^-9
    assert precision.float32_rtol("tpu", "default") == 8 * 2.0**-9
    assert precision.float32_rtol("tpu", "highest") == precision.FLOAT32_RTOL_FLOOR
    assert precision.float32_rtol("gpu", "default") == 8 * 2.0**-11
    assert precision.float32_rtol("tpu", "float32") == precision.float32_rtol("tpu", "highest")
    with pytest.raises(ValueError, match="backend='npu'"):
        precision.float32_rtol("npu")
    assert precision.float64_runs("cpu") and not precision.float64_runs("tpu")


def test_float64_is_refused_where_it_does_not_run():
    assert precision.check_runs("float64", "cpu") == "float64"
    assert precision.check_runs("float32", "tpu") == "float32"
    with pytest.raises(ValueError, match="XLA:TPU.*select-and-scatter.*float32"):
        precision.check_runs("float64", "tpu")
    with pytest.raises(ValueError, match="precision='float16'"):
        precision.check_runs("float16", "cpu")


def test_parity_tolerances_follow_the_platform():
    from course_lib import parity

    assert parity.tolerance("float32", "cpu") == parity.TOLERANCES["float32"]
    assert parity.tolerance("float64", "cpu") == parity.TOLERANCES["float64"]
    tpu = parity.tolerance("float32", "tpu")
    assert tpu.one_step_loss == precision.float32_rtol("tpu") and tpu.trajectory is None
    # a TPU's float32 matmul rounds its inputs as a bfloat16 run does; a bug still moves an update by 0.5
    assert tpu.one_step_update == parity.TOLERANCES["bfloat16"].one_step_update < 0.5
    assert parity.tolerance("bfloat16", "tpu") == parity.TOLERANCES["bfloat16"]
    with pytest.raises(ValueError, match="XLA:TPU"):
        parity.tolerance("float64", "tpu")


def test_parity_checks_are_float64_where_it_runs_and_float32_relative_elsewhere():
    assert (
        precision.parity_dtype("cpu") == jnp.float64
        and precision.parity_dtype("tpu") == jnp.float32
    )
    assert precision.parity_bound(1e-10, "cpu") == 1e-10
    assert precision.parity_bound(1e-10, "tpu") == precision.float32_rtol("tpu")
    ref = jnp.asarray([4.0, -8.0])
    assert precision.parity_diff(2e-3, ref, "cpu") == 2e-3  # absolute, as written
    assert precision.parity_diff(2e-3, ref, "tpu") == 2e-3 / 8  # relative to the largest value
    assert precision.parity_diff(2e-3, jnp.zeros(2), "tpu") == 2e-3
    with precision.parity_x64("cpu"):
        assert jnp.zeros(1, precision.parity_dtype("cpu")).dtype == jnp.float64
    with precision.parity_x64("tpu"):
        assert jnp.zeros(1).dtype == jnp.float32
    with pytest.raises(ValueError, match="float64_bound=0"):
        precision.parity_bound(0)


def test_parity_setup_per_backend():
    cpu = precision.parity_setup("cpu")
    assert cpu.float64 and cpu.dtype == jnp.float64 and cpu.note == ""
    assert cpu.bound(1e-10) == 1e-10 and cpu.diff(0.5, np.array([4.0])) == 0.5
    assert cpu.compile_once == {"xla_backend_optimization_level": 0}
    with cpu.x64():
        assert jnp.zeros(1, jnp.float64).dtype == jnp.float64
    tpu = precision.parity_setup("tpu")
    assert not tpu.float64 and tpu.dtype == jnp.float32 and tpu.compile_once is None
    assert tpu.bound(1e-10) == precision.float32_rtol("tpu")
    assert tpu.diff(0.5, np.array([4.0])) == 0.125 and "float32" in tpu.note
    f64, dtype, tol, scaled, x64, once = cpu  # as the lessons unpack it
    assert (f64, dtype, once) == (True, jnp.float64, cpu.compile_once)
    with pytest.raises(ValueError, match="backend='cuda'"):
        precision.parity_setup("cuda")

"""Facts the course relies on that only a TPU can show; marked tpu, skipped without one.

``tools/tpu_check.sh`` runs them on a TPU host (``pytest tests/test_tpu.py -m tpu``, one process: one program
holds the chip at a time).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from course_lib import precision

pytestmark = [
    pytest.mark.tpu,
    pytest.mark.skipif(jax.default_backend() != "tpu", reason="needs a TPU backend"),
]


@pytest.mark.parametrize("setting", ["default", "high", "highest"])
def test_float32_rtol_bounds_the_chips_matmul_error(setting):
    a, b = np.random.default_rng(0).standard_normal((2, 512, 512)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    with jax.default_matmul_precision(None if setting == "default" else setting):
        got = np.asarray(jnp.asarray(a) @ jnp.asarray(b), np.float64)
    err = np.max(np.abs(got - exact)) / np.max(np.abs(exact))
    rtol = precision.float32_rtol("tpu", setting)
    assert err < rtol, (setting, err, rtol)
    if setting == "default":  # one bfloat16 pass: far coarser than float32, as the lessons say
        assert err > 1e-4, err


def test_float64_parity_is_not_run_on_a_tpu():
    assert not precision.float64_runs()


def test_memory_stats_report_peak_and_limit():
    x = jnp.ones((1024, 1024))
    x.block_until_ready()
    stats = jax.devices()[0].memory_stats()
    assert stats["peak_bytes_in_use"] >= x.nbytes
    assert stats["bytes_limit"] > 8 * 2**30  # every TPU the course names has at least 16 GiB


def test_a_program_for_8_chips_compiles_on_one():
    from jax.experimental import topologies
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    topo = topologies.get_topology_desc("v5e:2x4", "tpu")
    mesh = topologies.make_mesh(topo, (8,), ("data",))
    x = jax.ShapeDtypeStruct((8 * 128, 256), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=NamedSharding(mesh, P()))
    grad = jax.jit(jax.grad(lambda w, x: jnp.sum((x @ w) ** 2)))
    text = grad.lower(w, x).compile().as_text()
    assert "all-reduce" in text


def test_the_report_names_the_chip_and_its_memory():
    from course_lib import chips, devices

    d = jax.devices()[0]
    chip = chips.chip_for(d.device_kind)
    assert chip is not None and chip.platform == "tpu", d.device_kind  # every TPU the course names
    limit = devices._bytes_limit(d)
    assert (
        limit is not None and 0.9 * chip.hbm_bytes <= limit <= chip.hbm_bytes
    )  # 15.7 of 16 GiB on a v5e
    with pytest.raises(devices.DeviceSetupError, match=r"TPU chip\(s\) exist .*platform='cpu'"):
        devices.select_devices(len(jax.devices()) + 1, jax.devices(), "tpu")


def test_a_bf16_matmul_stays_under_the_tables_peak():
    from course_lib import chips, measure

    d = jax.devices()[0]
    ceiling = measure.matmul_ceiling(d)
    peak = chips.chip_for(d.device_kind).peak_bf16_flops_per_s
    assert 0.5 * peak < ceiling <= 1.05 * peak, (ceiling, peak)  # v5e: 175 of 197 TFLOP/s measured


def test_the_lab_fits_the_articles_batch_to_the_chip():
    from course_lib import sizing
    from course_lib.config import resolve_profile

    config = resolve_profile("auto", "tpu")
    fitted, tried = sizing.fit_global_batch(config, jax.devices()[:1], "bfloat16", simulated=False)
    assert tried[-1].fits and fitted.global_batch <= 512
    assert tried[0].global_batch == 512 and all(not e.fits for e in tried[:-1])

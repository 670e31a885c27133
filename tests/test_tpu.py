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

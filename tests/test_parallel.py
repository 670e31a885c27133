"""Tensor parallelism: the per-shard forward inside shard_map equals the model."""

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from course_lib import meshes, model, parallel


def test_tensor_parallel_forward_equals_the_model(report):
    g, p = model.init_model(jax.random.key(0), model.TINY)
    x = jax.random.normal(jax.random.key(2), (8, 16, 16, 3))
    mesh = meshes.data_model_mesh(report.devices, (4, 2), axis_type="auto")
    specs = parallel.tp_param_specs(p)
    f = jax.shard_map(
        parallel.tp_apply, mesh=mesh, in_specs=(specs, P(meshes.DATA)), out_specs=P(meshes.DATA)
    )
    np.testing.assert_allclose(jax.jit(f)(p, x), model.apply(g, p, x), rtol=1e-5, atol=1e-5)

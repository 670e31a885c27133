"""The shared step's gradient sync: inside shard_map, averaging the gradients of a local loss is wrong."""

import jax
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from course_lib import data, meshes, model, steps


def test_the_gradient_trap_is_real(report):
    # Inside shard_map (check_vma=True), pmean-ing the gradients of a local loss leaves them n_data x too big.
    g, p = model.init_model(jax.random.key(0), model.TINY)
    x, y = data.SyntheticImages(image_size=16).batch(jax.random.key(1), 16)
    apply = lambda p, x: model.apply(g, p, x)
    true = jax.grad(lambda p: steps.cross_entropy(apply(p, x), y))(p)
    mesh = meshes.data_mesh(report.devices, axis_type="auto")

    def grads(sync):
        def body(p, x, y):
            def loss(p):
                loss_ = steps.cross_entropy(apply(p, x), y)
                return lax.pmean(loss_, meshes.DATA) if sync == "loss" else loss_

            gr = jax.grad(loss)(p)
            return lax.pmean(gr, meshes.DATA) if sync == "grads" else gr

        f = jax.shard_map(
            body, mesh=mesh, in_specs=(P(), P(meshes.DATA), P(meshes.DATA)), out_specs=P()
        )
        return jax.jit(f)(p, x, y)

    right, wrong = grads("loss"), grads("grads")
    for t, r, w in zip(
        jax.tree.leaves(true), jax.tree.leaves(right), jax.tree.leaves(wrong), strict=True
    ):
        np.testing.assert_allclose(r, t, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(w, 8 * t, rtol=1e-4, atol=1e-6)

"""The expert × data layout of a MoE layer: loss and gradients equal to one device (float64), every
collective of its gradient program predicted = compiled per axis, at 1, 2, 4 and 8 simulated devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from course_lib import comms, moe, moe_layout
from course_lib.meshes import mesh_of

E, K, D, F, N = 8, 2, 16, 32, 32
ONCE = {"xla_backend_optimization_level": 0}


def _reference(cf):
    def loss(p, x, t):
        out = moe.moe_mlp(x, p, k=K, capacity_factor=cf, n_groups=x.shape[0] // N)
        aux = moe.load_balancing_loss(x @ p["router"]["kernel"], K)
        return jnp.mean(jnp.sum((out - t) ** 2, -1)) + 0.01 * aux

    return loss


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_expert_data_layout_equals_one_device_and_its_bytes_are_predicted(report, n):
    n_data, n_expert = moe_layout.mesh_shape(n, E)
    mesh = mesh_of({"data": n_data, "expert": n_expert}, report.devices[:n], axis_type="auto")
    cf = 1.0  # drops choices: each device's capacity matters
    with jax.enable_x64(True):
        p = moe.init_moe(jax.random.key(0), D, F, E, jnp.float64)
        x, t = (jax.random.normal(jax.random.key(i), (n * N, D), jnp.float64) for i in (1, 2))
        assert float(moe.dropped_fraction(x, p, k=K, capacity_factor=cf, n_groups=n)) > 0
        loss = moe_layout.ep_dp_loss(
            mesh, data_axis="data", expert_axis="expert", k=K, capacity_factor=cf
        )
        step = jax.jit(jax.value_and_grad(loss), compiler_options=ONCE).lower(p, x, t).compile()
        (val, grads), (want, want_g) = step(p, x, t), jax.value_and_grad(_reference(cf))(p, x, t)
    assert abs(float(val - want)) < 1e-10
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_g), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-10)
    got = comms.sent_by_axis(comms.collectives(step.as_text(), dict(mesh.shape)))
    pred = comms.sent_by_axis(
        moe_layout.predict_transfers(N, D, F, E, K, cf, n_data, n_expert, itemsize=8)
    )
    assert comms.same_by_axis({a: b for a, b in got.items() if b}, pred), (got, pred)
    assert ("expert" in pred) == (n_expert > 1) and ("data" in pred) == (n_data > 1)


def test_mesh_shape_refuses_an_expert_axis_that_does_not_divide_the_experts():
    assert moe_layout.mesh_shape(8, 8) == (2, 4) and moe_layout.mesh_shape(2, 8) == (1, 2)
    with pytest.raises(ValueError, match="n_experts=6"):
        moe_layout.mesh_shape(8, 6)

"""A tensor-parallel block inside a pipeline stage (stage × model mesh): loss and gradients equal to one
device in float64, and every collective of the gradient program predicted per axis (count and bytes), at
1, 2, 4 and 8 simulated devices."""

import jax
import jax.numpy as jnp
import pytest

from course_lib import pipeline, pipeline_tp, schedules, transformer
from course_lib.meshes import MODEL, STAGE, mesh_of

CFG = transformer.TransformerConfig(16, 16, 32, 4, 64, 4)
ONCE = {"xla_backend_optimization_level": 0}


def _one_device(blocks, xs):
    def one(x):
        for layer in range(CFG.n_layers):
            x = transformer.block(x, jax.tree.map(lambda a, i=layer: a[i], blocks))
        return x

    return jnp.sum(jax.vmap(one)(xs) ** 2)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_tp_inside_pipeline_stages_equals_one_device_and_its_collectives_are_predicted(report, n):
    p, n_model = pipeline_tp.mesh_shape(n, CFG.n_layers)
    mesh = mesh_of({STAGE: p, MODEL: n_model}, report.devices[: p * n_model], axis_type="auto")
    sched = schedules.gpipe(p, p)
    with jax.enable_x64(True):
        params = transformer.init_model(jax.random.key(0), CFG)[1]
        blocks = jax.tree.map(lambda a: a.astype(jnp.float64), params["blocks"])
        xs = jax.random.normal(jax.random.key(1), (p, 2, CFG.seq_len, CFG.d_model), jnp.float64)
        loss = pipeline_tp.pp_tp_loss(mesh, sched, stage_axis=STAGE, model_axis=MODEL)
        step = jax.jit(jax.value_and_grad(loss), compiler_options=ONCE)
        compiled = step.lower(pipeline.chunked(blocks), xs).compile()
        val, grads = compiled(pipeline.chunked(blocks), xs)
        want, want_g = jax.value_and_grad(_one_device)(blocks, xs)
    assert abs(float(val - want)) < 1e-10 * abs(float(want))
    for g, w in zip(
        jax.tree.leaves(pipeline.unchunked(grads)), jax.tree.leaves(want_g), strict=True
    ):
        assert float(jnp.abs(g - w).max()) < 1e-10 * max(1.0, float(jnp.abs(w).max()))
    got = pipeline_tp.measured(compiled.as_text(), mesh)
    pred = pipeline_tp.predict(sched, CFG.n_layers // p, xs.shape[1:], n_model, itemsize=8)
    assert pipeline_tp.same(got, pred), (got, pred)
    assert ("model" in got) == (n_model > 1) and ("stage" in got) == (p > 1)

"""Pipeline executors against one device, in float64: every schedule, both executors, the transformer."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from course_lib import pipeline as PL
from course_lib import pipeline_measure as PM
from course_lib import schedules as S
from course_lib import transformer as T
from course_lib.meshes import STAGE, mesh_of

CFG = dataclasses.replace(T.TINY, n_layers=4)
ONCE = {"xla_backend_optimization_level": 0}
"""The transformer's programs run a few times: compiled without LLVM's optimisations (half the compile)."""


def _mesh(report, p):
    return mesh_of({STAGE: p}, report.devices[:p], axis_type="auto")


def _max_diff(a, b):
    return max(
        float(jnp.abs(x - y).max())
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize(
    "name, p, v",
    [("gpipe", 4, 1), ("1f1b_lockstep", 4, 1), ("circular", 2, 2), ("1f1b_lockstep", 1, 1)],
)
def test_train_equals_one_device_for_every_schedule(report, residual, name, p, v):
    params, xs, r, loss, (g_params, g_xs) = residual
    with jax.enable_x64(True):
        sched = S.make(name, p, xs.shape[0], v)
        step = PM.build_train(
            _mesh(report, p), STAGE, sched, PM.residual_stage(), input_grads=True, trace=True
        )
        got_loss, grads, dxs, trace = step(PL.chunked(params, v), xs, r)
        assert abs(float(got_loss - loss)) < 1e-10
        assert _max_diff(PL.unchunked(grads), g_params) < 1e-10 and _max_diff(dxs, g_xs) < 1e-10
    # what every device ran is its column of the table
    np.testing.assert_array_equal(np.asarray(trace)[:, 0], sched.f_mb)
    np.testing.assert_array_equal(np.asarray(trace)[:, 2], sched.b_mb)


@pytest.mark.parametrize("name, v", [("gpipe", 1), ("circular", 2)])
def test_forward_under_grad_equals_one_device(report, residual, name, v):
    params, xs, r, loss, (g_params, g_xs) = residual
    p = 2
    sched = S.make(name, p, xs.shape[0], v)
    spec = PL.stage_spec(STAGE)

    def body(prm, xs):
        ys, trace = PL.forward(jax.checkpoint(PM.residual_stage()), prm, xs, sched, STAGE)
        local = jnp.where(jax.lax.axis_index(STAGE) == p - 1, (ys * r).sum(), 0.0)
        return jax.lax.psum(local, STAGE), trace[..., None]

    mapped = jax.shard_map(
        body, mesh=_mesh(report, p), in_specs=(spec, P()), out_specs=(P(), P(None, None, STAGE))
    )
    with jax.enable_x64(True):
        (got, trace), grads = jax.value_and_grad(mapped, argnums=(0, 1), has_aux=True)(
            PL.chunked(params, v), xs
        )
        assert abs(float(got - loss)) < 1e-10
        assert (
            _max_diff(PL.unchunked(grads[0]), g_params) < 1e-10
            and _max_diff(grads[1], g_xs) < 1e-10
        )
    np.testing.assert_array_equal(np.asarray(trace)[:, 0], sched.f_mb[: sched.forward_ticks()])


@pytest.fixture(scope="module")
def model():
    _, params = T.init_model(jax.random.key(0), CFG)
    tokens = jax.random.randint(jax.random.key(1), (4, CFG.seq_len), 0, CFG.vocab)
    targets = jnp.roll(tokens, -1, axis=1)
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda a: a.astype(jnp.float64), params)

        def ref(prm):
            return PL.cross_entropy_sum(T.forward(prm, tokens), targets) / targets.size

        reference = jax.jit(jax.value_and_grad(ref), compiler_options=ONCE)
        loss, grads = reference(p64)
    return p64, tokens, targets, loss, grads, reference


def test_transformer_gpipe_by_autodiff_equals_one_device_for_steps(report, model):
    p64, tokens, targets, loss, grads, ref = model
    sched = S.gpipe(2, 2)
    with jax.enable_x64(True):
        step = jax.jit(
            jax.value_and_grad(PL.transformer_loss(_mesh(report, 2), sched, axis=STAGE)),
            compiler_options=ONCE,
        )
        got_l, got_g = step({**p64, "blocks": PL.chunked(p64["blocks"])}, tokens, targets)
        assert abs(float(got_l - loss)) < 1e-10
        assert _max_diff({**got_g, "blocks": PL.unchunked(got_g["blocks"])}, grads) < 1e-10
        # three SGD steps: the pipelined and the single-device parameters stay equal
        a, b = p64, {**p64, "blocks": PL.chunked(p64["blocks"])}
        for _ in range(3):
            la, ga = ref(a)
            lb, gb = step(b, tokens, targets)
            assert abs(float(la - lb)) < 1e-10
            a = jax.tree.map(lambda x, g: x - 0.5 * g, a, ga)
            b = jax.tree.map(lambda x, g: x - 0.5 * g, b, gb)
        assert _max_diff({**b, "blocks": PL.unchunked(b["blocks"])}, a) < 1e-10


def test_transformer_train_with_1f1b_equals_one_device(report, model):
    # (the circular schedule on the transformer: notebooks/11_pipeline_experts.ipynb)
    p64, tokens, targets, loss, grads, ref = model
    v = 1
    sched = S.one_f_one_b(2, 2)
    with jax.enable_x64(True):
        step = jax.jit(
            PL.transformer_grads(_mesh(report, 2), sched, axis=STAGE), compiler_options=ONCE
        )
        got_l, got_g = step({**p64, "blocks": PL.chunked(p64["blocks"], v)}, tokens, targets)
        assert abs(float(got_l - loss)) < 1e-10
        assert _max_diff({**got_g, "blocks": PL.unchunked(got_g["blocks"])}, grads) < 1e-10


def test_layout_helpers_and_errors(report):
    blocks = {"w": jnp.arange(8.0).reshape(8, 1)}
    two = PL.chunked(blocks, 2)
    assert two["w"].shape == (2, 4, 1) and float(two["w"][1, 0, 0]) == 4.0
    np.testing.assert_array_equal(PL.unchunked(two)["w"], blocks["w"])
    with pytest.raises(ValueError, match="8 layers do not split into 3 chunks"):
        PL.chunked(blocks, 3)
    with pytest.raises(ValueError, match="batch 6 does not split into 4 micro-batches"):
        PL.micro_batches(jnp.zeros((6, 2)), 4)
    assert PL.next_stage(3) == [(0, 1), (1, 2)] and PL.next_stage(3, -1) == [(1, 0), (2, 1)]
    assert PL.next_stage(3, ring=True) == [(0, 1), (1, 2), (2, 0)]
    sched = S.gpipe(4, 2)  # four stages on a two-device axis
    step = PM.build_train(_mesh(report, 2), STAGE, sched, PM.residual_stage())
    params = PM.init_residual(jax.random.key(0), 4, 8)
    with pytest.raises(ValueError, match="has 4 stages but axis 'stage' has 2 devices"):
        step(PL.chunked(params), jnp.zeros((2, 3, 8)), jnp.zeros((2, 3, 8)))


def test_transformer_on_stage_by_data_equals_one_device(report, model):
    # the batch split over a data axis beside the stage axis: losses and gradients are the one-device ones
    from course_lib.meshes import DATA

    p64, tokens, targets, loss, grads, ref = model
    mesh = mesh_of({DATA: 2, STAGE: 2}, report.devices[:4], axis_type="auto")
    with jax.enable_x64(True):
        for build, sched in (
            (PL.transformer_grads, S.one_f_one_b(2, 2)),
            (PL.transformer_loss, S.gpipe(2, 2)),
        ):
            step = build(mesh, sched, axis=STAGE, data_axis=DATA)
            step = jax.jit(
                step if build is PL.transformer_grads else jax.value_and_grad(step),
                compiler_options=ONCE,
            )
            got_l, got_g = step({**p64, "blocks": PL.chunked(p64["blocks"])}, tokens, targets)
            assert abs(float(got_l - loss)) < 1e-10, build.__name__
            assert _max_diff({**got_g, "blocks": PL.unchunked(got_g["blocks"])}, grads) < 1e-10, (
                build.__name__
            )

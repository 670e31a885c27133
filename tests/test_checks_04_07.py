"""Exercise checkers of lessons 04–07: each accepts the reference answer and rejects typical wrong ones
with a specific hint (8 simulated CPU devices, from conftest.py)."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from course_tools.checks import ExerciseError, lesson04, lesson05, lesson06, lesson07
from course_lib.meshes import DATA, MODEL


def rejects(check, *args, match):
    with pytest.raises(ExerciseError, match="(?s)" + match):
        check(*args)


# ---- lesson 04: pmap -------------------------------------------------------------------------------------


def test_replicate(report):
    good = lambda tree, n: jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), tree)
    assert lesson04.check_replicate(good, report.devices)
    rejects(lesson04.check_replicate, lambda t, n: t, report.devices, match="no leading device axis")
    last = lambda t, n: jax.tree.map(lambda x: jnp.stack([x] * n, axis=-1), t)
    rejects(lesson04.check_replicate, last, report.devices, match="leading axis.*not the last")
    scaled = lambda t, n: jax.tree.map(lambda x: jnp.stack([x * i for i in range(n)]), t)
    rejects(lesson04.check_replicate, scaled, report.devices, match="identical copy")


def test_device_noise(report):
    def good(key, x, axis_name):
        return x + jax.random.normal(jax.random.fold_in(key, lax.axis_index(axis_name)), x.shape)

    assert lesson04.check_device_noise(good, report.devices)
    same = lambda key, x, axis_name: x + jax.random.normal(key, x.shape)
    rejects(lesson04.check_device_noise, same, report.devices, match="fold_in")
    wrong_name = lambda key, x, axis_name: x + jax.random.normal(jax.random.fold_in(key, lax.axis_index("i")), x.shape)
    rejects(lesson04.check_device_noise, wrong_name, report.devices, match="axis name passed in")
    noise_only = lambda key, x, axis_name: good(key, x, axis_name) - x
    rejects(lesson04.check_device_noise, noise_only, report.devices, match="plus the noise")


def test_data_parallel_grads(report):
    def good(loss_fn, params, batch, axis_name):
        return lax.pmean(jax.grad(loss_fn)(params, batch), axis_name)

    assert lesson04.check_data_parallel_grads(good, report.devices)
    local = lambda loss_fn, params, batch, axis_name: jax.grad(loss_fn)(params, batch)
    rejects(lesson04.check_data_parallel_grads, local, report.devices, match="lax.pmean")
    summed = lambda loss_fn, params, batch, axis_name: lax.psum(jax.grad(loss_fn)(params, batch), axis_name)
    rejects(lesson04.check_data_parallel_grads, summed, report.devices, match="too large.*psum adds")


# ---- lesson 05: sharding ---------------------------------------------------------------------------------


def test_place_batch(report):
    assert lesson05.check_place_batch(lambda x, mesh: jax.device_put(x, NamedSharding(mesh, P(DATA))), report.devices)
    rejects(lesson05.check_place_batch, lambda x, mesh: jax.device_put(x, NamedSharding(mesh, P())),
            report.devices, match="whole batch")
    rejects(lesson05.check_place_batch, lambda x, mesh: jax.device_put(x, NamedSharding(mesh, P(DATA, MODEL))),
            report.devices, match="data only")
    rejects(lesson05.check_place_batch, lambda x, mesh: jax.device_put(x, NamedSharding(mesh, P(MODEL))),
            report.devices, match="'model' axis")


def test_shard_shape_reference_agrees_with_jax(report):
    from course_lib.meshes import data_model_mesh

    mesh = data_model_mesh(report.devices, (4, 2))
    for shape, spec in [((8, 6), P(DATA)), ((8, 6), P(DATA, MODEL)), ((16, 4), P((DATA, MODEL))), ((8, 4), P(None, MODEL))]:
        want = NamedSharding(mesh, spec).shard_shape(shape)
        assert lesson05.reference_shard_shape(shape, spec, dict(mesh.shape)) == tuple(want)


def test_shard_shape():
    assert lesson05.check_shard_shape(lesson05.reference_shard_shape)

    def first_axis_only(shape, spec, mesh_shape):
        out = list(shape)
        for d, e in enumerate(tuple(spec)):
            if e is not None:
                out[d] //= mesh_shape[e[0] if isinstance(e, tuple) else e]
        return tuple(out)

    rejects(lesson05.check_shard_shape, first_axis_only, match="product of their sizes")

    def all_devices_on_dim0(shape, spec, mesh_shape):
        return (shape[0] // int(np.prod(list(mesh_shape.values()))),) + tuple(shape[1:])

    rejects(lesson05.check_shard_shape, all_devices_on_dim0, match="divide each dimension|not split")


def test_no_comm_placement(report):
    def good(x, w, mesh):
        return jax.device_put(x, NamedSharding(mesh, P(DATA, None))), jax.device_put(w, NamedSharding(mesh, P(None, MODEL)))

    assert lesson05.check_no_comm_placement(good, report.devices)

    def rows(x, w, mesh):
        return jax.device_put(x, NamedSharding(mesh, P(DATA, None))), jax.device_put(w, NamedSharding(mesh, P(MODEL, None)))

    rejects(lesson05.check_no_comm_placement, rows, report.devices, match="all-reduce")

    def x_replicated(x, w, mesh):
        return jax.device_put(x, NamedSharding(mesh, P())), jax.device_put(w, NamedSharding(mesh, P(None, MODEL)))

    rejects(lesson05.check_no_comm_placement, x_replicated, report.devices, match="batch is not split")

    def w_replicated(x, w, mesh):
        return jax.device_put(x, NamedSharding(mesh, P(DATA, None))), jax.device_put(w, NamedSharding(mesh, P()))

    rejects(lesson05.check_no_comm_placement, w_replicated, report.devices, match="columns are not split")


# ---- lesson 06: shard_map --------------------------------------------------------------------------------


def test_allreduce_mean(report):
    assert lesson06.check_allreduce_mean(lambda b, axis_name: lax.pmean(b.mean(), axis_name), report.devices)
    rejects(lesson06.check_allreduce_mean, lambda b, axis_name: b.mean(), report.devices, match="lax.pmean")
    rejects(lesson06.check_allreduce_mean, lambda b, axis_name: lax.psum(b.mean(), axis_name),
            report.devices, match="psum adds")


def test_ring_shift(report):
    def good(b, axis_name):
        n = lax.axis_size(axis_name)
        return lax.ppermute(b, axis_name, [(i, (i + 1) % n) for i in range(n)])

    assert lesson06.check_ring_shift(good, report.devices)

    def backwards(b, axis_name):
        n = lax.axis_size(axis_name)
        return lax.ppermute(b, axis_name, [((i + 1) % n, i) for i in range(n)])

    rejects(lesson06.check_ring_shift, backwards, report.devices, match="source, destination")
    rejects(lesson06.check_ring_shift, lambda b, axis_name: b, report.devices, match="nothing moved")


def test_dp_grad(report):
    def good(loss_fn, params, x, y, axis_name):
        return jax.grad(lambda p: lax.pmean(loss_fn(p, x, y), axis_name))(params)

    assert lesson06.check_dp_grad(good, report.devices)

    def article(loss_fn, params, x, y, axis_name):
        return lax.pmean(jax.grad(loss_fn)(params, x, y), axis_name)

    rejects(lesson06.check_dp_grad, article, report.devices, match="n_data× too large.*pmean'd")

    def local_only(loss_fn, params, x, y, axis_name):
        return jax.grad(loss_fn)(params, x, y)

    rejects(lesson06.check_dp_grad, local_only, report.devices, match="already sums")

    def summed_twice(loss_fn, params, x, y, axis_name):
        return lax.psum(jax.grad(loss_fn)(params, x, y), axis_name)

    rejects(lesson06.check_dp_grad, summed_twice, report.devices, match="differ from the single-device")


def test_row_parallel(report):
    assert lesson06.check_row_parallel(lambda xb, wb, axis_name: lax.psum(xb @ wb, axis_name), report.devices)
    rejects(lesson06.check_row_parallel, lambda xb, wb, axis_name: xb @ wb, report.devices, match="lax.psum")
    rejects(lesson06.check_row_parallel, lambda xb, wb, axis_name: lax.pmean(xb @ wb, axis_name),
            report.devices, match="too small")


# ---- lesson 07: debugging --------------------------------------------------------------------------------


def _poly_body(x, degree):
    out = jnp.zeros_like(x)
    for k in range(degree + 1):
        out = out + x**k
    return out


def test_static_poly():
    assert lesson07.check_static_poly(jax.jit(_poly_body, static_argnames="degree"))
    rejects(lesson07.check_static_poly, jax.jit(_poly_body), match="static_argnames='degree'")
    rejects(lesson07.check_static_poly, _poly_body, match="not jit-compiled")
    rejects(lesson07.check_static_poly, jax.jit(_poly_body, static_argnums=(0, 1)), match="not hashable")


def _sgd(params, grads):
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def test_donating_update():
    assert lesson07.check_donating_update(jax.jit(_sgd, donate_argnums=0))
    rejects(lesson07.check_donating_update, jax.jit(_sgd), match="donate_argnums=0")
    rejects(lesson07.check_donating_update, jax.jit(_sgd, donate_argnums=1), match="donated the gradients")
    rejects(lesson07.check_donating_update, _sgd, match="not jit-compiled")


def test_balance():
    def good(lengths, n_shards):
        order = np.argsort(lengths)[::-1]
        return np.concatenate([order[s::n_shards] for s in range(n_shards)])

    assert lesson07.check_balance(good)
    rejects(lesson07.check_balance, lambda lengths, n: np.argsort(lengths), match="round-robin")
    rejects(lesson07.check_balance, lambda lengths, n: np.arange(len(lengths)), match="round-robin")
    rejects(lesson07.check_balance, lambda lengths, n: np.sort(lengths), match="not a permutation")


# ---- the student version's stubs are rejected with a plain "not written yet" ------------------------------


def _stub(*args, **kwargs):
    raise NotImplementedError("Exercise: write this part")


@pytest.mark.parametrize(
    "check, needs_devices",
    [
        (lesson04.check_replicate, True),
        (lesson04.check_device_noise, True),
        (lesson04.check_data_parallel_grads, True),
        (lesson05.check_place_batch, True),
        (lesson05.check_shard_shape, False),
        (lesson05.check_no_comm_placement, True),
        (lesson06.check_allreduce_mean, True),
        (lesson06.check_ring_shift, True),
        (lesson06.check_dp_grad, True),
        (lesson06.check_row_parallel, True),
        (lesson07.check_balance, False),
    ],
)
def test_stub_is_not_written_yet(report, check, needs_devices):
    args = (_stub, report.devices) if needs_devices else (_stub,)
    rejects(check, *args, match="not written yet")

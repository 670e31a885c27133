"""Exercise checkers of lesson 04 (course_tools.checks.lesson04): each accepts the reference answer and
rejects typical wrong ones with a specific hint (8 simulated CPU devices, from conftest.py).
"""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from course_tools.checks import ExerciseError, lesson04


def rejects(check, *args, match):
    with pytest.raises(ExerciseError, match="(?s)" + match):
        check(*args)


def test_replicate(report):
    good = lambda tree, n: jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), tree)
    assert lesson04.check_replicate(good, report.devices)
    rejects(
        lesson04.check_replicate, lambda t, n: t, report.devices, match="no leading device axis"
    )
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
    wrong_name = lambda key, x, axis_name: (
        x + jax.random.normal(jax.random.fold_in(key, lax.axis_index("i")), x.shape)
    )
    rejects(lesson04.check_device_noise, wrong_name, report.devices, match="axis name passed in")
    noise_only = lambda key, x, axis_name: good(key, x, axis_name) - x
    rejects(lesson04.check_device_noise, noise_only, report.devices, match="plus the noise")


def test_data_parallel_grads(report):
    def good(loss_fn, params, batch, axis_name):
        return lax.pmean(jax.grad(loss_fn)(params, batch), axis_name)

    assert lesson04.check_data_parallel_grads(good, report.devices)
    local = lambda loss_fn, params, batch, axis_name: jax.grad(loss_fn)(params, batch)
    rejects(lesson04.check_data_parallel_grads, local, report.devices, match="lax.pmean")
    summed = lambda loss_fn, params, batch, axis_name: lax.psum(
        jax.grad(loss_fn)(params, batch), axis_name
    )
    rejects(
        lesson04.check_data_parallel_grads, summed, report.devices, match="too large.*psum adds"
    )


# ---- the student version's stubs are rejected with a plain "not written yet" ------------------------------


def _stub(*args, **kwargs):
    raise NotImplementedError("Exercise: write this part")


@pytest.mark.parametrize(
    "check, needs_devices",
    [
        (lesson04.check_replicate, True),
        (lesson04.check_device_noise, True),
        (lesson04.check_data_parallel_grads, True),
    ],
)
def test_stub_is_not_written_yet(report, check, needs_devices):
    args = (_stub, report.devices) if needs_devices else (_stub,)
    rejects(check, *args, match="not written yet")

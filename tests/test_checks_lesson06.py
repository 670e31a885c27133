"""Exercise checkers of lesson 06 (course_tools.checks.lesson06): each accepts the reference answer and
rejects typical wrong ones with a specific hint (8 simulated CPU devices, from conftest.py).
"""

import jax
import pytest
from jax import lax

from course_tools.checks import ExerciseError, lesson06


def rejects(check, *args, match):
    with pytest.raises(ExerciseError, match="(?s)" + match):
        check(*args)


def test_allreduce_mean(report):
    assert lesson06.check_allreduce_mean(
        lambda b, axis_name: lax.pmean(b.mean(), axis_name), report.devices
    )
    rejects(
        lesson06.check_allreduce_mean,
        lambda b, axis_name: b.mean(),
        report.devices,
        match="lax.pmean",
    )
    rejects(
        lesson06.check_allreduce_mean,
        lambda b, axis_name: lax.psum(b.mean(), axis_name),
        report.devices,
        match="psum adds",
    )


def test_ring_shift(report):
    def good(b, axis_name):
        n = lax.axis_size(axis_name)
        return lax.ppermute(b, axis_name, [(i, (i + 1) % n) for i in range(n)])

    assert lesson06.check_ring_shift(good, report.devices)

    def backwards(b, axis_name):
        n = lax.axis_size(axis_name)
        return lax.ppermute(b, axis_name, [((i + 1) % n, i) for i in range(n)])

    rejects(lesson06.check_ring_shift, backwards, report.devices, match="source, destination")
    rejects(
        lesson06.check_ring_shift, lambda b, axis_name: b, report.devices, match="nothing moved"
    )


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

    rejects(
        lesson06.check_dp_grad, summed_twice, report.devices, match="differ from the single-device"
    )


def test_row_parallel(report):
    assert lesson06.check_row_parallel(
        lambda xb, wb, axis_name: lax.psum(xb @ wb, axis_name), report.devices
    )
    rejects(
        lesson06.check_row_parallel,
        lambda xb, wb, axis_name: xb @ wb,
        report.devices,
        match="lax.psum",
    )
    rejects(
        lesson06.check_row_parallel,
        lambda xb, wb, axis_name: lax.pmean(xb @ wb, axis_name),
        report.devices,
        match="too small",
    )


# ---- the student version's stubs are rejected with a plain "not written yet" ------------------------------


def _stub(*args, **kwargs):
    raise NotImplementedError("Exercise: write this part")


@pytest.mark.parametrize(
    "check, needs_devices",
    [
        (lesson06.check_allreduce_mean, True),
        (lesson06.check_ring_shift, True),
        (lesson06.check_dp_grad, True),
        (lesson06.check_row_parallel, True),
    ],
)
def test_stub_is_not_written_yet(report, check, needs_devices):
    args = (_stub, report.devices) if needs_devices else (_stub,)
    rejects(check, *args, match="not written yet")

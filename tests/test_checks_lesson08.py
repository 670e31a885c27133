"""Exercise checkers of the lab (course_tools.checks.lesson08): each accepts the reference answer and other
correct forms, rejects typical wrong ones with a specific hint, and prints the hint for an unwritten stub."""

import jax
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from course_lib import steps
from course_tools.checks import ExerciseError, lesson08


def _dim(spec, axis):
    return tuple(spec).index(axis) if axis in tuple(spec) else None


def _slice(p, spec, axis):
    d = _dim(spec, axis)
    if d is None:
        return p
    size = p.shape[d] // lax.axis_size(axis)
    return lax.dynamic_slice_in_dim(p, lax.axis_index(axis) * size, size, axis=d)


def _gather(p, spec, axis):
    d = _dim(spec, axis)
    return p if d is None else lax.all_gather(p, axis, axis=d, tiled=True, to="invarying")


def _is_spec(x):
    return isinstance(x, P)


def make_zero1(reduce="scatter", vary=True, divide=True, gather=True):
    """The reference ZeRO-1 body, or one of its typical mistakes."""

    def body(state, batch, *, apply_fn, optimizer, specs, axis_name):
        images, labels = batch
        n = lax.axis_size(axis_name)
        params = lax.pcast(state.params, axis_name, to="varying") if vary else state.params
        loss, grads = jax.value_and_grad(
            lambda p: steps.cross_entropy(apply_fn(p, images), labels)
        )(params)

        def my_grad(g, spec):
            d = _dim(spec, axis_name)
            if d is None:
                return lax.pmean(g, axis_name) if vary else g
            if reduce == "allreduce":
                return _slice(lax.pmean(g, axis_name), spec, axis_name)
            g = lax.psum_scatter(g, axis_name, scatter_dimension=d, tiled=True)
            return g / n if divide else g

        g = jax.tree.map(my_grad, grads, specs, is_leaf=_is_spec)
        mine = jax.tree.map(
            lambda p, s: _slice(p, s, axis_name), state.params, specs, is_leaf=_is_spec
        )
        updates, opt_state = optimizer.update(g, state.opt_state, mine)
        new = optax.apply_updates(mine, updates)
        if gather:
            new = jax.tree.map(lambda p, s: _gather(p, s, axis_name), new, specs, is_leaf=_is_spec)
        return steps.TrainState(new, opt_state), {"loss": lax.pmean(loss, axis_name)}

    return body


def loss_scaled_zero1(state, batch, *, apply_fn, optimizer, specs, axis_name):
    """Another correct form: differentiate loss / n and reduce-scatter the sum (no division after)."""
    images, labels = batch
    n = lax.axis_size(axis_name)
    params = lax.pcast(state.params, axis_name, to="varying")
    loss, grads = jax.value_and_grad(
        lambda p: steps.cross_entropy(apply_fn(p, images), labels) / n
    )(params)

    def my_grad(g, spec):
        d = _dim(spec, axis_name)
        if d is None:
            return lax.psum(g, axis_name)
        return lax.psum_scatter(g, axis_name, scatter_dimension=d, tiled=True)

    g = jax.tree.map(my_grad, grads, specs, is_leaf=_is_spec)
    mine = jax.tree.map(lambda p, s: _slice(p, s, axis_name), state.params, specs, is_leaf=_is_spec)
    updates, opt_state = optimizer.update(g, state.opt_state, mine)
    new = jax.tree.map(
        lambda p, s: _gather(p, s, axis_name),
        optax.apply_updates(mine, updates),
        specs,
        is_leaf=_is_spec,
    )
    return steps.TrainState(new, opt_state), {"loss": lax.psum(loss, axis_name)}


def rejects(check, *args, match):
    with pytest.raises(ExerciseError, match="(?s)" + match):
        check(*args)


def test_zero1_accepts_the_reference_and_another_form(report):
    assert lesson08.check_zero1(make_zero1(), report.devices)
    assert lesson08.check_zero1(loss_scaled_zero1, report.devices[:4])


def test_zero1_rejects_typical_mistakes(report):
    rejects(
        lesson08.check_zero1,
        make_zero1(reduce="allreduce"),
        report.devices[:4],
        match="psum_scatter gives each",
    )
    rejects(
        lesson08.check_zero1, make_zero1(divide=False), report.devices[:4], match="4x too large"
    )
    rejects(
        lesson08.check_zero1,
        make_zero1(vary=False),
        report.devices[:4],
        match="too large|pcast|refused",
    )
    rejects(
        lesson08.check_zero1,
        make_zero1(gather=False),
        report.devices[:4],
        match="all_gather each updated",
    )


def test_zero1_stub_prints_its_hint(report, capsys, monkeypatch):
    monkeypatch.delenv("COURSE_STRICT_CHECKS", raising=False)

    def stub(state, batch, **kw):
        raise NotImplementedError("Exercise: write this part")

    assert lesson08.check_zero1(stub, report.devices) is False
    out = capsys.readouterr().out
    assert "not written yet" in out and "hint:" in out


ROW = {
    "collective_bytes_per_device": 1_321_677.0,
    "param_bytes_per_device": 94_440,
    "opt_state_bytes_per_device": 94_440,
    "n_devices": 8,
}
P_BYTES = 755_240


def test_fsdp_prediction():
    n = 8
    right_sent = 2 * (n - 1) / n * P_BYTES
    right_state = 2 * P_BYTES / n
    assert lesson08.check_fsdp_prediction(right_sent, right_state, ROW)
    assert lesson08.check_fsdp_prediction(right_sent * 1.02, right_state, ROW)  # within 5 %
    rejects(
        lesson08.check_fsdp_prediction,
        2 * right_sent,
        right_state,
        ROW,
        match="does not all-reduce",
    )
    rejects(
        lesson08.check_fsdp_prediction,
        right_sent / 2,
        right_state,
        ROW,
        match="backward pass sends too",
    )
    rejects(
        lesson08.check_fsdp_prediction, 2 * P_BYTES, right_state, ROW, match="keeps its own block"
    )
    rejects(lesson08.check_fsdp_prediction, right_sent, P_BYTES / n, ROW, match="momentum")
    rejects(lesson08.check_fsdp_prediction, right_sent, 2 * P_BYTES, ROW, match="shards both")


def test_fsdp_prediction_left_unwritten_prints_its_hint(capsys, monkeypatch):
    monkeypatch.delenv("COURSE_STRICT_CHECKS", raising=False)
    assert lesson08.check_fsdp_prediction(None, None, ROW) is False
    assert "not written yet" in capsys.readouterr().out

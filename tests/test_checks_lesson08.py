"""Exercise checkers of the lab (course_tools.checks.lesson08): each accepts the reference answer and other
correct forms, rejects typical wrong ones with a specific hint, and prints the hint for an unwritten stub."""

from functools import partial

import jax
import jax.numpy as jnp
import optax
import pytest
from checking import rejects
from jax import lax
from jax.sharding import PartitionSpec as P

from course_lib import steps
from course_tools.checks import ExerciseError, lesson08
from course_tools.checks._common import NotJudged


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


def _opt_map(fn, opt_state, specs):
    """``fn(leaf, spec)`` on every optimizer-state leaf that mirrors a parameter (its path ends in the
    parameter's path), whatever optimizer built the state."""
    flat = [
        (tuple(str(k) for k in path), spec)
        for path, spec in jax.tree_util.tree_leaves_with_path(specs, is_leaf=_is_spec)
    ]

    def one(path, leaf):
        keys = tuple(str(k) for k in path)
        for ppath, spec in flat:
            if keys[-len(ppath) :] == ppath:
                return fn(leaf, spec)
        return leaf

    return jax.tree_util.tree_map_with_path(one, opt_state)


def make_zero2(
    reduce="scatter", vary=True, divide=True, gather=True, update_params="slices", bf16=False
):
    """The reference ZeRO-2 body, or one of its typical mistakes."""

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
            g = g / n if divide else g
            return g.astype(jnp.bfloat16).astype(g.dtype) if bf16 else g  # a slice rounded

        g = jax.tree.map(my_grad, grads, specs, is_leaf=_is_spec)
        mine = jax.tree.map(
            lambda p, s: _slice(p, s, axis_name), state.params, specs, is_leaf=_is_spec
        )
        zeros = jax.tree.map(lambda p: p * 0, mine)
        whole_zeros = jax.tree.map(  # zeros for the leaves kept whole (P()) only
            lambda p, s: p * 0 if _dim(s, axis_name) is None else p, mine, specs, is_leaf=_is_spec
        )
        given = {"slices": mine, "whole": state.params, "none": None, "zeros": zeros,
                 "zeros for whole leaves": whole_zeros}[update_params]  # fmt: skip
        updates, opt_state = optimizer.update(g, state.opt_state, given)
        new = optax.apply_updates(mine, updates)
        if gather:
            new = jax.tree.map(lambda p, s: _gather(p, s, axis_name), new, specs, is_leaf=_is_spec)
        return steps.TrainState(new, opt_state), {"loss": lax.pmean(loss, axis_name)}

    return body


def loss_scaled_zero2(state, batch, *, apply_fn, optimizer, specs, axis_name):
    """Another correct form: differentiate loss / n and reduce-scatter the sum (no division after)."""
    return _zero2_of_loss(state, batch, apply_fn, optimizer, specs, axis_name, scale=True)


def loss_summed_zero2(state, batch, *, apply_fn, optimizer, specs, axis_name):
    """Wrong: the loss not divided by n, so the reduce-scattered gradients are n times the mean (right on
    one device)."""
    return _zero2_of_loss(state, batch, apply_fn, optimizer, specs, axis_name, scale=False)


def _zero2_of_loss(state, batch, apply_fn, optimizer, specs, axis_name, scale):
    images, labels = batch
    n = lax.axis_size(axis_name) if scale else 1
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


def test_zero2_accepts_the_reference_and_another_form(report):
    assert lesson08.check_zero2(make_zero2(), report.devices)
    assert lesson08.check_zero2(loss_scaled_zero2, report.devices[:4])


def test_zero2_rejects_typical_mistakes(report):
    rejects(
        lesson08.check_zero2,
        make_zero2(reduce="allreduce"),
        report.devices[:4],
        match="psum_scatter gives each",
    )
    rejects(
        lesson08.check_zero2, make_zero2(divide=False), report.devices[:4], match="4x too large"
    )
    rejects(
        lesson08.check_zero2,
        make_zero2(vary=False),
        report.devices[:4],
        match="too large|pcast|refused",
    )
    rejects(
        lesson08.check_zero2,
        make_zero2(gather=False),
        report.devices[:4],
        match="all_gather each updated",
    )


def test_zero2_refuses_the_whole_parameters_handed_to_the_optimizer(report):
    # optax.sgd ignores its params argument, so this once passed; the checker's weight decay reads them
    rejects(
        lesson08.check_zero2,
        make_zero2(update_params="whole"),
        report.devices[:4],
        match="does not match.*slices of the gradients and of the parameters",
    )
    rejects(
        lesson08.check_zero2,
        make_zero2(update_params="none"),
        report.devices[:4],
        match="needs the parameters.*third argument",
    )
    # D6: zeros for the parameters leave out weight decay: the hint names the parameters, not the state
    rejects(
        lesson08.check_zero2,
        make_zero2(update_params="zeros"),
        report.devices[:4],
        match="(?s)momentum.*lacks the weight decay.*parameter slices as optimizer.update's third",
    )


def test_zero2_stub_prints_its_hint(report, capsys, monkeypatch):
    monkeypatch.delenv("COURSE_STRICT_CHECKS", raising=False)

    def stub(state, batch, **kw):
        raise NotImplementedError("Exercise: write this part")

    assert lesson08.check_zero2(stub, report.devices) is False
    out = capsys.readouterr().out
    assert "not written yet" in out and "hint:" in out


def gather_everything_zero2(state, batch, *, apply_fn, optimizer, specs, axis_name):
    """Parity holds, but no ZeRO-2 saving: gradients and momentum all-gathered, the full update on every
    device, the momentum sliced back (1.5x B's bytes)."""
    images, labels = batch
    n = lax.axis_size(axis_name)
    params = lax.pcast(state.params, axis_name, to="varying")
    loss, grads = jax.value_and_grad(lambda p: steps.cross_entropy(apply_fn(p, images), labels))(
        params
    )

    def full_grad(g, spec):
        d = _dim(spec, axis_name)
        if d is None:
            return lax.pmean(g, axis_name)
        return _gather(
            lax.psum_scatter(g, axis_name, scatter_dimension=d, tiled=True) / n, spec, axis_name
        )

    g = jax.tree.map(full_grad, grads, specs, is_leaf=_is_spec)
    full_opt = _opt_map(lambda m, s: _gather(m, s, axis_name), state.opt_state, specs)
    updates, opt_state = optimizer.update(g, full_opt, state.params)
    opt_state = _opt_map(lambda m, s: _slice(m, s, axis_name), opt_state, specs)
    new = optax.apply_updates(state.params, updates)
    return steps.TrainState(new, opt_state), {"loss": lax.pmean(loss, axis_name)}


def test_zero2_rejects_gathering_gradients_and_momentum(report):
    rejects(
        lesson08.check_zero2,
        gather_everything_zero2,
        report.devices[:4],
        match="all-gathers .* bytes; the sharded parameters.*gradients and momentum stay sharded",
    )


def _zero2_variant(state, batch, apply_fn, optimizer, specs, axis_name, whole_local, n_written):
    images, labels = batch
    n = n_written or lax.axis_size(axis_name)
    params = lax.pcast(state.params, axis_name, to="varying")
    loss, grads = jax.value_and_grad(lambda p: steps.cross_entropy(apply_fn(p, images), labels))(
        params
    )

    def my_grad(g, spec):
        d = _dim(spec, axis_name)
        if d is None:
            return g if whole_local else lax.pmean(g, axis_name)
        return lax.psum_scatter(g, axis_name, scatter_dimension=d, tiled=True) / n

    def my_slice(p, spec):
        d = _dim(spec, axis_name)
        if d is None:
            return p
        size = p.shape[d] // n
        return lax.dynamic_slice_in_dim(p, lax.axis_index(axis_name) * size, size, axis=d)

    g = jax.tree.map(my_grad, grads, specs, is_leaf=_is_spec)
    mine = jax.tree.map(my_slice, state.params, specs, is_leaf=_is_spec)
    updates, opt_state = optimizer.update(g, state.opt_state, mine)
    new = jax.tree.map(
        lambda p, s: (
            lax.pmean(p, axis_name) if _dim(s, axis_name) is None else _gather(p, s, axis_name)
        ),
        optax.apply_updates(mine, updates),
        specs,
        is_leaf=_is_spec,
    )
    return steps.TrainState(new, opt_state), {"loss": lax.pmean(loss, axis_name)}


def whole_leaves_local_zero2(state, batch, *, apply_fn, optimizer, specs, axis_name):
    """Wrong: a whole leaf's momentum from this device's own gradient (its parameters averaged after)."""
    return _zero2_variant(state, batch, apply_fn, optimizer, specs, axis_name, True, None)


def eight_written_in_zero2(state, batch, *, apply_fn, optimizer, specs, axis_name):
    """Wrong: the device count written in (8), not read from the mesh."""
    return _zero2_variant(state, batch, apply_fn, optimizer, specs, axis_name, False, 8)


def test_zero2_hints_name_what_is_wrong(report):
    # shard_map refuses the momentum of a leaf kept whole: the hint names the optimizer state, not the
    # parameters' all_gather or the loss (both right in this answer)
    with pytest.raises(ExerciseError) as e:
        lesson08.check_zero2(whole_leaves_local_zero2, report.devices[:4])
    text = str(e.value)
    assert "out_specs[0].opt_state" in text and "mean of the devices' gradients" in text, text
    assert "all_gather each updated" not in text and "lax.pmean it" not in text, text
    # the parameters left unsliced still get the all_gather hint
    rejects(
        lesson08.check_zero2,
        make_zero2(gather=False),
        report.devices[:4],
        match="out_specs\\[0\\].params.*all_gather each updated",
    )
    # on 4 devices the slices of a count written in do not fit the state: the hint says where n comes from
    rejects(
        lesson08.check_zero2,
        eight_written_in_zero2,
        report.devices[:4],
        match="does not match.*lax.axis_size\\(axis_name\\) long.*not written in",
    )


def gathered_in_bfloat16_zero2(state, batch, *, apply_fn, optimizer, specs, axis_name):
    """Wrong: the updated slices all-gathered in bfloat16 (the parameters rounded), cast back."""
    images, labels = batch
    n = lax.axis_size(axis_name)
    params = lax.pcast(state.params, axis_name, to="varying")
    loss, grads = jax.value_and_grad(lambda p: steps.cross_entropy(apply_fn(p, images), labels))(
        params
    )

    def my_grad(g, spec):
        d = _dim(spec, axis_name)
        if d is None:
            return lax.pmean(g, axis_name)
        return lax.psum_scatter(g, axis_name, scatter_dimension=d, tiled=True) / n

    def put(p, spec):
        d = _dim(spec, axis_name)
        if d is None:
            return p
        q = lax.all_gather(p.astype(jnp.bfloat16), axis_name, axis=d, tiled=True, to="invarying")
        return q.astype(p.dtype)

    g = jax.tree.map(my_grad, grads, specs, is_leaf=_is_spec)
    mine = jax.tree.map(lambda p, s: _slice(p, s, axis_name), state.params, specs, is_leaf=_is_spec)
    updates, opt_state = optimizer.update(g, state.opt_state, mine)
    new = jax.tree.map(put, optax.apply_updates(mine, updates), specs, is_leaf=_is_spec)
    return steps.TrainState(new, opt_state), {"loss": lax.pmean(loss, axis_name)}


def test_zero2_bfloat16_gather_hint_speaks_of_the_parameters(report):
    # an all-gather reduces nothing: its hint names what it rounds, the parameters it rebuilds
    rejects(
        lesson08.check_zero2,
        gathered_in_bfloat16_zero2,
        report.devices[:4],
        match="all-gather in bfloat16.*an all-gather, the parameters it rebuilds",
    )


def test_zero2_on_one_device_says_it_cannot_judge_a_closure(report, capsys, monkeypatch):
    """One device hides ZeRO-2's mistakes (its slice is the whole), and a body made inside a function
    cannot be sent to a process with 8 devices: no ✓, and how to have it judged (a body written at a
    cell's top level is judged there: tests/test_checks_devices.py)."""
    monkeypatch.delenv("COURSE_STRICT_CHECKS", raising=False)
    assert lesson08.check_zero2(make_zero2(divide=False), report.devices[:1]) is False
    out = capsys.readouterr().out
    assert "✓" not in out and "✗ not judged: this run has 1 device, too few" in out, out
    assert (
        "the answer (body) is a lambda or a nested function" in out
        and "n_devices=8, platform='cpu'" in out
    ), out
    monkeypatch.setenv("COURSE_STRICT_CHECKS", "1")  # as the suite runs the solution notebooks
    with pytest.raises(NotJudged, match="not judged"):
        lesson08.check_zero2(make_zero2(), report.devices[:1])


def sent_right(param_bytes, replicated_bytes, n):
    return 2 * (n - 1) / n * (param_bytes + 4)


def state_right(param_bytes, replicated_bytes, n):
    return 2 * ((param_bytes - replicated_bytes) / n + replicated_bytes)


def sent_per_collective(param_bytes, replicated_bytes, n):
    """Another correct form, per collective, the loss's 4 bytes left out."""
    sharded = param_bytes - replicated_bytes
    return 2 * (n - 1) / n * sharded + 2 * (n - 1) / n * replicated_bytes


ROW = {  # E measured on 8 devices at the cpu profile
    "profile": "cpu",
    "precision": "float32",
    "collective_bytes_per_device": 1_321_677.0,
    "param_bytes_per_device": 94_440,
    "opt_state_bytes_per_device": 94_440,
    "n_devices": 8,
}


def test_fsdp_prediction_accepts_correct_functions():
    assert lesson08.check_fsdp_prediction(sent_right, state_right, ROW)
    assert lesson08.check_fsdp_prediction(sent_per_collective, state_right)
    float64 = {  # 8-byte gradients and state: a float32 formula scaled by the checker, not refused
        **ROW,
        "precision": "float64",
        "collective_bytes_per_device": 2 * 1_321_677.0 - 7,
        "param_bytes_per_device": 2 * 94_440,
        "opt_state_bytes_per_device": 2 * 94_440,
    }
    assert lesson08.check_fsdp_prediction(sent_right, state_right, float64)


def test_fsdp_prediction_rejects_typical_mistakes():
    check = lesson08.check_fsdp_prediction
    rejects(check, lambda p, r, n: 2 * sent_right(p, r, n), state_right, match="sends .* once")
    rejects(check, lambda p, r, n: (n - 1) / n * p, state_right, match="backward pass sends too")
    rejects(check, lambda p, r, n: 2 * p, state_right, match="keeps its own block")
    # ZeRO-3's count (a second all-gather per leaf for the backward pass): E gathers once
    rejects(check, lambda p, r, n: 3 * (n - 1) / n * p, state_right, match="ZeRO-3's re-gather")
    rejects(check, sent_right, lambda p, r, n: p / n + r, match="momentum")
    rejects(check, sent_right, lambda p, r, n: 2 * p, match="shards both")
    # the state ignoring the leaves kept whole, and the parameters without their momentum (the review's)
    rejects(check, sent_right, lambda p, r, n: 2 * p / n, match="held whole on every device")
    rejects(check, sent_right, lambda p, r, n: (p - r) / n + r, match="momentum")


def test_fsdp_prediction_says_how_many_cases_are_wrong_not_which():
    check = lesson08.check_fsdp_prediction
    with pytest.raises(ExerciseError) as e:  # 2 P / n is right at n = 2 only
        check(lambda p, r, n: 2 * p / n, state_right, seed=0)
    text = str(e.value)
    assert "wrong in 6 of 8 cases" in text  # seed 0: right at the shown n = 2 and one drawn n = 2
    # neither the cases nor the true values are named, and the hint does not give the formula away
    for case in (lesson08.fsdp_case(p, n) for p, n in lesson08.FSDP_CASES):
        assert f"{case['sent']:,.0f}" not in text and f"{case['sent']:.0f}" not in text
    assert "devices (param_bytes" not in text and "2(n-1)/n" not in text and "(n-1)/n" not in text
    with pytest.raises(ExerciseError) as e:
        check(sent_right, lambda p, r, n: 2 * p / n)  # right where nothing stays whole
    assert "of 8 cases" in str(e.value) and "sharded bytes / n" not in str(e.value)


def test_fsdp_prediction_holds_at_one_device():
    # right at every n >= 2, wrong at n = 1 (the momentum forgotten there): the drawn cases start at 2
    def state_one_off(p, r, n):
        return state_right(p, r, n) if n > 1 else p

    rejects(
        lesson08.check_fsdp_prediction,
        sent_right,
        state_one_off,
        match="on one device \\(n = 1\\).*every n, 1 included",
    )
    assert lesson08.check_fsdp_prediction(sent_right, state_right)


def test_fsdp_prediction_refuses_answers_that_only_fit_one_run():
    check = lesson08.check_fsdp_prediction
    measured = ROW["collective_bytes_per_device"]  # the measurement copied in as the prediction
    rejects(check, lambda p, r, n: measured, state_right, ROW, match="wrong in [4-8] of 8 cases")
    # the replicated leaves matter at 3 devices (70 % of the cpu profile's bytes stay whole)
    rejects(check, sent_right, lambda p, r, n: 2 * p / n, match="wrong in [1-7] of 8 cases")
    # a run whose measurement the functions do not fit is named as such, not as a wrong formula
    odd = {**ROW, "collective_bytes_per_device": 1.5 * measured}
    rejects(
        check, sent_right, state_right, odd, match="right at the checker's cases but more than 5 %"
    )


def test_fsdp_prediction_left_unwritten_prints_its_hint(capsys, monkeypatch):
    monkeypatch.delenv("COURSE_STRICT_CHECKS", raising=False)

    def stub(param_bytes, replicated_bytes, n):
        raise NotImplementedError("Exercise: write this part")

    assert lesson08.check_fsdp_prediction(stub, stub, ROW) is False
    out = capsys.readouterr().out
    assert "not written yet" in out and "hint:" in out


def test_fsdp_prediction_refuses_a_table_of_the_shown_cases():
    # fsdp_case is public and returns the true values of every case the notebook shows; the checker also
    # draws CNNs and device counts of its own at every call, where a table has no answer
    table = {}
    for profile, n in lesson08.FSDP_CASES:
        c = lesson08.fsdp_case(profile, n)
        table[(c["param_bytes"], c["replicated_bytes"], n)] = c

    def sent(p, r, n):
        return table.get((p, r, n), {"sent": 2 * p})["sent"]

    def state(p, r, n):
        return table.get((p, r, n), {"state": 2 * p})["state"]

    for seed in (0, 1, None):
        check = partial(lesson08.check_fsdp_prediction, seed=seed)
        rejects(check, sent, state, ROW, match="wrong in [1-3] of 8")


def test_fsdp_prediction_draws_other_cases_at_every_call():
    assert lesson08.check_fsdp_prediction(sent_right, state_right, ROW, seed=None)
    assert lesson08.check_fsdp_prediction(sent_per_collective, state_right, seed=3)


def zero2_variant(
    *,
    replicated="pmean",
    n_fixed=None,
    keep_opt_state=False,
    grad_dtype=None,
    gather="all_gather",
    index=None,
):
    """The reference body with one mistake: n baked in, the old optimizer state returned, gradients
    reduced in another dtype, the updated slices summed by a psum instead of all-gathered, or the
    parameters sliced at another device's offset."""
    import jax.numpy as jnp

    def body(state, batch, *, apply_fn, optimizer, specs, axis_name):
        images, labels = batch
        n = n_fixed or lax.axis_size(axis_name)
        me = lax.axis_index(axis_name) if index is None else index(lax.axis_index(axis_name), n)
        params = lax.pcast(state.params, axis_name, to="varying")
        loss, grads = jax.value_and_grad(
            lambda p: steps.cross_entropy(apply_fn(p, images), labels)
        )(params)

        def cut(x, d):
            size = x.shape[d] // n
            return lax.dynamic_slice_in_dim(x, me * size, size, axis=d)

        def my_grad(g, spec):
            d = _dim(spec, axis_name)
            g = g if grad_dtype is None else g.astype(grad_dtype)
            if d is None:
                whole = lax.pmean if replicated == "pmean" else lax.psum
                return whole(g, axis_name).astype(jnp.float32)
            return (lax.psum_scatter(g, axis_name, scatter_dimension=d, tiled=True) / n).astype(
                jnp.float32
            )

        def put(p, spec):
            d = _dim(spec, axis_name)
            if d is None:
                return p
            if gather == "all_gather":
                return lax.all_gather(p, axis_name, axis=d, tiled=True, to="invarying")
            full = list(p.shape)
            full[d] *= n
            padded = lax.dynamic_update_slice_in_dim(
                jnp.zeros(full, p.dtype), p, me * p.shape[d], axis=d
            )
            return lax.psum(padded, axis_name)

        def mine_of(p, spec):
            d = _dim(spec, axis_name)
            return p if d is None else cut(p, d)

        g = jax.tree.map(my_grad, grads, specs, is_leaf=_is_spec)
        mine = jax.tree.map(mine_of, state.params, specs, is_leaf=_is_spec)
        updates, opt_state = optimizer.update(g, state.opt_state, mine)
        new = jax.tree.map(put, optax.apply_updates(mine, updates), specs, is_leaf=_is_spec)
        if keep_opt_state:
            opt_state = state.opt_state
        return steps.TrainState(new, opt_state), {"loss": lax.pmean(loss, axis_name)}

    return body


def test_zero2_refuses_what_only_the_parameters_hide(report):
    # each was accepted by a checker that compared the parameters only, at the run's device count only,
    # and read the compiled program, where XLA:CPU promotes bfloat16 reductions to float32
    rejects(
        lesson08.check_zero2,
        zero2_variant(keep_opt_state=True),
        report.devices[:4],
        match="parameters are right, but the new momentum of .*optimizer state that optimizer.update",
    )
    rejects(
        lesson08.check_zero2,
        zero2_variant(grad_dtype=jax.numpy.bfloat16),
        report.devices[:4],
        match="reduce-scatter in bfloat16.*rounds what it carries",
    )
    rejects(
        lesson08.check_zero2,
        zero2_variant(n_fixed=len(report.devices)),
        report.devices,
        match=rf"on {len(report.devices) // 2} device\(s\): a shape does not match",
    )


def test_zero2_hints_name_what_the_numbers_show(report):
    four = report.devices[:4]
    # the updated slices summed by a psum: the gradients were reduce-scattered, the gather is the all-reduce
    rejects(
        lesson08.check_zero2,
        zero2_variant(gather="psum"),
        four,
        match="gradients are reduce-scattered, and the program also all-reduces.*needs no sum",
    )
    # slices at the next device's offset: no "n x too large" (the update is not a multiple of the right one)
    with pytest.raises(ExerciseError) as e:
        lesson08.check_zero2(zero2_variant(index=lambda i, n: (i + 1) % n), four)
    assert "too large" not in str(e.value) and "its own block" in str(e.value)
    # dense2's bias is kept whole at 4 devices: its psum'ed gradient is named, not the reduce-scatter
    rejects(
        lesson08.check_zero2,
        zero2_variant(replicated="psum"),
        four,
        match="update of dense2/bias.*dense2/bias is kept whole.*mean of the devices' gradients",
    )


# ---- exercise 2: E's critical batch on a fabric ------------------------------------------------------


def critical_ref(flops, hbm, leaf_bytes, n, fabric):
    link = fabric.link
    ways = 2 if link.topology == "ring" else 1
    comm = sum(
        2 * ((n - 1) * link.latency_s + (n - 1) / n * s / (ways * link.bytes_per_s))
        for s in leaf_bytes
    )
    per_image = max(flops / (fabric.chip.bf16 * 1e12), hbm / fabric.chip.hbm_bytes_per_s)
    return comm / per_image


def critical_other_form(flops, hbm, leaf_bytes, n, fabric):
    # latency and bandwidth summed apart over the leaves, the roofline's rates per image inverted
    if n == 1:
        return 0
    bw = fabric.link.bytes_per_s * (2 if fabric.link.topology == "ring" else 1)
    latency = 2 * len(leaf_bytes) * (n - 1) * fabric.link.latency_s
    gather_and_scatter = latency + 2 * (n - 1) * sum(leaf_bytes) / (n * bw)
    images_per_s = min(fabric.chip.bf16 * 1e12 / flops, fabric.chip.hbm_bytes_per_s / hbm)
    return gather_and_scatter * images_per_s


def _fake_fsdp_run(precision="float32", n=8, batch=8):
    """A run of E as the checker reads it: the cpu profile's gathers and reduce-scatters and the loss's
    all-reduce, per-device numbers."""
    import types

    import numpy as np

    from course_lib import comms
    from course_lib.config import PROFILES

    shapes = comms.param_shapes(PROFILES["cpu"].model)
    transfers = []
    for layer in shapes.values():
        for shape in layer.values():
            size = 4 * int(np.prod(shape))
            for kind, dims in (
                ("all-gather", shape),
                ("reduce-scatter", shape[:-1] + (shape[-1] // n,)),
            ):
                transfers.append(comms.Collective(kind, ("data",), n, (("f32", tuple(dims)),), size,
                                                  comms.ring_bytes(kind, size, n), kind))  # fmt: skip
    transfers.append(comms.Collective("all-reduce", ("data",), n, (("f32", ()),), 4,
                                      comms.ring_bytes("all-reduce", 4, n), "loss"))  # fmt: skip
    stats = types.SimpleNamespace(
        flops_per_device=3.4e8, bytes_accessed=5.7e7, transfers=tuple(transfers)
    )
    row = {"n_devices": n, "local_batch": batch, "device_kind": "cpu", "platform": "cpu",
           "precision": precision, "profile": "cpu"}  # fmt: skip
    leaves = [4 * int(np.prod(s)) for layer in shapes.values() for s in layer.values()]
    return types.SimpleNamespace(row=row, stats=stats), leaves


def test_fsdp_critical_batch_accepts_correct_forms(capsys):
    assert lesson08.check_fsdp_critical_batch(critical_ref)
    assert lesson08.check_fsdp_critical_batch(critical_other_form)
    run, _ = _fake_fsdp_run()
    assert lesson08.check_fsdp_critical_batch(critical_ref, run)
    out = capsys.readouterr().out
    assert "this run's E" in out and "α included" in out
    # a bfloat16 run's gathers are read at their own bytes: compared too
    run16, _ = _fake_fsdp_run("bfloat16")
    assert lesson08.check_fsdp_critical_batch(critical_other_form, run16)
    assert "this run's E" in capsys.readouterr().out


def test_fsdp_critical_batch_is_the_lab_model_at_the_run():
    """The reference at a run's gathers equals the library's critical batch of those collectives."""
    from course_lib import costs, lab_time

    run, leaves = _fake_fsdp_run()
    _, fabric, _ = lab_time.fabric_for("cpu", "cpu")
    moved = [t for t in run.stats.transfers if t.kind != "all-reduce"]
    b = run.row["local_batch"]
    lab = costs.critical_batch(
        b, run.stats.flops_per_device, run.stats.bytes_accessed, moved, fabric, "bfloat16"
    )
    mine = critical_ref(
        run.stats.flops_per_device / b, run.stats.bytes_accessed / b, leaves, 8, fabric
    )
    assert abs(mine / lab - 1) < 1e-9


def test_fsdp_critical_batch_not_written(monkeypatch, capsys):
    from checking import not_written

    def stub(*args):
        raise NotImplementedError("Exercise: write this part")

    not_written(lesson08.check_fsdp_critical_batch, stub, monkeypatch=monkeypatch, capsys=capsys)


def test_fsdp_critical_batch_wrong_answers():
    import dataclasses

    from course_lib import costs

    def with_link(**fields):
        return lambda f, h, p, n, fab: critical_ref(
            f, h, p, n, dataclasses.replace(fab, link=dataclasses.replace(fab.link, **fields))
        )

    def latency_steps(steps):  # α counted `steps(n)` times per collective instead of n - 1
        def answer(f, h, p, n, fab):
            extra = 2 * len(p) * (steps(n) - (n - 1)) * fab.link.latency_s
            per_image = max(f / (fab.chip.bf16 * 1e12), h / fab.chip.hbm_bytes_per_s)
            return critical_ref(f, h, p, n, fab) + (extra / per_image if n > 1 else 0)

        return answer

    cases = {
        # the latency left out: the previous exercise's bandwidth-only answer
        "latency α": with_link(latency_s=0.0),
        # α once per collective
        "n − 1 steps, and each step pays α": latency_steps(lambda n: 1),
        # an all-reduce's step count
        "2\\(n − 1\\) is an all-reduce": latency_steps(lambda n: 2 * (n - 1)),
        # one gather and one scatter for the whole tree
        "each leaf apart": lambda f, h, p, n, fab: critical_ref(f, h, [sum(p)], n, fab),
        # FLOPs only: the HBM term forgotten
        "roofline": lambda f, h, p, n, fab: critical_ref(f, 0, p, n, fab),
        # a ring taken as one direction
        "carries data both ways": with_link(topology="switch"),
        # only the all-gather
        "both directions of the step": lambda f, h, p, n, fab: critical_ref(f, h, p, n, fab) / 2,
        # ZeRO-3's re-gather counted
        "second all-gather": lambda f, h, p, n, fab: 1.5 * critical_ref(f, h, p, n, fab),
        # the global batch
        "ONE device's batch": lambda f, h, p, n, fab: n * critical_ref(f, h, p, n, fab),
        # bfloat16 parameters assumed: no single typical mistake, the hint names the parts, not a formula
        "communication time = for each leaf": lambda f, h, p, n, fab: (
            critical_ref(f, h, [s / 2 for s in p], n, fab) + (n == 2)
        ),
        "return a number": lambda f, h, p, n, fab: str(critical_ref(f, h, p, n, fab)),
        "one device sends nothing": lambda f, h, p, n, fab: critical_ref(f, h, p, max(n, 2), fab),
    }
    for hint, answer in cases.items():
        rejects(lesson08.check_fsdp_critical_batch, answer, match=hint)
    library = lambda f, h, p, n, fab: costs.critical_batch(  # noqa: E731
        1, f, h, [comms_transfer("all-reduce", n, sum(p))], fab, "bfloat16"
    )
    rejects(lesson08.check_fsdp_critical_batch, library, match="do not call the costs module")


def test_fsdp_critical_batch_red_team_answers():
    """Answers a learner wrote from the notebook's text: each refused with a hint true of its mistake."""
    import dataclasses

    from course_lib import costs

    def both_ways_everywhere(f, h, p, n, fab):  # a switch's link taken as both directions too
        return critical_ref(
            f,
            h,
            p,
            n,
            dataclasses.replace(fab, link=dataclasses.replace(fab.link, topology="ring")),
        )

    rejects(
        lesson08.check_fsdp_critical_batch,
        both_ways_everywhere,
        match="only a ring .*through a switch",
    )

    def with_collective_time(
        f, h, p, n, fab
    ):  # the library's collective times: named by their own module
        comm = sum(
            costs.collective_time(k, n, s, fab.link)
            for k in ("all-gather", "reduce-scatter")
            for s in p
        )
        return comm / max(f / (fab.chip.bf16 * 1e12), h / fab.chip.hbm_bytes_per_s)

    rejects(
        lesson08.check_fsdp_critical_batch, with_collective_time,
        match="calls costs.collective_time: a library function this checker refuses",
    )  # fmt: skip


def test_fsdp_critical_batch_wrong_peak_is_not_hinted_as_one_collective():
    """Half the bfloat16 peak (or a GPU's TF32 rate) halves the batch at the compute-bound cases only: the
    hint must not say that a collective is missing (one collective per leaf halves every case)."""
    import dataclasses

    def at_peak(scale):
        def answer(f, h, p, n, fab):
            chip = dataclasses.replace(fab.chip, bf16=scale(fab.chip) * fab.chip.bf16)
            return critical_ref(f, h, p, n, dataclasses.replace(fab, chip=chip))

        return answer

    half_peak = at_peak(lambda chip: 0.5)
    tf32_peak = at_peak(lambda chip: (chip.tf32 or chip.bf16) / chip.bf16)
    for answer in (half_peak, tf32_peak):
        with pytest.raises(ExerciseError) as caught:
            lesson08.check_fsdp_critical_batch(answer)
        assert "both directions of the step" not in str(caught.value)
        assert "communication time = for each leaf" in str(caught.value)


def comms_transfer(kind, n, size):
    from course_lib import comms

    return comms.transfer(kind, "data", n, size, "parameters")

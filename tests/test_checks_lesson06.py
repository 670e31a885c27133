"""Exercise checkers of lesson 06 (course_tools.checks.lesson06): each accepts the reference answer and
other correct forms, rejects typical wrong answers with its own hint, and prints "not written yet" for the
student stub (8 simulated CPU devices from conftest.py; subsets for other device counts)."""

import answers_lesson06 as a
import jax
import pytest
from checking import rejects

from course_tools.checks import lesson06


def stub(*args, **kwargs):
    raise NotImplementedError("Exercise: write this part")


def test_stubs_print_not_written_and_return_false(report, monkeypatch, capsys):
    monkeypatch.delenv("COURSE_STRICT_CHECKS", raising=False)
    devs = report.devices
    assert lesson06.check_shapes_and_vma(stub) is False
    assert lesson06.check_ring_all_reduce(stub) is False
    assert lesson06.check_tp_cross_entropy(stub, devs) is False
    assert lesson06.check_tp_mlp(None, None, devs) is False  # the stub: mlp_layout = ... = None
    out = capsys.readouterr().out
    assert out.count("not written yet") == 4 and out.count("hint:") == 4


def test_shapes_and_vma():
    assert lesson06.check_shapes_and_vma(a.predict)
    assert lesson06.check_shapes_and_vma(a.predict_lists)
    rejects(lesson06.check_shapes_and_vma, a.predict_global_shapes, match="'x' has shape.*divided")
    rejects(
        lesson06.check_shapes_and_vma,
        a.predict_gather_invariant,
        match="'g' has vma.*to='invarying'",
    )
    rejects(
        lesson06.check_shapes_and_vma,
        a.predict_psum_still_varies,
        match="'y' has vma.*removes MODEL",
    )
    rejects(
        lesson06.check_shapes_and_vma,
        a.predict_hardcoded_4x2,
        match="data=1 x model=1.*'g' has shape",
    )
    rejects(
        lesson06.check_shapes_and_vma, a.predict_scatter_full, match="'s' has shape.*8 / n_data"
    )
    rejects(
        lesson06.check_shapes_and_vma,
        lambda nd, nm: {"x": ((8, 4), {"data"})},
        match="exactly the keys",
    )


def test_ring_all_reduce():
    assert lesson06.check_ring_all_reduce(a.ring_all_reduce)
    assert lesson06.check_ring_all_reduce(a.ring_all_reduce_fori)


@pytest.mark.parametrize(
    "answer, match",
    [
        (a.ring_uses_psum, r"uses \['psum.*ppermute"),
        (a.ring_scatter_gather, r"uses \['all_gather.*reduce_scatter"),
        (a.ring_whole_blocks, r"sends 7\.00× its block.*1\.75×"),
        (a.ring_whole_blocks_while, "while_loop sends with ppermute.*fori_loop"),
        (a.ring_whole_blocks_scan, r"sends 7\.00× its block"),
        (a.ring_reduce_scatter_only, "one chunk only.*all-gather half"),
        (a.ring_off_by_one, "differs from psum.*n-1 steps"),
        (a.ring_wrong_index, "differs from psum|one chunk only"),
        (a.ring_nothing, "still holds its own block"),
    ],
)
def test_ring_all_reduce_rejects(answer, match):
    rejects(lesson06.check_ring_all_reduce, answer, match=match)


@pytest.mark.parametrize("n", [8, 3, 1])
def test_tp_cross_entropy(report, n):
    devs = report.devices[:n]
    assert lesson06.check_tp_cross_entropy(a.tp_cross_entropy, devs)
    assert lesson06.check_tp_cross_entropy(a.tp_cross_entropy_onehot, devs)
    # the given bug is caught with any number of devices (the model axis is simulated)
    rejects(
        lesson06.check_tp_cross_entropy,
        a.tp_cross_entropy_buggy,
        devs,
        match="per-shard softmax.*lax.psum of the local sums",
    )


@pytest.mark.parametrize(
    "answer, match",
    [
        (a.tp_cross_entropy_no_shift, "inf or nan.*lax.pmax"),
        (a.tp_cross_entropy_local_max, "differs from the full.*same global max"),
        (a.tp_cross_entropy_no_stop_gradient, "'pmax' has no derivative.*stop_gradient"),
        (a.tp_cross_entropy_gather, "the logits travel.*all_gather"),
        (a.tp_cross_entropy_unmasked, "differs from the full"),
    ],
)
def test_tp_cross_entropy_rejects(report, answer, match):
    rejects(lesson06.check_tp_cross_entropy, answer, report.devices, match=match)


@pytest.mark.parametrize("n", [8, 3, 2, 1])
def test_tp_mlp(report, n):
    devs = report.devices[:n]
    assert lesson06.check_tp_mlp(a.mlp_layout, a.tp_mlp_loss_and_grads, devs)
    assert lesson06.check_tp_mlp(a.mlp_layout_tuples, a.tp_mlp_sum_form, devs)


@pytest.mark.parametrize(
    "layout, answer, match",
    [
        (a.mlp_layout, a.tp_mlp_article_grads, r"n_data× \(4×\)"),
        (a.mlp_layout, a.tp_mlp_bias_before_psum, "b2 is counted 2 times"),
        (a.mlp_layout, a.tp_mlp_no_psum, "still varies.*lax.psum"),
        (a.mlp_layout_columns, a.tp_mlp_columns, "communicates over model 3 times"),
        (a.mlp_layout, a.tp_mlp_two_passes, "over model 2 times"),
        (a.mlp_layout_replicated, a.tp_mlp_loss_and_grads, "w1 is not split"),
    ],
)
def test_tp_mlp_rejects(report, layout, answer, match):
    rejects(lesson06.check_tp_mlp, layout, answer, report.devices, match=match)


def test_the_debug_exercise_is_silent_without_the_checker(report):
    # The given program runs under shard_map with check_vma=True and returns finite, plausible losses.
    import jax.numpy as jnp
    import numpy as np
    from jax import P

    from course_lib.meshes import DATA, MODEL, data_model_mesh

    mesh = data_model_mesh(report.devices, (4, 2), axis_type="auto")
    logits = jax.random.normal(jax.random.key(0), (8, 10))
    labels = jnp.arange(8) % 10
    f = jax.shard_map(
        lambda lg, y: a.tp_cross_entropy_buggy(lg, y, MODEL),
        mesh=mesh,
        in_specs=(P(DATA, MODEL), P(DATA)),
        out_specs=P(DATA),
    )
    got = np.asarray(f(logits, labels))
    assert np.all(np.isfinite(got)) and np.all(got > 0)

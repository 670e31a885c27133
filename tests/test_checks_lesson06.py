"""Exercise checkers of lesson 06 (course_tools.checks.lesson06): each accepts the reference answer and
other correct forms, rejects typical wrong answers with its own hint, and prints "not written yet" for the
student stub (8 simulated CPU devices from conftest.py; subsets for other device counts)."""

import answers_lesson06 as a
import jax
import pytest
from checking import rejects

from course_tools.checks import ExerciseError, lesson06


def stub(*args, **kwargs):
    raise NotImplementedError("Exercise: write this part")


def test_stubs_print_not_written_and_return_false(report, monkeypatch, capsys):
    monkeypatch.delenv("COURSE_STRICT_CHECKS", raising=False)
    devs = report.devices
    assert lesson06.check_shapes_and_vma(stub) is False
    assert lesson06.check_ring_all_reduce(stub) is False
    assert lesson06.check_tp_cross_entropy(stub, devs) is False
    assert lesson06.check_halo_stencil(stub, devs) is False
    out = capsys.readouterr().out
    assert out.count("not written yet") == 4 and out.count("hint:") == 4


def test_shapes_and_vma():
    assert lesson06.check_shapes_and_vma(a.predict)
    assert lesson06.check_shapes_and_vma(a.predict_lists)
    for wrong, count in [
        (a.predict_global_shapes, 1),
        (a.predict_gather_invariant, 1),
        (a.predict_psum_still_varies, 1),
        (a.predict_hardcoded_4x2, 2),  # g and s depend on the mesh
        (a.predict_scatter_full, 1),
        (a.predict_all_wrong_vma, 8),
    ]:
        with pytest.raises(ExerciseError, match=f"{count} of the 8 values") as e:
            lesson06.check_shapes_and_vma(wrong)
        first = str(e.value).splitlines()[0]  # how many, never which
        assert not any(f"'{k}'" in first for k in ("x", "w", "xw", "y", "g", "s", "i", "wy")), first
        assert "data=" not in first, first
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
        (a.ring_uses_psum, r"uses \['lax\.psum'\].*ppermute"),
        (a.ring_scatter_gather, r"uses \['lax\.all_gather', 'lax\.psum_scatter'\]"),
        (a.ring_only_on_eight, r"on 4 devices each device sends 3\.00× its block.*1\.50×"),
        (a.ring_whole_blocks, r"sends 7\.00× its block.*1\.75×"),
        (a.ring_whole_blocks_while, "while_loop sends with ppermute.*fori_loop"),
        (a.ring_whole_blocks_scan, r"sends 7\.00× its block"),
        (a.ring_reduce_scatter_only, "one chunk only.*all-gather half"),
        (a.ring_off_by_one, "differs from psum.*n-1 steps"),
        (a.ring_wrong_index, "differs from psum|one chunk only"),
        (a.ring_nothing, "still holds its own block"),
        (a.ring_gather_then_sum, r"sends 7\.00× its block"),
        (a.ring_bf16, "differs from psum.*in bfloat16: the error is rounding"),
    ],
)
def test_ring_all_reduce_rejects(answer, match):
    rejects(lesson06.check_ring_all_reduce, answer, match=match)


@pytest.mark.parametrize("n", [8, 3, 1])
def test_tp_cross_entropy(report, n):
    devs = report.devices[:n]
    assert lesson06.check_tp_cross_entropy(a.tp_cross_entropy, devs)
    assert lesson06.check_tp_cross_entropy(a.tp_cross_entropy_onehot, devs)
    assert lesson06.check_tp_cross_entropy(a.tp_cross_entropy_two_level, devs)
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
        (a.tp_cross_entropy_batch_max, "(?s)rows lie on different scales.*per example.*last axis"),
        (a.tp_cross_entropy_no_stop_gradient, "'pmax' has no derivative.*stop_gradient"),
        (a.tp_cross_entropy_gather, r"the logits travel: \['lax\.all_gather'\]"),
        (a.tp_cross_entropy_gather_varying, r"the logits travel: \['lax\.all_gather'\]"),
        (a.tp_cross_entropy_unmasked, "differs from the full"),
    ],
)
def test_tp_cross_entropy_rejects(report, answer, match):
    rejects(lesson06.check_tp_cross_entropy, answer, report.devices, match=match)


@pytest.mark.parametrize("answer", [a.halo_stencil, a.halo_stencil_conv], ids=lambda f: f.__name__)
@pytest.mark.parametrize("n", [8, 2])  # 1: judged in a process of 8 (test_checks_devices.py)
def test_halo_stencil(report, answer, n):
    assert lesson06.check_halo_stencil(answer, report.devices[:n])


@pytest.mark.parametrize(
    "answer, match",
    [
        (
            a.halo_ring,
            "first and last rows of the whole signal see the other end.*leave that pair out",
        ),
        (a.halo_flipped, "convolution with the kernel reversed"),
        (a.halo_none, "as if the signal ended at its edges"),
        (a.halo_swapped, "differs from the stencil of the whole signal at rows.*which block each"),
        (a.halo_whole_blocks, "sends 144 bytes; the halo is 2 · r · C · 4 = 48 bytes"),
        (a.halo_gather, r"uses \['lax\.all_gather'\]"),
        (a.halo_bf16, "differs from the stencil.*in bfloat16: the error is rounding"),
    ],
)
def test_halo_stencil_rejects(report, answer, match):
    rejects(lesson06.check_halo_stencil, answer, report.devices, match=match)


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

"""The optional project of lesson 10 (course_tools.checks.lesson10.check_ring_vjp): a ring backward
pass with jax.custom_vjp. The checker accepts the reference and another correct form and refuses,
each with its own hint, a backward that leaves dK, dV one device past home, one that forgets the
causal mask, a custom_vjp that saves every K/V block, a custom_vjp whose backward is jax.vjp of the
forward ring, plain autodiff (no custom_vjp) and an answer calling the library, on 8 simulated CPU
devices (fewer are judged in a fresh process of 8)."""

import answers_lesson10_vjp as a
import pytest
from checking import not_written, rejects, stub

from course_lib import splits
from course_tools.checks import lesson10
from course_tools.checks._lesson10_vjp import (
    BWD_ALLOWANCE,
    VJP_ALLOWANCE,
    backward_blocks,
    residual_blocks,
)


def test_stub_prints_not_written(report, monkeypatch, capsys):
    not_written(
        lesson10.check_ring_vjp, stub, report.devices, monkeypatch=monkeypatch, capsys=capsys
    )


@pytest.mark.parametrize("n", [4, 8])
def test_accepts_correct_forms(report, n, capsys):
    assert lesson10.check_ring_vjp(a.vjp_reference, report.devices[:n])
    assert lesson10.check_ring_vjp(a.vjp_nondiff, report.devices[:n])
    assert "JAX's autodiff ring" in capsys.readouterr().out


def test_residuals_are_measured_against_autodiff():
    """The reference keeps a few blocks whatever the ring; autodiff and the block-saving answer grow."""
    for c in (8, 32):
        mine, auto = residual_blocks(a.vjp_reference, c), residual_blocks(splits.ring_attention, c)
        saved = residual_blocks(a.vjp_saves_blocks, c)
        assert mine <= VJP_ALLOWANCE < 2 * c <= auto
        assert saved >= 2 * c


def test_backward_is_measured():
    """What the backward holds: the correct forms stay under the allowance at rings of 8 and 32; a backward
    differentiating the forward ring with jax.vjp grows with the ring past it."""
    for c in (8, 32):
        assert backward_blocks(a.vjp_reference, c) <= BWD_ALLOWANCE
        assert backward_blocks(a.vjp_nondiff, c) <= BWD_ALLOWANCE
        assert backward_blocks(a.vjp_autodiff_backward, c) > max(BWD_ALLOWANCE, 2 * c)


@pytest.mark.parametrize(
    "answer, match",
    [
        (a.vjp_not_home, "gradient with respect to k is off.*dq is right.*one more ppermute"),
        (a.vjp_unmasked_backward, "gradient with respect to q is off.*causal mask"),
        (a.vjp_saves_blocks, "ring of 8 devices .* keeps 18.2 blocks.*allowance is 8.*every K/V"),
        (
            a.vjp_autodiff_backward,
            "backward pass holds .* blocks at once.*allowance is 32.*ppermutes",
        ),
        (a.vjp_plain_autodiff, "no custom_vjp_call.*jax.custom_vjp"),
        (a.vjp_leaks, "UnexpectedTracerError.*traced separately.*lax.axis_index"),
        (a.vjp_library, "calls course_lib.splits.ring_attention.*without course_lib.splits"),
    ],
)
def test_rejects(report, answer, match):
    rejects(lesson10.check_ring_vjp, answer, report.devices, match=match)


@pytest.mark.parametrize("n", [3, 4])
def test_fewer_than_eight_devices_are_judged_on_eight(report, n):
    """A block index right on rings of up to 4 devices only: on 3 or 4 devices (rings of 2 and 4 at
    most judged there) it would pass; the checker sends it to a process of 8."""
    rejects(
        lesson10.check_ring_vjp,
        a.vjp_short_rings_only,
        report.devices[:n],
        match=r"forward values differ .*judged in a fresh process on 8",
    )

"""What every checker test asks of a checker (tests/test_checks_lessonNN.py import these)."""

import pytest

from course_tools.checks import ExerciseError, NotWritten


def rejects(check, *args, match):
    """``check(*args)`` raises an ExerciseError whose message matches ``match`` (across lines)."""
    with pytest.raises(ExerciseError, match="(?s)" + match):
        check(*args)


def rejects_written(check, *args, match):
    """As :func:`rejects`, matching ``match`` as given, and the error is a wrong answer, not an unwritten one."""
    with pytest.raises(ExerciseError, match=match) as e:
        check(*args)
    assert not isinstance(e.value, NotWritten)


def not_written(check, *args, monkeypatch, capsys):
    """An unwritten answer raises NotWritten under COURSE_STRICT_CHECKS=1, else prints its hint and returns False."""
    monkeypatch.setenv("COURSE_STRICT_CHECKS", "1")  # as the test suite runs the solution notebooks
    with pytest.raises(NotWritten):
        check(*args)
    monkeypatch.delenv("COURSE_STRICT_CHECKS", raising=False)
    assert check(*args) is False
    out = capsys.readouterr().out
    assert "not written yet" in out and "hint:" in out


def stub(*args, **kwargs):
    """The student version's stub of an exercise."""
    raise NotImplementedError("Exercise: write this part")


TOLERANCES = ("platform", "tpu")
"""The float32 tolerances a checker test runs at: this platform's, and the loosest the course uses (a TPU's
at JAX's default matmul precision, 8 × 2^-9 ≈ 1.6e-2), at which every wrong answer must still be refused."""


def use_tolerance(monkeypatch, tolerance: str) -> float:
    """Make ``course_lib.precision.float32_rtol`` (which every checker reads, through
    ``course_tools.checks._common.matmul_rtol``) return ``tolerance``'s value: ``"platform"`` leaves it as
    it is, ``"tpu"`` forces a TPU's at default precision. Returns the value in force."""
    from course_lib import precision
    from course_tools.checks._common import matmul_rtol

    if tolerance == "tpu":
        loosest = precision.float32_rtol("tpu", "default")
        monkeypatch.setattr(precision, "float32_rtol", lambda *args, **kwargs: loosest)
        assert matmul_rtol() == loosest > 1e-2
    return matmul_rtol()


def tpu_rules(monkeypatch):
    """The TPU's precision rules on this CPU: float64 does not run (``precision.float64_runs`` False) and
    float32 comparisons take the TPU's default-precision tolerance (``precision.float32_rtol``, ~1.6e-2).
    The checkers read both through ``course_lib.precision``, so they judge as they would on the chip."""
    from course_lib import precision

    rtol, f64 = precision.float32_rtol, precision.float64_runs
    monkeypatch.setattr(
        precision,
        "float32_rtol",
        lambda backend=None, matmul=None, *, roundings=8: rtol(
            backend or "tpu", matmul, roundings=roundings
        ),
    )
    monkeypatch.setattr(
        precision, "float64_runs", lambda backend=None: False if backend is None else f64(backend)
    )
    return precision.float32_rtol()

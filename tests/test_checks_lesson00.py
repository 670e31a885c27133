"""The exercise checkers of lesson 00 (course_tools.checks.lesson00) accept the reference solutions and
reject typical wrong answers.

Each wrong answer is one a learner plausibly writes; the test asserts on the hint the checker gives.
"""

import ast

import jax
import jax.numpy as jnp
import pytest

from course_tools.checks import ExerciseError, lesson00


def rejects(check, answer, *args, match: str):
    with pytest.raises(ExerciseError, match=match):
        check(answer, *args)


def test_xla_flags():
    assert lesson00.check_xla_flags(lambda n: f"--xla_force_host_platform_device_count={n}")
    rejects(
        lesson00.check_xla_flags,
        lambda n: f"\u2013xla_force_host_platform_device_count={n}",
        match="typographic dash",
    )
    rejects(
        lesson00.check_xla_flags,
        lambda n: f"xla_force_host_platform_device_count={n}",
        match="must start with '--'",
    )
    rejects(
        lesson00.check_xla_flags,
        lambda n: "--xla_force_host_platform_device_count=8",
        match="use the argument n",
    )
    rejects(
        lesson00.check_xla_flags,
        lambda n: f"--xla_force_host_device_count={n}",
        match="check the spelling",
    )
    rejects(lesson00.check_xla_flags, lambda n: n, match="not a string")


def test_one_array_per_device(report):
    devices = report.devices
    assert lesson00.check_one_array_per_device(
        lambda ds: [jax.device_put(jnp.full(3, i), d) for i, d in enumerate(ds)], devices
    )
    rejects(
        lesson00.check_one_array_per_device,
        lambda ds: [jnp.full(3, i) for i, _ in enumerate(ds)],
        devices,
        match="jax.device_put",
    )
    rejects(
        lesson00.check_one_array_per_device,
        lambda ds: [jax.device_put(jnp.full(3, 1), d) for d in ds],
        devices,
        match=r"three copies of i",
    )
    rejects(
        lesson00.check_one_array_per_device,
        lambda ds: [jnp.zeros(3)],
        devices,
        match="one array for each device",
    )


def _plain_reference(source):
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    return _plain_tree(tree)


def _plain_tree(tree):
    for stmt in tree.body:
        if not (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
        ):
            return False
        try:
            ast.literal_eval(stmt.value)
        except ValueError:
            return False
    return True


def test_parameters_cell():
    assert lesson00.check_parameters_cell(_plain_reference)
    rejects(
        lesson00.check_parameters_cell,
        lambda s: "import" not in s,
        match="a call on the right-hand side",
    )

    def no_syntax_guard(source):  # forgets that ast.parse raises on a broken cell
        return _plain_tree(ast.parse(source))

    rejects(lesson00.check_parameters_cell, no_syntax_guard, match="catch SyntaxError")
    rejects(
        lesson00.check_parameters_cell,
        lambda s: all("=" in ln for ln in s.splitlines() if ln.strip()),
        match="comments, blank lines",
    )

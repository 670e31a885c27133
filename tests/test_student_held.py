"""Library functions held out of the student package (:mod:`course_lib.held`): the package's modules hold
no body of a held function, its stub names the exercise, the checker's accepted answer runs in its place,
and the repository (instructors, CI, papermill runs) keeps the whole function."""

import ast
import importlib
import inspect
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from course_lib import held
from course_tools import checks
from course_tools import student as student_mod
from course_tools.checks import _common

ROOT = Path(__file__).resolve().parents[1]


def _module_and_function(name: str) -> tuple[str, str]:
    module, function = name.split(".")
    return f"course_lib/{module}.py", function


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    (found,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    return found


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    """The student package, unpacked: its top folder."""
    tmp = tmp_path_factory.mktemp("held")
    with zipfile.ZipFile(student_mod.package(ROOT, tmp / "student.zip")) as z:
        z.extractall(tmp / "unpacked")
    return tmp / "unpacked" / student_mod.TOP


@pytest.mark.parametrize("name", sorted(held.EXERCISES))
def test_the_package_holds_no_body_of_a_held_function(package, name):
    """The package's function is its stub: a ``held.call`` of its name and no statement of the body."""
    path, function = _module_and_function(name)
    repo_text = (ROOT / path).read_text()
    lines = repo_text.splitlines()
    whole = _function(ast.parse(repo_text), function)
    span = range(whole.lineno, whole.end_lineno + 1)  # an END after the last statement too
    inside = [i + 1 for i in span if "SOLUTION" in lines[i]]
    assert len(inside) == 2, inside  # the repository's body is marked, once
    body = {
        ast.unparse(s)
        for s in ast.walk(whole)
        if isinstance(s, ast.stmt) and inside[0] < s.lineno < inside[1]
    }
    assert len(body) > 3  # and whole
    ours = _function(ast.parse((package / path).read_text()), function)
    calls = [n for n in ast.walk(ours) if isinstance(n, ast.Call)]
    stubs = [c for c in calls if ast.unparse(c.func).endswith("held.call")]
    assert len(stubs) == 1 and stubs[0].args[0].value == name, ast.unparse(ours)
    assert not body & {ast.unparse(s) for s in ast.walk(ours) if isinstance(s, ast.stmt)}
    assert len(ours.body) <= 4, ast.unparse(ours)  # docstring, argument checks, the stub, a return


def test_the_repository_marks_exactly_the_held_functions():
    """Every marked block in course_lib is a held function's body, and every held function is marked."""
    marked = set()
    for path in sorted((ROOT / "course_lib").glob("*.py")):
        text = path.read_text()
        if "# BEGIN SOLUTION" not in text:
            continue
        stripped = student_mod.library_source(text, path.name)
        for node in ast.parse(stripped).body:
            if isinstance(node, ast.FunctionDef) and "# BEGIN SOLUTION" in ast.get_source_segment(
                text, _function(ast.parse(text), node.name)
            ):
                marked.add(f"{path.stem}.{node.name}")
    assert marked == set(held.EXERCISES) | set(held.REPLACED)


def test_a_checker_registers_each_held_function():
    registering = set()
    for lesson in sorted(Path(checks.__file__).parent.glob("lesson[0-9][0-9].py")):
        module = importlib.import_module(f"course_tools.checks.{lesson.stem}")
        for _, fn in inspect.getmembers(module, callable):
            if getattr(fn, "registers", None):
                registering.add(fn.registers)
    assert registering == set(held.EXERCISES)


def test_registers_keeps_an_accepted_answer_only(monkeypatch):
    monkeypatch.setattr(held, "_ANSWERS", {})
    name = sorted(held.EXERCISES)[0]

    @_common.registers(name)
    def check(answer, verdict):
        return verdict

    def answer():
        return "mine"

    assert check(answer, False) is False and held.registered(name) is None
    assert check(answer, True) is True and held.registered(name) is answer
    assert held.call(name) == "mine"
    with pytest.raises(KeyError, match="not a held function"):
        held.register("splits.tp_block", answer)


def test_the_stub_names_the_exercise(monkeypatch):
    monkeypatch.setattr(held, "_ANSWERS", {})
    with pytest.raises(held.HeldOut, match=r"splits.ring_attention is exercise 3 of lesson 10"):
        held.call("splits.ring_attention", 1, 2, 3, "context")
    with pytest.raises(held.HeldOut, match=r"splits.zero3_blocks is exercise 4 of lesson 10"):
        held.call("splits.zero3_blocks", 1, {}, "data", checkpoint=None)


def test_the_repository_runs_its_own_function_whatever_is_registered(monkeypatch):
    """The instructor path: the whole function runs; a registered answer is never called."""
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from course_lib import splits, transformer

    def wrong(*args, **kwargs):
        raise AssertionError("the repository called a registered answer")

    monkeypatch.setattr(held, "_ANSWERS", {"splits.ring_attention": wrong})
    mesh = Mesh(jax.devices()[:1], ("context",))
    seq = P(None, "context")
    q = jax.random.normal(jax.random.key(0), (2, 8, 2, 4))
    ring = jax.shard_map(
        lambda q, k, v: splits.ring_attention(q, k, v, "context"),
        mesh=mesh,
        in_specs=(seq,) * 3,
        out_specs=seq,
    )
    want = transformer.causal_attention(q, q, q)
    assert np.allclose(ring(q, q, q), want, atol=1e-5)


def test_the_repository_keeps_the_zigzag_ring():
    """``ring_attention_at`` is a ring in the repository (the package computes its values by gathering)."""
    import jax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from course_lib import splits_zigzag

    mesh = Mesh(jax.devices()[:1], ("context",))
    q = jax.numpy.ones((1, 4, 1, 2))
    pos = jax.numpy.arange(4, dtype=jax.numpy.int32)
    for fn, collective in ((splits_zigzag.ring_attention_at, "ppermute"),
                           (splits_zigzag._gathered_at, "all_gather")):  # fmt: skip
        at = jax.shard_map(
            lambda q, k, v, pos, fn=fn: fn(q, k, v, pos, "context"),
            mesh=mesh,
            in_specs=(P(None, "context"),) * 3 + (P("context"),),
            out_specs=P(None, "context"),
        )
        assert collective in str(jax.make_jaxpr(at)(q, q, q, pos))


def test_unrolled_loops_write_out_fori_loop_and_scan():
    import jax
    import jax.numpy as jnp

    def looped(x):
        x = jax.lax.fori_loop(0, 3, lambda i, c: c * 2 + i, x)
        x, ys = jax.lax.scan(lambda c, a: (c + a, c * a), x, jnp.arange(4.0))
        return x, ys

    x = jnp.float32(1.0)
    real = jax.lax.fori_loop, jax.lax.scan
    # a fori_loop of known bounds is a scan; a new lambda each time (make_jaxpr keeps traces by function)
    assert str(jax.make_jaxpr(lambda x: looped(x))(x)).count("scan[") == 2
    with held.unrolled_loops():
        text = str(jax.make_jaxpr(lambda x: looped(x))(x))
        got = looped(x)
    assert "while[" not in text and "scan[" not in text
    want = looped(x)
    assert float(got[0]) == float(want[0]) and (got[1] == want[1]).all()
    assert (jax.lax.fori_loop, jax.lax.scan) == real  # put back
    assert "scan[" in str(jax.make_jaxpr(lambda x: looped(x))(x))


LEARNER = """
import sys

import jax, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from course_lib import held, op_schedules, splits, transformer

sys.path.insert(0, sys.argv[1])  # the repository's tests: answers the checkers accept
import answers_lesson10, answers_lesson11_zb

mesh = Mesh(jax.devices()[:4], ("context",))
seq = P(None, "context")
q = jax.random.normal(jax.random.key(0), (2, 16, 2, 4))


def mapped(fn, **kw):
    return jax.shard_map(lambda q, k, v: fn(q, k, v, "context", **kw), mesh=mesh,
                         in_specs=(seq,) * 3, out_specs=seq)


try:
    mapped(splits.ring_attention)(q, q, q)
    raise SystemExit("the package ran ring_attention with no answer registered")
except held.HeldOut as e:
    print("HeldOut:", e)
held.register("splits.ring_attention", answers_lesson10.ring_scan)  # a lax.scan ring
want = transformer.causal_attention(q, q, q)
assert np.allclose(mapped(splits.ring_attention)(q, q, q), want, atol=1e-5)
assert "scan[" in str(jax.make_jaxpr(mapped(splits.ring_attention))(q, q, q))
unrolled = mapped(splits.ring_attention, unroll=True)
assert "scan[" not in str(jax.make_jaxpr(unrolled)(q, q, q))
assert np.allclose(unrolled(q, q, q), want, atol=1e-5)

# the zig-zag ring's values, computed in the package without a ring
from course_lib import splits_zigzag

order = splits_zigzag.zigzag_order(16, 4)
at = jax.shard_map(lambda q, k, v, pos: splits_zigzag.ring_attention_at(q, k, v, pos, "context"),
                   mesh=mesh, in_specs=(seq,) * 3 + (P("context"),), out_specs=seq)
laid = q[:, order]
out = at(laid, laid, laid, jax.numpy.asarray(order, jax.numpy.int32))
assert np.allclose(out[:, np.argsort(order)], want, atol=1e-5)
text = str(jax.make_jaxpr(at)(laid, laid, laid, jax.numpy.asarray(order, jax.numpy.int32)))
assert "ppermute" not in text and "all_gather" in text
print("zig-zag values without a ring")

try:
    op_schedules.zb_h1(4, 8)
    raise SystemExit("the package ran zb_h1 with no answer registered")
except held.HeldOut as e:
    print("HeldOut:", e)
held.register("op_schedules.zb_h1", answers_lesson11_zb.zb_h1_orders)
table = op_schedules.zb_h1(4, 8)
assert op_schedules.measured_bubble(table) == op_schedules.predicted_bubble("zb_h1", 4, 8)
op_schedules.validate(table)


def zero3(x, blocks, axis_name):  # a layer under the answer's own policy, dots_saveable
    def layer(h, shard):
        full = jax.tree.map(lambda a: jax.lax.all_gather(a, axis_name, axis=0, tiled=True), shard)
        return h * full["w"].sum()

    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_saveable)
    return jax.lax.scan(lambda h, s: (layer(h, s), None), x, blocks)[0]


def zero3_jaxpr(**kw):
    f = jax.shard_map(lambda x, b: splits.zero3_blocks(x, b, "context", **kw), mesh=mesh,
                      in_specs=(P("context"), P(None, "context")), out_specs=P("context"))
    return str(jax.make_jaxpr(f)(jax.numpy.ones(4), {"w": jax.numpy.ones((2, 8))}))


try:
    zero3_jaxpr()
    raise SystemExit("the package ran zero3_blocks with no answer registered")
except held.HeldOut as e:
    print("HeldOut:", e)
held.register("splits.zero3_blocks", zero3)
assert "nothing_saveable" in zero3_jaxpr() and "dots_saveable" not in zero3_jaxpr()
assert "checkpoint[" not in zero3_jaxpr(policy=None)
print("registered answer ran")
"""


def test_in_the_package_the_learners_answer_powers_the_later_cells(package):
    env = {**os.environ, "PYTHONPATH": str(package), "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    done = subprocess.run(
        [sys.executable, "-c", LEARNER, str(ROOT / "tests")],
        cwd=package,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "HeldOut: splits.ring_attention is exercise 3 of lesson 10" in done.stdout
    assert "HeldOut: splits.zero3_blocks is exercise 4 of lesson 10" in done.stdout
    assert "HeldOut: op_schedules.zb_h1 is exercise 3 of lesson 11" in done.stdout
    assert "zig-zag values without a ring" in done.stdout
    assert "registered answer ran" in done.stdout


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("def f():\n    # BEGIN SOLUTION\n    return 1\n", "without END"),
        (
            "def f():\n    # BEGIN SOLUTION  # STUB: return (\n    return 1\n    # END SOLUTION\n",
            "parse",
        ),
    ],
)
def test_a_library_module_with_bad_markers_is_refused(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        student_mod.library_source(text, "course_lib/x.py")
    assert student_mod.library_source("x = 1\n", "course_lib/y.py") == "x = 1\n"


def test_the_judging_process_registers_the_accepted_answers_again(tmp_path, monkeypatch):
    """A checker judged in a fresh process (``judged_on``) that calls a held function runs the answer
    registered here: it travels beside the answer as a module."""
    import answers_lesson10

    monkeypatch.setattr(held, "_ANSWERS", {})
    assert _common._ship_held(str(tmp_path)) == []
    held.register("splits.ring_attention", answers_lesson10.ring_scan)
    ((name, module),) = _common._ship_held(str(tmp_path))
    assert name == "splits.ring_attention"
    namespace: dict = {}
    exec((tmp_path / f"{module}.py").read_text(), namespace)  # noqa: S102
    assert namespace["answer"] is answers_lesson10.ring_scan


@pytest.mark.notebook
@pytest.mark.parametrize("stem", ["10_transformers", "11_pipeline_experts"])
def test_the_lessons_run_on_the_package_with_their_answers_accepted(package, stem, tmp_path):
    """The lessons that call held functions, every answer written (the solution notebook), run top to
    bottom on the package's course_lib at 4 devices: each accepted answer powers the later cells."""
    import shutil

    from course_tools.execution import execute

    nb = shutil.copy(ROOT / "notebooks" / f"{stem}.ipynb", package / f"{stem}.ipynb")
    env = {"PYTHONPATH": str(package), "COURSE_STRICT_CHECKS": "1", "MPLBACKEND": "Agg"}
    execute(Path(nb), tmp_path / f"{stem}.ipynb", {"n_devices": 4, "platform": "cpu"}, False, env)


ZERO3_AS_A_LOOP = """def zero3_blocks(x, blocks, axis_name):
    @jax.checkpoint
    def layer(h, shard):
        full = jax.tree.map(lambda a: lax.all_gather(a, axis_name, axis=0, tiled=True), shard)
        return transformer.block(h, full)

    for i in range(jax.tree.leaves(blocks)[0].shape[0]):
        x = layer(x, jax.tree.map(lambda a, i=i: a[i], blocks))
    return x
"""
"""A right ZeRO-3 the checker accepts, written as a Python loop over the layers: in the package it runs
section 4's cells, whose temporaries differ from the scanned library function's."""


@pytest.mark.notebook
def test_lesson10_runs_on_the_package_with_another_right_zero3(package, tmp_path):
    """Lesson 10 on the package at 2 devices with exercise 4 answered by a Python loop (not the solution's
    scan): the later cells that run the learner's function hold for it too."""
    import json

    from course_tools.execution import execute

    nb = json.loads((ROOT / "notebooks" / "10_transformers.ipynb").read_text())
    (cell,) = [c for c in nb["cells"] if "".join(c["source"]).startswith("def zero3_blocks(")]
    cell["source"] = ZERO3_AS_A_LOOP
    path = package / "10_loop.ipynb"
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    env = {"PYTHONPATH": str(package), "COURSE_STRICT_CHECKS": "1", "MPLBACKEND": "Agg"}
    execute(path, tmp_path / "10_loop.ipynb", {"n_devices": 2, "platform": "cpu"}, False, env)

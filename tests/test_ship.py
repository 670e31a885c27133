"""course_tools.checks._ship: an answer written in a notebook, sent as source text to a fresh process only
where the text defines exactly the function that ran (cells stand in as a module loaded from a file that
is not importable by name, as a notebook's ``__main__`` is not)."""

import contextlib
import importlib.util
import textwrap

import pytest

from course_tools.checks._ship import CannotShip, ship

CELLS = '''
import functools
import jax
import jax.numpy as jnp
from jax import lax
from course_lib.meshes import MODEL
from course_lib.transformer import mlp

SCALE = 2.0
NAMES = ("a", "b")
ARRAY = jnp.ones(3)


def helper(x, s=SCALE):
    return x * s


@jax.jit
def jitted(x):
    return helper(x) + 1


def answer(x, axis_name=MODEL):
    """Reads modules, a constant, a default, a jitted helper, an imported function, a nested lambda."""
    return lax.psum(jitted(x), axis_name) + len(NAMES) + (lambda y: y)(1) + 0 * mlp.__name__.count("")


def uses_array(x):
    return x + ARRAY


PART = functools.partial(helper, s=3)


def uses_partial(x):
    return PART(x)


def outer():
    y = 1

    def inner(x):
        return x + y

    return inner


lam = lambda x: x  # noqa: E731


def uses_missing(x):
    return x + NOT_DEFINED  # noqa: F821


def loops_with_lambdas(x, kernel):  # the red team's D5: a lambda reading a local, in a loop
    total = 0
    for k in (1, 2):
        total = total + jax.vmap(lambda c: jnp.convolve(c, kernel * k), in_axes=1)(x)
    return total
'''


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    path = tmp_path_factory.mktemp("nb") / "cells.py"
    path.write_text(textwrap.dedent(CELLS))
    spec = importlib.util.spec_from_file_location("notebook_cells", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not in sys.modules: sent by source, as a notebook's functions
    return module, path


def test_ships_a_def_with_what_it_reads(cells):
    module, _ = cells
    source = ship(module.answer)
    for line in (
        "import jax.lax as lax",
        "SCALE = 2.0",
        "NAMES = ('a', 'b')",
        "MODEL = 'model'",
        "from course_lib.transformer import mlp",
        "@jax.jit\ndef jitted(x):",
        "def helper(x, s=SCALE):",
    ):
        assert line in source, (line, source)
    assert source.index("import jax\n") < source.index("@jax.jit")  # a decorator's module first
    ns: dict = {}
    exec(compile(source, "<shipped>", "exec"), ns)
    assert ns["answer"].__code__.co_varnames == module.answer.__code__.co_varnames


@contextlib.contextmanager
def _edited(path, old, new):
    """The cells' file with ``old`` replaced by ``new`` (as a cell edited after it ran), restored after."""
    import linecache

    text = path.read_text()
    path.write_text(text.replace(old, new))
    linecache.checkcache(str(path))
    try:
        yield
    finally:
        path.write_text(text)
        linecache.checkcache(str(path))


def test_ships_a_lambda_that_reads_a_local_inside_a_loop(cells):
    """A call whose argument is a closure compiles with a separate PUSH_NULL beside its cell's imports and
    without it alone, which moves every jump target after it: the same code, sent (the red team's D5 was
    refused as "not the code that ran")."""
    module, path = cells
    assert "def loops_with_lambdas(x, kernel):" in ship(module.loops_with_lambdas)
    with _edited(path, "kernel * k)", "kernel * k + 1)"):
        with pytest.raises(CannotShip, match="not the code that ran"):
            ship(module.loops_with_lambdas)


def test_an_importable_function_goes_by_name():
    import answers_lesson10

    assert ship(answers_lesson10.tp_mlp) == "from answers_lesson10 import tp_mlp as answer\n"


@pytest.mark.parametrize(
    "name, reason",
    [
        ("uses_array", "ARRAY, which it uses, is a value of type ArrayImpl made in the notebook"),
        ("uses_partial", "PART, which it uses, is a value of type partial"),
        ("lam", "the answer \\(<lambda>\\) is a lambda or a nested function"),
        ("uses_missing", "reads NOT_DEFINED, which is not defined"),
    ],
)
def test_refuses_what_cannot_be_sent_exactly(cells, name, reason):
    module, _ = cells
    with pytest.raises(CannotShip, match=reason):
        ship(getattr(module, name))


def test_refuses_a_closure(cells):
    module, _ = cells
    with pytest.raises(CannotShip, match="lambda or a nested function"):
        ship(module.outer())


def test_refuses_a_cell_edited_after_it_ran(cells, tmp_path):
    """The source text read back is not the code that ran: refused, never judged in its stead."""
    module, path = cells
    with _edited(path, "return x * s", "return x * s + 1"):
        with pytest.raises(CannotShip, match="not the code that ran"):
            ship(module.helper)


def test_refuses_a_cell_whose_module_call_was_edited(cells):
    """A call ``lax.psum(...)`` compiles to other instructions beside its cell's imports than alone (CPython
    3.11: LOAD_ATTR there, LOAD_METHOD here), which are compared as one; the attribute called is not."""
    module, path = cells
    with _edited(path, "lax.psum(jitted(x)", "lax.pmax(jitted(x)"):
        with pytest.raises(CannotShip, match="not the code that ran"):
            ship(module.answer)

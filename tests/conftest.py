"""Test session setup: 8 simulated CPU devices, fixed once before JAX starts (and asserted).

``COURSE_TEST_DEVICES=N`` sets another count: only for tools/audit_checkers.py, which runs the checker tests at
1 and 2 devices to list the wrong answers a checker would accept there (the suite itself runs at 8)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from course_lib.devices import setup_devices  # noqa: E402

N_DEVICES = int(os.environ.get("COURSE_TEST_DEVICES", "8"))
REPORT = setup_devices(N_DEVICES, platform="cpu")
assert REPORT.n_devices == N_DEVICES and len(REPORT.devices) == N_DEVICES, REPORT

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def report():
    """The session's :class:`course_lib.devices.DeviceReport` (8 simulated CPU devices)."""
    return REPORT


# --- scheduling over pytest-xdist workers (addopts: --dist loadgroup) ----------------------------------

FIRST = (
    "matrix-n4",
    "matrix-n2",
    "matrix-n1",
    "matrix-n8",
    "notebooks/08_lab.ipynb",
)
"""The longest units of work, longest first (measured), so that both workers start on a long chain: the
invariance matrix's counts (each count's notebooks run in order on one worker; at 1 device the lessons run
as their student versions, which tests/test_lessons.py reads), the lab's tiny profile and notebook 09 at 8,
the lab as committed. Then the other notebooks (nbmake), then the rest in collection order; the cross-count
comparisons last (they wait for the runs they read: sent early, they would hold a worker idle)."""
LAST = ("matrix-compare",)


def _group(item) -> str:
    mark = item.get_closest_marker("xdist_group")
    return mark.args[0] if mark.args else mark.kwargs.get("name", "")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every test without an ``xdist_group`` gets its module's (a module's tests share one worker, as with
    ``--dist loadfile``: its module-scoped fixtures are made once); the long groups are sent first.

    nbmake's run of notebook 09 (as committed: 8 devices) is also the invariance matrix's run of it at 8
    (``matrix.nbmake_stands_in``): it joins the group ``matrix-n8``, first, so that it is made before the
    comparisons ask for it."""
    import matrix

    for item in items:
        # nbmake: each notebook as committed; with the shell's XLA flags only where the session is asked
        # to (the second environment's run, matrix.NBMAKE_SHELL_FLAGS); otherwise with the session's
        if item.path.suffix == ".ipynb" and matrix.nbmake_keeps_shell_flags():
            item.runtest = matrix.with_shell_flags(item.runtest)
        if item.path.suffix == ".ipynb" and item.path.stem == matrix.MULTIHOST:
            item.add_marker(pytest.mark.xdist_group(f"matrix-n{matrix.DEFAULTS_COUNT}"))
            item.runtest = _standing_in(item.runtest, item.path.stem)
        elif item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))

    def rank(item):
        name = _group(item)
        first = FIRST.index(name) if name in FIRST else len(FIRST) + LAST.count(name)
        return first, item.path.suffix != ".ipynb"

    items.sort(key=rank)  # stable: the order within a group and among the other tests is kept


def _standing_in(runtest, stem):
    def run():
        import matrix

        with matrix.nbmake_stands_in(stem):
            runtest()

    return run


@pytest.fixture(scope="module")
def residual():
    """The pipeline tests' one-device reference, in float64: residual-stage parameters, 4 micro-batches
    ``xs [4, 3, 8]``, the head's weights ``r`` (loss = sum of stage(x) * r), the loss and its gradients
    with respect to (params, xs). tests/test_pipeline.py, tests/test_pipeline_ops.py."""
    import jax
    import jax.numpy as jnp

    from course_lib import pipeline_measure as PM

    with jax.enable_x64(True):
        params = PM.init_residual(jax.random.key(0), 8, 8, jnp.float64)
        xs = jax.random.normal(jax.random.key(1), (4, 3, 8), jnp.float64)
        r = jax.random.normal(jax.random.key(2), (4, 3, 8), jnp.float64)
        stage = PM.residual_stage()

        def ref(params, xs):
            return (jax.vmap(lambda x: stage(x, params))(xs) * r).sum()

        loss, grads = jax.value_and_grad(ref, argnums=(0, 1))(params, xs)
    return params, xs, r, loss, grads

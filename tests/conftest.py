"""Test session setup: 8 simulated CPU devices, fixed once before JAX starts (and asserted)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from course_lib.devices import setup_devices  # noqa: E402

REPORT = setup_devices(8, platform="cpu")
assert REPORT.n_devices == 8 and len(REPORT.devices) == 8, REPORT

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def report():
    """The session's :class:`course_lib.devices.DeviceReport` (8 simulated CPU devices)."""
    return REPORT


# --- scheduling over pytest-xdist workers (addopts: --dist loadgroup) ----------------------------------

MATRIX_FIRST = ("matrix-n8", "matrix-n4", "matrix-n2", "matrix-n1", "matrix-compare")
"""The invariance matrix's groups, longest first, so that both workers start on a long chain."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every test without an ``xdist_group`` gets its module's (a module's tests share one worker, as with
    ``--dist loadfile``: its module-scoped fixtures are made once); the matrix's groups are sent first."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))

    def rank(item):
        mark = item.get_closest_marker("xdist_group")
        name = mark.args[0] if mark.args else mark.kwargs.get("name", "")
        return MATRIX_FIRST.index(name) if name in MATRIX_FIRST else len(MATRIX_FIRST)

    items.sort(key=rank)  # stable: the order within a group and among the other tests is kept

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

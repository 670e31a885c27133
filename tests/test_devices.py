"""Device setup: parsing, XLA_FLAGS checks, and the errors that name their fix."""

import dataclasses
import os
import re
import subprocess
import sys
import textwrap

import jax
import pytest

from course_lib import devices
from course_lib.devices import DeviceSetupError, check_xla_flags, parse_n_devices, setup_devices


@pytest.mark.parametrize("value, expected", [(8, 8), ("8", 8), (" 4 ", 4), (2.0, 2), (1, 1)])
def test_parse_n_devices_accepts_integers_and_decimal_strings(value, expected):
    assert parse_n_devices(value) == expected


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("eight", "not an integer"),
        (0, "at least 1"),
        (-2, "at least 1"),
        ("0", "at least 1"),
        (2.5, "whole number"),
        (True, "bool"),
        (None, "not an integer"),
        ("8.0", "not an integer"),
    ],
)
def test_parse_n_devices_rejects_bad_values_naming_them(value, fragment):
    with pytest.raises(ValueError, match=fragment) as e:
        parse_n_devices(value)
    assert repr(value) in str(e.value)


def test_check_xla_flags_accepts_valid_flags():
    flags = "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/x"
    assert check_xla_flags(flags) == flags.split()
    assert check_xla_flags("") == []


@pytest.mark.parametrize(
    "flags, fragment",
    [
        ("xla_force_host_platform_device_count=8", "starts with '--'"),
        ("\u2013xla_force_host_platform_device_count=8", "typographic dash"),
        ("--xla_force_host_platform_device_count = 8", "no spaces around '='"),
    ],
)
def test_check_xla_flags_rejects_malformed_flags(flags, fragment):
    with pytest.raises(DeviceSetupError, match=fragment) as e:
        check_xla_flags(flags)
    assert "unset XLA_FLAGS" in str(e.value)


def test_session_has_eight_simulated_devices(report):
    assert report.n_devices == 8 and report.platform == "cpu" and report.simulated
    assert [d.id for d in report.devices] == list(range(8))
    assert "simulated" in str(report) and report.as_dict()["n_devices"] == 8
    # simulated CPU devices: no chip from the table, no peak, no allocator limit
    d = report.as_dict()
    assert report.chip is None and report.bytes_limit is None and d["chip"] == ""
    assert d["peak_bf16_flops_per_s"] is None and d["hbm_bytes"] is None
    assert "not a fabric" in str(report) and "no peak FLOP/s claimed" in str(report)


def test_same_count_again_is_fine(report):
    again = setup_devices("8", platform="cpu")
    assert again.devices == report.devices


def test_other_count_after_start_says_restart_the_kernel():
    with pytest.raises(DeviceSetupError, match="Restart the kernel"):
        setup_devices(4)


def test_gpu_platform_without_gpu_names_the_fix():
    with pytest.raises(DeviceSetupError, match=re.escape(f"jax[cuda12]=={jax.__version__}")):
        setup_devices(8, platform="gpu")


def test_tpu_platform_without_tpu_names_the_fix():
    pin = re.escape(jax.__version__)
    with pytest.raises(
        DeviceSetupError,
        match=rf"no TPU is visible to JAX.*jax\[tpu\]=={pin}.*platform='auto' / 'cpu'",
    ):
        setup_devices(8, platform="tpu")


def test_unknown_platform():
    with pytest.raises(ValueError, match="platform='npu'"):
        setup_devices(8, platform="npu")
    assert devices.PLATFORMS == ("auto", "cpu", "gpu", "tpu")


def test_device_subsets():
    assert devices.device_subsets(list(range(8))) == [1, 2, 4, 8]
    assert devices.device_subsets(list(range(3))) == [1, 2, 3]
    assert devices.device_subsets([0]) == [1]


def _run(code: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def _setup_in_fresh_process(platform: str, env_extra: dict) -> subprocess.CompletedProcess:
    """setup_devices(2, platform) in a new interpreter with ``env_extra``; prints "caught: <message>" on a
    DeviceSetupError."""
    return _run(
        f"""
        from course_lib.devices import setup_devices, DeviceSetupError
        try:
            setup_devices(2, platform={platform!r})
        except DeviceSetupError as e:
            print("caught:", e)
    """,
        env_extra,
    )


def test_fresh_process_gets_the_count_asked_for():
    r = _run("""
        from course_lib.devices import setup_devices
        rep = setup_devices("3", platform="cpu")
        import jax
        print(rep.n_devices, len(jax.devices()), rep.simulated)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["3", "3", "True"]


def test_malformed_xla_flags_is_caught_before_xla_aborts():
    r = _setup_in_fresh_process("cpu", {"XLA_FLAGS": "xla_force_host_platform_device_count=8"})
    assert r.returncode == 0, r.stderr
    assert "caught:" in r.stdout and "malformed flag" in r.stdout


def test_jax_used_before_setup_with_another_count():
    r = _run("""
        import jax.numpy as jnp
        jnp.zeros(3).block_until_ready()
        from course_lib.devices import setup_devices, DeviceSetupError
        try:
            setup_devices(4, platform="cpu")
        except DeviceSetupError as e:
            print("caught:", e)
    """)
    assert r.returncode == 0, r.stderr
    assert "caught:" in r.stdout and "1 CPU device" in r.stdout and "Restart the kernel" in r.stdout


class FakeGPU:
    device_kind = "NVIDIA H100 80GB HBM3"


def test_more_gpus_than_exist_names_the_count_and_the_fix():
    gpus = [FakeGPU()] * 4
    assert devices.select_devices(2, gpus, "gpu") == (gpus[0], gpus[1])
    with pytest.raises(
        DeviceSetupError,
        match=r"n_devices=8 but only 4 GPU device\(s\) exist \(NVIDIA H100 80GB HBM3\). "
        r"Use n_devices <= 4, or platform='cpu' to simulate 8",
    ):
        devices.select_devices(8, gpus, "gpu")


class FakeTPU:
    device_kind = "TPU v5 lite"


def test_more_tpu_chips_than_exist_names_the_chip_the_count_and_the_fix():
    with pytest.raises(
        DeviceSetupError,
        match=r"n_devices=8 but only 1 TPU chip\(s\) exist \(TPU v5 lite\). "
        r"Use n_devices <= 1, or platform='cpu' to simulate 8",
    ):
        devices.select_devices(8, [FakeTPU()], "tpu")


def test_report_on_a_chip_names_its_figures_and_memory(report):
    from course_lib import chips

    v5e = chips.chip_for("TPU v5 lite")
    on_tpu = dataclasses.replace(
        report, platform="tpu", device_kind="TPU v5 lite", simulated=False, chip=v5e,
        bytes_limit=int(15.7 * 2**30),
    )  # fmt: skip
    text = str(on_tpu)
    assert "TPU v5e: 197 TFLOP/s dense bf16, 16 GiB HBM at 819 GB/s" in text
    assert "cloud.google.com/tpu/docs/v5e" in text and "bytes_limit 15.70 GiB" in text
    d = on_tpu.as_dict()
    assert d["chip"] == "TPU v5e" and d["peak_bf16_flops_per_s"] == 197e12
    assert d["hbm_bytes"] == 16 * 2**30 and d["hbm_bytes_per_s"] == 819e9
    assert d["link_bytes_per_s"] == 200e9 and "Cloud TPU v5e" in d["chip_source"]
    unlisted = dataclasses.replace(on_tpu, device_kind="TPU v9 future", chip=None)
    assert "not in course_lib.chips.PEAKS" in str(unlisted)


def test_misspelt_xla_flag_is_caught_before_it_kills_the_process():
    r = _setup_in_fresh_process("cpu", {"XLA_FLAGS": "--xla_force_host_platform_devices_count=8"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "caught:" in r.stdout and "makes XLA abort" in r.stdout and "devices_count" in r.stdout


def test_unavailable_backend_in_the_environment_names_the_variable():
    r = _setup_in_fresh_process("auto", {"JAX_PLATFORMS": "cuda"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "caught:" in r.stdout and "JAX_PLATFORMS" in r.stdout


_COUNT_PROBES = """
    import subprocess
    probes = []
    _run = subprocess.run
    def counted(*a, **k):
        probes.append(a)
        return _run(*a, **k)
    subprocess.run = counted
    from course_lib.devices import setup_devices
    setup_devices(2, platform="cpu")
    print(len(probes))
"""


def test_xla_flags_are_probed_once_per_value():
    # Each kernel of a session with XLA_FLAGS would start a Python of its own to probe them (about a
    # CPU-second): the process that already started XLA with them says so (devices.FLAGS_CHECKED).
    flags = "--xla_backend_optimization_level=0"
    for checked, probes in ((None, "1"), ("--xla_cpu_use_thunk_runtime=true", "1"), (flags, "0")):
        extra = {"XLA_FLAGS": flags, devices.FLAGS_CHECKED: checked or ""}
        r = _run(_COUNT_PROBES, extra)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split()[-1:] == [probes], (checked, r.stdout)

"""course_lib.environment: what a notebook inherits from the shell either works or stops the setup cell
with the variable named (each case found by running the course under it)."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import faults
import pytest

from course_lib import environment
from course_lib.devices import DeviceSetupError
from course_tools.execution import execute

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = {option: default for option, default, _ in environment.COURSE_DEFAULTS}


def config(**changed):
    return types.SimpleNamespace(**{**DEFAULTS, "jax_compilation_cache_dir": None, **changed})


def test_the_course_defaults_pass():
    assert environment.check_jax_options(config(), environ={}) == []


@pytest.mark.parametrize(
    "option, value, text",
    [
        ("jax_enable_x64", True, "float64"),
        ("jax_disable_jit", True, "compilations"),
        ("jax_debug_nans", True, "NaNs"),
        ("jax_numpy_rank_promotion", "raise", "rank promotion"),
        ("jax_debug_key_reuse", True, "reuse a key"),
        ("jax_threefry_partitionable", False, "random numbers"),
        ("jax_default_prng_impl", "rbg", "random numbers"),
        ("jax_default_matmul_precision", "bfloat16", "precision"),
    ],
)
def test_an_option_that_changes_the_course_stops_with_its_variable_named(option, value, text):
    var = option.upper()
    with pytest.raises(DeviceSetupError) as e:
        environment.check_jax_options(config(**{option: value}), environ={var: str(value)})
    msg = str(e.value)
    assert f"{var}={str(value)!r}" in msg and text in msg and f"unset {var}" in msg
    assert "restart the kernel" in msg


def test_options_set_in_code_are_named_too_and_all_at_once():
    with pytest.raises(DeviceSetupError) as e:
        environment.check_jax_options(config(jax_enable_x64=True, jax_disable_jit=True), environ={})
    assert "jax_enable_x64=True (set in code)" in str(e.value) and "jax_disable_jit=True" in str(
        e.value
    )


def test_a_persistent_compilation_cache_is_a_note():
    notes = environment.check_jax_options(config(jax_compilation_cache_dir="/tmp/c"), environ={})
    assert notes == [
        "JAX_COMPILATION_CACHE_DIR=/tmp/c: compile times measured here include persistent-cache hits"
    ]


CACHED_COMPILE = """
import jax, jax.numpy as jnp
from course_lib.devices import setup_devices
rep = setup_devices(2, "cpu", measures_compiles={measures})
print("notes:", rep.notes)
jax.jit(lambda x: jnp.tanh(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()
"""


@pytest.mark.parametrize("measures", [False, True])
def test_a_lesson_that_times_compiles_switches_a_persistent_cache_off(tmp_path, measures):
    # A cache hit is a load: lessons 02 and 07 (measures_compiles=True) would time loads, not compiles.
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update(
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    r = subprocess.run(
        [sys.executable, "-c", CACHED_COMPILE.format(measures=measures)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    written = list(cache.glob("*-cache")) if cache.exists() else []
    if measures:
        assert written == [], written
        assert f"JAX_COMPILATION_CACHE_DIR={cache}: switched off in this kernel" in r.stdout
    else:
        assert written, "the cache was not used"
        assert "compile times measured here include persistent-cache hits" in r.stdout


def test_switching_the_cache_off_without_one_changes_nothing():
    assert environment.switch_off_persistent_cache(config()) == []


def test_switching_the_cache_off_after_jax_ran_says_to_restart():
    cfg = config(jax_compilation_cache_dir="/tmp/c", jax_enable_compilation_cache=True)
    (note,) = environment.switch_off_persistent_cache(cfg, jax_started=True)
    assert "JAX ran before this setup" in note and "restart the kernel" in note


def test_a_non_utf8_encoding_names_the_locale_and_the_fix():
    environment.check_encoding("utf-8")
    environment.check_encoding("UTF8")
    with pytest.raises(DeviceSetupError, match=r"'ascii', not UTF-8.*'LC_ALL': 'C'.*PYTHONUTF8=1"):
        environment.check_encoding("ascii", environ={"LC_ALL": "C", "PYTHONUTF8": "0"})


def test_course_lib_of_another_checkout_is_refused(tmp_path):
    checkout = tmp_path / "course"
    (checkout / "course_lib").mkdir(parents=True)
    (checkout / "course_lib" / "__init__.py").write_text("")
    (checkout / "notebooks").mkdir()
    here = Path(environment.__file__).parent
    with pytest.raises(
        DeviceSetupError,
        match=r"belongs to the course in .*course, but `course_lib` is imported from",
    ):
        environment.check_checkout(cwd=checkout / "notebooks", package=here)
    environment.check_checkout(
        cwd=checkout / "notebooks", package=checkout / "course_lib"
    )  # its own
    environment.check_checkout(cwd=tmp_path, package=here)  # not in a checkout: nothing to compare
    environment.check_checkout(cwd=ROOT / "notebooks")  # this checkout, its own package


class FakeShell:
    kernel = object()

    def __init__(self):
        self.magics = []

    def run_line_magic(self, name, line):
        self.magics.append((name, line))


@pytest.fixture
def in_kernel(monkeypatch):
    shell = FakeShell()
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    return shell


@pytest.mark.parametrize("before", ["Agg", "TkAgg", "agggg", "module://nonexistent"])
def test_in_a_kernel_any_backend_becomes_the_inline_one(in_kernel, before, monkeypatch):
    monkeypatch.delitem(sys.modules, "matplotlib", raising=False)
    env = {"MPLBACKEND": before}
    note = environment.use_inline_plots(env)
    assert env["MPLBACKEND"] == environment.INLINE_BACKEND and repr(before) in note
    assert in_kernel.magics == []  # matplotlib not imported yet: the variable is enough


def test_in_a_kernel_with_matplotlib_already_imported_the_magic_switches(in_kernel):
    import matplotlib  # noqa: F401  (imported: the magic is needed)

    env = {"MPLBACKEND": "Agg"}
    assert environment.use_inline_plots(env)
    assert in_kernel.magics == [("matplotlib", "inline")]


def test_nothing_changes_outside_a_kernel_or_without_the_variable(in_kernel, monkeypatch):
    assert environment.use_inline_plots({}) is None
    assert environment.use_inline_plots({"MPLBACKEND": environment.INLINE_BACKEND}) is None
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: None))
    env = {"MPLBACKEND": "Agg"}
    assert environment.use_inline_plots(env) is None and env == {"MPLBACKEND": "Agg"}


# --- in a fresh interpreter: the setup cell's own behaviour --------------------------------------------


def _setup(env: dict, n: int = 2, cwd=None) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        from course_lib.devices import setup_devices, DeviceSetupError
        try:
            rep = setup_devices({n}, "cpu")
            import jax
            print("devices", rep.n_devices, len(jax.devices()))
        except DeviceSetupError as e:
            print("caught:", e)
    """)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**base, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_an_invalid_jax_variable_value_is_named_not_jaxs_internal_option():
    r = _setup({"JAX_NUM_CPU_DEVICES": "four"})
    assert (
        "caught: JAX_NUM_CPU_DEVICES='four' in the environment is not a valid value" in r.stdout
    ), r.stderr
    assert "restart the kernel" in r.stdout


def test_x64_and_another_prng_stop_the_setup_naming_both():
    r = _setup({"JAX_ENABLE_X64": "1", "JAX_DEFAULT_PRNG_IMPL": "rbg"})
    assert "caught: JAX is configured differently" in r.stdout, r.stderr
    assert "JAX_ENABLE_X64='1'" in r.stdout and "JAX_DEFAULT_PRNG_IMPL='rbg'" in r.stdout


def test_variables_that_the_setup_overrides_or_that_do_no_harm_work():
    # another device count in both places JAX reads one, compile logging, fewer threads: 2 devices anyway
    env = {"JAX_NUM_CPU_DEVICES": "4", "JAX_LOG_COMPILES": "1", "OMP_NUM_THREADS": "1"}
    r = _setup({**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=3"})
    assert r.stdout.split() == ["devices", "2", "2"], r.stdout + r.stderr[-2000:]


def test_an_ascii_locale_stops_the_setup():
    r = _setup({"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0"})
    assert "caught: this Python encodes text as" in r.stdout and "PYTHONUTF8=1" in r.stdout, (
        r.stderr
    )


def test_pythonpath_naming_another_copy_of_the_course_stops_the_setup_in_a_notebook_folder(
    tmp_path,
):
    other = tmp_path / "other"
    shutil.copytree(
        ROOT / "course_lib", other / "course_lib", ignore=shutil.ignore_patterns("__pycache__")
    )
    r = _setup({"PYTHONPATH": str(other)}, cwd=ROOT / "notebooks")
    assert "caught: this notebook belongs to the course in" in r.stdout, r.stdout + r.stderr[-2000:]
    assert f"PYTHONPATH={str(other)!r}" in r.stdout
    assert _setup({"PYTHONPATH": str(other)}, cwd=tmp_path).stdout.startswith(
        "devices"
    )  # not a checkout


# --- plots in an executed notebook, whatever MPLBACKEND says --------------------------------------------

PLOTS = (
    "from course_lib.devices import setup_devices\nreport = setup_devices(1, 'cpu')\nprint(report)",
    "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()",
    "fig, ax = plt.subplots()\nax.plot([3, 1]);",
)


@pytest.mark.parametrize("backend", ["Agg", "agggg"])
def test_plots_appear_inline_whatever_backend_the_environment_presets(tmp_path, backend):
    nb = faults.make_notebook(tmp_path / "plots.ipynb", *PLOTS)
    out = tmp_path / "plots-out.ipynb"
    execute(nb, out, {}, progress=False, env={"MPLBACKEND": backend})
    cells = json.loads(out.read_text())["cells"]
    images = [sum("image/png" in o.get("data", {}) for o in c.get("outputs", [])) for c in cells]
    assert images == [0, 0, 1, 1]
    printed = "".join(cells[1]["outputs"][0]["text"])
    assert f"MPLBACKEND={backend!r} from the environment replaced by the inline backend" in printed

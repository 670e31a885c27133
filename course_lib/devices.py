"""Device setup: real TPU chips or GPUs, or simulated CPU devices, fixed before JAX starts.

Every notebook calls :func:`setup_devices` in the cell right after its parameters cell. On the CPU
backend it *simulates* ``n_devices`` devices with ``jax.config.update("jax_num_cpu_devices", n)``,
which only works before the first JAX operation (``notebooks/00_setup.ipynb`` shows why). On a TPU or
GPU host it uses the first ``n_devices`` chips, and its report names the chip from the table of
:mod:`course_lib.chips` (peak FLOP/s, HBM, links, with sources) and the memory XLA may use on it
(``memory_stats()["bytes_limit"]``).

The module imports JAX lazily, inside :func:`setup_devices`, so importing ``course_lib`` never starts a
backend.
"""

from __future__ import annotations

import dataclasses
import os
import platform as _platform
import re
from collections.abc import Sequence
from typing import Any

PLATFORMS = ("auto", "cpu", "gpu", "tpu")
"""The ``platform`` values: ``"auto"`` takes the accelerator JAX has (TPU or GPU), else simulated CPU devices."""

# One XLA flag: "--name" or "--name=value", ASCII only (an en dash or a missing "--" aborts XLA later).
_XLA_FLAG = re.compile(r"^--[A-Za-z0-9_]+(=[\x21-\x7e]*)?$")


class DeviceSetupError(RuntimeError):
    """The devices asked for cannot be provided; the message names the value and the fix."""


@dataclasses.dataclass(frozen=True)
class DeviceReport:
    """What :func:`setup_devices` set up.

    Attributes:
      platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``: the backend the devices belong to.
      device_kind: ``jax.Device.device_kind`` of the first device, e.g. ``"cpu"``, ``"TPU v5 lite"`` or
        ``"NVIDIA H100 80GB HBM3"``.
      n_devices: number of devices the course uses (``len(devices)``).
      simulated: True when the devices are simulated CPU devices sharing this machine's cores.
      devices: the ``jax.Device`` objects to use, in order; meshes and ``pmap`` take them from here.
      n_available: devices of this platform that JAX sees (may exceed ``n_devices`` on a GPU host).
      jax_version, jaxlib_version, python_version: versions, for results metadata.
      host_cpus: ``os.cpu_count()`` of this machine.
      notes: what the setup changed or wants known about the environment (e.g. an ``MPLBACKEND`` replaced
        by the inline backend), printed with the report.
      chip: the :class:`course_lib.chips.Peak` entry of ``device_kind`` (peak dense bf16 FLOP/s, HBM bytes
        and bandwidth, link bandwidth, source); None on simulated CPU devices (no fabric, no peak claimed)
        and on a chip the table does not list.
      bytes_limit: bytes XLA may allocate on the first device (``memory_stats()["bytes_limit"]``); None where
        the backend reports no allocator statistics (CPU).
    """

    platform: str
    device_kind: str
    n_devices: int
    simulated: bool
    devices: tuple[Any, ...]
    n_available: int
    jax_version: str
    jaxlib_version: str
    python_version: str
    host_cpus: int
    notes: tuple[str, ...] = ()
    chip: Any = None
    bytes_limit: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The report without the device objects: plain values for a table or a CSV row.

        The chip's figures are flattened: ``chip`` (its name, ``""`` without one), ``peak_bf16_flops_per_s``,
        ``hbm_bytes``, ``hbm_bytes_per_s``, ``link_bytes_per_s`` (None without a figure), ``chip_source``.
        """
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["devices"] = ", ".join(str(x) for x in self.devices)
        d["notes"] = "; ".join(self.notes)
        c = self.chip
        d["chip"] = "" if c is None else c.name
        d["peak_bf16_flops_per_s"] = None if c is None else c.peak_bf16_flops_per_s
        for key in ("hbm_bytes", "hbm_bytes_per_s", "link_bytes_per_s"):
            d[key] = None if c is None else getattr(c, key)
        d["chip_source"] = "" if c is None else f"{c.source} ({c.url})" if c.url else c.source
        return d

    def chip_line(self) -> str:
        """What the devices are, as hardware: the chip's figures and source, or why there are none."""
        if self.simulated:
            return (
                "simulated CPU devices: threads of one process, not a fabric; no HBM, no links, "
                "no peak FLOP/s claimed"
            )
        if self.chip is None:
            return f"{self.device_kind!r} is not in course_lib.chips.PEAKS: no peak FLOP/s claimed"
        source = f"{self.chip.source} ({self.chip.url})" if self.chip.url else self.chip.source
        return f"{self.chip.describe()} [source: {source}]"

    def __str__(self) -> str:
        kind = "simulated on the CPU" if self.simulated else "real"
        lines = [
            f"platform     : {self.platform} ({kind})",
            f"devices      : {self.n_devices} of {self.n_available} available ({self.device_kind})",
            f"device list  : {', '.join(str(d) for d in self.devices)}",
            f"jax / jaxlib : {self.jax_version} / {self.jaxlib_version}",
            f"python       : {self.python_version} on {self.host_cpus} host CPU cores",
        ]
        if self.simulated and self.n_devices > 1:
            lines.append(
                "note         : simulated devices share this machine's cores; timings are relative, not speedups"
            )
        lines.append(f"chip         : {self.chip_line()}")
        if self.bytes_limit is not None:
            lines.append(
                f"memory       : bytes_limit {self.bytes_limit / 2**30:.2f} GiB per device "
                f"(memory_stats(): what XLA may allocate)"
            )
        lines += [f"note         : {note}" for note in self.notes]
        return "\n".join(lines)


def parse_n_devices(n_devices: Any) -> int:
    """A device count given as an int or a decimal string (papermill ``-r`` passes strings).

    The rule of :func:`course_lib.config.coerce`, the one every parameter goes through.

    Returns:
      The count as a positive ``int``.

    Raises:
      ValueError: for a non-integer (``"eight"``, ``2.5``, ``True``) or a count ≤ 0.
    """
    from .config import N_DEVICES, coerce

    return coerce(N_DEVICES, n_devices)


def check_xla_flags(flags: str | None = None) -> list[str]:
    """Check an ``XLA_FLAGS`` string before XLA parses it (a malformed one aborts the process later).

    Args:
      flags: the string to check; ``None`` reads ``os.environ["XLA_FLAGS"]``.

    Returns:
      The individual flags, e.g. ``["--xla_force_host_platform_device_count=8"]``.

    Raises:
      DeviceSetupError: naming the first malformed token (missing ``--``, a non-ASCII dash, spaces
        around ``=``) and how to fix or unset the variable.
    """
    if flags is None:
        flags = os.environ.get("XLA_FLAGS", "")
    tokens = flags.split()
    for tok in tokens:
        if not _XLA_FLAG.match(tok):
            hint = ""
            if any(ch in tok for ch in "\u2013\u2014\u2212"):
                hint = " (it contains a typographic dash; type two ASCII hyphens '--')"
            elif tok == "=" or tok.startswith("="):
                hint = " (no spaces around '=': write --name=value)"
            elif not tok.startswith("--"):
                hint = " (every flag starts with '--')"
            raise DeviceSetupError(
                f"XLA_FLAGS contains a malformed flag {tok!r}{hint}. XLA would abort the process on first "
                f"use. Fix it, or remove it: `unset XLA_FLAGS` in the shell that starts Jupyter, or "
                f"os.environ.pop('XLA_FLAGS') before JAX starts, then restart the kernel."
            )
    return tokens


FLAGS_CHECKED = "COURSE_XLA_FLAGS_CHECKED"
"""An environment variable: when it holds exactly this environment's ``XLA_FLAGS``, :func:`setup_devices`
does not probe them again (a process that started XLA with these flags sets it for the processes it starts,
e.g. the test session for its notebooks' kernels: each probe is a Python start, about a CPU-second)."""


def probe_xla_flags(timeout_s: float = 120) -> None:
    """Start XLA once in a subprocess with this environment's ``XLA_FLAGS``: XLA aborts the whole process
    on a flag it does not know (e.g. a misspelt name), which in a notebook kills the kernel.

    Raises:
      DeviceSetupError: the probe died; the message quotes XLA's complaint and names the fix.
    """
    import subprocess
    import sys

    code = "import jax; jax.devices()"
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s
    )
    if r.returncode != 0:
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        hint = next(
            (line for line in lines if "flag" in line.lower()),
            lines[-1] if lines else f"exit {r.returncode}",
        )
        raise DeviceSetupError(
            f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} makes XLA abort the process: {hint.strip()[:300]}. "
            f"Fix the flag (check its spelling) or remove it: `unset XLA_FLAGS` in the shell that starts Jupyter, "
            f"or os.environ.pop('XLA_FLAGS') before JAX starts, then restart the kernel."
        )


def _backends_started() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:  # private API moved: fall back to the public behaviour below
        return False


def setup_devices(
    n_devices: Any = 8, platform: str = "auto", *, measures_compiles: bool = False
) -> DeviceReport:
    """Make ``n_devices`` JAX devices available and verify the count; call before any JAX operation.

    It first checks the environment the notebook inherited (:mod:`course_lib.environment`): a text encoding
    other than UTF-8, a ``PYTHONPATH`` that imports another copy of ``course_lib``, JAX options that break
    the lessons or change their numbers (``JAX_ENABLE_X64``, ``JAX_DISABLE_JIT``, ``JAX_DEFAULT_PRNG_IMPL``
    …) stop here with the variable named; in a Jupyter kernel an inherited ``MPLBACKEND`` is replaced by the
    inline backend, so plots show in the notebook.

    Args:
      n_devices: how many devices to use: an int, or a decimal string such as ``"8"``.
      platform: ``"auto"`` (the accelerator JAX has, TPU or GPU, else simulated CPU devices), ``"cpu"``
        (simulated CPU devices even on a TPU or GPU host), ``"gpu"`` or ``"tpu"`` (that accelerator only; an
        error naming the fix without it).
      measures_compiles: True in a lesson that times compiles (02, 07): a persistent compilation cache
        (``JAX_COMPILATION_CACHE_DIR``) is switched off in this kernel, with a note
        (:func:`course_lib.environment.switch_off_persistent_cache`).

    Returns:
      A :class:`DeviceReport`; ``report.devices`` are the devices the rest of the notebook uses.

    Raises:
      ValueError: ``n_devices`` is not a positive integer, or ``platform`` is not one of ``PLATFORMS``.
      DeviceSetupError: ``XLA_FLAGS`` is malformed; the environment is one the course cannot run in (see
        above); JAX already started with another device count (restart the kernel); more GPUs asked for
        than exist (the message names the chip, its count and the fix); ``platform="gpu"`` or ``"tpu"``
        without that backend.
    """
    from . import environment

    flags = check_xla_flags()
    environment.check_encoding()
    environment.check_checkout()
    notes = [environment.use_inline_plots()]
    jax = environment.import_jax()  # first: course_lib.config imports JAX too
    jax_notes = environment.check_jax_options(jax.config)  # raises on options that break a lesson
    if measures_compiles:  # the cache's note replaced by the switch's
        jax_notes = [n for n in jax_notes if not n.startswith("JAX_COMPILATION_CACHE_DIR=")]
        jax_notes += environment.switch_off_persistent_cache(jax.config, _backends_started())
    notes += jax_notes
    from .config import PLATFORM, coerce

    n = parse_n_devices(n_devices)
    platform = coerce(PLATFORM, platform)

    started = _backends_started()
    if flags and not started and os.environ.get(FLAGS_CHECKED) != os.environ.get("XLA_FLAGS"):
        probe_xla_flags()
    if not started:
        if platform == "cpu":
            jax.config.update("jax_platforms", "cpu")
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:
            started = True  # a JAX operation ran before this call
    if started:
        _check_running_backend(jax, n, platform)
    backend = _start_backend(jax, platform)
    available = jax.devices()
    devices = select_devices(n, available, backend)

    import jaxlib

    return DeviceReport(
        platform=backend,
        device_kind=devices[0].device_kind,
        n_devices=n,
        simulated=backend == "cpu",
        devices=devices,
        n_available=len(available),
        jax_version=jax.__version__,
        jaxlib_version=getattr(jaxlib, "__version__", "unknown"),
        python_version=_platform.python_version(),
        host_cpus=os.cpu_count() or 1,
        notes=tuple(note for note in notes if note),
        chip=_chip(backend, devices[0]),
        bytes_limit=_bytes_limit(devices[0]),
    )


def _chip(backend: str, device: Any) -> Any:
    """The :data:`course_lib.chips.PEAKS` entry of ``device``; None on simulated CPU devices."""
    from .chips import chip_for

    return None if backend == "cpu" else chip_for(device.device_kind)


def _bytes_limit(device: Any) -> int | None:
    """``device.memory_stats()["bytes_limit"]``, or None where the backend keeps no statistics (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without allocator statistics
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def _start_backend(jax: Any, platform: str) -> str:
    """Start JAX's default backend; a backend that cannot start, or no GPU/TPU for platform='gpu'/'tpu', is
    named with the fix."""
    try:
        backend = jax.default_backend()
    except Exception as e:  # e.g. JAX_PLATFORMS names a backend that is not installed
        env = {
            k: os.environ[k]
            for k in ("JAX_PLATFORMS", "JAX_PLATFORM_NAME", "CUDA_VISIBLE_DEVICES")
            if k in os.environ
        }
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DeviceSetupError(
            f"JAX could not start a backend ({type(e).__name__}: {first}); "
            f"environment: {env or 'no JAX_PLATFORMS set'}. "
            f"Unset JAX_PLATFORMS / JAX_PLATFORM_NAME (or set JAX_PLATFORMS=cpu) and restart the kernel, or install "
            f"the backend you asked for."
        ) from e
    if platform == "gpu" and backend != "gpu":
        raise DeviceSetupError(
            f"platform='gpu' but JAX's backend is {backend!r}: no GPU is visible to JAX. Install the CUDA "
            f"build of the same JAX (pip install 'jax[cuda12]=={jax.__version__}'), check nvidia-smi and "
            f"CUDA_VISIBLE_DEVICES, or use platform='auto' / 'cpu' to run on simulated CPU devices."
        )
    if platform == "tpu" and backend != "tpu":
        raise DeviceSetupError(
            f"platform='tpu' but JAX's backend is {backend!r}: no TPU is visible to JAX. On a TPU VM (Colab's or "
            f"Kaggle's TPU runtime, a Cloud TPU) install the same JAX with its TPU runtime "
            f"(pip install 'jax[tpu]=={jax.__version__}': lesson 00 checks the pin), check that no other "
            f"process holds the chips and that JAX_PLATFORMS is unset, and restart the kernel; "
            f"or use platform='auto' / 'cpu' to run on simulated CPU devices."
        )
    return backend


def _check_running_backend(jax: Any, n: int, platform: str) -> None:
    """JAX started before :func:`setup_devices`: the backend and count it has must be the ones asked for."""
    if platform == "cpu" and jax.default_backend() != "cpu":
        raise DeviceSetupError(
            f"platform='cpu' was asked for, but JAX already started on {jax.default_backend()!r}. Restart the "
            f"kernel and run the device setup cell before any other JAX code."
        )
    if jax.default_backend() == "cpu" and len(jax.devices()) != n:
        raise DeviceSetupError(
            f"JAX already started with {len(jax.devices())} CPU device(s), and the count cannot change in a "
            f"running process (asked for n_devices={n}). Restart the kernel and run the notebook from the "
            f"top: the device setup cell must run before any other JAX code."
        )


def select_devices(n: int, available: Sequence[Any], backend: str) -> tuple[Any, ...]:
    """The first ``n`` of the ``available`` devices of ``backend``, or an error naming the fix.

    Raises:
      DeviceSetupError: fewer devices than ``n`` (on a TPU or GPU: the message names the chip kind and
        count, and the fix: ``n_devices <= k``, or platform='cpu' to simulate ``n``; on CPU: the count was
        fixed earlier, restart the kernel).
    """
    if len(available) < n:
        if backend == "cpu":
            raise DeviceSetupError(
                f"asked for n_devices={n} but JAX reports {len(available)} CPU device(s). Something set the count "
                f"before this call (JAX_NUM_CPU_DEVICES or an earlier jax.config.update). Restart the kernel."
            )
        kind = available[0].device_kind if available else backend
        what = "chip(s)" if backend == "tpu" else "device(s)"
        raise DeviceSetupError(
            f"asked for n_devices={n} but only {len(available)} {backend.upper()} {what} exist ({kind}). "
            f"Use n_devices <= {len(available)}, or platform='cpu' to simulate {n} devices."
        )
    return tuple(available[:n])


def device_subsets(devices: Sequence[Any], max_n: int | None = None) -> list[int]:
    """Device counts 1, 2, 4, … up to ``len(devices)`` (and ``len(devices)`` itself), for scaling views.

    Args:
      devices: the devices available (``report.devices``).
      max_n: optional cap.

    Returns:
      Sorted counts, e.g. ``[1, 2, 4, 8]`` for 8 devices, ``[1, 2, 3]`` for 3.
    """
    total = len(devices) if max_n is None else min(len(devices), max_n)
    counts = {1, total}
    k = 2
    while k < total:
        counts.add(k)
        k *= 2
    return sorted(c for c in counts if c >= 1)

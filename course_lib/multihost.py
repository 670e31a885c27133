"""Multi-process JAX on one machine: P processes × D simulated CPU devices, one global mesh.

JAX is *multi-controller*: every process runs the same Python program, sees only its own (*local*,
*addressable*) devices, and joins the others through ``jax.distributed.initialize``. After that,
``jax.devices()`` lists the *global* devices of all processes, a mesh built from them spans the processes,
and a jitted or ``shard_map``-ed step runs on it unchanged; XLA inserts the cross-process collectives
(gloo on CPU, NCCL on GPU).

This module has two halves:

- the **worker** (``python -m course_lib.multihost worker ...``): one process of the group. It fixes its
  local device count before JAX starts, calls ``jax.distributed.initialize``, builds the lab's
  ``"sharded_jit"`` (data parallel) and ``"shard_map"`` (data × model) strategies on the global devices,
  feeds each step with :func:`jax.make_array_from_process_local_data` (each process supplies only its rows of
  the global batch) and writes its losses as JSON; process 0 also writes the final parameters.
- the **launcher** (:func:`launch`): starts the P workers on localhost with a coordinator on a free loopback
  port, waits for them under a timeout, and shuts every one down (its whole process group) as soon as one
  fails, raising :class:`WorkerFailed` that names the process and shows its last output lines.

:func:`train_strategies` is the loop both halves share: the notebook runs it in its own kernel on 1 process ×
8 devices as the reference, the workers run it on 2 processes × 4 devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

MULTIHOST_STRATEGIES = ("sharded_jit", "shard_map")
"""The lab strategies the workers run: D (data parallel, sharded jit) and C (data × model, shard_map)."""

FAIL_STAGES = ("init", "train")
"""Where a worker told to fail (``--fail``) raises: before ``jax.distributed.initialize`` or after it, before
the first step (the other processes are then waiting for it in a collective)."""

# Environment variables that would change a worker's device count or backend behind its back.
_STRIP_ENV = ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS", "JAX_PLATFORM_NAME", "CUDA_VISIBLE_DEVICES",
              "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "COURSE_MULTIHOST_FAIL")

_REPO_ROOT = Path(__file__).resolve().parent.parent


class MultiProcessError(RuntimeError):
    """A multi-process run did not finish. Attributes name what happened so a caller can assert on it.

    Attributes:
      process_id: the process the error is about (the first to fail), or None for a timeout.
      returncode: its exit status (None when it was still running).
      tail: its last output lines (stdout and stderr together), as one string.
      pids: the operating-system ids of every worker started; all have been killed and reaped.
      log_dir: the folder with each process's full log (``process_<i>.log``).
    """

    def __init__(self, message: str, *, process_id=None, returncode=None, tail="", pids=(), log_dir=None):
        super().__init__(message)
        self.process_id = process_id
        self.returncode = returncode
        self.tail = tail
        self.pids = tuple(pids)
        self.log_dir = log_dir


class WorkerFailed(MultiProcessError):
    """A worker exited with a non-zero status; the message names it and shows its last output lines."""


class WorkerTimeout(MultiProcessError):
    """The workers did not all finish within ``timeout_s``; the message names the ones still running."""


@dataclasses.dataclass(frozen=True)
class MultiProcessRun:
    """The outcome of :func:`launch`.

    Attributes:
      n_processes: P, processes started.
      local_devices: D, simulated CPU devices per process.
      losses: ``{strategy: [loss per step]}`` as process 0 saw them (float, nats, the global-batch mean
        before each update).
      outputs: each process's JSON output, in process order (see :func:`run_worker` for the keys).
      params: ``{strategy: {leaf_path: numpy array}}``, the final parameters process 0 saved (global copies).
      wall_s: seconds from starting the first worker to the last one exiting (startup and compiles included).
      pids: the workers' operating-system ids (all exited when ``launch`` returns).
      out_dir: the folder holding ``process_<i>.json``, ``process_<i>.log`` and ``params_<strategy>.npz``.
    """

    n_processes: int
    local_devices: int
    losses: dict
    outputs: tuple
    params: dict
    wall_s: float
    pids: tuple
    out_dir: str

    @property
    def n_devices(self) -> int:
        """P × D, the global device count."""
        return self.n_processes * self.local_devices


# ----------------------------------------------------------------------------------------------------------
# Planning and small helpers (no JAX needed)
# ----------------------------------------------------------------------------------------------------------


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer (at least 1)")
    return value


def plan(n_devices: int, n_processes: int | None = None, fallback: bool = False) -> tuple[int, int, str]:
    """Split ``n_devices`` global devices into processes × local devices for a local multi-process run.

    Args:
      n_devices: the global device count wanted (≥ 1).
      n_processes: processes wanted; ``None`` picks 2 when ``n_devices`` is even, else 1.
      fallback: when ``n_processes`` does not divide ``n_devices``, use 1 process (and say so) instead of raising.

    Returns:
      ``(n_processes, local_devices, why)``: ``n_processes * local_devices == n_devices``, and a one-line
      explanation to print.

    Raises:
      ValueError: a count that is not a positive integer, or ``n_processes`` that does not divide
        ``n_devices`` (the message lists the counts that do).
    """
    n_devices = _positive_int(n_devices, "n_devices")
    if n_processes is None:
        n_processes = 2 if n_devices % 2 == 0 else 1
        why = ("2 processes: the device count is even, so each process gets half"
               if n_processes == 2 else
               f"1 process: {n_devices} device(s) cannot be split evenly over 2 processes")
    else:
        n_processes = _positive_int(n_processes, "n_processes")
        why = f"{n_processes} process(es), as asked"
        if fallback and n_devices % n_processes:
            why = f"1 process: {n_devices} device(s) cannot be split evenly over {n_processes} processes"
            n_processes = 1
    local = split_devices(n_devices, n_processes)
    return n_processes, local, f"{why}: {n_processes} process(es) x {local} local device(s) = {n_devices} global devices"


def split_devices(n_devices: int, n_processes: int) -> int:
    """Local devices per process when ``n_devices`` are shared evenly by ``n_processes``.

    Raises:
      ValueError: a non-positive count, or ``n_processes`` not dividing ``n_devices`` (divisors named).
    """
    n_devices = _positive_int(n_devices, "n_devices")
    n_processes = _positive_int(n_processes, "n_processes")
    if n_devices % n_processes:
        divisors = [d for d in range(1, n_devices + 1) if n_devices % d == 0]
        raise ValueError(
            f"{n_devices} devices do not split evenly over {n_processes} processes; every process needs the same "
            f"number of local devices: use n_processes in {divisors}"
        )
    return n_devices // n_processes


def process_rows(global_batch: int, n_processes: int, process_index: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a global batch that process ``process_index`` loads under data parallelism.

    Assumes the usual device order (``jax.devices()`` lists process 0's devices first, then process 1's, …)
    and a batch split over all devices along axis 0, so each process owns one contiguous block.

    Raises:
      ValueError: ``global_batch`` not divisible by ``n_processes``, or ``process_index`` out of range.
    """
    global_batch = _positive_int(global_batch, "global_batch")
    n_processes = _positive_int(n_processes, "n_processes")
    if not isinstance(process_index, int) or not 0 <= process_index < n_processes:
        raise ValueError(f"process_index={process_index!r} must be in [0, {n_processes})")
    if global_batch % n_processes:
        raise ValueError(f"global batch {global_batch} is not divisible by {n_processes} processes; use a multiple of {n_processes}")
    per = global_batch // n_processes
    return process_index * per, (process_index + 1) * per


def local_rows(sharding: Any, global_shape: Sequence[int]) -> tuple[int, int]:
    """Rows ``[start, stop)`` along axis 0 that this process's devices hold under ``sharding``.

    Args:
      sharding: a ``jax.sharding.Sharding`` of the global batch, e.g. ``NamedSharding(mesh, P("data"))``.
      global_shape: the global array's shape, e.g. ``(32, 16, 16, 3)``.

    Raises:
      ValueError: the local rows are not one contiguous block (a device order that interleaves processes;
        build the mesh from ``jax.devices()`` in its own order).
    """
    B = int(global_shape[0])
    spans = set()
    for index in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
        s = index[0] if index else slice(None)
        spans.add((s.start or 0, B if s.stop is None else s.stop))
    start, stop = min(a for a, _ in spans), max(b for _, b in spans)
    covered = sum(b - a for a, b in sorted(spans))
    if covered != stop - start:
        raise ValueError(
            f"this process's devices hold rows {sorted(spans)} of the global batch, not one contiguous block; "
            f"build the mesh from jax.devices() in its own order so each process owns consecutive rows"
        )
    return start, stop


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (bind to port 0, read the port the OS chose, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def worker_env(base: dict | None = None) -> dict:
    """The environment for a CPU worker: ``base`` (default ``os.environ``) without the variables that fix a
    device count or backend (``XLA_FLAGS``, ``JAX_NUM_CPU_DEVICES``, ``JAX_PLATFORMS``, …), plus
    ``JAX_PLATFORMS=cpu`` and this repository on ``PYTHONPATH``."""
    env = dict(os.environ if base is None else base)
    for name in _STRIP_ENV:
        env.pop(name, None)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def survivors(pids: Sequence[int]) -> list[int]:
    """Processes still alive (zombies excluded) among ``pids`` or in the process groups they lead.

    Uses ``psutil`` when installed, else ``/proc``, else ``os.kill(pid, 0)`` on the pids alone.

    Returns:
      The live pids, sorted; ``[]`` means nothing a launch started is left.
    """
    pids = set(int(p) for p in pids)
    found = set()
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        for proc in psutil.process_iter(["pid", "status"]):
            try:
                if proc.info["status"] != psutil.STATUS_ZOMBIE and (proc.pid in pids or os.getpgid(proc.pid) in pids):
                    found.add(proc.pid)
            except (psutil.Error, OSError):
                continue
    elif os.path.isdir("/proc"):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ... after "pid (comm) "
            if fields[0] != "Z" and (int(entry) in pids or int(fields[2]) in pids):
                found.add(int(entry))
    else:  # pragma: no cover - neither psutil nor /proc
        for pid in pids:
            try:
                os.kill(pid, 0)
                found.add(pid)
            except ProcessLookupError:
                pass
            except PermissionError:
                found.add(pid)
    return sorted(found)


def tail(path: str | Path, n_lines: int = 15) -> str:
    """The last ``n_lines`` lines of a text file ('' when it does not exist)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip("\n").splitlines()[-n_lines:])


# ----------------------------------------------------------------------------------------------------------
# The training loop shared by the kernel (reference) and the workers
# ----------------------------------------------------------------------------------------------------------


def to_global_batch(local_batch: Any, sharding: Any, global_batch: int) -> Any:
    """Assemble a global batch from this process's rows: ``jax.make_array_from_process_local_data``.

    Args:
      local_batch: ``(images, labels)`` numpy arrays holding only this process's rows
        (float32 [rows, H, W, C], int32 [rows]); in a single process, the whole batch.
      sharding: the global batch's sharding, e.g. ``NamedSharding(mesh, P("data"))``.
      global_batch: the global batch size (rows over all processes).

    Returns:
      ``(images, labels)`` as global ``jax.Array``s of leading size ``global_batch``, laid out by ``sharding``.
    """
    import jax

    return tuple(
        jax.make_array_from_process_local_data(sharding, x, (global_batch,) + tuple(x.shape[1:])) for x in local_batch
    )


def prepare_inputs(folder: str | Path, profile: str = "tiny", steps: int = 3, seed: int = 0, batches: bool = True,
                   global_batch: int | None = None) -> Path:
    """Write the run's initial parameters and global batches to ``folder``, once, for every process to read.

    The values are exactly those :func:`course_lib.lab.run_strategy` uses for the same profile and seed:
    parameters from ``init_model(key(seed))``, batch *i* from ``fold_in(key(seed + 1), i)``. Preparing them
    once in the launcher spares every worker the same start-up compiles; it is also how a real job shares a
    dataset: one file, and each process reads only its rows (``np.load(..., mmap_mode="r")[i, start:stop]``).

    Files: ``params.npz`` (one array per leaf, named ``"conv1/kernel"`` …), ``images.npy`` float32
    [steps, global_batch, H, W, 3], ``labels.npy`` int32 [steps, global_batch], ``inputs.json`` (profile,
    steps, seed, batches, global_batch). ``global_batch`` overrides the profile's (e.g. a multiple of 3 for
    3 devices); :func:`train_strategies` reads it back from ``inputs.json``. With ``batches=False`` only the parameters are written (the workers then generate
    the batches on their devices, ``data="device"`` in :func:`train_strategies`: for large profiles).

    Returns:
      ``folder`` as a ``Path``.

    Raises:
      ValueError: unknown profile or steps < 1.
    """
    import jax
    import numpy as np

    from . import data as data_lib
    from . import model as model_lib
    from .lab import PROFILES

    if profile not in PROFILES:
        raise ValueError(f"profile={profile!r} is not one of {list(PROFILES)}")
    steps = _positive_int(steps, "steps")
    config = PROFILES[profile]
    if global_batch is not None:
        config = dataclasses.replace(config, global_batch=_positive_int(global_batch, "global_batch"))
    mcfg = config.model_config()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _, params = model_lib.init_model(jax.random.key(seed), mcfg)
    np.savez(folder / "params.npz", **_flatten(jax.device_get(params)))
    ds = data_lib.SyntheticImages(image_size=config.image_size, num_classes=mcfg.num_classes, signal=config.signal)
    if batches:
        host = jax.device_get(data_lib.batches(ds, jax.random.key(seed + 1), steps, config.global_batch))
        np.save(folder / "images.npy", np.stack([b[0] for b in host]))
        np.save(folder / "labels.npy", np.stack([b[1] for b in host]))
    meta = {"profile": profile, "steps": steps, "seed": seed, "batches": bool(batches), "global_batch": config.global_batch}
    (folder / "inputs.json").write_text(json.dumps(meta))
    return folder


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _unflatten(flat: dict) -> dict:
    out: dict = {}
    for name, v in flat.items():
        *path, leaf = name.split("/")
        d = out
        for k in path:
            d = d.setdefault(k, {})
        d[leaf] = v
    return out


def train_strategies(
    devices: Sequence[Any],
    inputs: str | Path,
    keys: Sequence[str] = MULTIHOST_STRATEGIES,
    steps: int | None = None,
    data: str = "file",
) -> dict:
    """Train the lab's CNN with each strategy in ``keys`` on ``devices`` (the global devices in a group).

    The same code runs in one process (the reference) and in every process of a group: the strategies come
    from :func:`course_lib.strategies.build` unchanged and the step is the lab's; only the batch is assembled
    per process, from this process's rows, with :func:`to_global_batch`.

    Args:
      devices: the devices to build the meshes from, in order (``jax.devices()``).
      inputs: a folder written by :func:`prepare_inputs` (parameters and batches).
      keys: strategies, from :data:`MULTIHOST_STRATEGIES`.
      steps: steps per strategy; default all the batches in ``inputs``.
      data: ``"file"``: each process reads its rows of the prepared batches and calls
        :func:`to_global_batch`; ``"device"``: the lab's on-device generation (``SyntheticImages.batch`` with
        the global sharding: one jitted program in which each process computes only its devices' rows; same
        values, nothing read from disk; for large profiles).

    Returns:
      ``{strategy: {"losses": [float per step], "mesh": "data=4 x model=2", "rows": [start, stop],
      "params": {leaf_path: numpy array}}}``. ``rows`` are the global-batch rows this process supplied;
      ``params`` are full global copies of the final parameters, gathered from every process (a collective:
      every process must call this).

    Raises:
      ValueError: an unknown strategy, more steps than prepared batches, or a global batch the data shards
        do not divide.
    """
    import jax
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils

    from . import model as model_lib
    from . import strategies as strategies_lib
    from .lab import PROFILES, check_divisibility
    from .steps import init_state, make_optimizer

    unknown = [k for k in keys if k not in MULTIHOST_STRATEGIES]
    if unknown:
        raise ValueError(f"strategies {unknown} are not run multi-process; choose from {MULTIHOST_STRATEGIES}")
    inputs = Path(inputs)
    meta = json.loads((inputs / "inputs.json").read_text())
    config = PROFILES[meta["profile"]]
    if "global_batch" in meta:  # the batch prepare_inputs wrote (may differ from the profile's)
        config = dataclasses.replace(config, global_batch=meta["global_batch"])
    steps = meta["steps"] if steps is None else _positive_int(steps, "steps")
    if data not in ("file", "device"):
        raise ValueError(f"data={data!r} must be 'file' or 'device'")
    if data == "file" and not meta.get("batches", True):
        raise ValueError(f"{inputs} holds no batches (prepare_inputs(batches=False)); use data='device'")
    if data == "file" and steps > meta["steps"]:
        raise ValueError(f"steps={steps} but {inputs} holds {meta['steps']} batches; prepare_inputs(steps={steps})")
    devices = list(devices)
    check_divisibility(config, len(devices), keys)
    mcfg = config.model_config()
    optimizer = make_optimizer(config.learning_rate)
    # The structure only: no parameter is computed here (they come from the file).
    graphdef, _ = nnx.eval_shape(lambda: model_lib.init_model(jax.random.key(meta["seed"]), mcfg))
    with np.load(inputs / "params.npz") as f:
        params = _unflatten({name: f[name] for name in f.files})
    B = config.global_batch
    if data == "file":
        images = np.load(inputs / "images.npy", mmap_mode="r")  # [steps, B, H, W, C], read lazily
        labels = np.load(inputs / "labels.npy", mmap_mode="r")  # [steps, B]
    else:
        from . import data as data_lib

        ds = data_lib.SyntheticImages(image_size=config.image_size, num_classes=mcfg.num_classes, signal=config.signal)
        data_key = jax.random.key(meta["seed"] + 1)

    out = {}
    for key in keys:
        strat = strategies_lib.build(key, graphdef, params, optimizer, devices)
        # Every process holds the same host copy; device_put onto a global sharding keeps, on each process,
        # the pieces its own devices hold.
        state = strat.place_state(init_state(params, optimizer))
        start, stop = local_rows(strat.batch_sharding, (B,))
        losses = []
        for i in range(steps):
            if data == "file":
                # Data loading is per process: read only this process's rows of batch i ...
                local = (np.asarray(images[i, start:stop]), np.asarray(labels[i, start:stop]))
                # ... and declare them as its part of one global array (no data moves between processes).
                batch = to_global_batch(local, strat.batch_sharding, B)
            else:
                batch = ds.batch(jax.random.fold_in(data_key, i), B, strat.batch_sharding)
            state, metrics = strat.step(state, batch)  # the lab's step, unchanged
            losses.append(float(metrics["loss"]))  # a replicated scalar: each process reads its own copy
        gathered = multihost_utils.process_allgather(state.params, tiled=True)
        out[key] = {"losses": losses, "mesh": strat.mesh, "rows": [start, stop],
                    "params": _flatten(jax.tree.map(np.asarray, gathered))}
    return out


def params_summary(params: dict) -> dict:
    """``{leaf_path: {"shape", "norm", "sum"}}`` of a flat parameter dict (float, for JSON and tables)."""
    import numpy as np

    return {k: {"shape": list(v.shape), "norm": float(np.linalg.norm(v)), "sum": float(v.sum())} for k, v in params.items()}


# ----------------------------------------------------------------------------------------------------------
# The worker: one process of the group
# ----------------------------------------------------------------------------------------------------------


def _watch_parent(parent_pid: int) -> None:
    """Exit this worker if the launcher dies (no orphan left computing or holding a port)."""

    def loop():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(70)

    threading.Thread(target=loop, daemon=True, name="watch-parent").start()


def run_worker(args: argparse.Namespace) -> dict:
    """One process of the group: set up devices, join the group, train, write JSON (and params on process 0).

    ``args`` (the worker's command line) holds: ``coordinator`` ("host:port", or "auto" to let
    ``jax.distributed.initialize`` read a cluster's environment, e.g. SLURM's), ``num_processes``,
    ``process_id``, ``local_devices`` (simulated CPU devices; 0 keeps the real devices), ``local_device_ids``
    (comma-separated GPU ids, or empty), ``strategies``, ``steps``, ``inputs`` (a :func:`prepare_inputs`
    folder; empty: this process prepares its own parameters from ``profile`` and ``seed``), ``data`` (see
    :func:`train_strategies`; default "file" with ``inputs``, else "device"), ``out`` (folder), ``fail`` (a
    stage in :data:`FAIL_STAGES` to raise at, for demonstrating failure handling), ``check_only`` and
    ``expect_local_devices`` (see :func:`device_check`), ``init_timeout_s``.

    Returns:
      The JSON-able dict written to ``out/process_<i>.json``: ``process_id``, ``process_count``,
      ``local_devices``, ``global_devices`` (``"id@process"`` strings, global order), ``wall_s``, and per
      strategy ``losses``, ``mesh``, ``rows``; process 0 adds ``params_summary`` and writes
      ``params_<strategy>.npz``.

    Raises:
      RuntimeError: ``fail`` was given (on purpose); JAX errors from initialisation or training.
    """
    t0 = time.perf_counter()
    pid = args.process_id
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.fail == "init":
        raise RuntimeError(f"process {pid}: failing on purpose before jax.distributed.initialize (--fail init)")

    import jax

    # The device count must be fixed before the backend starts (design/jax-0.12.md, "Simulated devices").
    if args.local_devices:
        jax.config.update("jax_num_cpu_devices", args.local_devices)
    ids = [int(x) for x in args.local_device_ids.split(",")] if args.local_device_ids else None
    timeout = max(10, int(args.init_timeout_s))
    if args.coordinator == "auto":
        # SLURM (and other managers) supply address, count and id. Under SLURM, JAX then also picks
        # local_device_ids=[SLURM_LOCALID] (one process per GPU) unless --local-device-ids is given.
        jax.distributed.initialize(local_device_ids=ids, initialization_timeout=timeout)
    else:
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=pid,
                                   local_device_ids=ids, initialization_timeout=timeout)
    me = jax.process_index()
    # A log line per process, prefixed: in a real job all of them land in one log.
    print(f"[process {me}/{jax.process_count()}] local devices {jax.local_devices()}; "
          f"{jax.device_count()} global devices", flush=True)
    result = {
        "process_id": me,
        "process_count": jax.process_count(),
        "platform": jax.default_backend(),
        "local_devices": [str(d) for d in jax.local_devices()],
        "global_devices": [f"{d.id}@{d.process_index}" for d in jax.devices()],
    }
    if args.check_only:
        print(device_check(args.expect_local_devices), flush=True)
        result["wall_s"] = time.perf_counter() - t0
        return result
    if args.fail == "train":
        raise RuntimeError(f"process {me}: failing on purpose after joining the group (--fail train); "
                           f"the other processes are now waiting for it")

    inputs = args.inputs
    if not inputs:  # no shared folder (e.g. a cluster job): every process makes the same inputs itself
        import tempfile

        inputs = prepare_inputs(tempfile.mkdtemp(prefix=f"course-inputs-{me}-"), args.profile, args.steps, args.seed,
                                batches=False)
    data = args.data or ("file" if args.inputs else "device")
    runs = train_strategies(jax.devices(), inputs, args.strategies, args.steps, data=data)
    out = Path(args.out)
    result["strategies"] = {k: {f: v for f, v in r.items() if f != "params"} for k, r in runs.items()}
    if me == 0:  # saving (and printing summaries) from process 0 only: the values are global copies everywhere
        import numpy as np

        result["params_summary"] = {k: params_summary(r["params"]) for k, r in runs.items()}
        for k, r in runs.items():
            np.savez(out / f"params_{k}.npz", **r["params"])
        for k, r in runs.items():
            print(f"[process 0] {k}: losses {', '.join(f'{x:.6f}' for x in r['losses'])}", flush=True)
    result["wall_s"] = time.perf_counter() - t0
    return result


def device_check(expect_local_devices: int = 0) -> str:
    """The checks to run first on a cluster, from inside one process of a joined group.

    Returns a report: this process's host name, index and local devices (with ``local_hardware_id``, the
    GPU ordinal to compare with ``nvidia-smi topo -m``), and the global device order with the process owning
    each device: meshes are built in this order, so a ``model`` group (neighbours in the order) should share a
    host and its fastest links.

    Raises:
      RuntimeError: ``expect_local_devices`` > 0 and this process has another number of local devices (a wrong
        ``CUDA_VISIBLE_DEVICES``, ``--gpus-per-task`` or ``local_device_ids``).
    """
    import jax

    me, local = jax.process_index(), jax.local_devices()
    lines = [f"[process {me}/{jax.process_count()}] host {socket.gethostname()}: {len(local)} local device(s), "
             f"{jax.device_count()} global, backend {jax.default_backend()}"]
    for d in local:
        lines.append(f"[process {me}]   {d} kind={d.device_kind!r} local_hardware_id={getattr(d, 'local_hardware_id', None)}")
    if me == 0:
        order = ", ".join(f"{d.id}@p{d.process_index}" for d in jax.devices())
        lines.append(f"[process 0] global device order (id@process): {order}")
    if expect_local_devices and len(local) != expect_local_devices:
        raise RuntimeError(
            f"process {me} on {socket.gethostname()} sees {len(local)} local device(s), expected {expect_local_devices}: "
            f"check CUDA_VISIBLE_DEVICES, the scheduler's GPUs per task, and --local-device-ids")
    return "\n".join(lines)


def _worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m course_lib.multihost worker",
                                description="One process of a multi-process JAX run (started by launch()).")
    p.add_argument("--coordinator", required=True, help='"host:port" of process 0, or "auto" (SLURM etc.)')
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    p.add_argument("--local-devices", type=int, default=0, help="simulated CPU devices per process; 0: real devices")
    p.add_argument("--strategies", default=",".join(MULTIHOST_STRATEGIES))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--profile", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inputs", default="", help="folder written by prepare_inputs(); empty: make them here")
    p.add_argument("--data", choices=["file", "device"], default=None,
                   help="file: read this process's rows of --inputs; device: generate on the devices (default without --inputs)")
    p.add_argument("--out", default=".")
    p.add_argument("--init-timeout-s", type=float, default=60)
    p.add_argument("--local-device-ids", default="", help='comma-separated local GPU ids, e.g. "0,1,2,3"; empty: JAX decides')
    p.add_argument("--expect-local-devices", type=int, default=0, help="with --check-only: fail unless each process has this many")
    p.add_argument("--fail", choices=FAIL_STAGES, default=None)
    p.add_argument("--check-only", action="store_true", help="join the group, report devices, train nothing")
    args = p.parse_args(argv)
    args.strategies = [s for s in args.strategies.split(",") if s]
    if os.environ.get("COURSE_MULTIHOST_PARENT", "").isdigit():  # started by launch(): die with the launcher
        _watch_parent(int(os.environ["COURSE_MULTIHOST_PARENT"]))
    try:
        result = run_worker(args)
    except BaseException:
        # Exit at once: the normal exit path runs jax.distributed.shutdown(), which waits at a barrier for
        # peers that are themselves waiting for this process.
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = out / f"process_{result['process_id']}.json"
    name.write_text(json.dumps(result, indent=1))
    print(f"[process {result['process_id']}] wrote {name} ({result['wall_s']:.1f} s)", flush=True)
    return 0


# ----------------------------------------------------------------------------------------------------------
# The launcher
# ----------------------------------------------------------------------------------------------------------


def launch(
    n_processes: int = 2,
    local_devices: int = 4,
    *,
    strategies: Sequence[str] = MULTIHOST_STRATEGIES,
    steps: int = 3,
    profile: str = "tiny",
    seed: int = 0,
    inputs: str | Path | None = None,
    timeout_s: float = 120.0,
    fail_process: int | None = None,
    fail_stage: str = "train",
    out_dir: str | Path | None = None,
    check_only: bool = False,
    tail_lines: int = 15,
) -> MultiProcessRun:
    """Start ``n_processes`` workers × ``local_devices`` simulated CPU devices on localhost and collect them.

    The coordinator is process 0 on a free loopback port. Each worker runs in its own process group with a
    cleaned environment (:func:`worker_env`); its stdout and stderr go to ``out_dir/process_<i>.log``. The
    launcher polls the workers; as soon as one exits non-zero, or ``timeout_s`` passes, it terminates every
    worker's process group (SIGTERM, then SIGKILL after 3 s), reaps them, and raises. No worker outlives it.

    Args:
      n_processes: P ≥ 1.
      local_devices: D ≥ 1 simulated CPU devices per process (P × D global devices).
      strategies: lab strategies to run, from :data:`MULTIHOST_STRATEGIES`.
      steps: training steps per strategy.
      profile: lab profile (``"tiny"`` keeps a run to seconds of compute).
      seed: parameters and data seed (same meaning as in :func:`course_lib.lab.run_strategy`).
      inputs: a :func:`prepare_inputs` folder shared by the workers; None prepares one in ``out_dir`` (this
        starts JAX in the calling process, on its default device).
      timeout_s: wall-clock seconds for the whole run, startup and compiles included.
      fail_process: make this process raise on purpose (to demonstrate failure handling); None for a normal run.
      fail_stage: where it raises: ``"init"`` (before joining) or ``"train"`` (after joining, before step 0).
      out_dir: folder for logs and outputs (if it already holds files, a new sibling ``<out_dir>-2`` is
        used); default a new temporary folder.
      check_only: join the group and report devices without training.
      tail_lines: output lines quoted in an error.

    Returns:
      A :class:`MultiProcessRun`.

    Raises:
      ValueError: a bad argument (P or D < 1, unknown strategy or stage, a ``fail_process`` out of range, a
        global batch the data shards do not divide), before anything starts.
      WorkerFailed: a worker exited non-zero; names it, its exit status and its last output lines.
      WorkerTimeout: the run passed ``timeout_s``; names the processes still running.
    """
    n_processes = _positive_int(n_processes, "n_processes")
    local_devices = _positive_int(local_devices, "local_devices")
    steps = _positive_int(steps, "steps")
    strategies = list(strategies)
    unknown = [k for k in strategies if k not in MULTIHOST_STRATEGIES]
    if unknown or not strategies:
        raise ValueError(f"strategies={strategies!r}: choose one or more of {MULTIHOST_STRATEGIES}")
    if fail_process is not None and (not isinstance(fail_process, int) or not 0 <= fail_process < n_processes):
        raise ValueError(f"fail_process={fail_process!r} must be None or a process id in [0, {n_processes})")
    if fail_stage not in FAIL_STAGES:
        raise ValueError(f"fail_stage={fail_stage!r} must be one of {FAIL_STAGES}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be > 0 seconds")
    from .lab import PROFILES, check_divisibility

    if profile not in PROFILES:
        raise ValueError(f"profile={profile!r} is not one of {list(PROFILES)}")
    config = PROFILES[profile]
    if inputs is not None:  # prepared inputs may carry their own global batch (prepare_inputs(global_batch=...))
        batch = json.loads((Path(inputs) / "inputs.json").read_text()).get("global_batch")
        if batch is not None:
            config = dataclasses.replace(config, global_batch=batch)
    check_divisibility(config, n_processes * local_devices, strategies)

    if out_dir is None:
        import tempfile

        out_dir = tempfile.mkdtemp(prefix="course-multihost-")
    from course_tools.results import prepare_results_dir

    out = prepare_results_dir(out_dir)  # an earlier launch's logs and outputs are kept: a used folder gets a sibling
    if not check_only:
        if inputs is None:
            inputs = prepare_inputs(out / "inputs", profile, steps, seed)
        meta = json.loads((Path(inputs) / "inputs.json").read_text())
        if meta["steps"] < steps or meta["profile"] != profile:
            raise ValueError(f"inputs {inputs} hold {meta['steps']} steps of profile {meta['profile']!r}; asked for "
                             f"{steps} of {profile!r}: prepare_inputs(folder, {profile!r}, {steps})")
    coordinator = f"127.0.0.1:{free_port()}"
    env = worker_env()
    env["COURSE_MULTIHOST_PARENT"] = str(os.getpid())

    procs: list[subprocess.Popen] = []
    logs = []
    t0 = time.perf_counter()
    try:
        for i in range(n_processes):
            cmd = [sys.executable, "-m", "course_lib.multihost", "worker",
                   "--coordinator", coordinator, "--num-processes", str(n_processes), "--process-id", str(i),
                   "--local-devices", str(local_devices), "--strategies", ",".join(strategies),
                   "--steps", str(steps), "--profile", profile, "--seed", str(seed), "--out", str(out),
                   "--inputs", "" if inputs is None else str(Path(inputs).resolve()),
                   "--init-timeout-s", str(timeout_s)]
            if check_only:
                cmd.append("--check-only")
            if fail_process == i:
                cmd += ["--fail", fail_stage]
            log = open(out / f"process_{i}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=env, cwd=str(_REPO_ROOT), start_new_session=True))
        pids = tuple(p.pid for p in procs)
        deadline = t0 + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i = _first_failure(failed, out)
                msg = (f"process {i} of {n_processes} failed (exit status {codes[i]}); all {n_processes} worker(s) "
                       f"were stopped. Last output lines of process {i} (full log: {out / f'process_{i}.log'}):\n"
                       + _indent(tail(out / f"process_{i}.log", tail_lines)))
                _stop(procs)
                raise WorkerFailed(msg, process_id=i, returncode=codes[i], tail=tail(out / f"process_{i}.log", tail_lines),
                                   pids=pids, log_dir=str(out))
            if all(c == 0 for c in codes):
                break
            if time.perf_counter() > deadline:
                running = [i for i, c in enumerate(codes) if c is None]
                _stop(procs)
                lines = "\n".join(f"  process {i}:\n" + _indent(tail(out / f"process_{i}.log", 5), 4) for i in running)
                raise WorkerTimeout(
                    f"the run did not finish within timeout_s={timeout_s:g} s; processes {running} were still running "
                    f"and were stopped (a process waiting for a peer that never came, or too little time for startup "
                    f"and compiles: raise timeout_s). Their last lines:\n{lines}",
                    process_id=None, tail=lines, pids=pids, log_dir=str(out))
            time.sleep(0.05)
    finally:
        _stop(procs)  # also on KeyboardInterrupt (a notebook's stop button) or an error while starting
        for log in logs:
            log.close()
    wall = time.perf_counter() - t0

    outputs = tuple(json.loads((out / f"process_{i}.json").read_text()) for i in range(n_processes))
    params = {}
    if not check_only:
        import numpy as np

        for k in strategies:
            with np.load(out / f"params_{k}.npz") as f:
                params[k] = {name: f[name] for name in f.files}
    losses = {k: outputs[0]["strategies"][k]["losses"] for k in strategies} if not check_only else {}
    return MultiProcessRun(n_processes=n_processes, local_devices=local_devices, losses=losses, outputs=outputs,
                           params=params, wall_s=wall, pids=pids, out_dir=str(out))


def _first_failure(failed: list[int], out: Path) -> int:
    # The launcher stops everything at the first failure it sees (it polls every 50 ms), so ``failed`` is
    # nearly always one process. When several exited in the same poll, a process that failed on its own
    # (the deliberate demo failure) beats one that may only have lost its peer; otherwise the lowest id.
    own = [i for i in failed if "failing on purpose" in tail(out / f"process_{i}.log", 50)]
    return min(own or failed)


def _indent(text: str, n: int = 2) -> str:
    return "\n".join(" " * n + line for line in (text or "(no output)").splitlines())


def _stop(procs: list[subprocess.Popen], grace_s: float = 3.0) -> None:
    """Terminate each worker's process group (SIGTERM, then SIGKILL) and reap every worker."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _killpg(p, signal.SIGTERM)
    deadline = time.perf_counter() + grace_s
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        # SIGKILL the whole group even when the leader has exited: a child it started may still be there.
        _killpg(p, signal.SIGKILL)
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process in uninterruptible sleep
            pass


def _killpg(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # start_new_session=True: the group id is the worker's pid
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str] | None = None) -> int:
    """``python -m course_lib.multihost worker ...`` (one process) or ``... launch -P 2 -D 4`` (a local group)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "worker":
        return _worker_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m course_lib.multihost",
                                description="Run the lab's strategies on P local processes x D simulated CPU devices.")
    p.add_argument("command", choices=["launch"])
    p.add_argument("-P", "--n-processes", type=int, default=2)
    p.add_argument("-D", "--local-devices", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=180)
    p.add_argument("--check-only", action="store_true")
    args = p.parse_args(argv)
    try:
        run = launch(args.n_processes, args.local_devices, steps=args.steps, timeout_s=args.timeout_s,
                     check_only=args.check_only)
    except (ValueError, MultiProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for o in run.outputs:
        print(f"process {o['process_id']}: local {o['local_devices']}")
        if args.check_only:
            print("\n".join(l for l in tail(Path(run.out_dir) / f"process_{o['process_id']}.log", 50).splitlines()
                            if l.startswith("[process")))
    for k, v in run.losses.items():
        print(f"{k}: {v}")
    print(f"{run.n_processes} x {run.local_devices} in {run.wall_s:.1f} s; outputs in {run.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

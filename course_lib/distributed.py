"""Multi-process JAX: P processes × D devices, one global mesh. Taught in ``notebooks/09_multihost.ipynb``.

JAX is *multi-controller*: every process runs the same Python program, sees only its own (*local*,
*addressable*) devices, and joins the others through ``jax.distributed.initialize`` (:func:`join_group`).
After that, ``jax.devices()`` lists the *global* devices of all processes, a mesh built from them spans the
processes, and a jitted or ``shard_map``-ed step runs on it unchanged; XLA inserts the cross-process
collectives (gloo on CPU, NCCL on GPU).

What changes is the data: each process loads only its rows of the global batch (:func:`process_rows`,
:func:`local_rows`) and declares them as its part of one global array (:func:`to_global_batch`).
:func:`train_strategies` is the lab's training loop written that way: the notebook runs it in its own
kernel (1 process × 8 devices) as the reference, and every process of a group runs it after
:func:`join_group`. The worker program that strings these together (its command line, a deliberate failure
for the demonstration, the files it writes) and the launcher that starts, watches and stops the processes
on one machine are plumbing, kept apart in ``course_tools/worker.py`` and ``course_tools/launcher.py``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import LAB_PARAMS, PROFILES, Param, coerce, init_run, positive_int
from .meshes import divisors
from .strategies import REGISTRY

MULTIHOST_STRATEGIES = tuple(k for k, info in REGISTRY.items() if info.multihost)
"""The lab strategies run on a group: C (data × model, shard_map) and D (data parallel, sharded jit)."""


def loopback_tcp() -> str | None:
    """Whether this host lets a process listen on a TCP port of the loopback, as ``jax.distributed``'s
    coordination service must (``notebooks/09_multihost.ipynb`` runs its process groups only where it can).

    Returns:
      None when a socket could be bound to ``127.0.0.1`` and listened on; else why not, e.g.
      ``"PermissionError: [Errno 1] Operation not permitted"`` (some sandboxed accelerator hosts allow unix
      sockets only).
    """
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            sock.listen(1)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def plan(
    n_devices: int, n_processes: int | None = None, fallback: bool = False
) -> tuple[int, int, str]:
    """Split ``n_devices`` global devices into processes × local devices for a local multi-process run.

    Args:
      n_devices: the global device count wanted (≥ 1).
      n_processes: processes wanted; ``None`` picks 2 when ``n_devices`` is even, else 1.
      fallback: when ``n_processes`` does not divide ``n_devices``, use 1 process (and say so) instead of
        raising.

    Returns:
      ``(n_processes, local_devices, why)``: ``n_processes * local_devices == n_devices``, and a one-line
      explanation to print.

    Raises:
      ValueError: a count that is not a positive integer, or ``n_processes`` that does not divide
        ``n_devices`` (the message lists the counts that do).
    """
    n_devices = positive_int(n_devices, "n_devices")
    if n_processes is None:
        n_processes = 2 if n_devices % 2 == 0 else 1
        why = (
            "2 processes: the device count is even, so each process gets half"
            if n_processes == 2
            else f"1 process: {n_devices} device(s) cannot be split evenly over 2 processes"
        )
    else:
        n_processes = positive_int(n_processes, "n_processes")
        why = f"{n_processes} process(es), as asked"
        if fallback and n_devices % n_processes:
            why = f"1 process: {n_devices} device(s) cannot be split evenly over {n_processes} processes"
            n_processes = 1
    local = split_devices(n_devices, n_processes)
    total = f"{n_processes} process(es) x {local} local device(s) = {n_devices} global devices"
    return n_processes, local, f"{why}: {total}"


def split_devices(n_devices: int, n_processes: int) -> int:
    """Local devices per process when ``n_devices`` are shared evenly by ``n_processes``.

    Raises:
      ValueError: a non-positive count, or ``n_processes`` not dividing ``n_devices`` (divisors named).
    """
    n_devices = positive_int(n_devices, "n_devices")
    n_processes = positive_int(n_processes, "n_processes")
    if n_devices % n_processes:
        raise ValueError(
            f"{n_devices} devices do not split evenly over {n_processes} processes; every process needs the "
            f"same number of local devices: use n_processes in {divisors(n_devices)}"
        )
    return n_devices // n_processes


def process_rows(global_batch: int, n_processes: int, process_index: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a global batch that process ``process_index`` loads under data parallelism.

    Assumes the usual device order (``jax.devices()`` lists process 0's devices first, then process 1's, …)
    and a batch split over all devices along axis 0, so each process owns one contiguous block.

    Raises:
      ValueError: ``global_batch`` not divisible by ``n_processes``, or ``process_index`` out of range.
    """
    global_batch = positive_int(global_batch, "global_batch")
    n_processes = positive_int(n_processes, "n_processes")
    if not isinstance(process_index, int) or not 0 <= process_index < n_processes:
        raise ValueError(f"process_index={process_index!r} must be in [0, {n_processes})")
    if global_batch % n_processes:
        raise ValueError(
            f"global batch {global_batch} is not divisible by {n_processes} processes; "
            f"use a multiple of {n_processes}"
        )
    per = global_batch // n_processes
    return process_index * per, (process_index + 1) * per


def local_rows(
    sharding: Any, global_shape: Sequence[int], devices: Sequence[Any] | None = None
) -> tuple[int, int]:
    """Rows ``[start, stop)`` along axis 0 that this process's devices hold under ``sharding``.

    Args:
      sharding: a ``jax.sharding.Sharding`` of the global batch, e.g. ``NamedSharding(mesh, P("data"))``.
      global_shape: the global array's shape, e.g. ``(32, 16, 16, 3)``.
      devices: whose rows: default this process's (addressable) devices; any devices of the sharding's
        mesh, e.g. those a process of a larger group would own.

    Raises:
      ValueError: the rows are not one contiguous block (a device order that interleaves processes;
        build the mesh from ``jax.devices()`` in its own order).
    """
    B = int(global_shape[0])
    if devices is None:
        indices = sharding.addressable_devices_indices_map(tuple(global_shape)).values()
    else:
        held = sharding.devices_indices_map(tuple(global_shape))
        indices = [held[d] for d in devices]
    spans = set()
    for index in indices:
        s = index[0] if index else slice(None)
        spans.add((s.start or 0, B if s.stop is None else s.stop))
    start, stop = min(a for a, _ in spans), max(b for _, b in spans)
    covered = sum(b - a for a, b in sorted(spans))
    if covered != stop - start:
        raise ValueError(
            f"this process's devices hold rows {sorted(spans)} of the global batch, not one contiguous "
            f"block; build the mesh from jax.devices() in its own order so each process owns consecutive rows"
        )
    return start, stop


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
        jax.make_array_from_process_local_data(sharding, x, (global_batch,) + tuple(x.shape[1:]))
        for x in local_batch
    )


def _profile(name: str):
    return PROFILES[coerce(Param("profile", "tiny", choices=tuple(PROFILES)), name)]


def prepare_inputs(
    folder: str | Path,
    profile: str = "tiny",
    steps: int = 3,
    seed: int = 0,
    batches: bool = True,
    global_batch: int | None = None,
) -> Path:
    """Write the run's initial parameters and global batches to ``folder``, once, for every process to read.

    The values are exactly those :func:`course_lib.lab.run_strategy` uses for the same profile and seed
    (:func:`course_lib.config.init_run`). Preparing them once spares every worker the same start-up compiles;
    it is also how a real job shares a dataset: one file, and each process reads only its rows
    (``np.load(..., mmap_mode="r")[i, start:stop]``).

    Files: ``params.npz`` (one array per leaf, named ``"conv1/kernel"`` …), ``images.npy`` float32
    [steps, global_batch, H, W, 3], ``labels.npy`` int32 [steps, global_batch], ``inputs.json`` (profile,
    steps, seed, batches, global_batch). ``global_batch`` overrides the profile's (e.g. a multiple of 3 for
    3 devices); :func:`train_strategies` reads it back from ``inputs.json``. With ``batches=False`` only the
    parameters are written (the workers then generate the batches on their devices, ``data="device"`` in
    :func:`train_strategies`: for large profiles).

    Returns:
      ``folder`` as a ``Path``.

    Raises:
      ValueError: unknown profile, steps < 1 or a seed that is not a non-negative integer.
    """
    import dataclasses

    import jax
    import numpy as np
    from flax import traverse_util

    from . import data as data_lib

    config, steps = _profile(profile), positive_int(steps, "steps")
    if global_batch is not None:
        config = dataclasses.replace(
            config, global_batch=positive_int(global_batch, "global_batch")
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    start = init_run(config, seed)
    np.savez(
        folder / "params.npz", **traverse_util.flatten_dict(jax.device_get(start.params), sep="/")
    )
    if batches:
        made = data_lib.batches(start.dataset, start.data_key, steps, config.global_batch)
        host = jax.device_get(made)
        np.save(folder / "images.npy", np.stack([b[0] for b in host]))
        np.save(folder / "labels.npy", np.stack([b[1] for b in host]))
    meta = {
        "profile": config.name,
        "steps": steps,
        "seed": coerce(LAB_PARAMS["seed"], seed),
        "batches": bool(batches),
        "global_batch": config.global_batch,
    }
    (folder / "inputs.json").write_text(json.dumps(meta))
    return folder


def _read_inputs(inputs: Path, steps: Any, data: str) -> tuple[Any, dict, int]:
    """The config, metadata and step count of a :func:`prepare_inputs` folder, checked against ``data``."""
    import dataclasses

    meta = json.loads((inputs / "inputs.json").read_text())
    config = _profile(meta["profile"])
    if "global_batch" in meta:  # the batch prepare_inputs wrote (may differ from the profile's)
        config = dataclasses.replace(config, global_batch=meta["global_batch"])
    steps = meta["steps"] if steps is None else positive_int(steps, "steps")
    if data not in ("file", "device"):
        raise ValueError(f"data={data!r} must be 'file' or 'device'")
    if data == "file" and not meta.get("batches", True):
        raise ValueError(
            f"{inputs} holds no batches (prepare_inputs(batches=False)); use data='device'"
        )
    if data == "file" and steps > meta["steps"]:
        raise ValueError(
            f"steps={steps} but {inputs} holds {meta['steps']} batches; prepare_inputs(steps={steps})"
        )
    return config, meta, steps


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
    import numpy as np
    from flax import traverse_util

    from .lab import check_divisibility
    from .steps import make_optimizer

    unknown = [k for k in keys if k not in MULTIHOST_STRATEGIES]
    if unknown:
        raise ValueError(
            f"strategies {unknown} are not run multi-process; choose from {MULTIHOST_STRATEGIES}"
        )
    inputs = Path(inputs)
    config, meta, steps = _read_inputs(inputs, steps, data)
    devices = list(devices)
    check_divisibility(config, len(devices), keys)
    # The structure only: no parameter is computed here (they come from the file).
    start = init_run(config, meta["seed"], abstract_params=True)
    with np.load(inputs / "params.npz") as f:
        params = traverse_util.unflatten_dict({name: f[name] for name in f.files}, sep="/")
    if data == "file":
        images = np.load(inputs / "images.npy", mmap_mode="r")  # [steps, B, H, W, C], read lazily
        labels = np.load(inputs / "labels.npy", mmap_mode="r")  # [steps, B]
        batches = (images, labels)
    else:
        batches = None  # generated on the devices from the run's data key
    optimizer = make_optimizer(config.learning_rate)
    return {
        key: _train_one(key, devices, start, params, optimizer, config.global_batch, steps, batches)
        for key in keys
    }


def _train_one(key, devices, start, params, optimizer, B, steps, batches) -> dict:
    """One strategy of :func:`train_strategies`: build, place, train ``steps`` steps, gather."""
    import jax
    import numpy as np
    from flax import traverse_util
    from jax.experimental import multihost_utils

    from .steps import init_state
    from .strategies import build

    strat = build(key, start.graphdef, params, optimizer, devices)
    # Every process holds the same host copy; device_put onto a global sharding keeps, on each process,
    # the pieces its own devices hold.
    state = strat.place_state(init_state(params, optimizer))
    first, stop = local_rows(strat.batch_sharding, (B,))
    losses = []
    for i in range(steps):
        if batches is not None:
            # Data loading is per process: read only this process's rows of batch i ...
            local = tuple(np.asarray(x[i, first:stop]) for x in batches)
            # ... and declare them as its part of one global array (no data moves between processes).
            batch = to_global_batch(local, strat.batch_sharding, B)
        else:
            batch = start.dataset.batch(
                jax.random.fold_in(start.data_key, i), B, strat.batch_sharding
            )
        state, metrics = strat.step(state, batch)  # the lab's step, unchanged
        losses.append(
            float(metrics["loss"])
        )  # a replicated scalar: each process reads its own copy
    gathered = multihost_utils.process_allgather(state.params, tiled=True)
    flat = traverse_util.flatten_dict(jax.tree.map(np.asarray, gathered), sep="/")
    return {"losses": losses, "mesh": strat.mesh, "rows": [first, stop], "params": flat}


def params_summary(params: dict) -> dict:
    """``{leaf_path: {"shape", "norm", "sum"}}`` of a flat parameter dict (float, for JSON and tables)."""
    import numpy as np

    return {
        k: {"shape": list(v.shape), "norm": float(np.linalg.norm(v)), "sum": float(v.sum())}
        for k, v in params.items()
    }


def join_group(
    coordinator: str,
    num_processes: int | None,
    process_id: int | None,
    local_devices: int = 0,
    local_device_ids: Sequence[int] | None = None,
    timeout_s: float = 60,
) -> None:
    """Join a group of processes: ``jax.distributed.initialize``, before any other JAX operation.

    Args:
      coordinator: ``"host:port"`` of process 0 (the same for every process), or ``"auto"``: SLURM (and
        other cluster managers) supply address, count and id, and then JAX also picks
        ``local_device_ids=[SLURM_LOCALID]`` (one process per GPU) unless ``local_device_ids`` is given.
      num_processes: P; process_id: this process's index in 0 … P-1 (both ignored with ``"auto"``).
      local_devices: simulated CPU devices for this process, fixed before the backend starts; 0 keeps the
        real devices.
      local_device_ids: the local GPUs this process uses, or None (JAX decides).
      timeout_s: seconds to wait for every process to arrive.
    """
    import jax

    if local_devices:
        jax.config.update("jax_num_cpu_devices", local_devices)
    timeout = max(10, int(timeout_s))
    if coordinator == "auto":
        jax.distributed.initialize(
            local_device_ids=local_device_ids, initialization_timeout=timeout
        )
    else:
        jax.distributed.initialize(
            coordinator,
            num_processes=num_processes,
            process_id=process_id,
            local_device_ids=local_device_ids,
            initialization_timeout=timeout,
        )
    # A log line per process, prefixed: in a real job all of them land in one log.
    print(
        f"[process {jax.process_index()}/{jax.process_count()}] local devices {jax.local_devices()}; "
        f"{jax.device_count()} global devices",
        flush=True,
    )

"""One worker process of a multi-process run: the program every process runs, and its command line.

    python -m course_tools.launcher worker --coordinator HOST:PORT --num-processes P --process-id I ...

It joins the group (:func:`course_lib.distributed.join_group`), trains the lab's strategies on the global
devices (:func:`course_lib.distributed.train_strategies`), and writes what it saw as JSON; process 0 also
saves the gathered parameters. :func:`course_tools.launcher.launch` starts P of them on this machine; the
cluster files in ``deploy/`` start them on real hosts. Taught in ``notebooks/09_multihost.ipynb``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from course_lib.config import MULTIHOST_PARAMS, PROFILES, Param, arg_type
from course_lib.distributed import (
    MULTIHOST_STRATEGIES,
    join_group,
    params_summary,
    prepare_inputs,
    train_strategies,
)
from course_lib.group_checkpoint import checkpoint_round_trip, hybrid_mesh

FAIL_STAGES = ("init", "train")
"""Where a worker told to fail raises: before ``jax.distributed.initialize`` or after it, before the first
step (the other processes are then waiting for it in a collective)."""

PARENT_ENV = "COURSE_MULTIHOST_PARENT"
"""Set by the launcher to its pid: a worker whose launcher dies exits too."""
PROFILE = Param("profile", "tiny", choices=tuple(PROFILES), help="lab profile")


def run_worker(args: Any) -> dict:
    """One process of the group: join it, train, save (parameters from process 0 only).

    ``args`` (the worker's command line, ``python -m course_tools.launcher worker --help``) holds:
    ``coordinator``, ``num_processes``, ``process_id``, ``local_devices``, ``local_device_ids`` (see
    :func:`join_group`), ``strategies``, ``steps``, ``inputs`` (a :func:`prepare_inputs` folder; empty: this
    process prepares its own parameters from ``profile`` and ``seed``), ``data`` (see
    :func:`train_strategies`; default "file" with ``inputs``, else "device"), ``out`` (folder), ``fail`` (a
    stage in :data:`FAIL_STAGES` to raise at, to show what a failure does), ``check_only`` and
    ``expect_local_devices`` (see :func:`device_check`), ``init_timeout_s``.

    Returns:
      The JSON-able dict the worker writes to ``out/process_<i>.json``: ``process_id``, ``process_count``,
      ``local_devices``, ``global_devices`` (``"id@process"`` strings, global order), ``wall_s``, and per
      strategy ``losses``, ``mesh``, ``rows``; ``hybrid_mesh`` (the ``"id@process"`` grid of
      :func:`course_lib.group_checkpoint.hybrid_mesh`) and ``checkpoint`` (what
      :func:`course_lib.group_checkpoint.checkpoint_round_trip` returned in this process, written under
      ``out/checkpoint``; only with ``inputs``, a folder every process sees); process 0 adds
      ``params_summary`` and writes ``params_<strategy>.npz``.

    Raises:
      RuntimeError: ``fail`` was given (on purpose); JAX errors from initialisation or training.
    """
    t0 = time.perf_counter()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.fail == "init":
        raise RuntimeError(
            f"process {args.process_id}: failing on purpose before jax.distributed.initialize (--fail init)"
        )
    ids = [int(x) for x in args.local_device_ids.split(",")] if args.local_device_ids else None
    join_group(
        args.coordinator,
        args.num_processes,
        args.process_id,
        args.local_devices,
        ids,
        args.init_timeout_s,
    )

    import jax

    me = jax.process_index()
    result = {
        "process_id": me,
        "process_count": jax.process_count(),
        "platform": jax.default_backend(),
        "local_devices": [str(d) for d in jax.local_devices()],
        "global_devices": [f"{d.id}@{d.process_index}" for d in jax.devices()],
    }
    if args.check_only:
        print(device_check(args.expect_local_devices), flush=True)
    else:
        if args.fail == "train":
            raise RuntimeError(
                f"process {me}: failing on purpose after joining the group (--fail train); "
                f"the other processes are now waiting for it"
            )
        result.update(_train_and_save(args, me))
    result["wall_s"] = time.perf_counter() - t0
    return result


def _train_and_save(args: Any, me: int) -> dict:
    import jax
    import numpy as np

    data = args.data or ("file" if args.inputs else "device")
    if args.inputs:
        runs = train_strategies(jax.devices(), args.inputs, args.strategies, args.steps, data=data)
    else:  # no shared folder (e.g. a cluster job): every process makes the same inputs itself, removed after
        import tempfile

        with tempfile.TemporaryDirectory(prefix=f"course-inputs-{me}-") as folder:
            inputs = prepare_inputs(folder, args.profile, args.steps, args.seed, batches=False)
            runs = train_strategies(jax.devices(), inputs, args.strategies, args.steps, data=data)
    out = {
        "strategies": {k: {f: v for f, v in r.items() if f != "params"} for k, r in runs.items()}
    }
    # a hybrid mesh (data across processes, model inside each) and, where the processes share a folder
    # (--inputs, as launch() runs them), a checkpoint every process writes
    mesh = hybrid_mesh()
    out["hybrid_mesh"] = [[f"{d.id}@{d.process_index}" for d in row] for row in mesh.devices]
    if args.inputs:
        out["checkpoint"] = checkpoint_round_trip(Path(args.out) / "checkpoint", mesh)
    if (
        me == 0
    ):  # saving (and printing) from process 0 only: the values are global copies everywhere
        out["params_summary"] = {k: params_summary(r["params"]) for k, r in runs.items()}
        for k, r in runs.items():
            np.savez(Path(args.out) / f"params_{k}.npz", **r["params"])
            print(
                f"[process 0] {k}: losses {', '.join(f'{x:.6f}' for x in r['losses'])}", flush=True
            )
    return out


def device_check(expect_local_devices: int = 0) -> str:
    """The checks to run first on a cluster, from inside one process of a joined group.

    Returns a report: this process's host name, index and local devices (with ``local_hardware_id``, the
    GPU ordinal to compare with ``nvidia-smi topo -m``), and the global device order with the process owning
    each device: meshes are built in this order, so a ``model`` group (neighbours in the order) should share a
    host and its fastest links.

    Raises:
      RuntimeError: ``expect_local_devices`` > 0 and this process has another number of local devices (a
        wrong ``CUDA_VISIBLE_DEVICES``, ``--gpus-per-task`` or ``local_device_ids``).
    """
    import jax

    me, local, host = jax.process_index(), jax.local_devices(), socket.gethostname()
    lines = [
        f"[process {me}/{jax.process_count()}] host {host}: {len(local)} local device(s), "
        f"{jax.device_count()} global, backend {jax.default_backend()}"
    ]
    for d in local:
        hw = getattr(d, "local_hardware_id", None)
        lines.append(f"[process {me}]   {d} kind={d.device_kind!r} local_hardware_id={hw}")
    if me == 0:
        order = ", ".join(f"{d.id}@p{d.process_index}" for d in jax.devices())
        lines.append(f"[process 0] global device order (id@process): {order}")
    if expect_local_devices and len(local) != expect_local_devices:
        raise RuntimeError(
            f"process {me} on {host} sees {len(local)} local device(s), expected {expect_local_devices}: "
            f"check CUDA_VISIBLE_DEVICES, the scheduler's GPUs per task, and --local-device-ids"
        )
    return "\n".join(lines)


def _watch_parent(parent_pid: int) -> None:
    """Exit this worker if the launcher dies (no orphan left computing or holding a port)."""

    def loop():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(70)

    threading.Thread(target=loop, daemon=True, name="watch-parent").start()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m course_tools.launcher worker",
        description="One process of a multi-process JAX run (started by launch(), or by deploy/).",
    )
    count = arg_type(Param("count", 1, minimum=0, papermill=False))
    add = p.add_argument
    add("--coordinator", required=True, help='"host:port" of process 0, or "auto" (SLURM etc.)')
    add("--num-processes", type=count, default=None)
    add("--process-id", type=count, default=None)
    add(
        "--local-devices",
        type=count,
        default=0,
        help="simulated CPU devices per process; 0: real devices",
    )
    add("--strategies", default=",".join(MULTIHOST_STRATEGIES))
    add("--steps", type=arg_type(MULTIHOST_PARAMS["steps"]), default=3)
    add("--profile", type=arg_type(PROFILE), default="tiny")
    add("--seed", type=arg_type(Param("seed", 0, minimum=0)), default=0)
    add("--inputs", default="", help="folder written by prepare_inputs(); empty: make them here")
    add(
        "--data",
        choices=["file", "device"],
        default=None,
        help="file: read this process's rows of --inputs; device: generate on the devices (default without "
        "--inputs)",
    )
    add("--out", default=".")
    add("--init-timeout-s", type=arg_type(MULTIHOST_PARAMS["timeout_s"]), default=60)
    add(
        "--local-device-ids",
        default="",
        help='comma-separated local GPU ids, e.g. "0,1,2,3"; empty: JAX decides',
    )
    add(
        "--expect-local-devices",
        type=count,
        default=0,
        help="with --check-only: fail unless each has this many",
    )
    add("--fail", choices=FAIL_STAGES, default=None)
    add("--check-only", action="store_true", help="join the group, report devices, train nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m course_tools.worker ...`` (or ``python -m course_tools.launcher worker ...``)."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    args.strategies = [s for s in args.strategies.split(",") if s]
    if os.environ.get(PARENT_ENV, "").isdigit():  # started by launch(): die with the launcher
        _watch_parent(int(os.environ[PARENT_ENV]))
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


if __name__ == "__main__":
    sys.exit(main())

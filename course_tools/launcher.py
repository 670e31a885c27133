"""The multi-process launcher: P local worker processes × D simulated CPU devices, started, watched, stopped.

Plumbing for ``notebooks/09_multihost.ipynb``; what each process does is the lesson, in
:mod:`course_lib.distributed`. :func:`launch` starts the workers on localhost with a coordinator on a free
loopback port, waits for them under a timeout, and shuts every one down (its whole process group) as soon as
one fails, raising :class:`WorkerFailed` that names the process and shows its last output lines.

    python -m course_tools.launcher launch -P 2 -D 4      # a local group; prints the losses
    python -m course_tools.launcher worker --help         # one process (the cluster files in deploy/ use it)
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from course_lib import distributed
from course_lib.config import MULTIHOST_PARAMS, PROFILES, Param, arg_type, coerce, positive_int
from course_lib.distributed import FAIL_STAGES, MULTIHOST_STRATEGIES

# Environment variables that would change a worker's device count or backend behind its back.
_STRIP_ENV = (
    "XLA_FLAGS",
    "JAX_NUM_CPU_DEVICES",
    "JAX_PLATFORMS",
    "JAX_PLATFORM_NAME",
    "CUDA_VISIBLE_DEVICES",
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "COURSE_MULTIHOST_FAIL",
)
_PARENT_ENV = "COURSE_MULTIHOST_PARENT"
_REPO_ROOT = Path(__file__).resolve().parent.parent
_PROFILE = Param("profile", "tiny", choices=tuple(PROFILES), help="lab profile")


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
      outputs: each process's JSON output, in process order (see
        :func:`course_lib.distributed.run_worker` for the keys).
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
    pids = {int(p) for p in pids}
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        found = set()
        for proc in psutil.process_iter(["pid", "status"]):
            try:
                if proc.info["status"] != psutil.STATUS_ZOMBIE and (
                    proc.pid in pids or os.getpgid(proc.pid) in pids
                ):
                    found.add(proc.pid)
            except (psutil.Error, OSError):
                continue
        return sorted(found)
    if os.path.isdir("/proc"):
        return sorted(_proc_survivors(pids))
    return sorted(_signal_survivors(pids))  # pragma: no cover - neither psutil nor /proc


def _proc_survivors(pids: set[int]) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, ... after "pid (comm) "
        if fields[0] != "Z" and (int(entry) in pids or int(fields[2]) in pids):
            found.add(int(entry))
    return found


def _signal_survivors(pids: set[int]) -> set[int]:  # pragma: no cover - neither psutil nor /proc
    found = set()
    for pid in pids:
        try:
            os.kill(pid, 0)
            found.add(pid)
        except ProcessLookupError:
            pass
        except PermissionError:
            found.add(pid)
    return found


def tail(path: str | Path, n_lines: int = 15) -> str:
    """The last ``n_lines`` lines of a text file ('' when it does not exist)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip("\n").splitlines()[-n_lines:])


# ---- launch: validate, spawn, wait, collect --------------------------------------------------------------


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
    Counts, steps, seed and timeout may be given as strings (papermill ``-r``): the rule of
    :func:`course_lib.config.coerce`.

    Args:
      n_processes: P ≥ 1.
      local_devices: D ≥ 1 simulated CPU devices per process (P × D global devices).
      strategies: lab strategies to run, from :data:`course_lib.distributed.MULTIHOST_STRATEGIES`.
      steps: training steps per strategy.
      profile: lab profile (``"tiny"`` keeps a run to seconds of compute).
      seed: parameters and data seed (:func:`course_lib.config.init_run`).
      inputs: a :func:`course_lib.distributed.prepare_inputs` folder shared by the workers; None prepares
        one in ``out_dir`` (this starts JAX in the calling process, on its default device).
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
    opts = _validate(locals())
    out, procs, logs = opts["out"], [], []
    t0 = time.perf_counter()
    try:
        procs, logs = _spawn(opts)
        _wait(procs, opts, deadline=t0 + opts["timeout_s"])
    finally:
        _stop(procs)  # also on KeyboardInterrupt (a notebook's stop button) or an error while starting
        for log in logs:
            log.close()
    return _collect(opts, wall=time.perf_counter() - t0, pids=tuple(p.pid for p in procs), out=out)


def _validate(args: dict) -> dict:
    """Check and type :func:`launch`'s arguments, pick the output folder and prepare the inputs."""
    opts = dict(args)
    opts["n_processes"] = n = positive_int(args["n_processes"], "n_processes")
    opts["local_devices"] = positive_int(args["local_devices"], "local_devices")
    opts["steps"] = coerce(MULTIHOST_PARAMS["steps"], args["steps"])
    opts["timeout_s"] = coerce(MULTIHOST_PARAMS["timeout_s"], args["timeout_s"])
    opts["profile"] = profile = coerce(_PROFILE, args["profile"])
    opts["strategies"] = strategies = list(args["strategies"])
    if not strategies or any(k not in MULTIHOST_STRATEGIES for k in strategies):
        raise ValueError(f"strategies={strategies!r}: choose one or more of {MULTIHOST_STRATEGIES}")
    fail = args["fail_process"]
    if fail is not None and (not isinstance(fail, int) or not 0 <= fail < n):
        raise ValueError(f"fail_process={fail!r} must be None or a process id in [0, {n})")
    if args["fail_stage"] not in FAIL_STAGES:
        raise ValueError(f"fail_stage={args['fail_stage']!r} must be one of {FAIL_STAGES}")
    from course_lib.lab import check_divisibility

    config, inputs = PROFILES[profile], args["inputs"]
    if inputs is not None:  # prepared inputs may carry their own global batch (prepare_inputs(global_batch=...))
        batch = json.loads((Path(inputs) / "inputs.json").read_text()).get("global_batch")
        if batch is not None:
            config = dataclasses.replace(config, global_batch=batch)
    check_divisibility(config, n * opts["local_devices"], strategies)

    from .results import prepare_results_dir

    out_dir = args["out_dir"]
    if out_dir is None:
        import tempfile

        out_dir = tempfile.mkdtemp(prefix="course-multihost-")
    # An earlier launch's logs and outputs are kept: a used folder gets a sibling.
    opts["out"] = out = prepare_results_dir(out_dir)
    if not args["check_only"]:
        if inputs is None:
            inputs = distributed.prepare_inputs(out / "inputs", profile, opts["steps"], args["seed"])
        meta = json.loads((Path(inputs) / "inputs.json").read_text())
        if meta["steps"] < opts["steps"] or meta["profile"] != profile:
            raise ValueError(
                f"inputs {inputs} hold {meta['steps']} steps of profile {meta['profile']!r}; asked for "
                f"{opts['steps']} of {profile!r}: prepare_inputs(folder, {profile!r}, {opts['steps']})"
            )
    opts["inputs"] = inputs
    return opts


def _worker_command(opts: dict, i: int, coordinator: str) -> list[str]:
    inputs = "" if opts["inputs"] is None else str(Path(opts["inputs"]).resolve())
    cmd = [sys.executable, "-m", "course_tools.launcher", "worker", "--coordinator", coordinator]
    cmd += ["--num-processes", str(opts["n_processes"]), "--process-id", str(i)]
    cmd += ["--local-devices", str(opts["local_devices"]), "--strategies", ",".join(opts["strategies"])]
    cmd += ["--steps", str(opts["steps"]), "--profile", opts["profile"], "--seed", str(opts["seed"])]
    cmd += ["--out", str(opts["out"]), "--inputs", inputs, "--init-timeout-s", str(opts["timeout_s"])]
    if opts["check_only"]:
        cmd.append("--check-only")
    if opts["fail_process"] == i:
        cmd += ["--fail", opts["fail_stage"]]
    return cmd


def _spawn(opts: dict) -> tuple[list[subprocess.Popen], list]:
    """Start every worker in its own process group, its output in ``process_<i>.log``."""
    coordinator = f"127.0.0.1:{free_port()}"
    env = worker_env()
    env[_PARENT_ENV] = str(os.getpid())
    procs, logs = [], []
    try:
        for i in range(opts["n_processes"]):
            log = open(opts["out"] / f"process_{i}.log", "w")  # closed by launch()
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    _worker_command(opts, i, coordinator),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    cwd=str(_REPO_ROOT),
                    start_new_session=True,
                )
            )
    except BaseException:
        _stop(procs)
        for log in logs:
            log.close()
        raise
    return procs, logs


def _wait(procs: list[subprocess.Popen], opts: dict, deadline: float) -> None:
    """Poll the workers until all exit 0; raise at the first failure or at the deadline (workers stopped)."""
    out, n, lines = opts["out"], opts["n_processes"], opts["tail_lines"]
    pids = tuple(p.pid for p in procs)
    while True:
        codes = [p.poll() for p in procs]
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i = _first_failure(failed, out)
            log = out / f"process_{i}.log"
            last = tail(log, lines)
            msg = (
                f"process {i} of {n} failed (exit status {codes[i]}); all {n} worker(s) were stopped. "
                f"Last output lines of process {i} (full log: {log}):\n" + _indent(last)
            )
            _stop(procs)
            raise WorkerFailed(msg, process_id=i, returncode=codes[i], tail=last, pids=pids, log_dir=str(out))
        if all(c == 0 for c in codes):
            return
        if time.perf_counter() > deadline:
            running = [i for i, c in enumerate(codes) if c is None]
            _stop(procs)
            last = "\n".join(
                f"  process {i}:\n" + _indent(tail(out / f"process_{i}.log", 5), 4) for i in running
            )
            raise WorkerTimeout(
                f"the run did not finish within timeout_s={opts['timeout_s']:g} s; processes {running} were "
                f"still running and were stopped (a process waiting for a peer that never came, or too little "
                f"time for startup and compiles: raise timeout_s). Their last lines:\n{last}",
                process_id=None,
                tail=last,
                pids=pids,
                log_dir=str(out),
            )
        time.sleep(0.05)


def _collect(opts: dict, wall: float, pids: tuple, out: Path) -> MultiProcessRun:
    """Read every worker's JSON output and the parameters process 0 saved."""
    import numpy as np

    n = opts["n_processes"]
    outputs = tuple(json.loads((out / f"process_{i}.json").read_text()) for i in range(n))
    params, losses = {}, {}
    if not opts["check_only"]:
        for k in opts["strategies"]:
            with np.load(out / f"params_{k}.npz") as f:
                params[k] = {name: f[name] for name in f.files}
            losses[k] = outputs[0]["strategies"][k]["losses"]
    return MultiProcessRun(
        n_processes=n,
        local_devices=opts["local_devices"],
        losses=losses,
        outputs=outputs,
        params=params,
        wall_s=wall,
        pids=pids,
        out_dir=str(out),
    )


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


# ---- the command lines -----------------------------------------------------------------------------------


def _watch_parent(parent_pid: int) -> None:
    """Exit this worker if the launcher dies (no orphan left computing or holding a port)."""

    def loop():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(70)

    threading.Thread(target=loop, daemon=True, name="watch-parent").start()


def _worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m course_tools.launcher worker",
        description="One process of a multi-process JAX run (started by launch(), or by deploy/).",
    )
    count = arg_type(Param("count", 1, minimum=0, papermill=False))
    add = p.add_argument
    add("--coordinator", required=True, help='"host:port" of process 0, or "auto" (SLURM etc.)')
    add("--num-processes", type=count, default=None)
    add("--process-id", type=count, default=None)
    add("--local-devices", type=count, default=0, help="simulated CPU devices per process; 0: real devices")
    add("--strategies", default=",".join(MULTIHOST_STRATEGIES))
    add("--steps", type=arg_type(MULTIHOST_PARAMS["steps"]), default=3)
    add("--profile", type=arg_type(_PROFILE), default="tiny")
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
    add("--local-device-ids", default="", help='comma-separated local GPU ids, e.g. "0,1,2,3"; empty: JAX decides')
    add("--expect-local-devices", type=count, default=0, help="with --check-only: fail unless each has this many")
    add("--fail", choices=FAIL_STAGES, default=None)
    add("--check-only", action="store_true", help="join the group, report devices, train nothing")
    return p


def _worker_main(argv: list[str]) -> int:
    args = _worker_parser().parse_args(argv)
    args.strategies = [s for s in args.strategies.split(",") if s]
    if os.environ.get(_PARENT_ENV, "").isdigit():  # started by launch(): die with the launcher
        _watch_parent(int(os.environ[_PARENT_ENV]))
    try:
        result = distributed.run_worker(args)
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


def main(argv: list[str] | None = None) -> int:
    """``python -m course_tools.launcher worker ...`` (one process) or ``... launch -P 2 -D 4`` (a group)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "worker":
        return _worker_main(argv[1:])
    p = argparse.ArgumentParser(
        prog="python -m course_tools.launcher",
        description="Run the lab's strategies on P local processes x D simulated CPU devices.",
    )
    p.add_argument("command", choices=["launch"])
    p.add_argument("-P", "--n-processes", type=arg_type(MULTIHOST_PARAMS["n_processes"]), default=2)
    p.add_argument("-D", "--local-devices", type=arg_type(Param("local_devices", 4, minimum=1)), default=4)
    p.add_argument("--steps", type=arg_type(MULTIHOST_PARAMS["steps"]), default=3)
    p.add_argument("--timeout-s", type=arg_type(MULTIHOST_PARAMS["timeout_s"]), default=180.0)
    p.add_argument("--check-only", action="store_true")
    args = p.parse_args(argv)
    try:
        run = launch(
            args.n_processes, args.local_devices, steps=args.steps, timeout_s=args.timeout_s, check_only=args.check_only
        )
    except (ValueError, MultiProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _print_run(run, args.check_only)
    return 0


def _print_run(run: MultiProcessRun, check_only: bool) -> None:
    for o in run.outputs:
        print(f"process {o['process_id']}: local {o['local_devices']}")
        if check_only:
            log = tail(Path(run.out_dir) / f"process_{o['process_id']}.log", 50).splitlines()
            print("\n".join(line for line in log if line.startswith("[process")))
    for k, v in run.losses.items():
        print(f"{k}: {v}")
    print(f"{run.n_processes} x {run.local_devices} in {run.wall_s:.1f} s; outputs in {run.out_dir}")


if __name__ == "__main__":
    sys.exit(main())

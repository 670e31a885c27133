"""The multi-process launcher: P local worker processes × D simulated CPU devices, started, watched, stopped.

Plumbing for ``notebooks/09_multihost.ipynb``; what each process does is the lesson, in
:mod:`course_lib.distributed`. :func:`launch` starts the workers on localhost with a coordinator on a free
loopback port, waits for them under a timeout, and shuts every one down (its whole process group) as soon as
one fails, raising :class:`WorkerFailed` that names the process and shows its last output lines.

    python -m course_tools.launcher launch -P 2 -D 4      # a local group; prints the losses
    python -m course_tools.launcher worker --help         # one process (the cluster files in deploy/ use it)
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from course_lib import distributed
from course_lib.config import MULTIHOST_PARAMS, PROFILES, coerce, positive_int
from course_lib.distributed import MULTIHOST_STRATEGIES

from .processes import (
    REPO_ROOT,
    Terminated,
    check_folder,
    claim_run_dir,
    deferring_signals,
    describe_exit,
    free_port,
    ignoring_sigint,
    stop,
    survivors,
    tail,
    worker_env,
)
from .worker import FAIL_STAGES, PARENT_ENV, PROFILE

__all__ = [
    "LaunchInterrupted",
    "MultiProcessError",
    "MultiProcessRun",
    "WorkerFailed",
    "WorkerTimeout",
    "launch",
    "survivors",
    "tail",
]


class MultiProcessError(RuntimeError):
    """A multi-process run did not finish. Attributes name what happened so a caller can assert on it.

    Attributes:
      process_id: the process the error is about (the first to fail), or None for a timeout.
      returncode: its exit status (None when it was still running).
      tail: its last output lines (stdout and stderr together), as one string.
      pids: the operating-system ids of every worker started; all have been killed and reaped.
      log_dir: the folder with each process's full log (``process_<i>.log``).
    """

    def __init__(
        self, message: str, *, process_id=None, returncode=None, tail="", pids=(), log_dir=None
    ):
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


class LaunchInterrupted(KeyboardInterrupt):
    """Ctrl-C (a notebook's stop button) or SIGTERM during a launch: every worker was stopped and reaped.
    Attributes ``pids`` (none left running), ``log_dir`` and ``exit_code`` (130 Ctrl-C, 143 SIGTERM)."""

    def __init__(self, message: str, pids=(), log_dir=None, exit_code: int = 130):
        super().__init__(message)
        self.pids, self.log_dir, self.exit_code = tuple(pids), log_dir, exit_code


@dataclasses.dataclass(frozen=True)
class MultiProcessRun:
    """The outcome of :func:`launch`.

    Attributes:
      n_processes: P, processes started.
      local_devices: D, simulated CPU devices per process.
      losses: ``{strategy: [loss per step]}`` as process 0 saw them (float, nats, the global-batch mean
        before each update).
      outputs: each process's JSON output, in process order (see
        :func:`course_tools.worker.run_worker` for the keys).
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
    timeout_s: float = MULTIHOST_PARAMS["timeout_s"].default,
    fail_process: int | None = None,
    fail_stage: str = "train",
    out_dir: str | Path | None = None,
    check_only: bool = False,
    tail_lines: int = 15,
    progress: bool = False,
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
        used, and one line says so); default a new folder ``build/multihost[-k]`` (under
        ``$COURSE_BUILD_DIR`` when set).
      check_only: join the group and report devices without training.
      tail_lines: output lines quoted in an error.
      progress: print a line as the workers start (counts, timeout, logs) and one as each exits (the CLI).

    Returns:
      A :class:`MultiProcessRun`.

    Raises:
      ValueError: a bad argument (P or D < 1, unknown strategy or stage, a ``fail_process`` out of range, a
        global batch the data shards do not divide), before anything starts.
      WorkerFailed: a worker exited non-zero; names it, its exit status and its last output lines.
      WorkerTimeout: the run passed ``timeout_s``; names the processes still running.
      LaunchInterrupted: Ctrl-C or SIGTERM (a ``KeyboardInterrupt``); every worker was stopped.
    """
    opts = _validate(locals())
    out, procs, logs = opts["out"], [], []
    if progress:
        _say_start(opts)
    t0 = time.perf_counter()
    try:
        _spawn(opts, procs, logs)
        _wait(procs, opts, t0)
    except KeyboardInterrupt as e:
        with ignoring_sigint():
            stop(procs)
        what = "stopped by SIGTERM" if isinstance(e, Terminated) else "interrupted"
        raise LaunchInterrupted(
            f"{what}: all {len(procs)} worker(s) stopped, none is left; their logs are in {out}",
            pids=[p.pid for p in procs],
            log_dir=str(out),
            exit_code=143 if isinstance(e, Terminated) else 130,
        ) from None
    finally:  # also on an error while starting
        stop(procs)
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
    opts["profile"] = profile = coerce(PROFILE, args["profile"])
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
    # Prepared inputs may carry their own global batch (prepare_inputs(global_batch=...)).
    if inputs is not None:
        batch = json.loads((Path(inputs) / "inputs.json").read_text()).get("global_batch")
        if batch is not None:
            config = dataclasses.replace(config, global_batch=batch)
    check_divisibility(config, n * opts["local_devices"], strategies)

    from course_lib import environment

    # The workers inherit this environment: options that change the numbers stop here, not in a worker.
    environment.check_jax_options(environment.import_jax().config)
    opts["out"] = out = _output_folder(args["out_dir"])
    if not args["check_only"]:
        if inputs is None:
            inputs = distributed.prepare_inputs(
                out / "inputs", profile, opts["steps"], args["seed"]
            )
        meta = json.loads((Path(inputs) / "inputs.json").read_text())
        if meta["steps"] < opts["steps"] or meta["profile"] != profile:
            raise ValueError(
                f"inputs {inputs} hold {meta['steps']} steps of profile {meta['profile']!r}; asked for "
                f"{opts['steps']} of {profile!r}: prepare_inputs(folder, {profile!r}, {opts['steps']})"
            )
    opts["inputs"] = inputs
    return opts


def _say_start(opts: dict) -> None:
    """The line a launch with ``progress`` prints before it starts the workers: how many processes and
    devices, the timeout, and where each process's log goes."""
    n, d, out = opts["n_processes"], opts["local_devices"], opts["out"]
    print(
        f"starting {n} process(es) x {d} simulated CPU devices ({n * d} in all"
        f"{', check only' if opts['check_only'] else ''}); timeout {opts['timeout_s']:g} s; "
        f"logs in {out}/process_<i>.log",
        flush=True,
    )


def _output_folder(out_dir) -> Path:
    """A folder for this launch alone: an earlier launch's logs and outputs are kept (a used folder gets a
    sibling), and a launch started at the same moment into the same folder gets another one."""
    from .results import prepare_results_dir, resolve_results_dir

    base = resolve_results_dir("auto" if out_dir is None else out_dir, "multihost")
    fix = "give another out_dir"
    check_folder(base.parent, "output folder", fix)
    return claim_run_dir(
        lambda: prepare_results_dir(base, what="output folder", fix=fix), "output folder"
    )


def _worker_command(opts: dict, i: int, coordinator: str) -> list[str]:
    inputs = "" if opts["inputs"] is None else str(Path(opts["inputs"]).resolve())
    flags = {
        "--coordinator": coordinator,
        "--num-processes": opts["n_processes"],
        "--process-id": i,
        "--local-devices": opts["local_devices"],
        "--strategies": ",".join(opts["strategies"]),
        "--steps": opts["steps"],
        "--profile": opts["profile"],
        "--seed": opts["seed"],
        "--out": opts["out"],
        "--inputs": inputs,
        "--init-timeout-s": opts["timeout_s"],
    }
    cmd = [sys.executable, "-m", "course_tools.launcher", "worker"]
    cmd += [str(x) for flag in flags.items() for x in flag]
    if opts["check_only"]:
        cmd.append("--check-only")
    if opts["fail_process"] == i:
        cmd += ["--fail", opts["fail_stage"]]
    return cmd


def _spawn(opts: dict, procs: list[subprocess.Popen], logs: list) -> None:
    """Start every worker in its own process group, its output in ``process_<i>.log``; ``procs`` and
    ``logs`` grow as they start, so the caller stops and closes whatever started, whatever happens."""
    coordinator = f"127.0.0.1:{free_port()}"
    env = worker_env()
    env[PARENT_ENV] = str(os.getpid())
    for i in range(opts["n_processes"]):
        logs.append(open(opts["out"] / f"process_{i}.log", "w"))
        cmd = _worker_command(opts, i, coordinator)
        # Ctrl-C between the worker's exec and the append would leave it out of ``procs``, unstopped
        with deferring_signals():
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=logs[-1],
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    cwd=str(REPO_ROOT),
                    start_new_session=True,
                )
            )


def _wait(procs: list[subprocess.Popen], opts: dict, t0: float) -> None:
    """Poll the workers until all exit 0; raise at the first failure or ``timeout_s`` after ``t0`` (workers
    stopped). With ``opts["progress"]``, print a line as each worker exits."""
    out, n, lines = opts["out"], opts["n_processes"], opts["tail_lines"]
    pids, deadline, reported = tuple(p.pid for p in procs), t0 + opts["timeout_s"], set()
    while True:
        codes = [p.poll() for p in procs]
        for i, code in enumerate(codes):
            if opts["progress"] and code is not None and i not in reported:
                reported.add(i)
                took = time.perf_counter() - t0
                print(
                    f"process {i} of {n} exited ({describe_exit(code)}) after {took:.1f} s",
                    flush=True,
                )
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i = _first_failure(failed, out)
            log = out / f"process_{i}.log"
            last = tail(log, lines)
            msg = (
                f"process {i} of {n} failed ({describe_exit(codes[i])}); all {n} worker(s) were stopped. "
                f"Last output lines of process {i} (full log: {log}):\n" + _indent(last)
            )
            stop(procs)
            raise WorkerFailed(
                msg, process_id=i, returncode=codes[i], tail=last, pids=pids, log_dir=str(out)
            )
        if all(c == 0 for c in codes):
            return
        if time.perf_counter() > deadline:
            running = [i for i, c in enumerate(codes) if c is None]
            stop(procs)
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


if __name__ == "__main__":
    from .launcher_cli import main

    code = main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while exiting changes nothing
    sys.exit(code)

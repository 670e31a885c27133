"""The launcher's command line: ``python -m course_tools.launcher launch -P 2 -D 4`` or ``... worker ...``.

Parses the options (each with ``--help`` text, the rules of :data:`course_lib.config.MULTIHOST_PARAMS`),
calls :func:`course_tools.launcher.launch` (which prints a line as the workers start and one as each exits)
and prints each process's devices, the losses and the output folder, all on stdout; errors (on stderr) and
interruptions become exit codes (2 bad input, 130 Ctrl-C, 143 SIGTERM).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from course_lib.config import MULTIHOST_PARAMS, Param, arg_type

from . import worker
from .launcher import LaunchInterrupted, MultiProcessError, MultiProcessRun, launch
from .processes import Terminated, ignoring_sigint, tail, terminate_as_interrupt


def main(argv: list[str] | None = None) -> int:
    """``python -m course_tools.launcher worker ...`` (one process) or ``... launch -P 2 -D 4`` (a group)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "worker":
        return worker.main(argv[1:])
    p = argparse.ArgumentParser(
        prog="python -m course_tools.launcher",
        description="Run the lab's strategies on P local processes x D simulated CPU devices.",
    )
    p.add_argument("command", choices=["launch"])
    local = Param("local_devices", 4, minimum=1, help="simulated CPU devices per process")
    for flags, prm in (
        (("-P", "--n-processes"), MULTIHOST_PARAMS["n_processes"]),
        (("-D", "--local-devices"), local),
        (("--steps",), MULTIHOST_PARAMS["steps"]),
        (("--timeout-s",), MULTIHOST_PARAMS["timeout_s"]),
    ):
        p.add_argument(
            *flags,
            type=arg_type(prm),
            default=prm.default,
            help=f"{prm.help} (default: {prm.default})",
        )
    p.add_argument(
        "--check-only",
        action="store_true",
        help="join the group and print each process's devices; no training",
    )
    p.add_argument(
        "--out", help="folder for the logs and outputs (default: a new folder build/multihost[-k])"
    )
    args = p.parse_args(argv)
    try:
        with terminate_as_interrupt():
            run = launch(
                args.n_processes,
                args.local_devices,
                steps=args.steps,
                timeout_s=args.timeout_s,
                check_only=args.check_only,
                out_dir=args.out,
                progress=True,
            )
    except LaunchInterrupted as e:
        with ignoring_sigint():
            print(str(e), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:  # before any worker started (preparing the inputs)
        print(f"{e or 'interrupted'} before any worker started", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
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
        print(f"{k}: loss before each of its {len(v)} updates (process 0): {v}")
    shape = f"{run.n_processes} x {run.local_devices}"
    print(f"{shape} in {run.wall_s:.1f} s; outputs in {run.out_dir}")

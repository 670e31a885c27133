"""Executing one notebook with papermill so that a run survives Ctrl-C, SIGTERM and a dying kernel.

:func:`execute` is what every course command (:mod:`course_tools.run`) and the test suite's notebook runs
use. On top of ``papermill.execute_notebook`` it:

- refuses, before a kernel starts, a ``python3`` Jupyter kernel that belongs to another Python
  (``JUPYTER_PATH``, a user-wide kernelspec) and parameter names the notebook does not declare;
- saves the executed notebook atomically after every cell (a full disk or a kill leaves the previous
  complete version, never a truncated file), through a papermill engine registered as ``"course"``;
- sends the kernel's own output (start-up warnings, tracebacks printed while it is torn down, XLA's C++
  log) to ``<notebook>.kernel.log`` beside the executed notebook instead of the terminal;
- on Ctrl-C (or SIGTERM, see :func:`course_tools.processes.terminate_as_interrupt`), or when the kernel
  dies (killed by the operating system, out of memory), marks the running cell as failed in the kept
  notebook, stops the kernel and everything in its process group, and raises one exception whose message
  names the notebook, the cell and what happened.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
from jupyter_client.manager import AsyncKernelManager
from papermill.engines import NBClientEngine, NotebookExecutionManager, papermill_engines
from traitlets import default

from .folders import write_atomic, write_error
from .processes import Terminated, describe_exit, ignoring_sigint, tail

KERNEL = "python3"
"""The Jupyter kernel every course notebook names (its ``kernelspec``)."""
ENGINE = "course"


class NotebookFailed(RuntimeError):
    """A notebook did not run to its end; the message names the notebook, the cell and the error.

    Attributes:
      output: the executed notebook kept, up to the failing cell.
    """

    def __init__(self, message: str, output: Path | None = None):
        super().__init__(message)
        self.output = output


class KernelDied(NotebookFailed):
    """The kernel process died during a cell (killed by a signal, e.g. by the system when memory ran out)."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a notebook; the kernel is stopped and the notebook up to that cell kept.

    Attributes:
      output: the executed notebook kept.
      exit_code: 130 for Ctrl-C (SIGINT), 143 for SIGTERM: what a shell reports for those signals.
    """

    def __init__(self, message: str, output: Path | None = None, exit_code: int = 130):
        super().__init__(message)
        self.output = output
        self.exit_code = exit_code


class RunRefused(ValueError):
    """A run was refused before anything started; the message names the problem and the fix."""


class _Run:
    """What one :func:`execute` call knows while papermill runs: the running cell and the kernel process."""

    def __init__(self, log_path: Path, env: dict | None):
        self.log_path, self.env = log_path, env
        self.cell: tuple[int, nbformat.NotebookNode] | None = None
        self.counts = 0  # the highest execution count before the running cell
        self.kernels: list[subprocess.Popen] = []
        self.log = None

    def where(self) -> str:
        if self.cell is None:
            return "before its first cell"
        _, cell = self.cell
        number = (
            cell.execution_count or self.counts + 1
        )  # not echoed yet when the kernel died at once
        first = next((line for line in cell.source.splitlines() if line.strip()), "").strip()
        return f"in cell [{number}] `{first[:60]}`"

    def stop_kernels(self) -> None:
        """Kill what is left of the kernel's process group (nbclient's own shutdown may have been cut short)."""
        for p in self.kernels:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover - uninterruptible sleep
                pass

    def kernel_exit(self) -> str:
        codes = [p.poll() for p in self.kernels]
        return describe_exit(codes[-1]) if codes and codes[-1] is not None else "no exit status"


class _Manager(NotebookExecutionManager):
    """papermill's execution manager, saving atomically and telling the run which cell is running."""

    def __init__(self, nb, run: _Run, **kwargs):
        super().__init__(nb, **kwargs)
        self.run = run

    def save(self, **kwargs):
        if kwargs.get("nb"):
            self.nb = kwargs["nb"]
        if self.output_path:
            write_atomic(self.output_path, nbformat.writes(self.nb))
        self.last_save_time = self.now()

    def cell_start(self, cell, cell_index=None, **kwargs):
        before = self.nb.cells[:cell_index] if cell_index is not None else []
        self.run.counts = max([c.get("execution_count") or 0 for c in before] + [0])
        self.run.cell = (cell_index, cell)
        super().cell_start(cell, cell_index, **kwargs)

    def mark_stopped(self, error: BaseException, why: str) -> None:
        """The running cell failed: status, and an error output saying why (unless the kernel wrote one)."""
        if self.run.cell is None:
            return
        index, cell = self.run.cell
        self.cell_exception(cell, cell_index=index)
        if not any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            cell.outputs.append(
                nbformat.v4.new_output(
                    "error", ename=type(error).__name__, evalue=why, traceback=[why]
                )
            )


class CourseEngine(NBClientEngine):
    """papermill's nbclient engine with :class:`_Manager` (registered as ``"course"``)."""

    @classmethod
    def execute_notebook(
        cls, nb, kernel_name, output_path=None, progress_bar=True, log_output=False, **kwargs
    ):
        run = kwargs.pop("course_run")
        kwargs.pop("autosave_cell_every", None)
        nb_man = _Manager(
            nb, run, output_path=output_path, progress_bar=progress_bar, log_output=log_output
        )
        nb_man.notebook_start()
        try:
            cls.execute_managed_notebook(nb_man, kernel_name, log_output=log_output, **kwargs)
        except BaseException as e:
            nb_man.mark_stopped(e, _why(e, run))
            raise
        finally:
            nb_man.cleanup_pbar()
            nb_man.notebook_complete()
        return nb_man.nb


papermill_engines.register(ENGINE, CourseEngine)


def _why(error: BaseException, run: _Run) -> str:
    if isinstance(error, Terminated):
        return "stopped by SIGTERM"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    if type(error).__name__ == "DeadKernelError":
        return f"the kernel died ({run.kernel_exit()})"
    return f"{type(error).__name__}: {error}"


def _kernel_manager_class(run: _Run) -> type:
    """A kernel manager that logs the kernel's own output to ``run.log`` and keeps its process."""

    class CourseKernelManager(AsyncKernelManager):
        @default("transport_encryption")
        def _encrypted(self):
            # The kernel's channels encrypted with CurveZMQ keys made for this kernel (ipykernel's spec
            # declares support): no "Kernel is running over TCP without encryption" warning in its log.
            import zmq

            return "auto" if zmq.has("curve") else "disabled"

        async def _async_interrupt_kernel(self):
            # jupyter_client's shutdown starts with a SIGINT. After the last cell the kernel is idle and the
            # shutdown request alone ends it; the SIGINT, landing wherever the kernel happens to be, made it
            # print "KeyboardInterrupt caught in kernel" (or a ZMQ traceback) into the log of a run that
            # ended well, on a busy machine. A cell that must be stopped is stopped by the run (Ctrl-C,
            # SIGTERM: stop_kernels) or by nbclient's timeout (interrupt_kernel), not here.
            if self.shutting_down:
                return
            await super()._async_interrupt_kernel()

        async def _async_launch_kernel(self, kernel_cmd, **kw):
            kw["stdout"] = kw["stderr"] = run.log
            env = dict(kw.get("env") or os.environ)
            for name, value in (run.env or {}).items():
                if value is None:
                    env.pop(name, None)
                else:
                    env[name] = value
            kw["env"] = env
            await super()._async_launch_kernel(kernel_cmd, **kw)
            run.kernels.append(self.provisioner.process)

    return CourseKernelManager


def check_kernel(name: str = KERNEL) -> None:
    """The Jupyter kernel ``name`` must run this Python (the one with the course installed).

    Raises:
      RunRefused: no such kernel, or its ``kernel.json`` starts another interpreter (found through
        ``JUPYTER_PATH``, a user-wide kernelspec, …), named with the fix.
    """
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(name)
    except NoSuchKernel:
        raise RunRefused(
            f"no Jupyter kernel named {name!r} (the course's notebooks use it): run `make setup`, which "
            f"installs ipykernel and its kernel into .venv"
        ) from None
    exe = spec.argv[0] if spec.argv else ""
    if exe in ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}"):
        return  # jupyter_client starts these with this interpreter
    if os.path.abspath(exe) == os.path.abspath(sys.executable) or _prefix(exe) == sys.prefix:
        return
    where = f"JUPYTER_PATH={os.environ['JUPYTER_PATH']!r}" if os.environ.get("JUPYTER_PATH") else ""
    raise RunRefused(
        f"the Jupyter kernel {name!r} found in {spec.resource_dir} {('(' + where + ') ') if where else ''}"
        f"runs {exe}, not this environment's {sys.executable}: its Python lacks the course's packages. "
        f"Remove that kernelspec (`jupyter kernelspec remove {name}`) or unset JUPYTER_PATH."
    )


def _prefix(exe: str) -> str | None:
    try:
        r = subprocess.run(
            [exe, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def check_parameters(notebook: Path, parameters: dict) -> None:
    """Every parameter name must be declared in the notebook's ``parameters`` cell.

    papermill only logs "Passed unknown parameter" and injects it; the notebook then runs with its default
    (``n_device=2`` runs on 8 devices).

    Raises:
      RunRefused: naming the unknown names, the closest declared one and the declared ones.
    """
    import difflib

    import papermill as pm

    declared = list(pm.inspect_notebook(str(notebook)))
    unknown = [k for k in parameters if k not in declared]
    if unknown:
        near = {k: difflib.get_close_matches(k, declared, n=1) for k in unknown}
        hints = ", ".join(
            f"{k!r}" + (f" (did you mean {m[0]!r}?)" if m else "") for k, m in near.items()
        )
        raise RunRefused(
            f"{notebook.name} has no parameter {hints}; its parameters are: {', '.join(declared)}"
        )


def execute(
    notebook: Path, output: Path, parameters: dict, progress: bool = True, env: dict | None = None
) -> float:
    """Execute ``notebook`` into ``output`` with papermill; return the seconds it took.

    Args:
      notebook: the notebook to run (its folder is the kernel's working folder).
      output: where the executed notebook goes (saved after every cell); the kernel's own output goes to
        ``output`` with the suffix ``.kernel.log`` (removed after a run that ended well if it is empty).
      parameters: papermill parameters; every name must be declared in the notebook.
      progress: show papermill's progress bar.
      env: environment variables to set (a value of None removes one) for the kernel only.

    Raises:
      RunRefused: before anything started (see :func:`check_kernel`, :func:`check_parameters`).
      NotebookFailed: a cell raised; :class:`KernelDied`: the kernel died. Each names the notebook and the
        cell; the executed notebook up to that cell is at ``output``.
      RunInterrupted: Ctrl-C or SIGTERM (a ``KeyboardInterrupt``); the kernel is stopped.
    """
    import papermill as pm
    from nbclient.exceptions import DeadKernelError

    notebook, output = Path(notebook), Path(output)
    check_kernel()
    check_parameters(notebook, parameters)
    run = _Run(output.with_suffix(".kernel.log"), env)
    t0 = time.perf_counter()
    handler = logging.FileHandler(run.log_path, delay=True)
    papermill_log = logging.getLogger("papermill")
    papermill_log.addHandler(
        handler
    )  # nbclient's "Kernel died" lines: to the log, not the terminal
    try:
        with open(run.log_path, "ab") as run.log:
            _papermill(notebook, output, parameters, progress, run)
    except pm.PapermillExecutionError as e:
        raise NotebookFailed(
            f"{notebook.name} failed in cell [{e.exec_count}] with {e.ename}: {e.evalue}\n"
            f"the executed notebook, up to the failing cell, is {output}",
            output,
        ) from None
    except DeadKernelError:
        raise _kernel_died(notebook, output, run) from None
    except OSError as e:
        # saving the executed notebook (a full disk): the last complete save is kept
        kept = (
            f"the executed notebook's last complete save is kept at {output}"
            if output.exists()
            else "no copy of the executed notebook could be saved"
        )
        raise NotebookFailed(
            f"{notebook.name}: {write_error(e, e.filename or output)} {run.where()}; {kept}", output
        ) from None
    except (
        RuntimeError
    ) as e:  # "Kernel died before replying to kernel_info", "Kernel didn't respond"
        if "Kernel" not in str(e):
            raise
        raise _kernel_died(notebook, output, run, str(e)) from None
    except KeyboardInterrupt as e:
        raise _interrupted(notebook, output, run, e, time.perf_counter() - t0) from None
    finally:
        papermill_log.removeHandler(handler)
        handler.close()
        with ignoring_sigint():
            run.stop_kernels()
    if run.log_path.exists() and run.log_path.stat().st_size == 0:
        run.log_path.unlink()  # the run ended well and the kernel said nothing: no empty file left
    return time.perf_counter() - t0


def _papermill(
    notebook: Path, output: Path, parameters: dict | None, progress: bool, run: _Run
) -> None:
    """papermill's run of ``notebook``, its kernel started again (up to :data:`KERNEL_STARTS` times) when it
    dies before it answers."""
    import papermill as pm

    for attempt in range(1, KERNEL_STARTS + 1):
        try:
            pm.execute_notebook(
                str(notebook),
                str(output),
                parameters=parameters,
                kernel_name=KERNEL,
                engine_name=ENGINE,
                cwd=str(notebook.parent),
                progress_bar=progress,
                log_output=False,
                kernel_manager_class=_kernel_manager_class(run),
                course_run=run,
            )
            return
        except RuntimeError as e:
            if not _start_failed(e, run) or attempt == KERNEL_STARTS:
                raise
            run.stop_kernels()
            run.log.write(
                f"[course] kernel start {attempt} failed ({e}); starting again\n".encode()
            )


def _interrupted(notebook: Path, output: Path, run: _Run, error: BaseException, seconds: float):
    # The cell that was running ends later with DeadKernelError (its kernel is stopped); when its event loop
    # is collected, asyncio logs "Task exception was never retrieved" with a traceback. Into the run's log.
    asyncio_log = logging.getLogger("asyncio")
    asyncio_log.addHandler(logging.FileHandler(run.log_path, delay=True))
    asyncio_log.propagate = False
    code, what = (
        (143, "stopped by SIGTERM") if isinstance(error, Terminated) else (130, "interrupted")
    )
    return RunInterrupted(
        f"{notebook.name} {what} {run.where()} after {seconds:.0f} s; the kernel was stopped; the executed "
        f"notebook up to that cell is {output}",
        output,
        code,
    )


KERNEL_STARTS = 3
"""Starts a run gets when its kernel dies before it answers (nothing of the notebook has run yet): with
several kernels starting at once a new kernel can lose one of the ports it was handed to another and exit
("Address already in use"); a fresh start picks new ports."""


def _start_failed(error: RuntimeError, run: _Run) -> bool:
    """Whether ``error`` is a kernel that died while starting, before any cell of the notebook ran."""
    return run.cell is None and "before replying to kernel_info" in str(error)


_NOT_THE_KERNELS = ("without encryption", "Kernel died", "Error occurred while starting new kernel")
"""Log lines that are nbclient's or ipykernel's boilerplate, not what the kernel said before it died."""


def _kernel_died(notebook: Path, output: Path, run: _Run, detail: str = "") -> KernelDied:
    last = [
        line
        for line in tail(run.log_path, 30).splitlines()
        if line.strip() and not any(n in line for n in _NOT_THE_KERNELS)
    ][-3:]
    quoted = ("; its last log lines: " + " | ".join(s.strip()[:200] for s in last)) if last else ""
    how = f"{detail}; " if detail else ""
    return KernelDied(
        f"the kernel running {notebook.name} died {run.where()}: {how}{run.kernel_exit()}{quoted}\n"
        f"the executed notebook up to that cell is {output}; the kernel's log is {run.log_path}",
        output,
    )

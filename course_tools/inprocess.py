"""Run a notebook in this Python process, without a Jupyter kernel: for hosts where no kernel can start.

A Jupyter kernel talks to its client over TCP sockets on the loopback. Some accelerator hosts allow no TCP
socket at all (a sandboxed TPU host allows unix sockets only), so neither papermill nor JupyterLab can run
a notebook there. :func:`execute` runs the notebook's code cells in order in an IPython shell inside this
process, the way papermill would in a kernel:

- the values in ``parameters`` are injected in a new cell (tagged ``injected-parameters``) right after the
  cell tagged ``parameters``; a name that cell does not assign is refused before anything runs;
- each cell's printed text, rich outputs (tables, plots drawn with matplotlib's inline backend) and error
  are kept as the cell's outputs, and the executed notebook is written (atomically) after every cell;
- a cell tagged ``raises-exception`` may raise; any other error stops the run (``keep_going=True`` runs on
  and reports the first failure);
- each cell's wall time is recorded in the report.

Differences from a kernel run: one notebook per process (a notebook's device setup must run before JAX
starts, and JAX starts once per process); widgets and ``input()`` do not work; ``%%`` cell magics and
``!`` shell lines run as IPython runs them outside Jupyter; a cell's last value is printed (``Out[0]: …``)
unless the cell ends in ``;``, as in a kernel (the lessons' check cells do: the checker prints its verdict).

``python -m course_tools.inprocess NOTEBOOK OUTPUT [-p NAME VALUE]... [--report FILE] [--keep-going]``
(``tools/tpu_check.sh`` runs every notebook this way).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

PARAMETERS_TAG = "parameters"
INJECTED_TAG = "injected-parameters"
RAISES_TAG = "raises-exception"


class InProcessRefused(ValueError):
    """The run was refused before any cell ran; the message names the problem and the fix."""


def declared_parameters(nb: dict) -> tuple[int, set[str]]:
    """The index of the cell tagged ``parameters`` and the names it assigns.

    Raises:
      InProcessRefused: no code cell is tagged ``parameters``.
    """
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code" and PARAMETERS_TAG in cell.get("metadata", {}).get(
            "tags", []
        ):
            tree = ast.parse(_source(cell))
            names = {
                t.id
                for node in tree.body
                if isinstance(node, ast.Assign | ast.AnnAssign)
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(t, ast.Name)
            }
            return i, names
    raise InProcessRefused(
        "the notebook has no code cell tagged 'parameters': nothing can be injected"
    )


def parse_value(text: str) -> Any:
    """A parameter given on the command line: a Python literal (``8``, ``'gpu'``, ``True``) or else a string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


class _Shell:
    """An IPython shell that runs cells in this process and captures what each one shows."""

    _class = None

    def __init__(self):
        from IPython.core.displayhook import DisplayHook
        from IPython.core.interactiveshell import InteractiveShell

        if _Shell._class is None:

            class Hook(DisplayHook):
                # the cell being run: IPython reads it from a history these runs do not keep
                cell = ""

                def quiet(self):  # a cell ending in ";" shows no value, as in a kernel
                    return self.semicolon_at_end_of_expression(self.cell)

            class Shell(InteractiveShell):
                displayhook_class = Hook

                def enable_gui(self, gui=None):  # no event loop to hook: plots are captured inline
                    pass

            _Shell._class = Shell
        os.environ.setdefault("MPLBACKEND", "Agg")
        from traitlets.config import Config

        config = Config()
        config.HistoryManager.enabled = False  # no history file: runs may share a home folder
        fresh = not _Shell._class.initialized()
        self.shell = _Shell._class.instance(config=config, colors="nocolor")
        if fresh:
            try:
                self.shell.enable_matplotlib("inline")
            except Exception:  # matplotlib or matplotlib-inline missing: plots are not captured
                pass
        else:  # one shell per process (matplotlib's inline backend binds to it): a fresh namespace
            self.shell.reset(new_session=False)

    def run(self, source: str) -> tuple[list[dict], BaseException | None]:
        from IPython.utils.capture import capture_output

        self.shell.displayhook.cell = source
        with capture_output() as cap:
            result = self.shell.run_cell(source, store_history=False)
        outputs = []
        if cap.stdout:
            outputs.append({"output_type": "stream", "name": "stdout", "text": cap.stdout})
        if cap.stderr:
            outputs.append({"output_type": "stream", "name": "stderr", "text": cap.stderr})
        for rich in cap.outputs:
            data = {k: v for k, v in rich.data.items()}
            outputs.append(
                {"output_type": "display_data", "data": data, "metadata": rich.metadata or {}}
            )
        error = result.error_before_exec or result.error_in_exec
        if error is not None:
            outputs.append(
                {
                    "output_type": "error",
                    "ename": type(error).__name__,
                    "evalue": str(error)[:4000],
                    "traceback": [],
                }
            )
        return outputs, error


def _write(nb: dict, output: Path) -> None:
    tmp = output.with_name(f".{output.name}.tmp")
    tmp.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, output)


def _with_parameters(nb: dict, notebook, parameters: dict) -> dict:
    """``nb`` with ``parameters`` injected in a new cell after the ``parameters`` cell (papermill's way).

    Raises:
      InProcessRefused: no ``parameters`` cell, or a name it does not assign.
    """
    at, names = declared_parameters(nb)
    unknown = sorted(set(parameters) - names)
    if unknown:
        raise InProcessRefused(
            f"{Path(notebook).name} has no parameter {', '.join(unknown)}: its parameters cell assigns "
            f"{', '.join(sorted(names))}"
        )
    if parameters:
        lines = ["# Parameters injected for this run"] + [
            f"{k} = {v!r}" for k, v in parameters.items()
        ]
        injected = {
            "cell_type": "code",
            "execution_count": None,
            "id": "injected-parameters",
            "metadata": {"tags": [INJECTED_TAG]},
            "outputs": [],
            "source": "\n".join(lines) + "\n",
        }
        nb["cells"].insert(at + 1, injected)
    return nb


def execute(
    notebook: str | os.PathLike,
    output: str | os.PathLike,
    parameters: dict[str, Any] | None = None,
    *,
    keep_going: bool = False,
    echo: bool = True,
) -> dict:
    """Run ``notebook``'s code cells in this process and write the executed notebook to ``output``.

    Args:
      notebook: the ``.ipynb`` to run (not changed).
      output: where the executed notebook goes (written after every cell; its folder must exist).
      parameters: values injected after the ``parameters`` cell, e.g. ``{"n_devices": 1}``.
      keep_going: run past a failing cell (the report names the first failure).
      echo: print each cell's text output as it runs (a log for a host with no notebook viewer).

    Returns:
      A report: ``{"notebook", "parameters", "ok", "failed_cell", "error", "cells": [{"index", "seconds",
      "error"?}], "seconds", "memory_stats"}``; ``failed_cell`` is the 0-based index in the executed notebook's cells.

    Raises:
      InProcessRefused: no ``parameters`` cell, or a parameter name it does not assign (a typo such as
        ``n_device`` would otherwise run the notebook with its default).
    """
    parameters = dict(parameters or {})
    nb = _with_parameters(
        json.loads(Path(notebook).read_text(encoding="utf-8")), notebook, parameters
    )
    shell = _Shell()
    report: dict[str, Any] = {
        "notebook": str(notebook),
        "parameters": parameters,
        "ok": True,
        "failed_cell": None,
        "error": None,
        "cells": [],
    }
    start = time.perf_counter()
    count = 0
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        count += 1
        t0 = time.perf_counter()
        outputs, error = shell.run(_source(cell))
        cell["outputs"], cell["execution_count"] = outputs, count
        row: dict[str, Any] = {"index": i, "seconds": round(time.perf_counter() - t0, 2)}
        if echo:
            print(f"--- cell {i} ({row['seconds']} s)", flush=True)
            for out in outputs:
                if out["output_type"] == "stream":
                    print(out["text"], end="" if out["text"].endswith("\n") else "\n", flush=True)
        expected = RAISES_TAG in cell.get("metadata", {}).get("tags", [])
        if error is not None and not expected:
            row["error"] = f"{type(error).__name__}: {str(error)[:2000]}"
            if echo:
                print(f"!!! cell {i} failed: {row['error']}", flush=True)
            if report["ok"]:
                report.update(ok=False, failed_cell=i, error=row["error"])
        report["cells"].append(row)
        _write(nb, Path(output))
        if (error is not None and not expected and not keep_going) or isinstance(
            error, KeyboardInterrupt
        ):
            break
    report["seconds"] = round(time.perf_counter() - start, 1)
    report["memory_stats"] = _memory_stats()
    return report


def _memory_stats() -> dict | None:
    """The first device's allocator statistics after the run (``peak_bytes_in_use``, ``bytes_limit`` …),
    when the notebook started JAX on an accelerator; None on CPU (XLA:CPU keeps none) or without JAX."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:
        return None
    return {k: int(v) for k, v in stats.items()} if stats else None


def main(argv: list[str] | None = None) -> int:
    """The command line; exit status 0 when every cell ran, 1 when one failed, 2 when refused."""
    parser = argparse.ArgumentParser(
        prog="python -m course_tools.inprocess",
        description="Run a notebook in this process (no Jupyter kernel), papermill-style parameters.",
    )
    parser.add_argument("notebook")
    parser.add_argument("output")
    parser.add_argument(
        "-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE")
    )
    parser.add_argument("--report", help="write the run's report (JSON) here")
    parser.add_argument("--keep-going", action="store_true", help="run past a failing cell")
    args = parser.parse_args(argv)
    params = {name: parse_value(value) for name, value in args.parameter}
    try:
        report = execute(args.notebook, args.output, params, keep_going=args.keep_going)
    except InProcessRefused as e:
        print(f"refused: {e}", file=sys.stderr)
        return 2
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    status = "ok" if report["ok"] else f"FAILED at cell {report['failed_cell']}: {report['error']}"
    print(f"=== {args.notebook}: {status} ({report['seconds']} s)", flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

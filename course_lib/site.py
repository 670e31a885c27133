"""The course as a book: a course run's executed notebooks rendered by Sphinx (myst-nb, sphinx-book-theme).

    python -m course_lib.site build/course build/site                 # a course run (make course)
    python -m course_lib.site --student notebooks build/site-student  # the student version

The book's Sphinx configuration and its page templates are in ``docs/book/``. This module stages the sources
in a temporary folder — the run's notebooks as they were executed (never executed again), the pages rendered
from ``docs/book/pages/`` with the run's metadata and results, the lab's plots — and runs Sphinx on them.
Taught by none of the notebooks: it is the course's publishing step.
"""

from __future__ import annotations

import argparse
import ast
import html
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

if __name__ == "__main__":  # the command's own process only: why, in docs/book/conf.py (about 2 s of CPU)
    sys.modules.setdefault("rfc3987_syntax", None)

import nbformat  # noqa: E402

from . import results  # noqa: E402  (moves with this module)

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "docs" / "book"
"""The book's Sphinx configuration (``conf.py``), course map (``course_map.toml``) and page templates."""
INSTRUCTOR_GUIDE = ROOT / "docs" / "instructor-guide.md"

REFERENCE_FILE, REFERENCE_SCALING_FILE = "reference_cpu_8sim.csv", "reference_cpu_8sim_scaling.csv"
"""The committed reference run in ``data/`` that the lab report shows beside the run's results."""
LAB_PLOTS = {
    "loss_curves.png": "training loss per step of every strategy (parity: the curves lie on top of each other)",
    "comparison.png": "samples/s, median step time, compiled bytes per device and achieved FLOP/s per strategy",
    "scaling.png": "strong scaling: throughput against device count at a fixed global batch",
}


def course_map() -> list[dict]:
    """The lessons in reading order, from ``docs/book/course_map.toml``.

    Returns:
      One dict per notebook: ``stem`` (``"06_shard_map"``), ``number`` (``"06"``), ``title``, ``teaches``
      and ``jax_docs`` (a list of ``{"title", "url"}`` links to the official JAX documentation).
    """
    with open(BOOK / "course_map.toml", "rb") as f:
        lessons = tomllib.load(f)["lesson"]
    return [{**lesson, "number": lesson["stem"][:2]} for lesson in lessons]


def build_site(source: str | Path, out: str | Path, student: bool = False, strict: bool = False) -> list[Path]:
    """Build the book of ``source`` into the empty folder ``out``; return its pages, the home page first.

    Args:
      source: a course run (``make course`` writes ``build/course``: executed ``NN_name.ipynb``, ``lab/``
        with the lab's results files and plots, ``timings.csv``), or with ``student=True`` a folder of
        notebooks to render as the student version (``notebooks``: their solutions are replaced by stubs
        with ``course_lib.student`` and their outputs cleared).
      out: the folder for the HTML (``out/index.html`` is the home page). It must be empty or not exist.
      student: build the student version: exercises without solutions, no outputs, no run pages.
      strict: fail on any Sphinx warning (the tests use it).

    Returns:
      The HTML pages in reading order: home, the ten lessons, then (course run) the lab report, the run's
      metadata and the instructor guide.

    Raises:
      FileNotFoundError: ``source`` holds no ``NN_name.ipynb`` notebooks.
      FileExistsError: ``out`` exists and is not empty (choose a new folder; nothing is overwritten).
      ValueError: a notebook of a course run was never executed (render a course run, or pass
        ``student=True``), or a notebook is not in ``docs/book/course_map.toml``.
      RuntimeError: Sphinx failed (its messages are in the error).
    """
    source, out = Path(source), Path(out)
    notebooks = {p.stem: p for p in sorted(source.glob("[0-9][0-9]_*.ipynb"))}
    if not notebooks:
        hint = "a folder of notebooks such as notebooks/" if student else "a course run; run `make course` first"
        raise FileNotFoundError(f"no NN_name.ipynb notebooks in {source}; give {hint}")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; give a new folder for the site")
    lessons = course_map()
    unknown = sorted(set(notebooks) - {lesson["stem"] for lesson in lessons})
    if unknown:
        raise ValueError(f"{unknown[0]}.ipynb is not in the course map; add it to {BOOK / 'course_map.toml'}")
    with tempfile.TemporaryDirectory(prefix="course-book-") as tmp:
        staging = Path(tmp) / "src"
        staging.mkdir()
        if student:
            from course_lib import student as student_version  # stays in course_lib

            student_version.generate(source, Path(tmp) / "student", overwrite=True)
            notebooks = {stem: Path(tmp) / "student" / p.name for stem, p in notebooks.items()}
        _stage(source, notebooks, lessons, staging, student)
        # Built beside the staging folder, then moved: myst-nb writes a jupyter_execute/ folder next to
        # Sphinx's output folder, which must not land beside the reader's ``out``.
        _sphinx(staging, Path(tmp) / "doctrees", Path(tmp) / "html" / "book", student, strict)
        out.mkdir(parents=True, exist_ok=True)
        for item in (Path(tmp) / "html" / "book").iterdir():
            shutil.move(item, out / item.name)
    names = ["index", *(lesson["stem"] for lesson in lessons)]
    if not student:
        names += ["lab-report", "run", "instructor-guide"]
    return [out / f"{name}.html" for name in names]


# --- staging: the sources Sphinx reads --------------------------------------------------------------------


def _stage(source: Path, notebooks: dict[str, Path], lessons: list[dict], staging: Path, student: bool) -> None:
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(BOOK / "pages"), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    missing = [lesson for lesson in lessons if lesson["stem"] not in notebooks]
    for lesson in lessons:
        lesson["missing"] = lesson in missing
        if lesson["missing"]:
            page = env.get_template("not-run.md.jinja").render(
                lesson=lesson, folder=source.name, label="not in this book" if student else "not in this run")
            (staging / f"{lesson['stem']}.md").write_text(page, encoding="utf-8")
        else:
            nb = _lesson_notebook(notebooks[lesson["stem"]], lesson, source, student)
            nbformat.write(nb, staging / f"{lesson['stem']}.ipynb")
    context = {"student": student, "lessons": lessons}
    if not student:
        run = _run_context(source, [n for n in lessons if not n["missing"]], [n["stem"] for n in missing])
        lab, ref = _lab_context(source, staging), _reference_context(staging)
        if lab:
            ref["comparable"], ref["difference"] = _comparable(lab["rows"], ref["rows"])
        context.update(run=run, lab=lab, ref=ref, simulated=run["simulated"], results_file=results.RESULTS_FILE)
        for name in ("lab-report", "run"):
            (staging / f"{name}.md").write_text(env.get_template(f"{name}.md.jinja").render(**context), encoding="utf-8")
        shutil.copyfile(INSTRUCTOR_GUIDE, staging / "instructor-guide.md")
    (staging / "index.md").write_text(env.get_template("index.md.jinja").render(**context), encoding="utf-8")


def _lesson_notebook(path: Path, lesson: dict, run_folder: Path, student: bool) -> nbformat.NotebookNode:
    """The notebook as the book shows it: papermill's injected-parameters cell replaced by a "run with" note
    (dropped in the student version), a line of official JAX documentation links after the title cell."""
    nb = nbformat.read(path, as_version=4)
    if not student and not any(c.cell_type == "code" and c.get("execution_count") for c in nb.cells):
        raise ValueError(f"{path} has not been executed: give a course run (`make course` writes build/course), "
                         f"or build the student version (--student)")
    cells = []
    for cell in nb.cells:
        if "injected-parameters" in cell.metadata.get("tags", []):
            if not student:
                cells.append(nbformat.v4.new_markdown_cell(_run_with_note(cell.source, run_folder)))
            continue
        cells.append(cell)
    links = " · ".join(f"[{d['title']}]({d['url']})" for d in lesson["jax_docs"])
    cells.insert(1, nbformat.v4.new_markdown_cell(f":::{{seealso}}\nOfficial JAX documentation: {links}\n:::"))
    nb.cells = cells
    _widgets_as_text(nb)
    return nb


def _widgets_as_text(nb: nbformat.NotebookNode) -> None:
    """Progress bars (tqdm's ipywidgets) as the text of their final state, and no widget state left: the book
    loads no widget JavaScript from the network, and a finished bar reads "20/20", not its first frame."""
    state = nb.metadata.pop("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})

    def text(model_id: str) -> str:
        model = state.get(model_id.removeprefix("IPY_MODEL_"), {})
        s = model.get("state", {})
        if model.get("model_name") == "HBoxModel":
            return " ".join(t for t in (text(c) for c in s.get("children", [])) if t)
        if model.get("model_name") == "HTMLModel":
            return html.unescape(re.sub(r"<[^>]+>", "", str(s.get("value", "")))).replace("\u2007", " ").strip()
        return ""

    for cell in nb.cells:
        outputs = []
        for o in cell.get("outputs", []):
            view = o.get("data", {}).get("application/vnd.jupyter.widget-view+json")
            if view is None:
                outputs.append(o)
            elif line := text(view.get("model_id", "")):
                outputs.append(nbformat.v4.new_output("stream", name="stdout", text=line + "\n"))
        if "outputs" in cell:
            cell.outputs = outputs


def _run_with_note(injected_source: str, run_folder: Path) -> str:
    values = ", ".join(f"`{k}={_short(v, run_folder)!r}`" for k, v in _assignments(injected_source).items())
    return (f":::{{container}} run-with\nRun with {values}: the parameters papermill passed to this notebook in "
            f"this course run (the `parameters` cell above holds the notebook's defaults).\n:::")


def _assignments(source: str) -> dict:
    """``name = literal`` lines of a parameters cell (papermill writes only those)."""
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                out[node.targets[0].id] = ast.unparse(node.value)
    return out


def _short(value, run_folder: Path):
    """A path inside the run folder as ``<run folder name>/...`` (not this machine's absolute path); other
    values as they are."""
    if isinstance(value, str) and value.startswith("/"):
        try:
            return str(Path(run_folder.name) / Path(value).relative_to(run_folder.resolve()))
        except ValueError:
            return value
    return value


# --- the run's metadata, as its notebooks recorded it ------------------------------------------------------

_REPORT_LINES = {
    "platform": re.compile(r"^platform\s*:\s*(?P<platform>\S+) \((?P<kind>simulated on the CPU|real)\)", re.M),
    "devices": re.compile(r"^devices\s*:\s*(?P<n>\d+) of (?P<available>\d+) available \((?P<device_kind>.*)\)\s*$", re.M),
    "versions": re.compile(r"^jax / jaxlib\s*:\s*(?P<jax>\S+) / (?P<jaxlib>\S+)", re.M),
    "python": re.compile(r"^python\s*:\s*(?P<python>\S+) on (?P<host_cpus>\d+) host CPU cores", re.M),
}


def device_report(nb: nbformat.NotebookNode) -> dict | None:
    """The device report an executed notebook printed (``print(setup_devices(...))``), as plain values.

    Returns:
      ``{"platform", "simulated", "n_devices", "n_available", "device_kind", "jax_version", "jaxlib_version",
      "python_version", "host_cpus"}``, or None when no cell printed a device report.
    """
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            text = o.get("text", "") if o.get("output_type") == "stream" else ""
            found = {k: rx.search(text) for k, rx in _REPORT_LINES.items()}
            if all(found.values()):
                p, d, v, py = found["platform"], found["devices"], found["versions"], found["python"]
                return {"platform": p["platform"], "simulated": p["kind"] != "real", "n_devices": int(d["n"]),
                        "n_available": int(d["available"]), "device_kind": d["device_kind"],
                        "jax_version": v["jax"], "jaxlib_version": v["jaxlib"], "python_version": py["python"],
                        "host_cpus": int(py["host_cpus"])}
    return None


def _devices_text(r: dict | None) -> str:
    if r is None:
        return "not reported"
    return f"{r['n_devices']} × {r['device_kind']}" + (" (simulated)" if r["simulated"] else f" ({r['platform']})")


def _run_context(source: Path, present: list[dict], missing: list[str]) -> dict:
    import pandas as pd

    timings = {}
    if (source / "timings.csv").exists():
        timings = pd.read_csv(source / "timings.csv").set_index("notebook").to_dict("index")
    rows, reports, starts, ends, papermill, failed = [], [], [], [], set(), []
    for lesson in present:
        nb = nbformat.read(source / f"{lesson['stem']}.ipynb", as_version=4)
        pm = nb.metadata.get("papermill", {})
        report = device_report(nb)
        reports.append(report)
        starts += [pm["start_time"]] if pm.get("start_time") else []
        ends += [pm["end_time"]] if pm.get("end_time") else []
        papermill |= {pm["version"]} if pm.get("version") else set()
        t = timings.get(f"{lesson['stem']}.ipynb", {})
        seconds = t.get("seconds", pm.get("duration"))
        params = ", ".join(f"`{k}={_short(v, source)!r}`" for k, v in pm.get("parameters", {}).items())
        status = str(t.get("status", "FAILED" if pm.get("exception") else "ok"))
        failed += [lesson["stem"]] if status != "ok" else []
        rows.append([f"{{doc}}`{lesson['stem']} <{lesson['stem']}>`", status,
                     "—" if seconds is None or seconds != seconds else f"{float(seconds):.0f} s",
                     _when(pm.get("start_time")), params or "—", _devices_text(report)])
    known = [r for r in reports if r]
    first = known[0] if known else None
    disagree = len({tuple(sorted(r.items())) for r in known}) > 1
    if first:
        devices = [
            ["platform", f"{first['platform']} ({'simulated CPU devices' if first['simulated'] else 'real devices'})"],
            ["device kind", first["device_kind"]],
            ["device count", f"{first['n_devices']} used, of {first['n_available']} available"],
            ["simulated", "yes" if first["simulated"] else "no"],
            ["JAX / jaxlib", f"{first['jax_version']} / {first['jaxlib_version']}"],
            ["Python", first["python_version"]],
            ["host CPU cores", str(first["host_cpus"])],
        ]
        summary = (f"{first['n_devices']} {'simulated CPU' if first['simulated'] else first['device_kind']} "
                   f"device{'s' if first['n_devices'] != 1 else ''} (JAX {first['jax_version']})")
    else:
        devices, summary = [["devices", "not reported by the notebooks"]], "the devices of the run"
    date = f"{_when(min(starts))} to {_when(max(ends))}" if starts and ends else "date not recorded"
    devices.append(["date (UTC)", date])
    devices.append(["run folder", f"`{source.name}`"])
    if papermill:
        devices.append(["papermill", ", ".join(sorted(papermill))])
    lab = None
    lab_dir = source / "lab"
    if (lab_dir / results.RESULTS_FILE).exists():
        r = results.load_results(lab_dir)["results"].iloc[0]
        lab = {"headers": ["setting", "value"], "rows": [
            ["profile", str(r.get("profile", "—"))], ["global batch", str(r["global_batch"])],
            ["image size", f"{r['image_size']} × {r['image_size']} × 3"], ["timed steps", str(r["steps"])],
            ["host CPU", f"{r.get('cpu_model', '—')} ({r.get('host_cpus', '—')} cores)"],
            ["measured at", _when(str(r.get("timestamp", "")))],
        ]}
    return {
        "folder": source.name, "summary": summary, "date": date.split(" to ")[0].split(" ")[0],
        "simulated": bool(first and first["simulated"]), "disagree": disagree, "missing": missing, "failed": failed,
        "timings": bool(timings), "lab": lab,
        "devices": {"headers": ["", "this run"], "rows": devices},
        "notebooks": {"headers": ["notebook", "status", "time", "started (UTC)", "parameters", "devices"], "rows": rows},
    }


def _when(iso: str | None) -> str:
    """``2026-12-01T08:44:55.46+00:00`` → ``2026-12-01 08:44``."""
    if not iso:
        return "—"
    m = re.match(r"(\d{4}-\d\d-\d\d)T(\d\d:\d\d)", iso)
    return f"{m[1]} {m[2]}" if m else iso


# --- the lab report: this run's results and the committed reference ----------------------------------------

_TIME_COLUMNS = [  # (header, column, format): what each strategy's step costs in time
    ("strategy", "label", str), ("devices", "n_devices", str), ("mesh", "mesh", str),
    ("median step (ms)", "step_time_s", lambda v: f"{v * 1e3:.1f}"),
    ("IQR (ms)", "step_time_iqr_s", lambda v: f"{v * 1e3:.1f}"),
    ("× A", "x_jit", lambda v: f"{v:.2f}"),
    ("samples/s", "samples_per_s", lambda v: f"{v:,.0f}"),
    ("compile (s)", "compile_s", lambda v: f"{v:.2f}"),
]
_WORK_COLUMNS = [  # ... and in memory, arithmetic and communication
    ("strategy", "label", str),
    ("bytes / device", "bytes_per_device", lambda v: f"{v:,.0f}"),
    ("parameter bytes / device", "param_bytes_per_device", lambda v: f"{v:,.0f}"),
    ("FLOPs / step", "flops_per_step", lambda v: f"{v / 1e9:.2f} G"),
    ("collectives", "collectives", str),
    ("final loss", "final_loss", lambda v: f"{v:.4g}"),
]


def _table(df, columns) -> dict:
    """Rows of ``df`` as formatted text cells for a pipe table (``_macros.jinja``); absent columns are left out."""
    cols = [(h, c, f) for h, c, f in columns if c in df.columns]
    rows = []
    for _, r in df.iterrows():
        rows.append([("—" if r[c] != r[c] else f(r[c])).replace("|", "\\|") for _, c, f in cols])
    return {"headers": [h for h, _, _ in cols], "rows": rows}


def _results_tables(df) -> list[dict]:
    jit = df.loc[df["strategy"] == "jit", "step_time_s"]
    df = df.assign(x_jit=df["step_time_s"] / float(jit.iloc[0])) if len(jit) else df
    return [_table(df, _TIME_COLUMNS), _table(df, _WORK_COLUMNS)]


def _scaling_table(df) -> dict:
    from course_lib import plots  # stays in course_lib

    eff = plots.scaling_efficiency(df)
    return _table(eff, [("strategy", "strategy", lambda v: f"`{v}`"), ("devices", "n_devices", str),
                        ("samples/s", "samples_per_s", lambda v: f"{v:,.0f}"), ("efficiency", "efficiency", lambda v: f"{v:.2f}")])


def _workload(df) -> str:
    r = df.iloc[0]
    n = int(df.loc[df["strategy"] != "jit", "n_devices"].max()) if (df["strategy"] != "jit").any() else int(r["n_devices"])
    simulated = str(r.get("simulated", "")).lower() == "true"
    devices = f"{n} simulated CPU devices" if simulated else f"{n} `{r['device_kind']}` devices ({r['platform']})"
    return (f"profile `{r.get('profile', '?')}` ({r['image_size']} × {r['image_size']} × 3 images, global batch "
            f"{r['global_batch']}, {r['steps']} timed steps) on {devices}, JAX {r['jax_version']}, measured "
            f"{_when(str(r.get('timestamp', '')))} UTC.")


def _lab_context(source: Path, staging: Path) -> dict | None:
    lab_dir = source / "lab"
    if not (lab_dir / results.RESULTS_FILE).exists():
        return None
    data = results.load_results(lab_dir)
    (staging / "lab").mkdir()
    plots = []
    for png in sorted(lab_dir.glob("*.png"), key=lambda p: (list(LAB_PLOTS).index(p.name) if p.name in LAB_PLOTS else 99, p.name)):
        shutil.copyfile(png, staging / "lab" / png.name)
        plots.append({"path": f"lab/{png.name}", "caption": LAB_PLOTS.get(png.name, png.stem.replace("_", " "))})
    return {"rows": data["results"], "summary": "Measured with " + _workload(data["results"]),
            "results": _results_tables(data["results"]), "plots": plots,
            "scaling": _scaling_table(data["scaling"]) if "scaling" in data else None}


def _reference_context(staging: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_lib import plots  # stays in course_lib

    rows = results.load_reference(REFERENCE_FILE)
    (staging / "reference").mkdir()
    figures = [{"path": "reference/comparison.png", "caption": LAB_PLOTS["comparison.png"]}]
    plots.save(plots.comparison(rows), staging / figures[0]["path"])
    scaling = None
    try:
        srows = results.load_reference(REFERENCE_SCALING_FILE)
        scaling = _scaling_table(srows)
        plots.save(plots.scaling(srows), staging / "reference" / "scaling.png")
        figures.append({"path": "reference/scaling.png", "caption": LAB_PLOTS["scaling.png"]})
    except FileNotFoundError:
        pass
    plt.close("all")
    return {"file": REFERENCE_FILE, "rows": rows, "summary": _workload(rows), "results": _results_tables(rows),
            "plots": figures, "scaling": scaling, "comparable": False, "difference": ""}


def _comparable(run, ref) -> tuple[bool, str]:
    def key(df):
        r = df.iloc[0]
        n = int(df.loc[df["strategy"] != "jit", "n_devices"].max()) if (df["strategy"] != "jit").any() else 1
        return str(r.get("profile")), str(r["platform"]), n

    a, b = key(run), key(ref)
    if a == b:
        return True, ""
    return False, (f"this run used profile `{a[0]}` on {a[2]} {a[1]} devices, the reference profile `{b[0]}` on "
                   f"{b[2]} {b[1]} devices")


# --- Sphinx ----------------------------------------------------------------------------------------------


def _sphinx(staging: Path, doctrees: Path, out: Path, student: bool, strict: bool) -> None:
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-c", str(BOOK), "-d", str(doctrees)]
    cmd += ["-t", "student"] if student else []
    cmd += ["-W", "--keep-going"] if strict else []
    proc = subprocess.run([*cmd, str(staging), str(out)], capture_output=True, text=True)
    if proc.stderr:
        print(proc.stderr, file=sys.stderr, end="")
    if proc.returncode != 0:
        raise RuntimeError(f"Sphinx failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib.site", description=__doc__.splitlines()[0])
    ap.add_argument("source", help="a course run (make course writes build/course); with --student, a folder of notebooks")
    ap.add_argument("out", help="folder for the book (if it is already used, a new sibling such as site-2 is made)")
    ap.add_argument("--student", action="store_true", help="the student version: solutions replaced by stubs, no outputs")
    ap.add_argument("--strict", action="store_true", help="fail on any Sphinx warning")
    args = ap.parse_args(argv)
    out = None
    try:
        out = results.prepare_results_dir(args.out)  # a new sibling (site-2, ...) when the folder is already used
        pages = build_site(args.source, out, student=args.student, strict=args.strict)
    except (FileNotFoundError, FileExistsError, ValueError, RuntimeError, KeyboardInterrupt) as e:
        if out is not None and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # made for this build and left empty: the book is moved in only once Sphinx succeeded
        print("interrupted" if isinstance(e, KeyboardInterrupt) else f"error: {e}", file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 2
    print(f"{len(pages)} pages in {out}; open {out / 'index.html'} (or serve it: python -m http.server -d {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

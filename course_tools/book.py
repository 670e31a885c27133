"""The data the course book's pages show: a course run's device report, per-notebook status, the lab's
results tables and the committed reference run beside them (``docs/book/pages/*.md.jinja`` render it).

Used by :mod:`course_tools.site`; taught by none of the notebooks.
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import nbformat

from . import results

REFERENCE_FILE, REFERENCE_SCALING_FILE = "reference_cpu_8sim.csv", "reference_cpu_8sim_scaling.csv"
"""The committed reference run in ``data/`` that the lab report shows beside the run's results."""
LAB_PLOTS = {
    "loss_curves.png": "training loss per step of every strategy (parity: the curves lie on top of each other)",
    "comparison.png": "samples/s, median step time, compiled bytes per device and achieved FLOP/s per strategy",
    "scaling.png": "strong scaling: throughput against device count at a fixed global batch",
}


def assignments(source: str) -> dict:
    """``name = literal`` lines of a parameters cell (papermill writes only those)."""
    out = {}
    for node in ast.parse(source).body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                out[node.targets[0].id] = ast.unparse(node.value)
    return out


def short_value(value, run_folder: Path):
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
    "platform": re.compile(
        r"^platform\s*:\s*(?P<platform>\S+) \((?P<kind>simulated on the CPU|real)\)", re.M
    ),
    "devices": re.compile(
        r"^devices\s*:\s*(?P<n>\d+) of (?P<available>\d+) available \((?P<device_kind>.*)\)\s*$",
        re.M,
    ),
    "versions": re.compile(r"^jax / jaxlib\s*:\s*(?P<jax>\S+) / (?P<jaxlib>\S+)", re.M),
    "python": re.compile(
        r"^python\s*:\s*(?P<python>\S+) on (?P<host_cpus>\d+) host CPU cores", re.M
    ),
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
                p, d, v, py = (
                    found["platform"],
                    found["devices"],
                    found["versions"],
                    found["python"],
                )
                return {
                    "platform": p["platform"],
                    "simulated": p["kind"] != "real",
                    "n_devices": int(d["n"]),
                    "n_available": int(d["available"]),
                    "device_kind": d["device_kind"],
                    "jax_version": v["jax"],
                    "jaxlib_version": v["jaxlib"],
                    "python_version": py["python"],
                    "host_cpus": int(py["host_cpus"]),
                }
    return None


def _devices_text(r: dict | None) -> str:
    if r is None:
        return "not reported"
    return f"{r['n_devices']} × {r['device_kind']}" + (
        " (simulated)" if r["simulated"] else f" ({r['platform']})"
    )


def run_context(source: Path, present: list[dict], missing: list[str]) -> dict:
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
        params = ", ".join(
            f"`{k}={short_value(v, source)!r}`" for k, v in pm.get("parameters", {}).items()
        )
        status = str(t.get("status", "FAILED" if pm.get("exception") else "ok"))
        failed += [lesson["stem"]] if status != "ok" else []
        rows.append(
            [
                f"{{doc}}`{lesson['stem']} <{lesson['stem']}>`",
                status,
                "—" if seconds is None or seconds != seconds else f"{float(seconds):.0f} s",
                _when(pm.get("start_time")),
                params or "—",
                _devices_text(report),
            ]
        )
    known = [r for r in reports if r]
    first = known[0] if known else None
    disagree = len({tuple(sorted(r.items())) for r in known}) > 1
    devices, summary = _device_rows(first)
    date = f"{_when(min(starts))} to {_when(max(ends))}" if starts and ends else "date not recorded"
    devices.append(["date (UTC)", date])
    devices.append(["run folder", f"`{source.name}`"])
    if papermill:
        devices.append(["papermill", ", ".join(sorted(papermill))])
    lab = _lab_settings(source / "lab")
    return {
        "folder": source.name,
        "summary": summary,
        "date": date.split(" to ")[0].split(" ")[0],
        "simulated": bool(first and first["simulated"]),
        "disagree": disagree,
        "missing": missing,
        "failed": failed,
        "timings": bool(timings),
        "lab": lab,
        "devices": {"headers": ["", "this run"], "rows": devices},
        "notebooks": {
            "headers": ["notebook", "status", "time", "started (UTC)", "parameters", "devices"],
            "rows": rows,
        },
    }


def _device_rows(first: dict | None) -> tuple[list[list[str]], str]:
    """The run page's device table rows and a one-line summary, from the first device report."""
    if first:
        devices = [
            [
                "platform",
                f"{first['platform']} ({'simulated CPU devices' if first['simulated'] else 'real devices'})",
            ],
            ["device kind", first["device_kind"]],
            ["device count", f"{first['n_devices']} used, of {first['n_available']} available"],
            ["simulated", "yes" if first["simulated"] else "no"],
            ["JAX / jaxlib", f"{first['jax_version']} / {first['jaxlib_version']}"],
            ["Python", first["python_version"]],
            ["host CPU cores", str(first["host_cpus"])],
        ]
        summary = (
            f"{first['n_devices']} {'simulated CPU' if first['simulated'] else first['device_kind']} "
            f"device{'s' if first['n_devices'] != 1 else ''} (JAX {first['jax_version']})"
        )
    else:
        devices, summary = [["devices", "not reported by the notebooks"]], "the devices of the run"
    return devices, summary


def _lab_settings(lab_dir: Path) -> dict | None:
    """The lab's settings table (profile, batch, image size, steps, host, time), or None without results."""
    lab = None
    if (lab_dir / results.RESULTS_FILE).exists():
        r = results.load_results(lab_dir)["results"].iloc[0]
        lab = {
            "headers": ["setting", "value"],
            "rows": [
                ["profile", str(r.get("profile", "—"))],
                ["global batch", str(r["global_batch"])],
                ["image size", f"{r['image_size']} × {r['image_size']} × 3"],
                ["timed steps", str(r["steps"])],
                ["host CPU", f"{r.get('cpu_model', '—')} ({r.get('host_cpus', '—')} cores)"],
                ["measured at", _when(str(r.get("timestamp", "")))],
            ],
        }
    return lab


def _when(iso: str | None) -> str:
    """``2026-12-01T08:44:55.46+00:00`` → ``2026-12-01 08:44``."""
    if not iso:
        return "—"
    m = re.match(r"(\d{4}-\d\d-\d\d)T(\d\d:\d\d)", iso)
    return f"{m[1]} {m[2]}" if m else iso


# --- the lab report: this run's results and the committed reference ----------------------------------------

_TIME_COLUMNS = [  # (header, column, format): what each strategy's step costs in time
    ("strategy", "label", str),
    ("devices", "n_devices", str),
    ("mesh", "mesh", str),
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
    from course_lib import measure

    eff = measure.scaling_efficiency(df)
    return _table(
        eff,
        [
            ("strategy", "strategy", lambda v: f"`{v}`"),
            ("devices", "n_devices", str),
            ("samples/s", "samples_per_s", lambda v: f"{v:,.0f}"),
            ("efficiency", "efficiency", lambda v: f"{v:.2f}"),
        ],
    )


def _workload(df) -> str:
    r = df.iloc[0]
    n = (
        int(df.loc[df["strategy"] != "jit", "n_devices"].max())
        if (df["strategy"] != "jit").any()
        else int(r["n_devices"])
    )
    simulated = str(r.get("simulated", "")).lower() == "true"
    devices = (
        f"{n} simulated CPU devices"
        if simulated
        else f"{n} `{r['device_kind']}` devices ({r['platform']})"
    )
    return (
        f"profile `{r.get('profile', '?')}` ({r['image_size']} × {r['image_size']} × 3 images, global batch "
        f"{r['global_batch']}, {r['steps']} timed steps) on {devices}, JAX {r['jax_version']}, measured "
        f"{_when(str(r.get('timestamp', '')))} UTC."
    )


def lab_context(source: Path, staging: Path) -> dict | None:
    lab_dir = source / "lab"
    if not (lab_dir / results.RESULTS_FILE).exists():
        return None
    data = results.load_results(lab_dir)
    (staging / "lab").mkdir()
    plots = []
    for png in sorted(
        lab_dir.glob("*.png"),
        key=lambda p: (list(LAB_PLOTS).index(p.name) if p.name in LAB_PLOTS else 99, p.name),
    ):
        shutil.copyfile(png, staging / "lab" / png.name)
        plots.append(
            {
                "path": f"lab/{png.name}",
                "caption": LAB_PLOTS.get(png.name, png.stem.replace("_", " ")),
            }
        )
    return {
        "rows": data["results"],
        "summary": "Measured with " + _workload(data["results"]),
        "results": _results_tables(data["results"]),
        "plots": plots,
        "scaling": _scaling_table(data["scaling"]) if "scaling" in data else None,
    }


def reference_context(staging: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_lib import plots

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
    return {
        "file": REFERENCE_FILE,
        "rows": rows,
        "summary": _workload(rows),
        "results": _results_tables(rows),
        "plots": figures,
        "scaling": scaling,
        "comparable": False,
        "difference": "",
    }


def comparable(run, ref) -> tuple[bool, str]:
    def key(df):
        r = df.iloc[0]
        n = (
            int(df.loc[df["strategy"] != "jit", "n_devices"].max())
            if (df["strategy"] != "jit").any()
            else 1
        )
        return str(r.get("profile")), str(r["platform"]), n

    a, b = key(run), key(ref)
    if a == b:
        return True, ""
    return False, (
        f"this run used profile `{a[0]}` on {a[2]} {a[1]} devices, the reference profile `{b[0]}` on "
        f"{b[2]} {b[1]} devices"
    )


# --- Sphinx ----------------------------------------------------------------------------------------------

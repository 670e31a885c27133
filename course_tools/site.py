"""The rendered course: executed notebooks as a static HTML site, with an index page of the course map.

    python -m course_tools.site build/course build/site

takes a folder of executed notebooks (``make course`` writes one), converts each with nbconvert's HTML
exporter (the JupyterLab template; plots are embedded in the pages) and writes ``index.html`` with the
course map, links to every lesson and the lab report with its plots.
"""

from __future__ import annotations

import argparse
import html
import sys
from pathlib import Path

import nbformat

COURSE_MAP = [
    (
        "00_setup",
        "Setup",
        "environment, devices (real or simulated), the parameters convention, papermill",
    ),
    ("01_grad", "grad", "grad, value_and_grad, pytrees, PRNG keys, purity"),
    (
        "02_jit",
        "jit",
        "tracing, XLA, static_argnums, recompilation, lax.cond / jnp.where, donation, timing",
    ),
    ("03_vmap", "vmap", "in_axes / out_axes, per-example gradients, memory"),
    (
        "04_pmap",
        "pmap",
        "SPMD, the leading device axis, replication, pmean, per-device keys, migrating to shard_map",
    ),
    (
        "05_sharding",
        "Sharded jit",
        "Mesh, PartitionSpec, NamedSharding, device_put, Explicit vs Auto axes",
    ),
    (
        "06_shard_map",
        "shard_map",
        "manual SPMD, collectives, check_vma, the gradient trap, tensor-parallel layers",
    ),
    (
        "07_debugging",
        "Debugging",
        "the pitfall table live, jax.debug.print, profiler traces, load imbalance",
    ),
    ("08_lab", "Capstone lab", "one CNN trained four ways, measured and compared"),
    ("09_multihost", "Multi-host", "jax.distributed, processes x local devices, cluster launch"),
]

_STYLE = """body{font-family:system-ui,sans-serif;max-width:960px;margin:2em auto;padding:0 1em;line-height:1.45}
table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #ddd;padding:.4em;text-align:left}
img{max-width:100%;border:1px solid #eee;margin:.5em 0}.missing{color:#999}"""


def build_site(executed: str | Path, out: str | Path) -> list[Path]:
    """Convert every ``NN_name.ipynb`` in ``executed`` to ``out/NN_name.html`` and write ``out/index.html``.

    Lab plots (``lab/*.png`` beside the executed notebooks, as ``make course`` leaves them) are copied to
    ``out/lab/`` and shown on the index page.

    Returns:
      The pages written, index first.

    Raises:
      FileNotFoundError: ``executed`` holds no executed notebooks.
      FileExistsError: ``out`` exists and is not empty (choose a new folder; nothing is overwritten).
    """
    from nbconvert import HTMLExporter

    executed, out = Path(executed), Path(out)
    notebooks = sorted(executed.glob("[0-9][0-9]_*.ipynb"))
    if not notebooks:
        raise FileNotFoundError(f"no executed notebooks in {executed}; run `make course` first")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; give a new folder for the site")
    out.mkdir(parents=True, exist_ok=True)
    exporter = HTMLExporter(template_name="lab")
    pages = {}
    for nb_path in notebooks:
        nb = nbformat.read(nb_path, as_version=4)
        body, _ = exporter.from_notebook_node(nb)
        page = out / f"{nb_path.stem}.html"
        page.write_text(_with_nav(body), encoding="utf-8")
        pages[nb_path.stem] = page
    plots = []
    lab_dir = executed / "lab"
    if lab_dir.is_dir():
        (out / "lab").mkdir(exist_ok=True)
        for png in sorted(lab_dir.glob("*.png")):
            (out / "lab" / png.name).write_bytes(png.read_bytes())
            plots.append(f"lab/{png.name}")
    rows = []
    for stem, title, teaches in COURSE_MAP:
        link = (
            f'<a href="{stem}.html">{html.escape(title)}</a>'
            if stem in pages
            else f'<span class="missing">{html.escape(title)} (not run)</span>'
        )
        rows.append(f"<tr><td>{stem[:2]}</td><td>{link}</td><td>{html.escape(teaches)}</td></tr>")
    figures = "".join(
        f'<figure><img src="{p}" alt="{p}"><figcaption>{p}</figcaption></figure>' for p in plots
    )
    index = f"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Parallel programming with JAX</title>
<style>{_STYLE}</style></head><body><h1>Parallel programming with JAX</h1>
<p>An executable course: every page below is a notebook executed on {html.escape(_devices_line(notebooks))}.</p>
<table><tr><th>#</th><th>lesson</th><th>teaches</th></tr>{"".join(rows)}</table>
<h2>Lab report</h2>{figures or '<p class="missing">the lab was not run</p>'}</body></html>"""
    (out / "index.html").write_text(index, encoding="utf-8")
    return [out / "index.html", *pages.values()]


def _with_nav(body: str) -> str:
    nav = '<p style="padding:0 1em"><a href="index.html">&larr; course map</a></p>'
    i = body.find("<body")
    if i < 0:
        return nav + body
    j = body.find(">", i)
    return body[: j + 1] + nav + body[j + 1 :]


def _devices_line(notebooks: list[Path]) -> str:
    nb = nbformat.read(notebooks[0], as_version=4)
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            text = o.get("text", "")
            if "platform" in text and "devices" in text:
                return " ".join(
                    line.split(":", 1)[1].strip() for line in text.splitlines()[:2] if ":" in line
                )
    return "the devices of the run"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("executed", help="folder of executed notebooks (make course)")
    ap.add_argument(
        "out",
        help="folder for the site (if it is already used, a new sibling such as site-2 is made)",
    )
    args = ap.parse_args(argv)
    from .results import prepare_results_dir

    try:
        out = prepare_results_dir(
            args.out
        )  # a new sibling (site-2, ...) when the folder is already used
        pages = build_site(args.executed, out)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{len(pages)} pages in {out}; open {out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

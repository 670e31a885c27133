"""Two compilers' programs side by side: the collectives of one program as XLA:CPU and XLA:TPU built it,
read from the summaries :func:`course_lib.aot.summarise` makes (a program compiled here, or the TPU
reference in ``data/tpu_reference/programs/``).

:func:`compare_summaries` sets two summaries side by side per ``(collective, mesh axes)``;
:func:`differences` says in words where they differ; :func:`overview` gives one row per program of a
notebook; :func:`label` names the compiler, the devices a program was built for and the JAX that built it.
``notebooks/08_lab.ipynb`` and ``notebooks/12_transformer_lab.ipynb`` show them (section "XLA:TPU's
program beside XLA:CPU's"); :mod:`course_lib.aot` re-exports every function here.
"""

from __future__ import annotations

import math
from typing import Any

FIELDS = ("n", "dtypes", "bytes", "async", "in_loop")
"""What is compared per ``(op, axes)``: instructions (an async pair once), HLO dtypes, bytes of their
results on one device, how many are asynchronous start/done pairs, how many sit in a ``while`` loop."""
_WORDS = {
    "n": "instructions",
    "dtypes": "dtypes",
    "bytes": "bytes",
    "async": "async start/done pairs",
    "in_loop": "in a loop",
}


def _axes(axes) -> str:
    return "?" if axes is None else ",".join(axes) or "-"


def _by_kind(summary: dict) -> dict[tuple[str, str], dict]:
    """Per ``(op, axes)``: instructions, dtypes, bytes, async and in-loop counts of one summary."""
    out: dict[tuple[str, str], dict] = {}
    for c in summary.get("collectives") or []:
        row = out.setdefault(
            (c["op"], _axes(c["axes"])),
            {"n": 0, "dtypes": set(), "bytes": 0, "async": 0, "in_loop": 0},
        )
        row["n"] += 1
        row["dtypes"].update(c["dtypes"])
        row["bytes"] += c["bytes"]
        row["async"] += bool(c["async"])
        row["in_loop"] += bool(c["in_loop"])
    return out


def label(summary: dict) -> str:
    """Which compiler built a summary's program, for which devices, with which JAX: ``"XLA:TPU for v5e:2x4,
    compiled on one chip, JAX 0.10.2"`` (a TPU topology's compile-only devices; the reference's or
    :func:`course_lib.aot.tpu_summary`'s fields ``topology``, ``host_devices``, ``jax``) or ``"XLA:CPU on 8
    simulated devices, JAX 0.12.0.1"`` (a program compiled here: the running JAX)."""
    import jax

    compiler = f"XLA:{str(summary.get('platform', '?')).upper()}"
    version = summary.get("jax") or jax.__version__
    if summary.get("topology"):
        host = summary.get("host_devices")
        on = "one chip" if host == 1 else f"a host of {host} chips" if host else "a TPU host"
        return f"{compiler} for {summary['topology']}, compiled on {on}, JAX {version}"
    n = math.prod((summary.get("mesh") or {}).values())
    kind = "simulated devices" if summary.get("platform") == "cpu" else "devices"
    return f"{compiler} on {n} {kind}, JAX {version}"


def compare_summaries(here: dict, ref: dict):
    """A table (pandas DataFrame) of two summaries' collectives side by side, one row per ``(op, axes)``.

    Columns: ``op``, ``axes`` (``"-"``: groups of one device; ``"?"``: not named), then for each summary,
    prefixed by its compiler (``"XLA:CPU n"``, ``"XLA:TPU n"``; the second marked ``(reference)`` when both
    are one compiler's): the :data:`FIELDS` — ``n`` (instructions; an async pair once), ``dtypes``
    (``"bf16,f32"``), ``bytes`` (their results' bytes on one device, each instruction once, not times its
    loop's trips), ``async`` (how many are asynchronous start/done pairs), ``in_loop`` (how many sit in a
    ``while`` loop); and ``same``: True when the two agree on all five.
    """
    import pandas as pd

    labels = [f"XLA:{s.get('platform', '?').upper()}" for s in (here, ref)]
    if labels[0] == labels[1]:
        labels[1] += " (reference)"
    sides = [_by_kind(here), _by_kind(ref)]
    rows = []
    for op, axes in sorted({k for side in sides for k in side}):
        row: dict[str, Any] = {"op": op, "axes": axes}
        values = []
        for name, side in zip(labels, sides):
            got = side.get(
                (op, axes), {"n": 0, "dtypes": set(), "bytes": 0, "async": 0, "in_loop": 0}
            )
            cells = [got[f] if f != "dtypes" else ",".join(sorted(got[f])) for f in FIELDS]
            values.append(cells)
            row.update({f"{name} {f}": v for f, v in zip(FIELDS, cells)})
        row["same"] = values[0] == values[1]
        rows.append(row)
    return pd.DataFrame(rows)


def differences(table) -> list[str]:
    """Where two programs differ, one sentence per ``(op, axes)`` row of :func:`compare_summaries`'s table
    whose ``same`` is False, naming each field that differs with both values, e.g. ``"all-reduce over
    data: instructions 1 on XLA:CPU, 2 on XLA:TPU; dtypes f32 on XLA:CPU, bf16,f32 on XLA:TPU; bytes
    755,244 on XLA:CPU, 377,624 on XLA:TPU"``. An empty list: the two agree on every collective."""
    sides = [c[: -len(" n")] for c in table.columns if c.endswith(" n")]
    out = []
    for _, row in table.iterrows():
        if row["same"]:
            continue
        parts = []
        for f in FIELDS:
            a, b = (row[f"{s} {f}"] for s in sides)
            if a != b:
                show = (lambda v: f"{v:,}") if f == "bytes" else (lambda v: str(v or "none"))
                parts.append(f"{_WORDS[f]} {show(a)} on {sides[0]}, {show(b)} on {sides[1]}")
        out.append(f"{row['op']} over {row['axes']}: " + "; ".join(parts))
    return out


def _totals(summary: dict) -> dict:
    kinds = _by_kind(summary)
    return {
        "collectives": sum(k["n"] for k in kinds.values()),
        "dtypes": ",".join(sorted({d for k in kinds.values() for d in k["dtypes"]})),
        "bytes": sum(k["bytes"] for k in kinds.values()),
        "async": sum(k["async"] for k in kinds.values()),
    }


def overview(tpu: dict[str, dict], cpu: dict[str, dict | None] | None = None):
    """One row per program (a DataFrame indexed by name): XLA:TPU's collectives — ``collectives``
    (instructions, an async pair once), ``dtypes``, ``bytes`` (results on one device, summed), ``async``
    (start/done pairs) — each column prefixed ``"XLA:TPU "``, and where ``cpu`` has the program, XLA:CPU's
    beside them and ``differs`` (the ``(op, axes)`` rows of :func:`compare_summaries` that differ, ``"-"``
    when none). ``tpu``, ``cpu``: ``{name: summary}``; a None or missing ``cpu`` entry leaves its columns
    empty (NaN)."""
    import pandas as pd

    rows = {}
    for name, ref in tpu.items():
        row = {f"XLA:TPU {k}": v for k, v in _totals(ref).items()}
        here = (cpu or {}).get(name)
        if here is not None:
            row.update({f"XLA:CPU {k}": v for k, v in _totals(here).items()})
            table = compare_summaries(here, ref)
            bad = table.loc[~table["same"], ["op", "axes"]]
            row["differs"] = "; ".join(f"{o} over {a}" for o, a in bad.itertuples(index=False))
            row["differs"] = row["differs"] or "-"
        rows[name] = row
    table = pd.DataFrame.from_dict(rows, orient="index")
    counts = [c for c in table.columns if c.split(" ")[-1] in ("collectives", "bytes", "async")]
    return table.astype({c: "Int64" for c in counts})  # whole numbers, <NA> where a side is absent


def collective_table(summary: dict):
    """One summary's collectives as a table (pandas DataFrame), one row per instruction (an async pair once):
    ``op``, ``axes``, ``dtypes``, ``shape``, ``bytes`` (its result on one device), ``async``, ``in_loop``,
    ``runs`` (None: a loop of unknown trip count). For the reference alone, e.g. where a notebook runs on
    fewer than 8 devices: ``collective_table(reference(name))``."""
    import pandas as pd

    cols = ["op", "axes", "dtypes", "shape", "bytes", "async", "in_loop", "runs"]
    rows = [
        {
            **{k: c[k] for k in cols},
            "axes": _axes(c["axes"]),
            "dtypes": ",".join(sorted(set(c["dtypes"]))),
        }
        for c in summary.get("collectives") or []
    ]
    return pd.DataFrame(rows, columns=cols)

"""The transformer lab's tables and plots: collectives predicted beside read from the program, a step-time
model's stacked bars, its time breakdown per layout (compute, bubble, exposed and overlapped communication)
and the bytes predicted beside measured; a picture of a mesh on two nodes (:func:`plot_two_nodes`).

Re-exported by :mod:`course_lib.lm_costs` (``lm_costs.by_kind``, ``lm_costs.plot_step_times``,
``lm_costs.plot_bytes``, ``lm_costs.time_breakdown``, ``lm_costs.plot_time_breakdown``). Taught in
``notebooks/12_transformer_lab.ipynb``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

__all__ = [
    "by_kind",
    "plot_step_times",
    "plot_bytes",
    "time_breakdown",
    "plot_time_breakdown",
    "node_of",
    "plot_two_nodes",
]


def plot_step_times(rows: Sequence[dict], ax=None, title: str = ""):
    """Stacked bars of a step-time model (:func:`step_time` rows): compute, then each mesh axis's
    communication; labelled as a model. Returns the axes."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7, 3))[1]
    axes = sorted({a for r in rows for a in r["comm_s"]})
    names = [r["layout"] for r in rows]
    bottom = np.zeros(len(rows))
    parts = [("compute", [r["compute_s"] for r in rows])]
    parts += [(f"comm: {a}", [r["comm_s"].get(a, 0.0) for r in rows]) for a in axes]
    for label, values in parts:
        values = np.asarray(values) * 1e3
        ax.bar(names, values, bottom=bottom, label=label)
        bottom += values
    ax.set_ylabel("ms per step (model)")
    ax.set_title(title or "step-time MODEL (not a measurement)")
    ax.legend(fontsize=7)
    return ax


def plot_bytes(rows: Sequence[dict], ax=None):
    """Bytes per device per step of each layout, predicted (hollow) beside measured from the compiled program
    (filled), from the lab's run (``rows``: ``{"layout", "predicted_bytes", "measured_bytes"}``)."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7, 3))[1]
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["predicted_bytes"] / 1e3 for r in rows], 0.4, label="predicted from shapes",
           fill=False, edgecolor="C0")  # fmt: skip
    ax.bar(
        x + 0.2,
        [r["measured_bytes"] / 1e3 for r in rows],
        0.4,
        label="compiled program",
        color="C1",
    )
    ax.set_xticks(x, [r["layout"] for r in rows])
    ax.set_ylabel("kB sent per device per step")
    ax.legend(fontsize=7)
    return ax


def by_kind(predicted: Sequence, measured: Sequence) -> list[dict]:
    """Predicted and measured collectives side by side, one row per (mesh axis, kind): how many and the
    bytes each device sends (:class:`course_lib.comms.Transfer` / :class:`course_lib.comms.Collective`)."""
    rows: dict[tuple[str, str], dict] = {}
    for source, items in (("predicted", predicted), ("measured", measured)):
        for t in items:
            row = rows.setdefault(
                (t.axis, t.kind),
                {"axis": t.axis, "kind": t.kind, "predicted_n": 0, "predicted_bytes": 0.0,
                 "measured_n": 0, "measured_bytes": 0.0},
            )  # fmt: skip
            row[f"{source}_n"] += 1
            row[f"{source}_bytes"] += t.sent_bytes
    return sorted(rows.values(), key=lambda r: (r["axis"], r["kind"]))


BREAKDOWN = ("compute", "bubble", "exposed communication", "overlapped communication")
"""The parts of :func:`time_breakdown`, in the order the bars stack them."""


def time_breakdown(row: dict) -> dict[str, float]:
    """One layout's predicted step split into its parts, seconds (a :func:`course_lib.lm_times.step_time`
    row, at the ``overlap`` it was computed with): ``compute`` (the roofline's time of the work, bubble
    left out), ``bubble`` (the pipeline's idle ticks, computed masked: its ``bubble_s``), ``exposed
    communication`` (what the step waits for: ``step_s − compute_s``) and ``overlapped communication`` (the
    rest of the collectives' time, hidden behind compute). The first three sum to ``step_s``; exposed and
    overlapped to the communication time.

    Raises:
      ValueError: a row without ``bubble_s`` (not a :func:`~course_lib.lm_times.step_time` row).
    """
    if "bubble_s" not in row:
        raise ValueError(f"{row.get('layout')!r}: not a lm_costs.step_time row (no 'bubble_s')")
    comm = sum(row["comm_s"].values())
    exposed = row["step_s"] - row["compute_s"]
    return {
        "compute": row["compute_s"] - row["bubble_s"],
        "bubble": row["bubble_s"],
        "exposed communication": exposed,
        "overlapped communication": comm - exposed,
    }


def plot_time_breakdown(rows: Sequence[dict], ax=None, title: str = ""):
    """Stacked bars per layout of :func:`time_breakdown`: compute, bubble and exposed communication stack
    to the predicted step time; the overlapped communication is drawn hatched above it (hidden: it adds no
    time). Labelled as a model. Returns the axes."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7, 3))[1]
    names = [r["layout"] for r in rows]
    parts = [time_breakdown(r) for r in rows]
    bottom = np.zeros(len(rows))
    for i, label in enumerate(BREAKDOWN):
        values = np.array([p[label] for p in parts]) * 1e3
        hidden = label == "overlapped communication"
        ax.bar(names, values, bottom=bottom, label=label + (" (hidden)" if hidden else ""),
               color=f"C{i}", alpha=0.35 if hidden else 1.0, hatch="//" if hidden else None)  # fmt: skip
        bottom += values
    steps = [r["step_s"] * 1e3 for r in rows]
    ax.plot(names, steps, "k_", markersize=18, label="predicted step")
    ax.set_ylabel("ms per step (model)")
    ax.set_title(title or "step-time MODEL: where the time goes (not a measurement)")
    ax.legend(fontsize=7)
    return ax


def node_of(sizes: dict[str, int], across: str, n_nodes: int = 2) -> dict[tuple[int, ...], int]:
    """Which node holds each device of a mesh when axis ``across`` spans the nodes.

    The devices are numbered with ``across`` outermost (a launcher gives each node consecutive devices):
    ``across`` is cut into ``n_nodes`` contiguous blocks, one per node, and every other axis stays whole
    inside each node. So a group along ``across`` spans the nodes; a group along any other axis does not.

    Args:
        sizes: the mesh, ``{axis: size}`` in mesh order (``lm_layouts.mesh_axes(layout, n)``).
        across: the axis that spans the nodes; one of ``sizes``.
        n_nodes: how many nodes (2 in ``notebooks/12_transformer_lab.ipynb``).

    Returns:
        ``{coordinate: node}``: every mesh coordinate (a tuple of ints, in ``sizes``' order) and the node
        (``0 … n_nodes − 1``) that holds it.

    Raises:
        ValueError: ``across`` is not an axis of ``sizes``, or ``n_nodes`` does not divide its size.
    """
    if across not in sizes:
        raise ValueError(f"across={across!r} is not an axis of the mesh {sizes}")
    if n_nodes < 1 or sizes[across] % n_nodes:
        raise ValueError(f"{n_nodes} nodes do not divide axis {across!r} of size {sizes[across]}")
    names = list(sizes)
    block = sizes[across] // n_nodes
    return {
        coord: coord[names.index(across)] // block
        for coord in itertools.product(*(range(sizes[a]) for a in names))
    }


def plot_two_nodes(sizes: dict[str, int], across: str, intra: str = "NVLink 4",
                   inter: str = "InfiniBand NDR", ax=None, title: str = ""):  # fmt: skip
    """Two nodes, each device labelled with its mesh coordinate (:func:`node_of`), and one group of each
    axis drawn as a line: the axis ``across`` (its collectives on the ``inter`` link between the nodes) and
    every other axis (on the ``intra`` link inside a node). A picture, not a measurement.

    Args:
        sizes: the mesh, ``{axis: size}`` in mesh order; its devices split evenly over the two nodes.
        across: the axis that spans the nodes.
        intra: the link inside a node, for the labels (``costs.LINKS`` names).
        inter: the link between the nodes, for the labels.
        ax: a matplotlib axes to draw on, else a new figure's.
        title: the axes' title; by default it names ``across``.

    Returns:
        The matplotlib axes. One rectangle per node and one per device (``ax.patches``).

    Raises:
        ValueError: as :func:`node_of`.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Rectangle

    placed = node_of(sizes, across, 2)
    names = list(sizes)
    ax = ax or plt.subplots(figsize=(9, 3.2))[1]
    per_node = len(placed) // 2
    cols = int(np.ceil(per_node / 2)) if per_node > 4 else per_node
    rows = int(np.ceil(per_node / cols))
    w, h, gap = 1.0, 0.7, 0.25
    node_w = cols * (w + gap) + gap
    where, boxes = {}, {}
    for node in (0, 1):
        x0 = node * (node_w + 1.5)
        ax.add_patch(FancyBboxPatch((x0, 0), node_w, rows * (h + gap) + gap + 0.35,
                                    boxstyle="round,pad=0.05", fc="0.95", ec="0.3", zorder=0))  # fmt: skip
        ax.text(x0 + node_w / 2, rows * (h + gap) + gap + 0.15, f"node {node}: {intra} inside",
                ha="center", va="center", fontsize=8)  # fmt: skip
        mine = sorted(c for c, n in placed.items() if n == node)
        for i, coord in enumerate(mine):
            x = x0 + gap + (i % cols) * (w + gap)
            y = gap + (rows - 1 - i // cols) * (h + gap)
            boxes[coord] = ax.add_patch(Rectangle((x, y), w, h, fc="white", ec="0.4", zorder=1))
            label = "\n".join(f"{a} {c}" for a, c in zip(names, coord, strict=True))
            ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=6)
            where[coord] = (x + w / 2, y + h / 2)
    ax.annotate("", xy=(node_w + 1.5, 0.5), xytext=(node_w, 0.5),
                arrowprops={"arrowstyle": "<->", "color": "C3", "lw": 2})  # fmt: skip
    ax.text(node_w + 0.75, 0.2, inter, ha="center", va="top", fontsize=8, color="C3")
    origin = tuple(0 for _ in names)
    for i, axis in enumerate([across] + [a for a in names if a != across]):
        k = names.index(axis)
        group = [origin[:k] + (j,) + origin[k + 1 :] for j in range(sizes[axis])]
        xs, ys = zip(*(where[c] for c in group), strict=True)
        link = inter if axis == across else intra
        colour = "C3" if axis == across else f"C{i - 1 if i - 1 < 3 else i}"
        # drawn under the devices: the line shows between them, each member's edge in the group's colour
        ax.plot(xs, ys, "-", color=colour, lw=2, zorder=0.5,
                label=f"one {axis} group ({sizes[axis]} devices): on {link}")  # fmt: skip
        for c in group:
            if c != origin or axis == across:
                boxes[c].set_edgecolor(colour)
                boxes[c].set_linewidth(2)
    ax.set_xlim(-0.3, 2 * node_w + 1.8)
    ax.set_ylim(-0.6, rows * (h + gap) + gap + 0.6)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(names))
    ax.set_title(title or f"{sizes}: {across} across the two nodes", fontsize=9)
    return ax

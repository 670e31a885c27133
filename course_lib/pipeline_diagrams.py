"""Pictures of pipelines and experts, drawn from the run: schedules (ticks × stages), the layers each
device holds, the stash over time, the experts' load against their capacity, what dropping costs, and
the experts' ``all_to_all`` exchange, where a tensor-parallel stage's all-reduces sit, and which ticks of a
forward-then-backward schedule send over the stage axis.

Each function takes an optional ``ax``, returns the Figure, never calls ``plt.show()`` and changes no global
style. A schedule's cells are coloured by micro-batch (pale: forward F, dark: backward B; a cell that runs
both lanes at once is split, F above B); grey cells are the bubble: in the lockstep (masked) executors
the stage computes there too and its result is thrown away; in a switched run (``pipeline_ops``,
``mode="cond"``) the device computes nothing there and waits. Used by ``notebooks/11_pipeline_experts.ipynb``
(and :func:`sends` by ``notebooks/12_transformer_lab.ipynb``).
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib as mpl
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from . import op_schedules as O
from .diagrams import device_color
from .schedules import Schedule, bubble_fraction
from .split_diagrams import tp_stage  # drawn with the splits' pictures; named here too

__all__ = [
    "trace_arrays",
    "schedule",
    "op_trace",
    "ops",
    "layers",
    "send_ticks",
    "sends",
    "in_flight",
    "expert_load",
    "drops",
    "expert_exchange",
    "tp_stage",
]

_IDLE = "#e6e6e6"


def _color(mb: int, dark: bool) -> tuple:
    base = mpl.colors.to_rgb(mpl.color_sequences["petroff10"][int(mb) % 10])
    if dark:
        return tuple(0.75 * c for c in base)
    return tuple(0.45 * c + 0.55 for c in base)


def trace_arrays(trace: np.ndarray) -> dict[str, np.ndarray]:
    """The run's trace, int [T, 4, p] (F micro-batch, F chunk, B micro-batch, B chunk per device, as
    :func:`course_lib.pipeline_measure.build_train` returns it) or [T, 2, p] (F only), as the four
    [T, p] arrays :func:`schedule` draws."""
    trace = np.asarray(trace)
    if trace.ndim != 3 or trace.shape[1] not in (2, 4):
        raise ValueError(f"trace of shape {trace.shape}; expected [T, 4, p] or [T, 2, p]")
    out = {"f_mb": trace[:, 0], "f_chunk": trace[:, 1]}
    if trace.shape[1] == 4:
        out.update(b_mb=trace[:, 2], b_chunk=trace[:, 3])
    else:
        out.update(b_mb=np.full_like(trace[:, 0], -1), b_chunk=np.zeros_like(trace[:, 0]))
    return out


def _cell(ax, t, s, lane_mb, lane_c, dark, y0, h, chunks):
    mb = int(lane_mb[t, s])
    if mb < 0:
        return False
    ax.add_patch(Rectangle((t, y0), 1, h, fc=_color(mb, dark), ec="white", lw=0.6))
    label = f"{mb}" if chunks == 1 else f"{mb}.{int(lane_c[t, s])}"
    size = 7 if h > 0.6 else 5.5
    ax.text(t + 0.5, y0 + h / 2, label, ha="center", va="center", fontsize=size,
            color="white" if dark else "black")  # fmt: skip
    return True


def schedule(
    sched: Schedule | dict, ax=None, title: str | None = None, n_chunks: int | None = None
):
    """Draw a schedule: ticks left to right, stage 0 on top.

    Args:
      sched: a :class:`~course_lib.schedules.Schedule` (its table) or the dict :func:`trace_arrays` makes
        from a run (what each device really ran).
      title: default: the schedule's name, ticks and bubble.
      n_chunks: label cells ``mb.chunk`` when > 1 (default: the schedule's).
    """
    arrays = (
        sched
        if isinstance(sched, dict)
        else {k: getattr(sched, k) for k in ("f_mb", "f_chunk", "b_mb", "b_chunk")}
    )
    f_mb, b_mb = np.asarray(arrays["f_mb"]), np.asarray(arrays["b_mb"])
    ticks, p = f_mb.shape
    chunks = n_chunks or (
        sched.n_chunks if isinstance(sched, Schedule) else int(arrays["f_chunk"].max()) + 1
    )
    if ax is None:
        ax = plt.subplots(figsize=(min(14, max(6, 0.3 * ticks + 1.5)), 0.42 * p + 1.0))[1]
    for s in range(p):
        row = p - 1 - s
        both = (f_mb[:, s] >= 0) & (b_mb[:, s] >= 0)
        for t in range(ticks):
            if both[t]:
                _cell(ax, t, s, f_mb, arrays["f_chunk"], False, row + 0.5, 0.5, chunks)
                _cell(ax, t, s, b_mb, arrays["b_chunk"], True, row, 0.5, chunks)
            elif not (_cell(ax, t, s, f_mb, arrays["f_chunk"], False, row, 1, chunks)
                      or _cell(ax, t, s, b_mb, arrays["b_chunk"], True, row, 1, chunks)):  # fmt: skip
                ax.add_patch(Rectangle((t, row), 1, 1, fc=_IDLE, ec="white", lw=0.6))
    ax.set_xlim(0, ticks)
    ax.set_ylim(0, p)
    ax.set_yticks(np.arange(p) + 0.5, [f"stage {p - 1 - r}" for r in range(p)], fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    cell = "micro-batch" + (".chunk" if chunks > 1 else "")
    ax.set_xlabel(f"tick   (pale: F, dark: B, grey: bubble; a cell's label: {cell})", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    if title is None and isinstance(sched, Schedule):
        title = f"{sched.name}: p={p}, m={sched.n_micro}" + (
            f", v={sched.n_chunks}" if sched.n_chunks > 1 else ""
        )
        title += f" — {ticks} ticks, bubble {bubble_fraction(sched):.1%} (F cost 1, B cost 2)"
    ax.set_title(title or "", fontsize=9, loc="left")
    return ax.figure


def op_trace(trace: np.ndarray) -> dict[str, np.ndarray]:
    """A run's trace of :func:`course_lib.pipeline_ops.build_step`, int [T, 3, p] (operation, micro-batch,
    chunk per device and tick), as the ``{"op", "mb", "chunk"}`` [T, p] arrays :func:`ops` draws.

    Raises:
      ValueError: a trace of another shape.
    """
    trace = np.asarray(trace)
    if trace.ndim != 3 or trace.shape[1] != 3:
        raise ValueError(
            f"trace of shape {trace.shape}; expected [T, 3, p] from pipeline_ops.build_step"
        )
    return {"op": trace[:, 0], "mb": trace[:, 1], "chunk": trace[:, 2]}


_SHADE = {O.F: 0.0, O.B: 1.0, O.W: 0.5}


def ops(table, ax=None, title: str | None = None, n_chunks: int | None = None):
    """Draw a one-operation-per-tick schedule (:mod:`course_lib.op_schedules`) or a run's trace
    (:func:`op_trace`): ticks left to right, stage 0 on top; a cell coloured by micro-batch, pale F, dark B,
    hatched W (ZB-H1's weight gradient), grey the bubble (idle: under ``lax.switch`` the device waits).

    Args:
      table: an :class:`~course_lib.op_schedules.OpSchedule` or the dict :func:`op_trace` makes.
      title: default: the schedule's name, ticks and bubble.
      n_chunks: label cells ``mb.chunk`` when > 1 (default: from the table).
    """
    get = table.get if isinstance(table, dict) else lambda k: getattr(table, k)
    op, mb, ch = (np.asarray(get(k)) for k in ("op", "mb", "chunk"))
    ticks, p = op.shape
    chunks = n_chunks or int(ch.max()) + 1
    if ax is None:
        ax = plt.subplots(figsize=(min(14, max(6, 0.3 * ticks + 1.5)), 0.42 * p + 1.0))[1]
    for t in range(ticks):
        for s in range(p):
            row, kind = p - 1 - s, int(op[t, s])
            if kind == O.IDLE:
                ax.add_patch(Rectangle((t, row), 1, 1, fc=_IDLE, ec="white", lw=0.6))
                continue
            base = (
                np.asarray(_color(mb[t, s], False)) * (1 - _SHADE[kind])
                + np.asarray(_color(mb[t, s], True)) * _SHADE[kind]
            )
            ax.add_patch(Rectangle((t, row), 1, 1, fc=tuple(base), ec="white", lw=0.6,
                                   hatch="////" if kind == O.W else None))  # fmt: skip
            label = f"{mb[t, s]}" if chunks == 1 else f"{mb[t, s]}.{ch[t, s]}"
            ax.text(t + 0.5, row + 0.5, label, ha="center", va="center", fontsize=6.5,
                    color="white" if kind == O.B else "black")  # fmt: skip
    ax.set_xlim(0, ticks)
    ax.set_ylim(0, p)
    ax.set_yticks(np.arange(p) + 0.5, [f"stage {p - 1 - r}" for r in range(p)], fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.tick_params(axis="x", labelsize=7)
    cell = "micro-batch" + (".chunk" if chunks > 1 else "")
    ax.set_xlabel(f"tick   (pale: F, dark: B, hatched: W, grey: idle; label: {cell})", fontsize=8)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    if title is None:
        name = getattr(table, "name", "run")
        title = f"{name}: {ticks} ticks, bubble {O.measured_bubble(op):.1%} of the stage-ticks"
    ax.set_title(title, fontsize=9, loc="left")
    return ax.figure


def layers(n_layers: int, n_stages: int, n_chunks: int = 1, ax=None):
    """Which stage holds which layer: contiguous slices (``n_chunks = 1``) or interleaved chunks (virtual
    stage ``c·p + s`` on device ``s``), as :func:`course_lib.pipeline.chunked` lays them out."""
    if n_layers % (n_stages * n_chunks):
        raise ValueError(
            f"{n_layers} layers do not split into {n_stages} stages × {n_chunks} chunks"
        )
    k = n_layers // (n_stages * n_chunks)
    ax = plt.subplots(figsize=(max(5, 0.45 * n_layers), 1.1))[1] if ax is None else ax
    for layer in range(n_layers):
        virtual = layer // k
        s, c = virtual % n_stages, virtual // n_stages
        color = mpl.color_sequences["petroff10"][s % 10]
        ax.add_patch(Rectangle((layer, 0), 1, 1, fc=color, ec="white", lw=1))
        ax.text(layer + 0.5, 0.5, f"{layer}" if n_chunks == 1 else f"{layer}\nc{c}", ha="center",
                va="center", fontsize=7, color="white")  # fmt: skip
    ax.set_xlim(0, n_layers)
    ax.set_ylim(0, 1)
    ax.set_axis_off()
    handles = [
        Rectangle((0, 0), 1, 1, fc=mpl.color_sequences["petroff10"][s % 10])
        for s in range(n_stages)
    ]
    ax.legend(handles, [f"stage {s}" for s in range(n_stages)], ncol=n_stages, fontsize=7,
              loc="upper center", bbox_to_anchor=(0.5, 0), frameon=False)  # fmt: skip
    ax.set_title(f"{n_layers} layers on {n_stages} stages" + (f", {n_chunks} chunks each" if n_chunks > 1 else ""),
                 fontsize=9, loc="left")  # fmt: skip
    return ax.figure


def send_ticks(sched: Schedule) -> list[tuple[int, int]]:
    """The sends over the stage axis of a forward-then-backward schedule (GPipe's, as
    :func:`course_lib.pipeline.transformer_grads` runs it): ``(tick, step)``, one per tick whose result a
    later tick of the same lane reads, ``step = +1`` forward (stage ``s`` to ``s + 1``), ``-1`` backward.
    Each is one ``collective-permute`` in which every stage but the last along ``step`` sends a
    micro-batch's activation (or its gradient); ``2 (m + p − 2)`` in all, none for one stage."""
    tf = sched.forward_ticks()
    if sched.n_stages == 1:
        return []
    return [(t, +1) for t in range(tf - 1)] + [(t, -1) for t in range(tf, sched.ticks - 1)]


def sends(sched: Schedule, ax=None, title: str | None = None):
    """:func:`schedule`'s picture of a forward-then-backward schedule with an arrow for each send over the
    stage axis (:func:`send_ticks`): at the end of its tick, from every stage that sends to its neighbour
    (down forward, up backward); a tick without arrows ends without a send."""
    fig = schedule(sched, ax=ax, title=title)
    ax = fig.axes[0] if ax is None else ax
    p = sched.n_stages
    for t, step in send_ticks(sched):
        for s in range(p) if step > 0 else range(p - 1, -1, -1):
            if 0 <= s + step < p:  # the row of stage s is p - 1 - s, its middle + 0.5
                y0, y1 = p - 1 - s + 0.5, p - 1 - (s + step) + 0.5
                ax.annotate("", xy=(t + 1, y1), xytext=(t + 1, y0),
                            arrowprops={"arrowstyle": "-|>", "color": "black", "lw": 1.0})  # fmt: skip
    ax.set_xlabel(ax.get_xlabel() + "; arrow: a send over stage at the end of a tick", fontsize=8)
    return fig


def in_flight(scheds: Sequence[Schedule], stage: int = 0, ax=None):
    """Micro-batch inputs held by one stage at each tick (F done, B not yet), one line per schedule."""
    ax = plt.subplots(figsize=(6, 2.6))[1] if ax is None else ax
    for sched in scheds:
        held = np.cumsum(sched.f_mb[:, stage] >= 0) - np.concatenate(
            [[0], np.cumsum(sched.b_mb[:, stage] >= 0)[:-1]]
        )
        label = sched.name + (f" v={sched.n_chunks}" if sched.n_chunks > 1 else "")
        ax.step(np.arange(sched.ticks), held, where="post", label=f"{label} (peak {held.max()})")
    ax.set_xlabel("tick")
    ax.set_ylabel(f"inputs held, stage {stage}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return ax.figure


def expert_load(load: np.ndarray, cap: int, ax=None, title: str | None = None):
    """Token choices each expert received in one group, against its capacity: the part above the
    capacity line is dropped. ``load``: int [E]."""
    load = np.asarray(load)
    ax = plt.subplots(figsize=(max(4, 0.5 * len(load) + 1), 2.6))[1] if ax is None else ax
    x = np.arange(len(load))
    kept = np.minimum(load, cap)
    ax.bar(x, kept, color=mpl.color_sequences["petroff10"][0], label="computed")
    over = load > kept  # only the experts that dropped choices get a hatched part
    ax.bar(x[over], (load - kept)[over], bottom=kept[over], color="white", edgecolor="#c0392b",
           hatch="///", label="dropped")  # fmt: skip
    ax.axhline(cap, color="#333333", lw=1, ls="--", label=f"capacity {cap}")
    ax.set_xticks(x, [f"e{e}" for e in x], fontsize=7)
    ax.set_ylabel("token choices")
    ax.legend(fontsize=7)
    ax.set_title(
        title or f"{int((load - kept).sum())} of {int(load.sum())} choices dropped",
        fontsize=9,
        loc="left",
    )
    return ax.figure


def drops(factors: Sequence[float], dropped: Sequence[float], error: Sequence[float], ax=None):
    """The fraction of token choices dropped and the output's relative error, against the capacity factor."""
    ax = plt.subplots(figsize=(5, 2.8))[1] if ax is None else ax
    ax.plot(factors, dropped, "o-", label="choices dropped")
    ax.plot(factors, error, "s--", label="output error (relative)")
    ax.set_xlabel("capacity factor")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax.figure


def expert_exchange(n_experts: int, capacity: int, n_devices: int, ax=None):
    """The dispatch ``all_to_all`` of expert parallelism, drawn for every device of the expert axis.

    Top: each device's buffer ``[E, C, D]`` (one row of ``C`` places per expert), each row coloured by the
    device that holds its expert, where it is sent. Bottom: each device's ``[E/n, n·C, D]`` after
    ``all_to_all(split_axis=0, concat_axis=1)``: its ``E/n`` experts, each row the ``n`` devices' ``C``
    places side by side, coloured by the device they came from. The combine is the reverse exchange
    (``split_axis=1, concat_axis=0``). Taught in ``notebooks/11_pipeline_experts.ipynb``, section 9.

    Args:
      n_experts: ``E``, a positive multiple of ``n_devices``.
      capacity: ``C``, places per expert and device (>= 1).
      n_devices: ``n``, devices on the expert axis (>= 1).
      ax: the Axes to draw on; a new figure when None.

    Returns:
      The Figure: one Rectangle per (device, expert) row on top and per (device, expert, source) below,
      ``2·n·E`` in all.

    Raises:
      ValueError: a size below 1, or ``E`` not a multiple of ``n``.
    """
    if min(n_experts, capacity, n_devices) < 1 or n_experts % n_devices:
        raise ValueError(
            f"expert_exchange: n_experts={n_experts} must be a positive multiple of n_devices="
            f"{n_devices}, capacity={capacity} at least 1"
        )
    e, n, per = n_experts, n_devices, n_experts // n_devices
    if ax is None:
        ax = plt.subplots(figsize=(max(6.0, 1.4 * n), 0.22 * (e + per) + 1.8))[1]
    row, gap, width = (
        1.0,
        2.5,
        1.0,
    )  # a row's height, the gap between the two buffers, a device's width
    top = per + gap  # the buffers before the exchange sit above
    for d in range(n):
        x0 = d * 1.25
        for j in range(e):  # before: expert j's C places, sent to the device holding it
            y = top + (e - 1 - j) * row
            ax.add_patch(Rectangle((x0, y), width, row, facecolor=device_color(j // per),
                                   edgecolor="white", lw=0.8))  # fmt: skip
            if e <= 16:
                ax.text(x0 + width / 2, y + row / 2, f"e{j}", ha="center", va="center", fontsize=6)
        for j in range(per):  # after: this device's expert d·per + j, the n sources side by side
            y = (per - 1 - j) * row
            for src in range(n):
                ax.add_patch(Rectangle((x0 + src * width / n, y), width / n, row,
                                       facecolor=device_color(src), edgecolor="white", lw=0.5))  # fmt: skip
            ax.text(x0 - 0.04, y + row / 2, f"e{d * per + j}", ha="right", va="center", fontsize=6)
        ax.text(x0 + width / 2, top + e * row + 0.2, f"device {d}", ha="center", fontsize=7)
    mid = per + gap / 2
    ax.annotate(
        "", xy=(-0.35, per + 0.2), xytext=(-0.35, top - 0.2), arrowprops={"arrowstyle": "-|>"}
    )
    ax.text(-0.45, mid, "dispatch", ha="right", va="center", fontsize=7)
    ax.text(0.0, mid, "all_to_all(split_axis=0, concat_axis=1)", ha="left", va="center", fontsize=7)
    ax.set_xlim(-1.6, max(n * 1.25, 4.0))
    ax.set_ylim(-0.3, top + e * row + 0.8)
    ax.set_axis_off()
    ax.set_title(
        f"dispatch on {n} device(s): [E, C, D] = [{e}, {capacity}, D] per device -> "
        f"[E/n, n·C, D] = [{per}, {n * capacity}, D]\ncolour: the device a row goes to (top), "
        "came from (below); the combine runs it back",
        fontsize=8,
        loc="left",
    )
    return ax.figure

"""Pictures of the transformer split over devices, drawn from the run's shapes: the heads each device of
the model axis holds, the ring of key/value blocks of ring attention (which block each device scores at
each step, and how much of it the causal mask keeps), Ulysses' swap of a sequence split for a head split,
sequence parallelism's layouts region by region
of a block, Megatron's *f* and *g* around a tensor-parallel MLP, one collective matmul's steps (which block each
device multiplies while it sends it on), ZeRO-3's per-layer gather/free timeline and where a
tensor-parallel pipeline stage's all-reduces sit (lesson 11, also named in ``pipeline_diagrams``).

A colour per device (:func:`course_lib.diagrams.device_color`). Each function takes an optional ``ax``,
returns the Figure, never calls ``plt.show()`` and changes no global style. Used by
``notebooks/10_transformers.ipynb`` and ``notebooks/11_pipeline_experts.ipynb``.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

from .diagrams import device_color

__all__ = [
    "collective_matmul_schedule",
    "collective_matmul_steps",
    "heads_over_devices",
    "megatron_fg",
    "ring_blocks",
    "ring_schedule",
    "sp_layout",
    "sp_regions",
    "tp_stage",
    "ulysses_layout",
    "ulysses_owners",
    "zero3_timeline",
]


def heads_over_devices(n_heads: int, n_devices: int, ax=None):
    """The attention heads (and their slices of ``wq``/``wk``/``wv``/``wo``) each device holds under
    tensor parallelism: head ``h`` on device ``h // (n_heads / n_devices)``.

    Raises:
      ValueError: ``n_heads`` not divisible by ``n_devices``.
    """
    if n_devices < 1 or n_heads % n_devices:
        raise ValueError(f"{n_heads} heads do not split over {n_devices} devices")
    per = n_heads // n_devices
    ax = plt.subplots(figsize=(max(5, 0.6 * n_heads), 1.2))[1] if ax is None else ax
    for h in range(n_heads):
        ax.add_patch(Rectangle((h, 0), 1, 1, fc=device_color(h // per), ec="white", lw=1.5))
        ax.text(h + 0.5, 0.5, f"head {h}", ha="center", va="center", fontsize=7, color="white")
    ax.set_xlim(0, n_heads)
    ax.set_ylim(0, 1)
    ax.set_axis_off()
    handles = [Rectangle((0, 0), 1, 1, fc=device_color(d)) for d in range(n_devices)]
    ax.legend(handles, [f"device {d}" for d in range(n_devices)], ncol=min(n_devices, 8),
              fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 0), frameon=False)  # fmt: skip
    ax.set_title(f"{n_heads} heads on {n_devices} device(s): {per} each, one all-reduce per sub-layer",
                 fontsize=9, loc="left")  # fmt: skip
    return ax.figure


def ring_schedule(n_devices: int) -> tuple[np.ndarray, np.ndarray]:
    """Which key/value block device ``r`` holds at step ``t`` of ring attention, ``(r - t) mod n``, and
    how the causal mask treats it: 2 all visible (an earlier block), 1 the diagonal block (masked by
    position), 0 masked entirely (a later block, arrived by wrapping round the ring). Both int [n, n],
    indexed [step, device]."""
    t = np.arange(n_devices)[:, None]
    r = np.arange(n_devices)[None, :]
    held = (r - t) % n_devices
    seen = np.where(held < r, 2, np.where(held == r, 1, 0))
    return held, seen


def ring_blocks(n_devices: int, ax=None):
    """The ring of key/value blocks: rows = steps, columns = devices; each cell coloured by the device
    whose block it is, labelled by its block, hatched when the causal mask hides it entirely (under SPMD
    still computed, then discarded: ``n(n-1)/2`` of the ``n²`` cells)."""
    held, seen = ring_schedule(n_devices)
    if ax is None:
        size = (max(4, 0.7 * n_devices + 1.5), max(1.6, 0.45 * n_devices + 0.8))
        ax = plt.subplots(figsize=size)[1]
    for t in range(n_devices):
        for r in range(n_devices):
            b, s = int(held[t, r]), int(seen[t, r])
            ax.add_patch(Rectangle((r, t), 1, 1, fc=device_color(b), ec="white", lw=1.5,
                                   alpha=1.0 if s else 0.35, hatch="///" if s == 0 else None))  # fmt: skip
            label = f"KV{b}" + ("" if s == 2 else " ◣" if s == 1 else " ✗")
            ax.text(r + 0.5, t + 0.5, label, ha="center", va="center", fontsize=7,
                    color="white" if s else "black")  # fmt: skip
    ax.set_xlim(0, n_devices)
    ax.set_ylim(n_devices, 0)
    ax.set_xticks(
        np.arange(n_devices) + 0.5, [f"dev {r}\n(Q{r})" for r in range(n_devices)], fontsize=7
    )
    ax.set_yticks(np.arange(n_devices) + 0.5, [f"step {t}" for t in range(n_devices)], fontsize=7)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    useful = int((seen > 0).sum())
    ax.set_title(f"ring attention on {n_devices}: ◣ diagonal (masked by position), ✗ masked entirely "
                 f"({n_devices * n_devices - useful} of {n_devices * n_devices} cells)", fontsize=8,
                 loc="left")  # fmt: skip
    return ax.figure


def ulysses_owners(n_heads: int, n_devices: int) -> tuple[np.ndarray, np.ndarray]:
    """Which device holds each (sequence block, head) of q, k or v in Ulysses
    (:func:`course_lib.splits.ulysses_attention`): before the ``all_to_all``, device ``r`` holds
    sequence block ``r`` of every head; after it, device ``d`` holds heads ``d·H/n … (d+1)·H/n − 1`` of
    the whole sequence. Both int [n_devices, n_heads], indexed [sequence block, head].

    Raises:
      ValueError: ``n_heads`` not divisible by ``n_devices``.
    """
    if n_devices < 1 or n_heads % n_devices:
        raise ValueError(f"{n_heads} heads do not split over {n_devices} devices")
    blocks, heads = np.indices((n_devices, n_heads))
    return blocks, heads // (n_heads // n_devices)


def ulysses_layout(n_heads: int, n_devices: int, ax=None):
    """:func:`ulysses_owners` drawn: two grids of sequence blocks (rows) × heads (columns), each piece
    coloured by the device that holds it, sequence-split on the left, head-split on the right, the
    ``all_to_all`` between them. Returns the Matplotlib Figure.

    Raises:
      ValueError: ``n_heads`` not divisible by ``n_devices``.
    """
    owners = ulysses_owners(n_heads, n_devices)
    if ax is None:
        ax = plt.subplots(figsize=(max(6, 0.5 * n_heads + 2), max(1.8, 0.3 * n_devices + 1.2)))[1]
    x0s, gap = (0.0, n_heads + 3.0), 3.0
    labels = ("sequence split [B, S/n, H, Dh]", "head split [B, S, H/n, Dh]")
    for x0, owner, label in zip(x0s, owners, labels):
        for (s, h), d in np.ndenumerate(owner):
            ax.add_patch(Rectangle((x0 + h, s), 1, 1, fc=device_color(int(d)), ec="white", lw=1))
        ax.text(x0 + n_heads / 2, -0.3, label, ha="center", va="bottom", fontsize=8)
    mid = n_devices / 2
    ax.annotate(
        "", (n_heads + gap - 0.3, mid), (n_heads + 0.3, mid), arrowprops=dict(arrowstyle="->")
    )
    ax.text(n_heads + gap / 2, mid - 0.2, "all_to_all", ha="center", va="bottom", fontsize=7)
    ax.set_xlim(-0.5, 2 * n_heads + gap + 0.5)
    ax.set_ylim(n_devices + 0.2, -1.6)
    ax.set_axis_off()
    ax.set_title(f"Ulysses on {n_devices}: rows = sequence blocks, columns = heads, a colour per device"
                 "\nq, k and v go left to right; the output comes back right to left", fontsize=8,
                 loc="left")  # fmt: skip
    return ax.figure


def sp_layout(batch: int, seq: int, d_model: int, n_devices: int) -> list[tuple[str, tuple, str]]:
    """One block under sequence parallelism (:func:`course_lib.splits.sp_block`), region by region:
    ``(region, shape a device holds, collective after it)`` — the LayerNorm regions ``[B, S/n, D]``, an
    all-gather to ``[B, S, D]`` before each sub-layer, a reduce-scatter back to ``[B, S/n, D]`` after it
    (the collective is ``""`` where none follows).

    Raises:
      ValueError: ``seq`` not divisible by ``n_devices``.
    """
    if n_devices < 1 or seq % n_devices:
        raise ValueError(f"a sequence of {seq} does not split over {n_devices} devices")
    split, full = (batch, seq // n_devices, d_model), (batch, seq, d_model)
    return [
        ("LayerNorm 1", split, "all-gather"),
        ("attention (H/n heads)", full, "reduce-scatter"),
        ("residual add, LayerNorm 2", split, "all-gather"),
        ("MLP (F/n columns)", full, "reduce-scatter"),
        ("residual add", split, ""),
    ]


def sp_regions(batch: int, seq: int, d_model: int, n_devices: int, ax=None):
    """:func:`sp_layout` drawn: one box per region, as wide as the sequence a device holds there
    (``S/n`` in the LayerNorm regions, ``S`` in the sub-layers), the collective between two regions on
    the arrow. Returns the Matplotlib Figure.

    Raises:
      ValueError: ``seq`` not divisible by ``n_devices``.
    """
    regions = sp_layout(batch, seq, d_model, n_devices)
    ax = plt.subplots(figsize=(10, 1.9))[1] if ax is None else ax
    x = 0.0
    for name, shape, op in regions:
        width = 1.6 * shape[1] / seq  # the sequence a device holds, against the whole
        split = shape[1] < seq
        ax.add_patch(Rectangle((x, 0.6), max(width, 0.25), 0.8, fc=device_color(0 if split else 1),
                               ec="white", lw=1.5))  # fmt: skip
        ax.text(x + max(width, 0.25) / 2, 1.55, name, ha="center", va="bottom", fontsize=7)
        ax.text(x + max(width, 0.25) / 2, 0.45, f"[{', '.join(map(str, shape))}]", ha="center",
                va="top", fontsize=7)  # fmt: skip
        x += max(width, 0.25)
        if op:
            ax.annotate("", (x + 0.9, 1.0), (x + 0.05, 1.0), arrowprops=dict(arrowstyle="->"))
            ax.text(x + 0.475, 1.08, op, ha="center", va="bottom", fontsize=7, color="dimgray")
            x += 0.95
    ax.set_xlim(-0.1, x + 0.1)
    ax.set_ylim(0, 2.2)
    ax.set_axis_off()
    ax.set_title(f"one block under SP on {n_devices} device(s): [B, S/n, D] between the sub-layers, "
                 "[B, S, D] inside them", fontsize=8, loc="left")  # fmt: skip
    return ax.figure


def collective_matmul_schedule(n_devices: int) -> tuple[np.ndarray, np.ndarray]:
    """The steps of :func:`course_lib.splits.collective_matmul` on a ring of ``n_devices``: at step ``t``
    device ``r`` multiplies the row block of ``x`` it holds, block ``(r − t) mod n`` (into the output rows
    of that block), and, unless ``t`` is the last step, sends that same block on to device ``r + 1``.

    Returns:
      ``(held, sends)``: int [n, n], the block device ``r`` multiplies at step ``t``; bool [n, n], whether
      it sends that block during the step. Both indexed [step, device].

    Raises:
      ValueError: ``n_devices`` < 1.
    """
    if n_devices < 1:
        raise ValueError(f"a ring needs at least one device, not {n_devices}")
    t = np.arange(n_devices)[:, None]
    r = np.arange(n_devices)[None, :]
    held = (r - t) % n_devices
    sends = np.broadcast_to(t < n_devices - 1, held.shape).copy()
    return held, sends


def collective_matmul_steps(
    n_devices: int, rows: int, k: int, n_cols: int, itemsize: int, ax=None
):  # fmt: skip
    """One collective matmul, ``all_gather(x) @ w`` as a ring (:func:`collective_matmul_schedule`):
    rows = steps, columns = devices; each cell is the matmul ``x_b @ w`` of the block ``b`` the device
    holds (coloured by the device it started on), with ``→`` where the same block is sent on to the next
    device during the step. The title gives the shapes and the bytes of one send.

    Args:
      n_devices: the ring's size ``n``.
      rows, k: one block of ``x``, ``[rows, k]`` (``rows = M/n``).
      n_cols: this device's columns of ``w`` (``[k, n_cols]``).
      itemsize: bytes per element of ``x`` (8 for float64, 4 for float32, 2 for bfloat16).
      ax: a Matplotlib Axes to draw on; a new figure when None.

    Returns:
      The Matplotlib Figure.

    Raises:
      ValueError: ``n_devices`` < 1.
    """
    held, sends = collective_matmul_schedule(n_devices)
    if ax is None:
        size = (max(4, 1.1 * n_devices + 1.5), max(1.6, 0.5 * n_devices + 0.9))
        ax = plt.subplots(figsize=size)[1]
    for t in range(n_devices):
        for r in range(n_devices):
            b = int(held[t, r])
            ax.add_patch(Rectangle((r, t), 1, 1, fc=device_color(b), ec="white", lw=1.5))
            label = f"x{b} @ w" + (f"\n→ dev {(r + 1) % n_devices}" if sends[t, r] else "")
            ax.text(r + 0.5, t + 0.5, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_xlim(0, n_devices)
    ax.set_ylim(n_devices, 0)
    ax.set_xticks(np.arange(n_devices) + 0.5, [f"dev {r}" for r in range(n_devices)], fontsize=7)
    ax.set_yticks(np.arange(n_devices) + 0.5, [f"step {t}" for t in range(n_devices)], fontsize=7)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    sent = rows * k * itemsize
    ax.set_title(f"collective matmul on {n_devices}: x{{b}} [{rows}, {k}] @ w [{k}, {n_cols}] each step; "
                 f"→ sends that block on ({sent:,} bytes), {int(sends[:, 0].sum())} sends a device",
                 fontsize=8, loc="left")  # fmt: skip
    return ax.figure


def zero3_timeline(n_layers: int, ax=None):
    """ZeRO-3's per-layer timeline: forward layer ``i`` gathers its parameters, runs, frees them; the
    backward gathers them again (``jax.checkpoint``), computes the gradient and reduce-scatters it. At
    most one gathered layer is alive at a time (XLA may prefetch the next)."""
    ax = plt.subplots(figsize=(max(6, 0.9 * n_layers * 2), 1.6))[1] if ax is None else ax
    order = [("F", i) for i in range(n_layers)] + [("B", i) for i in reversed(range(n_layers))]
    for x, (phase, i) in enumerate(order):
        c = device_color(i)
        ax.add_patch(
            Rectangle((x, 1), 1, 0.8, fc=c, ec="white", lw=1.5, alpha=0.55 if phase == "F" else 1)
        )
        ax.text(x + 0.5, 1.4, f"{phase} L{i}", ha="center", va="center", fontsize=7)
        ax.text(x + 0.5, 0.6, "all-gather", ha="center", va="center", fontsize=6)
        if phase == "B":
            ax.text(x + 0.5, 0.25, "reduce-scatter", ha="center", va="center", fontsize=6)
    ax.set_xlim(0, len(order))
    ax.set_ylim(0, 2)
    ax.set_axis_off()
    ax.set_title(f"A schematic (the order of operations, not their times): ZeRO-3 over {n_layers} layers, "
                 "each layer gathered before use and freed after;\ngathered again in the backward, its "
                 "gradient reduce-scattered", fontsize=8, loc="left")  # fmt: skip
    return ax.figure


_TP_FORWARD = (
    ("LN1", "compute"),
    ("f: nothing\n(x varies)", "compute"),
    ("attention\nheads / n", "compute"),
    ("all-reduce\n(g)", "model"),
    ("+ x", "compute"),
    ("LN2", "compute"),
    ("f: nothing\n(x varies)", "compute"),
    ("MLP\ncolumns / n", "compute"),
    ("all-reduce\n(g)", "model"),
    ("+ x", "compute"),
)
"""One layer of :func:`course_lib.pipeline_tp.tp_stage_block` forward, in order: (label, kind)."""

_TP_BACKWARD = (
    ("LN1'", "compute"),
    ("f': nothing", "compute"),
    ("attention'", "compute"),
    ("g': cast,\nmoves nothing", "compute"),
    ("all-reduce\n(join)", "model"),
    ("LN2'", "compute"),
    ("f': nothing", "compute"),
    ("MLP'", "compute"),
    ("g': cast,\nmoves nothing", "compute"),
    ("all-reduce\n(join)", "model"),
)
"""The same layer backward, each op under the forward op it transposes (read right to left)."""

_TP_COLORS = {"compute": "#dddddd", "model": "#d62728", "stage": "#1f77b4"}


def tp_stage(n_model: int, act_bytes: int, ln_bytes: int, predicted: dict | None = None, ax=None):
    """Where the collectives of one layer of a tensor-parallel pipeline stage sit, forward and backward.

    Top row: the layer forward (:func:`course_lib.pipeline_tp.tp_stage_block`): Megatron's *f* does
    nothing (the executor's stream already varies over ``model``) and each sub-layer ends in *g*, an
    all-reduce over ``model`` of the activation (red). Bottom row: its backward, each op under the forward
    op it transposes (read right to left): *g*'s ``psum`` transposes to a cast that moves nothing, and the
    all-reduce sits at the residual add, where *g*'s replicated result joined the varying stream (the
    transpose of that implicit cast); the four LayerNorm ``[D]`` gradients are summed over ``model`` in
    one more all-reduce. Blue arrows: the ``ppermute`` over ``stage`` into and out of the
    stage, one activation per tick each way. Taught in ``notebooks/11_pipeline_experts.ipynb``, section 8.

    Args:
      n_model: devices on the ``model`` axis (>= 1).
      act_bytes: bytes of one activation ``[b, S, D]`` (what each all-reduce and ``ppermute`` carries).
      ln_bytes: bytes of the four LayerNorm gradients, ``4·D·itemsize``.
      predicted: optional :func:`course_lib.pipeline_tp.predict` output, ``{axis: {"count", "sent"}}``,
        whose per-step totals go in the title.
      ax: the Axes to draw on; a new figure when None.

    Returns:
      The Figure: one Rectangle per op, 20, and one for the LayerNorms' gradients: 21 (5 of them
      all-reduces over ``model``).

    Raises:
      ValueError: ``n_model`` below 1 or a size below 0.
    """
    if n_model < 1 or min(act_bytes, ln_bytes) < 0:
        raise ValueError(
            f"tp_stage: n_model={n_model} must be >= 1, act_bytes={act_bytes} and ln_bytes={ln_bytes} >= 0"
        )
    if ax is None:
        ax = plt.subplots(figsize=(13, 3.2))[1]
    w, h, step = 1.0, 0.8, 1.15
    end = (len(_TP_FORWARD) - 1) * step + w
    blue = {"arrowstyle": "-|>", "color": _TP_COLORS["stage"]}
    for name, y, ops in (("forward", 2.0, _TP_FORWARD), ("backward", 0.0, _TP_BACKWARD)):
        ax.text(-0.9, y + h / 2, name, ha="right", va="center", fontsize=8)
        for i, (label, kind) in enumerate(ops):
            x = i * step
            ax.add_patch(Rectangle((x, y), w, h, facecolor=_TP_COLORS[kind], edgecolor="white"))
            text = label if kind == "compute" else f"{label}\n{act_bytes:,} B"
            color = "white" if kind == "model" else "black"
            ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=6, color=color)
        into, out = ((-0.8, -0.1), (end + 0.1, end + 0.8))[:: 1 if name == "forward" else -1]
        if name == "backward":
            into, out = (into[1], into[0]), (out[1], out[0])
        for a, b in (into, out):
            ax.annotate("", xy=(b, y + h / 2), xytext=(a, y + h / 2), arrowprops=blue)
    ax.text(end + 0.45, 2.0 + h + 0.1, f"ppermute to\nstage s+1\n{act_bytes:,} B", fontsize=6,
            color=_TP_COLORS["stage"], ha="center")  # fmt: skip
    ax.text(end + 0.45, -0.6, f"dy from\nstage s+1\n{act_bytes:,} B", fontsize=6,
            color=_TP_COLORS["stage"], ha="center")  # fmt: skip
    ax.add_patch(
        Rectangle((0, 1.05), w * 2.2, 0.55, facecolor=_TP_COLORS["model"], edgecolor="white")
    )
    ax.text(1.1 * w, 1.325, f"all-reduce LN grads {ln_bytes:,} B", ha="center", va="center",
            fontsize=6, color="white")  # fmt: skip
    ax.set_xlim(-1.9, end + 1.1)
    ax.set_ylim(-0.7, 3.3)
    ax.set_axis_off()
    title = (
        f"one layer of a stage, model axis of {n_model}: red = all-reduce over model, blue = ppermute "
        "over stage"
    )
    if predicted:
        title += "\nper step: " + "; ".join(
            f"{axis}: {row['count']:.0f} collectives, {row['sent']:,.0f} B sent by the busiest device"
            for axis, row in sorted(predicted.items())
        )
    ax.set_title(title, fontsize=8, loc="left")
    return ax.figure


_FG = (  # (label, forward: all-reduce?, backward: all-reduce?), left to right
    ("x\n[T, D]", False, False),
    ("f", False, True),
    ("x @ W1[:, cols]\ncolumn-parallel", False, False),
    ("GELU", False, False),
    ("h @ W2[rows, :]\nrow-parallel", False, False),
    ("g", True, False),
    ("y\n[T, D]", False, False),
)


def megatron_fg(n_model: int, act_bytes: int, ax=None):
    """Where Megatron's *f* and *g* sit around a tensor-parallel MLP (attention is the same, heads for
    columns): *f* before the column-parallel matmul is the identity forward and an all-reduce of the
    input's cotangent backward; *g* after the row-parallel matmul is an all-reduce forward and the
    identity backward. Taught in ``notebooks/10_transformers.ipynb``, section 1.

    Args:
      n_model: devices on the ``model`` axis (>= 1).
      act_bytes: bytes of one activation ``[T, D]``, what each all-reduce carries (>= 0).
      ax: the Axes to draw on; a new figure when None.

    Returns:
      The Figure: 14 Rectangles (7 ops forward, 7 backward), 2 of them all-reduces (red).

    Raises:
      ValueError: ``n_model`` below 1 or ``act_bytes`` below 0.
    """
    if n_model < 1 or act_bytes < 0:
        raise ValueError(f"megatron_fg: n_model={n_model} must be >= 1, act_bytes={act_bytes} >= 0")
    ax = plt.subplots(figsize=(11, 2.4))[1] if ax is None else ax
    for y, name, col in ((1.2, "forward", 1), (0.0, "backward", 2)):
        ax.text(-0.15, y + 0.4, name, ha="right", va="center", fontsize=8)
        for i, op in enumerate(_FG):
            red = op[col]
            text = (
                f"all-reduce\n{act_bytes:,} B" if red else "identity" if op[0] in ("f", "g") else ""
            )
            label = f"{op[0]}: {text}" if op[0] in ("f", "g") else op[0]
            ax.add_patch(Rectangle((i * 1.3, y), 1.1, 0.8, ec="white",
                                   fc=_TP_COLORS["model"] if red else _TP_COLORS["compute"]))  # fmt: skip
            ax.text(i * 1.3 + 0.55, y + 0.4, label, ha="center", va="center", fontsize=6,
                    color="white" if red else "black")  # fmt: skip
    ax.set_xlim(-1.0, len(_FG) * 1.3)
    ax.set_ylim(-0.1, 2.1)
    ax.set_axis_off()
    ax.set_title(f"Megatron's f and g, model axis of {n_model}: red = all-reduce over model "
                 "(forward left to right; the backward runs right to left)", fontsize=8, loc="left")  # fmt: skip
    return ax.figure

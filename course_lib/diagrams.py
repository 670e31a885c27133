"""Pictures of parallel programs drawn from the run's own numbers (devices, mesh, shapes).

A colour per device (matplotlib's ``petroff10``, made for colour-vision deficiencies); white: the
same on every device; white with stripes: data of (or held by) the striped devices. Each function
takes an optional ``ax``, returns the Figure, never calls ``plt.show()``, changes no global style.
Lessons: :func:`collective` (06), :func:`data_parallel` (04, 08), :func:`megatron_mlp` and
:func:`tensor_parallel_cnn` (06, 08), :func:`array_sharding` and :func:`sharding_table` (05, 08).
``treescope.render_array_sharding(x)`` draws N-D shardings as interactive HTML (needs JavaScript).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import matplotlib as mpl
import matplotlib.pyplot as plt
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from matplotlib.patches import FancyBboxPatch, Rectangle

from .meshes import DATA, MODEL
from .parallel import tp_param_specs

COLLECTIVES = {
    "psum": "all-reduce: every device gets the sum over devices",
    "all_gather": "every device gets every device's block, in device order",
    "psum_scatter": "reduce-scatter: device i gets the sum of block i",
    "all_to_all": "device i sends its block j to device j",
    "ppermute": "a ring shift: device i sends its block to device i + 1",
}
"""The collectives :func:`collective` draws (``jax.lax`` names) and what each does."""
MAX_DEVICES = 16
"""Most devices a picture draws legibly."""
TP_LAYOUTS = ("tp", "alternative")
"""CNN layouts: ``parallel.tp_param_specs``; conv1 whole, conv2 → conv3, dense1 → dense2."""
_EDGE, _ARROW = "#333333", {"arrowstyle": "-|>"}


def device_color(device_id: int) -> tuple:
    """Returns the RGB colour of a device in every picture (``petroff10``, cycled past 10)."""
    palette = mpl.color_sequences["petroff10"]
    return tuple(palette[int(device_id) % len(palette)])


def _fit(text: str, width_in: float, largest: float = 8.0) -> float:
    """A font size (points, at least 5) at which each line of ``text`` fits ``width_in`` inches."""
    chars = max([len(line) for line in text.splitlines()] + [1])
    return max(5.0, min(largest, 0.92 * width_in * 72 / (0.56 * chars)))


def _new_fig(ax, size):
    ax = plt.subplots(figsize=size)[1] if ax is None else ax
    ax.set_axis_off()
    return ax.figure, ax


def _check_n(n: int, what: str = "n_devices") -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= MAX_DEVICES:
        raise ValueError(f"{what}={n!r} must be an integer from 1 to {MAX_DEVICES}, e.g. 8")
    return int(n)


def _shape(dims) -> str:
    return "[" + ", ".join(str(int(d)) for d in dims) + "]"


def _block(ax, x, y, w, h, owners, text="", fontsize=8.0, rounded=False):
    """A box at (x, y): one owner's colour, white with a stripe per owner, or white (no owners)."""
    owners = list(owners)
    face = device_color(owners[0]) if len(owners) == 1 else "white"
    style = "round,pad=0,rounding_size=0.06" if rounded else "square,pad=0"
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=style, fc=face, ec=_EDGE, lw=0.8))
    for k, d in enumerate(owners if len(owners) > 1 else []):
        sw = w / len(owners)
        ax.add_patch(Rectangle((x + k * sw, y), sw, 0.18 * h, fc=device_color(d), lw=0))
    r, g, b = mpl.colors.to_rgb(face)
    color = "white" if 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.5 else "black"
    ty = y + h / 2 + (0.09 * h if len(owners) > 1 else 0)
    ax.text(x + w / 2, ty, text, ha="center", va="center", fontsize=fontsize, color=color)


@dataclasses.dataclass(frozen=True)
class CollectiveRun:
    """What the devices ``device_ids`` held before and after a collective (the ``jax.lax``
    ``call``): row ``i`` of ``before`` / ``after`` (float32 [n, k_in] / [n, k_out]) is device
    ``i``'s buffer, ``before[i, j] = 10 i + j`` (``100 i + j`` past 10); ``sources_*`` (int32, same
    shapes): bit ``d`` set when the value holds device ``d``'s data (the call run on one-hot
    bitmasks: found, not assumed)."""

    kind: str
    call: str
    device_ids: tuple[int, ...]
    before: np.ndarray
    after: np.ndarray
    sources_before: np.ndarray
    sources_after: np.ndarray


def run_collective(kind: str, n_devices: int | None = None, devices=None) -> CollectiveRun:
    """Returns a :class:`CollectiveRun`: ``kind`` run in ``jax.shard_map`` on a 1-D ``data`` mesh of
    ``n_devices`` (default: all) of ``devices`` (default ``jax.devices()``), each row read back from
    that device's own buffer.

    Raises:
      ValueError: unknown ``kind``, or ``n_devices`` not in 1 … min(16, number of devices).
    """
    if kind not in COLLECTIVES:
        raise ValueError(f"collective {kind!r} is not drawn; choose one of {tuple(COLLECTIVES)}")
    devices = list(jax.devices() if devices is None else devices)
    n = _check_n(len(devices) if n_devices is None else n_devices)
    if n > len(devices):
        raise ValueError(f"n_devices={n} but only {len(devices)} devices exist; use at most that")
    devices, mesh = devices[:n], Mesh(np.array(devices[:n]), (DATA,))
    kwargs = {"perm": [(i, (i + 1) % n) for i in range(n)]} if kind == "ppermute" else {}
    kwargs = {"split_axis": 0, "concat_axis": 0} if kind == "all_to_all" else kwargs
    kwargs |= {"tiled": True} if kind in ("all_gather", "psum_scatter", "all_to_all") else {}
    call = ", ".join([f"lax.{kind}(x", repr(DATA)] + [f"{k}={v}" for k, v in kwargs.items()]) + ")"
    body = functools.partial(getattr(lax, kind), axis_name=DATA, **kwargs)  # x: this device's row
    per_device = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(DATA), out_specs=P(DATA)))
    k = 1 if kind in ("all_gather", "ppermute") else n  # values per device before
    values = ((10 if n <= 10 else 100) * np.arange(n)[:, None] + np.arange(k)).astype(np.float32)
    masks = np.repeat((1 << np.arange(n, dtype=np.int32))[:, None], k, axis=1)

    def on_devices(x):  # row i: the buffer device i holds after the call (not a gathered copy)
        out = per_device(jax.device_put(x.reshape(-1), NamedSharding(mesh, P(DATA))))
        rows = {s.device.id: np.asarray(s.data) for s in out.addressable_shards}
        return np.stack([rows[d.id] for d in devices])

    ids = tuple(d.id for d in devices)
    return CollectiveRun(kind, call, ids, values, on_devices(values), masks, on_devices(masks))


def collective(kind: str, n_devices: int | None = None, ax=None, devices=None):
    """Returns a Figure of who holds what before and after one collective (06_shard_map).

    A row per device; a box is one float32 value of its buffer, in the colour of the device its data
    came from; "Σ" boxes are sums, striped with the devices that contributed. The values are those
    the devices returned (:func:`run_collective`, same ``kind``, ``n_devices``, ``devices``).

    Raises:
      ValueError: as :func:`run_collective`.
    """
    run = run_collective(kind, n_devices, devices)
    (n, k_in), k_out, gap = run.before.shape, run.after.shape[1], 2.2
    width = k_in + k_out + gap
    fig, ax = _new_fig(ax, (max(4.5, 0.5 * width + 1.2), 0.45 * n + 1.3))
    grids = ((0, run.before, run.sources_before), (k_in + gap, run.after, run.sources_after))
    for x0, values, sources in grids:
        for (i, j), v in np.ndenumerate(values):
            owners = [run.device_ids[d] for d in range(n) if sources[i, j] >> d & 1]
            text = f"{v:g}" if len(owners) == 1 else f"Σ {v:g}"
            _block(ax, x0 + j, n - 1 - i, 1, 1, owners, text, 8 if max(k_in, k_out) <= 8 else 6)
    for i, d in enumerate(run.device_ids):
        ax.text(-0.2, n - 0.5 - i, f"device {d}", ha="right", va="center", fontsize=8)
    ax.annotate("", (k_in + gap - 0.25, n / 2), (k_in + 0.25, n / 2), arrowprops=_ARROW)
    ax.text(k_in / 2, n + 0.25, "before", ha="center", fontsize=9)
    ax.text(k_in + gap + k_out / 2, n + 0.25, "after", ha="center", fontsize=9)
    ax.set_title(f"{kind}: {COLLECTIVES[kind]}\n{run.call}", fontsize=9, loc="left")
    ax.set(xlim=(-1.8, width + 0.1), ylim=(-0.1, n + 0.9), aspect="equal")
    return fig


@dataclasses.dataclass(frozen=True)
class Stage:
    """A row of a flow picture: ``kind`` ``"sharded"`` (each device its own part, in its colour),
    ``"same"`` (identical on every device, white) or ``"collective"`` (a band across the devices);
    ``name`` and ``note``: its label; ``text``: box text per device (one entry: the same in each);
    ``forward``, ``backward``: a collective's communication in each pass (``""``: none)."""

    kind: str
    name: str
    text: tuple[str, ...] = ("",)
    note: str = ""
    forward: str = ""
    backward: str = ""


def _draw_flow(ax, stages: Sequence[Stage], columns: Sequence[str], title: str):
    """Draw ``stages`` top to bottom, a column per entry of ``columns``; returns the Figure."""
    n, w, gap, step = len(columns), 2.0, 0.25, 0.45
    pitch_in = 2.1 if n <= 2 else 1.7 if n <= 4 else 1.15  # inches per column
    heights = [0.9 if s.kind == "collective" else 1.0 for s in stages]
    bottom, right = -(sum(heights) + step * (len(stages) - 1)) - 0.1, n * (w + gap) - gap
    new = ax is None
    fig, ax = _new_fig(ax, (1.6 + n * pitch_in, 0.62 * (0.85 - bottom) + 0.5))
    if new:
        fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=1 - 0.45 / fig.get_figheight())
    ax.set(xlim=(-2.9, right + 0.05), ylim=(bottom, 0.75))
    unit_in = ax.get_position().width * fig.get_figwidth() / (right + 2.95)  # inches per x unit
    for j, col in enumerate(columns):
        ax.text(j * (w + gap) + w / 2, 0.25, col, ha="center", va="bottom", fontsize=8)
    y = 0.0
    for s, h in zip(stages, heights):
        y -= h
        label = f"$\\it{{{s.name}}}$" if s.kind == "collective" and len(s.name) == 1 else s.name
        va, mid = ("bottom", y + h / 2 + 0.02) if s.note else ("center", y + h / 2)
        ax.text(-0.3, mid, label, ha="right", va=va, fontsize=9)
        ax.text(-0.3, y + h / 2 - 0.02, s.note, ha="right", va="top", fontsize=7, color="#555")
        if s.kind == "collective":
            box = FancyBboxPatch((0, y), right, h, "round,pad=0,rounding_size=0.15", fc="#f0f0f0")
            ax.add_patch(box).set(ec=_EDGE, lw=1.6)
            fs = _fit(s.text[0], right * unit_in, 8.5)
            ax.text(right / 2, y + h / 2, s.text[0], ha="center", va="center", fontsize=fs)
        for j in range(n):
            x, text = j * (w + gap), s.text[j % len(s.text)]
            if s.kind != "collective":
                owners = [j] if s.kind == "sharded" else []
                _block(ax, x, y, w, h, owners, text, _fit(text, w * unit_in), rounded=True)
            if s is not stages[-1]:
                ax.annotate("", (x + w / 2, y - step), (x + w / 2, y), arrowprops=_ARROW)
        y -= step
    ax.set_title(title, fontsize=9.5)
    return fig


def data_parallel(n_devices: int, global_batch: int, image_shape=(32, 32, 3), params=None, ax=None):
    """Returns a Figure of data parallelism on ``n_devices`` (04_pmap; 08_lab B and D).

    Per device: the full parameter copy (with ``params``, a pytree: its values and bytes), its
    ``global_batch / n_devices`` images of ``image_shape`` (height, width, channels), its forward
    and backward pass and gradient; the gradient all-reduce (mean over ``data``); the update.

    Raises:
      ValueError: ``n_devices`` not in 1 … 16, or ``global_batch`` not divisible by it.
    """
    n, table = _check_n(n_devices), str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉")
    sub = [str(i).translate(table) for i in range(n)]  # subscripts: g₀, x₁, ...
    if global_batch % n:
        raise ValueError(f"global batch {global_batch} is not divisible by {n}: use a multiple")
    b, theta = global_batch // n, "θ (a full copy)"
    if params is not None:
        leaves = jax.tree.leaves(params)
        kib = sum(x.size * x.dtype.itemsize for x in leaves) / 2**10
        theta = f"θ: {sum(x.size for x in leaves):,} values\n{kib:,.1f} KiB"
    terms = " + ".join(f"g{i}" for i in sub) if n <= 3 else f"g₀ + … + g{sub[-1]}"
    mean = f"all-reduce (mean over {DATA!r}): ḡ = ({terms}) / {n}\nevery device receives ḡ"
    mean = mean if n > 1 else "all-reduce over 1 device:\nḡ = g₀, nothing is sent"
    shape = _shape((b, *image_shape))
    batch = tuple(f"x{sub[i]}: images {i * b}–{(i + 1) * b - 1}\n{shape}" for i in range(n))
    grads = tuple(f"loss(θ, x{i})\n→ gradient g{i}" for i in sub)
    stages = [
        Stage("same", "parameters", (theta,), "replicated, P()"),
        Stage("sharded", "batch", batch, f"split, P({DATA!r})"),
        Stage("sharded", "forward and\nbackward", grads),
        Stage("collective", "gradients", (mean,), forward=f"all-reduce over {DATA!r}"),
        Stage("same", "update", ("θ ← opt(θ, ḡ)",), "the same on every device"),
    ]
    title = f"Data parallelism: {n} device{'s' * (n > 1)}, global batch {global_batch} = {n} × {b}"
    return _draw_flow(ax, stages, [f"device {i}" for i in range(n)], title)


def megatron_stages(inputs, layers, splits, n_model: int, axis: str = MODEL, input_grad=False):
    """Returns the per-device plan (a list of :class:`Stage`) of a chain of Megatron pairs.

    An ``"out"``-split layer (column split, kernel ``[in, out/m]``) takes a whole input through *f*:
    forward identity (``shard_map``'s implicit ``pvary``), backward ``psum`` of the input's gradient
    (none for the first input unless ``input_grad``: images need no gradient). An ``"in"``-split
    layer (row split, ``[in/m, out]``) makes partial sums, added by *g*: forward ``psum``, backward
    identity. ``None``: replicated, run whole. Collective stages name the arrays they sum in
    ``forward`` / ``backward`` (the tests check them against the differentiated program's jaxpr).

    Args:
      inputs: global shape of the first input; ``n_model``, ``axis``: the model axis.
      layers: ``(name, kernel [..., in, out], output shape, local ops after it, shape after them)``
        per layer, global shapes, features last; ``splits``: ``"out"``, ``"in"`` or ``None`` each.

    Raises:
      ValueError: a split that breaks the pairing (``"in"`` on whole activations, ``"out"`` or
        ``None`` on split ones), or a split dimension not divisible by ``n_model``.
    """
    m, split, prev = _check_n(n_model, "n_model"), False, tuple(inputs)
    stages = [Stage("same", "input", (_shape(inputs),), "on every model shard")]

    def part(shape, dim, name):  # the per-device shape when ``dim`` is split over the axis
        if shape[dim] % m:
            raise ValueError(f"{name}: {shape[dim]} features are not divisible by {m} model shards")
        return _shape([d // m if i == len(shape) + dim else d for i, d in enumerate(shape)])

    for i, ((name, kernel, out, post, post_out), kind) in enumerate(zip(layers, splits)):
        then = post + "\n" if post else ""
        if (kind == "in") != split:
            need = "an 'in' split (input is split)" if split else "'out' or None (input is whole)"
            raise ValueError(f"{name} has split {kind!r}; after {_shape(prev)} it needs {need}")
        if kind == "out":
            back = f"psum over {axis!r} of {_shape(prev)}" * bool(i or input_grad)
            text = f"forward: identity\nbackward: {back or 'nothing (the input needs no gradient)'}"
            stages.append(Stage("collective", "f", (text,), "into an out split", backward=back))
            text = f"W {part(kernel, -1, name)}\n{then}→ {part(post_out, -1, name)}"
            stages.append(Stage("sharded", name, (text,), "output-split"))
        elif kind == "in":
            text = f"W {part(kernel, -2, name)}\n→ partial sums\n{_shape(out)}"
            stages.append(Stage("sharded", name, (text,), "input-split"))
            fwd = f"psum over {axis!r} of {_shape(out)}"
            text = f"forward: {fwd}\nbackward: identity"
            stages.append(Stage("collective", "g", (text,), "out of an in split", forward=fwd))
            label = ("+ bias, " + post).rstrip(", ")
            stages.append(Stage("same", label, (f"→ {_shape(post_out)}",), "on every model shard"))
        else:
            text = f"W {_shape(kernel)}\n{then}→ {_shape(post_out)}"
            stages.append(Stage("same", name, (text,), "replicated"))
        split, prev = kind == "out", post_out
    return stages


def megatron_mlp(batch: int, d_in: int, d_hidden: int, d_out: int, n_model: int, ax=None):
    """Returns a Figure of a 2-layer MLP's Megatron pair on ``n_model`` model shards (06_shard_map).

    ``x [batch, d_in] → f → @ W1 [d_in, d_hidden/m], gelu → @ W2 [d_hidden/m, d_out] → g``: a
    ``psum`` forward (*g*) and one backward (*f*: ``x`` is an activation and needs its gradient).

    Raises:
      ValueError: ``d_hidden`` not divisible by ``n_model``.
    """
    layers = [
        ("dense1", (d_in, d_hidden), (batch, d_hidden), "gelu", (batch, d_hidden)),
        ("dense2", (d_hidden, d_out), (batch, d_out), "", (batch, d_out)),
    ]
    stages = megatron_stages((batch, d_in), layers, ("out", "in"), n_model, input_grad=True)
    title = f"Tensor parallelism (Megatron): 2-layer MLP on {n_model} model shards"
    return _draw_flow(ax, stages, [f"model shard {k}" for k in range(n_model)], title)


def tensor_parallel_cnn(config, n_model: int, batch: int, layout="tp", ax=None):
    """Returns a Figure of the tensor-parallel CNN on ``n_model`` model shards (06, 08_lab C).

    Rows follow the forward pass of ``batch`` images (one data shard's) through the CNN of
    ``config`` (a :class:`course_lib.model.CNNConfig`), with per-device shapes; *f* and *g* bands
    are the ``model``-axis collectives of each pair (:func:`megatron_stages`); white rows run
    whole, duplicated, on every model shard. ``layout``: a name in :data:`TP_LAYOUTS` or a dict
    ``{layer: {"kernel": PartitionSpec}}``.

    Raises:
      ValueError: unknown layout, one that breaks the pairing, or channels not divisible.
    """
    out, inp, names = P(None, None, None, MODEL), P(None, None, MODEL), ("conv1", "conv2", "conv3")
    kernels = zip((*names, "dense1", "dense2"), (P(), out, inp, P(None, MODEL), P(MODEL)))
    specs = {"tp": tp_param_specs(None), "alternative": {k: {"kernel": v} for k, v in kernels}}
    if not isinstance(layout, dict) and layout not in specs:
        raise ValueError(f"layout={layout!r}: give one of {TP_LAYOUTS} or a dict of PartitionSpecs")
    specs = layout if isinstance(layout, dict) else specs[layout]
    c, s, b = (config.in_channels, *config.channels), config.image_size, batch
    flat, hidden, k = config.flat_features, config.hidden, config.num_classes
    layers = []
    for i, name in enumerate(names):  # a conv layer sees s / 2**i pixels per side
        after = (b, s >> i + 1, s >> i + 1, c[i + 1]) if i < 2 else (b, flat)
        post = "relu, pool" + ", flatten" * (i == 2)
        layers.append((name, (3, 3, c[i], c[i + 1]), (b, s >> i, s >> i, c[i + 1]), post, after))
    layers.append(("dense1", (flat, hidden), (b, hidden), "relu", (b, hidden)))
    layers.append(("dense2", (hidden, k), (b, k), "", (b, k)))
    splits = []
    for name, kernel, *_ in layers:
        spec = tuple(specs[name]["kernel"])
        spec += (None,) * (len(kernel) - len(spec))
        splits.append("out" if spec[-1] == MODEL else "in" if spec[-2] == MODEL else None)
    stages = megatron_stages((b, s, s, c[0]), layers, splits, n_model)
    name = layout if isinstance(layout, str) else "custom"
    title = f"Tensor-parallel CNN, {name!r} layout: {n_model} model shards, {b} images per shard"
    return _draw_flow(ax, stages, [f"model shard {k}" for k in range(n_model)], title)


def _layout(x: jax.Array):
    """(mesh axes per dim, {((start, stop) per dim): [device ids]}, the mesh as text) of ``x``."""
    spec = tuple(x.sharding.spec) if isinstance(x.sharding, NamedSharding) else ()
    spec = [(e,) if isinstance(e, str) else tuple(e or ()) for e in (spec + (None,) * x.ndim)]
    blocks = {}
    for d, index in x.sharding.devices_indices_map(x.shape).items():
        blocks.setdefault(tuple(s.indices(n)[:2] for s, n in zip(index, x.shape)), []).append(d.id)
    mesh = getattr(x.sharding, "mesh", None)
    mesh = ", ".join(f"{k}={v}" for k, v in mesh.shape.items()) if mesh is not None else "1 device"
    return spec[: x.ndim], blocks, mesh


def array_sharding(x: jax.Array, ax=None):
    """Returns a Figure of which device holds which block of a 1-D or 2-D array (05_sharding).

    A box per distinct block (not to scale): the devices that hold it, in their colour (stripes: a
    copy on each), and its shape; read from ``x.sharding.devices_indices_map``, for any spec on a
    1-D or 2-D mesh. ``jax.debug.visualize_array_sharding`` prints the grid as text, no shapes.

    Raises:
      ValueError: ``x`` is not 1-D or 2-D (use :func:`sharding_table` or ``treescope``).
    """
    if x.ndim not in (1, 2):
        raise ValueError(
            f"array_sharding takes 1-D or 2-D arrays, not {x.shape}; see sharding_table"
        )
    spec, blocks, mesh = _layout(x)
    rows, cols = [[0]] * (2 - x.ndim) + [sorted({k[d][0] for k in blocks}) for d in range(x.ndim)]
    fig, ax = _new_fig(ax, (1.3 * len(cols) + 1.6, 0.8 * len(rows) + 1.3))
    for key, ids in blocks.items():
        r, c = (rows.index(key[0][0]) if x.ndim == 2 else 0), cols.index(key[-1][0])
        run = len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1))
        text = f"devices\n{ids[0]}–{ids[-1]}" if run else f"device{'s' * (len(ids) > 1)} "
        text = text if run else text + ", ".join(map(str, ids))
        shape = _shape(b - a for a, b in key)
        _block(ax, c, len(rows) - 1 - r, 1, 1, ids, f"{text}\n{shape}", _fit(text, 1.1))
    ax.set_title(f"{x.dtype.name}{_shape(x.shape)}, {x.sharding.spec}\non mesh ({mesh})", size=9)
    dims = [
        f"dim {d} ({n})\n" + ("split over " + "·".join(a) if a else "whole")
        for d, n, a in zip(range(2), x.shape, spec)
    ]
    ax.text(len(cols) / 2, -0.1, dims[-1].replace("\n", ": "), ha="center", va="top", fontsize=8)
    if x.ndim == 2:
        ax.text(-0.1, len(rows) / 2, dims[0], ha="right", va="center", rotation=90, fontsize=7.5)
    ax.set(xlim=(-0.5, len(cols) + 0.05), ylim=(-0.55, len(rows) + 0.05), aspect="equal")
    return fig


def sharding_table(tree: Any, ax=None):
    """Returns a Figure of each array of a pytree: which dim is split over which mesh axis, and the
    per-device shape (05_sharding, 08_lab).

    For N-D arrays such as 4-D conv kernels, which ``visualize_array_sharding`` does not take. A
    row per leaf of ``tree`` (placed arrays): a box per dim (its size; a split one ``size / axis →
    per-device size``, coloured by mesh axis), the shard shape and how many devices hold each.
    """
    leaves = [(p, x, *_layout(x)) for p, x in jax.tree_util.tree_leaves_with_path(tree)]
    used = list(dict.fromkeys(a for *_, spec, _, _ in leaves for entry in spec for a in entry))
    names = [getattr(getattr(x.sharding, "mesh", None), "axis_names", ()) for _, x, *_ in leaves]
    colors = dict(zip(dict.fromkeys(sum(names, ())), mpl.color_sequences["okabe_ito"][1:]))
    width, rows = max([x.ndim for _, x, *_ in leaves] + [1]), len(leaves)
    fig, ax = _new_fig(ax, (2.0 + 1.3 * width + 3.2, 0.42 * rows + 1.1))
    ax.set(xlim=(-2.6, width * 1.6 + 4.6), ylim=(-0.2, rows + 0.8))
    unit_in = ax.get_position().width * fig.get_figwidth() / (width * 1.6 + 7.2)
    for i, (path, x, spec, blocks, _) in enumerate(leaves):
        y, shard, kw = rows - 1 - i, x.sharding.shard_shape(x.shape), {"va": "center", "size": 8}
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        ax.text(-0.15, y + 0.4, name, ha="right", **kw)
        for d, (size, axes) in enumerate(zip(x.shape, spec)):
            text = f"{size} / {'·'.join(axes)}\n→ {shard[d]}" if axes else f"{size}"
            face = colors[axes[0]] if axes else "white"
            ax.add_patch(Rectangle((d * 1.6, y), 1.5, 0.8, fc=face, ec=_EDGE))
            fs = _fit(text, 1.5 * unit_in)
            ax.text(d * 1.6 + 0.75, y + 0.4, text, ha="center", va="center", size=fs)
        held = len(next(iter(blocks.values())))
        on = f"{held} device" + "s" * (held > 1)
        where = f"{len(blocks)} shards, each on {on}" if len(blocks) > 1 else f"whole on {on}"
        ax.text(width * 1.6, y + 0.4, f"per device {_shape(shard)}: {where}", **kw)
    for k, (axis, c) in enumerate((a, colors[a]) for a in used):  # a colour per mesh axis
        ax.add_patch(Rectangle((k * 2.6, rows + 0.2), 0.4, 0.4, fc=c, ec=_EDGE))
        ax.text(k * 2.6 + 0.5, rows + 0.4, f"split over {axis!r}", va="center", fontsize=8)
    ax.set_title(f"Shardings on mesh ({leaves[0][-1] if leaves else '-'})", fontsize=9, loc="left")
    return fig

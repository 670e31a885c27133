"""Bytes on the wire: every collective of a compiled program, sized — and the same predicted from shapes.

A collective over a group of ``n`` devices, on an array of ``S`` bytes, makes each device send (ring
algorithms, the usual cost model; ``notebooks/08_lab.ipynb`` draws them):

==================  =====================  =========================================================
collective          bytes sent per device  S is
==================  =====================  =========================================================
all-reduce          2(n−1)/n · S           the array (a reduce-scatter, then an all-gather)
all-gather          (n−1)/n · S            the gathered (full) result
reduce-scatter      (n−1)/n · S            the full operand (n × the result)
all-to-all          (n−1)/n · S            the array
collective-permute  S · senders / devices  the array (a cyclic shift: every device sends its block once)
==================  =====================  =========================================================

The convention is NCCL's *bus bandwidth* (``nccl-tests`` ``busbw``): the bytes a ring algorithm moves per
device, a figure that does not depend on the algorithm NCCL picks. On NVSwitch servers NCCL may run
NVLS (the switch reduces) or tree algorithms, which put other byte counts on the wires; the step-time model
of :mod:`course_lib.costs` divides these bus bytes by the link bandwidth, as ``busbw`` does. A
collective-permute over source-target pairs that do not form a cycle (a shift that stops at the edge) has
devices that send nothing: :func:`collectives` gives its mean per device, S × (pairs whose source is not
their target) / devices; the busiest device sends S.

:func:`collectives` sizes them, as :func:`course_lib.programs.collective_ops` reads them from
``Compiled.as_text()``: kind, result shapes and dtypes (a combined all-reduce is one instruction with a
tuple shape), the replica groups in any of the printed forms
(``mesh['data'=4,'model'=2] {'model'}``, iota ``[4,2]<=[8]`` / ``[2,4]<=[4,2]T(1,0)``, explicit
``{{0,1},{2,3}}``, ``source_target_pairs``), and the mesh axes those groups span. Async pairs
(``all-gather-start`` / ``-done``, on GPUs) are counted once, sized by the ``-done``. A collective inside a
``while`` body would run once per iteration: :func:`collectives` refuses such programs rather than
under-count. No JAX API reports these bytes; ``cost_analysis()["bytes accessed"]`` is memory traffic.

:func:`predict_data_parallel`, :func:`predict_fsdp` and :func:`predict_tensor_parallel` predict the same
transfers from the model's shapes, the batch and the mesh; each strategy's registry entry names its own.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

from . import programs

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
"""The HLO collectives that move data between devices."""

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
"""Bytes per element of the HLO element types."""

_FACTOR = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}


def ring_bytes(kind: str, size_bytes: float, n: int) -> float:
    """Bytes each device sends for one ``kind`` over ``n`` devices on ``size_bytes`` (the table above).

    Raises:
      ValueError: an unknown kind.
    """
    if kind not in _FACTOR:
        raise ValueError(f"unknown collective {kind!r}; one of {KINDS}")
    return 0.0 if n <= 1 else _FACTOR[kind](n) * size_bytes


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program (per device, per execution).

    Attributes:
      kind: one of :data:`KINDS`.
      axes: the mesh axes its groups span, e.g. ``("model",)``; ``("?",)`` when they match no axes.
      group_size: devices per group (``n``).
      shapes: the result arrays, ``((dtype, dims), ...)`` — several for a combined (tuple) collective.
      size_bytes: ``S`` of the ring formula (for a reduce-scatter: the full operand, result × n).
      sent_bytes: bytes each device sends, :func:`ring_bytes`.
      name: the HLO instruction's name.
    """

    kind: str
    axes: tuple[str, ...]
    group_size: int
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    size_bytes: int
    sent_bytes: float
    name: str

    @property
    def axis(self) -> str:
        """The axes as one string (``"data"``, ``"data,model"``)."""
        return ",".join(self.axes)

    @property
    def dtypes(self) -> tuple[str, ...]:
        """Element types of its arrays, sorted and distinct (``("f32",)``)."""
        return tuple(sorted({dt for dt, _ in self.shapes}))

    def describe(self) -> str:
        """``"all-reduce over model (n=2): f32[16,8,8,64]"``; a tuple collective lists its first arrays."""
        arrays = [f"{dt}[{','.join(map(str, d))}]" for dt, d in self.shapes]
        shown = ", ".join(arrays[:2]) + (f", … ({len(arrays)} arrays)" if len(arrays) > 2 else "")
        return f"{self.kind} over {self.axis} (n={self.group_size}): {shown}"


def arrays_in(shape: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The arrays of an HLO shape string (a tuple shape has several): ``((dtype, dims), ...)``
    (:func:`course_lib.programs.arrays`, element types of :data:`DTYPE_BYTES` only)."""
    return tuple((dt, dims) for dt, dims in programs.arrays(shape) if dt in DTYPE_BYTES)


def collectives(hlo_text: str, mesh_axes: Mapping[str, int] | None = None) -> list[Collective]:
    """Every collective of a compiled program's HLO text (``Compiled.as_text()``), in program order, sized.

    The program is read by :func:`course_lib.programs.collective_ops` (every replica-group form, tuple and
    async collectives); this adds the ring formula's ``S`` and the bytes each device sends.

    Args:
      hlo_text: the per-device (partitioned) program.
      mesh_axes: the mesh's axis sizes in order, e.g. ``{"data": 4, "model": 2}`` (``dict(mesh.shape)``);
        None or ``{}`` for a single device.

    Raises:
      ValueError: a collective inside a ``while`` loop body (its count would be wrong), or replica groups
        over sub-axes.
    """
    mesh_axes = dict(mesh_axes or {})
    n_devices = math.prod(mesh_axes.values()) if mesh_axes else 1
    loops = programs.while_bodies(hlo_text)
    out = []
    for op in programs.collective_ops(hlo_text, mesh_axes or None):
        if op.computation in loops:
            raise ValueError(
                f"{op.op} {op.name} is inside the while loop {op.computation}; not counted"
            )
        n = op.group_size or n_devices
        size = op.nbytes * (n if op.op == "reduce-scatter" else 1)
        sent = op.bytes_sent
        if op.op == "collective-permute":
            pairs = _PAIRS.search(op.line)
            pairs = re.findall(r"\{(\d+),(\d+)\}", pairs.group(1)) if pairs else []
            seen = len(
                {int(d) for pair in pairs for d in pair}
            )  # without a mesh: the devices named
            sent = permute_bytes(op.nbytes, pairs, max(n_devices, seen)) if pairs else sent
        # a group of one device: named by the mesh's axis of size 1 (e.g. data on a 1 x 2 mesh)
        axes = op.axes or tuple(a for a, size in mesh_axes.items() if size == 1)[:1] or ("?",)
        out.append(Collective(op.op, axes, n, arrays_in(op.shape), int(size), sent, op.name))
    return out


_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def permute_bytes(size_bytes: float, pairs: Sequence[tuple], n_devices: int) -> float:
    """Mean bytes per device that a collective-permute of ``size_bytes`` per block sends: ``size_bytes`` ×
    the pairs whose source is not their target / ``n_devices``. A cyclic shift over every device gives
    ``size_bytes``; a shift that stops at the edge (``{0,1},{1,2},{2,3}`` on 4 devices) gives 3/4 of it.

    Args:
      size_bytes: bytes of one device's block.
      pairs: ``(source, target)`` device pairs (ints or digit strings), as the HLO's
        ``source_target_pairs`` lists them.
      n_devices: devices in the program.
    """
    senders = sum(1 for a, b in pairs if int(a) != int(b))
    return size_bytes * senders / n_devices if n_devices else 0.0


PARAMETERS, AGAIN, GRADIENTS, ACTIVATIONS = (
    "parameters gathered",
    "parameters gathered again",
    "gradients (+ loss)",
    "activations resharded",
)
"""What a data-parallel program's collective moves, as :func:`what_moves` names it."""


def what_moves(items: Sequence[Collective], shapes: Mapping) -> list[str]:
    """What each collective of a data-parallel step moves, read from its shapes alone (one label each):

    - :data:`PARAMETERS`: an all-gather whose result has a parameter's full shape, as many times as
      parameters have that shape; :data:`AGAIN` every later time (the backward pass gathering a kernel
      once more);
    - :data:`GRADIENTS`: a reduce-scatter, or an all-reduce whose arrays all have parameter shapes, in any
      order of their dimensions (XLA may hold a dense kernel's gradient transposed), or are the scalar loss;
    - :data:`ACTIVATIONS`: anything else (an all-to-all, or a gather of a batch-shaped array).

    Args:
      items: the program's collectives (:func:`collectives`), in program order.
      shapes: the parameters' shapes, ``{layer: {leaf: shape}}`` (:func:`param_shapes`).
    """
    leaves = [tuple(shape) for layer in shapes.values() for shape in layer.values()]
    full = set(leaves)
    left = {shape: leaves.count(shape) for shape in full}  # first gathers still to come, per shape
    transposed = {tuple(sorted(shape)) for shape in full}  # a gradient may come in another layout
    out = []
    for c in items:
        dims = [d for _, d in c.shapes]
        if c.kind == "all-gather" and len(dims) == 1 and dims[0] in full:
            out.append(PARAMETERS if left[dims[0]] else AGAIN)
            left[dims[0]] = max(left[dims[0]] - 1, 0)
        elif c.kind == "reduce-scatter" or (
            c.kind == "all-reduce" and all(tuple(sorted(d)) in transposed or d == () for d in dims)
        ):
            out.append(GRADIENTS)
        else:
            out.append(ACTIVATIONS)
    return out


def sent_by_axis(items: Sequence[Collective | Transfer]) -> dict[str, float]:
    """Bytes sent per device per step, summed per mesh axis (``{"data": …, "model": …}``)."""
    out: dict[str, float] = {}
    for c in items:
        out[c.axis] = out.get(c.axis, 0.0) + c.sent_bytes
    return out


def total_sent(items: Sequence[Collective | Transfer]) -> float:
    """Bytes each device sends per step, all collectives together."""
    return float(sum(c.sent_bytes for c in items))


BYTES_REL_TOL = 1e-12
"""Relative tolerance of :func:`same_bytes` for byte counts that are not whole numbers."""


def same_bytes(a: float, b: float) -> bool:
    """True when two byte counts (bytes sent per device, e.g. predicted and measured) are the same: exactly
    when both are whole numbers, else within a relative :data:`BYTES_REL_TOL`.

    A ring all-reduce over ``n`` devices sends ``2(n-1)/n`` of its array per device: a fraction of a byte on
    3 or 6 devices. The prediction adds those fractions one leaf at a time and the program one combined
    collective at a time, so the two sums can differ in the last bit (12806.666666666666 against
    12806.666666666668 on 6 devices). Whole counts (a power-of-two group) are added exactly by floats
    below 2**53: those must agree to the byte.
    """
    a, b = float(a), float(b)
    if a.is_integer() and b.is_integer():
        return a == b
    return math.isclose(a, b, rel_tol=BYTES_REL_TOL)


def same_by_axis(a: Mapping[str, float], b: Mapping[str, float]) -> bool:
    """True when two ``{axis: bytes}`` tables (:func:`sent_by_axis`) name the same axes and every axis's
    bytes are :func:`same_bytes`."""
    return set(a) == set(b) and all(same_bytes(a[k], b[k]) for k in a)


# ---- predictions from shapes --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One predicted collective: what moves, over which axis, how many bytes each device sends.

    Attributes:
      kind: one of :data:`KINDS`.
      axis: the mesh axis (``"data"`` or ``"model"``).
      group_size: devices per group.
      size_bytes: ``S`` of the ring formula.
      sent_bytes: :func:`ring_bytes` of it.
      what: what the array is (``"conv3 output (forward psum)"``).
    """

    kind: str
    axis: str
    group_size: int
    size_bytes: int
    sent_bytes: float
    what: str


def transfer(kind: str, axis: str, n: int, size_bytes: float, what: str) -> Transfer:
    """A :class:`Transfer` with its bytes sent computed by :func:`ring_bytes`."""
    return Transfer(kind, axis, n, int(size_bytes), ring_bytes(kind, size_bytes, n), what)


def _local(shape: tuple[int, ...], spec, sizes: Mapping[str, int]) -> int:
    """Elements one device holds of a leaf of ``shape`` laid out by PartitionSpec ``spec``."""
    n = math.prod(shape)
    for entry in tuple(spec):
        for axis in (entry,) if isinstance(entry, str) else (entry or ()):
            n //= sizes[axis]
    return n


def local_param_count(param_shapes: Mapping, param_specs: Mapping, sizes: Mapping[str, int]) -> int:
    """Parameters one device holds: ``param_shapes`` ``{layer: {leaf: shape}}`` laid out by ``param_specs``."""
    return sum(
        _local(tuple(shape), param_specs[layer][leaf], sizes)
        for layer, leaves in param_shapes.items()
        for leaf, shape in leaves.items()
    )


def predict_data_parallel(
    shapes, specs, *, n_devices, grad_bytes=4, loss_bytes=None, **_
) -> list[Transfer]:
    """B and D: one all-reduce of every gradient (``grad_bytes`` per value) and the loss (``loss_bytes``,
    default ``grad_bytes``) over all devices."""
    loss_bytes = grad_bytes if loss_bytes is None else loss_bytes
    size = local_param_count(shapes, specs, {}) * grad_bytes + loss_bytes
    return [transfer("all-reduce", "data", n_devices, size, "gradients + loss (combined)")]


def predict_fsdp(shapes, specs, *, n_devices, grad_bytes=4, loss_bytes=None, **_) -> list[Transfer]:
    """E: per sharded leaf an all-gather of the parameter (forward) and a reduce-scatter of its gradient
    (backward); the replicated leaves' gradients and the loss in one all-reduce. (Gathered once and kept:
    ZeRO-3's re-gather in the backward pass would add another all-gather per leaf.)"""
    loss_bytes = grad_bytes if loss_bytes is None else loss_bytes
    out, replicated = [], 0
    for layer, leaves in shapes.items():
        for leaf, shape in leaves.items():
            size = math.prod(shape) * grad_bytes
            if "data" not in tuple(specs[layer][leaf]):
                replicated += math.prod(shape)
                continue
            out.append(
                transfer("all-gather", "data", n_devices, size, f"{layer}/{leaf} parameters")
            )
            out.append(
                transfer("reduce-scatter", "data", n_devices, size, f"{layer}/{leaf} gradient")
            )
    size = replicated * grad_bytes + loss_bytes
    out.append(transfer("all-reduce", "data", n_devices, size, "replicated gradients + loss"))
    return out


def _activations(layout: str, cfg, b: int) -> list[tuple[str, int, str]]:
    """(kind, elements, what) of each model-axis collective of a tensor-parallel layout, per device."""
    s, (c1, c2, c3) = cfg.image_size, cfg.channels
    if layout == "gather":
        return [
            ("all-gather", b * (s // 2) ** 2 * c1, "pooled conv1 output (forward all_gather)"),
            (
                "reduce-scatter",
                b * (s // 2) ** 2 * c1,
                "its gradient (backward: the gather's transpose)",
            ),
            ("all-reduce", b * (s // 4) ** 2 * c3, "conv3 output (forward psum)"),
            ("all-reduce", b * cfg.num_classes, "dense2 output (forward psum)"),
            ("all-reduce", b * cfg.flat_features, "dense1 input gradient (backward)"),
        ]
    if layout == "pairs":
        return [
            ("all-reduce", b * (s // 2) ** 2 * c2, "conv2 output (forward psum)"),
            ("all-reduce", b * cfg.hidden, "dense1 output (forward psum)"),
            ("all-reduce", b * (s // 4) ** 2 * c2, "conv3 input gradient (backward)"),
        ]
    if layout == "article":
        return [("all-gather", b * s * s * c1, "conv1 output (forward all_gather)")]
    raise ValueError(f"unknown tensor-parallel layout {layout!r}; one of gather, pairs, article")


def predict_tensor_parallel(
    shapes,
    specs,
    *,
    layout,
    cfg,
    global_batch,
    mesh_shape,
    act_bytes=4,
    grad_bytes=4,
    loss_bytes=None,
    **_,
) -> list[Transfer]:
    """C, its pairs variant and C′: the layout's activation collectives over ``model`` and one all-reduce
    of this device's gradients (and the loss) over ``data``."""
    n_data, n_model = mesh_shape
    out = [
        transfer(kind, "model", n_model, elements * act_bytes, what)
        for kind, elements, what in _activations(layout, cfg, global_batch // n_data)
    ]
    local = local_param_count(shapes, specs, {"data": n_data, "model": n_model})
    size = local * grad_bytes + (grad_bytes if loss_bytes is None else loss_bytes)
    out.append(transfer("all-reduce", "data", n_data, size, "local gradients + loss"))
    return out


def param_shapes(cfg) -> dict[str, dict[str, tuple[int, ...]]]:
    """The CNN's parameter shapes from its config (no arrays made): ``{layer: {"kernel": …, "bias": …}}``."""
    c1, c2, c3 = cfg.channels
    return {
        "conv1": {"kernel": (3, 3, cfg.in_channels, c1), "bias": (c1,)},
        "conv2": {"kernel": (3, 3, c1, c2), "bias": (c2,)},
        "conv3": {"kernel": (3, 3, c2, c3), "bias": (c3,)},
        "dense1": {"kernel": (cfg.flat_features, cfg.hidden), "bias": (cfg.hidden,)},
        "dense2": {"kernel": (cfg.hidden, cfg.num_classes), "bias": (cfg.num_classes,)},
    }

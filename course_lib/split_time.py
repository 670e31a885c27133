"""Time beside bytes for the transformer splits of ``notebooks/10_transformers.ipynb``: FLOPs per byte sent,
the degree at which a split becomes communication-bound, and the overlap of a ring matmul.

A **model**, not a measurement: FLOPs at the chip's peak and each collective at its link's bandwidth plus
an assumed latency (:func:`course_lib.costs.step_time`, :data:`course_lib.chips.FABRICS`); nothing here is
timed on a chip.

- :func:`split_cost`: per device, the matmul FLOPs (counted analytically, 2 per multiply-add, every score of
  the causal attention included: the course's attention computes the masked ones too) and the collectives
  (:class:`course_lib.comms.Transfer`) of one split — ``"tp"``, ``"sp"`` (one block's forward), ``"ring"``,
  ``"ulysses"`` (attention alone, as the lesson compiles it), ``"dp"``, ``"zero3"`` (a training step of all
  layers: 3 × the forward FLOPs, 4 × for ZeRO-3, whose checkpoint recomputes the forward).
- :func:`fabric_ratio`: the FLOPs a chip does while one byte crosses its link (peak ÷ bandwidth, both
  directions on a ring): a split whose FLOPs per byte sent fall below it is communication-bound.
- :func:`comm_bound_degree`: the smallest number of devices on the axis at which :func:`~course_lib.costs.
  step_time` says the collectives outlast the compute; :func:`tp_critical_degree` the same for tensor
  parallelism in closed form, latency left out; :func:`bound_degrees` and :func:`degree_table` tabulate
  them for section 6.
- :func:`ring_matmul_plan`: the overlap a collective matmul offers (how many sends, each beside a matmul
  chunk of how many FLOPs, the time of each on a fabric); :func:`async_windows` reads what XLA:TPU
  scheduled between each ``-start`` and its ``-done`` in a compiled program's text, :func:`window_counts`
  counts it (pairs, pairs with a matmul under them, transfers in flight at once, matmuls that wait).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from . import costs
from .comms import Transfer, transfer

KINDS = ("tp", "sp", "ring", "ulysses", "dp", "zero3")
"""The splits :func:`split_cost` knows (``notebooks/10_transformers.ipynb``, sections 1–4)."""
AXIS = {
    "tp": "model",
    "sp": "model",
    "ring": "context",
    "ulysses": "context",
    "dp": "data",
    "zero3": "data",
}
"""The mesh axis each split runs its collectives over."""


@dataclasses.dataclass(frozen=True)
class SplitCost:
    """What one device computes and sends for a split.

    Attributes:
      kind: one of :data:`KINDS`.
      n: devices on the axis.
      flops: matmul FLOPs per device (2 per multiply-add).
      transfers: the collectives, each a :class:`course_lib.comms.Transfer` (``sent_bytes`` per device).
    """

    kind: str
    n: int
    flops: float
    transfers: tuple[Transfer, ...]

    @property
    def sent_bytes(self) -> float:
        """Bytes each device sends (ring costs, :func:`course_lib.comms.ring_bytes`)."""
        return sum(t.sent_bytes for t in self.transfers)

    @property
    def flops_per_byte(self) -> float:
        """FLOPs per byte sent; ``inf`` when nothing is sent (one device)."""
        return self.flops / self.sent_bytes if self.sent_bytes else math.inf


def block_flops(cfg: Any, tokens_batch: int) -> float:
    """Matmul FLOPs of one transformer block's forward on one device holding all of it: ``T·(8D² + 4SD +
    4DF)`` with ``T = batch·S`` tokens — q, k, v and the output projection ``8TD²``, the scores and their
    product with v ``4·batch·S²·D`` (every score, the masked ones too), the MLP ``4TDF``."""
    s, d, f = cfg.seq_len, cfg.d_model, cfg.d_ff
    t = tokens_batch * s
    return float(t * (8 * d * d + 4 * s * d + 4 * d * f))


def block_param_bytes(cfg: Any, itemsize: int) -> float:
    """Bytes of the stacked block parameters of :mod:`course_lib.transformer` (every layer):
    :func:`course_lib.splits.block_bytes` of its ``params["blocks"]`` at ``itemsize`` bytes a value."""
    d, f = cfg.d_model, cfg.d_ff
    per_layer = 4 * d * d + 4 * d + 2 * d * f + f + d  # q, k, v, o kernels; 2 LayerNorms; the MLP
    return float(cfg.n_layers * per_layer * itemsize)


def _check(kind: str, cfg: Any, batch: int, n: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: one of {KINDS}")
    if n < 1 or batch < 1:
        raise ValueError(f"n={n}, batch={batch}: both must be at least 1")
    dims = {"tp": ("n_heads", "d_ff"), "sp": ("n_heads", "d_ff", "seq_len"), "ring": ("seq_len",),
            "ulysses": ("n_heads", "seq_len"), "dp": (), "zero3": ("d_model",)}  # fmt: skip
    for dim in dims[kind]:
        if getattr(cfg, dim) % n:
            raise ValueError(
                f"{kind} on n={n} devices needs {dim}={getattr(cfg, dim)} divisible by n"
            )
    if kind in ("dp", "zero3") and batch % n:
        raise ValueError(f"{kind}: the global batch {batch} must divide by n={n}")


def split_cost(kind: str, cfg: Any, batch: int, n: int, itemsize: int = 2) -> SplitCost:
    """FLOPs and collectives per device of split ``kind`` on ``n`` devices.

    Args:
      kind: ``"tp"``/``"sp"``: one block's forward, the whole ``[batch, S, D]`` activation (two all-reduces;
        SP: two all-gathers and two reduce-scatters). ``"ring"``/``"ulysses"``: causal attention alone on
        ``[batch, S, H, Dh]`` q, k, v (ring: ``2(n−1)`` K/V blocks passed on; Ulysses: four all-to-alls of a
        block). ``"dp"``/``"zero3"``: a training step of all layers on a global ``batch`` (the gradients'
        all-reduce; ZeRO-3: gathers forward and backward, a reduce-scatter of the gradients).
      cfg: a :class:`course_lib.transformer.TransformerConfig`.
      batch: sequences (the whole batch for every kind; dp and zero3 split it over ``n``).
      n: devices on the axis.
      itemsize: bytes per value sent (2 bfloat16, 4 float32).

    Raises:
      ValueError: an unknown kind, or a dimension the split needs divisible by ``n`` that is not.
    """
    _check(kind, cfg, batch, n)
    axis, s, d = AXIS[kind], cfg.seq_len, cfg.d_model
    act = batch * s * d * itemsize  # one [batch, S, D] activation
    blk = batch * (s // n) * d * itemsize  # one sequence block of q, k or v
    if kind in ("tp", "sp"):
        flops = block_flops(cfg, batch) / n
        if kind == "tp":
            moves = [transfer("all-reduce", axis, n, act, "sub-layer output (g)")] * 2
        else:
            moves = [transfer("all-gather", axis, n, act, "sub-layer input"),
                     transfer("reduce-scatter", axis, n, act, "sub-layer output")] * 2  # fmt: skip
    elif kind == "ring":
        flops = (
            n * 4.0 * batch * (s // n) ** 2 * d
        )  # n steps: scores and weights·v of one block pair
        moves = [transfer("collective-permute", axis, n, blk, "K or V block")] * (2 * (n - 1))
    elif kind == "ulysses":
        flops = 4.0 * batch * s * s * d / n
        moves = [transfer("all-to-all", axis, n, blk, "q, k, v in; output back")] * 4
    else:
        fwd = cfg.n_layers * block_flops(cfg, batch // n)
        params = block_param_bytes(cfg, itemsize)
        if kind == "dp":
            flops, moves = 3 * fwd, [transfer("all-reduce", axis, n, params, "block gradients")]
        else:
            flops = 4 * fwd  # nothing_saveable: the backward pass runs the forward again
            moves = [transfer("all-gather", axis, n, params, "block parameters")] * 2 + [
                transfer("reduce-scatter", axis, n, params, "block gradients")
            ]
    return SplitCost(kind, n, float(flops), tuple(m for m in moves if n > 1))


def fabric_ratio(
    fabric: costs.Fabric, precision: str = "bfloat16", *, both_ways: bool = True
) -> float:
    """FLOPs the chip does while one byte crosses the link: peak FLOP/s ÷ link bandwidth (× 2 on a
    bidirectional ring when ``both_ways``: ring collectives send half each way; a ``ppermute`` to one
    neighbour uses one direction: ``both_ways=False``).

    Raises:
      ValueError: the chip has no rate for ``precision``.
    """
    peak = costs.rate(fabric.chip, precision)
    if peak is None:
        raise ValueError(f"{fabric.chip.name} has no peak for precision={precision!r}")
    ways = 2 if both_ways and fabric.link.topology == "ring" else 1
    return peak / (fabric.link.bytes_per_s * ways)


def timing(cost: SplitCost, fabric: costs.Fabric, precision: str = "bfloat16") -> dict[str, Any]:
    """:func:`course_lib.costs.step_time` of ``cost`` on ``fabric`` (HBM traffic left out: the matmuls'
    FLOPs against the collectives)."""
    return costs.step_time(cost.flops, None, cost.transfers, fabric, precision)


def valid_degrees(kind: str, cfg: Any, batch: int, max_n: int = 1024) -> list[int]:
    """The device counts ``2 … max_n`` split ``kind`` accepts for ``cfg`` (:func:`split_cost` raises no
    error), in increasing order."""
    out = []
    for n in range(2, max_n + 1):
        try:
            _check(kind, cfg, batch, n)
        except ValueError:
            continue
        out.append(n)
    return out


def comm_bound_degree(
    kind: str, cfg: Any, batch: int, fabric: costs.Fabric, *, itemsize: int = 2,
    precision: str = "bfloat16", max_n: int = 1024,
) -> int | None:  # fmt: skip
    """The smallest device count on the axis at which split ``kind`` is communication-bound on ``fabric``:
    :func:`timing`'s ``comm_bound`` (its collectives, latency included, take longer than its matmuls at
    the peak). Only the counts of :func:`valid_degrees` are tried.

    Returns:
      That count, or None when no count up to ``max_n`` is communication-bound.
    """
    for n in valid_degrees(kind, cfg, batch, max_n):
        if timing(split_cost(kind, cfg, batch, n, itemsize), fabric, precision)["comm_bound"]:
            return n
    return None


def tp_critical_degree(cfg: Any, fabric: costs.Fabric, precision: str = "bfloat16") -> float:
    """The tensor-parallel degree at which one block's forward all-reduces (bfloat16, ring, latency left
    out) take as long as its matmuls: ``n* = 1 + (D + (S + F)/2) · W / C`` with ``C`` the peak and ``W``
    the link bandwidth (both ways on a ring). The batch cancels. Beyond ``n*`` TP is communication-bound.
    """
    return 1.0 + (cfg.d_model + (cfg.seq_len + cfg.d_ff) / 2) / fabric_ratio(fabric, precision)


SPLITS_BOUND = ("tp", "sp", "ring", "ulysses")
"""The splits whose communication-bound degree lesson 10 tabulates (one block's forward, or attention)."""


def bound_degrees(
    models: dict[str, tuple[Any, int]], fabrics: dict[str, costs.Fabric],
    kinds: tuple[str, ...] = SPLITS_BOUND,
) -> dict[tuple[str, str, str], int | None]:  # fmt: skip
    """:func:`comm_bound_degree` of each split on each model and fabric.

    Args:
      models: label → ``(TransformerConfig, batch)`` (sequences).
      fabrics: label → fabric (:data:`course_lib.costs.FABRICS`' values).
      kinds: the splits (:data:`KINDS`).

    Returns:
      ``{(model label, fabric label, kind): the smallest bound degree, or None when none up to 1024}``.

    Raises:
      ValueError: an unknown kind (from :func:`split_cost`).
    """
    return {
        (label, fname, kind): comm_bound_degree(kind, cfg, batch, fab)
        for label, (cfg, batch) in models.items()
        for fname, fab in fabrics.items()
        for kind in kinds
    }


def degree_table(
    models: dict[str, tuple[Any, int]], fabrics: dict[str, costs.Fabric],
    degrees: dict[tuple[str, str, str], int | None], kinds: tuple[str, ...] = SPLITS_BOUND,
) -> Any:  # fmt: skip
    """:func:`bound_degrees`' result as a table (a ``pandas.DataFrame``), one row per model and fabric.

    Columns: the model's ``D``, ``S``, ``F``, ``H``; each kind's first bound degree, written
    ``"beyond H"`` for TP and SP when TP's ``n*`` (:func:`tp_critical_degree`, latency left out) lies above
    the largest degree they accept (H divides by it), ``"none"`` when no degree up to 1024 is bound; and
    ``n* (TP)``, rounded to 2 places. Used by ``notebooks/10_transformers.ipynb``, section 6.
    """
    import pandas as pd

    rows = []
    for label, (cfg, batch) in models.items():
        for fname, fab in fabrics.items():
            star = tp_critical_degree(cfg, fab)
            top = max(valid_degrees("tp", cfg, batch))
            row = {"model": label, "fabric": fname, "D": cfg.d_model, "S": cfg.seq_len,
                   "F": cfg.d_ff, "H": cfg.n_heads}  # fmt: skip
            for kind in kinds:
                d = degrees[label, fname, kind]
                beyond = kind in ("tp", "sp") and star > top
                row[kind] = d if d is not None else ("beyond H" if beyond else "none")
            row["n* (TP)"] = round(star, 2)
            rows.append(row)
    return pd.DataFrame(rows).set_index(["model", "fabric"])


# ---- the overlap of a collective matmul --------------------------------------------------------------------


def ring_matmul_plan(
    variant: str, m: int, k: int, n_cols: int, n: int, fabric: costs.Fabric, *,
    itemsize: int = 2, precision: str = "bfloat16",
) -> dict[str, Any]:  # fmt: skip
    """The schedule a ring matmul offers a compiler, and its time on ``fabric`` (a model).

    Args:
      variant: ``"allgather"`` — ``all_gather(x) @ w``, x ``[m, k]`` split by rows, w ``[k, n_cols]`` this
        device's columns: ``n`` chunks ``[m/n, k] @ [k, n_cols]``, ``n − 1`` sends of an ``[m/n, k]`` block,
        each beside a chunk that does not need it; ``"reducescatter"`` — ``psum_scatter(x @ w)``, x
        ``[m, k]`` and w ``[k, n_cols]`` this device's slices of the contraction: ``n`` chunks of the same
        shape, ``n − 1`` sends of an ``[m/n, n_cols]`` partial sum; ``"bidirectional"`` — the all-gather
        variant with each block cut in two halves sent opposite ways round the ring: ``2(n − 1)`` sends of
        half a block, two at a time, beside two chunks half as big.
      m, k, n_cols: the shapes above.
      n: devices on the ring.
      fabric: the chip and its link (a ``"switch"`` link carries a step's two halves one after the other:
        they share the device's injection bandwidth).
      itemsize: bytes per element sent: 2 for bfloat16 blocks (XLA:TPU sends the bfloat16 copy of a float32
        block it multiplies at the default precision); 4 for the reduce-scatter ring's partial sums, which
        XLA:TPU accumulates and sends in float32 (the v5e reference, ``notebooks/10_transformers.ipynb``).
      precision: the peak the matmuls run at (:func:`course_lib.costs.rate`).

    Returns:
      ``{"permutes", "steps", "chunk_flops" (one matmul chunk), "chunk_s", "step_s" (a step's matmuls),
      "permute_bytes", "permute_s", "hidden" (a step's sends take no longer than its matmuls),
      "overlap_s", "no_overlap_s"}``; per device, seconds at the bfloat16 peak, α included.

    Raises:
      ValueError: an unknown variant, ``m`` not divisible by ``n`` (by ``2n`` for the bidirectional one),
        or no peak for ``precision``.
    """
    if variant not in ("allgather", "reducescatter", "bidirectional"):
        raise ValueError(f"variant={variant!r}: 'allgather', 'reducescatter' or 'bidirectional'")
    halves = 2 if variant == "bidirectional" else 1
    if m % (n * halves):
        raise ValueError(f"m={m} must divide by {n * halves} for the {variant} ring on {n} devices")
    rows = m // n
    chunk_flops = 2.0 * rows * k * n_cols / halves  # one send's matmul
    if variant == "reducescatter":
        permute_bytes = rows * n_cols * itemsize
    else:
        permute_bytes = rows * k * itemsize / halves
    peak = costs.rate(fabric.chip, precision)
    if peak is None:
        raise ValueError(f"{fabric.chip.name} has no peak for precision={precision!r}")
    link = fabric.link
    # both halves leave at once: on a ring each has its own direction; through a switch they share the
    # device's injection bandwidth
    shared = halves if link.topology == "switch" else 1
    permute_s = costs.collective_time("collective-permute", n, shared * permute_bytes, link)
    chunk_s = chunk_flops / peak
    steps = n - 1  # a bidirectional step sends both halves at once, one each way
    step_s = halves * chunk_s  # the matmuls of one step
    return {
        "permutes": halves * steps, "steps": steps, "chunk_flops": chunk_flops, "chunk_s": chunk_s,
        "step_s": step_s, "permute_bytes": permute_bytes, "permute_s": permute_s,
        "hidden": permute_s <= step_s,
        "overlap_s": step_s + steps * max(step_s, permute_s),
        "no_overlap_s": step_s + steps * (step_s + permute_s),
    }  # fmt: skip


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\((.*)$")


def _matmul_computations(hlo_text: str) -> set[str]:
    """Names of the computations that hold a ``convolution`` or ``dot`` (XLA:TPU's matmul fusions)."""
    from .programs import _computations

    return {
        name
        for name, lines in _computations(hlo_text)
        if any(re.search(r"\s(convolution|dot)\(", line) for line in lines)
    }


def async_windows(hlo_text: str) -> list[dict[str, Any]]:
    """Each asynchronous collective of a scheduled program (``*-start`` … ``*-done``, XLA:TPU and XLA:GPU;
    XLA:CPU writes none) with what runs between the two in its computation's instruction order.

    Returns:
      ``[{"computation", "start", "op" (e.g. "collective-permute"), "between" (instruction names),
      "matmuls" (how many of them are matmuls: a fusion calling a convolution or dot, or one itself),
      "done_feeds_matmul" (a matmul reads the ``-done``'s result directly: it had to wait for the
      transfer)}]``, in program order; ``[]`` for a program with no asynchronous collective.
    """
    from .programs import _computations

    with_matmul, out = _matmul_computations(hlo_text), []
    for comp, lines in _computations(hlo_text):
        parsed = [m.groups() for m in map(_INSTR.match, lines) if m]
        for i, (name, opcode, _) in enumerate(parsed):
            if not opcode.endswith("-start") or opcode in ("copy-start",):
                continue
            between, matmuls, done = [], 0, None
            for other, op2, rest2 in parsed[i + 1 :]:
                if op2.endswith("-done") and re.match(rf"%?{re.escape(name)}\b", rest2.strip()):
                    done = other
                    break
                between.append(other)
                matmuls += _is_matmul(op2, rest2, with_matmul)
            feeds = done is not None and any(
                _is_matmul(op2, rest2, with_matmul)
                and re.search(rf"[(,]\s*%?{re.escape(done)}[,)]", "(" + rest2.split(")")[0] + ")")
                for _, op2, rest2 in parsed[i + 1 :]
            )
            op = opcode[: -len("-start")]
            out.append(dict(computation=comp, start=name, op=op, between=between, matmuls=matmuls,
                            done_feeds_matmul=feeds))  # fmt: skip
    return out


def _is_matmul(opcode: str, rest: str, with_matmul: set[str]) -> bool:
    called = re.search(r"calls=%?([\w.\-]+)", rest)
    return opcode in ("convolution", "dot") or bool(called and called.group(1) in with_matmul)


def window_counts(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """What :func:`async_windows` found, counted: ``{"windows"`` (start/done pairs), ``"overlapped"`` (pairs
    with at least one matmul between start and done), ``"matmuls"`` (per pair, in program order),
    ``"in_flight"`` (the most transfers started and not yet done at one point of the program: 2 for a
    ring that sends both ways at once), ``"waiting"`` (pairs with no matmul between whose result a matmul
    reads: a matmul that waits for its transfer)``}``."""
    in_flight = [1 + sum(w["start"] in o["between"] for o in windows) for w in windows]
    return {
        "windows": len(windows),
        "overlapped": sum(w["matmuls"] > 0 for w in windows),
        "matmuls": [w["matmuls"] for w in windows],
        "in_flight": max(in_flight, default=0),
        "waiting": sum(w["matmuls"] == 0 and w["done_feeds_matmul"] for w in windows),
    }

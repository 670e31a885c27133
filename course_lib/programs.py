"""Reading what JAX and XLA made of a program, without running it: the equations of a jaxpr, the
collectives of a traced or a compiled program with the mesh axes they communicate over and their sizes,
and the programs compiled while a block of code runs.

Taught in ``notebooks/04_pmap.ipynb`` (a traced program's collectives), ``notebooks/05_sharding.ipynb``
(compiled collectives and their mesh axes; one compile per input placement) and
``notebooks/06_shard_map.ipynb`` (a jaxpr read line by line; collectives with their groups), and
``notebooks/02_jit.ipynb`` (the kernels a compiled program launches; compiles counted); the lab
sizes its communication with :func:`collective_ops`, and the exercise checkers use the same functions.

A compiled program (``jax.jit(f).lower(...).compile().as_text()``) writes each collective's device groups
in one of four forms: ``replica_groups=mesh['data'=4,'model'=2] {'data'}`` (a mesh of its own — axes of
size 1 dropped and sometimes renamed ``axis_0`` … — then the axes grouped), ``replica_groups=[4,2]<=[8]``
or ``[2,4]<=[4,2]T(1,0)`` (an iota: ``arange(8)`` reshaped, transposed, and its rows are the groups),
``replica_groups={{0,1},{2,3}}`` (listed; ``{}`` is one group of every device), or
``source_target_pairs={{0,1},{1,2}}`` (a permute). Device numbers are positions in the mesh's device
order; the functions here turn each group back into the axes of *your* mesh along which its devices differ.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from .kernels import hlo_kernels, hlo_memory_moves  # noqa: F401  (re-exported: lesson 02)

HLO_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
"""Collective instructions of compiled HLO (an async ``-start``/``-done`` pair counts once)."""

JAXPR_COLLECTIVES = ("psum", "pmax", "pmin", "all_gather", "all_to_all", "ppermute", "psum_scatter")
"""Collective primitives of a jaxpr (``lax.pmean`` traces to ``psum`` and a division)."""

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_ITEMSIZE.update({"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16})

_INSTR = re.compile(
    r"(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s(?P<op>"
    + "|".join(HLO_COLLECTIVES)
    + r")(?P<start>-start)?\("
)
_ANY_COLLECTIVE = re.compile("|".join(re.escape(op) for op in HLO_COLLECTIVES))
"""A cheap first test of a line (most lines of a program hold no collective) before :data:`_INSTR`."""
_DONE = re.compile(r"=\s*(?P<shape>.+?)\s[\w\-]+-done\([^%]*%(?P<start>[\w.\-]+)\)")
_UPDATE = re.compile(r"%?(?P<name>[\w.\-]+)\s*=\s*.+?\s[\w\-]+-update\([^%]*%(?P<start>[\w.\-]+)\)")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LIST = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_WHILE = re.compile(r"\bwhile\(.*?\bbody=%?([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLED = re.compile(
    r"\b(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
    r"|\bbranch_computations=\{([^}]*)\}"
)
_ASYNC_CALL = re.compile(r"\basync-start\(.*?\bcalls=%?([\w.\-]+)")
# XLA:TPU's asynchronous collective fusions: one collective written in every fusion of its chain (the
# start, its continuations, the done), each copy tagged with the chain's ``chain_id``
_CHAIN = re.compile(r'\bchain_id="(\d+)"')
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s")


# --- jaxprs ----------------------------------------------------------------------------------------------


def _sub_jaxprs(eqn) -> Iterator:
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if hasattr(item, "eqns") or hasattr(getattr(item, "jaxpr", None), "eqns"):
                yield item


def _walk(jaxpr, times: int = 1, in_loop: bool = False) -> Iterator[tuple[Any, int, bool]]:
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn, times, in_loop
        name = eqn.primitive.name
        reps = times * int(eqn.params.get("length", 1)) if name == "scan" else times
        for sub in _sub_jaxprs(eqn):
            yield from _walk(sub, reps, in_loop or name in ("scan", "while"))


def jaxpr_equations(jaxpr: Any, times: int = 1) -> Iterator[tuple[Any, int]]:
    """Every equation of ``jaxpr`` and of the jaxprs nested in its equations, in program order.

    Args:
      jaxpr: a ``jax.make_jaxpr(f)(...)`` result (``ClosedJaxpr``) or a ``Jaxpr``.
      times: how many times ``jaxpr`` runs (the recursion multiplies by each ``scan``'s ``length``; a
        ``while_loop`` body counts once, its trip count is not in the program).

    Yields:
      ``(equation, times_run)``: ``equation.primitive.name``, ``.params``, ``.invars``/``.outvars`` (their
      ``.aval`` has the shape, dtype and, inside ``shard_map``, the vma).
    """
    for eqn, reps, _ in _walk(jaxpr, times):
        yield eqn, reps


def jaxpr_collectives(closed_jaxpr: Any) -> list[tuple[str, int, bool]]:
    """The collectives of a traced program (``jax.make_jaxpr(f)(*args)``), nested programs included.

    Returns:
      ``[(primitive, n_operands, in_loop)]``: the primitive from :data:`JAXPR_COLLECTIVES`, how many arrays
      it reduces or moves at once, and whether it sits inside a ``lax.scan`` / ``while_loop`` /
      ``fori_loop`` body (then it runs once per iteration).
    """
    return [
        (eqn.primitive.name, len(eqn.invars), in_loop)
        for eqn, _, in_loop in _walk(closed_jaxpr)
        if eqn.primitive.name in JAXPR_COLLECTIVES
    ]


# --- compiled programs -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction of a compiled program.

    Attributes:
      op: one of :data:`HLO_COLLECTIVES` (``"all-reduce"``, ``"all-gather"``, …).
      shape: its result type as the HLO prints it, e.g. ``"f32[8,16]{1,0}"``, or a tuple ``"(f32[2]{0}, …)"``
        when XLA combined several collectives into one (for an async pair: the ``-done``'s result).
      axes: the mesh axes its device groups span, in mesh order, e.g. ``("model",)``; ``()`` for groups of one
        device; None when the groups are device numbers and no mesh was given to name them.
      group_size: devices per group (0 when unknown).
      nbytes: bytes of its result on one device (summed over a tuple).
      name: the instruction's name, e.g. ``"all-reduce.7"`` (profiler events carry it).
      line: the instruction as printed.
      computation: the HLO computation it sits in (``""`` for a bare instruction); a collective in one of
        :func:`while_bodies` runs once per loop iteration.
      runs: how many times it runs when the program runs once: the product of the ``known_trip_count``
        XLA wrote on each ``while`` loop around it (:func:`computation_runs`); 1 outside loops; None when
        a loop around it has no known trip count (XLA:TPU writes none).
      in_loop: it sits in a ``while`` loop (:func:`loop_computations`), whether or not the count is known.
      asynchronous: issued as an asynchronous pair (``all-reduce-start`` … ``all-reduce-done``, or inside
        a computation an ``async-start`` calls, or an XLA:TPU asynchronous collective fusion): other work
        may run between its start and its end.
    """

    op: str
    shape: str
    axes: tuple[str, ...] | None
    group_size: int
    nbytes: int
    name: str
    line: str
    computation: str = ""
    runs: int | None = 1
    in_loop: bool = False
    asynchronous: bool = False

    @property
    def bytes_sent(self) -> float:
        """Bytes one device sends for this collective with ring algorithms (a model, not a measurement):
        all-reduce 2(n−1)/n·S, all-gather (n−1)/n·S of the gathered result S, reduce-scatter (n−1)/n of the
        full operand (n × its result), all-to-all (n−1)/n·S, collective-permute S; 0 for a group of one."""
        n = self.group_size
        if n <= 1:
            return 0.0
        factor = {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": n - 1}.get(self.op, (n - 1) / n)
        return self.nbytes * (1.0 if self.op == "collective-permute" else factor)


def arrays(shape: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The arrays of an HLO type, ``((dtype, dims), ...)``: ``"(f32[2]{0}, bf16[3,4])"`` gives
    ``(("f32", (2,)), ("bf16", (3, 4)))``; a scalar ``f32[]`` has ``dims == ()``."""
    return tuple(
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape)
    )


def nbytes(shape: str) -> int:
    """Bytes of an HLO type such as ``"f32[16,128]{1,0}"`` or a tuple ``"(f32[2], bf16[3,4])"``."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape):
        size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += _ITEMSIZE.get(dtype, 4) * size
    return total


def traced_shapes(hlo_text: str, op: str, jax_name: str) -> list[tuple[int, ...]]:
    """Dims of every ``op`` instruction (e.g. ``"multiply"``) whose metadata names the JAX operation
    ``jax_name`` (its ``op_name`` ends ``/jax_name``), in program order: what a traced line of the model
    became in a compiled program. ``transformer.layer_norm``'s ``jnp.square(x - mean)`` is a ``multiply``
    named ``…/square``: its dims are the LayerNorm input's a device holds (``notebooks/10_transformers.ipynb``).
    Empty if the compiler dropped the metadata or rewrote the operation."""
    pattern = rf'= \w+\[([\d,]*)\]\S* {re.escape(op)}\([^)]*\),[^\n]*?op_name="[^"]*/{re.escape(jax_name)}"'
    return [tuple(_ints(dims)) for dims in re.findall(pattern, hlo_text)]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _groups(line: str) -> list[list[int]] | None:
    """The device groups of one HLO instruction, as positions in the device order; None if not written."""
    m = _MESH.search(line)
    if m:
        dims = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [d[0] for d in dims], [int(d[1]) for d in dims]
        if re.search(r"[:(]", m.group(2)):
            raise ValueError(f"replica groups over sub-axes are not supported: {m.group(0)!r}")
        chosen = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(2))]
        rest = [i for i in range(len(sizes)) if i not in chosen]
        ids = np.arange(int(np.prod(sizes))).reshape(sizes).transpose(rest + chosen)
        return ids.reshape(-1, int(np.prod([sizes[i] for i in chosen]))).tolist()
    m = _IOTA.search(line)
    if m:
        base = _ints(m.group(2))
        ids = np.arange(int(np.prod(base))).reshape(base)
        if m.group(3):
            ids = ids.transpose(_ints(m.group(3)))
        return ids.reshape(_ints(m.group(1))).tolist()
    m = _LIST.search(line)
    if m:  # "{}" (no groups listed) means one group of every device
        return [_ints(g) for g in re.findall(r"\{([\d,]*)\}", m.group(1))] or None
    m = _PAIRS.search(line)
    if m:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
    return None


def _axes(groups: list[list[int]], mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes (in mesh order) along which the devices of some group differ."""
    names, sizes = list(mesh_shape), tuple(mesh_shape.values())
    coords = np.stack(np.unravel_index(np.arange(int(np.prod(sizes))), sizes), axis=1)
    varying = {names[i] for g in groups for i in range(len(names)) if len(set(coords[g, i])) > 1}
    return tuple(a for a in names if a in varying)


def _mesh_shape(mesh: Any) -> dict[str, int] | None:
    if mesh is None:
        return None
    return dict(mesh.shape) if hasattr(mesh, "axis_names") else dict(mesh)


def _done_shapes(hlo_text: str) -> dict[str, str]:
    """``{start instruction: result type of its -done}``; a ``-done`` may follow ``-update`` steps."""
    updates = {m.group("name"): m.group("start") for m in _UPDATE.finditer(hlo_text)}
    out = {}
    for m in _DONE.finditer(hlo_text):
        start = m.group("start")
        while start in updates:
            start = updates[start]
        out[start] = m.group("shape").strip()
    return out


def collective_ops(hlo_text: str, mesh: Any = None) -> list[CollectiveOp]:
    """The collectives of a compiled program, in the order the HLO text lists them.

    Args:
      hlo_text: ``compiled.as_text()`` (``compiled = jax.jit(f).lower(*args).compile()``).
      mesh: the mesh the program runs on (a ``Mesh`` or its ``dict(mesh.shape)``), to name the axes.

    Returns:
      One :class:`CollectiveOp` per instruction; an asynchronous ``-start``/``-done`` pair counts once,
      and so does an XLA:TPU asynchronous collective fusion (the copies of one collective that share a
      ``chain_id`` across its start, continuation and done fusions: the first, asynchronous).
      Groups not written out (every device) span every axis of size > 1.

    Raises:
      ValueError: replica groups over sub-axes of the mesh (``{'data':(1)2}``), which it cannot name.
    """
    shape_of_mesh = _mesh_shape(mesh)
    runs, looped = computation_runs(hlo_text), loop_computations(hlo_text)
    done = _done_shapes(hlo_text)
    wrapped = set(_ASYNC_CALL.findall(hlo_text))
    ops, computation, chains = [], "", set()
    for line in hlo_text.splitlines():
        if line[:1] not in ("", " ", "\t") and line.rstrip().endswith("{"):
            computation = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            continue
        m = _INSTR.search(line) if _ANY_COLLECTIVE.search(line) else None
        if not m:
            continue
        chain = _CHAIN.search(line)
        if chain:
            if (m.group("op"), chain.group(1)) in chains:
                continue  # a later fusion of a chain already counted
            chains.add((m.group("op"), chain.group(1)))
        groups = _groups(line)
        if shape_of_mesh is None:
            axes = None
        elif groups is None:
            axes = tuple(a for a, size in shape_of_mesh.items() if size > 1)
        else:
            axes = _axes(groups, shape_of_mesh)
        if groups is not None:
            size = (
                len(groups[0]) if groups else 1
            )  # a ppermute with no pairs (one stage) sends nothing
        elif axes is not None:
            size = int(np.prod([shape_of_mesh[a] for a in axes]))
        else:
            size = 0
        shape = done.get(m.group("name"), m.group("shape")).strip() if m.group("start") else None
        shape = shape or m.group("shape").strip()
        ops.append(
            CollectiveOp(
                m.group("op"),
                shape,
                axes,
                size,
                nbytes(shape),
                m.group("name"),
                line.strip(),
                computation,
                runs.get(computation, 1),
                computation in looped,
                bool(m.group("start")) or computation in wrapped or bool(chain),
            )
        )
    return ops


def _computations(hlo_text: str) -> list[tuple[str, list[str]]]:
    """``[(name, instruction lines)]`` of each computation of an HLO module, in text order."""
    out: list[tuple[str, list[str]]] = []
    for line in hlo_text.splitlines():
        if line[:1] not in ("", " ", "\t") and line.rstrip().endswith("{"):
            m = _HEADER.match(line)
            out.append((m.group(1) if m else "", []))
        elif out and line.strip() and line.strip() != "}":
            out[-1][1].append(line)
    return out


def computation_runs(hlo_text: str, unknown: int | None = None) -> dict[str, int | None]:
    """How many times each computation of a compiled program runs when the program runs once.

    The ``ENTRY`` computation runs once. A ``while`` loop's body runs its loop's ``known_trip_count``
    times (XLA writes it in the loop's ``backend_config`` when it can prove the count, as for every
    ``lax.scan`` and ``fori_loop`` with constant bounds) times what runs the loop; a computation called
    from several places adds them up. This is what the compiled program does, whatever XLA did to the
    loops: a body unrolled by 2 (XLA:GPU's ``WHILE_LOOP_UNROLLING_AUTO_UNROLL`` for loops that hold
    collectives, on by default or not depending on the XLA version) holds two copies of each instruction
    and reports half the trips. A ``conditional``'s branch counts as if taken.

    Returns:
      ``{computation: runs}`` (absent: not reached from ``ENTRY``); a loop that states no trip count
      (XLA:TPU's) runs ``unknown`` times (e.g. a scan's layers), or, with None, its computations map to None.
    """
    comps = _computations(hlo_text)
    names = {name for name, _ in comps}
    entry = next((name for name, _ in comps if f"ENTRY %{name} " in hlo_text), None)
    if entry is None:
        entry = next((name for name, _ in comps if f"ENTRY {name} " in hlo_text), None)
    if entry is None:
        return {}
    runs: dict[str, int | None] = {entry: 1}
    for name, lines in reversed(comps):  # HLO text lists callees before their callers
        if name not in runs:
            continue
        for line in lines:
            if " async-done(" in line or " async-update(" in line:
                continue  # it names the computation its async-start runs
            trips = _TRIPS.search(line) if " while(" in line else None
            for m in _CALLED.finditer(line):
                for callee in (m.group(1),) if m.group(1) else re.findall(r"[\w.\-]+", m.group(2)):
                    callee = callee.lstrip("%")
                    if callee not in names:
                        continue
                    factor = 1
                    if " while(" in line and line[m.start() : m.start() + 5] == "body=":
                        factor = int(trips.group(1)) if trips else unknown
                    here = None if runs[name] is None or factor is None else runs[name] * factor
                    before = runs.get(callee, 0)
                    runs[callee] = None if before is None or here is None else before + here
    return runs


def loop_computations(hlo_text: str) -> set[str]:
    """Names of the computations of a compiled program that run inside a ``while`` loop: its bodies and
    conditions and every computation they call, at any depth (with or without a known trip count)."""
    comps = _computations(hlo_text)
    names, looped = {name for name, _ in comps}, set()
    for name, lines in reversed(comps):  # callers after their callees in the text: from ENTRY down
        for line in lines:
            for m in _CALLED.finditer(line):
                callees = (m.group(1),) if m.group(1) else re.findall(r"[\w.\-]+", m.group(2))
                if name in looped or " while(" in line:
                    looped.update(c.lstrip("%") for c in callees if c.lstrip("%") in names)
    return looped


def while_bodies(hlo_text: str) -> set[str]:
    """Names of the computations a compiled program runs as ``while`` loop bodies: a collective whose
    :attr:`CollectiveOp.computation` is one of them runs once per iteration (:attr:`CollectiveOp.runs` reads
    the trip counts)."""
    return set(_WHILE.findall(hlo_text))


def collectives(hlo_text: str, mesh_shape: Any) -> list[tuple[str, tuple[str, ...]]]:
    """``[(op, axes)]`` of :func:`collective_ops`: each collective and the mesh axes it spans.

    Args:
      hlo_text: ``compiled.as_text()`` of a program compiled for a mesh.
      mesh_shape: that mesh's ``dict(mesh.shape)`` (or the mesh), e.g. ``{"data": 4, "model": 2}``.
    """
    return [(c.op, c.axes) for c in collective_ops(hlo_text, mesh_shape)]


class CompileLog(logging.Handler):
    """The programs XLA compiles while the log is open, read from ``jax.log_compiles`` messages.

    Use as ``with CompileLog() as log: ...``; then ``log.compiled`` lists the names (``"jit(f)"``) in order
    and ``log.count("f")`` counts one function's compiles. JAX's own messages are collected, not printed.
    """

    def __init__(self):
        super().__init__()
        self.compiled: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Finished XLA compilation of "):
            self.compiled.append(message.split(" of ", 1)[1].rsplit(" in ", 1)[0])

    def count(self, name: str) -> int:
        """Compiles of the function called ``name`` (``jit(name)``, or ``pmap(name)``)."""
        return sum(c in (f"jit({name})", f"pmap({name})") for c in self.compiled)

    def __enter__(self) -> CompileLog:
        import jax

        logger = logging.getLogger("jax")
        self._propagate, logger.propagate = logger.propagate, False
        logger.addHandler(self)
        self._flag = jax.log_compiles(True)
        self._flag.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._flag.__exit__(*exc)
        logger = logging.getLogger("jax")
        logger.removeHandler(self)
        logger.propagate = self._propagate

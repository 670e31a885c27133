"""Reading the splits' programs: what lesson 10's cells measure, each in one call.

The cells of notebook 10 show a split and assert what it sends and keeps; these functions do the reading
behind those numbers: a primitive counted in a jaxpr, the residuals a ``jax.vjp`` keeps on a device, the
largest difference between two pytrees, one training step's memory and bytes, where a data-parallel
step's all-reduces sit, and the temporaries of an attention program as its ring grows. Collectives are
read by :mod:`course_lib.programs` and costed by :func:`course_lib.splits.loop_sent` (the ring model).

Taught in: notebook 10.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
from jax import P

from course_lib import splits
from course_lib.meshes import mesh_of
from course_lib.programs import collective_ops, jaxpr_equations, while_bodies

__all__ = [
    "attention_temporaries",
    "count_primitive",
    "dp_loop_all_reduces",
    "residual_bytes",
    "step_row",
    "step_table",
    "tree_diff",
]


def count_primitive(jaxpr: Any, name: str) -> int:
    """How many times equations of primitive ``name`` (``"psum_invariant"``, ``"all_gather"``, …) run in
    ``jaxpr`` (a ``jax.make_jaxpr`` result), each ``scan`` body counted its ``length`` times. An int."""
    return sum(t for e, t in jaxpr_equations(jaxpr) if e.primitive.name == name)


def residual_bytes(vjp_fn: Any) -> int:
    """Bytes the residuals of ``vjp_fn`` (the function ``jax.vjp`` returns, a pytree of its residual
    arrays) occupy on the first device: the sum of each leaf's shard there. An int, in bytes."""
    return sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(vjp_fn))


def tree_diff(got: Any, want: Any, scaled: Callable[[float, Any], float]) -> float:
    """The largest of ``scaled(max |g − w|, w)`` over the leaves of two pytrees of the same structure
    (``scaled``: :func:`course_lib.precision.parity_diff`, absolute in float64, relative in float32).

    Raises:
      ValueError: when the two trees have different structures.
    """
    if jax.tree.structure(got) != jax.tree.structure(want):
        raise ValueError(
            f"the trees differ: {jax.tree.structure(got)} vs {jax.tree.structure(want)}"
        )
    return max(
        scaled(float(abs(a - b).max()), b)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
    )


def step_row(compiled: Any, mesh: Any, trips: int) -> dict[str, Any]:
    """One compiled training step's row of lesson 10's table, per device: ``args`` (parameters and data
    in, bytes), ``temp`` (temporaries, bytes), ``out`` (outputs less aliased ones: loss and gradients,
    bytes), ``sent`` (:func:`course_lib.splits.loop_sent` with ``trips``: ``{kind: {"count", "sent"}}``)
    and ``flops`` (``cost_analysis()``, a loop body once)."""
    ma = compiled.memory_analysis()
    return dict(
        args=ma.argument_size_in_bytes,
        temp=ma.temp_size_in_bytes,
        out=ma.output_size_in_bytes - ma.alias_size_in_bytes,
        sent=splits.loop_sent(compiled.as_text(), mesh, trips=trips),
        flops=compiled.cost_analysis()["flops"],
    )


def step_table(rows: dict[str, dict[str, Any]]) -> str:
    """:func:`step_row` rows as a text table, one line per program, with the count of each collective
    and the bytes sent per device."""
    kinds = ("all-gather", "reduce-scatter", "all-reduce")
    lines = [
        f"{'program':28s} {'params+data in':>14s} {'temporaries':>12s} {'outputs':>8s} "
        f"{'all-gathers':>11s} {'reduce-sc.':>10s} {'all-reduces':>11s} {'bytes sent':>11s} {'FLOPs*':>9s}"
    ]
    for name, r in rows.items():
        cnt = [r["sent"].get(k, {}).get("count", 0) for k in kinds]
        total = sum(v["sent"] for v in r["sent"].values())
        lines.append(
            f"{name:28s} {r['args']:14,} {r['temp']:12,} {r['out']:8,} {cnt[0]:11} {cnt[1]:10} "
            f"{cnt[2]:11} {total:11,.0f} {r['flops']:9.3g}"
        )
    lines.append(
        "* cost_analysis() counts each loop body once: one layer's forward and backward, plus the rest"
    )
    return "\n".join(lines)


def dp_loop_all_reduces(hlo_text: str, mesh: Any, trips: int) -> dict[str, Any]:
    """Where a data-parallel step's all-reduces sit: ``in_loop`` (the all-reduce instructions inside a
    ``while`` body, :class:`course_lib.programs.CollectiveOp`), ``outside`` (how many are not),
    ``trips`` (each in-loop instruction's runs: XLA's ``known_trip_count``, or ``trips`` where the compiler
    wrote none, as XLA:TPU), ``loop_bytes`` (their buffers' bytes × runs) and ``loop_sent`` (their
    ring-model bytes sent per device × runs)."""
    bodies = while_bodies(hlo_text)
    ops = [o for o in collective_ops(hlo_text, mesh) if o.op == "all-reduce"]
    in_loop = [o for o in ops if o.computation in bodies]
    runs = {o.name: trips if o.runs is None else o.runs for o in in_loop}
    return dict(
        in_loop=in_loop,
        outside=len(ops) - len(in_loop),
        trips=runs,
        loop_bytes=sum(o.nbytes * runs[o.name] for o in in_loop),
        loop_sent=sum(o.bytes_sent * runs[o.name] for o in in_loop),
    )


def attention_temporaries(
    fns: dict[str, Callable],
    rings: Iterable[int],
    devices: Sequence[Any],
    shape: tuple[int, int, int, int],
    dtype: Any,
    key: jax.Array,
    axis: str,
    compiler_options: dict | None = None,
    heads_split: Iterable[str] = (),
) -> dict[tuple[str, int], int]:
    """The temporaries (``memory_analysis().temp_size_in_bytes``, bytes per device) of each context-parallel
    attention in ``fns`` on rings of ``rings`` devices, every device's block fixed.

    Args:
      fns: name → ``fn(q, k, v, axis)``, run in ``shard_map`` with q, k, v split along the sequence.
      rings: ring sizes (each at most ``len(devices)``).
      devices: the devices to build each ring from (the first ``c``).
      shape: one device's block ``(B, s, H, Dh)``: the ring of ``c`` runs ``[B, c·s, H, Dh]``.
      dtype: q, k, v's dtype.
      key: PRNG key for q, k, v.
      axis: the mesh axis name.
      compiler_options: passed to ``jax.jit``.
      heads_split: the names in ``fns`` that split the heads over the ring (Ulysses): skipped on a ring
        that does not divide ``H``.

    Returns:
      ``{(name, c): bytes}``.

    Raises:
      ValueError: when a ring is larger than ``len(devices)``.
    """
    b, s, h, dh = shape
    spec = P(None, axis)
    temps = {}
    for c in rings:
        if c > len(devices):
            raise ValueError(f"a ring of {c} devices needs {c} devices; {len(devices)} are present")
        mesh = mesh_of({axis: c}, list(devices[:c]), axis_type="auto")
        qkv = [
            jax.random.normal(jax.random.fold_in(key, i), (b, s * c, h, dh), dtype)
            for i in range(3)
        ]
        for name, fn in fns.items():
            if name in heads_split and h % c:
                continue
            f = jax.shard_map(
                lambda q, k, v, fn=fn: fn(q, k, v, axis),
                mesh=mesh,
                in_specs=(spec,) * 3,
                out_specs=spec,
            )
            compiled = jax.jit(f, compiler_options=compiler_options).lower(*qkv).compile()
            temps[name, c] = compiled.memory_analysis().temp_size_in_bytes
    return temps


def temporaries_table(temps: dict[tuple[str, int], int], unit_bytes: int) -> Any:
    """:func:`attention_temporaries`' result as a table (a ``pandas.DataFrame``): one row per program, one
    column per ring size, each value the bytes ÷ ``unit_bytes`` (in lesson 10: K or V blocks of 8
    positions), NaN where a program did not run on that ring. Used by ``notebooks/10_transformers.ipynb``,
    section 3.

    Raises:
      ValueError: ``unit_bytes`` not positive.
    """
    import pandas as pd

    if unit_bytes <= 0:
        raise ValueError(f"unit_bytes={unit_bytes} must be positive")
    names = list(dict.fromkeys(name for name, _ in temps))
    rings = sorted({c for _, c in temps})
    table = pd.DataFrame(
        [[temps.get((name, c), float("nan")) / unit_bytes for c in rings] for name in names],
        index=pd.Index(names, name="program"),
        columns=pd.Index(rings, name="devices"),
    )
    return table

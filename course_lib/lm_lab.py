"""The transformer lab's plumbing, so that its cells show the idea: run the layouts beside a one-device
reference (:func:`run_parity`), read XLA:TPU's and XLA:CPU's programs for the facts the lab states
(:func:`program_facts`), rank the layouts under every way of adding communication to compute
(:func:`decision_table`), size the expert layout's buffers (:func:`expert_capacity`), print a step-time
model's rows (:func:`step_table`) and lay out the results files' rows (:func:`results_row`,
:func:`model_table`).

Taught in ``notebooks/12_transformer_lab.ipynb``; tested in ``tests/test_lm_lab.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from typing import Any

import jax
import numpy as np
import pandas as pd

from . import comms, lm_layouts, moe
from . import lm_tables as _tables

__all__ = [
    "model_of",
    "worst_diff",
    "run_parity",
    "nonzero_by_axis",
    "bytes_by_axis",
    "memory_row",
    "gathered_weights",
    "xla_cpu_summaries",
    "collectives_of",
    "dtypes_of",
    "program_facts",
    "decision_table",
    "expert_capacity",
    "step_table",
    "results_row",
    "model_table",
]


def model_of(key: str) -> str:
    """Which model layout ``key`` trains: ``"moe"`` for a layout with an expert axis (``ep_dp``: the
    mixture-of-experts transformer of :mod:`course_lib.lm_experts`), else ``"dense"``.

    Raises:
      KeyError: ``key`` is not a layout of :data:`course_lib.lm_layouts.LAYOUTS`.
    """
    return "moe" if lm_layouts.LAYOUTS[key].expert_axis else "dense"


def worst_diff(a: Any, b: Any, relative: bool = False) -> float:
    """The largest ``|a - b|`` over every leaf of two pytrees of the same structure (any shapes, any float
    dtype), computed in NumPy on the host (one jnp op per leaf would compile a program per shape and dtype).

    ``relative``: per leaf, ``max |a - b| / max |b|`` (a leaf of zeros divides by 1), then the largest.

    Raises:
      ValueError: the two trees have different numbers of leaves.
    """
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    if len(la) != len(lb):
        raise ValueError(
            f"the trees differ: {len(la)} leaves against {len(lb)}; pass the same structure"
        )
    worst = 0.0
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        scale = (float(np.abs(y).max()) or 1.0) if relative else 1.0
        worst = max(worst, float(np.abs(x - y).max()) / scale)
    return worst


def _train(step, state, batches, place_batch, from_layout=lambda t: t) -> list[tuple[float, Any]]:
    """Every batch through a compiled step; per step the loss and the gradients (one-device layout)."""
    p, v = state
    out = []
    for tok, tgt in batches:
        p, v, loss, g = step(p, v, *place_batch(tok, tgt))
        out.append((float(loss), from_layout(g)))
    return out


def _compile_timed(lowered):
    t0 = time.perf_counter()
    return lowered.compile(), time.perf_counter() - t0


def _compare(ref: list, got: list) -> tuple[float, float]:
    """The worst absolute and relative difference of losses and gradients over every step."""
    pairs = list(zip(ref, got, strict=True))
    worst = max(max(abs(la - lb), worst_diff(ga, gb)) for (la, ga), (lb, gb) in pairs)
    rel = max(
        max(abs(la - lb) / abs(la), worst_diff(gb, ga, relative=True))
        for (la, ga), (lb, gb) in pairs
    )
    return worst, rel


def run_parity(
    keys: Sequence[str],
    models: dict[str, tuple[Any, Callable]],
    batches: Sequence[tuple[Any, Any]],
    config,
    devices: Sequence,
    dtype,
    *,
    pool: Executor,
    compiler_options: dict | None = None,
) -> tuple[dict[str, list], dict[str, dict]]:
    """Train every layout of ``keys`` and its model's one-device reference on the same batches, and compare.

    Args:
      keys: layout keys of :data:`course_lib.strategies.LAYOUT_KEYS` that fit ``devices``.
      models: ``{"dense": (params, reference_step), "moe": (...)}``: each model's float parameters and its
        one-device step ``(params, momentum, tokens, targets) -> (params, momentum, loss, grads)``; ``"moe"``
        only when a key trains it (:func:`model_of`).
      batches: ``(tokens, targets)`` int32 arrays ``[global_batch, seq_len]``, one pair per step.
      dtype: the parameters' dtype for this run (float32, or float64 under ``jax.enable_x64``).
      pool: an executor: the references' and layouts' programs compile side by side in it (XLA compiles
        with the GIL released).
      compiler_options: passed to every compile (the lab's XLA:CPU ``xla_backend_optimization_level: 0``).

    Returns:
      ``(refs, results)``: ``refs[model]`` the reference's ``[(loss, grads), ...]`` per step; ``results[key]``
      a dict with ``built`` (the :class:`course_lib.lm_layouts` build), ``compiled`` (its program),
      ``worst`` (largest absolute difference of a loss or gradient entry, any step), ``rel`` (the largest
      relative one, per leaf), ``compile_s`` and ``run_s`` (seconds: the compile beside the others, and one
      step) and ``losses`` (per step).

    Raises:
      KeyError: a key is not a layout, or its model is missing from ``models``.
    """
    from . import strategies  # the registry builds the layouts

    used = sorted({model_of(k) for k in keys} | {"dense"})
    missing = [m for m in used if m not in models]
    if missing:
        raise KeyError(
            f"models lacks {missing}: layouts {list(keys)} train them; add (params, reference_step)"
        )
    state, ref_jobs = {}, {}
    for m in used:  # each model's parameters in this dtype, and its one-device reference step
        params = jax.tree.map(lambda a: a.astype(dtype), models[m][0])
        state[m] = (params, lm_layouts.init_momentum(params))
        ref_step = jax.jit(models[m][1], compiler_options=compiler_options)
        ref_jobs[m] = pool.submit(_compile_timed, ref_step.lower(*state[m], *batches[0]))
    builts = {
        k: strategies.build_layout(k, config, devices, compiler_options=compiler_options)
        for k in keys
    }
    placed = {k: b.place(*state[model_of(k)], *batches[0]) for k, b in builts.items()}
    jobs = {k: pool.submit(_compile_timed, b.lower(*placed[k])) for k, b in builts.items()}
    refs = {m: _train(ref_jobs[m].result()[0], state[m], batches, lambda *b: b) for m in used}
    results = {}
    for k, built in builts.items():
        compiled, compile_s = jobs[k].result()

        def place(tok, tgt, b=built):
            return jax.device_put(tok, b.batch_sharding), jax.device_put(tgt, b.batch_sharding)

        t0 = time.perf_counter()
        got = _train(compiled, placed[k][:2], batches, place, built.from_layout)
        run_s = (time.perf_counter() - t0) / len(batches)
        worst, rel = _compare(refs[model_of(k)], got)
        results[k] = dict(built=built, compiled=compiled, worst=worst, rel=rel, compile_s=compile_s,
                          run_s=run_s, losses=[la for la, _ in got])  # fmt: skip
    return refs, results


def nonzero_by_axis(items: Sequence) -> dict[str, float]:
    """Bytes each device sends per mesh axis (:func:`course_lib.comms.sent_by_axis` of predicted transfers
    or read collectives), the axes that send nothing (an axis of size 1) left out."""
    return {a: b for a, b in comms.sent_by_axis(items).items() if b}


def bytes_by_axis(key: str, predicted: Sequence, measured: Sequence) -> pd.DataFrame:
    """One row per mesh axis that sends anything: ``layout`` (``key``), ``axis``, ``predicted`` and
    ``measured`` (bytes per device per step, float; 0 where one side has nothing on that axis) and ``match``
    (:func:`course_lib.comms.same_bytes`: equal whole bytes, or within 1e-12 relative for ring fractions)."""
    pred, meas = nonzero_by_axis(predicted), nonzero_by_axis(measured)
    rows = [
        {
            "layout": key,
            "axis": a,
            "predicted": float(pred.get(a, 0.0)),
            "measured": float(meas.get(a, 0.0)),
        }
        for a in sorted(set(pred) | set(meas))
    ]
    table = pd.DataFrame(rows, columns=["layout", "axis", "predicted", "measured"])
    table["match"] = [comms.same_bytes(p, m) for p, m in zip(table["predicted"], table["measured"])]
    return table


def memory_row(key: str, predicted: dict, analysis: Any, n_devices: int) -> dict:
    """One row of lab 12's memory table (bytes per device): ``predicted`` is
    :func:`course_lib.lm_costs.predict_memory`'s dict, ``analysis`` the compiled program's
    ``memory_analysis()``. ``temp / est.`` is the temporaries over the activation estimate (2 decimals).

    Raises:
      ZeroDivisionError: an activation estimate of 0 bytes.
    """
    return {
        "layout": key,
        "n_devices": n_devices,
        **{k: predicted[k] for k in ("params", "optimizer", "gradients", "batch")},
        "activations_est": predicted["activations"],
        "arguments_predicted": predicted["arguments"],
        "argument_size": analysis.argument_size_in_bytes,
        "outputs_predicted": predicted["outputs"],
        "output_size": analysis.output_size_in_bytes,
        "temp_size": analysis.temp_size_in_bytes,
        "temp / est.": round(analysis.temp_size_in_bytes / predicted["activations"], 2),
    }


def gathered_weights(collectives: Sequence, params: dict) -> list:
    """The all-gathers among ``collectives`` (:class:`course_lib.comms.Collective`, read from a compiled
    program) whose result has a parameter's shape: a leaf of ``params``, or a leaf of ``params["blocks"]``
    without its leading layer axis. Lab 12 shows with it that the partitioner gathers weights as well as
    activations."""
    shapes = {a.shape for a in jax.tree.leaves(params)}
    shapes |= {a.shape[1:] for a in jax.tree.leaves(params.get("blocks", {}))}
    return [
        c
        for c in collectives
        if c.kind == "all-gather" and any(tuple(d) in shapes for _, d in c.shapes)
    ]


def xla_cpu_summaries(runs: dict[str, tuple[Any, Any]], prefix: str = "lab12.") -> dict[str, dict]:
    """:func:`course_lib.aot.summarise` of programs compiled here: ``runs`` maps a name (``"tp_sp"``) to
    ``(compiled, mesh)``; the result maps ``prefix + name`` (the reference's program names) to its summary."""
    from . import aot

    return {
        prefix + name: aot.summarise(compiled, mesh)[0] for name, (compiled, mesh) in runs.items()
    }


def collectives_of(summary: dict, op: str, axes: Sequence[str]) -> list[dict]:
    """The collectives of a program summary (:func:`course_lib.aot.summarise`) of kind ``op``
    (``"all-gather"``, ...) over exactly the mesh axes ``axes`` (e.g. ``["stage"]``)."""
    return [c for c in summary["collectives"] if c["op"] == op and c["axes"] == list(axes)]


def dtypes_of(summary: dict, op: str, axes: Sequence[str]) -> set[str]:
    """The HLO dtypes (``"f32"``, ``"bf16"``) the collectives :func:`collectives_of` selects carry."""
    return {d for c in collectives_of(summary, op, axes) for d in c["dtypes"]}


def _joined(values: Iterable[str]) -> str:
    return ",".join(sorted(values)) or "none"


def _facts(programs: dict[str, dict], prefix: str) -> dict[str, Any]:
    """The lab's facts about one compiler's programs (None where a program is missing)."""
    get = programs.get
    perms = (
        collectives_of(get(prefix + "pp_dp"), "collective-permute", ["stage"])
        if get(prefix + "pp_dp")
        else None
    )
    a2a = (
        collectives_of(get(prefix + "ep_dp"), "all-to-all", ["expert"])
        if get(prefix + "ep_dp")
        else None
    )
    dp = get(prefix + "dp")
    gathered = {k: dtypes_of(get(prefix + k), "all-gather", [a]) if get(prefix + k) else None
                for k, a in (("tp_sp", "model"), ("dp_cp", "context"))}  # fmt: skip
    return {
        "programs with asynchronous collectives": _joined(n.removeprefix(prefix) for n, s in programs.items()
                                                  if s["async_starts"]),  # fmt: skip
        "pp_dp: collective-permutes over stage": None if perms is None else len(perms),
        "pp_dp: of them asynchronous": None if perms is None else sum(bool(c["async"]) for c in perms),
        "tp_sp: all-gather dtypes over model": None if gathered["tp_sp"] is None else _joined(gathered["tp_sp"]),
        "dp_cp: all-gather dtypes over context": None if gathered["dp_cp"] is None else _joined(gathered["dp_cp"]),
        "ep_dp: all-to-alls over expert": None if a2a is None else len(a2a),
        "ep_dp: of them asynchronous": None if a2a is None else sum(bool(c["async"]) for c in a2a),
        "ep_dp: of them in bf16 only": None if a2a is None else sum(c["dtypes"] == ["bf16"] for c in a2a),
        "ep_dp: all-to-all dtypes over expert": None if a2a is None else _joined({d for c in a2a for d in c["dtypes"]}),
        "dp: collectives": None if dp is None else _joined(c["op"] for c in dp["collectives"]),
        "dp: number of collectives": None if dp is None else len(dp["collectives"]),
        "dp: dtypes": None if dp is None else _joined({d for c in dp["collectives"] for d in c["dtypes"]}),
        "dp: array bytes (not sent)": None if dp is None else sum(c["bytes"] for c in dp["collectives"]),
    }  # fmt: skip


def program_facts(
    tpu: dict[str, dict], cpu: dict[str, dict] | None = None, prefix: str = "lab12."
) -> pd.DataFrame:
    """The facts lab 12 states about its programs, one row per fact, one column per compiler.

    Args:
      tpu: ``{name: summary}``, XLA:TPU's programs (:func:`course_lib.aot.tpu_summaries`), names
        ``prefix + layout``; it must hold ``dp``, ``tp_sp``, ``dp_cp``, ``pp_dp`` and ``ep_dp``.
      cpu: the same for XLA:CPU's programs compiled here (:func:`xla_cpu_summaries`), or None/empty.

    Returns:
      A DataFrame indexed by fact (e.g. ``"pp_dp: collective-permutes over stage"``), columns ``XLA:TPU``
      and, when ``cpu`` is given, ``XLA:CPU``: counts (int), dtype sets as sorted comma-joined HLO names
      (``"bf16"``, ``"f32"``; ``"none"`` for an empty set), bytes on one device (int); None where that
      compiler's program is missing.

    Raises:
      ValueError: ``tpu`` lacks one of the five programs (the message names it).
    """
    needed = [prefix + k for k in ("dp", "tp_sp", "dp_cp", "pp_dp", "ep_dp")]
    missing = [n for n in needed if n not in tpu]
    if missing:
        raise ValueError(
            f"XLA:TPU's programs lack {missing}; pass aot.tpu_summaries of every lab12 program"
        )
    columns = {"XLA:TPU": _facts(tpu, prefix)}
    if cpu:
        columns["XLA:CPU"] = _facts(cpu, prefix)
    return pd.DataFrame(columns).astype(object)


def decision_table(
    config, fabric, cases: dict[str, tuple[int, float]], n_devices: int = 8
) -> pd.DataFrame:
    """Rank the dense layouts (:func:`course_lib.lm_costs.rank_layouts`, a step-time MODEL) for every case,
    every way of adding communication to compute (:data:`course_lib.lm_costs.OVERLAPS`) and with and
    without recomputation.

    Args:
      cases: ``{label: (global_batch, memory_limit_bytes)}``, e.g. ``{"tight limit": (64, 56e9)}``.

    Returns:
      One row per ``(case, overlap, remat)``: ``winner`` (the fastest layout that fits), ``margin`` (the
      next one's step time over the winner's, minus 1: 0.1 is 10 %), ``top`` (the three fastest, ms per
      step) and ``fits`` (how many layouts fit the limit).

    Raises:
      ValueError: ``cases`` is empty, or a case leaves fewer than two layouts that fit (no margin).
    """
    from . import lm_costs

    if not cases:
        raise ValueError("cases is empty: pass {label: (global_batch, memory_limit_bytes)}")
    rows = []
    for label, (batch, limit) in cases.items():
        for overlap in lm_costs.OVERLAPS:
            for remat in (False, True):
                ranked = lm_costs.rank_layouts(config, batch, fabric, n_devices, memory_limit=limit,
                                               overlap=overlap, remat=remat)  # fmt: skip
                if len(ranked) < 2:
                    raise ValueError(f"case {label!r} (batch {batch}, limit {limit:.3g} B, remat={remat}): "
                                     f"{len(ranked)} layout(s) fit; raise the memory limit")  # fmt: skip
                rows.append({
                    "case": label, "overlap": overlap, "remat": remat, "winner": ranked[0]["layout"],
                    "margin": ranked[1]["step_s"] / ranked[0]["step_s"] - 1,
                    "top": ", ".join(f"{r['layout']} {r['step_s'] * 1e3:.1f}" for r in ranked[:3]),
                    "fits": len(ranked),
                })  # fmt: skip
    return pd.DataFrame(rows)


def expert_capacity(
    config, global_batch: int, sizes: dict[str, int], capacity_factor: float
) -> dict[str, float]:
    """What one device of ``ep_dp`` routes per layer: ``tokens`` (its share of the batch's tokens,
    ``global_batch / (data · expert) · seq_len``), ``capacity`` (places per expert, :func:`course_lib.moe.
    capacity` with the lab's ``E`` experts and top-``k``), ``places`` (``E · C``: rows of expert MLP computed,
    empty ones included) and ``places_per_token`` (``places / tokens``: 2.5 at capacity factor 1.25, top-2).

    Raises:
      ValueError: ``sizes`` lacks ``data`` or ``expert``, or they do not divide ``global_batch``.
    """
    from . import lm_experts

    if not {"data", "expert"} <= set(sizes):
        raise ValueError(
            f"sizes {sizes} must name data and expert (lm_layouts.mesh_axes('ep_dp', n))"
        )
    shards = sizes["data"] * sizes["expert"]
    if global_batch % shards:
        raise ValueError(
            f"global_batch {global_batch} is not a multiple of data x expert = {shards}"
        )
    tokens = global_batch // shards * config.seq_len
    cap = moe.capacity(tokens, lm_experts.N_EXPERTS, lm_experts.TOP_K, capacity_factor)
    places = lm_experts.N_EXPERTS * cap
    return {
        "tokens": tokens,
        "capacity": cap,
        "places": places,
        "places_per_token": places / tokens,
    }


# lab 12's tables, in course_lib.lm_tables
step_table, results_row, model_table = _tables.step_table, _tables.results_row, _tables.model_table

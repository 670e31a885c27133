"""Checkers for ``12_transformer_lab.ipynb``: the layout decision (the lab's main exercise), the largest
model that fits a memory limit under each layout, and the pipeline's bytes per mesh axis.

None of them holds an answer: each compares the learner's function, on cases drawn afresh at every call
(``seed``: for tests), with :mod:`course_lib.lm_costs` — the step-time model
(:func:`~course_lib.lm_costs.rank_layouts`, built on the byte and memory predictions that the notebook
checks against the compiled programs), the memory model (:func:`~course_lib.lm_costs.largest_layers`) and
:func:`~course_lib.lm_costs.predict_bytes`, which equals the compiled pipeline's bytes (asserted in the
notebook). Each says how many cases are wrong, and in which part, never which case (an answer that raises
is shown the call that raised, to rerun it). An answer that calls the function the checker compares with
is refused (:mod:`._unaided`: from any thread, under any alias, or as a copy of its code; a copied and
edited source cannot be detected — the checkers are a self-test): the exercise is to build it from its
pieces.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from course_lib import comms, costs, lm_costs, lm_layouts, transformer

from ._common import checker, fail, passed, plain
from ._unaided import call_unaided as _call_unaided

__all__ = ["check_layout_decision", "check_largest_model", "check_pipeline_bytes"]

_G = transformer.GPU
_REL = 1e-9  # bytes and memory: the same model computed in another order
_TIE = 1e-9  # a layout whose modelled step is within this of the fastest also counts as first

_MODEL = (lm_costs.step_time, lm_costs.rank_layouts, lm_costs.largest_layers)
"""What the layout and largest-model checkers compare with: an answer must not call them."""
_BYTES = (lm_costs.predict_bytes, lm_costs._pipeline_transfers)
"""What the pipeline checker compares with."""


# ---- exercise 1: the layout decision ----------------------------------------------------------------------

_SMALL = dataclasses.replace(_G, d_model=512, d_ff=2048, n_heads=8, n_layers=8)
_CONFIGS = {
    "gpu": _G,
    "8 layers": dataclasses.replace(_G, n_layers=8),
    "32 layers": dataclasses.replace(_G, n_layers=32),
    "seq 1024": dataclasses.replace(_G, seq_len=1024),
    "seq 4096": dataclasses.replace(_G, seq_len=4096),
    "seq 8192": dataclasses.replace(_G, seq_len=8192),
    "narrow": _SMALL,
    # a width an fsdp axis of 4 cannot split (2046 = 2 x 1023, 6 heads of 341): fsdp_tp keeps the blocks
    # whole over fsdp, 3d's fsdp axis of 2 halves them
    "width 2046": dataclasses.replace(_G, d_model=2046, n_heads=6, d_ff=8184),
}
# no latency-bound model (TINY): its winner depends on how the 10 µs are counted (per predicted transfer,
# per collective the program runs), which is bookkeeping, not what the exercise teaches
# (configs, global batches, profiles, limit): each family exposes one part of the model — the pipeline's
# micro-batches (it wins under a limit just below the fastest's memory), its bubble (DP first, the pipeline
# second), the latency per predicted transfer (fsdp_tp ahead of 3d by one on the width-2046 model, a tie
# only to an answer that rounds), the profile (an A100 ranks otherwise), the
# splits (batch 16: the pipeline does not split), the model axis's share of the compute (batch 8), the
# roofline (a faster peak leaves batch 16 memory-bound: fsdp_tp, which reads the fewest bytes, ahead of DP)
_FAMILIES = (
    (("gpu", "32 layers", "seq 1024", "seq 4096"), (32, 64), ("H100", "H200"), "below"),
    (("gpu", "8 layers", "32 layers", "seq 1024", "seq 4096"), (32, 64), ("H100", "H200"), "roomy"),
    (("gpu", "8 layers", "32 layers", "seq 1024", "seq 4096"), (32, 64), ("H100", "H200"), "exact"),
    (("gpu", "32 layers", "seq 1024"), (32, 64), ("A100",), "below"),
    (("gpu", "32 layers", "seq 4096"), (16,), ("H100", "H200"), "below"),
    (("gpu", "8 layers", "32 layers"), (8,), ("H100", "H200", "A100"), "roomy"),
    (("gpu", "8 layers", "32 layers"), (16,), ("fast peak",), "roomy"),
    (("width 2046",), (4, 8, 12, 20), ("H100", "H200", "A100"), "roomy"),
    (
        tuple(_CONFIGS),
        (8, 16, 32, 64, 128),
        ("H100", "H200", "A100", "slow link", "fast peak"),
        "any",
    ),
    (
        tuple(_CONFIGS),
        (8, 16, 32, 64, 128),
        ("H100", "H200", "A100", "slow link", "fast peak"),
        "any",
    ),
)
_WINNERS = {
    # layout: ((config, global batches), ...), profiles — for each, a memory limit makes the layout first
    # (drawn between its memory and the smallest memory of a faster layout): an answer that leaves any
    # layout out is wrong at least once at every call
    "dp": ((("gpu", (16, 32, 64)), ("8 layers", (16, 32, 64)), ("seq 4096", (8, 16, 32))),
           ("H100", "H200", "A100")),
    # a batch the 8-way data axis does not split: TP (+FSDP) over 2, the batch over 4
    "fsdp_tp": ((("gpu", (4, 12, 20)), ("32 layers", (4, 12, 20)), ("seq 1024", (4, 12, 20))),
                ("H100", "H200", "A100")),
    # only tp_sp fits: a limit just above its memory, the smallest of all
    "tp_sp": ((("gpu", (32, 64)), ("32 layers", (32, 64)), ("seq 8192", (8, 16)), ("narrow", (16, 32))),
              ("H100", "H200", "A100")),
    # the pipeline fits where DP does not and is faster than the rest
    "pp_dp": ((("gpu", (32, 64)), ("32 layers", (32, 64)), ("seq 1024", (32, 64))), ("H100", "H200")),
    # a long sequence and a batch DP cannot split 8 ways: the context axis beats TP
    "dp_cp": ((("seq 8192", (12, 20)), ("narrow", (12, 20)), ("seq 4096", (20,))), ("H100", "H200", "A100")),
    # fsdp_tp cannot split the width-2046 blocks: 3d holds less, one predicted transfer slower
    "3d": ((("width 2046", (4, 8, 12, 20)),), ("H100", "H200", "A100")),
}  # fmt: skip
"""Per layout, the cases where the step-time model ranks it first (``tests/test_checks_lesson12.py``
checks every one)."""


def _profiles(rng) -> dict[str, costs.DeviceProfile]:
    """The lab's two profiles, an A100, and two made-up GPUs: a slow link, and a faster bfloat16 peak."""
    h100 = lm_costs.PROFILES["H100"]
    link = float(rng.uniform(20e9, 80e9))
    fast = dataclasses.replace(h100.peak, bf16=h100.peak.bf16 * float(rng.uniform(3, 8)))
    return {
        "H100": h100,
        "H200": lm_costs.PROFILES["H200"],
        "A100": costs.DEVICE_PROFILES["A100"],
        "slow link": dataclasses.replace(h100, name="H100, slow link", link_bytes_per_s=link),
        "fast peak": dataclasses.replace(h100, name="H100, faster peak", peak=fast),
    }


def _pick(rng, options):
    return options[int(rng.integers(len(options)))]


def _decision_cases(rng) -> list[tuple]:
    """(config, global batch, profile, memory limit), one drawn from each of :data:`_FAMILIES`, shuffled.
    Limits: ``roomy`` fits every layout; ``below`` is drawn under the fastest's memory (and above the next
    smaller one); ``exact`` is the fastest's memory itself (``<=``, not ``<``)."""
    profiles = _profiles(rng)
    cases = []
    for configs, batches, names, mode in _FAMILIES:
        cfg, batch = _CONFIGS[_pick(rng, configs)], int(_pick(rng, batches))
        profile = profiles[_pick(rng, names)]
        rows = lm_costs.rank_layouts(cfg, batch, profile, 8)
        mems = sorted({r["memory_bytes"] for r in rows})
        first = rows[0]["memory_bytes"]
        below = [m for m in mems if m < first]
        mode = _pick(rng, ("roomy", "below", "exact")) if mode == "any" else mode
        if mode == "below" and below:
            limit = float(rng.uniform(below[-1], first - 1))
        elif mode == "exact":
            limit = float(first)
        else:
            limit = float(mems[-1]) * float(rng.uniform(1.0, 1.5))
        cases.append((cfg, batch, profile, limit))
    for key in _WINNERS:
        cases.append(_winner_case(rng, key, profiles))
    rng.shuffle(cases)
    return cases


def _winner_window(key, cfg, batch, profile) -> tuple[float, float]:
    """The memory limits under which ``key`` is ranked first: from its memory up to (not including) the
    smallest memory of a layout the model ranks faster (inf when none is)."""
    rows = lm_costs.rank_layouts(cfg, batch, profile, 8)
    at = [r["layout"] for r in rows].index(key)
    return rows[at]["memory_bytes"], min((r["memory_bytes"] for r in rows[:at]), default=math.inf)


def _winner_case(rng, key, profiles) -> tuple:
    """A case of :data:`_WINNERS` that ranks ``key`` first: its memory exactly (a third of the time), or a
    limit drawn up to a quarter above it, below any faster layout's memory."""
    options, names = _WINNERS[key]
    name, batches = _pick(rng, options)
    cfg, batch, profile = _CONFIGS[name], int(_pick(rng, batches)), profiles[_pick(rng, names)]
    low, high = _winner_window(key, cfg, batch, profile)
    top = min(high, 1.25 * low)
    limit = float(low) if rng.uniform() < 1 / 3 else float(rng.uniform(low, top))
    return cfg, batch, profile, limit


def _config_expr(cfg) -> str:
    """``cfg`` as code a learner can paste: ``transformer.GPU`` or ``transformer.TINY``, or the one of the
    two it differs from least with its other sizes (``dataclasses.replace(transformer.GPU, seq_len=8192)``)."""
    options = []
    for name, base in (("GPU", _G), ("TINY", transformer.TINY)):
        changed = [f"{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)
                   if getattr(cfg, f.name) != getattr(base, f.name)]  # fmt: skip
        code = f"dataclasses.replace(transformer.{name}, {', '.join(changed)})"
        options.append((len(changed), code if changed else f"transformer.{name}"))
    return min(options)[1]


def _profile_expr(profile) -> str:
    """``profile`` as code: one of the lab's profiles, or the H100 with its link or its peak changed."""
    for table, named in (
        ("lm_costs.PROFILES", lm_costs.PROFILES),
        ("costs.DEVICE_PROFILES", costs.DEVICE_PROFILES),
    ):
        for name, known in named.items():
            if profile == known:
                return f'{table}["{name}"]'
    h100 = 'lm_costs.PROFILES["H100"]'
    if profile.peak == lm_costs.PROFILES["H100"].peak:
        changed = f"link_bytes_per_s={profile.link_bytes_per_s!r}"
    else:
        changed = f"peak=dataclasses.replace({h100}.peak, bf16={profile.peak.bf16!r})"
    return f"dataclasses.replace({h100}, name={profile.name!r}, {changed})"


def _close(a, b) -> bool:
    # a mean over devices can end in half a byte (2(n-1)/n of an odd count): rounded to whole bytes is right
    return math.isclose(float(a), float(b), rel_tol=_REL, abs_tol=0.5)


def _triple(got, what):
    try:
        key, sent, memory = got
        return str(key), float(sent), float(memory)
    except (TypeError, ValueError):
        fail(
            f"{what} returned {plain(got)!r}",
            "return (layout_key, sent_bytes, memory_bytes), e.g. ('dp', 1.2e9, 3e10)",
        )


@checker
def check_layout_decision(choose: Callable, *, seed: int | None = None) -> bool:
    """``choose(cfg, global_batch, profile, memory_limit) -> (layout, sent_bytes, memory_bytes)``: the layout
    the step-time model ranks first among those that split and fit (memory at most the limit), the bytes one
    device sends per step and the memory it holds, compared with :func:`course_lib.lm_costs.rank_layouts`
    on cases drawn afresh (``seed``: for tests) — the lab's profiles and made-up
    ones (no latency-bound model: no case is decided by how the 10 µs are counted, the tests check it),
    limits at a layout's memory exactly, and one case per layout that the model ranks first
    (:data:`_WINNERS`), so an answer that leaves any layout out is refused at every call.
    The cases have no ties (the tests check that the first is ahead of the second by more than 1e-6,
    relative): ``_TIE`` only absorbs the same sums added in another order. Says how many layouts, bytes
    and memories are wrong, not in which cases; an answer that raises is shown the case's call, as code.
    An answer that calls ``step_time``, ``rank_layouts`` or ``largest_layers`` is refused."""
    cases = _decision_cases(np.random.default_rng(seed))
    wrong = {"layout": 0, "bytes": 0, "memory": 0}
    n_wrong = 0
    for cfg, batch, profile, limit in cases:
        # the case in full, as code: an answer that raises (or returns no triple) can be rerun on it
        what = f"choose_layout({_config_expr(cfg)}, {batch}, {_profile_expr(profile)}, {limit!r})"
        got = _call_unaided(
            what, choose, _MODEL,
            "build the step time from its pieces (FLOPs, hbm_bytes, predict_bytes, predict_memory, the "
            "profile's peak, HBM and link): step_time and rank_layouts are what the checker compares with",
            cfg, batch, profile, limit,
            explain=lambda e, what=what: (
                f"{what} raised {type(e).__name__}: {str(e)[:300]}",
                "run that call in a cell (the case's arguments, as written) and read the error; at "
                "least one layout fits every case",
            ),
        )  # fmt: skip
        key, sent, memory = _triple(got, what)
        rows = lm_costs.rank_layouts(cfg, batch, profile, 8, memory_limit=limit)
        firsts = {r["layout"]: r for r in rows if r["step_s"] <= rows[0]["step_s"] * (1 + _TIE)}
        if key not in firsts:
            bad = {"layout": True}
        else:
            row = firsts[key]
            bad = {"bytes": not _close(sent, row["sent_bytes"]),
                   "memory": not _close(memory, row["memory_bytes"])}  # fmt: skip
        for part, is_bad in bad.items():
            wrong[part] += is_bad
        n_wrong += any(bad.values())
    if n_wrong:
        parts = [
            (
                "layout",
                "another layout first",
                "rank every layout that splits (lm_costs.splits) and whose memory is at most the limit by "
                "compute (the larger of 3 x forward FLOPs of the global batch / 8 devices at the profile's "
                "bfloat16 peak and hbm_bytes / the profile's HBM bandwidth, x (m + p - 1)/m for the pipeline, "
                "m = 4 x stages) + predicted bytes / the profile's link bandwidth + COLLECTIVE_LATENCY_S per "
                "predicted transfer (a line of predict_bytes; FSDP's gathers of all parameters count as one)",
            ),
            (
                "bytes",
                "the right layout but its bytes off",
                "the sum of predict_bytes' sent_bytes, bfloat16 (itemsize=2), the pipeline with "
                "n_micro = 4 x stages",
            ),
            (
                "memory",
                "the right layout but its memory off",
                "params + optimizer + gradients + activations of predict_memory, bfloat16, nothing else",
            ),
        ]
        counts = ", ".join(f"{wrong[k]} with {say}" for k, say, _ in parts)
        hints = "; ".join(f"{k}: {h}" for k, _, h in parts if wrong[k])
        fail(f"{n_wrong} of {len(cases)} cases are wrong ({counts})", hints)
    return passed(f"the layout, its bytes and its memory right in all {len(cases)} cases")


# ---- exercise 2: the largest model that fits ---------------------------------------------------------------


def _fit_configs(rng) -> list:
    """Widths of the GPU configuration and others (sequence, vocabulary, MLP width)."""
    return [
        _G,
        dataclasses.replace(_G, seq_len=int(rng.choice([1024, 4096]))),
        dataclasses.replace(_G, d_model=1024, n_heads=8, d_ff=int(rng.choice([2048, 4096]))),
        dataclasses.replace(_G, vocab=int(rng.choice([16384, 65536]))),
    ]


def _memory_at(key, cfg, batch, n_layers) -> int:
    return lm_costs.step_time(
        key, dataclasses.replace(cfg, n_layers=n_layers), batch, lm_costs.PROFILES["H100"]
    )["memory_bytes"]


def _fit_cases(rng) -> list[tuple]:
    """(layout, config, global batch, memory limit): every layout twice, limits drawn between a few and
    dozens of layers; one at a count's memory exactly (``<=``), the pipeline between two counts of layers,
    and one where not a single layer (stage) fits."""
    configs = _fit_configs(rng)
    keys = list(lm_layouts.LAYOUTS)
    cases = []
    exact = int(rng.integers(2 * len(keys)))
    for i, key in enumerate(keys * 2):
        cfg = configs[int(rng.integers(len(configs)))]
        batch = int(rng.choice([32, 64])) if key == "pp_dp" else int(rng.choice([8, 16, 32]))
        p = lm_layouts.mesh_axes(key, 8).get("stage", 1)
        one, two = _memory_at(key, cfg, batch, p), _memory_at(key, cfg, batch, 2 * p)
        n = int(rng.integers(2, 40))
        if i == exact:  # a count's memory exactly
            limit = float(one + (n - 1) * (two - one))
        else:
            # the pipeline: past half a stage's increment (so one layer more than a stage count fits
            # by a line drawn through single layers)
            low = 0.55 if p > 1 else 0.05
            limit = float(one + (n - 1 + rng.uniform(low, 0.95)) * (two - one))
        cases.append((key, cfg, batch, limit))
    key = keys[int(rng.integers(len(keys)))]
    cfg = configs[int(rng.integers(len(configs)))]
    p = lm_layouts.mesh_axes(key, 8).get("stage", 1)
    one, two = _memory_at(key, cfg, 32, p), _memory_at(key, cfg, 32, 2 * p)
    cases.append((key, cfg, 32, float((2 * one - two) * rng.uniform(0.3, 0.95))))  # below no layers
    rng.shuffle(cases)
    return cases


@checker
def check_largest_model(largest: Callable, *, seed: int | None = None) -> bool:
    """``largest(layout, cfg, global_batch, memory_limit) -> n_layers``: the most layers of ``cfg``'s width
    whose predicted memory per device is at most the limit (a multiple of the stages for the pipeline; 0 when
    none fits), compared with :func:`course_lib.lm_costs.largest_layers` on cases drawn afresh (``seed``:
    for tests): every layout, several widths, a limit at a count's memory exactly, one where nothing fits.
    Says how many counts are too large and too small, not which. An answer that calls ``largest_layers``,
    ``step_time`` or ``rank_layouts`` is refused."""
    cases = _fit_cases(np.random.default_rng(seed))
    over = under = 0
    for key, cfg, batch, limit in cases:
        what = f"largest_model({key!r}, {_config_expr(cfg)}, {batch}, {limit!r})"
        got = _call_unaided(
            what, largest, _MODEL,
            "count the memory with lm_costs.predict_memory (its four kinds) at a few layer counts: "
            "largest_layers is what the checker compares with",
            key, cfg, batch, limit,
        )  # fmt: skip
        try:
            got = int(got)
        except (TypeError, ValueError):
            fail(f"{what} returned {plain(got)!r}", "return the number of layers, an int")
        truth = lm_costs.largest_layers(key, cfg, batch, limit)
        over += got > truth
        under += got < truth
    if over or under:
        hints = []
        if over:
            hints.append(
                "too many: the memory of the count you return (params + optimizer + gradients + "
                "activations, bfloat16) must be at most the limit, and a pipeline's count a multiple of "
                "its stages"
            )
        if under:
            hints.append(
                "too few: a larger count still fits (at most the limit, not below it; a multiple of the "
                "stages for the pipeline); 0, never less, when not even one fits"
            )
        fail(
            f"{over + under} of {len(cases)} cases are wrong ({over} too many layers, {under} too few)",
            "; ".join(hints),
        )
    return passed(f"the largest model right in all {len(cases)} cases, every layout")


# ---- exercise 3: the pipeline's bytes -----------------------------------------------------------------------

_BYTES_CASES = 8


def _bytes_cases(rng) -> list[tuple]:
    """(stages, data, micro-batches, config, global batch, itemsize): one data shard, one stage, fewer and
    more micro-batches than stages, every itemsize, configs drawn (vocabulary, sequence, widths, layers)."""
    shapes = [(2, 4), (4, 2), (8, 1), (1, 8), (2, 2), (4, 1), (2, 1), (1, 2)]
    cases = []
    for p, d in shapes:
        m = int(rng.choice([1, 2, 3, 4, 8]))
        cfg = dataclasses.replace(
            transformer.TINY,
            vocab=int(rng.choice([16, 24, 64])),
            seq_len=int(rng.choice([8, 16, 32])),
            d_model=int(rng.choice([16, 32, 48])),
            d_ff=int(rng.choice([32, 64, 96])),
            n_layers=p * int(rng.integers(1, 4)),
        )
        batch = d * m * int(rng.integers(1, 4))
        cases.append((p, d, m, cfg, batch, int(rng.choice([2, 4, 8]))))
    rng.shuffle(cases)
    return cases


@checker
def check_pipeline_bytes(pipeline_bytes: Callable, *, seed: int | None = None) -> bool:
    """``pipeline_bytes(n_stages, n_data, n_micro, cfg, global_batch, itemsize) -> {"stage", "data"}``: the
    bytes one device sends per step of ``pp_dp``, compared with :func:`course_lib.lm_costs.predict_bytes`
    (which the notebook checks against the compiled program) on :data:`_BYTES_CASES` cases drawn afresh
    (``seed``: for tests). Says how many cases are wrong over each axis, not which. An answer that calls
    ``predict_bytes`` is refused."""
    cases = _bytes_cases(np.random.default_rng(seed))
    wrong = {"stage": 0, "data": 0}
    n_wrong = 0
    for p, d, m, cfg, batch, itemsize in cases:
        what = f"pipeline_bytes({p}, {d}, {m}, {_config_expr(cfg)}, {batch}, {itemsize})"
        got = _call_unaided(
            what, pipeline_bytes, _BYTES,
            "count the transfers from the shapes: predict_bytes is what the checker compares with",
            p, d, m, cfg, batch, itemsize,
        )  # fmt: skip
        if not isinstance(got, dict):
            fail(
                f"{what} returned {type(got).__name__}",
                'return a dict {"stage": bytes, "data": bytes}',
            )
        truth = comms.sent_by_axis(lm_costs.predict_bytes("pp_dp", cfg, batch, {"data": d, "stage": p},
                                                            itemsize=itemsize, n_micro=m))  # fmt: skip
        bad = [a for a in wrong if not math.isclose(float(got.get(a, 0.0)), truth.get(a, 0.0),
                                                    rel_tol=1e-9, abs_tol=1e-6)]  # fmt: skip
        for a in bad:
            wrong[a] += 1
        n_wrong += bool(bad)
    if n_wrong:
        hints = {
            "stage": "stage: GPipe runs m + p - 1 ticks forward and as many backward; count the sends a later "
            "tick reads, each one micro-batch [global_batch / n_data / n_micro, S, D], as a mean over the "
            "devices (a shift that stops at the last stage); plus the ring all-reduce of the embedding's "
            "and the head's gradients and the loss",
            "data": "data: the ring all-reduce (2(n-1)/n of its array) of every gradient a device holds — its "
            "stage's layers, the token and position embeddings, the final LayerNorm, the head — and the "
            "loss, itemsize bytes each",
        }
        fail(
            f"{n_wrong} of {len(cases)} cases are wrong ({wrong['stage']} over stage, {wrong['data']} over "
            "data)",
            "; ".join(hints[a] for a in hints if wrong[a]),
        )
    return passed(f"the pipeline's bytes per axis right in all {len(cases)} cases")

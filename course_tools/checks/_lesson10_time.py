"""Lesson 10, exercise 5: the tensor-parallel degree at which a block's forward becomes communication-bound.

The answer ``tp_critical_degree(cfg, batch, fabric)`` is judged by its values on fixed cases that expose each part
of the model (``notebooks/10_transformers.ipynb``, "Time beside bytes"): the block's matmul FLOPs with the
attention scores (sequence length and MLP width differ between cases), two bfloat16 ring all-reduces of
``[batch, S, D]`` (the batch differs and must cancel), the ``2 (n − 1) / n`` of a ring all-reduce, a
bidirectional ring (a TPU's ICI, and GPUs joined in a ring) against a switch (NVLink, a TPU slice's data
network), and each chip's bfloat16 peak; and on cases drawn afresh at each check (shapes, batch, bandwidth,
topology, peak), so that no table of values passes. A wrong answer is named only when it equals, on every case, one of
the mistakes of :data:`MISTAKES`; otherwise the hint lists the parts of the model. The time model itself
(:mod:`course_lib.split_time`, :func:`course_lib.costs.step_time` …) is refused: the exercise is to derive it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable

import numpy as np

from course_lib import costs, split_time, transformer

from ._common import checker, fail, passed, plain
from ._unaided import call_unaided

Config = transformer.TransformerConfig
FABRICS = dict(costs.FABRICS)
FABRICS["TPU v5e across slices"] = dataclasses.replace(
    costs.FABRICS["TPU v5e"],
    name="TPU v5e chips over the data-centre network",
    link=costs.LINKS["DCN"],
)
FABRICS["A100 ring"] = dataclasses.replace(
    costs.FABRICS["A100"], name="A100s joined in a ring of NVLink bridges",
    link=dataclasses.replace(costs.LINKS["NVLink 3"], name="NVLink bridges", topology="ring"),
)  # fmt: skip
"""The fabrics of :data:`CASES`: :data:`course_lib.costs.FABRICS` and two whose link's topology is not the one
their chip usually has (an answer must read ``fabric.link.topology``)."""

CASES = (
    # (config, batch, fabric name)
    (transformer.GPU, 16, "TPU v5e"),
    (transformer.GPU, 4, "H100"),
    (Config(32000, 8192, 4096, 32, 14336, 32), 1, "TPU v5p"),
    (Config(1024, 1024, 1024, 16, 4096, 4), 8, "A100"),
    (Config(16, 16, 32, 8, 64, 2), 4, "TPU v5e"),
    (Config(32768, 2048, 2048, 16, 8192, 16), 2, "TPU v5e across slices"),
    (Config(32768, 4096, 2048, 16, 5632, 16), 3, "A100 ring"),
)
"""Fixed inputs the checker calls the answer with (vocab, seq_len, d_model, n_heads, d_ff, n_layers), beside
:data:`DRAWN` cases drawn afresh at each check (:func:`cases`)."""

DRAWN = 6
"""How many cases :func:`cases` draws at each check besides :data:`CASES`: a table of the fixed cases' values
cannot pass."""


def cases(rng: np.random.Generator) -> list[tuple[Config, int, costs.Fabric]]:
    """``(cfg, batch, fabric)``: :data:`CASES`, then :data:`DRAWN` cases with D, S, F and the batch drawn,
    on one of :data:`FABRICS` whose link bandwidth (× 0.3–3), topology (ring or switch) and chip's bfloat16
    peak (× 0.5–2) are drawn too."""
    out = [(cfg, batch, FABRICS[name]) for cfg, batch, name in CASES]
    names = sorted(FABRICS)
    for _ in range(DRAWN):
        d, s, f = (int(v) * 64 for v in rng.integers(1, 65, 3))
        base = FABRICS[names[int(rng.integers(len(names)))]]
        topology = ("ring", "switch")[int(rng.integers(2))]
        link = dataclasses.replace(
            base.link,
            bytes_per_s=base.link.bytes_per_s * float(rng.uniform(0.3, 3)),
            topology=topology,
        )
        chip = dataclasses.replace(base.chip, bf16=base.chip.bf16 * float(rng.uniform(0.5, 2)))
        name = (
            f"{base.chip.name} at {chip.bf16:.4g} TFLOP/s, a {topology} link of "
            f"{link.bytes_per_s / 1e9:.4g} GB/s (drawn)"
        )
        fabric = dataclasses.replace(base, name=name, chip=chip, link=link)
        out.append((Config(1024, s, d, 8, f, 2), int(rng.integers(1, 33)), fabric))
    return out


def _x(cfg: Config, fabric: costs.Fabric, ways: float | None = None, scores: bool = True) -> float:
    """``(D + (S + F)/2) · W / C``: the part of ``n*`` beyond 1 (``ways``: link directions used)."""
    if ways is None:
        ways = 2 if fabric.link.topology == "ring" else 1
    per_token = cfg.d_model + ((cfg.seq_len if scores else 0) + cfg.d_ff) / 2
    return per_token * fabric.link.bytes_per_s * ways / (fabric.chip.bf16 * 1e12)


def reference(cfg: Config, batch: int, fabric: costs.Fabric) -> float:
    """``n* = 1 + (D + (S + F)/2) · W / C``, latency left out (the batch cancels)."""
    return 1.0 + _x(cfg, fabric)


_FACTORS_OF_2 = (
    "check the factors of 2: two all-reduces per block (attention and MLP), each sending 2 (n − 1) / n of "
    "its size (a reduce-scatter and an all-gather), 2 bytes per bfloat16 value, 2 FLOPs per multiply-add"
)
"""The hint of an answer off by exactly 2 on every case: each factor that, missed or doubled, gives it."""

MISTAKES: tuple[tuple[Callable, str], ...] = (
    (lambda c, f: 1 + _x(c, f, ways=1),
     "on a ring (a TPU's ICI axis, or GPUs joined in a ring) an all-reduce sends half its bytes each way: "
     "the bandwidth counts twice there; read fabric.link.topology"),
    (lambda c, f: 1 + _x(c, f, ways=2),
     "only a ring uses both directions; through a switch (NVLink, a data-centre network) each device sends "
     "at fabric.link.bytes_per_s"),
    (lambda c, f: _x(c, f),
     "a ring all-reduce sends 2 (n − 1) / n of its size, and the FLOPs are divided by n: equal times give "
     "n − 1 = …, so the degree is 1 + …"),
    (lambda c, f: 1 + _x(c, f, scores=False),
     "the attention scores and their product with v are matmuls too: 4·B·S²·D FLOPs per block"),
    (lambda c, f: 1 + _x(c, f) / 2,
     _FACTORS_OF_2),
    (lambda c, f: 1 + 2 * _x(c, f),
     _FACTORS_OF_2),
    (lambda c, f: 1 / (1 - _x(c, f)) if _x(c, f) != 1 else math.inf,  # n − 1 = x·n solved
     "each of the n devices computes 1/n of the block's FLOPs (its heads and its MLP columns)"),
)  # fmt: skip
"""Wrong answers the checker names when an answer equals one of them on every case."""

_GENERIC = (
    "per device, compare two times for one block: its matmul FLOPs (count them from the block's shapes, "
    "section 1; split n ways) ÷ the bfloat16 peak (fabric.chip.bf16 is TFLOP/s), and the bytes of its two "
    "all-reduces of the [T, D] bfloat16 activations (ring model, section 1) ÷ fabric.link.bytes_per_s "
    "(one way; both ways on a ring); T = batch × S. The degree is the n where they are equal"
)


def _diagnose(got: list[float], judged: list) -> str:
    """The hint for values ``got`` on the cases ``judged`` (:func:`cases`) that are not the reference's."""
    for mistake, hint in MISTAKES:
        wants = [mistake(c, fabric) for c, _, fabric in judged]
        if all(math.isclose(g, w, rel_tol=1e-6) for g, w in zip(got, wants)):
            return hint
    wants = [reference(c, b, fabric) for c, b, fabric in judged]
    if all(g in (math.floor(w), math.ceil(w)) for g, w in zip(got, wants)):
        return "return the exact degree at which the two times are equal (a real number), not a whole one"
    return _GENERIC


@checker
def check_tp_critical_degree(fn: Callable, *, seed: int | None = None) -> bool:
    """Judge ``fn(cfg, batch, fabric) -> float`` on :data:`CASES` and :data:`DRAWN` cases drawn afresh
    (:func:`cases`; ``seed``: the draw, for tests; None: fresh).

    Raises:
      ExerciseError: a value off by more than 1e-6 relative (the hint names the mistake when the values
        equal one of :data:`MISTAKES` on every case), a non-number, or a call to the library's time model.
    """
    forbidden = (
        split_time.tp_critical_degree, split_time.comm_bound_degree, split_time.timing,
        split_time.fabric_ratio, split_time.split_cost, split_time.block_flops, costs.step_time,
        costs.collective_time, costs.critical_size,
    )  # fmt: skip
    got, judged = [], cases(np.random.default_rng(seed))
    for cfg, batch, fabric in judged:
        shape = f"d_model={cfg.d_model}, seq_len={cfg.seq_len}, d_ff={cfg.d_ff}"
        what = f"tp_critical_degree(<{shape}>, {batch}, <{fabric.name}>)"
        value = call_unaided(
            what, fn, forbidden,
            "derive it from the block's FLOPs, the bytes its all-reduces send and the fabric's figures; do "
            "not call course_lib.split_time or costs.step_time/collective_time/critical_size",
            cfg, batch, fabric,
        )  # fmt: skip
        if isinstance(value, str | bytes | bool) or not isinstance(plain(value), numbers.Real):
            fail(
                f"{what} returned {plain(value)!r}",
                "return a number: a degree (devices on the axis)",
            )
        got.append(float(plain(value)))
    wrong = [
        (case, g)
        for case, g in zip(judged, got)
        if not math.isclose(g, reference(*case), rel_tol=1e-6)
    ]
    if wrong:
        (cfg, batch, fabric), value = wrong[0]
        want_word = f"{len(wrong)} of {len(judged)} cases are off"
        fail(
            f"{want_word}; e.g. D={cfg.d_model}, S={cfg.seq_len}, F={cfg.d_ff}, batch {batch} on "
            f"{fabric.name}: {value:.6g}",
            _diagnose(got, judged),
        )
    v5e = got[0]
    return passed(
        f"the critical degree on every fabric; e.g. {v5e:.3g} devices for transformer.GPU on TPU v5e ICI: "
        "beyond it a block's all-reduces outlast its matmuls (a model, latency left out)"
    )

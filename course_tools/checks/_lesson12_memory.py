"""Checker of lab 12's exercise 2: the memory one device holds during a step under each dense layout
(``notebooks/12_transformer_lab.ipynb``; re-exported by :mod:`course_tools.checks.lesson12`).

The answer is compared with :func:`course_lib.lm_costs.predict_memory` on 8 devices in bfloat16 (the
pipeline with ``n_micro`` = 4 × stages): ``params + optimizer + gradients + activations``. The cases are
drawn afresh at each call (``seed``: for tests): every dense layout, with and without recomputation, widths,
sequences, vocabularies, layer counts and batches drawn. The activations are a given piece
(:func:`course_lib.lm_costs.activation_bytes` may be called); the state is the exercise: an answer that calls
``predict_memory``, ``param_bytes`` (or its private count ``_param_bytes``), ``largest_layers``,
``step_time``, ``rank_layouts`` or :func:`course_lib.lm_layouts.local_bytes` (a device's block of one
array: the piece the exercise asks for) is refused (:mod:`._unaided`). Says how many cases are wrong,
never which, and, where every wrong case shares one mistake (float32, two copies of the state, the whole
model on each device, the fsdp axis left out, the pipeline's micro-batches or stages, recomputation
ignored), that mistake.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from course_lib import lm_costs, lm_layouts, transformer

from ._common import checker, fail, passed, plain
from ._unaided import call_unaided

__all__ = ["check_device_memory", "model_memory"]

_G = transformer.GPU
_FORBIDDEN = (
    lm_costs.predict_memory,
    lm_costs.param_bytes,
    lm_costs.largest_layers,
    lm_costs.step_time,
    lm_costs.rank_layouts,
)
_PRIVATE = (lm_costs._param_bytes, lm_layouts.local_bytes)
"""``param_bytes``' count and the block of one array it sums: ``activation_bytes`` (allowed) calls them for
FSDP's gathered parameters; an answer's own call is refused."""
_CONFIGS = {
    "transformer.GPU": _G,
    "dataclasses.replace(transformer.GPU, n_layers=8)": dataclasses.replace(_G, n_layers=8),
    "dataclasses.replace(transformer.GPU, n_layers=24, seq_len=1024)": dataclasses.replace(
        _G, n_layers=24, seq_len=1024
    ),
    "dataclasses.replace(transformer.GPU, d_model=1024, n_heads=8, d_ff=4096, vocab=65536)": (
        dataclasses.replace(_G, d_model=1024, n_heads=8, d_ff=4096, vocab=65536)
    ),
}


def model_memory(key: str, cfg, global_batch: int, *, remat: bool, itemsize: int = 2,
                 n_micro: int | None = None, whole: bool = False, copies: int = 3) -> int:  # fmt: skip
    """What the memory model charges one device of ``key`` on 8 devices: ``copies`` × its parameters
    (``whole``: all of them, unsplit) + its activations (``n_micro``: 4 × stages unless given)."""
    sizes = lm_layouts.mesh_axes(key, 8)
    p = sizes.get("stage", 1)
    m = 4 * p if n_micro is None else n_micro
    mem = lm_costs.predict_memory(key, cfg, global_batch, sizes, itemsize, m, remat=remat)
    state = mem["params"] if not whole else transformer.param_count(cfg) * itemsize
    return copies * state + mem["activations"]


def _cases(rng) -> list[tuple[str, str, int, bool]]:
    """(layout, config as code, global batch, remat): every dense layout with and without remat."""
    cases = []
    for key in lm_layouts.DENSE_KEYS:
        for remat in (False, True):
            batch = int(rng.choice([32, 64])) if key == "pp_dp" else int(rng.choice([8, 16, 32]))
            cfg_name = list(_CONFIGS)[int(rng.integers(len(_CONFIGS)))]
            cases.append((key, cfg_name, batch, remat))
    rng.shuffle(cases)
    return cases


def _mistake(wrong: list[tuple]) -> str:
    """The one mistake every wrong case shares, or ``""``: each (key, cfg, batch, remat, got)."""
    variants = {
        "every wrong case is the one of 4-byte values: the lab holds everything in bfloat16, 2 bytes a "
        "value": {"itemsize": 4},
        "every wrong case counts two copies of the state: a device holds its parameters, their momentum "
        "and their gradients, three": {"copies": 2},
        "every wrong case holds the whole model on each device: a device keeps only its block of each "
        "parameter, as lm_layouts.param_specs splits it over the mesh's axes": {"whole": True},
    }
    for hint, change in variants.items():
        if all(np.isclose(got, model_memory(k, c, b, remat=r, **change), rtol=1e-9)
               for k, c, b, r, got in wrong):  # fmt: skip
            return hint
    if all(k in ("fsdp_tp", "3d") for k, *_ in wrong):
        return (
            "only the FSDP layouts' cases are wrong: their specs name the fsdp axis too, and it splits "
            "every parameter it divides, beside the model axis"
        )
    if all(k == "pp_dp" for k, *_ in wrong):
        return (
            "only the pipeline's cases are wrong: it runs n_micro = 4 x stages micro-batches (8 with 2 "
            "stages: pass them to activation_bytes), and only its blocks are split, their layer axis over "
            "stage (the embedding and the head stay whole on each device)"
        )
    if all(r for _, _, _, r, _ in wrong) and all(
        np.isclose(got, model_memory(k, c, b, remat=False), rtol=1e-9) for k, c, b, _, got in wrong
    ):
        return "only the cases with remat=True are wrong, by the activations: pass remat on"
    return ""


@checker
def check_device_memory(device_memory: Callable, *, seed: int | None = None) -> bool:
    """``device_memory(layout_key, cfg, global_batch, remat) -> bytes``: one device's parameters, momentum,
    gradients and activations on 8 devices in bfloat16, compared with :func:`model_memory` on cases drawn
    afresh (``seed``: for tests), within a relative 1e-9. An answer that calls ``predict_memory``,
    ``param_bytes``, ``largest_layers``, ``step_time``, ``rank_layouts`` or ``lm_layouts.local_bytes`` is
    refused."""
    cases = _cases(np.random.default_rng(seed))
    wrong = []
    for key, cfg_name, batch, remat in cases:
        cfg = _CONFIGS[cfg_name]
        what = f"device_memory({key!r}, {cfg_name}, {batch}, remat={remat})"
        got = call_unaided(
            what, device_memory, _FORBIDDEN,
            "count each parameter's block yourself, from its shape, its spec (lm_layouts.param_specs) "
            "and the mesh's sizes (activations: lm_costs.activation_bytes may be called); predict_memory "
            "is what the checker compares with",
            key, cfg, batch, remat, private=_PRIVATE,
        )  # fmt: skip
        try:
            value = float(got)
        except (TypeError, ValueError):
            fail(f"{what} returned {plain(got)!r}", "return the bytes per device, a number")
        if not np.isclose(value, model_memory(key, cfg, batch, remat=remat), rtol=1e-9, atol=0):
            wrong.append((key, cfg, batch, remat, value))
    if wrong:
        hint = _mistake(wrong) or (
            "a device holds three copies of its block of the parameters (the parameters, their momentum, "
            "their gradients: each leaf divided by the sizes of the mesh axes its PartitionSpec names), "
            "2 bytes a value, plus lm_costs.activation_bytes (itemsize 2, n_micro = 4 x stages, remat "
            "passed on)"
        )
        fail(f"{len(wrong)} of {len(cases)} cases are wrong", hint)
    return passed(f"the memory per device right in all {len(cases)} cases, every dense layout")

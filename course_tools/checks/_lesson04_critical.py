"""Lesson 04, exercise 4: the per-device batch below which a data-parallel step is communication-bound.

The answer ``critical_batch(n_params, flops_per_example, n_devices, fabric)`` is judged by its values on
cases that expose each part of the model (``notebooks/04_pmap.ipynb``, "What the all-reduce costs in time"):
the ring all-reduce's ``2 (n − 1) / n`` (n = 2, 8, 64), float32 gradients (4 bytes), a bidirectional ring
(a TPU's ICI axis: both directions) against a switch (NVLink: one direction), the chip's bfloat16 peak, and
one device (nothing to reduce: 0). Calls to :func:`course_lib.costs.collective_time`,
:func:`~course_lib.costs.step_time` and :func:`~course_lib.costs.critical_size` are refused: the exercise is
to derive it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable

from course_lib import costs

from ._common import checker, fail, passed, plain
from ._unaided import call_unaided

FABRICS = dict(costs.FABRICS)
FABRICS["TPU v5e across slices"] = dataclasses.replace(
    costs.FABRICS["TPU v5e"],
    name="TPU v5e chips, data axis over the data-centre network",
    link=costs.LINKS["DCN"],
)  # a TPU whose data axis is a switch: the topology, not the chip, decides
FABRICS["A100 ring"] = dataclasses.replace(
    costs.FABRICS["A100"], name="A100s joined in a ring of NVLink bridges",
    link=dataclasses.replace(costs.LINKS["NVLink 3"], name="NVLink bridges", topology="ring"),
)  # a GPU whose link is a ring  # fmt: skip
"""The fabrics of :data:`CASES`: :data:`course_lib.costs.FABRICS` and two whose link's topology is not the one
their chip usually has (an answer must read ``fabric.link.topology``, not the chip or the names)."""

CASES = (
    # (n_params, flops_per_example, n_devices, fabric name)
    (25_000_000, 2.0e10, 8, "TPU v5e"),
    (25_000_000, 2.0e10, 8, "H100"),
    (1_000_000_000, 6.0e12, 2, "TPU v5p"),
    (350_000_000, 2.1e12, 64, "TPU v5e"),
    (7_000_000_000, 8.4e13, 8, "A100"),
    (25_000_000, 2.0e10, 8, "TPU v5e across slices"),
    (25_000_000, 2.0e10, 4, "A100 ring"),
    (25_000_000, 2.0e10, 1, "TPU v5e"),
)
"""Inputs the checker calls the answer with; each exposes a part of the formula (see the module docstring)."""


def reference(
    n_params: int, flops_per_example: float, n_devices: int, fabric: costs.Fabric
) -> float:
    """Per-device batch at which the bfloat16 forward and backward pass takes as long as the float32
    gradients' ring all-reduce on ``fabric`` (latency left out): ``2 (n−1)/n · 4 P / B · peak / F``, with
    ``B`` doubled on a bidirectional ring."""
    if n_devices <= 1:
        return 0.0
    sent = 2 * (n_devices - 1) / n_devices * 4 * n_params
    bandwidth = fabric.link.bytes_per_s * (2 if fabric.link.topology == "ring" else 1)
    return sent / bandwidth * fabric.chip.bf16 * 1e12 / flops_per_example


def _why(ratio: float, case: tuple, ratios: list[float]) -> str:
    """A hint for an answer off by ``ratio`` on ``case``, from the part of the formula it points at."""
    n, fabric = case[2], FABRICS[case[3]]
    ring_only = all(
        math.isclose(r, 2.0, rel_tol=1e-6) == (FABRICS[c[3]].link.topology == "ring")
        for r, c in zip(ratios, CASES)
        if c[2] > 1
    )
    if ring_only:
        return "on a TPU the data axis is a bidirectional ring of ICI links: the all-reduce sends half each way"
    if math.isclose(ratio, n / (n - 1), rel_tol=1e-6) or math.isclose(
        ratio, (n - 1) / n, rel_tol=1e-6
    ):
        return "a ring all-reduce sends 2 (n − 1) / n of the gradient bytes from each device, not 2 or 2 (n-1)"
    if math.isclose(ratio, 2.0, rel_tol=1e-6) or math.isclose(ratio, 0.5, rel_tol=1e-6):
        return (
            "check the factors of 2: a ring all-reduce is a reduce-scatter then an all-gather (2 (n − 1) / n "
            "of S), float32 gradients are 4 bytes, and a ring fabric uses both directions"
        )
    if math.isclose(ratio, n, rel_tol=1e-6):
        return (
            "off by n: either the batch of all devices (the answer is ONE device's), or the bytes sent "
            "taken as 2 (n − 1) × S where a ring all-reduce sends 2 (n − 1) / n × S"
        )
    want = reference(*case[:3], fabric)
    got = ratio * want
    if got in (math.floor(want), math.ceil(want), round(want)):
        return "return the exact batch at which the two times are equal, not a whole number of examples"
    return (
        f"compute time = batch × flops_per_example / peak (fabric.chip.bf16 is TFLOP/s); communication time = "
        f"bytes sent / bandwidth (fabric.link.bytes_per_s, one way); on {fabric.name} with n={n}"
    )


@checker
def check_critical_batch(fn: Callable) -> bool:
    """Judge ``fn(n_params, flops_per_example, n_devices, fabric) -> float`` on :data:`CASES`.

    Raises:
      ExerciseError: a value off by more than 1e-6 relative (the hint names the part of the formula the
        error points at), a non-number, or a call to the library's time model.
    """
    forbidden = (costs.collective_time, costs.step_time, costs.critical_size)
    got, ratios = [], []
    for case in CASES:
        params, flops, n, name = case
        what = f"critical_batch({params:,}, {flops:g}, {n}, <{FABRICS[name].name}>)"
        value = call_unaided(
            what,
            fn,
            forbidden,
            "derive it from the bytes the all-reduce sends and the link's bandwidth; do not call "
            "costs.collective_time, costs.step_time or costs.critical_size",
            params,
            flops,
            n,
            FABRICS[name],
        )
        if isinstance(value, str | bytes) or not isinstance(plain(value), numbers.Real):
            fail(f"{what} returned {plain(value)!r}", "return a number: a per-device batch")
        value = float(plain(value))
        got.append(value)
        want = reference(*case[:3], FABRICS[name])
        ratios.append(value / want if want else (1.0 if value == 0 else math.inf))
    for case, value, ratio in zip(CASES, got, ratios):
        want = reference(*case[:3], FABRICS[case[3]])
        if want == 0 and value != 0:
            fail(
                f"on one device critical_batch returned {value:g}",
                "one device reduces nothing: no batch is communication-bound there (0)",
            )
        if want and not math.isclose(value, want, rel_tol=1e-6):
            params, flops, n, name = case
            fail(
                f"on {name} with n={n}, {params:,} parameters, {flops:g} FLOPs/example: {value:,.4g} "
                f"examples per device (off by a factor {ratio:.4g})",
                _why(ratio, case, ratios),
            )
    v5e = got[0]
    return passed(
        f"the critical batch on every fabric; e.g. {v5e:,.1f} examples per device for 25 M parameters on "
        "8 TPU v5e chips: below it the gradients' all-reduce outlasts the step's compute"
    )

"""Lesson 08, exercise 2: strategy E's critical per-device batch on a fabric, latency included, leaf by leaf.

The answer ``fsdp_critical_batch(flops_per_image, hbm_bytes_per_image, leaf_bytes, n_devices, fabric)`` is
judged by its values on :data:`CASES`, each exposing a part of the model (``notebooks/08_lab.ipynb``,
section 6.4): the roofline (HBM-bound and compute-bound cases); E's per-leaf collectives, an all-gather and
a reduce-scatter of each leaf it shards, each ``n − 1`` ring steps paying the link's latency α and
``(n − 1) / n`` of the leaf's bytes over the link (n = 2, 4, 8, 64); a bidirectional ring against a switch
(read from the link, not the chip: a TPU over the data-centre network, GPUs in a ring) and one device (0).
The latency is what the notebook has not computed for the learner: it makes E's critical batch grow with
the number of leaves, not only their bytes. The cases compare at 1e-4 relative: an answer that also counts
the loss's 4 bytes in one leaf differs by less than that and is accepted; every typical mistake is off by a
factor or by the latency term. Then, given the run's E, the answer applied to its compiled FLOPs and bytes
and to the bytes of its all-gathers is compared with the lab's own model
(:func:`course_lib.costs.critical_batch`) of those gathers and reduce-scatters at the bfloat16 peak. The
library's time functions, and this module's own functions that compute the answer (:func:`reference` and
its pieces), are refused while the answer runs.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable

from course_lib import comms, costs, lab_time
from course_lib.config import PROFILES

from . import _attempts
from ._common import checker, fail, passed, plain, require
from ._unaided import call_unaided


def _no_alpha(fabric: costs.Fabric, fabric_name: str | None = None, **link) -> costs.Fabric:
    """``fabric`` with its link's latency α set to 0 (and ``link`` fields replaced)."""
    new = dataclasses.replace(fabric.link, latency_s=0.0, **link)
    return dataclasses.replace(fabric, name=fabric_name or fabric.name, link=new)


def _relinked(fabric: costs.Fabric, fabric_name: str, **link) -> costs.Fabric:
    """``fabric`` renamed, with ``link`` fields replaced (its latency kept unless replaced)."""
    return dataclasses.replace(
        fabric, name=fabric_name, link=dataclasses.replace(fabric.link, **link)
    )


FABRICS = dict(costs.FABRICS)
FABRICS["TPU v5e across slices"] = _relinked(
    costs.FABRICS["TPU v5e"], "TPU v5e chips, data axis over the data-centre network",
    **{k: getattr(costs.LINKS["DCN"], k) for k in ("name", "bytes_per_s", "latency_s", "topology")},
)  # a TPU whose axis is a switch  # fmt: skip
FABRICS["A100 ring"] = _relinked(
    costs.FABRICS["A100"], "A100s joined in a ring of NVLink bridges", topology="ring"
)  # a GPU whose link is a ring
"""The checker's fabrics, each with its link's latency α: :data:`course_lib.costs.FABRICS` and two whose
link's topology is not the one their chip usually has."""

CNN_LEAVES = (3456, 128, 73728, 256, 294912, 512, 720896, 1024, 5120, 40)
"""Float32 bytes of a small CNN's ten leaves (three convolutions and two dense layers, kernel and bias):
1.1 MB in all, most of it in few leaves."""

CASES = (
    # (flops_per_image, hbm_bytes_per_image, leaf_bytes, n_devices, fabric)
    (4.3e7, 7.2e6, CNN_LEAVES, 8, "TPU v5e"),  # a small CNN on XLA:CPU's counts: HBM-bound, α-bound
    (6.0e9, 1.0e7, (6.0e7, 4.0e7), 8, "H100"),  # compute-bound, bandwidth-bound
    (2.0e10, 4.0e7, (1.0e9,) * 4, 64, "TPU v5p"),
    (1.0e8, 5.0e7, (2.5e7, 2.5e7) + (1.0e3,) * 30, 2, "A100"),  # many small leaves
    (3.0e9, 1.0e7, (1.0e8, 1.0e8, 4.0e3), 4, "A100 ring"),
    (4.3e7, 7.2e6, CNN_LEAVES, 8, "TPU v5e across slices"),
    (4.3e7, 7.2e6, CNN_LEAVES, 1, "TPU v5e"),
)
"""Inputs the checker calls the answer with (see the module docstring)."""


def _per_image(case: tuple, roofline: bool = True, fabrics: dict | None = None) -> float:
    flops, hbm, _, _, name = case
    chip = (FABRICS if fabrics is None else fabrics)[name].chip
    compute = flops / (chip.bf16 * 1e12)
    return max(compute, hbm / chip.hbm_bytes_per_s) if roofline else compute


def _bandwidth(name: str, both_ways: bool | str = True, fabrics: dict | None = None) -> float:
    link = (FABRICS if fabrics is None else fabrics)[name].link
    doubled = both_ways == "always" or (both_ways and link.topology == "ring")
    return link.bytes_per_s * (2 if doubled else 1)


def _leaves(leaf_bytes) -> tuple[float, ...]:
    return (float(leaf_bytes),) if isinstance(leaf_bytes, numbers.Real) else tuple(leaf_bytes)


def reference(
    case: tuple,
    *,
    share: float = 2.0,
    roofline: bool = True,
    both_ways: bool | str = True,
    alpha: str = "per step",
    fabrics: dict | None = None,
) -> float:
    """The critical batch of ``case``: ``Σ_leaves 2 [(n − 1) α + (n − 1) / n · S / B] ÷ max(F / peak,
    H / HBM)`` (``B`` doubled on a ring). The keywords give the typical wrong forms: ``share`` collectives
    per leaf (2: a gather and a scatter), ``roofline=False`` FLOPs only, ``both_ways=False`` one direction of
    a ring, ``both_ways="always"`` both directions through a switch too, ``alpha`` ``"none"`` (left out),
    ``"per collective"`` (once, not per ring step), ``"tree"`` (one gather and one scatter for all leaves),
    ``"all-reduce"`` (2(n − 1) steps per collective). ``fabrics``: where ``case`` names its fabric
    (:data:`FABRICS`)."""
    n = case[3]
    if n <= 1:
        return 0.0
    leaves = _leaves(case[2])
    link = (FABRICS if fabrics is None else fabrics)[case[4]].link
    steps = {"none": 0, "per collective": 1, "all-reduce": 2 * (n - 1)}.get(alpha, n - 1)
    count = 1 if alpha == "tree" else len(leaves)
    latency = share * count * steps * link.latency_s
    sent = share * (n - 1) / n * sum(leaves)
    return (latency + sent / _bandwidth(case[4], both_ways, fabrics)) / _per_image(
        case, roofline, fabrics
    )


FORBIDDEN = (
    costs.collective_time,
    costs.step_time,
    costs.scaled_step_time,
    costs.critical_size,
    costs.critical_batch,
    reference,
    _per_image,
    _bandwidth,
)
"""Refused while the answer runs: the library's time model and this checker's own answer."""

CASE_RTOL = 1e-4
"""How close an answer must be at :data:`CASES` (relative; see the module docstring)."""


_WRONG = (
    (
        dict(alpha="none"),
        "each collective pays the link's latency α (fabric.link.latency_s) at every ring step: with small "
        "leaves the latency, not the bytes, can set E's communication time",
    ),
    (
        dict(alpha="per collective"),
        "a ring all-gather or reduce-scatter over n devices takes n − 1 steps, and each step pays α",
    ),
    (
        dict(alpha="all-reduce"),
        "an all-gather or a reduce-scatter takes n − 1 ring steps; 2(n − 1) is an all-reduce's count",
    ),
    (
        dict(alpha="tree"),
        "E gathers and scatters each leaf apart: every leaf's two collectives pay their own latency",
    ),
    (
        dict(roofline=False),
        "the compute per image is the roofline's: the slower of FLOPs at the peak and HBM bytes at the HBM "
        "bandwidth (fabric.chip.hbm_bytes_per_s); a small CNN is HBM-bound",
    ),
    (
        dict(both_ways=False),
        "a ring link (fabric.link.topology == 'ring') carries data both ways: a ring all-gather or "
        "reduce-scatter sends half each way round",
    ),
    (
        # at a switch's cases the same values as share=1.0; a ring's differ
        dict(both_ways="always"),
        "only a ring (fabric.link.topology == 'ring') carries data both ways; through a switch (NVLink, a "
        "data-centre network) each device sends at fabric.link.bytes_per_s",
    ),
    (
        dict(share=1.0),
        "E sends in both directions of the step: an all-gather of each leaf forward, a reduce-scatter "
        "of its gradient backward, each (n − 1) / n of the leaf's bytes",
    ),
    (
        dict(share=3.0),
        "that counts a second all-gather (ZeRO-3's re-gather in the backward pass); E gathers every "
        "leaf once and keeps it",
    ),
)


def _why(got: list[float], wanted: list[float]) -> str:
    """The hint of the one typical mistake every case fits, else one naming each part (never a false lead).

    A mistake's hint is given only when the answer equals that mistake's values at EVERY case, the right
    ones included: fitting only the wrong cases is not enough (half the right batch at the compute-bound
    cases is half the bf16 peak, not one collective per leaf, though both halve those cases)."""
    wrong = [i for i, (g, w) in enumerate(zip(got, wanted)) if not _close(g, w)]
    for keywords, hint in _WRONG:
        if all(_close(g, reference(case, **keywords)) for g, case in zip(got, CASES)):
            return hint
    if all(CASES[i][3] > 1 and _close(got[i], wanted[i] * CASES[i][3]) for i in wrong):
        return "the answer is ONE device's batch: the global batch is n times it"
    return (
        "communication time = for each leaf, an all-gather and a reduce-scatter, each (n − 1) steps of α "
        "plus (n − 1)/n of the leaf's bytes ÷ the link's bandwidth (one way, doubled on a ring); compute "
        "time per image = max(FLOPs / peak, HBM bytes / HBM bandwidth); the batch makes them equal"
    )


def _close(a: float, b: float, rel: float = CASE_RTOL) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def _call(fn: Callable, args: tuple, fabric: costs.Fabric) -> float:
    leaves = list(args[2])
    what = (
        f"fsdp_critical_batch({args[0]:g}, {args[1]:g}, <{len(leaves)} leaves, {sum(leaves):g} bytes>, "
        f"{args[3]}, <{fabric.name}>)"
    )
    value = call_unaided(
        what, fn, FORBIDDEN,
        "derive it from what E sends and the roofline; do not call the costs module's time functions "
        "or the checker's own",
        args[0], args[1], leaves, args[3], fabric,
    )  # fmt: skip
    if isinstance(value, str | bytes) or not isinstance(plain(value), numbers.Real):
        fail(f"{what} returned {plain(value)!r}", "return a number: images per device")
    return float(plain(value))


@checker
def check_fsdp_critical_batch(fn: Callable, run=None) -> bool:
    """Judge ``fn(flops_per_image, hbm_bytes_per_image, leaf_bytes, n_devices, fabric) -> float``
    (``leaf_bytes``: a list, one entry per leaf E shards).

    On :data:`CASES` within :data:`CASE_RTOL` (1e-4) relative; then, given ``run`` (the lab's
    ``runs["fsdp"]``), the answer at the run's own numbers (its FLOPs and bytes accessed per image, the
    bytes of its all-gathers) against :func:`course_lib.costs.critical_batch` of its all-gathers and
    reduce-scatters at the bfloat16 peak on the run's fabric, α included, within 2 %.

    Raises:
      ExerciseError: a wrong value (the hint names the part it points at), a non-number, or a call to the
        library's time model.
    """
    got = [_call(fn, case[:2] + (_leaves(case[2]), case[3]), FABRICS[case[4]]) for case in CASES]
    wanted = [reference(case) for case in CASES]
    if CASES[-1][3] == 1 and got[-1] != 0:
        fail(
            f"on one device fsdp_critical_batch returned {got[-1]:g}", "one device sends nothing: 0"
        )
    bad = [i for i in range(len(CASES)) if not _close(got[i], wanted[i])]
    if bad:
        fail(f"fsdp_critical_batch is wrong in {len(bad)} of {len(CASES)} cases", _why(got, wanted))
    message = f"E's critical batch at all {len(CASES)} cases"
    if run is not None and getattr(run, "row", None) is not None:
        message += "; " + _judge_run(fn, run)
    return passed(message)


def _judge_run(fn: Callable, run) -> str:
    """The answer at the run's own numbers against the lab's model of the run's gathers and scatters on
    the run's fabric, α included, at the bfloat16 peak the exercise names (the notebook's table uses the
    run's precision: a float32 run's peak is lower, which moves a compute-bound batch)."""
    row, stats = run.row, run.stats
    n, b = int(row["n_devices"]), int(row["local_batch"])
    _, fabric, predicted = lab_time.fabric_for(row["device_kind"], row["platform"])
    moved = [t for t in stats.transfers if t.kind in ("all-gather", "reduce-scatter")]
    gathers = [t.size_bytes for t in moved if t.kind == "all-gather"]
    if not gathers or 2 * len(gathers) != len(moved):
        return "this run's E not compared (its gathers and scatters do not pair one to one)"
    answer = _call(fn, (stats.flops_per_device / b, stats.bytes_accessed / b, gathers, n), fabric)
    grows = lab_time.grows_with_batch(moved, comms.param_shapes(PROFILES[row["profile"]].model))
    lab = costs.critical_batch(
        b, stats.flops_per_device, stats.bytes_accessed, moved, fabric, "bfloat16", grows=grows,
    )  # fmt: skip
    if not math.isclose(answer, lab, rel_tol=0.02, abs_tol=1e-9):
        fail(
            f"right at the checker's cases, but {answer:.4g} images per device for this run's E, where the "
            f"lab's model of its compiled program gives {lab:.4g}; the checker called it with this run's "
            f"FLOPs {stats.flops_per_device / b:g} and HBM bytes {stats.bytes_accessed / b:g} per image "
            f"(per device ÷ the {b} images one device holds), {len(gathers)} leaves of "
            f"{sum(gathers):g} bytes in all, n_devices={n} and the fabric {fabric.name!r}",
            "call your function with those arguments yourself: its value must follow from its arguments "
            "alone (not from the notebook's variables), for any number of leaves and of devices",
        )
    kind = "a prediction for" if predicted else "on"
    return (
        f"this run's E ({kind} {fabric.name} at the bfloat16 peak, α included, {len(gathers)} gathered "
        f"leaves): {answer:.1f} images per device, it holds {b}"
    )


CRITICAL_MOVES = (
    "link bandwidth x2",
    "ring -> switch",
    "8 -> 64 devices",
    "FLOP peak x2",
    "parameter bytes x2",
)
"""The changes exercise 2's prediction names: after ÷ before of E's critical batch, every other input kept."""

_MOVE_CASE = (4.3e7, 7.2e6, 1.1e6, 8, "TPU v5e")  # HBM-bound on the v5e (checked in the tests)


def _moved(change: str) -> float:
    """After ÷ before of :func:`reference` at :data:`_MOVE_CASE` for ``change`` (α = 0)."""
    flops, hbm, p, n, name = _MOVE_CASE
    fab = _no_alpha(FABRICS[name])
    fabrics = {name: fab}
    before = reference(_MOVE_CASE, fabrics=fabrics)
    if change == "link bandwidth x2":
        fabrics["_moved"] = _no_alpha(fab, "_moved", bytes_per_s=2 * fab.link.bytes_per_s)
    elif change == "ring -> switch":
        fabrics["_moved"] = _no_alpha(fab, "_moved", topology="switch")
    elif change == "FLOP peak x2":
        chip = dataclasses.replace(fab.chip, bf16=2 * fab.chip.bf16)
        fabrics["_moved"] = dataclasses.replace(fab, name="_moved", chip=chip)
    else:
        fabrics["_moved"] = fab
    case = {"8 -> 64 devices": (flops, hbm, p, 64), "parameter bytes x2": (flops, hbm, 2 * p, n)}
    return reference((*case.get(change, (flops, hbm, p, n)), "_moved"), fabrics=fabrics) / before


MOVES_HINT = (
    "the critical batch is E's communication time ÷ its compute time per image; communication = the bytes "
    "each device sends (an all-gather and a reduce-scatter of the parameters, each (n − 1)/n of their bytes) "
    "÷ the link's bandwidth per direction, a ring carrying half each way round and a switch port all of it "
    "one way; time per image = the LARGER of FLOPs ÷ peak and HBM bytes ÷ HBM bandwidth. For each change, "
    "ask which of these terms it moves, and by how much"
)
"""The one hint of wrong moves, whichever are wrong: the model, never which move is off (a hint naming the
wrong ones lets the factors be found by trying values one key at a time)."""


@checker
def check_critical_batch_moves(moves) -> bool:
    """Judge exercise 2's prediction ``moves``: ``{change: after ÷ before}`` for every name in
    :data:`CRITICAL_MOVES`, each within 1 % of the model (:func:`reference`, α = 0).

    Raises:
      NotWritten: a value left ``...`` or ``None``.
      ExerciseError: not a dict of those names, a non-number, or wrong values (how many, and the model:
        never which move, nor its value). Every judged call is counted
        (:mod:`course_tools.checks._attempts`): a verdict after wrong attempts says on which attempt.
    """
    if not isinstance(moves, dict) or set(moves) != set(CRITICAL_MOVES):
        got = sorted(moves) if isinstance(moves, dict) else type(moves).__name__
        fail(
            f"e_critical_moves has keys {got}",
            f"a dict with one number for each of {list(CRITICAL_MOVES)}",
        )
    for key in CRITICAL_MOVES:
        require(
            f"e_critical_moves[{key!r}]", moves[key], "write the factor after ÷ before (a number)"
        )
        if isinstance(moves[key], bool) or not isinstance(plain(moves[key]), numbers.Real):
            fail(f"e_critical_moves[{key!r}] is {moves[key]!r}", "write a number: after ÷ before")
    wrong = sum(not _close(float(moves[k]), _moved(k), rel=0.01) for k in CRITICAL_MOVES)
    verdict = _attempts.record("lesson08 critical_moves", right=not wrong)
    if wrong:
        fail(
            f"{wrong} of {len(CRITICAL_MOVES)} predictions are off ({verdict}; the verdict of a later "
            "attempt says how many came before it)",
            MOVES_HINT,
        )
    return passed(
        f"all {len(CRITICAL_MOVES)} moves of E's critical batch, as the model gives them (α = 0), {verdict}"
    )

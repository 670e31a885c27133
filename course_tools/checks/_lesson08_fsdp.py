"""Lesson 08's prediction checker (exported by :mod:`course_tools.checks.lesson08`): what strategy E (FSDP,
gathered once) sends and holds per device, as functions of the parameters' bytes, the bytes kept whole and
the device count, judged at cases the checker builds from shapes and against the run's own measurement.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from course_lib import comms, parallel, strategies
from course_lib.config import PROFILES
from course_lib.model import CNNConfig

from ._common import call_answer, checker, fail, passed, require

FSDP_CASES = (("cpu", 8), ("cpu", 3), ("tiny", 8), ("tiny", 3), ("cpu", 2))
"""(profile, devices) at which the FSDP prediction is checked, shown in the notebook: at 3 devices most of
the cpu profile's leaves have no dimension divisible by 3 and stay whole; on the tiny model most leaves are
small. The checker adds :data:`HIDDEN_CASES` cases of CNNs drawn afresh at every call (not shown)."""

HIDDEN_CASES = 3
"""Cases on CNNs and device counts drawn at random at every call: a table of the shown cases' answers
(``fsdp_case`` returns them) does not pass."""


def _random_model(rng: np.random.Generator) -> CNNConfig:
    """A CNN of the lab's architecture with drawn widths (the drawn cases of :func:`check_fsdp_prediction`)."""
    widths = (4, 6, 8, 12, 16, 24, 32, 48)
    return CNNConfig(
        image_size=int(rng.choice((16, 32))),
        channels=tuple(int(c) for c in rng.choice(widths, 3)),
        hidden=int(rng.choice((12, 16, 40, 64, 96))),
        num_classes=int(rng.choice((7, 10, 12))),
    )


def fsdp_case(profile: str | CNNConfig, n: int) -> dict:
    """One FSDP case from shapes alone (float32): ``param_bytes``, ``replicated_bytes`` (the leaves
    :func:`course_lib.parallel.fsdp_specs` keeps whole), and the true ``sent`` (:mod:`course_lib.comms`'s
    prediction, which the lab checks against compiled programs) and ``state`` (params + momentum) per device.
    ``profile``: a name of :data:`course_lib.config.PROFILES` or a :class:`course_lib.model.CNNConfig`."""
    cfg = profile if isinstance(profile, CNNConfig) else PROFILES[profile].model
    shapes = comms.param_shapes(cfg)
    flat = [shape for leaves in shapes.values() for shape in leaves.values()]
    total = sum(int(np.prod(s)) for s in flat)
    whole = sum(int(np.prod(s)) for s in flat if parallel.fsdp_dim(tuple(s), n) is None)
    local = sum(
        int(np.prod(s)) // (1 if parallel.fsdp_dim(tuple(s), n) is None else n) for s in flat
    )
    sent = comms.total_sent(strategies.predict_comm("fsdp", cfg, 4 * n, n))
    return {
        "profile": profile if isinstance(profile, str) else "drawn",
        "n": n,
        "param_bytes": 4 * total,
        "replicated_bytes": 4 * whole,
        "sent": sent,
        "state": 2 * 4 * local,
    }


@checker
def check_fsdp_prediction(
    sent_fn: Callable, state_fn: Callable, measured_row=None, *, seed: int | None = None
) -> bool:
    """``sent_fn(param_bytes, replicated_bytes, n)`` and ``state_fn(...)``: E's bytes sent per device per
    step and its parameter + momentum bytes per device, checked within 2 % at every :data:`FSDP_CASES`
    (the checker's own shapes) and at :data:`HIDDEN_CASES` CNNs and device counts drawn at random (``seed``:
    for tests; None draws new ones at every call), then within 5 % against this run's measurement
    ``runs["fsdp"].row``.

    A wrong function is told how many cases it gets wrong, not which, nor the true values: a prediction
    fitted to the failures is not a prediction."""
    rng = np.random.default_rng(seed)
    cases = [fsdp_case(p, n) for p, n in FSDP_CASES]
    cases += [
        fsdp_case(_random_model(rng), int(rng.choice((2, 3, 4, 6, 8)))) for _ in range(HIDDEN_CASES)
    ]
    sent_wrong, state_wrong = [], []
    for case in cases:
        args = (case["param_bytes"], case["replicated_bytes"], case["n"])
        sent = _number("fsdp_sent_bytes", call_answer("fsdp_sent_bytes", sent_fn, *args))
        state = _number("fsdp_state_bytes", call_answer("fsdp_state_bytes", state_fn, *args))
        if not _close(sent, case["sent"], 0.02):
            sent_wrong.append((sent, case))
        if not _close(state, case["state"], 0.02):
            state_wrong.append((state, case))
    if sent_wrong:
        fail(
            f"fsdp_sent_bytes is wrong in {len(sent_wrong)} of {len(cases)} cases (device counts and "
            "models the checker tries)",
            _pattern_hint(sent_wrong, _SENT_PATTERNS, _SENT_HINT),
        )
    if state_wrong:
        fail(
            f"fsdp_state_bytes is wrong in {len(state_wrong)} of {len(cases)} cases (device counts and "
            "models the checker tries)",
            _pattern_hint(state_wrong, _STATE_PATTERNS, _STATE_HINT),
        )
    _judge_one_device(sent_fn, state_fn, fsdp_case(_random_model(rng), 1))
    if measured_row is not None and "profile" in measured_row:
        return _judge_measured(sent_fn, state_fn, measured_row)
    return passed(f"E's bytes sent and held match at {len(cases)} device counts and layouts")


def _judge_one_device(sent_fn: Callable, state_fn: Callable, case: dict) -> None:
    """The functions at ``n = 1`` (a drawn CNN): nothing sent, every parameter and its momentum held. The
    cases above start at 2 devices, so a function wrong only at ``n = 1`` would pass them."""
    args = (case["param_bytes"], case["replicated_bytes"], 1)
    sent = _number("fsdp_sent_bytes", call_answer("fsdp_sent_bytes", sent_fn, *args))
    state = _number("fsdp_state_bytes", call_answer("fsdp_state_bytes", state_fn, *args))
    if not (_close(sent, case["sent"], 0.02) and _close(state, case["state"], 0.02)):
        fail(
            f"on one device (n = 1) fsdp_sent_bytes returned {sent:,.0f} and fsdp_state_bytes {state:,.0f}",
            "one device sends nothing and holds every parameter and its momentum: the functions must hold "
            "at every n, 1 included",
        )


def _judge_measured(sent_fn: Callable, state_fn: Callable, row) -> bool:
    """Both functions against this run's measurement (8-byte values in a float64 run)."""
    n = int(row["n_devices"])
    case = fsdp_case(row["profile"], n)
    scale = 2 if row.get("precision") == "float64" else 1  # 8-byte values
    args = (scale * case["param_bytes"], scale * case["replicated_bytes"], n)
    true_sent = float(row["collective_bytes_per_device"])
    true_state = float(row["param_bytes_per_device"] + row["opt_state_bytes_per_device"])
    where = f"this run ({row.get('precision', 'float32')}, {n} devices)"
    for what, fn, truth in (
        ("fsdp_sent_bytes", sent_fn, true_sent),
        ("fsdp_state_bytes", state_fn, true_state),
    ):
        if not _close(_number(what, call_answer(what, fn, *args)), truth, 0.05):
            fail(
                f"{what} is right at the checker's cases but more than 5 % off the measurement of {where}",
                "the measurement counts every collective of the compiled program, the loss's all-reduce too",
            )
    return passed(
        f"at every case checked, and this run: E sends {true_sent:,.0f} B per device per step and "
        f"holds {true_state:,.0f} B of state per device"
    )


_SENT_HINT = (
    "list what E sends per step: one collective per sharded leaf in each direction of the step, one for "
    "the leaves kept whole (and the loss), and size each with the table of section 4"
)
_SENT_PATTERNS = (
    (
        lambda c: 2 * c["sent"],
        "each collective sends (n-1)/n of its bytes once: an all-gather forward, a reduce-scatter backward",
    ),
    (
        lambda c: c["sent"] / 2,
        "the backward pass sends too: the transpose of the all_gather is a reduce-scatter of the gradients",
    ),
    (
        lambda c: 1.5 * c["sent"],
        "that counts a second all-gather per leaf for the backward pass (ZeRO-3's re-gather); E gathers "
        "every parameter once, before the forward pass, and keeps it",
    ),
    (
        lambda c: c["sent"] * c["n"] / (c["n"] - 1) if c["n"] > 1 else None,
        "a device keeps its own block: (n-1)/n of the bytes travel",
    ),
)
_STATE_HINT = (
    "a sharded leaf is held in 1/n per device, a leaf fsdp_specs keeps whole is held whole on every device; "
    "count the momentum as well as the parameters"
)
_STATE_PATTERNS = (
    (
        lambda c: c["state"] / 2,
        "SGD with momentum keeps one momentum value per parameter: count it too",
    ),
    (
        lambda c: 2 * c["param_bytes"] if c["n"] > 1 else None,
        "FSDP shards both the parameters and the momentum over the devices",
    ),
    (
        lambda c: 2 * c["param_bytes"] / c["n"] if c["replicated_bytes"] else None,
        "the leaves fsdp_specs keeps whole (replicated_bytes) are held whole on every device",
    ),
)


def _pattern_hint(wrong: list, patterns, default: str) -> str:
    """The hint of the first typical mistake that every wrong case fits, else ``default`` (no formula)."""
    for guess, hint in patterns:
        expected = [guess(c) for _, c in wrong]
        if all(
            e is not None and _close(v, e, 0.02) for (v, _), e in zip(wrong, expected, strict=True)
        ):
            return hint
    return default


def _number(what: str, value) -> float:
    value = require(what, value, "return a number of bytes")
    try:
        return float(value)
    except (TypeError, ValueError):
        fail(f"{what} returned {value!r}", "return a number of bytes")


def _close(a: float, b: float, tol: float = 0.05) -> bool:
    return abs(a - b) <= tol * max(abs(b), 1.0)

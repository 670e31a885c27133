"""The papermill parameters of the course's runs (``make lab``, ``make course``, ``make scaling``): one place
for what each run passes each notebook, so that the runner checks them before any folder is made.

Used by :mod:`course_tools.run`; tested in ``tests/test_run.py``.
"""

from __future__ import annotations

import math
from pathlib import Path


def lab_params(n: int, platform: str, profile: str, run_dir: Path, **more) -> dict:
    """The lab's papermill parameters for a run into its own fresh folder."""
    params = {"n_devices": n, "platform": platform, "profile": profile, "results_dir": str(run_dir)}
    return {**params, "overwrite": True, **more}


LAB12 = "12_transformer_lab.ipynb"


LAB12_BATCH = 16
"""The transformer lab's committed ``global_batch``."""


def lab12_batch(n: int) -> int:
    """The transformer lab's ``global_batch`` on ``n`` devices: its committed 16 where every layout that fits
    splits it (1, 2, 4, 8), else the smallest multiple of what they need ≥ 16 (18 on 3), with a note. ``make
    course`` and ``make scaling`` pass it: a run at an odd count trains (``lm_runs.check_run``)."""
    from course_lib import lm_runs, strategies

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n_devices={n!r}: the transformer lab needs 1 device or more")
    needs = [lm_runs.batch_divisor(k, n) for k in strategies.LAYOUT_KEYS]
    lcm = math.lcm(*[d for d in needs if d])  # 1 where no layout fits
    if LAB12_BATCH % lcm == 0:
        return LAB12_BATCH
    batch = lcm * math.ceil(LAB12_BATCH / lcm)
    print(
        f"note: the transformer lab's global batch {LAB12_BATCH} does not split over the layouts that fit "
        f"{n} device(s) (they need a multiple of {lcm}); it runs with global_batch={batch}",
        flush=True,
    )
    return batch


def lab12_params(n: int, platform: str, results_dir: Path) -> dict:
    """The transformer lab's papermill parameters for a run into its own folder."""
    return {
        "n_devices": n,
        "platform": platform,
        "results_dir": str(results_dir),
        "overwrite": True,
        "global_batch": lab12_batch(n),
    }


def course_params(nb: Path, n: int, platform: str, out: Path, lab_params: dict | None) -> dict:
    """The papermill parameters of notebook ``nb`` in a ``make course`` run into ``out`` on ``n`` devices (the
    lab's ``lab_params`` added; the labs write their results under ``out``)."""
    params = {"n_devices": n, "platform": platform}
    if nb.name == "08_lab.ipynb":
        params.update(results_dir=str(out / "lab"), overwrite=False, **(lab_params or {}))
    if nb.name == LAB12:
        params.update(results_dir=str(out / "lab12"), overwrite=False, global_batch=lab12_batch(n))
    return params

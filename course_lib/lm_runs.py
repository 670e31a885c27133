"""Which transformer layouts run on a device count, and with which parameters: the checks that
``12_transformer_lab`` makes before anything is built (:func:`check_run`), what the global batch must be a
multiple of (:func:`batch_divisor`, used by ``make course`` and ``make scaling``), and why a layout is left out
(:func:`why_not`). The layouts themselves are :mod:`course_lib.lm_layouts`'s.
Tested in ``tests/test_lm_layouts.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .lm_layouts import fixed_axes, layout, mesh_axes

__all__ = ["why_not", "batch_divisor", "check_run"]


def why_not(key: str, n_devices: int) -> str | None:
    """Why layout ``key`` does not fit ``n_devices`` (None when it fits): the device count its axes after the
    first need, e.g. ``"needs a multiple of 2 devices (model=2)"`` for ``tp_sp`` on 5 devices."""
    if mesh_axes(key, n_devices) is not None:
        return None
    rest = fixed_axes(key)
    need = math.prod(rest.values())
    axes = " x ".join(f"{a}={s}" for a, s in rest.items())
    return f"needs a multiple of {need} devices ({axes})"


def batch_divisor(key: str, n_devices: int, n_micro: int = 2) -> int | None:
    """What the global batch must be a multiple of for layout ``key`` on ``n_devices``: the product of its
    batch axes (:func:`mesh_axes`), times ``n_micro`` for the pipeline (each data shard splits into
    micro-batches); None when the layout does not fit ``n_devices``."""
    sizes = mesh_axes(key, n_devices)
    if sizes is None:
        return None
    lay = layout(key)
    shards = math.prod(sizes[a] for a in lay.batch_axes)
    return shards * (n_micro if lay.stage_axis else 1)


def _plain(value):
    return value.item() if isinstance(value, np.generic) else value


def _whole(value) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def check_run(
    keys: Sequence[str], n_devices: int, global_batch: int, steps: int, *, n_micro: int = 2
) -> None:
    """Fail fast, before anything is built, when the lab cannot run layouts ``keys`` on ``n_devices`` with
    these parameters (``12_transformer_lab`` calls it right after choosing the layouts).

    Raises:
      ValueError: ``steps`` or ``global_batch`` not a whole number at least 1, a layout of ``keys`` that
        does not fit ``n_devices``, or a global batch that a layout's batch axes (and the pipeline's
        ``n_micro`` micro-batches per data shard) do not divide. The message names the value, the layout
        that needs more, and the nearest batches every layout of ``keys`` splits.
    """
    steps, global_batch = _plain(steps), _plain(global_batch)  # a message shows 0, not np.int64(0)
    for name, value in (("steps", steps), ("global_batch", global_batch), ("n_micro", n_micro)):
        if not _whole(value):
            raise ValueError(
                f"{name}={value!r} is a {type(value).__name__}, not a whole number: pass an int (papermill "
                f"-p {name} 16, not -r, which passes text; 16, not 16.0)"
            )
    if steps < 1:
        raise ValueError(
            f"steps={steps!r}: the lab needs at least 1 training step; set steps to 1 or more"
        )
    if n_micro < 1:
        raise ValueError(f"n_micro={n_micro!r}: a pipeline step needs at least 1 micro-batch")
    need = {}
    for key in keys:
        d = batch_divisor(key, n_devices, n_micro)
        if d is None:
            raise ValueError(
                f"layout {key!r} does not fit {n_devices} device(s) (mesh_axes({key!r}, {n_devices}) is "
                "None); leave it out"
            )
        need[key] = d
    lcm = math.lcm(*need.values())  # 1 for no layout
    if global_batch < 1:
        raise ValueError(
            f"global_batch={global_batch!r}: a step needs at least one sequence per data shard; set "
            f"global_batch to a positive multiple of {lcm} on {n_devices} device(s) (e.g. {2 * lcm})"
        )
    if global_batch % lcm == 0:
        return
    # the layout with the largest requirement that the batch misses: the one to name
    key = max((k for k, d in need.items() if global_batch % d), key=lambda k: need[k])
    lay, sizes = layout(key), mesh_axes(key, n_devices)
    shards = math.prod(sizes[a] for a in lay.batch_axes)
    why = f"{shards} data shards" + (f" x {n_micro} micro-batches" if lay.stage_axis else "")
    down, up = global_batch // lcm * lcm, (global_batch // lcm + 1) * lcm
    nearest = f"{down} or {up}" if down else f"{up}"
    raise ValueError(
        f"global batch {global_batch} does not split over layout {key!r} on {n_devices} device(s): it needs "
        f"a multiple of {need[key]} ({why}); set global_batch to a multiple of {lcm}, which every layout "
        f"of this run splits (e.g. {nearest})"
    )

"""Lesson 00, exercise 3: which arrays the learner's ``split_and_sum`` moved between devices, and why.

``RecordMoves`` wraps ``jax.device_put`` while the answer runs; ``judge_moves`` accepts only moves of the
rows to their devices and of the partial sums to the target, so a sum of ``x`` computed on the default
device and moved afterwards (the right values, computed in the wrong place) is refused.
"""

from __future__ import annotations

import numpy as np

from ._common import fail


class RecordMoves:
    """Record every ``jax.device_put(value, device)`` made while the learner's function runs."""

    def __enter__(self):
        import jax

        self.moves, self._put = [], jax.device_put

        def device_put(x, device=None, *args, **kwargs):
            self.moves.append((jax.tree.leaves(x), device))
            return self._put(x, device, *args, **kwargs)

        jax.device_put = device_put
        return self

    def __exit__(self, *exc):
        import jax

        jax.device_put = self._put


def judge_moves(moves, partials, devices, target, row_shape) -> None:
    """Every row-sized array that really changed device is a partial sum going to the target."""
    import jax

    sums = [np.asarray(p) for p in partials]
    for leaves, dst in moves:
        if isinstance(dst, jax.sharding.Sharding) and len(dst.device_set) == 1:
            (dst,) = dst.device_set
        for leaf in leaves:
            if np.shape(leaf) != row_shape or not isinstance(dst, jax.Device):
                continue
            if isinstance(leaf, jax.Array) and leaf.devices() == {dst}:
                continue  # already there: nothing moved
            same = [i for i, s in enumerate(sums) if np.array_equal(np.asarray(leaf), s)]
            if not same:
                fail(
                    f"a row-sized sum that is none of the partial sums was moved to {dst}: the total "
                    "was computed from x, not from the partial sums",
                    "build the total only from the partial sums: move each one to the target, then add",
                )
            if not any(dst == target != devices[i] for i in same):
                fail(
                    f"partial sum {same[0]} was moved to {dst}: it was computed somewhere else "
                    f"(from x), not where part {same[0]} lives",
                    "compute each partial sum from its committed part: part.sum(axis=0) runs on "
                    "that part's device, with no move",
                )

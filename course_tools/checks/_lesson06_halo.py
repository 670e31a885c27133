"""Lesson 06's exercise 4 (exported by :mod:`course_tools.checks.lesson06`): a stencil over a signal split
along its length, with the neighbours' edge rows exchanged by ``lax.ppermute`` (a halo exchange).

Values are compared with the stencil computed on the whole signal on the host, under ``shard_map`` on meshes
of 1, 2, 3, 4 and 8 of the notebook's devices (as many as it has: ``vmap`` cannot stand in for devices here,
its ``ppermute`` takes only full permutations); what each device sends is read from the program's jaxpr
under ``shard_map(check_vma=True)`` on an abstract 8-device mesh, which needs no devices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from course_lib.programs import jaxpr_equations

from ._common import fail
from ._lesson06_tp import public_name
from ._spmd import abstract, communicates, narrow_floats, precision_hint, run_mapped

_AXIS = "seq"

CASES = ((4, 4, 3, 2), (3, 2, 5, 1), (8, 3, 3, 3), (2, 5, 7, 2), (1, 5, 5, 2))
"""``(n devices, rows per block, kernel size, channels)``: blocks as short as the halo, kernels of 3, 5 and
7 taps, one device (no neighbours at all); a case needs ``n`` devices."""


def stencil(x: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """``out[i, c] = Σ_j kernel[j] · x[i + j - r, c]`` with ``r = len(kernel) // 2`` and ``x`` zero outside
    ``[0, L)``: the reference, on the whole signal ``x: [L, C]``."""
    r, length = len(kernel) // 2, x.shape[0]
    padded = np.concatenate([np.zeros((r, x.shape[1])), x, np.zeros((r, x.shape[1]))])
    return sum(kernel[j] * padded[j : j + length] for j in range(len(kernel)))


def _wrapped(x, kernel):  # the periodic stencil: the ends wrap around
    r = len(kernel) // 2
    return sum(kernel[j] * np.roll(x, r - j, axis=0) for j in range(len(kernel)))


def _local_only(x, kernel, n):  # every block padded with zeros: no exchange
    return np.concatenate([stencil(b, kernel) for b in np.split(x, n)])


def _judge_values(fn: Callable, devices: Sequence[Any], rng) -> list[int]:
    judged = []
    for n, rows, k, c in CASES:
        if n > len(devices):
            continue
        x = rng.standard_normal((n * rows, c)).astype(np.float32)
        kernel = rng.standard_normal(k).astype(np.float32)  # not symmetric: a flipped kernel shows
        mesh = Mesh(np.array(list(devices)[:n]), (_AXIS,), axis_types=(AxisType.Auto,))
        mapped = jax.jit(
            jax.shard_map(
                partial(fn, axis_name=_AXIS),
                mesh=mesh,
                in_specs=(P(_AXIS), P()),
                out_specs=P(_AXIS),
            )
        )
        hint = (
            "return the stencil of this device's block (ppermute's result varies, like the block)"
        )
        got = np.asarray(run_mapped("halo_stencil", mapped, x, kernel, varies_hint=hint))
        where = f"on {n} device(s), blocks of {rows} rows, a kernel of {k} taps"
        judged.append(n)
        if got.shape != (n * rows, c):
            fail(
                f"{where}: a block [{rows}, {c}] came back as [{got.shape[0] // n}, {got.shape[1:]}]",
                "return the stencil of this device's rows only: the block's shape",
            )
        want = stencil(x, kernel)
        if np.allclose(got, want, rtol=1e-5, atol=1e-5):
            continue
        close = partial(np.allclose, got, rtol=1e-5, atol=1e-5)
        if close(stencil(x, kernel[::-1])):
            fail(
                f"{where}: you computed the convolution with the kernel reversed",
                "out[i] = Σ_j kernel[j] · x[i + j - r]: kernel[0] weighs the row r before i",
            )
        if close(_wrapped(x, kernel)):
            fail(
                f"{where}: the first and last rows of the whole signal see the other end",
                "the signal is zero outside [0, L): a ring (i -> (i + 1) % n) wraps the ends around; the "
                "first and last devices have no neighbour on one side, so leave that pair out of the "
                "permutation (ppermute fills what no one sends with zeros)",
            )
        if n > 1 and close(_local_only(x, kernel, n)):
            fail(
                f"{where}: every block is computed as if the signal ended at its edges",
                "the first r rows of a block need the last r rows of the block before it, the last r rows "
                "the first r rows of the block after it: exchange them with lax.ppermute",
            )
        narrow = narrow_floats(jax.make_jaxpr(mapped)(x, kernel))
        if narrow:
            fail(
                f"{where}: the result differs from the stencil of the whole signal",
                precision_hint(narrow),
            )
        bad = np.unique(np.nonzero(~np.isclose(got, want, rtol=1e-5, atol=1e-5).all(1))[0] % rows)
        fail(
            f"{where}: the result differs from the stencil of the whole signal at rows {bad.tolist()} of "
            "a block",
            "device i needs the last r rows of device i-1 (before its first row) and the first r rows "
            "of device i+1 (after its last row): check which block each ppermute sends, and where",
        )
    return judged


def _judge_traffic(fn: Callable) -> tuple[float, int]:
    """What each device sends on an 8-device mesh, blocks of 6 rows, 3 channels, a kernel of 5 taps."""
    n, rows, c, k = 8, 6, 3, 5
    mapped = jax.shard_map(
        partial(fn, axis_name=_AXIS),
        mesh=abstract((n,), (_AXIS,)),
        in_specs=(P(_AXIS), P()),
        out_specs=P(_AXIS),
    )
    args = (
        jax.ShapeDtypeStruct((n * rows, c), jnp.float32),
        jax.ShapeDtypeStruct((k,), jnp.float32),
    )
    hint = "return the stencil of this device's block (ppermute's result varies, like the block)"
    jaxpr = run_mapped(
        "halo_stencil under shard_map", jax.make_jaxpr(mapped), *args, varies_hint=hint
    )
    sent, other = 0, set()
    for eqn, times in jaxpr_equations(jaxpr):
        if eqn.primitive.name == "ppermute":
            sent += times * sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.invars)
        elif communicates(eqn):
            other.add(eqn.primitive.name)
    if other:
        fail(
            f"the stencil uses {sorted({public_name(o) for o in other})}",
            "gathering or summing over the axis moves far more than the halo: send each neighbour "
            "only the rows it needs, with lax.ppermute",
        )
    halo = 2 * (k // 2) * c * 4
    if sent > 1.01 * halo:
        fail(
            f"with blocks of {rows} rows, {c} channels and a kernel of {k} taps each device sends "
            f"{sent} bytes; the halo is 2 · r · C · 4 = {halo} bytes",
            "send each neighbour only the r = len(kernel) // 2 edge rows it needs, not the whole block",
        )
    if sent < 0.99 * halo:
        fail(
            f"on 8 devices each device sends {sent} bytes; the neighbours need its 2 · r · C · 4 = {halo} "
            "bytes of edge rows",
            "the first r rows of a block need the last r rows of the block before it, the last r rows "
            "the first r rows of the block after it: exchange them with lax.ppermute",
        )
    return sent, halo


def check_halo_stencil(fn: Callable, devices: Sequence[Any]) -> tuple[list[int], float, int]:
    """Judge a stencil over a signal split along its length (exercise 4).

    Spec: ``fn(x_block, kernel, axis_name)`` — ``x_block: f32[L/n, C]`` this device's rows of a signal
    ``x: f32[L, C]`` split over ``axis_name``, ``kernel: f32[K]`` with ``K = 2r + 1`` odd and ``L/n >= r``,
    the same on every device — returns this device's rows of ``out[i, c] = Σ_j kernel[j] · x[i + j - r, c]``
    with ``x`` zero outside ``[0, L)`` (no wrapping around), and

    - equals that stencil on the whole signal for every case of :data:`CASES` that ``devices`` can hold
      (1, 2, 3, 4 and 8 devices in a row, blocks as short as the halo, kernels of 3 to 7 taps), under
      ``shard_map`` with ``check_vma=True``;
    - under ``shard_map(check_vma=True)`` on 8 devices communicates with ``lax.ppermute`` only, each
      device sending exactly its halo, ``2 · r · C`` values (its first and its last ``r`` rows).

    Returns ``(the device counts judged, bytes each device sends, the halo's bytes)`` (the bytes on the
    8-device case); raises ExerciseError naming the first broken rule.
    """
    judged = _judge_values(fn, devices, np.random.default_rng(12))
    return (judged, *_judge_traffic(fn))

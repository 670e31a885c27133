"""Numerical precision of a lab run: ``float32`` (default), ``float64`` or ``bfloat16`` mixed precision.

- ``float64`` (XLA:CPU, XLA:GPU; refused on XLA:TPU, :func:`check_runs`): parameters, optimizer state, images
  and every computation in float64 (``jax_enable_x64``).
  Every strategy then equals single-device ``jit`` at every step within 1e-10 relative (the lab asserts
  it and prints the largest difference): the evidence that the parallel programs compute the same
  mathematics (``notebooks/08_lab.ipynb``, "Parity").
- ``float32``: everything in float32; XLA chooses how float32 matmuls and convolutions are computed unless
  ``jax_default_matmul_precision`` says otherwise (TF32 on recent NVIDIA GPUs by default; no effect on CPU),
  so results record :func:`matmul_precision`.
- ``bfloat16``: the usual mixed-precision recipe — bfloat16 activations and conv/matmul inputs, float32
  parameters (master weights), optimizer state and loss (:func:`compute_in`). The gradients the update
  reads are float32. *Where they are summed over devices, and in which dtype*, depends on the strategy and
  the platform (``notebooks/08_lab.ipynb``, "the bfloat16 partial-sum pitfall"):

  ==========================  ==========================================  ========================
  strategy                    the gradient all-reduce sums                bytes per value moved
  ==========================  ==========================================  ========================
  ``pmap`` (B)                float32: the cast's transpose runs on each   4
                              device before ``pmean``
  ``shard_map`` (C, E)        float32, when the parameters are made to     4
                              vary over ``data`` before the cast (below)
  sharded ``jit`` (D, E′)     bfloat16 partial sums: the partitioner       XLA:GPU 2; XLA:CPU 4
                              all-reduces the backward pass's bf16         (``AllReducePromotion``
                              results, then casts them to float32          sums them in float32)
  ==========================  ==========================================  ========================

Where the bfloat16 cast sits matters inside ``shard_map`` (``check_vma=True``): a replicated parameter is
implicitly broadcast (``pvary``) where it meets data that varies over the ``data`` axis, and the transpose of
that broadcast is the gradient's all-reduce. Cast first, and that all-reduce sums bfloat16 gradients; make
the parameters vary over ``data`` first (``lax.pcast(p, "data", to="varying")``), then cast, and it sums
float32 gradients (the cast's transpose comes before it). :func:`compute_in` does the latter when given the
data axis. Sharded ``jit`` has no such choice in the step body: the partitioner places the all-reduce after
the backward convolution or matmul that produced the partial sum, in that op's dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

PRECISIONS = ("float32", "float64", "bfloat16")
"""The lab's ``precision`` parameter values."""

PARAM_DTYPES = {"float32": jnp.float32, "float64": jnp.float64, "bfloat16": jnp.float32}
"""dtype of parameters, gradients and optimizer state per precision (bfloat16 keeps float32 master weights)."""

COMPUTE_DTYPES = {"float32": None, "float64": None, "bfloat16": jnp.bfloat16}
"""dtype activations and conv/matmul inputs are cast to (None: the parameters' dtype)."""


def check(precision: str) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`; else a ValueError naming it and the choices."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {list(PRECISIONS)}")
    return precision


@contextlib.contextmanager
def enabled(precision: str) -> Iterator[None]:
    """Context in which ``precision``'s arrays can be made: ``jax.enable_x64(True)`` for float64, else
    nothing. Arrays made inside stay float64 outside; computations on them should run inside too."""
    if check(precision) == "float64":
        with jax.enable_x64(True):
            yield
    else:
        yield


def cast_params(tree: Any, precision: str) -> Any:
    """Every floating leaf of ``tree`` (parameters, optimizer state) in :data:`PARAM_DTYPES` [precision].

    Call inside :func:`enabled` for float64 (outside it, JAX would make float32 arrays again).
    """
    dtype = PARAM_DTYPES[check(precision)]

    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x

    return jax.tree.map(cast, tree)


def cast_batch(batch: tuple[jax.Array, jax.Array], precision: str) -> tuple[jax.Array, jax.Array]:
    """``(images, labels)`` with the images in the parameters' dtype (labels stay int32); keeps the sharding."""
    images, labels = batch
    return images.astype(PARAM_DTYPES[check(precision)]), labels


def compute_in(
    apply_fn: Callable[..., jax.Array], precision: str, vary_over: str | None = None
) -> Callable[..., jax.Array]:
    """``apply_fn(params, images, **kw)`` computed in :data:`COMPUTE_DTYPES` [precision], logits float32.

    For ``bfloat16``: parameters and images are cast to bfloat16 at the call, so every conv and matmul takes
    bfloat16 inputs and its activations are bfloat16; the logits are cast back to float32 for the loss, and
    the gradients flow back to the float32 parameters. Other precisions return ``apply_fn`` unchanged.

    Args:
      apply_fn: ``(params, images, **kw) -> logits``.
      precision: one of :data:`PRECISIONS`.
      vary_over: inside ``shard_map``, the data axis: parameters are made varying over it *before* the cast,
        so the gradients are summed over it in float32 (see the module docstring).
    """
    dtype = COMPUTE_DTYPES[check(precision)]
    if dtype is None:
        return apply_fn

    def mixed(params, images, **kw):
        if vary_over is not None:
            params = jax.tree.map(lambda p: _vary(p, vary_over), params)
        params, images = jax.tree.map(lambda x: x.astype(dtype), (params, images))
        return apply_fn(params, images, **kw).astype(jnp.float32)

    return mixed


def _vary(x: jax.Array, axis: str) -> jax.Array:
    try:
        return lax.pcast(x, axis, to="varying")
    except (
        ValueError
    ):  # already varying over the axis (a sharded or gathered parameter): nothing to do
        return x


def matmul_precision() -> str:
    """``jax_default_matmul_precision`` as results record it: its value, or ``"default"`` when unset."""
    return jax.config.jax_default_matmul_precision or "default"


# The relative rounding of a float32 matmul's or convolution's inputs, per platform and per
# ``jax_default_matmul_precision`` (unit roundoff u = 2^-(mantissa bits + 1) of what the hardware multiplies):
# XLA:CPU multiplies in float32 whatever the setting; XLA:TPU's DEFAULT is one bfloat16 pass (8 bits), "high"
# three bfloat16 passes (about 16 bits), "highest" six (float32); XLA:GPU's DEFAULT is TF32 (11 bits) on
# NVIDIA Ampere and later. Measured on one TPU v5e chip (JAX 0.10.2): a float32 512 x 512 matmul's largest
# relative error against float64 is 2.4e-3 / 1.4e-5 / 1.3e-7 at default / high / highest.
_F32 = 2.0**-24
MATMUL_UNIT_ROUNDOFF = {
    "cpu": {
        "default": _F32,
        "bfloat16": 2.0**-9,
        "tensorfloat32": 2.0**-11,
        "high": _F32,
        "highest": _F32,
    },
    "tpu": {
        "default": 2.0**-9,
        "bfloat16": 2.0**-9,
        "tensorfloat32": 2.0**-17,
        "high": 2.0**-17,
        "highest": _F32,
    },
    "gpu": {
        "default": 2.0**-11,
        "bfloat16": 2.0**-9,
        "tensorfloat32": 2.0**-11,
        "high": 2.0**-11,
        "highest": _F32,
    },
}
"""Unit roundoff of a float32 matmul's inputs: ``MATMUL_UNIT_ROUNDOFF[backend][matmul precision]``."""

FLOAT32_RTOL_FLOOR = 1e-5
"""The tolerance the course's float32 comparisons use where matmuls are computed in float32 (XLA:CPU)."""


def float32_rtol(
    backend: str | None = None, precision: str | None = None, *, roundings: int = 8
) -> float:
    """Relative tolerance for two float32 results that differ only in how matmuls and convolutions round.

    ``max(FLOAT32_RTOL_FLOOR, roundings * u)`` where ``u`` is :data:`MATMUL_UNIT_ROUNDOFF` of the platform and
    the matmul precision in force: 1e-5 on XLA:CPU, about 1.6e-2 on a TPU at JAX's default precision (its
    float32 matmuls multiply bfloat16 inputs), about 3.9e-3 on a recent NVIDIA GPU (TF32). Every lesson's
    float32 assert that compares a computation with matmuls against another order of the same computation
    takes its tolerance from here (``notebooks/01_grad.ipynb`` introduces it).

    Args:
      backend: ``"cpu"``, ``"gpu"`` or ``"tpu"``; ``None`` reads ``jax.default_backend()``.
      precision: a ``jax_default_matmul_precision`` value; ``None`` reads the one in force.
      roundings: how many input roundings the compared results may differ by (8 covers a few layers).

    Returns:
      The relative tolerance, a float.

    Raises:
      ValueError: an unknown backend or precision, naming the known ones.
    """
    backend = jax.default_backend() if backend is None else backend
    precision = (precision or matmul_precision()).lower()
    precision = {"float32": "highest", "bfloat16_3x": "high", "fastest": "default"}.get(
        precision, precision
    )
    table = MATMUL_UNIT_ROUNDOFF.get(backend)
    if table is None or precision not in table:
        raise ValueError(
            f"no matmul rounding known for backend={backend!r}, precision={precision!r}: backends "
            f"{sorted(MATMUL_UNIT_ROUNDOFF)}, precisions {sorted(MATMUL_UNIT_ROUNDOFF['cpu'])}"
        )
    return max(FLOAT32_RTOL_FLOOR, roundings * table[precision])


def float64_runs(backend: str | None = None) -> bool:
    """Whether the course runs its float64 parity checks on ``backend`` (``None``: JAX's default backend).

    True on XLA:CPU and XLA:GPU, which compute float64 natively. False on a TPU: XLA:TPU emulates float64
    (programs take minutes to compile), and on one TPU v5e with JAX 0.10.2 the float64 max-pool gradient
    (``select-and-scatter``) was observed not to compile (UNIMPLEMENTED; ``data/tpu_reference/``), so the
    lessons say so and check float32 parity with :func:`float32_rtol` instead.
    """
    backend = jax.default_backend() if backend is None else backend
    return backend != "tpu"


def check_runs(precision: str, backend: str | None = None) -> str:
    """``precision`` if it is one of :data:`PRECISIONS` and the course runs it on ``backend`` (``None``:
    JAX's default backend); else a ValueError naming the value and the fix.

    Raises:
      ValueError: an unknown precision, or ``"float64"`` where :func:`float64_runs` is False (XLA:TPU).
    """
    if check(precision) == "float64" and not float64_runs(backend):
        raise ValueError(
            f"precision={precision!r} does not run on XLA:TPU: float64 is emulated there (programs take "
            "minutes to compile) and, on one TPU v5e with JAX 0.10.2, the float64 select-and-scatter "
            "(the max-pool gradient) was observed not to compile (UNIMPLEMENTED); "
            "use precision='float32' (or 'bfloat16')"
        )
    return precision


# ---- the lessons' parity checks (notebooks 10, 11) --------------------------------------------------------


def parity_dtype(backend: str | None = None) -> Any:
    """The dtype the lessons' parity checks compute in: ``jnp.float64`` where :func:`float64_runs`, else
    ``jnp.float32`` (XLA:TPU). Float64 arrays need :func:`parity_x64` (or ``jax_enable_x64``) in force."""
    return jnp.float64 if float64_runs(backend) else jnp.float32


def parity_x64(backend: str | None = None) -> contextlib.AbstractContextManager:
    """``jax.enable_x64(True)`` where the parity checks run in float64; a context that does nothing where
    they run in float32."""
    return jax.enable_x64(True) if float64_runs(backend) else contextlib.nullcontext()


def parity_bound(float64_bound: float, backend: str | None = None) -> float:
    """What a parity check asserts its :func:`parity_diff` below: ``float64_bound`` (an absolute
    difference, e.g. 1e-10) where float64 runs; :func:`float32_rtol` (relative) where it does not.

    Args:
      float64_bound: the check's bound in float64, > 0.

    Raises:
      ValueError: ``float64_bound`` not a positive number (named).
    """
    if not float64_bound > 0:
        raise ValueError(f"float64_bound={float64_bound!r} must be a positive number such as 1e-10")
    return float64_bound if float64_runs(backend) else float32_rtol(backend)


def parity_diff(diff: float, reference: Any, backend: str | None = None) -> float:
    """A largest absolute difference ``diff`` from ``reference`` (an array or a number) as a parity check
    compares it with :func:`parity_bound`: as it is where float64 runs; divided by ``max |reference|``
    (1 for an all-zero reference) where it does not (float32 differences scale with the values)."""
    if float64_runs(backend):
        return float(diff)
    scale = float(jnp.max(jnp.abs(jnp.asarray(reference))))
    return float(diff) / (scale or 1.0)


class ParitySetup(NamedTuple):
    """What a lesson's parity checks need, from :func:`parity_setup` (notebooks 10 and 11)."""

    float64: bool  # whether the checks run in float64 (:func:`float64_runs`)
    dtype: Any  # the checks' dtype (:func:`parity_dtype`)
    bound: Callable[[float], float]  # :func:`parity_bound` for this backend
    diff: Callable[[float, Any], float]  # :func:`parity_diff` for this backend
    x64: Callable[[], contextlib.AbstractContextManager]  # :func:`parity_x64` for this backend
    compile_once: dict[str, Any] | None  # compiler options for programs that run only a few times

    @property
    def note(self) -> str:
        """One line saying how the checks compare where they do not run in float64; ``""`` where they do."""
        if self.float64:
            return ""
        return (
            f"the parity checks run in float32, within {self.bound(1.0):.1e} relative: XLA:TPU emulates "
            "float64 (its programs take minutes to compile)"
        )


def parity_setup(backend: str) -> ParitySetup:
    """The parity checks' dtype, bound and compile options on ``backend`` (``"cpu"``, ``"gpu"``, ``"tpu"``).

    In float64 where it runs (XLA:CPU, XLA:GPU) a check asserts an absolute difference below its bound
    (e.g. 1e-10); on XLA:TPU it runs in float32 and compares the difference relative to the reference
    with :func:`float32_rtol`. ``compile_once`` compiles XLA:CPU programs without LLVM's optimisations
    (``xla_backend_optimization_level=0``: about half the compile time, the same values), for programs
    that run a few times; ``None`` elsewhere. Timed programs are compiled as usual.

    Returns:
      ParitySetup, unpacked by the lessons as ``F64, DTYPE, tol, scaled, parity_x64, once``.

    Raises:
      ValueError: ``backend`` is not ``"cpu"``, ``"gpu"`` or ``"tpu"``.
    """
    if backend not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"backend={backend!r}: expected 'cpu', 'gpu' or 'tpu'")
    return ParitySetup(
        float64=float64_runs(backend),
        dtype=parity_dtype(backend),
        bound=lambda bound: parity_bound(bound, backend),
        diff=lambda diff, reference: parity_diff(diff, reference, backend),
        x64=lambda: parity_x64(backend),
        compile_once={"xla_backend_optimization_level": 0} if backend == "cpu" else None,
    )

"""Mesh builders: a 1-D ``data`` mesh and a 2-D ``data × model`` mesh, axis types stated explicitly.

``jax.make_mesh`` defaults to *Explicit* axis types in JAX 0.12 while ``jax.sharding.Mesh`` defaults to
*Auto* (``notebooks/05_sharding.ipynb`` shows both): the builders here always pass ``axis_types`` so the reader
sees which one is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import AxisType, Mesh

DATA = "data"
"""Name of the data-parallel mesh axis (the batch is split over it)."""
MODEL = "model"
"""Name of the tensor-parallel mesh axis (layer features are split over it)."""
CONTEXT = "context"
"""Name of the context-parallel axis: the sequence is split over it (ring attention, ``10_transformers``)."""
STAGE = "stage"
"""Name of the pipeline axis: each device holds a slice of the layers (``11_pipeline_experts``)."""
EXPERT = "expert"
"""Name of the expert-parallel axis: each device holds some of a mixture's experts (``11_pipeline_experts``)."""

AXIS_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


def _axis_type(axis_type: str | AxisType) -> AxisType:
    if isinstance(axis_type, AxisType):
        return axis_type
    try:
        return AXIS_TYPES[str(axis_type).lower()]
    except KeyError:
        raise ValueError(f"axis_type={axis_type!r} must be one of {sorted(AXIS_TYPES)}") from None


def _devices(devices: Sequence[Any] | None, n: int | None = None) -> list[Any]:
    if devices is None:
        import jax

        devices = jax.devices()
    devices = list(devices)
    if n is not None:
        if n > len(devices):
            raise ValueError(
                f"asked for {n} devices but only {len(devices)} were given; use n <= {len(devices)}"
            )
        devices = devices[:n]
    if not devices:
        raise ValueError("no devices given; pass report.devices from setup_devices()")
    return devices


def data_mesh(devices: Sequence[Any] | None = None, axis_type: str | AxisType = "explicit") -> Mesh:
    """A 1-D mesh ``{data: len(devices)}`` for data parallelism.

    Args:
      devices: the devices, in order (default: all of ``jax.devices()``).
      axis_type: ``"explicit"`` or ``"auto"`` (``jax.sharding.AxisType``).
    """
    devs = _devices(devices)
    return Mesh(np.array(devs), (DATA,), axis_types=(_axis_type(axis_type),))


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` in increasing order: the sizes an axis of ``n`` devices can take."""
    return [d for d in range(1, n + 1) if n % d == 0]


def choose_mesh_shape(n_devices: int, model: int | None = None) -> tuple[int, int]:
    """A valid ``(n_data, n_model)`` split of ``n_devices``.

    Args:
      n_devices: total devices (≥ 1).
      model: the model-axis size wanted; default 2 when ``n_devices`` is even (the source article's
        4 × 2 on 8 devices), else 1. ``n_devices = 1`` gives ``(1, 1)``.

    Raises:
      ValueError: ``n_devices`` < 1, or ``model`` < 1 or not a divisor of ``n_devices``.
    """
    if isinstance(n_devices, bool) or not isinstance(n_devices, int) or n_devices < 1:
        raise ValueError(f"n_devices={n_devices!r} must be a positive integer")
    if model is None:
        model = 2 if n_devices % 2 == 0 else 1
    if isinstance(model, bool) or not isinstance(model, int) or model < 1:
        raise ValueError(f"model={model!r} must be a positive integer")
    if n_devices % model:
        raise ValueError(
            f"a model axis of {model} does not divide {n_devices} devices; choose one of {divisors(n_devices)}"
        )
    return n_devices // model, model


def data_model_mesh(
    devices: Sequence[Any] | None = None,
    shape: tuple[int, int] | None = None,
    axis_type: str | AxisType = "explicit",
) -> Mesh:
    """A 2-D mesh ``{data: n_data, model: n_model}``.

    Devices are laid out row-major: the ``model`` axis varies fastest, so a model group holds neighbouring
    devices (on a GPU server, the ones with the fastest links).

    Args:
      devices: the devices (default: all of ``jax.devices()``).
      shape: ``(n_data, n_model)``; default :func:`choose_mesh_shape` of the device count.
      axis_type: ``"explicit"`` or ``"auto"``, for both axes.

    Raises:
      ValueError: ``n_data * n_model`` differs from the number of devices.
    """
    devs = _devices(devices)
    if shape is None:
        shape = choose_mesh_shape(len(devs))
    if len(tuple(shape)) != 2 or any(
        isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1 for v in shape
    ):
        raise ValueError(
            f"mesh shape {shape!r} must be two positive integers (n_data, n_model), e.g. {choose_mesh_shape(len(devs))}"
        )
    n_data, n_model = shape
    if n_data * n_model != len(devs):
        raise ValueError(
            f"mesh shape (data={n_data}, model={n_model}) needs {n_data * n_model} devices but "
            f"{len(devs)} were given; use data * model == {len(devs)}, e.g. {choose_mesh_shape(len(devs))}"
        )
    t = _axis_type(axis_type)
    return Mesh(np.array(devs).reshape(n_data, n_model), (DATA, MODEL), axis_types=(t, t))


def mesh_of(
    axes: dict[str, int],
    devices: Sequence[Any] | None = None,
    axis_type: str | AxisType = "explicit",
) -> Mesh:
    """A mesh with the named axes, in the order given; the last axis varies fastest over the devices.

    Lessons 10–12 combine axes this way, e.g. ``mesh_of({DATA: 2, STAGE: 2, MODEL: 2})``; put the axis whose
    collectives are most frequent last, so its groups are neighbouring devices (on a GPU server, the ones with
    the fastest links).

    Args:
      axes: axis name → size, e.g. ``{"data": 4, "model": 2}``.
      devices: the devices (default: all of ``jax.devices()``); their number must equal the sizes' product.
      axis_type: ``"explicit"`` or ``"auto"``, for every axis.

    Raises:
      ValueError: an empty ``axes``, a size that is not a positive integer, a repeated name, or a product of
        sizes that differs from the number of devices.
    """
    devs = _devices(devices)
    if not axes:
        raise ValueError("axes is empty; name at least one axis, e.g. {'data': len(devices)}")
    for name, size in axes.items():
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"axis {name!r} has size {size!r}; sizes must be positive integers")
    total = int(np.prod(list(axes.values())))
    if total != len(devs):
        raise ValueError(
            f"mesh {dict(axes)} needs {total} devices but {len(devs)} were given; "
            f"choose sizes whose product is {len(devs)} (each a divisor: {divisors(len(devs))})"
        )
    t = _axis_type(axis_type)
    shape = tuple(int(s) for s in axes.values())
    return Mesh(np.array(devs).reshape(shape), tuple(axes), axis_types=(t,) * len(shape))


def describe(mesh: Mesh) -> str:
    """``"data=4 x model=2"`` style description of a mesh's axes."""
    return " x ".join(f"{name}={size}" for name, size in mesh.shape.items())

"""Synthetic image-classification data, generated on the device from a PRNG key.

Each class has a fixed prototype image (a random 4 × 4 grid of colours, resized to the image size); an
example is ``signal * prototype[label] + noise`` with unit Gaussian noise per pixel. A CNN
learns this (the loss falls within a few steps), at any image size, with no download. Batches are made by
a jitted function whose output can be placed straight into a sharding, so the data is generated on the
devices that consume it (the source article: "generating data on the device doubled its throughput").

JAX's PRNG is partitionable (``jax_threefry_partitionable``, the default), so a batch generated with any
sharding holds the same values as the one generated on a single device: every strategy sees the same
global batches.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .meshes import DATA, data_mesh


@dataclasses.dataclass(frozen=True)
class SyntheticImages:
    """A synthetic dataset: class prototypes fixed by ``seed``.

    Attributes:
      image_size: height = width, pixels.
      num_classes: number of classes; labels are int32 in ``[0, num_classes)``.
      seed: fixes the class prototypes (not the batches: those come from the key given to :meth:`batch`).
      signal: prototype amplitude relative to unit Gaussian noise; larger is easier.
      channels: image channels (3).
    """

    image_size: int = 32
    num_classes: int = 10
    seed: int = 0
    signal: float = 0.5
    channels: int = 3

    def __post_init__(self):
        if not isinstance(self.image_size, int) or self.image_size <= 0:
            raise ValueError(f"image_size={self.image_size!r} must be a positive integer, e.g. 32")
        if not isinstance(self.num_classes, int) or self.num_classes < 2:
            raise ValueError(f"num_classes={self.num_classes!r} must be an integer >= 2")

    def batch(self, key: jax.Array, batch_size: int, sharding: jax.sharding.Sharding | None = None):
        """One batch ``(images, labels)``.

        Args:
          key: PRNG key for this batch (split or fold in the step number for the next one).
          batch_size: number of examples (the *global* batch when ``sharding`` splits it).
          sharding: where to generate it, e.g. ``NamedSharding(mesh, P("data"))``; default: the default device.

        Returns:
          images: float32 [batch_size, image_size, image_size, channels]; labels: int32 [batch_size].

        Raises:
          ValueError: ``batch_size`` ≤ 0, or not divisible by the number of shards of the leading axis.
        """
        batch_size = _positive_int(batch_size, "batch_size")
        if sharding is not None:
            check_divisible(batch_size, _leading_shards(sharding), "batch")
            out = (sharding, sharding)
        else:
            out = None
        return _batch_fn(self, batch_size, out)(key)


def _positive_int(value: Any, name: str) -> int:
    from .config import positive_int  # the one rule for counts (config imports this module)

    return positive_int(value, name)


def _leading_shards(sharding: jax.sharding.Sharding) -> int:
    if (
        isinstance(sharding, NamedSharding)
        and len(sharding.spec) > 0
        and sharding.spec[0] is not None
    ):
        axes = sharding.spec[0] if isinstance(sharding.spec[0], tuple) else (sharding.spec[0],)
        n = 1
        for a in axes:
            n *= sharding.mesh.shape[a]
        return n
    return 1


def check_divisible(size: int, parts: int, what: str = "global batch", axis: str = "data") -> None:
    """Raise a ValueError naming the numbers when ``size`` does not split evenly into ``parts``.

    Example message: "global batch 100 is not divisible by 8 data shards; use a multiple of 8 (e.g. 104)".
    """
    if parts <= 0:
        raise ValueError(f"cannot split {what} {size} into {parts} {axis} shards")
    if size % parts:
        up = (size // parts + 1) * parts
        down = (size // parts) * parts
        alt = f"{down} or {up}" if down > 0 else f"{up}"
        raise ValueError(
            f"{what} {size} is not divisible by {parts} {axis} shards; use a multiple of {parts} (e.g. {alt})"
        )


def _generate(ds: SyntheticImages, batch_size: int, key: jax.Array):
    proto_key = jax.random.key(ds.seed)
    shape = (ds.num_classes, ds.image_size, ds.image_size, ds.channels)
    # Low-frequency prototypes (a 4x4 grid of random colours, resized): class structure survives pooling.
    coarse = _normal(proto_key, (ds.num_classes, 4, 4, ds.channels))
    prototypes = jax.image.resize(coarse, shape, method="linear")
    k_label, k_noise = jax.random.split(key)
    labels = jax.random.randint(k_label, (batch_size,), 0, ds.num_classes, dtype=jnp.int32)
    noise = _normal(k_noise, (batch_size,) + shape[1:])
    images = ds.signal * prototypes[labels] + noise
    return images, labels


def _normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``jax.random.normal(key, shape)`` drawn flat and reshaped: the partitionable PRNG gives the same
    random bits for both shapes, and XLA:CPU compiles the 1-D draw about four times faster than the 4-D one.
    The float transform from bits to normals is compiled for each shape, so the two agree to a few ulp (bit
    for bit on some CPUs, one ulp apart on others: ``tests/test_data.py``)."""
    return jax.random.normal(key, (math.prod(shape),), jnp.float32).reshape(shape)


_CACHE: dict[Any, Any] = {}


def _batch_fn(ds, batch_size, out_shardings):
    cache_key = (ds, batch_size, out_shardings)
    fn = _CACHE.get(cache_key)
    if fn is None:
        fn = jax.jit(partial(_generate, ds, batch_size), out_shardings=out_shardings)
        _CACHE[cache_key] = fn
    return fn


def batches(
    ds: SyntheticImages,
    key: jax.Array,
    steps: int,
    batch_size: int,
    sharding=None,
    transform: Callable[[Any], Any] | None = None,
) -> list:
    """``steps`` batches, batch *i* made from ``jax.random.fold_in(key, i)``: the same for every strategy.

    ``transform`` (e.g. a cast to bfloat16) is applied to each batch as it is made, so only one batch in
    its generated form is alive at a time: on a device with little memory to spare, a list of float32
    batches cast afterwards would hold both lists at once (and fragment the allocator).

    Returns a list of ``(images, labels)`` tuples, each as :meth:`SyntheticImages.batch` describes
    (after ``transform``).
    """
    steps = _positive_int(steps, "steps")
    transform = transform or (lambda b: b)
    return [
        transform(ds.batch(jax.random.fold_in(key, i), batch_size, sharding)) for i in range(steps)
    ]


def split_leading(x: jax.Array, n: int) -> jax.Array:
    """``[B, ...]`` → ``[n, B // n, ...]`` (B divisible by n): the layout ``pmap`` maps over."""
    return x.reshape((n, x.shape[0] // n) + x.shape[1:])


def pmap_sharding(devices) -> NamedSharding:
    """Where pmap's stacked layout lives: the leading axis split over ``devices``, one slice per device."""
    return NamedSharding(data_mesh(devices, axis_type="auto"), P(DATA))


def to_pmap_layout(batch, n_devices: int, devices=None):
    """Reshape a global batch ``[B, ...]`` to pmap's layout ``[n_devices, B // n_devices, ...]``.

    pmap maps over the **leading** axis, whose size must equal the number of devices (not the last axis).
    Taught in ``notebooks/04_pmap.ipynb``; the lab's pmap strategy lays out its batches with it.

    Args:
      batch: pytree of arrays with leading axis B (the global batch).
      n_devices: number of devices pmap will run on.
      devices: optional devices to place the shards on (shard *i* on ``devices[i]``).

    Raises:
      ValueError: B is not divisible by ``n_devices`` (the message names both numbers).
    """
    leaves = jax.tree.leaves(batch)
    size = leaves[0].shape[0]
    check_divisible(size, n_devices, "global batch")

    out = jax.tree.map(lambda x: split_leading(x, n_devices), batch)
    if devices is not None:
        out = jax.device_put(out, pmap_sharding(list(devices)[:n_devices]))
    return out

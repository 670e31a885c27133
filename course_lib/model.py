"""The source article's small CNN, in Flax NNX, exposed functionally.

Three conv blocks (3×3 conv → ReLU → 2×2 max-pool) and two dense layers. The module is split once into a
graph definition and a parameter pytree (``nnx.split``) so that ``jit``, ``pmap`` and ``shard_map`` only
ever see plain pytrees; :func:`apply` rebuilds the module at trace time (``nnx.merge``).

The feature map is flattened **channel-major** (``[B, C, H, W]`` order, as PyTorch's NCHW flatten does), so
that the rows of the first dense kernel are grouped by conv3 output channel. That is what lets the
tensor-parallel forward (:mod:`course_lib.parallel`) split conv3's output channels and dense1's input rows
with the same ``model`` axis and a single ``psum``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class CNNConfig:
    """Shape of the CNN (frozen, so it is hashable and can be a static argument).

    Attributes:
      image_size: height = width of the square input images, pixels; a multiple of 8 (three 2×2 pools).
      channels: output channels of the three conv layers.
      hidden: width of the first dense layer.
      num_classes: number of classes (width of the last dense layer).
      in_channels: input channels (3 for RGB).
    """

    image_size: int = 32
    channels: tuple[int, int, int] = (32, 64, 64)
    hidden: int = 128
    num_classes: int = 10
    in_channels: int = 3

    def __post_init__(self):
        if not isinstance(self.image_size, int) or self.image_size < 8 or self.image_size % 8:
            raise ValueError(
                f"image_size={self.image_size!r} must be a positive multiple of 8 (three 2x2 max-pools); "
                f"use e.g. 32 or 128"
            )
        if len(self.channels) != 3 or any(int(c) <= 0 for c in self.channels):
            raise ValueError(
                f"channels={self.channels!r} must be three positive integers, e.g. (32, 64, 64)"
            )
        if self.hidden <= 0 or self.num_classes <= 1:
            raise ValueError(
                f"hidden={self.hidden} must be > 0 and num_classes={self.num_classes} > 1"
            )

    @property
    def flat_features(self) -> int:
        """Input width of dense1: ``channels[2] * (image_size // 8) ** 2``."""
        return self.channels[2] * (self.image_size // 8) ** 2


TINY = CNNConfig(image_size=16, channels=(4, 8, 8), hidden=16, num_classes=10)
"""A config for tests: 16×16 images, small channels; its parameter count is asserted in the tests."""


def lecun_normal(key: jax.Array, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
    """Flax's default kernel initializer (``nnx.initializers.lecun_normal()``), drawn flat.

    A truncated normal with variance 1 / fan_in (fan_in = product of all but the last dimension), cut at
    ±2 standard deviations. JAX's partitionable PRNG gives the same numbers for a shape and for its
    flattened size, so the draw is made 1-D and reshaped: XLA:CPU compiles the 1-D draw several times
    faster than a 4-D one (about 0.2 s against 1 s per conv kernel), which every notebook's start pays.
    The random bits are Flax's exactly; the float transform to a truncated normal, compiled for the flat
    shape, agrees with Flax's to a few ulp (``tests/test_model.py`` checks both).
    """
    fan_in = math.prod(shape[:-1])
    variance = jnp.array(1.0 / fan_in, dtype=dtype)
    stddev = jnp.sqrt(variance) / jnp.array(0.87962566103423978, dtype)
    flat = jax.random.truncated_normal(key, -2, 2, (math.prod(shape),), dtype)
    return (flat * stddev).reshape(shape)


class CNN(nnx.Module):
    """conv(3→c1) → ReLU → pool → conv(c1→c2) → ReLU → pool → conv(c2→c3) → ReLU → pool → dense → ReLU → dense.

    Input ``images``: float32 [batch, image_size, image_size, in_channels] (NHWC).
    Output: float32 logits [batch, num_classes].
    """

    def __init__(self, config: CNNConfig, *, rngs: nnx.Rngs):
        c1, c2, c3 = config.channels
        self.config = config
        conv = dict(kernel_size=(3, 3), padding="SAME", kernel_init=lecun_normal, rngs=rngs)
        self.conv1 = nnx.Conv(config.in_channels, c1, **conv)
        self.conv2 = nnx.Conv(c1, c2, **conv)
        self.conv3 = nnx.Conv(c2, c3, **conv)
        self.dense1 = nnx.Linear(
            config.flat_features, config.hidden, kernel_init=lecun_normal, rngs=rngs
        )
        self.dense2 = nnx.Linear(
            config.hidden, config.num_classes, kernel_init=lecun_normal, rngs=rngs
        )

    def __call__(self, images: jax.Array) -> jax.Array:
        x = images
        for conv in (self.conv1, self.conv2, self.conv3):
            x = max_pool(jax.nn.relu(conv(x)))
        x = flatten_channel_major(x)
        x = jax.nn.relu(self.dense1(x))
        return self.dense2(x)


def max_pool(x: jax.Array) -> jax.Array:
    """2×2 max-pool, stride 2, on NHWC: [B, H, W, C] → [B, H/2, W/2, C]."""
    return nnx.max_pool(x, window_shape=(2, 2), strides=(2, 2))


def flatten_channel_major(x: jax.Array) -> jax.Array:
    """[B, H, W, C] → [B, C·H·W] in (channel, row, column) order, like PyTorch's NCHW flatten."""
    return jnp.transpose(x, (0, 3, 1, 2)).reshape(x.shape[0], -1)


def init_model(key: jax.Array, config: CNNConfig = CNNConfig()) -> tuple[nnx.GraphDef, nnx.State]:
    """Create the CNN and split it into ``(graphdef, params)``.

    Args:
      key: a PRNG key; the same key gives the same parameters.
      config: the model shape.

    Returns:
      ``graphdef`` (static structure, hashable) and ``params``: a plain nested dict of float32 arrays
      (``nnx.to_pure_dict``; :func:`apply` merges it back),
      ``params["conv1"]["kernel"]``: [3, 3, in, c1], ``["bias"]``: [c1], …, ``params["dense1"]["kernel"]``:
      [flat_features, hidden], ``params["dense2"]["kernel"]``: [hidden, num_classes].
    """
    model = CNN(config, rngs=nnx.Rngs(params=key))
    graphdef, state = nnx.split(model, nnx.Param)
    return graphdef, nnx.to_pure_dict(state)


def apply(graphdef: nnx.GraphDef, params: Any, images: jax.Array) -> jax.Array:
    """Run the CNN functionally: float32 [B, H, W, 3] images → float32 [B, num_classes] logits."""
    return nnx.merge(graphdef, params)(images)


def param_count(params: Any) -> int:
    """Total number of scalar parameters in a pytree."""
    return sum(int(x.size) for x in jax.tree.leaves(params))


def param_bytes(params: Any) -> int:
    """Total bytes of a parameter pytree (float32: 4 bytes per parameter)."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))


def flops_per_example(config: CNNConfig) -> int:
    """Analytic forward FLOPs for one image (2 per multiply-add, convs and dense layers only).

    Every tap of every 3×3 kernel is counted, also on the 'SAME' padding at the borders, which XLA's
    count leaves out (so ``cost_analysis`` reports ~10 % less at 32 × 32). A training step costs about 3×
    this per example (forward + two backward matmuls); compare with the
    compiled program's ``cost_analysis()["flops"]``, which the lab reports.
    """
    s = config.image_size
    c_in = config.in_channels
    total = 0
    for c_out in config.channels:
        total += 2 * s * s * 9 * c_in * c_out
        c_in, s = c_out, s // 2
    total += 2 * config.flat_features * config.hidden + 2 * config.hidden * config.num_classes
    return total

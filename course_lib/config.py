"""The lab's configuration: profiles, the notebook parameters and how their values are read, the seed rule.

- :class:`LabConfig` nests the model's shape (:class:`course_lib.model.CNNConfig`) and the data
  (:class:`course_lib.data.SyntheticImages`); :data:`PROFILES` holds the ``cpu``, ``gpu`` (the source
  article's setting, for any accelerator: TPU or GPU) and ``tiny`` ones; on a chip whose memory it does not
  fit, :func:`course_lib.sizing.fit_global_batch` halves the article's batch.
- :class:`Param` declares one notebook parameter (name, default, type, allowed values) and
  :func:`coerce` turns what papermill passes into a value of that type: ``-r`` passes strings (``"3"``,
  ``"False"``), ``-y`` YAML (ints, bools, floats). One rule, the type of the default, serves every notebook,
  command-line runner and the multi-process launcher, with the same errors. :data:`LAB_PARAMS` and
  :data:`MULTIHOST_PARAMS` are the parameters cells of ``notebooks/08_lab.ipynb`` and
  ``notebooks/09_multihost.ipynb``.
- :func:`init_run` is the seed rule every run follows: parameters from ``key(seed)``, batch *i* from
  ``fold_in(key(seed + 1), i)``; lessons 08 and 09 agree because both use it.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from . import data as data_lib
from . import model as model_lib
from .devices import PLATFORMS, device_subsets
from .precision import PRECISIONS

_TRUE, _FALSE = ("true", "yes", "1"), ("false", "no", "0")


@dataclasses.dataclass(frozen=True)
class Param:
    """One notebook or command-line parameter.

    Attributes:
      name: the variable name in the parameters cell (``steps``).
      default: its value there; its type is the parameter's type unless ``kind`` says otherwise.
      kind: ``int``, ``float``, ``bool`` or ``str``; default ``type(default)``.
      choices: for a ``str``: the allowed values (compared stripped and case-folded).
      minimum: for an ``int`` or ``float``: the smallest value allowed.
      example: a valid value to quote in error messages (default: ``default``).
      help: one line for ``--help`` and the documentation.
      papermill: a notebook parameter: its errors quote the papermill form of the fix.
    """

    name: str
    default: Any
    kind: type | None = None
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    example: Any = None
    help: str = ""
    papermill: bool = True

    @property
    def type(self) -> type:
        """The parameter's Python type."""
        return self.kind or type(self.default)

    def hint(self) -> str:
        """``"such as 20 (papermill: -p steps 20)"``: the fix quoted by every error."""
        example = self.default if self.example is None else self.example
        papermill = f" (papermill: -p {self.name} {example})" if self.papermill else ""
        return f"such as {example!r}{papermill}"


def coerce(param: Param, value: Any) -> Any:
    """``value`` as a value of ``param``'s type, or a ValueError that names the parameter, the value and the fix.

    - ``bool``: True/False, 1/0, or the strings true/false, yes/no, 1/0 in any case (``bool("False")``
      is True, so strings are never passed to ``bool``).
    - ``int``: ints, numpy integers, integral floats (``2.0``) and decimal strings (``" 3 "``); bools,
      fractions and other text are refused. ``minimum`` is checked.
    - ``float``: numbers and numeric strings; bools are refused. ``minimum`` is checked.
    - ``str``: text (or a path); with ``choices``, stripped, case-folded and checked. ``None`` stays None.

    Raises:
      ValueError: e.g. "steps='three' is not an integer; give a whole number such as 20 (papermill: -p steps 20)".
    """
    kind = param.type
    if kind is bool:
        return _as_bool(param, value)
    if kind is int:
        return _at_least(param, value, _as_int(param, value))
    if kind is float:
        return _at_least(param, value, _as_float(param, value))
    if kind is str:
        return _as_str(param, value)
    raise TypeError(f"parameter {param.name!r} has an unsupported type {kind.__name__}")


def coerce_params(params: Mapping[str, Param], values: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: coerce(params[name], values[name])}`` for every declared parameter (its default when absent).

    In a notebook, ``coerce_params(LAB_PARAMS, globals())`` types the parameters cell's values.
    """
    return {name: coerce(p, values.get(name, p.default)) for name, p in params.items()}


def positive_int(value: Any, name: str) -> int:
    """``value`` as an int ≥ 1 by the rule of :func:`coerce` (for counts given in code or on a command line)."""
    return coerce(Param(name, 1, int, minimum=1, papermill=False), value)


def arg_type(param: Param):
    """A function for argparse's ``type=`` that applies :func:`coerce` and keeps its error message, without
    the papermill form of the fix: on a command line, argparse names the option itself."""
    import argparse

    on_command_line = dataclasses.replace(param, papermill=False)

    def parse(text: str) -> Any:
        try:
            return coerce(on_command_line, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = param.name
    return parse


def _as_bool(param: Param, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    if not isinstance(value, str | float):
        try:
            number = operator.index(value)  # ints and numpy integers
        except TypeError:
            number = None
        if number in (0, 1):
            return bool(number)
    raise ValueError(
        f"{param.name}={value!r} is not a yes/no value; use True or False "
        f"(papermill: -p {param.name} False)"
    )


def _as_int(param: Param, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(
            f"{param.name}={value!r} is a bool, not an integer; give one {param.hint()}"
        )
    if isinstance(value, str):
        if not re.fullmatch(r"\s*[+-]?\d+\s*", value):
            raise ValueError(
                f"{param.name}={value!r} is not an integer; give a whole number {param.hint()}"
            )
        return int(value)
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(
                f"{param.name}={value!r} is not a whole number; give an integer {param.hint()}"
            )
        return int(value)
    try:
        return operator.index(value)  # ints and numpy integers
    except TypeError:
        raise ValueError(
            f"{param.name}={value!r} ({type(value).__name__}) is not an integer; "
            f"give a whole number {param.hint()}"
        ) from None


def _as_float(param: Param, value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{param.name}={value!r} is a bool, not a number; give one {param.hint()}")
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise ValueError(
            f"{param.name}={value!r} is not a number; give one {param.hint()}"
        ) from None
    if not math.isfinite(number):
        raise ValueError(f"{param.name}={value!r} is not a finite number; give one {param.hint()}")
    return number


def _at_least(param: Param, value: Any, number: float) -> Any:
    if param.minimum is None or number >= param.minimum:
        return number
    if param.type is int and param.minimum in (0, 1):
        what = "a positive integer (at least 1)" if param.minimum == 1 else "a non-negative integer"
    else:
        what = f"at least {param.minimum:g}"
    raise ValueError(f"{param.name}={value!r} must be {what}; give one {param.hint()}")


def _as_str(param: Param, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str | os.PathLike):
        raise ValueError(f"{param.name}={value!r} is not text; give a string {param.hint()}")
    text = os.fspath(value)
    if param.choices is None:
        return text
    key = text.strip().casefold()
    if key not in param.choices:
        raise ValueError(
            f"{param.name}={value!r} is not one of {list(param.choices)}; use {param.default!r} "
            f"unless you need another"
        )
    return key


# ---- the lab's settings ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LabConfig:
    """One lab setting (frozen, hashable).

    Attributes:
      name: profile name (recorded in results).
      model: the CNN's shape (its ``image_size`` and ``num_classes`` are the data's too).
      data: the synthetic dataset the batches come from.
      global_batch: images per step over all devices (the source article: 512).
      steps: training steps per strategy; the first ``warmup`` are not timed.
      warmup: untimed steps after compilation.
      learning_rate: SGD step size (momentum 0.9), the same for every strategy.
      scaling_steps: steps per run in the scaling sweep (short: it measures throughput only).

    Raises:
      ValueError: the model and the data disagree on image size, classes or channels.
    """

    name: str
    model: model_lib.CNNConfig
    data: data_lib.SyntheticImages
    global_batch: int
    steps: int
    warmup: int = 2
    learning_rate: float = 0.01
    scaling_steps: int = 8

    def __post_init__(self):
        pairs = [
            ("image_size", "image_size"),
            ("num_classes", "num_classes"),
            ("in_channels", "channels"),
        ]
        for m_field, d_field in pairs:
            m, d = getattr(self.model, m_field), getattr(self.data, d_field)
            if m != d:
                raise ValueError(
                    f"profile {self.name!r}: the model's {m_field}={m} differs from the data's {d_field}={d}; "
                    f"give both the same value"
                )

    @property
    def image_size(self) -> int:
        """Pixels per side of the images (the model's and the data's)."""
        return self.model.image_size


def _profile(
    name: str, model: model_lib.CNNConfig, signal: float = 1.0, **settings: Any
) -> LabConfig:
    # The lab's data: class prototypes at twice the default amplitude, so the loss falls within a few steps.
    data = data_lib.SyntheticImages(
        image_size=model.image_size, num_classes=model.num_classes, signal=signal
    )
    return LabConfig(name, model, data, **settings)


PROFILES = {
    # Sized for a 2-core laptop or CI runner with 8 simulated devices: the whole lab in well under 2 minutes.
    "cpu": _profile("cpu", model_lib.CNNConfig(image_size=32), global_batch=64, steps=20),
    # The source article's setting: 128 x 128 x 3 images, global batch 512 (8 x 64 per device). "auto" picks
    # it on a TPU or GPU; notebooks/08_lab.ipynb then fits the batch to the chip (course_lib.sizing).
    "gpu": _profile(
        "gpu",
        model_lib.CNNConfig(image_size=128),
        global_batch=512,
        steps=50,
        warmup=3,
        scaling_steps=12,
    ),
    # For tests and quick papermill checks: the model's test config (model.TINY), with a stronger class
    # signal so that this small model's loss falls within its few steps.
    "tiny": _profile("tiny", model_lib.TINY, signal=3.0, global_batch=32, steps=6, scaling_steps=4),
}
"""The lab's profiles; ``"auto"`` picks ``gpu`` (the article's setting) on a TPU or GPU backend, else ``cpu``."""

N_DEVICES = Param(
    "n_devices", 8, minimum=1, help="devices to use (simulated CPU devices, TPUs or GPUs)"
)
PLATFORM = Param(
    "platform",
    "auto",
    choices=PLATFORMS,
    help="auto (TPU or GPU if any, else CPU) | cpu | gpu | tpu",
)

LAB_PARAMS = {
    p.name: p
    for p in (
        N_DEVICES,
        PLATFORM,
        Param("profile", "auto", choices=("auto", *PROFILES), help="auto | cpu | gpu | tiny"),
        Param(
            "precision",
            "float32",
            choices=PRECISIONS,
            help="float32 | float64 (every strategy equals A to 1e-10) | bfloat16 (mixed precision)",
        ),
        Param(
            "steps",
            0,
            minimum=0,
            example=20,
            help="training steps per strategy; 0 keeps the profile's",
        ),
        Param(
            "global_batch", 0, minimum=0, example=64, help="images per step; 0 keeps the profile's"
        ),
        Param("scaling", False, help="also measure B, C, D on 1, 2, 4, ... of the devices (slow)"),
        Param("article_variant", True, help="also run the article's split (C') beside C"),
        Param("results_dir", "auto", help="results folder; auto: build/lab"),
        Param("overwrite", False, help="write into a used results folder instead of a new one"),
        Param("reference", "auto", help="reference run from data/: auto, none, or a CSV name"),
        Param("seed", 0, minimum=0, help="fixes the initial parameters and the data"),
    )
}
"""The parameters cell of ``notebooks/08_lab.ipynb`` (names and defaults; a test keeps them equal)."""

MULTIHOST_PARAMS = {
    p.name: p
    for p in (
        N_DEVICES,
        PLATFORM,
        Param("n_processes", 2, minimum=1, help="local processes"),
        Param("steps", 3, minimum=1, help="SGD steps per strategy"),
        Param("timeout_s", 240, float, minimum=1e-3, help="seconds for a whole multi-process run"),
    )
}
"""The parameters cell of ``notebooks/09_multihost.ipynb``; the launcher's arguments use the same rule."""


def resolve_profile(
    profile: str,
    platform: str,
    steps: Any = None,
    global_batch: Any = None,
    n_devices: int | None = None,
) -> LabConfig:
    """Pick a :class:`LabConfig`: ``"auto"`` → ``"gpu"`` (the article's setting) on a TPU or GPU backend,
    else ``"cpu"``. Fitting its batch to the chip's memory is :func:`course_lib.sizing.fit_global_batch`'s
    job (it compiles a step, so it needs the devices).

    With ``n_devices`` and no ``global_batch`` of the reader's, the profile's batch is rounded up to a
    multiple of every device count the lab uses (1, 2, 4, …, n), so that 3, 5, 6 or 7 devices work too:
    e.g. 64 → 66 on 3 devices, 72 on 6 (a printed note says so). A batch the reader gave is never changed.

    Args:
      profile: ``"auto"``, ``"cpu"``, ``"gpu"`` or ``"tiny"``.
      platform: ``report.platform`` (``"cpu"``, ``"gpu"`` or ``"tpu"``).
      steps: overrides the profile's steps when given (None, ``""`` or 0 keeps it); ints or decimal strings.
      global_batch: overrides the profile's global batch likewise.
      n_devices: the device count, to fit the default batch to it.

    Raises:
      ValueError: unknown profile, or steps / global_batch that are not positive integers, or steps not
        greater than the warm-up.
    """
    key = coerce(LAB_PARAMS["profile"], profile)
    if key == "auto":
        key = "gpu" if platform in ("gpu", "tpu") else "cpu"
    cfg = PROFILES[key]
    changes = {}
    for name, value in (("steps", steps), ("global_batch", global_batch)):
        if value is None or (isinstance(value, str) and not value.strip()):
            continue
        value = coerce(LAB_PARAMS[name], value)
        if value:
            changes[name] = value
    cfg = dataclasses.replace(cfg, **changes)
    if n_devices is not None and "global_batch" not in changes:
        cfg = _fit_batch(cfg, n_devices)
    if cfg.steps <= cfg.warmup:
        raise ValueError(
            f"steps={cfg.steps} must exceed the {cfg.warmup} warm-up steps of profile {key!r}; "
            f"use steps >= {cfg.warmup + 1}"
        )
    return cfg


def _fit_batch(cfg: LabConfig, n_devices: int) -> LabConfig:
    counts = device_subsets(range(n_devices))
    multiple = math.lcm(*counts)
    fitted = -(-cfg.global_batch // multiple) * multiple
    if fitted == cfg.global_batch:
        return cfg
    print(
        f"note: global batch {cfg.global_batch} -> {fitted}, a multiple of {multiple}, so that "
        f"{n_devices} devices (and the scaling sweep's {counts}) split it evenly"
    )
    return dataclasses.replace(cfg, global_batch=fitted)


class RunStart(NamedTuple):
    """What every run of a config starts from (see :func:`init_run`).

    Attributes:
      graphdef: the CNN's graph definition (static).
      params: the initial parameters, ``init_model(key(seed))``; abstract shapes with ``abstract_params``.
      dataset: the :class:`course_lib.data.SyntheticImages` the batches come from.
      data_key: the key of the batches: batch *i* is made from ``jax.random.fold_in(data_key, i)``.
    """

    graphdef: Any
    params: Any
    dataset: data_lib.SyntheticImages
    data_key: Any


def init_run(config: LabConfig, seed: Any = 0, *, abstract_params: bool = False) -> RunStart:
    """The seed rule: parameters from ``jax.random.key(seed)``, batches from ``jax.random.key(seed + 1)``.

    Every run with the same config and seed, whatever the strategy, device count or process count, starts
    from the same parameters and sees the same global batches; taught in ``notebooks/08_lab.ipynb`` and
    relied on by the multi-process run of ``notebooks/09_multihost.ipynb``.

    Args:
      config: the lab setting.
      seed: a non-negative integer (or its decimal string).
      abstract_params: return only the parameters' shapes and dtypes (nothing computed), for a run that
        reads the parameters from a file.

    Raises:
      ValueError: a seed that is not a non-negative integer.
    """
    import jax

    seed = coerce(LAB_PARAMS["seed"], seed)
    key = jax.random.key(seed)
    if abstract_params:
        from flax import nnx

        graphdef, params = nnx.eval_shape(lambda: model_lib.init_model(key, config.model))
    else:
        graphdef, params = model_lib.init_model(key, config.model)
    return RunStart(graphdef, params, config.data, jax.random.key(seed + 1))

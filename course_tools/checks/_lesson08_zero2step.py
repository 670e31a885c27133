"""Pieces of the ZeRO-2 step's checker (:func:`course_tools.checks.lesson08.check_zero2`,
``notebooks/08_lab.ipynb``, exercise 3): its starting parameters, its tolerance and the hints it gives when an
update or a momentum differs from single-device ``jit``'s.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from course_lib import model, parity
from course_lib import precision as precision_lib
from course_lib.meshes import DATA

WEIGHT_DECAY = 0.05
"""Weight decay of the ZeRO-2 checker's optimizer."""

PERTURB = 0.1
"""Standard deviation of the noise the ZeRO-2 checker adds to every initial parameter (biases start at 0)."""


def _check_params(model_config):
    """``(graphdef, params)`` of the checker's CNN: :func:`course_lib.model.init_model` at key 0 with
    ``PERTURB`` · N(0, 1) added to every leaf, so that every leaf (biases too) is non-zero and weight decay,
    which reads the parameters, shows in every leaf's update."""
    graphdef, params = model.init_model(jax.random.key(0), model_config)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    noisy = [p + PERTURB * jax.random.normal(k, p.shape, p.dtype) for p, k in zip(leaves, keys)]
    return graphdef, treedef.unflatten(noisy)


def _tight_tolerance() -> parity.Tolerance:
    """One step of the checker's CNN from the same state, compared leaf by leaf: float32 sums in another
    order differ by :func:`course_lib.precision.float32_rtol` per rounding (1e-5 on XLA:CPU, so 1e-4 for the
    update of each leaf), far below a gradient rounded to bfloat16 (4e-3) or a leaf's weight decay left out
    (``WEIGHT_DECAY · p`` with :data:`PERTURB`-sized parameters). Each step starts from single-device jit's
    own state, so a max-pool near-tie flip does not carry over; on a platform whose float32 matmuls round
    more coarsely (a TPU at JAX's default precision) the looser parity tolerance applies."""
    loose = parity.tolerance("float32")
    update = min(loose.one_step_update, 10 * precision_lib.float32_rtol())
    return dataclasses.replace(loose, one_step_update=update)


def _leaf_specs(specs) -> dict:
    """``{"layer/name": spec}`` of the FSDP specs."""
    return {
        "/".join(str(getattr(k, "key", k)) for k in path): s
        for path, s in jax.tree_util.tree_leaves_with_path(
            specs, is_leaf=lambda x: isinstance(x, P)
        )
    }


def _without_decay(opt_state, params):
    """The state of :func:`make_check_optimizer` had its ``update`` been handed zeros for the parameters:
    the momentum less ``WEIGHT_DECAY · p`` (``p`` the parameters before the step)."""
    decay, (trace, rest) = opt_state
    momentum = jax.tree.map(lambda m, p: m - WEIGHT_DECAY * p, trace.trace, params)
    return decay, (trace._replace(trace=momentum), rest)


DECAY_HINT = (
    "the momentum of {leaf} lacks the weight decay term wd · p: optimizer.update was handed zeros (or other "
    "values) for its parameters, and weight decay reads them: pass this device's parameter slices as "
    "optimizer.update's third argument (of a leaf kept whole: all of it)"
)


def _decay_missing(new_opt, ref_next, ref_opt, params, tol: float) -> str | None:
    """The first parameter (``"layer/name"``) whose new momentum is single-device jit's *without* its weight
    decay (within ``tol`` of the update, relative) and not single-device jit's; ``None`` if there is none."""
    undecayed = _without_decay(ref_next, params)

    def momentum(state):
        return jax.tree_util.tree_leaves_with_path(state[1][0].trace)

    for (path, new), (_, want), (_, bare), (_, old) in zip(
        momentum(new_opt), momentum(ref_next), momentum(undecayed), momentum(ref_opt), strict=True
    ):
        u, u_want, u_bare = (np.asarray(x, np.float64) - old for x in (new, want, bare))
        near_bare = np.max(np.abs(u - u_bare)) <= tol * max(float(np.max(np.abs(u_bare))), 1e-30)
        near_want = np.max(np.abs(u - u_want)) <= tol * max(float(np.max(np.abs(u_want))), 1e-30)
        if near_bare and not near_want:
            return "/".join(str(getattr(k, "key", k)) for k in path)
    return None


def _update_hint(new_params, after, before, leaf, n, specs) -> str:
    """What is wrong with an update that differs from single-device jit's: only what the numbers show."""

    def flat(tree, minus):
        return np.concatenate(
            [np.ravel(a - b) for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(minus))]
        )

    u, u_ref = flat(new_params, before), flat(after, before)
    scale = float(np.dot(u, u_ref) / max(float(np.dot(u_ref, u_ref)), 1e-30))
    fits = np.linalg.norm(u - scale * u_ref) <= 0.1 * np.linalg.norm(scale * u_ref)
    if n > 1 and fits and abs(scale - n) < 0.1 * n:
        return (
            f"the updates are {n}x too large: the gradient must be the MEAN over devices, and no implicit "
            "psum may add the gradients before yours does (differentiate the local loss of parameters made "
            "varying)"
        )
    if n > 1 and fits and abs(scale * n - 1) < 0.1:
        return (
            f"the updates are {n}x too small: the summed gradient is divided by the axis size twice"
        )
    spec = _leaf_specs(specs).get(leaf)
    if spec is not None and DATA not in tuple(spec):
        return (
            f"{leaf} is kept whole (its spec is P()): every device updates all of it, with the mean of "
            "the devices' gradients and its own parameters (weight decay reads them: not zeros)"
        )
    return (
        f"the update of {leaf} is not single-device training's: each device must update its own block "
        "(the one lax.axis_index names) with the same block of the mean gradient, of the momentum and of "
        "the parameters, all in float32 (a gradient rounded to bfloat16 is off by ~1e-3) — "
        "optimizer.update's weight decay reads the parameters it is given"
    )

"""Answers to lab 12's exercise 2 (``device_memory``): the reference, another right form, and wrong ones
the checker must refuse (``tests/test_checks_lesson12_memory.py``)."""

import math

import jax
from jax.sharding import PartitionSpec as P

from course_lib import lm_costs, lm_layouts, transformer


def _shapes(cfg, staged=True):
    """The parameters' shapes; ``staged``: the pipeline's blocks as it holds them, [1, L, ...]."""
    shapes = jax.eval_shape(lambda: transformer.init_model(jax.random.key(0), cfg)[1])
    if staged:
        shapes = {**shapes, "blocks": jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape), a.dtype),
                                                   shapes["blocks"])}  # fmt: skip
    return shapes


def _share(layout_key, cfg, sizes, *, skip=(), stage_all=False):
    """Values of one device's block of every parameter: the pipeline's blocks as [1, L, ...]. The mistakes:
    the axes in ``skip`` not dividing, every leaf split over ``stage`` (``stage_all``)."""
    shapes = _shapes(cfg, "stage" in sizes)
    specs = lm_layouts.param_specs(layout_key, shapes, sizes)
    total = 0
    for leaf, spec in zip(jax.tree.leaves(shapes), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)),
                          strict=True):  # fmt: skip
        entries = [e for e in spec if e is not None]
        names = [a for e in entries for a in (e if isinstance(e, tuple) else (e,)) if a not in skip]
        if stage_all and "stage" in sizes and "stage" not in names:
            names.append("stage")
        total += math.prod(leaf.shape) // math.prod(sizes[a] for a in names)
    return total


def reference(
    layout_key, cfg, global_batch, remat, *, itemsize=2, copies=3, whole=False, micro=None, **share
):
    sizes = lm_layouts.mesh_axes(layout_key, 8)
    m = micro or 4 * sizes.get("stage", 1)
    state = transformer.param_count(cfg) if whole else _share(layout_key, cfg, sizes, **share)
    acts = lm_costs.activation_bytes(layout_key, cfg, global_batch, sizes, itemsize, m, remat=remat)
    return copies * state * itemsize + acts


def by_block_shape(layout_key, cfg, global_batch, remat):
    """Right, another form: each leaf's block shape, dimension by dimension, over a tree map."""
    sizes = lm_layouts.mesh_axes(layout_key, 8)
    n_stages = sizes.get("stage", 1)
    shapes = _shapes(cfg, n_stages > 1)

    def block(leaf, spec):
        dims = list(leaf.shape)
        for i, entry in enumerate(spec):
            for axis in (entry,) if isinstance(entry, str) else (entry or ()):
                dims[i] //= sizes[axis]
        return math.prod(dims)

    blocks = jax.tree.map(block, shapes, lm_layouts.param_specs(layout_key, shapes, sizes))
    acts = lm_costs.activation_bytes(
        layout_key, cfg, global_batch, sizes, 2, 4 * n_stages, remat=remat
    )
    return 2 * 3 * sum(jax.tree.leaves(blocks)) + acts


def by_local_bytes(layout_key, cfg, global_batch, remat):
    """Refused: each leaf's block from lm_layouts.local_bytes (the piece the exercise asks for), plus
    activation_bytes: right, but a call of two library functions."""
    sizes = lm_layouts.mesh_axes(layout_key, 8)
    shapes = jax.eval_shape(lambda: transformer.init_model(jax.random.key(0), cfg)[1])
    if sizes.get("stage", 1) > 1:
        shapes["blocks"] = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, *a.shape), a.dtype),
                                        shapes["blocks"])  # fmt: skip
    specs = lm_layouts.param_specs(layout_key, shapes, sizes)
    flat = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    state = sum(3 * lm_layouts.local_bytes(leaf.shape, spec, sizes, 2)
                for leaf, spec in zip(jax.tree.leaves(shapes), flat, strict=True))  # fmt: skip
    n_micro = 4 * sizes.get("stage", 1)
    return state + lm_costs.activation_bytes(
        layout_key, cfg, global_batch, sizes, 2, n_micro, remat=remat
    )


def fsdp_ignored(layout_key, cfg, global_batch, remat):
    """Wrong: only the model axis divides (the fsdp entries of the specs left out)."""
    return reference(layout_key, cfg, global_batch, remat, skip=("fsdp",))


def blocks_whole_per_stage(layout_key, cfg, global_batch, remat):
    """Wrong: the pipeline's blocks held whole on each stage (the stage entries left out)."""
    return reference(layout_key, cfg, global_batch, remat, skip=("stage",))


def staged_everything(layout_key, cfg, global_batch, remat):
    """Wrong: the pipeline's embedding and head split over stage too, as its blocks are."""
    return reference(layout_key, cfg, global_batch, remat, stage_all=True)


def float32(layout_key, cfg, global_batch, remat):
    """Wrong: 4 bytes a value."""
    return reference(layout_key, cfg, global_batch, remat, itemsize=4)


def no_gradients(layout_key, cfg, global_batch, remat):
    """Wrong: parameters and momentum, the gradients forgotten."""
    return reference(layout_key, cfg, global_batch, remat, copies=2)


def unsplit(layout_key, cfg, global_batch, remat):
    """Wrong: the whole model's state on every device (the specs ignored)."""
    return reference(layout_key, cfg, global_batch, remat, whole=True)


def two_micro_batches(layout_key, cfg, global_batch, remat):
    """Wrong: activation_bytes' default n_micro (2), not 4 x stages."""
    return reference(layout_key, cfg, global_batch, remat, micro=2)


def remat_ignored(layout_key, cfg, global_batch, remat):
    """Wrong: the activations as without recomputation, whatever remat says."""
    return reference(layout_key, cfg, global_batch, False)


def by_the_model(layout_key, cfg, global_batch, remat):
    """Wrong: the memory model's own sum."""
    sizes = lm_layouts.mesh_axes(layout_key, 8)
    mem = lm_costs.predict_memory(layout_key, cfg, global_batch, sizes, 2, 4 * sizes.get("stage", 1),
                                  remat=remat)  # fmt: skip
    return mem["params"] + mem["optimizer"] + mem["gradients"] + mem["activations"]


def by_param_bytes(layout_key, cfg, global_batch, remat):
    """Wrong: the state from lm_costs.param_bytes (the piece the exercise asks for)."""
    sizes = lm_layouts.mesh_axes(layout_key, 8)
    n_micro = 4 * sizes.get("stage", 1)
    return 3 * lm_costs.param_bytes(layout_key, cfg, sizes, 2) + lm_costs.activation_bytes(
        layout_key, cfg, global_batch, sizes, 2, n_micro, remat=remat
    )


def by_private_param_bytes(layout_key, cfg, global_batch, remat):
    """Wrong: the state from lm_costs._param_bytes, param_bytes' own count (activation_bytes calls it for
    FSDP's gathered parameters, so it cannot be switched off like param_bytes)."""
    sizes = lm_layouts.mesh_axes(layout_key, 8)
    n_micro = 4 * sizes.get("stage", 1)
    state = lm_costs._param_bytes(layout_key, cfg, sizes, 2, None)
    return 3 * state + lm_costs.activation_bytes(
        layout_key, cfg, global_batch, sizes, 2, n_micro, remat=remat
    )

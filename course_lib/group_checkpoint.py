"""A hybrid mesh over a group of processes, and a sharded checkpoint that every process writes.

Run by every worker of a multi-process run (:mod:`course_tools.worker`) after training, and read back in
``notebooks/09_multihost.ipynb``:

- :func:`hybrid_mesh`: ``data`` across processes (on a cluster, the slow network between hosts or slices,
  DCN), ``model`` inside each process (the fast links between one host's chips, ICI), built with
  ``jax.experimental.mesh_utils.create_hybrid_device_mesh``;
- :func:`checkpoint_round_trip`: every process saves its share of the distinct shards with Orbax, whose
  ``save`` is collective (Orbax 0.12.8: a barrier at the start; after the writes, all wait, process 0
  commits the checkpoint atomically — on a local file system ``commit_success.txt`` in the temporary folder,
  then a rename to the final name — and all wait for the commit; ``wait_until_finished`` returns after it), then
  each restores the checkpoint onto another layout and compares the shards it now holds with the values it
  can recompute. One ``multihost_utils.sync_global_devices`` between the two shows JAX's barrier; Orbax
  does not need it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .meshes import DATA, MODEL


def hybrid_mesh(devices: Any = None) -> Any:
    """A ``data × model`` mesh with ``data`` across processes and ``model`` inside each process.

    Args:
      devices: the group's global devices (default ``jax.devices()``); every process must own as many.

    Returns:
      ``jax.sharding.Mesh`` of shape ``(processes, local devices)``, axes ``('data', 'model')``, Auto axis
      types (stated): row ``p`` holds process ``p``'s devices. ``create_hybrid_device_mesh`` builds it from an
      inner mesh per process, ``(1, local)``, tiled ``(processes, 1)`` times; ``process_is_granule=True``
      makes processes the outer units (TPU slices set ``slice_index`` and are the units without it).

    Raises:
      ValueError: processes own different numbers of devices (raised by ``create_hybrid_device_mesh``).
    """
    import jax
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    devices = list(devices if devices is not None else jax.devices())
    n_proc = len({d.process_index for d in devices})
    grid = mesh_utils.create_hybrid_device_mesh(
        (1, len(devices) // n_proc), (n_proc, 1), devices, process_is_granule=True
    )
    return Mesh(grid, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


def _values(n: int) -> dict:
    """The checkpointed state as NumPy: ``w`` f32[2n, 2n], ``b`` f32[2n], ``step`` i32 (n: global devices)."""
    import numpy as np

    w = np.arange(4 * n * n, dtype=np.float32).reshape(2 * n, 2 * n) / 7
    return {"w": w, "b": np.linspace(-1, 1, 2 * n, dtype=np.float32), "step": np.int32(7)}


def checkpoint_round_trip(folder: str | Path, mesh: Any) -> dict:
    """Save a state sharded on ``mesh`` from every process, then restore it onto another layout.

    Every process of the group must call this (Orbax's save, its commit and the barrier are collective). Saved as
    ``w: P('data', 'model')``, ``b: P('data')``, ``step: P()``; restored as ``w: P('model', 'data')``,
    ``b: P()`` (whole on every device), ``step: P()``.

    Args:
      folder: where to write, on a file system every process sees; must not exist yet.
      mesh: a ``data × model`` mesh over the group (:func:`hybrid_mesh`).

    Returns:
      ``{"written": [entries of the committed folder], "restored": {leaf: str(spec)},
      "shards_checked": int, "max_abs_error": float}``: this process's restored shards against the values.
    """
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax import P
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding

    values = _values(mesh.devices.size)
    saved = {"w": P(DATA, MODEL), "b": P(DATA), "step": P()}
    wanted = {"w": P(MODEL, DATA), "b": P(), "step": P()}
    state = {  # each process builds only the blocks its own devices hold
        k: jax.make_array_from_callback(
            v.shape, NamedSharding(mesh, saved[k]), lambda index, v=v: v[index]
        )
        for k, v in values.items()
    }
    path = Path(folder).absolute()
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, state)  # collective: each process writes its share of the distinct shards
        ckptr.wait_until_finished()  # returns once process 0 committed the checkpoint for the group
        # JAX's own barrier, shown for the lesson: Orbax's save has already synchronised the group
        multihost_utils.sync_global_devices("checkpoint written")
        target = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, wanted[k]))
            for k, v in values.items()
        }
        restored = ckptr.restore(path, target)
    checked, worst = 0, 0.0
    for k, arr in restored.items():
        for shard in arr.addressable_shards:
            worst = max(
                worst, float(np.max(np.abs(np.asarray(shard.data) - values[k][shard.index])))
            )
            checked += 1
    return {
        "written": sorted(os.listdir(path)),
        "restored": {k: str(v.sharding.spec) for k, v in restored.items()},
        "shards_checked": checked,
        "max_abs_error": worst,
    }

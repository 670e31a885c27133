"""course_lib: the helper package of the JAX parallel programming course.

Modules (import them explicitly; importing ``course_lib`` starts no JAX backend and touches no device):

- ``devices``    — :func:`~course_lib.devices.setup_devices`: real or simulated devices, fixed before JAX starts
- ``model``      — the source article's CNN in Flax NNX, exposed as ``(graphdef, params)``
- ``data``       — synthetic image batches generated on the device; pmap/sharding layouts
- ``meshes``     — 1-D ``data`` and 2-D ``data × model`` meshes; axis names ``DATA``, ``MODEL``
- ``steps``      — the shared loss, optimizer and pure ``train_step``
- ``parallel``   — tensor-parallel layout and per-shard forward for ``shard_map``
- ``strategies`` — A ``jit``, B ``pmap``, C ``shard_map``, D sharded ``jit``
- ``measure``    — timing, memory, FLOPs, collectives of compiled programs
- ``lab``        — lab profiles, one measured run per strategy, scaling sweep
- ``results``    — results files (never silently overwritten) and references from ``data/``
- ``plots``      — loss curves, comparison bars, scaling plots
- ``checks``     — exercise checkers; ``student`` — generates the student notebooks
"""

__version__ = "0.1.0"

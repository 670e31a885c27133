"""course_lib: the lesson library of the JAX parallel programming course, the code the notebooks teach.

Modules (import them explicitly; importing ``course_lib`` starts no JAX backend and touches no device):

- ``devices``     — :func:`~course_lib.devices.setup_devices`: real or simulated devices, fixed before JAX starts
- ``environment`` — the shell environment a notebook inherits, checked in the setup cell
- ``config``      — the lab's profiles, the one rule that types notebook parameters, the seed rule
- ``model``       — the source article's CNN in Flax NNX, exposed as ``(graphdef, params)``
- ``data``        — synthetic image batches generated on the device; pmap/sharding layouts
- ``meshes``      — 1-D ``data`` and 2-D ``data × model`` meshes; axis names ``DATA``, ``MODEL``
- ``steps``       — the shared loss, optimizer and pure ``train_step``
- ``parallel``    — tensor-parallel layout and per-shard forward for ``shard_map``
- ``strategies``  — the registry of strategies: A ``jit``, B ``pmap``, C/C2/C′ ``shard_map``, D sharded ``jit``,
  E/E′ FSDP (gathered once: ZeRO-2-like)
- ``builders``    — how each strategy is built from the shared ``train_step``
- ``precision``   — float32, float64 or bfloat16 mixed precision for a run
- ``parity``      — the parity rule of each precision, and why float32 runs drift apart
- ``comms``       — bytes on the wire: collectives measured in the compiled program and predicted from shapes
- ``costs``       — memory per device by kind, peak FLOP/s per GPU kind (MFU), a step-time model
- ``xla_dump``    — XLA's own records of a compile: the HLO after SPMD partitioning, what the temporaries hold
- ``measure``     — timing, memory, FLOPs, collectives of compiled programs, scaling efficiency
- ``programs``    — reading a program: jaxpr equations, collectives with their mesh axes and sizes, compiles
- ``kernels``     — the kernels a compiled program launches, its copies between memory spaces, XLA:CPU on any host
- ``plots``       — loss curves, comparison bars, scaling plots
- ``diagrams``    — pictures of parallel programs drawn from the run's own devices, meshes and shapes
- ``lab``         — one measured run per strategy, the scaling sweep
- ``distributed`` — multi-process JAX: processes, each process's rows, one global mesh
- ``splits``      — the transformer split in ``shard_map``: TP, SP, ring and Ulysses attention, per-layer ZeRO-3
- ``split_diagrams`` — pictures of heads over devices, the ring of key/value blocks, Ulysses' layout change,
  ZeRO-3's per-layer timeline
- ``split_time``  — time beside bytes for those splits: FLOPs per byte sent, the communication-bound degree on a
  named fabric, a ring matmul's overlap plan and XLA:TPU's start/done windows (a model, not a measurement)
- ``split_measure`` — reading those splits' programs in one call each: residual bytes, primitive counts, a
  training step's memory and bytes, where data parallelism's all-reduces sit, attention temporaries by ring size
- ``split_gqa``   — grouped- and multi-query attention under tensor parallelism: key/value heads split or replicated
- ``schedules``   — pipeline schedules as tables of ticks × stages (GPipe, lockstep 1F1B, circular), bubble, stash
- ``pipeline``    — pipeline parallelism in ``shard_map``: stages as layer slices, the executors that run a table
- ``pipeline_measure`` — a pipeline's bubble in compiled FLOPs and in time, its stash in memory, its sends
- ``pipeline_diagrams`` — pictures of schedules (from the run), layers on stages, the stash, experts' load
- ``moe``         — a mixture-of-experts MLP (top-k routing, capacity) and expert parallelism with ``all_to_all``

The course toolkit that runs the notebooks (papermill runs, results files, the site, the student version,
the process launcher, the exercise checkers) is the separate package ``course_tools``.
"""

__version__ = "0.1.0"

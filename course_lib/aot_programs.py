"""The programs :mod:`course_lib.aot` compiles for a mesh of 8 devices, built from abstract inputs only.

Each :class:`Program` makes, from a list of devices (real ones, or the compile-only devices of a TPU
topology that is not attached), a jitted function, its arguments as ``jax.ShapeDtypeStruct`` with their
``NamedSharding`` and the mesh: ``fn.lower(*args).compile()`` then gives the program XLA would run on those
devices, and nothing is placed or run. The programs are the course's own, at the sizes the notebooks use:

- ``lab08.*``: the lab's CNN strategies (``notebooks/08_lab.ipynb``, :data:`course_lib.strategies.REGISTRY`):
  D (``sharded_jit``, data parallel), E′ (``fsdp_jit``, FSDP as sharded jit), C (``shard_map``, data × model)
  and E (``fsdp``, FSDP in ``shard_map``), each in ``float32`` and ``bfloat16`` precision
  (:mod:`course_lib.precision`: float32 parameters, bfloat16 compute); profile ``cpu`` (the size a TPU runs
  the lab at: ``profile="auto"`` picks ``gpu`` only on GPUs), ``tiny`` for tests.
- ``lesson10.*``: the transformer splits of ``notebooks/10_transformers.ipynb`` (:mod:`course_lib.splits`)
  at its ``cpu`` sizes (:data:`LESSON10_CONFIG`, batch 4), on one axis of 8 devices, in float32 (the
  notebook checks parity in float64; a TPU computes in float32 and emulates float64), and the ring matmuls
  of its overlap section: all-gather × matmul one way round the ring (``collective_matmul``) and half of
  each block each way (``collective_matmul_bidi``), matmul × reduce-scatter (``collective_matmul_rs``,
  beside the plain ``matmul_reducescatter``).
- ``lab12.*``: the transformer lab's layouts (``notebooks/12_transformer_lab.ipynb``,
  :mod:`course_lib.lm_layouts`) on their 8-device meshes, ``transformer.TINY``, global batch 16, float32
  (``ep_dp``: the MoE transformer of :mod:`course_lib.lm_experts`, data=4 × expert=2), and ``tp_sp`` left to
  the partitioner (``lab12.tp_sp_partitioner``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import lm_experts, lm_layouts, parallel, splits, strategies, transformer
from . import precision as precision_lib
from .config import PROFILES, init_run
from .meshes import CONTEXT, DATA, MODEL, mesh_of
from .steps import TrainState, init_state, make_optimizer

N_DEVICES = 8
"""Devices of every program's mesh (a TPU v5e ``2x4`` slice has 8 chips)."""

LESSON10_CONFIG = transformer.TransformerConfig(16, 16, 32, 8, 64, 2)
"""``notebooks/10_transformers.ipynb``'s ``SIZES["cpu"]`` model (vocab, seq_len, d_model, n_heads, d_ff,
n_layers); its batch is :data:`LESSON10_BATCH` sequences. ``tests/test_aot.py`` checks the notebook still
says so."""
LESSON10_BATCH = 4
LAB12_BATCH = 16
"""``notebooks/12_transformer_lab.ipynb``'s global batch (sequences per step)."""

LAB08_KEYS = ("sharded_jit", "fsdp_jit", "shard_map", "fsdp")
"""The lab's strategies compiled here: D, E′, C, E (pmap's B has no abstract-device form; A is one device)."""
LAB08_PRECISIONS = ("float32", "bfloat16")

Made = tuple[Callable, tuple, Any]
"""What a program's ``make`` returns: ``(jitted function, abstract arguments, mesh)``."""


@dataclasses.dataclass(frozen=True)
class Program:
    """One program of the catalogue.

    Attributes:
      name: its key, e.g. ``"lab08.sharded_jit.bfloat16"``; also its HLO file's name.
      notebook: the notebook that builds and reads it.
      about: one line on what it is.
      make: ``(devices, profile) -> (jitted function, abstract args, mesh)``; ``devices``: 8 devices (real or
        compile-only), ``profile``: the lab's CNN size (a key of :data:`course_lib.config.PROFILES`).
    """

    name: str
    notebook: str
    about: str
    make: Callable[[Sequence[Any], str], Made]


def abstract(tree: Any, specs: Any, mesh: Any) -> Any:
    """Every leaf of ``tree`` (arrays or ``ShapeDtypeStruct``) as a ``jax.ShapeDtypeStruct`` placed by the
    ``PartitionSpec`` at the same place in ``specs`` (a tree with ``tree``'s structure, or one spec for all)
    on ``mesh``: an argument ``jit(f).lower`` accepts without any array existing."""
    if isinstance(specs, P):
        specs = jax.tree.map(lambda _: specs, tree)
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
        tree,
        specs,
    )


# ---- lab 08: the CNN strategies ------------------------------------------------------------------------------


def _lab08(key: str, precision: str, devices: Sequence[Any], profile: str) -> Made:
    config = PROFILES[profile]
    start = init_run(config, 0, abstract_params=True)
    params = jax.eval_shape(partial(precision_lib.cast_params, precision=precision), start.params)
    optimizer = make_optimizer(config.learning_rate)
    strat = strategies.build(
        key, start.graphdef, params, optimizer, devices, None, precision=precision
    )
    mesh = strat.batch_sharding.mesh
    state = jax.eval_shape(lambda p: init_state(p, optimizer), params)
    specs = TrainState(
        strat.param_specs, parallel.specs_like(state.opt_state, params, strat.param_specs)
    )
    b, m = config.global_batch, config.model
    images = jax.ShapeDtypeStruct(
        (b, m.image_size, m.image_size, m.in_channels),
        precision_lib.PARAM_DTYPES[precision],
        sharding=strat.batch_sharding,
    )
    labels = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=strat.batch_sharding)
    return strat.step, (abstract(state, specs, mesh), (images, labels)), mesh


# ---- lesson 10: the splits -----------------------------------------------------------------------------------


def _params10() -> Any:
    return jax.eval_shape(lambda: transformer.init_model(jax.random.key(0), LESSON10_CONFIG)[1])


def _tokens(mesh, spec: P | None = None, batch: int = LESSON10_BATCH):
    shape, sharding = (batch, LESSON10_CONFIG.seq_len), NamedSharding(mesh, spec or P())
    return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)


def _tp_specs(params) -> dict:
    return {**jax.tree.map(lambda _: P(), params), "blocks": splits.tp_specs(MODEL)}


def _tp_block_implicit(x, p, axis):
    """``splits.tp_block`` without ``megatron_f``: ``shard_map`` inserts a pvary at each use of the input."""
    x = x + splits.tp_attention(transformer.layer_norm(x, p["ln1"]), p["attn"], axis)
    return x + splits.tp_mlp(transformer.layer_norm(x, p["ln2"]), p["mlp"], axis)


def _tp(block, grad: bool, devices, profile) -> Made:
    mesh = mesh_of({MODEL: N_DEVICES}, devices, axis_type="auto")
    params, specs = _params10(), _tp_specs(_params10())
    fwd = jax.shard_map(
        lambda prm, tok: transformer.forward(prm, tok, block_fn=lambda x, p: block(x, p, MODEL)),
        mesh=mesh, in_specs=(specs, P()), out_specs=P(),
    )  # fmt: skip
    fn = jax.grad(lambda prm, tok: jnp.sum(fwd(prm, tok) ** 2)) if grad else fwd
    return jax.jit(fn), (abstract(params, specs, mesh), _tokens(mesh)), mesh


def _sp(devices, profile) -> Made:
    mesh = mesh_of({MODEL: N_DEVICES}, devices, axis_type="auto")
    params, specs = _params10(), _tp_specs(_params10())

    def sp_forward(prm, tok):
        me, s_local = lax.axis_index(MODEL), tok.shape[1] // N_DEVICES
        x = lax.dynamic_slice_in_dim(transformer.embed(prm, tok), me * s_local, s_local, axis=1)
        x, _ = lax.scan(lambda h, p: (splits.sp_block(h, p, MODEL), None), x, prm["blocks"])
        return transformer.head(prm, x)

    fn = jax.shard_map(sp_forward, mesh=mesh, in_specs=(specs, P()), out_specs=P(None, MODEL))
    return jax.jit(fn), (abstract(params, specs, mesh), _tokens(mesh)), mesh


def _context(attention, devices, profile) -> Made:
    mesh = mesh_of({CONTEXT: N_DEVICES}, devices, axis_type="auto")
    c, seq = LESSON10_CONFIG, P(None, CONTEXT)
    qkv = jax.ShapeDtypeStruct((LESSON10_BATCH, c.seq_len, c.n_heads, c.d_head), jnp.float32)
    fn = jax.shard_map(
        lambda q, k, v: attention(q, k, v, CONTEXT), mesh=mesh, in_specs=(seq,) * 3, out_specs=seq
    )
    return jax.jit(fn), tuple(abstract(qkv, seq, mesh) for _ in range(3)), mesh


def _data_step(zero3: bool, devices, profile) -> Made:
    """The notebook's data-parallel or ZeRO-3 (``nothing_saveable``) loss-and-gradients step."""
    mesh = mesh_of({DATA: N_DEVICES}, devices, axis_type="auto")
    params, c, z_batch = _params10(), LESSON10_CONFIG, 2 * N_DEVICES
    specs = jax.tree.map(lambda _: P(), params)
    if zero3:
        specs = {**specs, "blocks": splits.zero3_specs(params["blocks"], DATA)}

    def blocks(x, b):
        if zero3:
            return splits.zero3_blocks(x, b, DATA)
        return lax.scan(lambda h, p: (transformer.block(h, p), None), x, b)[0]

    def loss(prm, tok, tgt):  # this device's share of the global mean loss
        logp = jax.nn.log_softmax(
            transformer.head(prm, blocks(transformer.embed(prm, tok), prm["blocks"]))
        )
        return -jnp.take_along_axis(logp, tgt[..., None], -1).sum() / (z_batch * c.seq_len)

    def step(prm, tok, tgt):
        value, grads = jax.value_and_grad(loss)(prm, tok, tgt)
        return lax.psum(value, DATA), grads

    fn = jax.shard_map(step, mesh=mesh, in_specs=(specs, P(DATA), P(DATA)), out_specs=(P(), specs))
    tok = _tokens(mesh, P(DATA), z_batch)
    return jax.jit(fn), (abstract(params, specs, mesh), tok, tok), mesh


def _matmul(ring: bool, devices, profile) -> Made:
    mesh = mesh_of({MODEL: N_DEVICES}, devices, axis_type="auto")
    n, d = N_DEVICES, LESSON10_CONFIG.d_model
    x = jax.ShapeDtypeStruct((8 * n, d), jnp.float32, sharding=NamedSharding(mesh, P(MODEL)))
    w = jax.ShapeDtypeStruct(
        (d, 2 * d * n), jnp.float32, sharding=NamedSharding(mesh, P(None, MODEL))
    )

    def body(a, b):
        if ring == "bidirectional":
            return splits.collective_matmul_bidirectional(a, b, MODEL)
        return (
            splits.collective_matmul(a, b, MODEL)
            if ring
            else lax.all_gather(a, MODEL, tiled=True) @ b
        )

    fn = jax.shard_map(
        body, mesh=mesh, in_specs=(P(MODEL), P(None, MODEL)), out_specs=P(None, MODEL)
    )
    return jax.jit(fn), (x, w), mesh


def _matmul_rs(ring: bool, devices, profile) -> Made:
    """``psum_scatter(x @ w)``, the contraction split (SP's row-parallel matmul): x [8n, 2Dn], w [2Dn, D]."""
    mesh = mesh_of({MODEL: N_DEVICES}, devices, axis_type="auto")
    n, d = N_DEVICES, LESSON10_CONFIG.d_model
    x = jax.ShapeDtypeStruct(
        (8 * n, 2 * d * n), jnp.float32, sharding=NamedSharding(mesh, P(None, MODEL))
    )
    w = jax.ShapeDtypeStruct((2 * d * n, d), jnp.float32, sharding=NamedSharding(mesh, P(MODEL)))

    def body(a, b):
        if ring:
            return splits.matmul_reduce_scatter(a, b, MODEL)
        return lax.psum_scatter(a @ b, MODEL, scatter_dimension=0, tiled=True)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(None, MODEL), P(MODEL)), out_specs=P(MODEL))
    return jax.jit(fn), (x, w), mesh


# ---- lab 12: the transformer layouts ---------------------------------------------------------------------------


def _lab12(key: str, partitioner: bool, devices, profile) -> Made:
    config = transformer.TINY
    built = lm_layouts.build(key, config, devices, partitioner=partitioner)
    if lm_layouts.LAYOUTS[key].expert_axis:  # ep_dp trains the MoE transformer (lm_experts)
        init = lambda: lm_experts.init_params(jax.random.key(0), config)  # noqa: E731
    else:
        init = lambda: transformer.init_model(jax.random.key(0), config)[1]  # noqa: E731
    params = jax.eval_shape(lambda: built.to_layout(init()))
    params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        params,
        built.param_shardings,
    )
    tokens = jax.ShapeDtypeStruct(
        (LAB12_BATCH, config.seq_len), jnp.int32, sharding=built.batch_sharding
    )
    return built.step, (params, params, tokens, tokens), built.mesh


_LESSON10 = (  # name, what it is, how it is made
    (
        "tp_forward",
        "tensor-parallel blocks (Megatron), forward",
        partial(_tp, splits.tp_block, False),
    ),
    (
        "tp_grad",
        "tensor-parallel blocks, gradient (explicit f)",
        partial(_tp, splits.tp_block, True),
    ),
    (
        "tp_grad_implicit",
        "tensor-parallel gradient, implicit pvary",
        partial(_tp, _tp_block_implicit, True),
    ),
    ("sp_forward", "sequence parallel (Megatron-SP), forward", _sp),
    (
        "ring_attention",
        "ring attention (ppermute in a loop)",
        partial(_context, splits.ring_attention),
    ),
    (
        "ulysses_attention",
        "Ulysses attention (all-to-all)",
        partial(_context, splits.ulysses_attention),
    ),
    ("dp_step", "data-parallel loss and gradients", partial(_data_step, False)),
    ("zero3_step", "ZeRO-3 per layer, nothing_saveable", partial(_data_step, True)),
    ("allgather_matmul", "all-gather, then matmul", partial(_matmul, False)),
    ("collective_matmul", "collective matmul (ppermute ring)", partial(_matmul, True)),
    (
        "collective_matmul_bidi",
        "collective matmul, half of each block each way",
        partial(_matmul, "bidirectional"),
    ),
    ("matmul_reducescatter", "matmul, then reduce-scatter", partial(_matmul_rs, False)),
    (
        "collective_matmul_rs",
        "matmul-reduce-scatter as a ppermute ring",
        partial(_matmul_rs, True),
    ),
)


def _catalogue() -> dict[str, Program]:
    nb8, nb10, nb12 = (
        f"notebooks/{n}.ipynb" for n in ("08_lab", "10_transformers", "12_transformer_lab")
    )
    out = [
        Program(
            f"lab08.{k}.{prec}", nb8, f"{strategies.LABELS[k]}, {prec}", partial(_lab08, k, prec)
        )
        for k in LAB08_KEYS
        for prec in LAB08_PRECISIONS
    ]
    out += [Program(f"lesson10.{name}", nb10, about, make) for name, about, make in _LESSON10]
    out += [
        Program(f"lab12.{k}", nb12, f"layout {lay.label}", partial(_lab12, k, False))
        for k, lay in lm_layouts.LAYOUTS.items()
    ]
    out.append(
        Program(
            "lab12.tp_sp_partitioner",
            nb12,
            "tp_sp left to the partitioner",
            partial(_lab12, "tp_sp", True),
        )
    )
    return {p.name: p for p in out}


PROGRAMS: dict[str, Program] = _catalogue()
"""Every program of the catalogue, by name, in the order above (lab 08, lesson 10, lab 12)."""

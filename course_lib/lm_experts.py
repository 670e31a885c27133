"""The transformer lab's expert-parallel layout ``ep_dp``: a mixture-of-experts transformer on data × expert.

Every block's MLP is lesson 11's mixture-of-experts MLP (:func:`course_lib.moe.init_moe_model`: a router
``[D, E]`` and ``E`` expert MLPs, top-``k`` routing, a capacity per expert). The mesh is ``data × expert``
(8 devices: data=4 × expert=2; on fewer, ``data`` shrinks, :func:`course_lib.lm_layouts.mesh_axes`): the
**tokens split over both axes** (every device routes its own sequences), the **experts over** ``expert``
(each device holds ``E/n_e`` of them), everything else replicated. Written by hand in ``jax.shard_map``
(``check_vma=True``), every collective in the code or the transpose of one:

- ``expert``: per layer, the dispatch buffer ``[E, C, D]`` goes to the experts' devices and their outputs
  come back (:func:`course_lib.moe_layout.to_experts` / ``from_experts``, two ``all_to_all``), and the
  backward pass runs both transposed: **4 all-to-alls per layer**, ``E·C·D`` values each;
- ``data``: each device's experts' gradients, all-reduced over ``data`` only (the ``n_d`` devices of a data
  group hold the same experts; the ``expert`` axis splits them, so it sums nothing there);
- ``data,expert`` (every device): the gradients of everything replicated (attention, LayerNorms,
  embeddings, head, the router) and the loss, in one all-reduce group over both axes.

:func:`predict_bytes` predicts these from shapes, :func:`predict_memory` the arguments and outputs of
``memory_analysis()``, :func:`step_time` the step through the course's one time model (a MODEL, as
:func:`course_lib.lm_times.step_time` for the dense layouts). :func:`reference_step` is the same model on
one device with :func:`course_lib.moe.moe_dense` (no capacity): equal to the layout's step when no token is
dropped, which :data:`CAPACITY_FACTOR` (``E/k``: ``C = N``, a place for every token in every expert)
guarantees. The loss is the cross-entropy alone, without the load-balancing term that training adds
(:func:`course_lib.moe.load_balancing_loss`; at ``C = N`` nothing is dropped, however unbalanced).
Taught in ``notebooks/12_transformer_lab.ipynb`` (parity, bytes and memory beside the other layouts in
sections 1–3; its step-time row in section 4); tested in ``tests/test_lm_experts.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import comms, costs, moe, moe_layout, pipeline, transformer
from .meshes import DATA, EXPERT, mesh_of

__all__ = [
    "N_EXPERTS",
    "TOP_K",
    "CAPACITY_FACTOR",
    "init_params",
    "reference_step",
    "grads_fn",
    "build",
    "param_bytes",
    "predict_bytes",
    "activation_bytes",
    "predict_memory",
    "flops_per_device",
    "step_time",
]

N_EXPERTS = 4
"""Experts per MoE MLP: 2 per device on the 2-way ``expert`` axis."""
TOP_K = 2
"""Experts per token."""
CAPACITY_FACTOR = N_EXPERTS / TOP_K
"""``E/k``: ``C = N`` places per expert and device, enough for every token's choices — nothing is dropped,
so the one-device reference without a capacity (:func:`course_lib.moe.moe_dense`) is exact."""


def init_params(
    key: jax.Array, config: transformer.TransformerConfig, n_experts: int = N_EXPERTS
) -> dict:
    """The MoE transformer's parameters (float32): :func:`course_lib.moe.init_moe_model` —
    ``params["blocks"]["moe"]`` (``router.kernel`` [L, D, E], ``w1.kernel`` [L, E, D, F], ``w1.bias``
    [L, E, F], ``w2.kernel`` [L, E, F, D], ``w2.bias`` [L, E, D]) instead of ``["mlp"]``."""
    return moe.init_moe_model(key, config, n_experts)


def _forward_loss(params, tokens, targets, *, n_layers, eps, mlp_fn, denominator=None):
    """Cross-entropy summed over ``tokens`` [b, S] and divided by ``denominator`` (default: their count),
    the layers unrolled (no collective inside a loop), each block's MLP ``mlp_fn(h, p_moe)``."""
    x = transformer.embed(params, tokens)
    for i in range(n_layers):
        p = jax.tree.map(lambda a, i=i: a[i], params["blocks"])
        x = x + transformer.attention(transformer.layer_norm(x, p["ln1"], eps), p["attn"])
        x = x + mlp_fn(transformer.layer_norm(x, p["ln2"], eps), p["moe"])
    logits = transformer.head(params, x, eps)
    return pipeline.cross_entropy_sum(logits, targets) / (denominator or targets.size)


def _update(params, velocity, grads):
    from .lm_layouts import _update as update  # the lab's SGD with momentum, one definition

    return update(params, velocity, grads)


def reference_step(config: transformer.TransformerConfig, *, k: int = TOP_K) -> Callable:
    """The one-device step ``(params, velocity, tokens, targets) -> (params, velocity, loss, grads)`` of the
    MoE transformer (not jitted): every MLP :func:`course_lib.moe.moe_dense` (no capacity, nothing
    dropped). Tokens and targets int32 [B, S]; the parameters' dtype throughout (float64 for the lab's
    parity)."""
    mlp = partial(moe.moe_dense, k=k)

    def step(params, velocity, tokens, targets):
        loss, grads = jax.value_and_grad(_forward_loss)(
            params, tokens, targets, n_layers=config.n_layers, eps=config.ln_eps, mlp_fn=mlp
        )
        return (*_update(params, velocity, grads), loss, grads)

    return step


def grads_fn(mesh, specs: Any, config, *, k: int = TOP_K, capacity_factor: float = CAPACITY_FACTOR):
    """``(params, tokens, targets) -> (loss, grads)`` on the ``data × expert`` ``mesh``, in ``shard_map``.

    Args:
      mesh: a mesh with axes ``data`` and ``expert``; specs: the parameters' ``PartitionSpec`` tree
        (:func:`course_lib.lm_layouts.param_specs` of ``"ep_dp"``: the experts' leaves split over
        ``expert``, the rest replicated).
      config: the transformer's shape; k, capacity_factor: the routing (:func:`course_lib.moe.capacity`).

    Returns:
      A function of global arrays (tokens and targets int32 [B, S], B split over both axes): the mean loss
      (replicated) and the gradients (laid out by ``specs``). Each leaf is made to vary (``lax.pcast``)
      over the axes its spec does not split it over, so its gradient's all-reduce (the transpose) sums
      over exactly those: ``data,expert`` for the replicated leaves, ``data`` for the experts'.

    Raises:
      ValueError: when the returned function is traced, if the experts do not split over the ``expert``
        axis (:func:`course_lib.moe_layout.moe_mlp_ep_dp`).
    """
    axes = (DATA, EXPERT)
    n_shards = mesh.shape[DATA] * mesh.shape[EXPERT]
    mlp = partial(
        moe_layout.moe_mlp_ep_dp, expert_axis=EXPERT, k=k, capacity_factor=capacity_factor
    )

    def vary(x, spec):
        missing = tuple(a for a in axes if a not in tuple(spec))
        return lax.pcast(x, missing, to="varying")

    def local_loss(params, tokens, targets):
        params = jax.tree.map(vary, params, specs)
        loss = _forward_loss(params, tokens, targets, n_layers=config.n_layers, eps=config.ln_eps,
                             mlp_fn=mlp, denominator=targets.size * n_shards)  # fmt: skip
        return lax.psum(loss, axes)

    batch = P(axes, None)
    return jax.shard_map(jax.value_and_grad(local_loss), mesh=mesh, in_specs=(specs, batch, batch),
                         out_specs=(P(), specs), check_vma=True)  # fmt: skip


def build(config, devices: Sequence[Any], *, compiler_options: dict | None = None):
    """Layout ``ep_dp``'s step on ``devices`` (their number fixes the mesh): a
    :class:`course_lib.lm_layouts.Built` whose ``place`` takes the MoE parameters (:func:`init_params`).

    Raises:
      ValueError: a device count the layout does not fit (an odd count: the expert axis is 2), or
        :data:`N_EXPERTS` not divisible by the expert axis.
    """
    from .lm_layouts import Built, fixed_axes, mesh_axes, param_specs

    devices = list(devices)
    sizes = mesh_axes("ep_dp", len(devices))
    if sizes is None:
        raise ValueError(
            f"layout 'ep_dp' needs a multiple of {math.prod(fixed_axes('ep_dp').values())} devices "
            f"(expert={fixed_axes('ep_dp')[EXPERT]}); {len(devices)} given"
        )
    if N_EXPERTS % sizes[EXPERT]:
        raise ValueError(
            f"{N_EXPERTS} experts do not split over expert={sizes[EXPERT]} devices; use an expert axis "
            f"that divides {N_EXPERTS}"
        )
    mesh = mesh_of(sizes, devices, axis_type="auto")
    abstract = jax.eval_shape(lambda: init_params(jax.random.key(0), config))
    specs = param_specs("ep_dp", abstract, sizes)
    grads_of = grads_fn(mesh, specs, config)

    def step(params, velocity, tokens, targets):
        loss, grads = grads_of(params, tokens, targets)
        return (*_update(params, velocity, grads), loss, grads)

    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    batch_sharding = NamedSharding(mesh, P((DATA, EXPERT), None))
    jitted = jax.jit(
        step,
        in_shardings=(shardings, shardings, batch_sharding, batch_sharding),
        out_shardings=(shardings, shardings, NamedSharding(mesh, P()), shardings),
        compiler_options=compiler_options,
    )
    same = lambda prm: prm  # noqa: E731
    return Built("ep_dp", mesh, sizes, jitted, shardings, batch_sharding, same, same)


# ---- bytes, memory and time from shapes ---------------------------------------------------------------------


def _param_split(config, sizes, itemsize: int) -> tuple[int, int]:
    """(replicated bytes, the experts' local bytes) of one device's parameters."""
    abstract = jax.eval_shape(lambda: init_params(jax.random.key(0), config))
    total = sum(math.prod(a.shape) for a in jax.tree.leaves(abstract)) * itemsize
    experts = config.n_layers * moe_layout.expert_param_count(
        config.d_model, config.d_ff, N_EXPERTS
    )
    return total - experts * itemsize, experts * itemsize // sizes[EXPERT]


def param_bytes(config, sizes: dict[str, int], itemsize: int = 4) -> int:
    """Bytes of one device's parameters: everything but the experts whole, ``E/n_e`` experts per layer."""
    return sum(_param_split(config, sizes, itemsize))


def _tokens(config, global_batch: int, sizes: dict[str, int]) -> int:
    shards = sizes[DATA] * sizes[EXPERT]
    if global_batch % shards:
        raise ValueError(
            f"global_batch={global_batch} does not split over data={sizes[DATA]} x expert={sizes[EXPERT]}; "
            f"use a multiple of {shards}"
        )
    return global_batch // shards * config.seq_len


def predict_bytes(config, global_batch: int, sizes: dict[str, int], *, itemsize: int = 4,
                  capacity_factor: float = CAPACITY_FACTOR) -> list:  # fmt: skip
    """Every collective of one ``ep_dp`` step, from shapes (per device): :class:`course_lib.comms.Transfer`
    items, ``axis`` named as the compiled program's (:func:`course_lib.comms.collectives`).

    ``expert``: 4 all-to-alls per layer of ``E·C·D·itemsize`` bytes (``C``: :func:`course_lib.moe.capacity`
    of the device's ``N`` tokens); ``data``: the device's experts' gradients; ``data,expert``: every
    replicated parameter's gradient and the loss. An axis of one device sends nothing (left out).

    Raises:
      ValueError: a global batch the ``data × expert`` shards do not divide.
    """
    n_d, n_e = sizes[DATA], sizes[EXPERT]
    cap = moe.capacity(_tokens(config, global_batch, sizes), N_EXPERTS, TOP_K, capacity_factor)
    buffer = N_EXPERTS * cap * config.d_model * itemsize
    replicated, experts = _param_split(config, sizes, itemsize)
    both = ",".join(a for a, s in ((DATA, n_d), (EXPERT, n_e)) if s > 1)
    out = [comms.transfer("all-to-all", EXPERT, n_e, buffer, "tokens to experts and back (fwd, bwd)")
           for _ in range(4 * config.n_layers)]  # fmt: skip
    out.append(comms.transfer("all-reduce", DATA, n_d, experts, "experts' gradients"))
    out.append(
        comms.transfer("all-reduce", both, n_d * n_e, replicated + itemsize, "gradients (+ loss)")
    )
    return [t for t in out if t.group_size > 1]


def activation_bytes(config, global_batch: int, sizes: dict[str, int], itemsize: int = 4, *,
                     capacity_factor: float = CAPACITY_FACTOR) -> int:  # fmt: skip
    """Bytes of the activations one device keeps for the backward pass — an ESTIMATE, as
    :func:`course_lib.lm_costs.activation_bytes` for the dense layouts: per layer at the device's ``b``
    sequences (``N = b·S`` tokens) the residual stream, the two LayerNorm outputs, q, k, v and the attention
    output ``7·N·D``, the scores and weights ``2·b·H·S·S``, the router's logits and probabilities ``2·N·E``,
    the four ``[E, C, D]`` buffers (dispatched, received, the experts' outputs, returned) and the experts'
    two hidden values ``2·E·C·F``; the logits ``N·V`` once."""
    n = _tokens(config, global_batch, sizes)
    cap = moe.capacity(n, N_EXPERTS, TOP_K, capacity_factor)
    d, e = config.d_model, N_EXPERTS
    b, s = n // config.seq_len, config.seq_len
    layer = (
        7 * n * d + 2 * b * config.n_heads * s * s + 2 * n * e + e * cap * (4 * d + 2 * config.d_ff)
    )
    return int((config.n_layers * layer + n * config.vocab) * itemsize)


def predict_memory(config, global_batch: int, sizes: dict[str, int], itemsize: int = 4, *,
                   capacity_factor: float = CAPACITY_FACTOR) -> dict[str, int]:  # fmt: skip
    """Bytes per device by kind, as :func:`course_lib.lm_costs.predict_memory` for the dense layouts:
    ``params`` (= ``optimizer`` = ``gradients``), ``batch`` (tokens and targets, int32), ``activations``
    (:func:`activation_bytes`, an estimate), and what ``memory_analysis()`` reports exactly on XLA:CPU:
    ``arguments`` (params + momentum + batch) and ``outputs`` (params + momentum + gradients + the loss + 8
    bytes per output array)."""
    prm = param_bytes(config, sizes, itemsize)
    batch = 2 * _tokens(config, global_batch, sizes) * 4
    acts = activation_bytes(config, global_batch, sizes, itemsize, capacity_factor=capacity_factor)
    n_leaves = len(jax.tree.leaves(jax.eval_shape(lambda: init_params(jax.random.key(0), config))))
    return {"params": prm, "optimizer": prm, "gradients": prm, "batch": batch, "activations": acts,
            "arguments": 2 * prm + batch, "outputs": 3 * prm + itemsize + 8 * (3 * n_leaves + 1)}  # fmt: skip


def flops_per_device(config, global_batch: int, sizes: dict[str, int], *,
                     capacity_factor: float = CAPACITY_FACTOR) -> float:  # fmt: skip
    """FLOPs one device runs per step (a model, forward and backward ``3×`` the forward): the dense
    transformer's per token (:func:`course_lib.transformer.flops_per_token`) without its MLP, plus per layer
    the router ``2·D·E`` per token and the experts' MLP ``4·D·F`` on every place of the buffers the device's
    experts receive: ``E·C`` rows (padding included: the program computes empty places too)."""
    n = _tokens(config, global_batch, sizes)
    cap = moe.capacity(n, N_EXPERTS, TOP_K, capacity_factor)
    d, f, layers = config.d_model, config.d_ff, config.n_layers
    dense = (transformer.flops_per_token(config) - layers * 4 * d * f) * n
    moe_flops = layers * (2 * d * N_EXPERTS * n + 4 * d * f * N_EXPERTS * cap)
    return 3.0 * (dense + moe_flops)


def step_time(config, global_batch: int, fabric, n_devices: int = 8, *, precision: str = "bfloat16",
              roofline: bool = True, mfu: float = 1.0, overlap: str = "none",
              capacity_factor: float = 1.25) -> dict[str, Any]:  # fmt: skip
    """``ep_dp``'s step time on ``fabric`` — a MODEL through the course's one time model
    :func:`course_lib.costs.step_time`, as :func:`course_lib.lm_times.step_time` for the dense layouts (which
    calls this one for ``ep_dp``): :func:`flops_per_device` at ``mfu`` of the peak, with ``roofline`` the HBM
    bytes ``8·params + 2·activations`` (:func:`predict_memory`), every :func:`predict_bytes` transfer on its
    axis's link; ``overlap`` as there (the all-to-alls are on the critical path: the experts wait for their
    tokens; ``critical_s`` is their time, overlapped by nothing under ``"data"``). ``capacity_factor`` 1.25
    by default (a usual training setting: the experts compute all ``E·C ≈ 1.25·k·N`` places per device and
    layer, empty ones included, and choices beyond ``C`` would be dropped; the lab's parity uses
    :data:`CAPACITY_FACTOR`, which drops nothing).

    Returns:
      The keys of :func:`course_lib.lm_times.step_time` (``bubble_s`` 0).

    Raises:
      ValueError: the layout does not fit ``n_devices``, the batch does not split, or an unknown ``overlap``.
    """
    from .lm_layouts import mesh_axes
    from .lm_times import OVERLAPS, _itemsize

    sizes = mesh_axes("ep_dp", n_devices)
    if sizes is None:
        raise ValueError(
            f"layout 'ep_dp' does not fit {n_devices} devices (a multiple of 2 needed)"
        )
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap={overlap!r}; one of {OVERLAPS}")
    itemsize = _itemsize(precision)
    mem = predict_memory(config, global_batch, sizes, itemsize, capacity_factor=capacity_factor)
    flops = flops_per_device(config, global_batch, sizes, capacity_factor=capacity_factor) / mfu
    moved = 8 * mem["params"] + 2 * mem["activations"]
    transfers = predict_bytes(
        config, global_batch, sizes, itemsize=itemsize, capacity_factor=capacity_factor
    )
    t = costs.step_time(flops, moved if roofline else None, transfers, fabric, precision)
    # the all-to-alls alone (not the axis: at data=1 the gradients' all-reduce runs over expert too)
    critical = sum(
        costs.collective_time(x.kind, x.group_size, x.size_bytes, fabric.link_of(x.axis))
        for x in transfers
        if x.kind == "all-to-all"
    )
    roof = t["roofline_s"]
    bounds = {"no_overlap_s": t["no_overlap_s"], "overlap_s": t["overlap_s"],
              "data_overlap_s": max(roof, t["comm_s"] - critical) + critical}  # fmt: skip
    step = bounds[{"none": "no_overlap_s", "data": "data_overlap_s", "all": "overlap_s"}[overlap]]
    return {
        "layout": "ep_dp", "sizes": sizes, "compute_s": roof, "flop_s": t["compute_s"], "hbm_s": t["memory_s"],
        "hbm_bytes": moved, "comm_s": t["comm_by_axis"], "critical_s": critical, **bounds, "step_s": step,
        "overlap": overlap, "bubble_s": 0.0, "sent_bytes": comms.total_sent(transfers),
        "memory_bytes": mem["params"] + mem["optimizer"] + mem["gradients"] + mem["activations"],
    }  # fmt: skip

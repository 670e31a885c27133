"""A mixture-of-experts MLP (top-k routing, a capacity per expert) and expert parallelism with ``all_to_all``.

The MLP of a transformer block becomes ``E`` expert MLPs and a **router** (``[D, E]``): each token goes to
the ``k`` experts with the largest router probabilities, weighted by those probabilities renormalised over
the ``k`` (:func:`route`). Each expert takes at most ``C`` tokens of a group (:func:`capacity`: ``C =
ceil(capacity_factor · k · N / E)`` for ``N`` tokens); places are given in order — every token's first
choice before any second choice, tokens in order within a choice — and a choice that finds its expert full
is **dropped** (the token gets less, or nothing, from the MLP; the block's residual still carries it).

- :func:`load_balancing_loss` — the auxiliary loss that training adds to balance the experts' load
  (Switch Transformer): ``E · Σ_i f_i · P_i``, 1 for a balanced router, up to ``E`` for a collapsed one.
- :func:`moe_dense` — the reference: every token through its ``k`` experts, no capacity.
- :func:`moe_mlp` — one device: tokens in ``n_groups`` groups routed apart (as ``n_groups`` devices would
  route their own tokens), :func:`dispatch` to ``[E, C, D]`` buffers, the experts, :func:`combine`.
- :func:`moe_mlp_ep` — inside ``shard_map`` over an expert axis of ``n`` devices: each device holds ``E/n``
  experts and ``N`` tokens; the dispatch buffer goes to the experts' devices with one ``all_to_all`` and
  comes back with another (:func:`all_to_all_bytes` predicts each). Equal to :func:`moe_mlp` with
  ``n_groups = n``, and to :func:`moe_dense` when nothing is dropped.

:func:`init_moe_model` and :func:`block` put the MoE MLP into the transformer of
:mod:`course_lib.transformer` (``params["blocks"]["moe"]`` instead of ``["mlp"]``); :func:`ep_loss` runs
it with expert parallelism. Taught in ``notebooks/11_pipeline_experts.ipynb``; ``tests/test_moe.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from . import transformer

__all__ = [
    "Routing",
    "init_moe",
    "capacity",
    "route",
    "dispatch",
    "combine",
    "experts",
    "moe_dense",
    "moe_mlp",
    "moe_mlp_ep",
    "dropped_fraction",
    "expert_load",
    "load_balancing_loss",
    "all_to_all_bytes",
    "expert_specs",
    "init_moe_model",
    "block",
    "loss_fn",
    "ep_loss",
]


class Routing(NamedTuple):
    """Where each token's ``k`` choices go. All ``[N, k]``.

    Attributes:
      expert: int32, the chosen expert (largest router probability first).
      slot: int32, the choice's place in its expert's buffer (``>= capacity``: no place).
      keep: bool, ``slot < capacity``: the choice is computed (False: dropped).
      gate: float, the choice's weight: router probabilities renormalised over the ``k`` choices.
    """

    expert: jax.Array
    slot: jax.Array
    keep: jax.Array
    gate: jax.Array


def init_moe(key: jax.Array, d_model: int, d_ff: int, n_experts: int, dtype=jnp.float32) -> dict:
    """Parameters of one MoE MLP: ``router.kernel`` [D, E], ``w1.kernel`` [E, D, F], ``w1.bias`` [E, F],
    ``w2.kernel`` [E, F, D], ``w2.bias`` [E, D] (LeCun-normal kernels, small random biases, router scaled
    so its probabilities are not all equal)."""
    k_r, k1, k2, kb1, kb2 = jax.random.split(key, 5)
    normal = lambda k, shape, fan: jax.random.normal(k, shape, dtype) / math.sqrt(fan)  # noqa: E731
    return {
        "router": {"kernel": normal(k_r, (d_model, n_experts), d_model / 4)},
        "w1": {"kernel": normal(k1, (n_experts, d_model, d_ff), d_model),
               "bias": 0.1 * jax.random.normal(kb1, (n_experts, d_ff), dtype)},
        "w2": {"kernel": normal(k2, (n_experts, d_ff, d_model), d_ff),
               "bias": 0.1 * jax.random.normal(kb2, (n_experts, d_model), dtype)},
    }  # fmt: skip


def capacity(n_tokens: int, n_experts: int, k: int, capacity_factor: float) -> int:
    """Places per expert for a group of ``n_tokens``: ``ceil(capacity_factor · k · n_tokens / n_experts)``.

    ``capacity_factor = 1`` gives the places a perfectly balanced router would fill; ``E/k`` is always
    enough (every token's choices can go to one expert).

    Raises:
      ValueError: non-positive sizes or factor, or ``k > n_experts``.
    """
    if min(n_tokens, n_experts, k) < 1 or capacity_factor <= 0:
        raise ValueError(
            f"n_tokens={n_tokens}, n_experts={n_experts}, k={k} must be >= 1 and capacity_factor="
            f"{capacity_factor} > 0"
        )
    if k > n_experts:
        raise ValueError(
            f"k={k} experts per token but only n_experts={n_experts}; use k <= {n_experts}"
        )
    return max(1, math.ceil(capacity_factor * k * n_tokens / n_experts))


def route(logits: jax.Array, k: int, cap: int) -> Routing:
    """Top-``k`` routing with a capacity of ``cap`` per expert: logits [N, E] → :class:`Routing`.

    Places are given choice by choice (all first choices, then all second choices, …), tokens in order
    within a choice: a token's slot in expert ``e`` is the number of earlier entries in that order that
    chose ``e``.
    """
    n, e = logits.shape
    probs = jax.nn.softmax(logits, axis=-1)
    gate, expert = lax.top_k(probs, k)  # [N, k]
    gate = gate / gate.sum(-1, keepdims=True)
    chosen = jax.nn.one_hot(expert, e, dtype=jnp.int32).transpose(1, 0, 2).reshape(k * n, e)
    before = jnp.cumsum(chosen, axis=0) - chosen  # [kN, E]: earlier entries that chose each expert
    slot = (before * chosen).sum(-1).reshape(k, n).T  # [N, k]
    return Routing(expert, slot.astype(jnp.int32), slot < cap, gate)


def dispatch(x: jax.Array, r: Routing, n_experts: int, cap: int) -> jax.Array:
    """Tokens into the experts' buffers: x [N, D] → [E, C, D] (empty places are zeros)."""
    n, k = r.expert.shape
    flat = jnp.where(
        r.keep, r.expert * cap + r.slot, n_experts * cap
    )  # the spare row takes the dropped
    rows = jnp.broadcast_to(x[:, None], (n, k, x.shape[-1])).reshape(n * k, -1)
    buf = jnp.zeros((n_experts * cap + 1, x.shape[-1]), x.dtype).at[flat.reshape(-1)].add(rows)
    return buf[:-1].reshape(n_experts, cap, x.shape[-1])


def combine(y: jax.Array, r: Routing) -> jax.Array:
    """The experts' outputs back to the tokens: y [E, C, D] → [N, D], ``Σ_k gate · keep · y[expert, slot]``."""
    e, cap, d = y.shape
    flat = jnp.where(r.keep, r.expert * cap + r.slot, 0)
    picked = y.reshape(e * cap, d)[flat]  # [N, k, D]
    return (picked * (r.gate * r.keep)[..., None]).sum(1)


def experts(p: dict, h: jax.Array) -> jax.Array:
    """Each expert's MLP on its own rows: h [E, …, D] → [E, …, D] (``p``'s leaves lead with the same E)."""
    w1, b1, w2, b2 = p["w1"]["kernel"], p["w1"]["bias"], p["w2"]["kernel"], p["w2"]["bias"]
    lead = (slice(None),) + (None,) * (h.ndim - 2)
    z = jax.nn.gelu(jnp.einsum("e...d,edf->e...f", h, w1) + b1[lead])
    return jnp.einsum("e...f,efd->e...d", z, w2) + b2[lead]


def moe_dense(x: jax.Array, p: dict, *, k: int = 2) -> jax.Array:
    """The reference MoE MLP without a capacity: x [..., D] → [..., D], every expert run on every token
    and each token's ``k`` chosen outputs summed with their gates."""
    flat = x.reshape(-1, x.shape[-1])
    r = route(flat @ p["router"]["kernel"], k, flat.shape[0] * k)
    every = experts(
        p, jnp.broadcast_to(flat, (p["w1"]["kernel"].shape[0], *flat.shape))
    )  # [E, N, D]
    picked = jnp.take_along_axis(every.transpose(1, 0, 2), r.expert[..., None], axis=1)  # [N, k, D]
    return (picked * r.gate[..., None]).sum(1).reshape(x.shape)


def moe_mlp(
    x: jax.Array,
    p: dict,
    *,
    k: int = 2,
    capacity_factor: float = 1.25,
    n_groups: int = 1,
    limit: jax.Array | int | None = None,
) -> jax.Array:
    """The MoE MLP on one device: x [..., D] → [..., D]; the tokens (rows of ``x`` flattened) are cut into
    ``n_groups`` equal groups, each routed with its own capacity (as ``n_groups`` devices would).

    Args:
      limit: optional places per expert actually used (a traced int is fine), at most the capacity that
        ``capacity_factor`` gives (which sizes the buffers): one compiled program serves every limit.

    Raises:
      ValueError: the token count is not divisible by ``n_groups``.
    """
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] % n_groups:
        raise ValueError(f"{flat.shape[0]} tokens do not split into {n_groups} groups")
    e = p["router"]["kernel"].shape[1]
    groups = flat.reshape(n_groups, -1, flat.shape[-1])
    cap = capacity(groups.shape[1], e, k, capacity_factor)

    def one(g):
        r = route(g @ p["router"]["kernel"], k, cap if limit is None else jnp.minimum(limit, cap))
        return combine(experts(p, dispatch(g, r, e, cap)), r)

    return jax.vmap(one)(groups).reshape(x.shape)


def moe_mlp_ep(
    x: jax.Array, p: dict, *, axis: str, k: int = 2, capacity_factor: float = 1.25
) -> jax.Array:
    """The MoE MLP with expert parallelism, inside ``shard_map`` over ``axis`` (n devices).

    Args:
      x: [..., D], this device's tokens (N after flattening).
      p: the router whole (``router.kernel`` [D, E]); the experts' leaves split over ``axis``
        (``w1.kernel`` [E/n, D, F], …; :func:`expert_specs`).
      axis: the expert axis's name.

    Returns:
      [..., D]. Two ``all_to_all`` over ``axis``: the dispatch buffer [E, C, D] goes out (expert group j to
      device j) and the experts' outputs come back, each ``E·C·D`` elements per device.
    """
    n = lax.axis_size(axis)
    flat = x.reshape(-1, x.shape[-1])
    e = p["router"]["kernel"].shape[1]
    if e % n:
        raise ValueError(f"{e} experts do not split over {n} devices of axis {axis!r}")
    cap = capacity(flat.shape[0], e, k, capacity_factor)
    r = route(flat @ p["router"]["kernel"], k, cap)
    buf = dispatch(flat, r, e, cap)  # [E, C, D], expert-major
    got = lax.all_to_all(
        buf, axis, 0, 0, tiled=True
    )  # [n·E/n, C, D]: my experts' rows, source-major
    got = got.reshape(n, e // n, cap, -1).transpose(1, 0, 2, 3)  # [E/n, n, C, D]
    out = experts(p, got).transpose(1, 0, 2, 3).reshape(e, cap, -1)  # source-major again
    back = lax.all_to_all(out, axis, 0, 0, tiled=True)  # [E, C, D], expert-major
    return combine(back, r).reshape(x.shape)


def dropped_fraction(x: jax.Array, p: dict, *, k: int = 2, capacity_factor: float = 1.25,
                     n_groups: int = 1, limit: jax.Array | int | None = None) -> jax.Array:  # fmt: skip
    """Fraction of the token choices that find their expert full (routing as :func:`moe_mlp`)."""
    flat = x.reshape(n_groups, -1, x.shape[-1])
    cap = capacity(flat.shape[1], p["router"]["kernel"].shape[1], k, capacity_factor)
    cap = cap if limit is None else jnp.minimum(limit, cap)
    keep = jax.vmap(lambda g: route(g @ p["router"]["kernel"], k, cap).keep)(flat)
    return 1.0 - keep.mean()


def expert_load(x: jax.Array, p: dict, *, k: int = 2) -> jax.Array:
    """Token choices each expert receives from the tokens x [N, D] (before any capacity): int32 [E]."""
    r = route(x @ p["router"]["kernel"], k, x.shape[0] * k)
    return jax.nn.one_hot(r.expert, p["router"]["kernel"].shape[1], dtype=jnp.int32).sum((0, 1))


def load_balancing_loss(logits: jax.Array, k: int = 1) -> jax.Array:
    """The Switch Transformer's auxiliary load-balancing loss, ``E · Σ_i f_i · P_i``: a scalar.

    ``f_i`` is the fraction of the ``k·N`` choices of the top-``k`` routing that go to expert ``i`` (before
    any capacity; Switch uses ``k = 1``) and ``P_i`` the router probability of expert ``i`` averaged over the
    tokens. ``f`` is piecewise constant, so the gradient flows through ``P`` only: it lowers the
    probability of the experts that receive more than their share. The value is 1 when either ``f`` or
    ``P`` is uniform (``Σ f_i = Σ P_i = 1``) and at most ``E/k``: a token's ``k`` choices are different
    experts, so ``f_i ≤ 1/k`` and ``Σ f_i·P_i ≤ max_i f_i ≤ 1/k``; it approaches ``E/k`` when every token
    goes to one expert with probability 1. It can fall below 1 while the load is uneven (``f`` and ``P``
    anti-correlated): a training signal, not a measure of balance (:func:`expert_load` is). Training adds
    ``α`` times it to the model's loss (Switch: ``α = 0.01``), once per MoE layer.

    Args:
      logits: float [N, E], the router's logits for N tokens.
      k: experts per token (1 ≤ k ≤ E).

    Returns:
      float scalar (the logits' dtype).

    Raises:
      ValueError: ``k`` outside ``[1, E]``.

    Taught in ``notebooks/11_pipeline_experts.ipynb`` (section 9); ``tests/test_moe.py``.
    """
    n_experts = logits.shape[-1]
    if not 1 <= k <= n_experts:
        raise ValueError(f"k={k} experts per token; use 1 <= k <= n_experts={n_experts}")
    probs = jax.nn.softmax(logits, axis=-1)  # [N, E]
    chosen = lax.top_k(probs, k)[1]  # [N, k]
    frac = jax.nn.one_hot(chosen, n_experts, dtype=probs.dtype).mean((0, 1))  # f: [E], sums to 1
    return n_experts * jnp.sum(lax.stop_gradient(frac) * probs.mean(0))


def all_to_all_bytes(n_tokens: int, n_experts: int, k: int, capacity_factor: float, d_model: int,
                     n: int, itemsize: int = 4) -> dict:  # fmt: skip
    """Predicted size of each of :func:`moe_mlp_ep`'s two ``all_to_all`` per device, from shapes.

    Returns:
      ``{"capacity": C, "buffer": E·C·D·itemsize (the operand and the result, bytes), "sent": (n-1)/n of
      it (the rows that leave the device; the rest stays)}``.
    """
    cap = capacity(n_tokens, n_experts, k, capacity_factor)
    buffer = n_experts * cap * d_model * itemsize
    return {"capacity": cap, "buffer": buffer, "sent": buffer * (n - 1) / n}


def expert_specs(p: dict, axis: str, lead: int = 0) -> dict:
    """PartitionSpecs for MoE parameters: the experts' leaves split on their expert dimension over
    ``axis`` (after ``lead`` leading dimensions, e.g. 1 for the layer axis), the router replicated."""
    pre = (None,) * lead
    split = P(*pre, axis)
    return {
        name: jax.tree.map(lambda _, r=name == "router": P() if r else split, sub)
        for name, sub in p.items()
    }


def init_moe_model(key: jax.Array, config: transformer.TransformerConfig, n_experts: int) -> dict:
    """The transformer's parameters (:func:`course_lib.transformer.init_model`) with each block's MLP
    replaced by a MoE MLP: ``params["blocks"]["moe"]`` (leaves ``[L, …]``) instead of ``["mlp"]``."""
    k_model, k_moe = jax.random.split(key)
    _, params = transformer.init_model(k_model, config)
    keys = jax.random.split(k_moe, config.n_layers)
    moe = jax.vmap(lambda kk: init_moe(kk, config.d_model, config.d_ff, n_experts))(keys)
    blocks = {name: v for name, v in params["blocks"].items() if name != "mlp"}
    return {**params, "blocks": {**blocks, "moe": moe}}


def block(x: jax.Array, p: dict, *, mlp_fn: Callable, eps: float = 1e-5) -> jax.Array:
    """A transformer block whose MLP is ``mlp_fn(h [B, S, D], p["moe"])`` (one of the MoE MLPs above)."""
    x = x + transformer.attention(transformer.layer_norm(x, p["ln1"], eps), p["attn"])
    return x + mlp_fn(transformer.layer_norm(x, p["ln2"], eps), p["moe"])


def loss_fn(params: dict, tokens: jax.Array, targets: jax.Array, *, mlp_fn: Callable,
            eps: float = 1e-5) -> jax.Array:  # fmt: skip
    """Mean next-token cross-entropy of the MoE transformer with ``mlp_fn`` as every block's MLP."""
    logits = transformer.forward(
        params, tokens, block_fn=partial(block, mlp_fn=mlp_fn, eps=eps), eps=eps
    )
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def ep_loss(mesh: Any, axis: str, *, k: int = 2, capacity_factor: float = 1.25, eps: float = 1e-5):
    """``loss(params, tokens, targets)`` of the MoE transformer with expert parallelism over ``axis``:
    the batch and the experts split over it, everything else replicated; differentiate it with
    ``jax.grad``. Equal to :func:`loss_fn` with ``moe_mlp(..., n_groups=n)`` on one device, where each
    group is one device's sequences.
    """
    mlp = partial(moe_mlp_ep, axis=axis, k=k, capacity_factor=capacity_factor)

    def body(params, tokens, targets):
        return lax.pmean(loss_fn(params, tokens, targets, mlp_fn=mlp, eps=eps), axis)

    def loss(params, tokens, targets):
        rest = jax.tree.map(lambda _: P(), {n: v for n, v in params.items() if n != "blocks"})
        blocks = {
            n: jax.tree.map(lambda _: P(), v) for n, v in params["blocks"].items() if n != "moe"
        }
        blocks["moe"] = expert_specs(params["blocks"]["moe"], axis, lead=1)
        specs = {**rest, "blocks": blocks}
        return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(axis), P(axis)), out_specs=P())(
            params, tokens, targets
        )

    return loss

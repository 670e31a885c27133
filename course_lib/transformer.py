"""A small decoder-only transformer in Flax NNX, exposed functionally — the model of lessons 10–12.

Pre-LayerNorm GPT blocks: ``x + attention(LN(x))`` then ``x + MLP(LN(x))``, causal multi-head attention
with the heads as an explicit axis of every projection (``wq``/``wk``/``wv``: [D, H, Dh], ``wo``: [H, Dh, D]),
a GELU MLP ([D, F] then [F, D]), learned token and position embeddings, a final LayerNorm and an untied
output projection. No dropout, so every step is a deterministic function of the parameters and the batch.

The blocks are created with ``nnx.vmap`` and run with ``nnx.scan``: every block parameter carries a leading
layer axis ``L`` (``params["blocks"]["attn"]["wq"]["kernel"]``: [L, D, H, Dh]). A scan over layers is what
per-layer FSDP (ZeRO-3: gather one layer, use it, free it) and pipeline parallelism (a stage = a slice of the
layer axis) need, and it compiles one block however deep the model is.

Two ways to run the same parameters:

- :func:`apply` — the NNX module itself, merged from ``(graphdef, params)`` at trace time (as the CNN's
  :func:`course_lib.model.apply`): the reference.
- :func:`forward` — the same math written with ``jnp`` on the plain parameter dict, one function per piece
  (:func:`layer_norm`, :func:`attention`, :func:`mlp`, :func:`block`), with a ``block_fn`` argument: the
  parallel versions of lessons 10–12 replace one piece (a tensor-parallel MLP, ring attention, a per-layer
  gather) and keep the rest. ``tests/test_transformer.py`` checks ``forward == apply`` in float64.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = [
    "TransformerConfig",
    "TINY",
    "CPU",
    "GPU",
    "CONFIGS",
    "Transformer",
    "init_model",
    "apply",
    "forward",
    "block",
    "attention",
    "causal_attention",
    "mlp",
    "layer_norm",
    "embed",
    "head",
    "param_count",
    "flops_per_token",
]


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Shape of the transformer (frozen: hashable, so it can be a static argument).

    Attributes:
      vocab: number of token ids; tokens are int32 in ``[0, vocab)``.
      seq_len: tokens per sequence S (the position table's length).
      d_model: width D of the residual stream.
      n_heads: attention heads H; ``d_model`` must divide by it (``d_head = d_model // n_heads``).
      d_ff: width F of the MLP's hidden layer.
      n_layers: blocks L.
      ln_eps: LayerNorm epsilon.
    """

    vocab: int = 64
    seq_len: int = 64
    d_model: int = 64
    n_heads: int = 8
    d_ff: int = 256
    n_layers: int = 4
    ln_eps: float = 1e-5

    def __post_init__(self):
        for name in ("vocab", "seq_len", "d_model", "n_heads", "d_ff", "n_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.vocab < 2:
            raise ValueError(f"vocab={self.vocab} must be at least 2")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                f"use a multiple of {self.n_heads} (e.g. {self.n_heads * max(1, self.d_model // self.n_heads)})"
            )

    @property
    def d_head(self) -> int:
        """Width of one head: ``d_model // n_heads``."""
        return self.d_model // self.n_heads


TINY = TransformerConfig(vocab=16, seq_len=16, d_model=32, n_heads=8, d_ff=64, n_layers=2)
"""For tests: every axis divides by 8 (heads, MLP width, sequence), so any 1/2/4/8-way split works."""
CPU = TransformerConfig(vocab=64, seq_len=64, d_model=64, n_heads=8, d_ff=256, n_layers=4)
"""The lessons' size on simulated CPU devices (about 0.2 M parameters)."""
GPU = TransformerConfig(vocab=32768, seq_len=2048, d_model=2048, n_heads=16, d_ff=8192, n_layers=16)
"""A real size for 8 GPUs: about 0.9 B parameters (16 layers of 50 M, embeddings 2 × 67 M)."""
CONFIGS = {"tiny": TINY, "cpu": CPU, "gpu": GPU}
"""The transformer's size for each profile name (``profile="auto"`` picks ``cpu`` or ``gpu`` by platform,
as the CNN lab does)."""


def _kernel_init(fan_in_axes: tuple[int, ...]):
    """LeCun-normal (truncated at ±2σ, variance 1 / fan_in) with fan_in the product of ``fan_in_axes``.

    The same distribution as ``nnx.initializers.lecun_normal(in_axis=…)``, drawn 1-D and reshaped: XLA:CPU
    compiles a 1-D draw several times faster than a 3-D one, which every notebook's start pays.
    """

    def init(key: jax.Array, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
        fan_in = math.prod(shape[a] for a in fan_in_axes)
        stddev = math.sqrt(1.0 / fan_in) / 0.87962566103423978  # std of a unit normal cut at ±2
        flat = jax.random.truncated_normal(key, -2, 2, (math.prod(shape),), dtype)
        return (flat * stddev).reshape(shape)

    return init


class Attention(nnx.Module):
    """Causal multi-head self-attention; heads are an explicit axis of every kernel (no biases)."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        d, h, k = config.d_model, config.n_heads, config.d_head
        qkv = dict(kernel_init=_kernel_init((0,)), rngs=rngs)
        self.wq = nnx.Einsum("bsd,dhk->bshk", (d, h, k), **qkv)
        self.wk = nnx.Einsum("bsd,dhk->bshk", (d, h, k), **qkv)
        self.wv = nnx.Einsum("bsd,dhk->bshk", (d, h, k), **qkv)
        self.wo = nnx.Einsum(
            "bshk,hkd->bsd", (h, k, d), kernel_init=_kernel_init((0, 1)), rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.wo(causal_attention(self.wq(x), self.wk(x), self.wv(x)))


class MLP(nnx.Module):
    """``gelu(x @ w1 + b1) @ w2 + b2``: [.., D] → [.., F] → [.., D]."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        init = _kernel_init((0,))
        self.w1 = nnx.Linear(config.d_model, config.d_ff, kernel_init=init, rngs=rngs)
        self.w2 = nnx.Linear(config.d_ff, config.d_model, kernel_init=init, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.w2(jax.nn.gelu(self.w1(x)))


class Block(nnx.Module):
    """A pre-LayerNorm block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``; [B, S, D] → [B, S, D]."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        norm = dict(epsilon=config.ln_eps, use_fast_variance=False, rngs=rngs)
        self.ln1 = nnx.LayerNorm(config.d_model, **norm)
        self.attn = Attention(config, rngs=rngs)
        self.ln2 = nnx.LayerNorm(config.d_model, **norm)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nnx.Module):
    """Token ids int32 [B, S] → logits float32 [B, S, vocab]; the blocks stacked on a leading layer axis."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Embed(config.vocab, config.d_model, rngs=rngs)
        pos = nnx.initializers.normal(0.02)(
            rngs.params(), (config.seq_len, config.d_model), jnp.float32
        )
        self.pos = nnx.Param(pos)

        @nnx.split_rngs(splits=config.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(config, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.ln_f = nnx.LayerNorm(
            config.d_model, epsilon=config.ln_eps, use_fast_variance=False, rngs=rngs
        )
        self.unembed = nnx.Linear(
            config.d_model, config.vocab, use_bias=False, kernel_init=_kernel_init((0,)), rngs=rngs
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, blk: Block):
            return blk(x)

        x = run(x, self.blocks)
        return self.unembed(self.ln_f(x))


def init_model(
    key: jax.Array, config: TransformerConfig = CPU
) -> tuple[nnx.GraphDef, dict[str, Any]]:
    """Create the transformer and split it into ``(graphdef, params)``.

    Args:
      key: a PRNG key; the same key gives the same parameters.
      config: the model shape.

    Returns:
      ``graphdef`` (static structure) and ``params``, a plain nested dict of float32 arrays
      (``nnx.to_pure_dict``): ``embed.embedding`` [V, D], ``pos`` [S, D], ``blocks`` (every leaf with a leading
      layer axis L): ``ln1.scale``/``ln1.bias`` [L, D], ``attn.wq.kernel``/``wk``/``wv`` [L, D, H, Dh],
      ``attn.wo.kernel`` [L, H, Dh, D], ``ln2.*`` [L, D], ``mlp.w1.kernel`` [L, D, F], ``mlp.w1.bias`` [L, F],
      ``mlp.w2.kernel`` [L, F, D], ``mlp.w2.bias`` [L, D]; ``ln_f.*`` [D], ``unembed.kernel`` [D, V].
    """
    model = Transformer(config, rngs=nnx.Rngs(params=key))
    graphdef, state = nnx.split(model, nnx.Param)
    return graphdef, nnx.to_pure_dict(state)


def apply(graphdef: nnx.GraphDef, params: Any, tokens: jax.Array) -> jax.Array:
    """Run the NNX module functionally: int32 [B, S] tokens → [B, S, vocab] logits (the params' dtype)."""
    return nnx.merge(graphdef, params)(tokens)


# --- the same math on the plain parameter dict ---------------------------------------------------------


def layer_norm(x: jax.Array, p: dict, eps: float = 1e-5) -> jax.Array:
    """LayerNorm over the last axis, as ``nnx.LayerNorm(use_fast_variance=False)``: [.., D] → [.., D].

    ``p``: ``{"scale": [D], "bias": [D]}``. The statistics are per token, so a sequence-sharded ``x`` needs
    no communication here (sequence parallelism, ``notebooks/10_transformers.ipynb``).
    """
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, q_offset: int = 0, k_offset: int = 0
) -> jax.Array:
    """Softmax attention with a causal mask: q [B, Sq, H, Dh], k/v [B, Sk, H, Dh] → [B, Sq, H, Dh].

    Query ``i`` attends to key ``j`` when ``q_offset + i >= k_offset + j`` (the offsets are the blocks'
    global positions, so the same function serves one block of a sequence split over devices). Scores are
    scaled by ``1/sqrt(Dh)``; a query that sees no key gets zeros.
    """
    scores = jnp.einsum("bqhk,bthk->bhqt", q, k) / math.sqrt(q.shape[-1])
    qi = q_offset + jnp.arange(q.shape[1])[:, None]
    kj = k_offset + jnp.arange(k.shape[1])[None, :]
    scores = jnp.where(qi >= kj, scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    weights = jnp.where(jnp.isnan(weights), 0.0, weights)  # rows with no visible key
    return jnp.einsum("bhqt,bthk->bqhk", weights, v)


def attention(x: jax.Array, p: dict) -> jax.Array:
    """The attention sub-layer (no residual): [B, S, D] → [B, S, D]; ``p`` is one layer's ``attn`` dict."""
    q = jnp.einsum("bsd,dhk->bshk", x, p["wq"]["kernel"])
    k = jnp.einsum("bsd,dhk->bshk", x, p["wk"]["kernel"])
    v = jnp.einsum("bsd,dhk->bshk", x, p["wv"]["kernel"])
    return jnp.einsum("bshk,hkd->bsd", causal_attention(q, k, v), p["wo"]["kernel"])


def mlp(x: jax.Array, p: dict) -> jax.Array:
    """The MLP sub-layer (no residual): [.., D] → [.., F] → [.., D]; ``p`` is one layer's ``mlp`` dict."""
    h = jax.nn.gelu(x @ p["w1"]["kernel"] + p["w1"]["bias"])
    return h @ p["w2"]["kernel"] + p["w2"]["bias"]


def block(x: jax.Array, p: dict, eps: float = 1e-5) -> jax.Array:
    """One block on one layer's parameters (``params["blocks"]`` sliced at a layer): [B, S, D] → [B, S, D]."""
    x = x + attention(layer_norm(x, p["ln1"], eps), p["attn"])
    return x + mlp(layer_norm(x, p["ln2"], eps), p["mlp"])


def embed(params: dict, tokens: jax.Array, pos_offset: int = 0) -> jax.Array:
    """Token + position embeddings: int32 [B, S] → [B, S, D] (positions ``pos_offset … pos_offset+S-1``)."""
    pos = jax.lax.dynamic_slice_in_dim(params["pos"], pos_offset, tokens.shape[1])
    return params["embed"]["embedding"][tokens] + pos


def head(params: dict, x: jax.Array, eps: float = 1e-5) -> jax.Array:
    """Final LayerNorm and output projection: [B, S, D] → [B, S, vocab] logits."""
    return layer_norm(x, params["ln_f"], eps) @ params["unembed"]["kernel"]


def forward(
    params: dict,
    tokens: jax.Array,
    *,
    block_fn: Callable[[jax.Array, dict], jax.Array] | None = None,
    eps: float = 1e-5,
) -> jax.Array:
    """:func:`apply`'s math on the plain dict: embed, ``lax.scan`` of ``block_fn`` over the layer axis, head.

    Args:
      params: the dict :func:`init_model` returns (or a copy in another dtype).
      tokens: int32 [B, S].
      block_fn: ``(x [B, S, D], layer_params) -> [B, S, D]``; default :func:`block`. Lessons 10–12 pass
        parallel versions of it.
      eps: LayerNorm epsilon (the config's ``ln_eps``).

    Returns:
      Logits [B, S, vocab].
    """
    block_fn = block_fn or (lambda x, p: block(x, p, eps))
    x = embed(params, tokens)
    x, _ = jax.lax.scan(lambda h, p: (block_fn(h, p), None), x, params["blocks"])
    return head(params, x, eps)


def param_count(config: TransformerConfig) -> int:
    """Scalar parameters, from the shapes (``tests/test_transformer.py`` checks it against the model)."""
    d, f, v, s = config.d_model, config.d_ff, config.vocab, config.seq_len
    per_layer = 4 * d * d + (d * f + f) + (f * d + d) + 4 * d  # attention, MLP, two LayerNorms
    return v * d + s * d + config.n_layers * per_layer + 2 * d + d * v


def flops_per_token(config: TransformerConfig, seq_len: int | None = None) -> int:
    """Analytic forward FLOPs per token (2 per multiply-add): the matmuls and the attention scores.

    Per layer: ``2·4·D²`` (q, k, v, o projections) + ``2·2·D·F`` (MLP) + ``2·2·S·D`` (scores and the
    weighted sum, counted over all ``S`` keys: the causal mask's half is computed, then masked); plus the
    output projection ``2·D·V``. The embedding lookup is a gather, not a matmul. A training step costs about
    3× this per token (forward, and two matmuls per matmul backward); the first layer's input gradient is
    not needed, which :func:`course_lib.costs` models subtract where they compare with compiled FLOPs.
    """
    s = seq_len or config.seq_len
    d, f = config.d_model, config.d_ff
    per_layer = 2 * 4 * d * d + 2 * 2 * d * f + 2 * 2 * s * d
    return config.n_layers * per_layer + 2 * d * config.vocab

"""The encoder the pretraining models share: post-LayerNorm blocks as in BERT and in PyTorch's
``nn.TransformerEncoderLayer`` (its default ``norm_first=False``, which scGPT uses), and the
float32-accumulating helpers they are built from.

Modules apply to one cell (arrays of shape ``(L,)`` or ``(L, d)``). Parameters are float32; with
``compute_dtype=jnp.bfloat16`` the matmul inputs are cast to bfloat16 (accumulating in float32)
while the residual stream, LayerNorm and softmax stay float32. Layers are stacked (every array has
a leading ``num_layers`` axis) and run with ``lax.scan``, so compile time does not grow with depth
(a stack of at most `UNROLL_LAYERS` layers is unrolled: see there).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

NEG = -1e30  # attention logit of a padded key: exp underflows to exactly 0 in float32
ACTIVATIONS: dict[str, Callable] = {"relu": jax.nn.relu, "gelu": partial(jax.nn.gelu, approximate=False)}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Encoder shape: ``num_layers`` blocks of ``width`` with ``num_heads`` heads and an MLP of
    ``mlp_width``; ``activation`` is ``"relu"`` or ``"gelu"``; ``dropout`` is used on the embeddings,
    the attention probabilities and both residual branches (and on the MLP hidden layer where the
    reference model has it: scGPT, not BERT)."""

    num_layers: int
    width: int
    num_heads: int
    mlp_width: int
    activation: str = "relu"
    dropout: float = 0.0


def layer_norm(ln: eqx.nn.LayerNorm, x: jax.Array) -> jax.Array:
    """LayerNorm over the last axis of ``x`` ``(..., d)``, always in float32."""
    x = x.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + ln.eps) * ln.weight + ln.bias


def dense(lin: eqx.nn.Linear, x: jax.Array, dtype: Any) -> jax.Array:
    """``x @ W.T + b`` over the last axis of ``x``, inputs in ``dtype``, accumulated in float32."""
    y = jnp.matmul(x.astype(dtype), lin.weight.T.astype(dtype), preferred_element_type=jnp.float32)
    if lin.bias is not None:
        y = y + lin.bias
    return y.astype(dtype)


def keep_masks(drop: eqx.nn.Dropout, key: jax.Array | None, shapes: list[tuple[int, ...]]) -> list:
    """Dropout keep-masks of the given shapes from one draw of random bits (an element is kept when its
    uint32 is >= ``p·2³²``: cheaper to run and to compile than one ``bernoulli`` per site). All None
    when ``key`` is None, the rate is 0, or in inference mode."""
    if key is None or drop.inference or drop.p == 0:
        return [None] * len(shapes)
    sizes = [math.prod(shape) for shape in shapes]
    threshold = np.uint32(min(round(drop.p * 2**32), 2**32 - 1))
    keep = jax.random.bits(key, (sum(sizes),), jnp.uint32) >= threshold
    parts = jnp.split(keep, np.cumsum(sizes)[:-1])
    return [part.reshape(shape) for part, shape in zip(parts, shapes, strict=True)]


def apply_dropout(x: jax.Array, keep: jax.Array | None, rate: float) -> jax.Array:
    if keep is None:
        return x
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def dropout(drop: eqx.nn.Dropout, x: jax.Array, key: jax.Array | None) -> jax.Array:
    """Dropout at one site; the identity when ``key`` is None, the rate is 0, or in inference mode."""
    return apply_dropout(x, keep_masks(drop, key, [x.shape])[0], drop.p)


def with_dropout(model: Any, rate: float) -> Any:
    """``model`` with every ``eqx.nn.Dropout`` in it at ``rate`` (a preset's or a published
    checkpoint's rate overridden; no array changes)."""

    def set_rate(node: Any) -> Any:
        return dataclasses.replace(node, p=rate) if isinstance(node, eqx.nn.Dropout) else node

    return jax.tree.map(set_rate, model, is_leaf=lambda node: isinstance(node, eqx.nn.Dropout))


def split_keys(key: jax.Array | None, num: int) -> list:
    return [None] * num if key is None else list(jax.random.split(key, num))


class EncoderLayer(eqx.Module):
    """Post-LayerNorm block: ``x = LN1(x + MHA(x))`` with a key-padding mask, then
    ``x = LN2(x + MLP(x))`` (BERT's ``BertLayer``; PyTorch's ``TransformerEncoderLayer``).
    ``qkv`` holds the query, key and value projections stacked (PyTorch's ``in_proj_weight``);
    ``hidden_dropout`` drops the MLP's hidden layer too (PyTorch does, BERT does not)."""

    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    ln1: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    ln2: eqx.nn.LayerNorm
    drop: eqx.nn.Dropout
    num_heads: int = eqx.field(static=True)
    activation: str = eqx.field(static=True)
    compute_dtype: Any = eqx.field(static=True)
    hidden_dropout: bool = eqx.field(static=True)

    def __init__(
        self,
        cfg: TransformerConfig,
        *,
        compute_dtype: Any = jnp.float32,
        eps: float = 1e-5,
        hidden_dropout: bool = True,
        key: jax.Array,
    ):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        d = cfg.width
        self.qkv = eqx.nn.Linear(d, 3 * d, key=k1)
        self.out = eqx.nn.Linear(d, d, key=k2)
        self.ln1 = eqx.nn.LayerNorm(d, eps=eps)
        self.fc1 = eqx.nn.Linear(d, cfg.mlp_width, key=k3)
        self.fc2 = eqx.nn.Linear(cfg.mlp_width, d, key=k4)
        self.ln2 = eqx.nn.LayerNorm(d, eps=eps)
        self.drop = eqx.nn.Dropout(cfg.dropout)
        self.num_heads = cfg.num_heads
        self.activation = cfg.activation
        self.compute_dtype = jnp.dtype(compute_dtype)
        self.hidden_dropout = hidden_dropout

    def __call__(self, x: jax.Array, key_mask: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        """``x`` ``(L, d)`` float32 residual stream; ``key_mask`` ``(L,)`` bool, True = real token.
        ``key`` drives dropout (None: no dropout)."""
        dt, rate = self.compute_dtype, self.drop.p
        length, d = x.shape
        heads = self.num_heads
        hidden = (length, self.fc1.weight.shape[0]) if self.hidden_dropout else (0,)
        shapes = [(heads, length, length), (length, d), hidden, (length, d)]
        keep_probs, keep_attn_out, keep_hidden, keep_mlp_out = keep_masks(self.drop, key, shapes)
        q, k, v = jnp.split(dense(self.qkv, x, dt).reshape(length, 3, heads, d // heads), 3, axis=1)
        q, k, v = q[:, 0], k[:, 0], v[:, 0]  # (L, heads, head_dim)
        s = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) / np.sqrt(d // heads)
        s = jnp.where(key_mask[None, None, :], s, NEG)
        p = apply_dropout(jax.nn.softmax(s, axis=-1).astype(dt), keep_probs, rate)
        a = jnp.einsum("hqk,khd->qhd", p, v, preferred_element_type=jnp.float32).reshape(length, d)
        a = apply_dropout(dense(self.out, a, dt), keep_attn_out, rate).astype(jnp.float32)
        x = layer_norm(self.ln1, x + a)
        h = ACTIVATIONS[self.activation](dense(self.fc1, x, dt))
        h = dense(self.fc2, apply_dropout(h, keep_hidden if self.hidden_dropout else None, rate), dt)
        return layer_norm(self.ln2, x + apply_dropout(h, keep_mlp_out, rate).astype(jnp.float32))


# A scan keeps every layer's residuals for the backward pass in stacked buffers that it fills and
# copies: for a shallow, narrow stack that traffic can outweigh the layers' own arithmetic (the tiny
# preset's training step, scanned and unrolled: benchmarks/bench_encoder.py), while unrolling a deep
# stack multiplies its compile time. The loss and gradients are the same either way.
UNROLL_LAYERS = 4


class Encoder(eqx.Module):
    """``num_layers`` `EncoderLayer` s, stacked and run by ``lax.scan``, unrolled up to
    `UNROLL_LAYERS` (no final LayerNorm: in a post-LayerNorm stack every block already ends with one)."""

    layers: EncoderLayer
    num_layers: int = eqx.field(static=True)

    def __init__(
        self,
        cfg: TransformerConfig,
        *,
        compute_dtype: Any = jnp.float32,
        eps: float = 1e-5,
        hidden_dropout: bool = True,
        key: jax.Array,
    ):
        make = partial(EncoderLayer, cfg, compute_dtype=compute_dtype, eps=eps, hidden_dropout=hidden_dropout)
        self.layers = eqx.filter_vmap(lambda k: make(key=k))(jax.random.split(key, cfg.num_layers))
        self.num_layers = cfg.num_layers

    def __call__(self, x: jax.Array, key_mask: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        """Final hidden states ``(L, d)`` float32 of one cell."""
        params, static = eqx.partition(self.layers, eqx.is_array)
        keys = None if key is None else jax.random.split(key, self.num_layers)

        def body(h, xs):
            layer_params, layer_key = xs
            return eqx.combine(layer_params, static)(h, key_mask, key=layer_key), None

        unroll = self.num_layers <= UNROLL_LAYERS
        x, _ = jax.lax.scan(body, x.astype(jnp.float32), (params, keys), unroll=unroll)
        return x


# Geneformer V1: BertConfig(num_hidden_layers=6, hidden_size=256, num_attention_heads=4,
#   intermediate_size=512, hidden_act="relu", hidden/attention dropout 0.02) (ctheodoris/Geneformer).
# scGPT: TransformerModel builds TransformerEncoderLayer(d_model, nhead, d_hid, dropout, batch_first=True)
#   without `activation`, so PyTorch's default "relu" applies (its FlashTransformerEncoderLayer also
#   defaults to "relu"); the whole-human model is 12 layers, embsize 512, 8 heads, d_hid 512, dropout 0.2
#   (bowang-lab/scGPT, scgpt/model/model.py).
PRESETS: dict[str, TransformerConfig] = {
    "tiny": TransformerConfig(2, 64, 2, 128, "relu", 0.1),
    "geneformer-v1": TransformerConfig(6, 256, 4, 512, "relu", 0.02),
    "scgpt": TransformerConfig(12, 512, 8, 512, "relu", 0.2),
}


def resolve_preset(preset: str | TransformerConfig) -> TransformerConfig:
    from ._errors import TrainError

    if isinstance(preset, TransformerConfig):
        return preset
    if preset not in PRESETS:
        msg = f"preset must be one of {', '.join(PRESETS)} (or a TransformerConfig); got {preset!r}"
        raise TrainError(msg)
    return PRESETS[preset]

"""Transformer encoders for single-cell foundation-model pretraining: Geneformer (masked gene-token
prediction) and scGPT (masked binned-value regression), fed the fixed ``(B, L)`` token batches of
the token specification (``docs/tokens.md``).

Modules apply to one cell (arrays of shape ``(L,)``); ``loss`` and ``embed`` take a whole batch dict
and vmap. Parameters are float32; with ``compute_dtype=jnp.bfloat16`` the matmul inputs are cast to
bfloat16 (accumulating in float32) while the residual stream, LayerNorm, softmax and losses stay
float32. Layers are stacked (every array has a leading ``num_layers`` axis) and run with
``lax.scan``, so compile time does not grow with depth.

>>> model = make_pretrain_model("geneformer", "tiny", 128, 64, key=jax.random.key(0))  # doctest: +SKIP
>>> step = make_pretrain_step(make_optimizer(1e-3, warmup_steps=100, total_steps=10_000))  # doctest: +SKIP
>>> model, opt_state, loss = step(model, opt_state, batch, key, np.int32(0))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._errors import TrainError

KINDS = ("geneformer", "scgpt")
_NEG = -1e30  # attention logit of a padded key: exp underflows to exactly 0 in float32
_ACTIVATIONS: dict[str, Callable] = {"relu": jax.nn.relu, "gelu": partial(jax.nn.gelu, approximate=False)}
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Encoder shape: ``num_layers`` blocks of ``width`` with ``num_heads`` heads and an MLP of
    ``mlp_width``; ``activation`` is ``"relu"`` or ``"gelu"``; ``dropout`` is used everywhere
    (embeddings, attention probabilities, MLP hidden, both residual branches)."""

    num_layers: int
    width: int
    num_heads: int
    mlp_width: int
    activation: str = "relu"
    dropout: float = 0.0


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


def _layer_norm(ln: eqx.nn.LayerNorm, x: jax.Array) -> jax.Array:
    """LayerNorm over the last axis of ``x`` ``(..., d)``, always in float32."""
    x = x.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + ln.eps) * ln.weight + ln.bias


def _dense(lin: eqx.nn.Linear, x: jax.Array, dtype: Any) -> jax.Array:
    """``x @ W.T + b`` over the last axis of ``x``, inputs in ``dtype``, accumulated in float32."""
    y = jnp.matmul(x.astype(dtype), lin.weight.T.astype(dtype), preferred_element_type=jnp.float32)
    if lin.bias is not None:
        y = y + lin.bias
    return y.astype(dtype)


def _keep_masks(drop: eqx.nn.Dropout, key: jax.Array | None, shapes: list[tuple[int, ...]]) -> list:
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


def _apply_dropout(x: jax.Array, keep: jax.Array | None, rate: float) -> jax.Array:
    if keep is None:
        return x
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def _dropout(drop: eqx.nn.Dropout, x: jax.Array, key: jax.Array | None) -> jax.Array:
    """Dropout at one site; the identity when ``key`` is None, the rate is 0, or in inference mode."""
    return _apply_dropout(x, _keep_masks(drop, key, [x.shape])[0], drop.p)


def _keys(key: jax.Array | None, num: int) -> list:
    return [None] * num if key is None else list(jax.random.split(key, num))


def _normal(key: jax.Array, shape: tuple[int, ...], std: float) -> jax.Array:
    return std * jax.random.normal(key, shape, jnp.float32)


class EncoderLayer(eqx.Module):
    """Pre-LayerNorm block: ``x + MHA(LN(x))`` with a key-padding mask, then ``x + MLP(LN(x))``."""

    ln1: eqx.nn.LayerNorm
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    ln2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    drop: eqx.nn.Dropout
    num_heads: int = eqx.field(static=True)
    activation: str = eqx.field(static=True)
    compute_dtype: Any = eqx.field(static=True)

    def __init__(
        self, cfg: TransformerConfig, *, compute_dtype: Any = jnp.float32, eps: float = 1e-5, key: jax.Array
    ):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        d = cfg.width
        self.ln1 = eqx.nn.LayerNorm(d, eps=eps)
        self.qkv = eqx.nn.Linear(d, 3 * d, key=k1)
        self.out = eqx.nn.Linear(d, d, key=k2)
        self.ln2 = eqx.nn.LayerNorm(d, eps=eps)
        self.fc1 = eqx.nn.Linear(d, cfg.mlp_width, key=k3)
        self.fc2 = eqx.nn.Linear(cfg.mlp_width, d, key=k4)
        self.drop = eqx.nn.Dropout(cfg.dropout)
        self.num_heads = cfg.num_heads
        self.activation = cfg.activation
        self.compute_dtype = jnp.dtype(compute_dtype)

    def __call__(self, x: jax.Array, key_mask: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        """``x`` ``(L, d)`` float32 residual stream; ``key_mask`` ``(L,)`` bool, True = real token.
        ``key`` drives dropout (None: no dropout)."""
        dt, rate = self.compute_dtype, self.drop.p
        length, d = x.shape
        heads = self.num_heads
        shapes = [(heads, length, length), (length, d), (length, self.fc1.weight.shape[0]), (length, d)]
        keep_probs, keep_attn_out, keep_hidden, keep_mlp_out = _keep_masks(self.drop, key, shapes)
        h = _layer_norm(self.ln1, x)
        q, k, v = jnp.split(_dense(self.qkv, h, dt).reshape(length, 3, heads, d // heads), 3, axis=1)
        q, k, v = q[:, 0], k[:, 0], v[:, 0]  # (L, heads, head_dim)
        s = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) / np.sqrt(d // heads)
        s = jnp.where(key_mask[None, None, :], s, _NEG)
        p = _apply_dropout(jax.nn.softmax(s, axis=-1).astype(dt), keep_probs, rate)
        a = jnp.einsum("hqk,khd->qhd", p, v, preferred_element_type=jnp.float32).reshape(length, d)
        x = x + _apply_dropout(_dense(self.out, a, dt), keep_attn_out, rate).astype(jnp.float32)
        h = _ACTIVATIONS[self.activation](_dense(self.fc1, _layer_norm(self.ln2, x), dt))
        h = _dense(self.fc2, _apply_dropout(h, keep_hidden, rate), dt)
        return x + _apply_dropout(h, keep_mlp_out, rate).astype(jnp.float32)


class Encoder(eqx.Module):
    """``num_layers`` `EncoderLayer` s (stacked, run by ``lax.scan``) and a final LayerNorm."""

    layers: EncoderLayer
    ln_final: eqx.nn.LayerNorm
    num_layers: int = eqx.field(static=True)

    def __init__(
        self, cfg: TransformerConfig, *, compute_dtype: Any = jnp.float32, eps: float = 1e-5, key: jax.Array
    ):
        make = partial(EncoderLayer, cfg, compute_dtype=compute_dtype, eps=eps)
        self.layers = eqx.filter_vmap(lambda k: make(key=k))(jax.random.split(key, cfg.num_layers))
        self.ln_final = eqx.nn.LayerNorm(cfg.width, eps=eps)
        self.num_layers = cfg.num_layers

    def __call__(self, x: jax.Array, key_mask: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        """Final hidden states ``(L, d)`` float32 of one cell."""
        params, static = eqx.partition(self.layers, eqx.is_array)
        keys = None if key is None else jax.random.split(key, self.num_layers)

        def body(h, xs):
            layer_params, layer_key = xs
            return eqx.combine(layer_params, static)(h, key_mask, key=layer_key), None

        x, _ = jax.lax.scan(body, x.astype(jnp.float32), (params, keys))
        return _layer_norm(self.ln_final, x)


def _check_pool(pool: str) -> None:
    if pool not in ("cls", "mean"):
        msg = f"pool must be 'cls' or 'mean'; got {pool!r} (Geneformer V1 rows have no CLS: pool='mean')"
        raise TrainError(msg)


def _pool(hidden: jax.Array, real: jax.Array, pool: str) -> jax.Array:
    if pool == "cls":
        return hidden[:, 0]
    w = real.astype(jnp.float32)
    return jnp.einsum("bld,bl->bd", hidden, w) / jnp.maximum(w.sum(1), 1.0)[:, None]


def _check_length(length: int, max_len: int) -> None:
    if length > max_len:
        msg = (
            f"batch has L={length} positions but the model was built with max_len={max_len}; "
            f"rebuild it with make_pretrain_model(..., max_len={length})"
        )
        raise TrainError(msg)


class GeneformerModel(eqx.Module):
    """BERT-style masked-token model over rank-ordered gene tokens (Geneformer).

    Token + learned position embedding → LayerNorm → dropout → `Encoder` → MLM head
    (dense → activation → LayerNorm → decoder). The decoder is tied to the token embedding by default
    (``logits = h @ E.T + b``, as Hugging Face ``BertForMaskedLM``); ``tie_embeddings=False`` gives
    it its own matrix. ``max_predictions`` (static) decodes only the first that many labelled positions
    of each cell instead of all ``L`` (labelled positions beyond it are left out of the loss): at
    V1's L = 2048 and ~25k tokens, decoding every position costs ~70% of the encoder's FLOPs
    (`flops_per_cell`) and a ``(B, L, vocab)`` float32 logits array, whereas 15% masking needs ~0.15·L.
    Build it with `make_pretrain_model`, which draws BERT's initialisation.
    """

    token_embedding: eqx.nn.Embedding
    position_embedding: eqx.nn.Embedding
    embedding_norm: eqx.nn.LayerNorm
    drop: eqx.nn.Dropout
    encoder: Encoder
    head_dense: eqx.nn.Linear
    head_norm: eqx.nn.LayerNorm
    decoder: eqx.nn.Linear | None
    decoder_bias: jax.Array
    activation: str = eqx.field(static=True)
    compute_dtype: Any = eqx.field(static=True)
    max_predictions: int | None = eqx.field(static=True)

    def __init__(
        self,
        cfg: TransformerConfig,
        vocab_size: int,
        max_len: int,
        *,
        compute_dtype: Any = jnp.float32,
        tie_embeddings: bool = True,
        max_predictions: int | None = None,
        key: jax.Array,
    ):
        ks = jax.random.split(key, 5)
        d, eps = cfg.width, 1e-12  # BERT's layer_norm_eps
        self.token_embedding = eqx.nn.Embedding(weight=_normal(ks[0], (vocab_size, d), 0.02))
        self.position_embedding = eqx.nn.Embedding(weight=_normal(ks[1], (max_len, d), 0.02))
        self.embedding_norm = eqx.nn.LayerNorm(d, eps=eps)
        self.drop = eqx.nn.Dropout(cfg.dropout)
        self.encoder = Encoder(cfg, compute_dtype=compute_dtype, eps=eps, key=ks[2])
        self.head_dense = eqx.nn.Linear(d, d, key=ks[3])
        self.head_norm = eqx.nn.LayerNorm(d, eps=eps)
        self.decoder = None if tie_embeddings else eqx.nn.Linear(d, vocab_size, use_bias=False, key=ks[4])
        self.decoder_bias = jnp.zeros(vocab_size, jnp.float32)
        self.activation = cfg.activation
        self.compute_dtype = jnp.dtype(compute_dtype)
        self.max_predictions = max_predictions

    def encode(
        self, input_ids: jax.Array, attention_mask: jax.Array, *, key: jax.Array | None = None
    ) -> jax.Array:
        """Final hidden states ``(L, d)`` float32 of one cell (``attention_mask`` True = real token)."""
        _check_length(input_ids.shape[0], self.position_embedding.weight.shape[0])
        k_emb, k_enc = _keys(key, 2)
        x = self.token_embedding.weight[input_ids] + self.position_embedding.weight[: input_ids.shape[0]]
        x = _dropout(self.drop, _layer_norm(self.embedding_norm, x), k_emb)
        return self.encoder(x, attention_mask, key=k_enc)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """MLM head: hidden states ``(P, d)`` → float32 logits ``(P, vocab_size)``."""
        dt = self.compute_dtype
        h = _ACTIVATIONS[self.activation](_dense(self.head_dense, hidden, dt))
        h = _layer_norm(self.head_norm, h).astype(dt)
        w = self.token_embedding.weight if self.decoder is None else self.decoder.weight
        return jnp.matmul(h, w.T.astype(dt), preferred_element_type=jnp.float32) + self.decoder_bias

    def __call__(
        self, input_ids: jax.Array, attention_mask: jax.Array, *, key: jax.Array | None = None
    ) -> jax.Array:
        """Logits ``(L, vocab_size)`` of one cell at every position."""
        return self.logits(self.encode(input_ids, attention_mask, key=key))

    def _cell_loss(self, input_ids, attention_mask, labels, key):
        hidden = self.encode(input_ids, attention_mask, key=key)
        valid = labels != -100
        if self.max_predictions is not None:
            (idx,) = jnp.nonzero(valid, size=self.max_predictions, fill_value=0)
            hidden, labels = hidden[idx], labels[idx]
            valid = jnp.arange(self.max_predictions) < valid.sum()
        ce = optax.softmax_cross_entropy_with_integer_labels(self.logits(hidden), jnp.where(valid, labels, 0))
        return jnp.sum(jnp.where(valid, ce, 0.0)), jnp.sum(valid)

    def loss(self, batch: dict, *, key: jax.Array | None = None) -> jax.Array:
        """Mean cross-entropy over all positions of the batch with ``labels != -100``; ``key`` drives
        dropout (None: no dropout)."""
        ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        keys = None if key is None else jax.random.split(key, ids.shape[0])
        total, count = jax.vmap(self._cell_loss)(ids, mask.astype(bool), labels, keys)
        return total.sum() / jnp.maximum(count.sum(), 1)

    def embed(self, batch: dict, *, pool: str = "cls") -> jax.Array:
        """Cell embeddings ``(B, d)`` without dropout: position 0 (CLS, V2 rows) with ``pool="cls"``,
        the mean over real tokens with ``pool="mean"`` (V1 rows, ``special_tokens=False``)."""
        _check_pool(pool)
        mask = batch["attention_mask"].astype(bool)
        hidden = jax.vmap(self.encode)(batch["input_ids"], mask)
        return _pool(hidden, mask, pool)


class ScGPTModel(eqx.Module):
    """scGPT-style masked value regression over (gene, binned value) tokens.

    Gene embedding → LayerNorm (scGPT's GeneEncoder) plus the continuous value encoder (value clamped
    at 512 → Linear(1, d) → ReLU → Linear(d, d) → LayerNorm → dropout), summed → `Encoder` →
    expression decoder (Linear → LeakyReLU → Linear → LeakyReLU → Linear(d, 1)) giving one value per
    position. No position embedding: scGPT treats a cell as a set of genes (``max_len`` is only
    checked). Build it with `make_pretrain_model`, which draws scGPT's / PyTorch's initialisation.
    """

    gene_embedding: eqx.nn.Embedding
    gene_norm: eqx.nn.LayerNorm
    value_fc1: eqx.nn.Linear
    value_fc2: eqx.nn.Linear
    value_norm: eqx.nn.LayerNorm
    drop: eqx.nn.Dropout
    encoder: Encoder
    decoder_fc1: eqx.nn.Linear
    decoder_fc2: eqx.nn.Linear
    decoder_out: eqx.nn.Linear
    compute_dtype: Any = eqx.field(static=True)
    max_len: int = eqx.field(static=True)
    max_value: float = eqx.field(static=True, default=512.0)

    def __init__(
        self,
        cfg: TransformerConfig,
        vocab_size: int,
        max_len: int,
        *,
        compute_dtype: Any = jnp.float32,
        key: jax.Array,
    ):
        ks = jax.random.split(key, 7)
        d = cfg.width
        weight = jax.random.uniform(ks[0], (vocab_size, d), jnp.float32, -0.1, 0.1)  # scGPT init_weights
        self.gene_embedding = eqx.nn.Embedding(weight=weight)
        self.gene_norm = eqx.nn.LayerNorm(d)
        self.value_fc1 = eqx.nn.Linear(1, d, key=ks[1])
        self.value_fc2 = eqx.nn.Linear(d, d, key=ks[2])
        self.value_norm = eqx.nn.LayerNorm(d)
        self.drop = eqx.nn.Dropout(cfg.dropout)
        self.encoder = Encoder(cfg, compute_dtype=compute_dtype, key=ks[3])
        self.decoder_fc1 = eqx.nn.Linear(d, d, key=ks[4])
        self.decoder_fc2 = eqx.nn.Linear(d, d, key=ks[5])
        self.decoder_out = eqx.nn.Linear(d, 1, key=ks[6])
        self.compute_dtype = jnp.dtype(compute_dtype)
        self.max_len = max_len

    def encode(
        self, gene_ids: jax.Array, values: jax.Array, pad_mask: jax.Array, *, key: jax.Array | None = None
    ) -> jax.Array:
        """Final hidden states ``(L, d)`` float32 of one cell (``pad_mask`` True = padding)."""
        _check_length(gene_ids.shape[0], self.max_len)
        dt = self.compute_dtype
        k_val, k_enc = _keys(key, 2)
        genes = _layer_norm(self.gene_norm, self.gene_embedding.weight[gene_ids])
        v = jnp.minimum(values.astype(jnp.float32), self.max_value)[:, None]
        v = _dense(self.value_fc2, jax.nn.relu(_dense(self.value_fc1, v, dt)), dt)
        v = _dropout(self.drop, _layer_norm(self.value_norm, v), k_val)
        return self.encoder(genes + v, ~pad_mask, key=k_enc)

    def predict_values(self, hidden: jax.Array) -> jax.Array:
        """Expression decoder: hidden states ``(L, d)`` → float32 values ``(L,)``."""
        dt = self.compute_dtype
        h = jax.nn.leaky_relu(_dense(self.decoder_fc1, hidden, dt))
        h = jax.nn.leaky_relu(_dense(self.decoder_fc2, h, dt))
        return _dense(self.decoder_out, h, jnp.float32)[:, 0]

    def __call__(
        self, gene_ids: jax.Array, values: jax.Array, pad_mask: jax.Array, *, key: jax.Array | None = None
    ) -> jax.Array:
        """Predicted value ``(L,)`` of one cell at every position."""
        return self.predict_values(self.encode(gene_ids, values, pad_mask, key=key))

    def loss(self, batch: dict, *, key: jax.Array | None = None) -> jax.Array:
        """Masked MSE: mean of ``(pred - values)**2`` over the positions where ``mask`` is True, the
        model reading ``masked_values``; ``key`` drives dropout (None: no dropout)."""
        gene_ids, pad_mask = batch["gene_ids"], batch["pad_mask"].astype(bool)
        keys = None if key is None else jax.random.split(key, gene_ids.shape[0])
        cell = lambda g, v, p, k: self(g, v, p, key=k)  # noqa: E731
        pred = jax.vmap(cell)(gene_ids, batch["masked_values"], pad_mask, keys)
        mask = batch["mask"].astype(bool)
        err = jnp.where(mask, jnp.square(pred - batch["values"].astype(jnp.float32)), 0.0)
        return err.sum() / jnp.maximum(mask.sum(), 1)

    def embed(self, batch: dict, *, pool: str = "cls") -> jax.Array:
        """Cell embeddings ``(B, d)`` without dropout: position 0 (CLS) or the mean over real tokens.
        The encoder reads ``batch["values"]`` (unmasked)."""
        _check_pool(pool)
        pad_mask = batch["pad_mask"].astype(bool)
        hidden = jax.vmap(self.encode)(batch["gene_ids"], batch["values"], pad_mask)
        return _pool(hidden, ~pad_mask, pool)


def _resolve_preset(preset: str | TransformerConfig) -> TransformerConfig:
    if isinstance(preset, TransformerConfig):
        return preset
    if preset not in PRESETS:
        msg = f"preset must be one of {', '.join(PRESETS)} (or a TransformerConfig); got {preset!r}"
        raise TrainError(msg)
    return PRESETS[preset]


def make_pretrain_model(
    kind: str,
    preset: str | TransformerConfig,
    vocab_size: int,
    max_len: int,
    *,
    key: jax.Array,
    compute_dtype: Any = jnp.float32,
    tie_embeddings: bool = True,
    max_predictions: int | None = None,
) -> GeneformerModel | ScGPTModel:
    """A `GeneformerModel` (``kind="geneformer"``) or `ScGPTModel` (``kind="scgpt"``) of the shape
    ``PRESETS[preset]``. ``vocab_size`` is the number of embedding rows (pad it to a multiple of 64);
    ``max_len`` the longest ``L`` the model accepts. ``tie_embeddings`` and ``max_predictions`` apply
    to Geneformer only."""
    if kind not in KINDS:
        msg = f"kind must be one of {', '.join(KINDS)}; got {kind!r}"
        raise TrainError(msg)
    cfg = _resolve_preset(preset)
    if cfg.activation not in _ACTIVATIONS:
        msg = f"activation must be one of {', '.join(_ACTIVATIONS)}; got {cfg.activation!r}"
        raise TrainError(msg)
    if cfg.num_layers < 1 or not 0.0 <= cfg.dropout < 1.0:
        msg = (
            f"need num_layers >= 1 and 0 <= dropout < 1; got num_layers={cfg.num_layers}, "
            f"dropout={cfg.dropout}"
        )
        raise TrainError(msg)
    if cfg.width % cfg.num_heads:
        msg = f"width must be a multiple of num_heads; got width={cfg.width}, num_heads={cfg.num_heads}"
        raise TrainError(msg)
    if jnp.dtype(compute_dtype) not in _DTYPES:
        msg = f"compute_dtype must be jnp.float32 or jnp.bfloat16; got {compute_dtype!r}"
        raise TrainError(msg)
    if vocab_size < 1 or max_len < 1 or (max_predictions is not None and max_predictions < 1):
        msg = (
            f"vocab_size, max_len and max_predictions must be >= 1; got vocab_size={vocab_size}, "
            f"max_len={max_len}, max_predictions={max_predictions}"
        )
        raise TrainError(msg)
    if kind == "geneformer":
        make = partial(
            GeneformerModel,
            cfg,
            vocab_size,
            max_len,
            compute_dtype=compute_dtype,
            tie_embeddings=tie_embeddings,
            max_predictions=max_predictions,
        )
    else:
        make = partial(ScGPTModel, cfg, vocab_size, max_len, compute_dtype=compute_dtype)
    return _initialise(eqx.filter_eval_shape(make, key=key), key, bert=kind == "geneformer")


def _initialise(abstract: eqx.Module, key: jax.Array, *, bert: bool) -> eqx.Module:
    """The parameters of ``abstract`` (a model from ``filter_eval_shape``) drawn with numpy, seeded by
    ``key``: nothing to compile (eagerly, each random draw of a new shape compiles on its own).

    LayerNorm: weight 1, bias 0. ``bert`` (Geneformer, as Hugging Face's ``BertPreTrainedModel``):
    Linear and Embedding weights N(0, 0.02²), biases 0. Otherwise (scGPT, PyTorch's defaults): Linear
    weight and bias U(±1/√fan_in), embeddings U(±0.1) (scGPT's ``init_weights``).
    """
    seed = [int(x) for x in np.asarray(jax.random.key_data(key)).ravel()]
    counter = itertools.count()

    def draw(node):
        if not isinstance(node, (eqx.nn.LayerNorm, eqx.nn.Linear, eqx.nn.Embedding, jax.ShapeDtypeStruct)):
            return node  # dropout rates and other non-array leaves
        rng = np.random.default_rng([*seed, next(counter)])

        def matrix(shape, bound):
            values = rng.normal(0.0, 0.02, shape) if bert else rng.uniform(-bound, bound, shape)
            return jnp.asarray(values, jnp.float32)

        if isinstance(node, eqx.nn.LayerNorm):
            return eqx.tree_at(
                lambda n: (n.weight, n.bias), node, (jnp.ones(node.weight.shape), jnp.zeros(node.bias.shape))
            )
        if isinstance(node, eqx.nn.Embedding):
            return eqx.tree_at(lambda n: n.weight, node, matrix(node.weight.shape, 0.1))
        if isinstance(node, eqx.nn.Linear):
            bound = 1.0 / np.sqrt(node.weight.shape[-1])
            node = eqx.tree_at(lambda n: n.weight, node, matrix(node.weight.shape, bound))
            if node.bias is None:
                return node
            bias = jnp.zeros(node.bias.shape) if bert else matrix(node.bias.shape, bound)
            return eqx.tree_at(lambda n: n.bias, node, bias)
        return jnp.zeros(node.shape, node.dtype)  # the MLM decoder bias

    leaf_types = (eqx.nn.LayerNorm, eqx.nn.Linear, eqx.nn.Embedding)
    return jax.tree.map(draw, abstract, is_leaf=lambda x: isinstance(x, leaf_types))


def _decay_mask(params: Any) -> Any:
    """True for matrices (Linear and Embedding weights), False for biases and LayerNorm parameters
    (the Hugging Face Trainer's rule)."""

    def is_node(x):
        return isinstance(x, (eqx.nn.LayerNorm, eqx.nn.Linear)) or eqx.is_array(x)

    def mark(node):
        if isinstance(node, eqx.nn.LayerNorm):
            return jax.tree.map(lambda _: False, node)
        if isinstance(node, eqx.nn.Linear):
            return eqx.tree_at(lambda lin: lin.weight, jax.tree.map(lambda _: False, node), True)
        return node.ndim >= 2  # embedding matrices; 1-D arrays (the decoder bias) are not decayed

    return jax.tree.map(mark, params, is_leaf=is_node)


def make_optimizer(
    lr: float,
    *,
    warmup_steps: int,
    total_steps: int,
    schedule: str = "cosine",
    weight_decay: float = 0.01,
    clip_norm: float = 1.0,
) -> optax.GradientTransformation:
    """``clip_by_global_norm(clip_norm)`` then AdamW whose learning rate rises linearly from 0 to ``lr``
    over ``warmup_steps`` and decays to 0 at ``total_steps`` (``"cosine"`` or ``"linear"``). Weight decay
    applies to weight matrices only, not to biases or LayerNorm parameters."""
    if schedule not in ("cosine", "linear"):
        msg = f"schedule must be 'cosine' or 'linear'; got {schedule!r}"
        raise TrainError(msg)
    if not 0 <= warmup_steps < total_steps:
        msg = (
            f"need 0 <= warmup_steps < total_steps; got warmup_steps={warmup_steps}, "
            f"total_steps={total_steps}"
        )
        raise TrainError(msg)
    if schedule == "cosine":
        lr_at = optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, total_steps, end_value=0.0)
    else:
        lr_at = optax.join_schedules(
            [
                optax.linear_schedule(0.0, lr, warmup_steps),
                optax.linear_schedule(lr, 0.0, total_steps - warmup_steps),
            ],
            [warmup_steps],
        )
    return optax.chain(
        optax.clip_by_global_norm(clip_norm), optax.adamw(lr_at, weight_decay=weight_decay, mask=_decay_mask)
    )


def make_pretrain_step(optimizer: optax.GradientTransformation) -> Callable:
    """``step(model, opt_state, batch, key, step) -> (model, opt_state, loss)``, jitted.

    ``batch`` is the token-batch dict of either model; the dropout key of step ``s`` is
    ``fold_in(key, s)``, so a resumed run draws the same masks. Pass ``step`` as a numpy scalar
    array (a Python int would recompile every step). Initialise ``opt_state`` with
    ``optimizer.init(eqx.filter(model, eqx.is_array))``.
    """

    @eqx.filter_jit
    def step(model, opt_state, batch, key, step):
        step_key = jax.random.fold_in(key, step)
        loss, grads = eqx.filter_value_and_grad(lambda m: m.loss(batch, key=step_key))(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


def flops_per_cell(
    kind: str,
    preset: str | TransformerConfig,
    seq_len: int,
    *,
    vocab_size: int = 0,
    max_predictions: int | None = None,
) -> float:
    """Training FLOPs (forward + backward) of one cell of ``seq_len`` positions, for MFU.

    The usual accounting (Kaplan et al. 2020; PaLM appendix B): a weight matrix of ``N`` entries costs
    ``6·N`` FLOPs per token it is applied to (2 forward, 4 backward), and self-attention adds
    ``12·n_layers·L·d`` per token (QKᵀ and AV). With ``n`` = num_layers, ``d`` = width,
    ``f`` = mlp_width:

        encoder   L · (6·n·(4d² + 2d·f) + 12·n·L·d)
        geneformer head   6·P·(d² + d·V),  P = max_predictions or L,  V = vocab_size
        scgpt value encoder + decoder   6·L·(d + 3d² + d)

    Embedding lookups, biases, LayerNorm, softmax and activations are not counted. Padded positions
    are counted: the model computes over all ``L`` slots.
    """
    if kind not in KINDS:
        msg = f"kind must be one of {', '.join(KINDS)}; got {kind!r}"
        raise TrainError(msg)
    cfg = _resolve_preset(preset)
    n, d, f, length = cfg.num_layers, cfg.width, cfg.mlp_width, seq_len
    total = length * (6 * n * (4 * d * d + 2 * d * f) + 12 * n * length * d)
    if kind == "geneformer":
        if vocab_size < 1:
            msg = f"geneformer needs vocab_size >= 1 for its decoder FLOPs; got vocab_size={vocab_size}"
            raise TrainError(msg)
        positions = length if max_predictions is None else min(max_predictions, length)
        return float(total + 6 * positions * (d * d + d * vocab_size))
    return float(total + 6 * length * (3 * d * d + 2 * d))

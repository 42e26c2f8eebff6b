"""Geneformer's network: Hugging Face's ``BertForMaskedLM`` over rank-ordered gene tokens, fed the
``input_ids`` / ``attention_mask`` / ``labels`` batches of the token specification
(``docs/tokens.md``), with its masked-token loss, the MLM head's predictions at the labelled
positions and the pooled cell embedding. `train._transformer` builds it; it computes what the
reference implementation computes (``tests/test_reference_models.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from ._layers import ACTIVATIONS, Encoder, TransformerConfig, dense, dropout, layer_norm, split_keys
from ._pooling import _check_length, _check_pool, _pool


class GeneformerModel(eqx.Module):
    """Hugging Face ``BertForMaskedLM`` over rank-ordered gene tokens (Geneformer).

    Token + learned absolute position + token-type-0 embedding → LayerNorm → dropout → post-LN
    `Encoder` (BERT's layers: no dropout on the MLP hidden layer) → MLM head (dense → activation →
    LayerNorm → decoder + bias). The decoder is tied to the token embedding by default
    (``logits = h @ E.T + b``); ``tie_embeddings=False`` gives it its own matrix. ``eps`` is BERT's
    ``layer_norm_eps``; ``type_vocab_size`` rows of token-type embedding are held (as in BERT) and
    row 0 is added. ``max_predictions`` (static) decodes only the first that many labelled positions
    of each cell instead of all ``L`` (labelled positions beyond it are left out of the loss): at
    V1's L = 2048 and ~25k tokens, decoding every position costs ~70% of the encoder's FLOPs
    (`flops_per_cell`) and a ``(B, L, vocab)`` float32 logits array, whereas 15% masking needs ~0.15·L.
    Build it with `make_pretrain_model` (BERT's initialisation) or `train.load_checkpoint`.
    """

    token_embedding: eqx.nn.Embedding
    position_embedding: eqx.nn.Embedding
    token_type_embedding: eqx.nn.Embedding
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
        eps: float = 1e-12,
        type_vocab_size: int = 2,
        key: jax.Array,
    ):
        ks = jax.random.split(key, 6)
        d = cfg.width
        self.token_embedding = eqx.nn.Embedding(vocab_size, d, key=ks[0])
        self.position_embedding = eqx.nn.Embedding(max_len, d, key=ks[1])
        self.token_type_embedding = eqx.nn.Embedding(type_vocab_size, d, key=ks[5])
        self.embedding_norm = eqx.nn.LayerNorm(d, eps=eps)
        self.drop = eqx.nn.Dropout(cfg.dropout)
        self.encoder = Encoder(cfg, compute_dtype=compute_dtype, eps=eps, hidden_dropout=False, key=ks[2])
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
        k_emb, k_enc = split_keys(key, 2)
        x = self.token_embedding.weight[input_ids] + self.position_embedding.weight[: input_ids.shape[0]]
        x = x + self.token_type_embedding.weight[0]
        x = dropout(self.drop, layer_norm(self.embedding_norm, x), k_emb)
        return self.encoder(x, attention_mask, key=k_enc)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """MLM head: hidden states ``(P, d)`` → float32 logits ``(P, vocab_size)``."""
        dt = self.compute_dtype
        h = ACTIVATIONS[self.activation](dense(self.head_dense, hidden, dt))
        h = layer_norm(self.head_norm, h).astype(dt)
        w = self.token_embedding.weight if self.decoder is None else self.decoder.weight
        return jnp.matmul(h, w.T.astype(dt), preferred_element_type=jnp.float32) + self.decoder_bias

    def __call__(
        self, input_ids: jax.Array, attention_mask: jax.Array, *, key: jax.Array | None = None
    ) -> jax.Array:
        """Logits ``(L, vocab_size)`` of one cell at every position."""
        return self.logits(self.encode(input_ids, attention_mask, key=key))

    def labelled(self, hidden: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The positions the MLM head decodes: ``(hidden, labels, valid)`` of the cell's labelled
        positions (``labels != -100``), the first ``max_predictions`` of them when that is set (then
        padded, ``valid`` False on the padding), else all ``L`` positions."""
        valid = labels != -100
        if self.max_predictions is not None:
            (idx,) = jnp.nonzero(valid, size=self.max_predictions, fill_value=0)
            hidden, labels = hidden[idx], labels[idx]
            valid = jnp.arange(self.max_predictions) < valid.sum()
        return hidden, labels, valid

    def predict_masked(
        self, input_ids: jax.Array, attention_mask: jax.Array, labels: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The most likely token at the positions the loss scores (`labelled`): ``(guess, labels,
        valid)`` of one cell, decoding only those positions."""
        hidden, labels, valid = self.labelled(self.encode(input_ids, attention_mask), labels)
        return jnp.argmax(self.logits(hidden), axis=-1), labels, valid

    def _cell_loss(self, input_ids, attention_mask, labels, key):
        hidden, labels, valid = self.labelled(self.encode(input_ids, attention_mask, key=key), labels)
        ce = optax.softmax_cross_entropy_with_integer_labels(self.logits(hidden), jnp.where(valid, labels, 0))
        return jnp.sum(jnp.where(valid, ce, 0.0)), jnp.sum(valid)

    def loss(self, batch: dict, *, key: jax.Array | None = None) -> jax.Array:
        """Mean cross-entropy over all positions of the batch with ``labels != -100``; ``key`` drives
        dropout (None: no dropout)."""
        ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        keys = None if key is None else jax.random.split(key, ids.shape[0])
        total, count = jax.vmap(self._cell_loss)(ids, mask.astype(bool), labels, keys)
        return total.sum() / jnp.maximum(count.sum(), 1)

    def embed(
        self,
        batch: dict,
        *,
        pool: str = "cls",
        special_ids: Sequence[int] = (),
        key: jax.Array | None = None,
    ) -> jax.Array:
        """Cell embeddings ``(B, d)``: position 0 (CLS, V2 rows) with ``pool="cls"``; with
        ``pool="mean"`` the mean over real tokens whose id is not in ``special_ids`` (Geneformer's
        cell embedding: pass the vocabulary's CLS and EOS ids to average over gene tokens only).
        ``key`` drives dropout (None: none, as for inference)."""
        _check_pool(pool)
        ids, mask = batch["input_ids"], batch["attention_mask"].astype(bool)
        keys = None if key is None else jax.random.split(key, ids.shape[0])
        hidden = jax.vmap(lambda i, m, k: self.encode(i, m, key=k))(ids, mask, keys)
        return _pool(hidden, mask, pool, ids, special_ids)

"""scGPT's network: the ``scgpt`` package's ``TransformerModel`` with continuous value input, fed the
``gene_ids`` / ``values`` / ``masked_values`` / ``mask`` / ``pad_mask`` batches of the token
specification (``docs/tokens.md``), with its expression and MVC decoders, scGPT's GEP + GEPC
pretraining loss and the pooled cell embedding. `train._transformer` builds it; it computes what
the reference implementation computes (``tests/test_reference_models.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ._layers import Encoder, TransformerConfig, dense, dropout, layer_norm, split_keys
from ._pooling import _check_length, _check_pool, _pool


class ScGPTModel(eqx.Module):
    """The ``scgpt`` package's ``TransformerModel`` (continuous value input, the expression decoder).

    Gene embedding → LayerNorm (its ``GeneEncoder``) plus the continuous value encoder (value clamped
    at 512 → Linear(1, d) → ReLU → Linear(d, d) → LayerNorm → dropout), summed → post-LN `Encoder`
    (PyTorch's ``TransformerEncoderLayer``, LayerNorm eps 1e-5, no final norm) → expression decoder
    (Linear → LeakyReLU → Linear → LeakyReLU → Linear(d, 1)) giving one value per position, and its
    ``MVCDecoder`` ("inner product"): each gene's value read from the cell embedding alone, as
    ``W · sigmoid(gene2query(gene)) · cell`` with the CLS position's hidden state as ``cell``. No
    position embedding: scGPT treats a cell as a set of genes (``max_len`` is only checked). Build it
    with `make_pretrain_model` (scGPT's / PyTorch's initialisation) or `train.load_checkpoint`.

    The pretraining loss is scGPT's: GEP (the masked values from the expression decoder) plus GEPC
    (the same values from the cell embedding, through the MVC decoder). GEPC is what makes the CLS
    embedding describe the cell: without it nothing asks the CLS position to hold anything.
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
    mvc_query: eqx.nn.Linear
    mvc_w: eqx.nn.Linear
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
        ks = jax.random.split(key, 9)
        d = cfg.width
        self.gene_embedding = eqx.nn.Embedding(vocab_size, d, key=ks[0])
        self.gene_norm = eqx.nn.LayerNorm(d)
        self.value_fc1 = eqx.nn.Linear(1, d, key=ks[1])
        self.value_fc2 = eqx.nn.Linear(d, d, key=ks[2])
        self.value_norm = eqx.nn.LayerNorm(d)
        self.drop = eqx.nn.Dropout(cfg.dropout)
        self.encoder = Encoder(cfg, compute_dtype=compute_dtype, key=ks[3])
        self.decoder_fc1 = eqx.nn.Linear(d, d, key=ks[4])
        self.decoder_fc2 = eqx.nn.Linear(d, d, key=ks[5])
        self.decoder_out = eqx.nn.Linear(d, 1, key=ks[6])
        self.mvc_query = eqx.nn.Linear(d, d, key=ks[7])
        self.mvc_w = eqx.nn.Linear(d, d, use_bias=False, key=ks[8])
        self.compute_dtype = jnp.dtype(compute_dtype)
        self.max_len = max_len

    def encode_genes(
        self, gene_ids: jax.Array, values: jax.Array, pad_mask: jax.Array, *, key: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """Final hidden states ``(L, d)`` float32 of one cell (``pad_mask`` True = padding) and its gene
        embeddings ``(L, d)`` (the ``GeneEncoder``'s output, which the MVC decoder queries)."""
        _check_length(gene_ids.shape[0], self.max_len)
        dt = self.compute_dtype
        k_val, k_enc = split_keys(key, 2)
        genes = layer_norm(self.gene_norm, self.gene_embedding.weight[gene_ids])
        v = jnp.minimum(values.astype(jnp.float32), self.max_value)[:, None]
        v = dense(self.value_fc2, jax.nn.relu(dense(self.value_fc1, v, dt)), dt)
        v = dropout(self.drop, layer_norm(self.value_norm, v), k_val)
        return self.encoder(genes + v, ~pad_mask, key=k_enc), genes

    def encode(
        self, gene_ids: jax.Array, values: jax.Array, pad_mask: jax.Array, *, key: jax.Array | None = None
    ) -> jax.Array:
        """Final hidden states ``(L, d)`` float32 of one cell (``pad_mask`` True = padding)."""
        return self.encode_genes(gene_ids, values, pad_mask, key=key)[0]

    def predict_from_cell(self, cell: jax.Array, genes: jax.Array) -> jax.Array:
        """MVC decoder: the values ``(L,)`` of genes with embeddings ``genes (L, d)`` read from the cell
        embedding ``cell (d,)`` alone."""
        dt = self.compute_dtype
        query = jax.nn.sigmoid(dense(self.mvc_query, genes, dt))
        return jnp.matmul(dense(self.mvc_w, query, dt), cell.astype(dt), preferred_element_type=jnp.float32)

    def predict_values(self, hidden: jax.Array) -> jax.Array:
        """Expression decoder: hidden states ``(L, d)`` → float32 values ``(L,)``."""
        dt = self.compute_dtype
        h = jax.nn.leaky_relu(dense(self.decoder_fc1, hidden, dt))
        h = jax.nn.leaky_relu(dense(self.decoder_fc2, h, dt))
        return dense(self.decoder_out, h, jnp.float32)[:, 0]

    def __call__(
        self, gene_ids: jax.Array, values: jax.Array, pad_mask: jax.Array, *, key: jax.Array | None = None
    ) -> jax.Array:
        """Predicted value ``(L,)`` of one cell at every position."""
        return self.predict_values(self.encode(gene_ids, values, pad_mask, key=key))

    def _both(self, gene_ids, values, pad_mask, key):
        hidden, genes = self.encode_genes(gene_ids, values, pad_mask, key=key)
        return self.predict_values(hidden), self.predict_from_cell(hidden[0], genes)

    def loss(self, batch: dict, *, key: jax.Array | None = None) -> jax.Array:
        """scGPT's pretraining loss, GEP + GEPC: the masked MSE of the expression decoder plus that of
        the MVC decoder (each the mean of ``(pred - values)**2`` over the positions where ``mask`` is
        True), the model reading ``masked_values``; ``key`` drives dropout (None: no dropout)."""
        gene_ids, pad_mask = batch["gene_ids"], batch["pad_mask"].astype(bool)
        keys = None if key is None else jax.random.split(key, gene_ids.shape[0])
        gep, gepc = jax.vmap(self._both)(gene_ids, batch["masked_values"], pad_mask, keys)
        mask, target = batch["mask"].astype(bool), batch["values"].astype(jnp.float32)
        err = jnp.where(mask, jnp.square(gep - target) + jnp.square(gepc - target), 0.0)
        return err.sum() / jnp.maximum(mask.sum(), 1)

    def embed(
        self,
        batch: dict,
        *,
        pool: str = "cls",
        special_ids: Sequence[int] = (),
        key: jax.Array | None = None,
    ) -> jax.Array:
        """Cell embeddings ``(B, d)``: position 0 (CLS, scGPT's cell embedding) or the mean over real
        tokens whose id is not in ``special_ids``. The encoder reads ``batch["values"]`` (unmasked);
        ``key`` drives dropout (None: none, as for inference)."""
        _check_pool(pool)
        gene_ids, pad_mask = batch["gene_ids"], batch["pad_mask"].astype(bool)
        keys = None if key is None else jax.random.split(key, gene_ids.shape[0])
        cell = lambda g, v, p, k: self.encode(g, v, p, key=k)  # noqa: E731
        hidden = jax.vmap(cell)(gene_ids, batch["values"], pad_mask, keys)
        return _pool(hidden, ~pad_mask, pool, gene_ids, special_ids)

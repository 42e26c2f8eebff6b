"""Transformer encoders for single-cell foundation-model pretraining: Geneformer (masked gene-token
prediction, Hugging Face's ``BertForMaskedLM``) and scGPT (masked binned-value regression, the
``scgpt`` package's ``TransformerModel``), fed the fixed ``(B, L)`` token batches of the token
specification (``docs/tokens.md``). With the same weights both compute what the reference
implementations compute (``tests/test_reference_models.py``); `load_checkpoint` reads their
published checkpoints.

Modules apply to one cell (arrays of shape ``(L,)``); ``loss`` and ``embed`` take a whole batch dict
and vmap. The encoder is `train._layers.Encoder` (post-LayerNorm, float32 residual stream, optional
bfloat16 matmuls).

>>> model = make_pretrain_model("geneformer", "tiny", 128, 64, key=jax.random.key(0))  # doctest: +SKIP
>>> step = make_pretrain_step(make_optimizer(1e-3, warmup_steps=100, total_steps=10_000))  # doctest: +SKIP
>>> model, opt_state, loss = step(model, opt_state, batch, key, np.int32(0))  # doctest: +SKIP
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import partial
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._errors import TrainError
from ._layers import ACTIVATIONS, PRESETS, Encoder, TransformerConfig, dense, dropout, layer_norm, split_keys
from ._layers import resolve_preset as resolve_preset
from ._optim import KINDS, flops_per_cell, make_optimizer, make_pretrain_step
from ._optim import _decay_mask as _decay_mask

__all__ = [
    "KINDS",
    "PRESETS",
    "GeneformerModel",
    "ScGPTModel",
    "TransformerConfig",
    "flops_per_cell",
    "make_optimizer",
    "make_pretrain_model",
    "make_pretrain_step",
]
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _check_pool(pool: str) -> None:
    if pool not in ("cls", "mean"):
        msg = f"pool must be 'cls' or 'mean'; got {pool!r} (Geneformer V1 rows have no CLS: pool='mean')"
        raise TrainError(msg)


def _pool(
    hidden: jax.Array, real: jax.Array, pool: str, ids: jax.Array, special_ids: Sequence[int]
) -> jax.Array:
    """Position 0 (``pool="cls"``) or the mean over ``real`` positions whose id is not special."""
    if pool == "cls":
        return hidden[:, 0]
    for special in special_ids:
        real = real & (ids != special)
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


def check_architecture(cfg: TransformerConfig) -> None:
    """One-line errors for an encoder shape the models cannot build."""
    if cfg.activation not in ACTIVATIONS:
        msg = f"activation must be one of {', '.join(ACTIVATIONS)}; got {cfg.activation!r}"
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


def abstract_model(
    kind: str, cfg: TransformerConfig, vocab_size: int, max_len: int, **options: Any
) -> GeneformerModel | ScGPTModel:
    """The model's structure with ``jax.ShapeDtypeStruct`` leaves (nothing computed), for
    `_initialise` or a checkpoint loader to fill. ``options`` go to the model's constructor."""
    if kind not in KINDS:
        msg = f"kind must be one of {', '.join(KINDS)}; got {kind!r}"
        raise TrainError(msg)
    check_architecture(cfg)
    if jnp.dtype(options.get("compute_dtype", jnp.float32)) not in _DTYPES:
        msg = f"compute_dtype must be jnp.float32 or jnp.bfloat16; got {options['compute_dtype']!r}"
        raise TrainError(msg)
    max_predictions = options.get("max_predictions")
    if vocab_size < 1 or max_len < 1 or (max_predictions is not None and max_predictions < 1):
        msg = (
            f"vocab_size, max_len and max_predictions must be >= 1; got vocab_size={vocab_size}, "
            f"max_len={max_len}, max_predictions={max_predictions}"
        )
        raise TrainError(msg)
    cls = GeneformerModel if kind == "geneformer" else ScGPTModel
    return eqx.filter_eval_shape(partial(cls, cfg, vocab_size, max_len, **options), key=jax.random.key(0))


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
    options: dict[str, Any] = {"compute_dtype": compute_dtype}
    if kind == "geneformer":
        options.update(tie_embeddings=tie_embeddings, max_predictions=max_predictions)
    if kind not in KINDS:
        msg = f"kind must be one of {', '.join(KINDS)}; got {kind!r}"
        raise TrainError(msg)
    abstract = abstract_model(kind, resolve_preset(preset), vocab_size, max_len, **options)
    return _initialise(abstract, key, bert=kind == "geneformer")


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

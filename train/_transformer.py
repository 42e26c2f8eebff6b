"""Transformer encoders for single-cell foundation-model pretraining: Geneformer (masked gene-token
prediction, Hugging Face's ``BertForMaskedLM``) and scGPT (masked binned-value regression, the
``scgpt`` package's ``TransformerModel``), fed the fixed ``(B, L)`` token batches of the token
specification (``docs/tokens.md``). With the same weights both compute what the reference
implementations compute (``tests/test_reference_models.py``); `load_checkpoint` reads their
published checkpoints.

The networks are `GeneformerModel` (``train._geneformer_model``) and `ScGPTModel`
(``train._scgpt_model``); this module checks an architecture and builds either, as a structure
without values (`abstract_model`, which a checkpoint loader fills) or with initialised parameters
(`make_pretrain_model`), and gathers the names pretraining uses (the optimizer, the step, presets).

Modules apply to one cell (arrays of shape ``(L,)``); ``loss`` and ``embed`` take a whole batch dict
and vmap. The encoder is `train._layers.Encoder` (post-LayerNorm, float32 residual stream, optional
bfloat16 matmuls).

>>> model = make_pretrain_model("geneformer", "tiny", 128, 64, key=jax.random.key(0))  # doctest: +SKIP
>>> step = make_pretrain_step(make_optimizer(1e-3, warmup_steps=100, total_steps=10_000))  # doctest: +SKIP
>>> model, opt_state, loss = step(model, opt_state, batch, key, np.int32(0))  # doctest: +SKIP
"""

from __future__ import annotations

import itertools
from functools import partial
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._errors import TrainError
from ._geneformer_model import GeneformerModel
from ._layers import ACTIVATIONS, PRESETS, TransformerConfig
from ._layers import resolve_preset as resolve_preset
from ._optim import KINDS, flops_per_cell, make_optimizer, make_pretrain_step
from ._optim import _decay_mask as _decay_mask
from ._scgpt_model import ScGPTModel

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

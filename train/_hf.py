"""Published checkpoints as Equinox models: a Hugging Face ``BertForMaskedLM`` directory (Geneformer:
``config.json`` + ``model.safetensors``, ``pytorch_model.bin`` or the shards of either) as a `GeneformerModel`, and an
scGPT directory (``args.json`` + ``best_model.pt`` + ``vocab.json``) as a `ScGPTModel`
(`train._scgpt_checkpoint`). No torch: `train._weights` reads the files.

>>> ckpt = train.load_checkpoint("hf:Geneformer/gf-6L-30M-i2048")   # doctest: +SKIP
>>> ckpt.kind, ckpt.vocab_size, ckpt.max_len                   # doctest: +SKIP
('geneformer', 25426, 2048)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._errors import TrainError
from ._layers import TransformerConfig
from ._transformer import abstract_model
from ._weights import read_weights

_BUFFERS = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")


@dataclasses.dataclass(frozen=True)
class PublishedCheckpoint:
    """A loaded checkpoint: the model, its family (``"geneformer"`` or ``"scgpt"``), encoder shape,
    embedding rows, longest input, the weight file it came from and its token vocabulary file
    (``None`` where the directory holds none: a Geneformer directory without a
    ``token_dictionary*.pkl``)."""

    kind: str
    model: eqx.Module
    config: TransformerConfig
    vocab_size: int
    max_len: int
    path: Path
    vocab: Path | None


def read_config(directory: Path, *, family: str, check) -> dict:
    """``directory/config.json`` as a dict, checked by ``check(config, path)``."""
    path = directory / "config.json"
    if not path.is_file():
        msg = f"{directory} has no config.json; a {family} checkpoint is saved with save_pretrained(DIR)"
        raise TrainError(msg)
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        msg = f"{path}: not JSON ({e})"
        raise TrainError(msg) from None
    check(config, path)
    return config


def _check_bert(config: dict, path: Path) -> None:
    model_type, archs = config.get("model_type"), config.get("architectures") or []
    if model_type != "bert" or (archs and "BertForMaskedLM" not in archs):
        msg = (
            f"{path}: model_type {model_type!r}, architectures {archs} is not a BertForMaskedLM "
            "(Geneformer) checkpoint; hf:DIR loads model_type 'bert' with its MLM head (scGPT: scgpt:DIR)"
        )
        raise TrainError(msg)
    rules = {
        "position_embedding_type": ("absolute",),
        "hidden_act": ("relu", "gelu"),
        "is_decoder": (False,),
        "add_cross_attention": (False,),
    }
    for key, allowed in rules.items():
        if key in config and config[key] not in allowed:
            msg = f"{path}: {key} is {config[key]!r}; GeneformerModel implements only {' or '.join(map(repr, allowed))}"
            raise TrainError(msg)


class WeightTaker:
    """Takes named tensors out of a checkpoint's weights, checking each one's shape; collects the
    names that are missing, so that one error can list them all."""

    def __init__(self, weights: dict[str, np.ndarray], path: Path, aliases: dict[str, str] | None = None):
        self.weights, self.path, self.missing = dict(weights), path, []
        for old, new in (aliases or {}).items():  # older spellings of the same weight
            for name in [n for n in self.weights if old in n]:
                self.weights.setdefault(name.replace(old, new), self.weights.pop(name))

    def __call__(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.weights:
            self.missing.append(name)
            return np.zeros(shape, np.float32)
        value = self.weights.pop(name)
        if tuple(value.shape) != tuple(shape):
            msg = (
                f"{self.path}: weight {name} has shape {tuple(value.shape)} but the config asks for "
                f"{tuple(shape)}; the weights do not match the config: use the config file saved with them"
            )
            raise TrainError(msg)
        return np.asarray(value, np.float32)

    def finish(self, *, family: str, ignore: tuple[str, ...] = ()) -> None:
        """One-line errors for missing weights and for weights the model has no place for."""
        if self.missing:
            names = ", ".join(self.missing[:5]) + (
                f" and {len(self.missing) - 5} more" if len(self.missing) > 5 else ""
            )
            msg = (
                f"{self.path}: missing weights {names}; not a complete {family} checkpoint "
                "(save the whole model with save_pretrained / its full state_dict)"
            )
            raise TrainError(msg)
        extra = sorted(n for n in self.weights if not n.startswith(ignore))
        if extra:
            names = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
            msg = (
                f"{self.path}: unexpected weights {names}; {family} has no such weights: "
                "a checkpoint of another model or head (load the pretrained MLM checkpoint)"
            )
            raise TrainError(msg)


def fill(abstract: eqx.Module, values: dict[str, np.ndarray]) -> eqx.Module:
    """``abstract`` with every array leaf (a ``ShapeDtypeStruct``) replaced by ``values``, keyed on the
    leaf's attribute path (``"encoder.layers.qkv.weight"``); other leaves (dropout rates) are kept."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    names = [".".join(str(k.name) for k in keypath) for keypath, _ in flat]
    arrays = {
        n: leaf for n, (_, leaf) in zip(names, flat, strict=True) if isinstance(leaf, jax.ShapeDtypeStruct)
    }
    if set(arrays) != set(values):
        msg = f"internal error: model arrays {sorted(set(arrays) ^ set(values))} are not mapped"
        raise TrainError(msg)
    for name, leaf in arrays.items():
        if values[name].shape != leaf.shape:
            msg = f"internal error: {name} mapped to shape {values[name].shape}; the model holds {leaf.shape}"
            raise TrainError(msg)
    leaves = [
        jnp.asarray(values[n], jnp.float32) if n in arrays else leaf
        for n, (_, leaf) in zip(names, flat, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def load_bert(
    directory: Path, *, compute_dtype: Any = jnp.float32, max_predictions: int | None = None
) -> PublishedCheckpoint:
    """A `GeneformerModel` with the weights of the ``BertForMaskedLM`` checkpoint in ``directory``."""
    config = read_config(directory, family="BertForMaskedLM", check=_check_bert)
    weights, path = read_weights(directory)
    cfg = TransformerConfig(
        config["num_hidden_layers"],
        config["hidden_size"],
        config["num_attention_heads"],
        config["intermediate_size"],
        config.get("hidden_act", "gelu"),
        float(config.get("hidden_dropout_prob", 0.1)),
    )
    vocab, max_len, types = (
        config["vocab_size"],
        config["max_position_embeddings"],
        config.get("type_vocab_size", 2),
    )
    tied = bool(config.get("tie_word_embeddings", True))
    abstract = abstract_model(
        "geneformer",
        cfg,
        vocab,
        max_len,
        compute_dtype=compute_dtype,
        tie_embeddings=tied,
        max_predictions=max_predictions,
        eps=float(config.get("layer_norm_eps", 1e-12)),
        type_vocab_size=types,
    )
    take = WeightTaker(
        weights, path, aliases={"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"}
    )
    d, f = cfg.width, cfg.mlp_width
    values: dict[str, np.ndarray] = {}

    def norm(prefix: str, name: str) -> None:
        values[f"{name}.weight"] = take(f"{prefix}.weight", (d,))
        values[f"{name}.bias"] = take(f"{prefix}.bias", (d,))

    e = "bert.embeddings"
    values["token_embedding.weight"] = take(f"{e}.word_embeddings.weight", (vocab, d))
    values["position_embedding.weight"] = take(f"{e}.position_embeddings.weight", (max_len, d))
    values["token_type_embedding.weight"] = take(f"{e}.token_type_embeddings.weight", (types, d))
    norm(f"{e}.LayerNorm", "embedding_norm")
    layers = []
    for i in range(cfg.num_layers):
        p = f"bert.encoder.layer.{i}"
        qkv = [take(f"{p}.attention.self.{n}.weight", (d, d)) for n in ("query", "key", "value")]
        qkv_b = [take(f"{p}.attention.self.{n}.bias", (d,)) for n in ("query", "key", "value")]
        layers.append(
            {
                "qkv.weight": np.concatenate(qkv),
                "qkv.bias": np.concatenate(qkv_b),
                "out.weight": take(f"{p}.attention.output.dense.weight", (d, d)),
                "out.bias": take(f"{p}.attention.output.dense.bias", (d,)),
                "ln1.weight": take(f"{p}.attention.output.LayerNorm.weight", (d,)),
                "ln1.bias": take(f"{p}.attention.output.LayerNorm.bias", (d,)),
                "fc1.weight": take(f"{p}.intermediate.dense.weight", (f, d)),
                "fc1.bias": take(f"{p}.intermediate.dense.bias", (f,)),
                "fc2.weight": take(f"{p}.output.dense.weight", (d, f)),
                "fc2.bias": take(f"{p}.output.dense.bias", (d,)),
                "ln2.weight": take(f"{p}.output.LayerNorm.weight", (d,)),
                "ln2.bias": take(f"{p}.output.LayerNorm.bias", (d,)),
            }
        )
    for name in layers[0]:
        values[f"encoder.layers.{name}"] = np.stack([layer[name] for layer in layers])
    values["head_dense.weight"] = take("cls.predictions.transform.dense.weight", (d, d))
    values["head_dense.bias"] = take("cls.predictions.transform.dense.bias", (d,))
    norm("cls.predictions.transform.LayerNorm", "head_norm")
    # The logits' bias: transformers >= 5 adds cls.predictions.decoder.bias, tied to cls.predictions.bias
    # only with tie_word_embeddings; before 5 the two names held one tensor.
    bias = (
        "cls.predictions.decoder.bias"
        if not tied and "cls.predictions.decoder.bias" in weights
        else "cls.predictions.bias"
    )
    values["decoder_bias"] = take(bias, (vocab,))
    if not tied:
        values["decoder.weight"] = take("cls.predictions.decoder.weight", (vocab, d))
    ignore = (*_BUFFERS, "cls.predictions.decoder.bias", "cls.predictions.bias")
    ignore += ("cls.predictions.decoder.weight",) if tied else ()
    take.finish(family="BertForMaskedLM", ignore=ignore)
    vocab_file = next(iter(sorted(directory.glob("token_dictionary*.pkl"))), None)
    return PublishedCheckpoint("geneformer", fill(abstract, values), cfg, vocab, max_len, path, vocab_file)

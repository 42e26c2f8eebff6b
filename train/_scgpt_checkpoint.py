"""An scGPT checkpoint directory as a `ScGPTModel`: ``args.json`` (the run's arguments: ``embsize``,
``nheads``, ``d_hid``, ``nlayers``, ``dropout``), ``best_model.pt`` (``torch.save`` of the
``TransformerModel``'s state dict) and ``vocab.json`` (token → id), as the scGPT repository
publishes its pretrained models. The MVC decoder (``mvc_decoder``, "inner product") is read where
the checkpoint has one, else drawn with PyTorch's default initialisation (a checkpoint trained without
GEPC); the task heads that feed neither decoder (``cls_decoder``, ...) are left out; the flash-attention spelling of the attention
weights (``self_attn.Wqkv``) is read as PyTorch's (``self_attn.in_proj_``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._errors import TrainError
from ._hf import PublishedCheckpoint, WeightTaker, fill
from ._layers import TransformerConfig
from ._transformer import abstract_model
from ._weights import read_torch_pickle

_HEADS = (
    "cls_decoder.",
    "mvc_decoder.W_zero_logit.",
    "grad_reverse_discriminator.",
    "decoder.zero_logit.",
    "sim.",
)
_ARGS = ("embsize", "nheads", "d_hid", "nlayers")


def _read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        msg = f"{path.parent} has no {path.name}; an scGPT checkpoint directory holds args.json, best_model.pt and vocab.json ({what})"
        raise TrainError(msg)
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        msg = f"{path}: not JSON ({e})"
        raise TrainError(msg) from None


def _check_args(args: dict, path: Path) -> None:
    if "model_type" in args or not all(k in args for k in _ARGS):
        msg = (
            f"{path}: not scGPT run arguments (needs {', '.join(_ARGS)}); "
            "a Hugging Face checkpoint (config.json with model_type) loads with hf:DIR"
        )
        raise TrainError(msg)
    # what the model and its inputs implement (scGPT's defaults); a run trained otherwise would be fed
    # inputs it never saw (its bins, mask and pad values) or pooled otherwise, with no error
    rules = {
        "input_emb_style": "continuous",
        "pre_norm": False,
        "use_batch_labels": False,
        "DSBN": False,
        "input_style": "binned",
        "n_bins": 51,
        "mask_value": -1,
        "pad_value": -2,
        "cell_emb_style": "cls",
    }
    for key, allowed in rules.items():
        if key in args and args[key] != allowed:
            msg = f"{path}: {key} is {args[key]!r}; ScGPTModel implements only {allowed!r} (scGPT's default)"
            raise TrainError(msg)


def load_scgpt(
    directory: Path, *, compute_dtype: Any = jnp.float32, max_len: int | None = None
) -> PublishedCheckpoint:
    """A `ScGPTModel` with the weights of the scGPT checkpoint in ``directory``."""
    args = _read_json(directory / "args.json", "the model's shape")
    _check_args(args, directory / "args.json")
    vocab = _read_json(directory / "vocab.json", "its token ids")
    path = directory / "best_model.pt"
    if not path.is_file():
        msg = f"{directory} has no best_model.pt (the TransformerModel's state_dict saved with torch.save)"
        raise TrainError(msg)
    weights = read_torch_pickle(path)
    cfg = TransformerConfig(
        int(args["nlayers"]),
        int(args["embsize"]),
        int(args["nheads"]),
        int(args["d_hid"]),
        "relu",
        float(args.get("dropout", 0.2)),
    )
    num_tokens = len(vocab)
    length = max_len or int(args.get("max_seq_len", 1200)) + 1
    abstract = abstract_model("scgpt", cfg, num_tokens, length, compute_dtype=compute_dtype)
    take = WeightTaker(weights, path, aliases={"self_attn.Wqkv.": "self_attn.in_proj_"})
    d, f = cfg.width, cfg.mlp_width
    values = {
        "gene_embedding.weight": take("encoder.embedding.weight", (num_tokens, d)),
        "gene_norm.weight": take("encoder.enc_norm.weight", (d,)),
        "gene_norm.bias": take("encoder.enc_norm.bias", (d,)),
        "value_fc1.weight": take("value_encoder.linear1.weight", (d, 1)),
        "value_fc1.bias": take("value_encoder.linear1.bias", (d,)),
        "value_fc2.weight": take("value_encoder.linear2.weight", (d, d)),
        "value_fc2.bias": take("value_encoder.linear2.bias", (d,)),
        "value_norm.weight": take("value_encoder.norm.weight", (d,)),
        "value_norm.bias": take("value_encoder.norm.bias", (d,)),
    }
    for ours, theirs, shape in (
        ("decoder_fc1", "0", (d, d)),
        ("decoder_fc2", "2", (d, d)),
        ("decoder_out", "4", (1, d)),
    ):
        values[f"{ours}.weight"] = take(f"decoder.fc.{theirs}.weight", shape)
        values[f"{ours}.bias"] = take(f"decoder.fc.{theirs}.bias", shape[:1])
    mvc = {
        "mvc_query.weight": ("mvc_decoder.gene2query.weight", (d, d)),
        "mvc_query.bias": ("mvc_decoder.gene2query.bias", (d,)),
        "mvc_w.weight": ("mvc_decoder.W.weight", (d, d)),
    }
    if all(theirs in weights for theirs, _ in mvc.values()):
        values.update({ours: take(theirs, shape) for ours, (theirs, shape) in mvc.items()})
    else:  # trained without GEPC: the decoder as PyTorch's nn.Linear starts, U(±1/√d), seeded
        rng, bound = np.random.default_rng(0), 1 / np.sqrt(d)
        values.update(
            {ours: rng.uniform(-bound, bound, shape).astype(np.float32) for ours, (_, shape) in mvc.items()}
        )
    layer_names = {
        "qkv.weight": ("self_attn.in_proj_weight", (3 * d, d)),
        "qkv.bias": ("self_attn.in_proj_bias", (3 * d,)),
        "out.weight": ("self_attn.out_proj.weight", (d, d)),
        "out.bias": ("self_attn.out_proj.bias", (d,)),
        "ln1.weight": ("norm1.weight", (d,)),
        "ln1.bias": ("norm1.bias", (d,)),
        "fc1.weight": ("linear1.weight", (f, d)),
        "fc1.bias": ("linear1.bias", (f,)),
        "fc2.weight": ("linear2.weight", (d, f)),
        "fc2.bias": ("linear2.bias", (d,)),
        "ln2.weight": ("norm2.weight", (d,)),
        "ln2.bias": ("norm2.bias", (d,)),
    }
    for ours, (theirs, shape) in layer_names.items():
        stacked = [take(f"transformer_encoder.layers.{i}.{theirs}", shape) for i in range(cfg.num_layers)]
        values[f"encoder.layers.{ours}"] = np.stack(stacked)
    take.finish(family="scGPT TransformerModel", ignore=_HEADS)
    # vocab.json (gene symbols → ids) is the default vocabulary: matched to the dataset's gene names
    return PublishedCheckpoint(
        "scgpt", fill(abstract, values), cfg, num_tokens, length, path, directory / "vocab.json"
    )

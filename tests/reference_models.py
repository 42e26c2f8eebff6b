"""The reference implementations, run in .venv-reference (torch): builds random-weight models with
fixed seeds, saves them in their own checkpoint formats, runs them on the token batches it is given
and writes their outputs as .npy for tests/test_reference_models.py to compare.

    .venv-reference/bin/python tests/reference_models.py JOBS.json

Each job of JOBS.json: ``{"name", "family": "bert" | "scgpt", "config": {...}, "seed", "inputs":
FILE.npz, "out": DIR, "formats": [...]}``.

- ``bert``: ``transformers.BertForMaskedLM(BertConfig(**config))``, saved with ``save_pretrained``
  (``DIR/safetensors``: config.json + model.safetensors) and, with ``"bin"`` in formats, as
  ``DIR/bin``: config.json + ``pytorch_model.bin`` (``torch.save`` of the state dict, the format of
  Geneformer's published V1 checkpoint). Writes ``logits.npy`` (B, L, vocab) and ``hidden.npy``
  (B, L, d: last hidden states) for ``input_ids`` and ``attention_mask``; with ``"embed_inputs":
  FILE.npz``, ``embed_hidden.npy`` too (the last hidden states of those rows).
- ``scgpt``: the published ``scgpt`` package's ``TransformerModel`` (scgpt/model/model.py, imported
  without the package's __init__: see scripts/setup-reference.sh), saved as scGPT publishes its
  models: ``DIR/ckpt`` with args.json, best_model.pt (``torch.save`` of the state dict) and
  vocab.json. Writes ``pred.npy`` (B, L: ``mlm_output``), ``hidden.npy`` (B, L, d) and
  ``cell_emb.npy`` (B, d) for ``gene_ids``, ``values`` and ``pad_mask``.

Every parameter is drawn from the model's own initialisation and then moved by seeded noise, so
that LayerNorm scales and biases are not the 1s and 0s that would hide a mapping mistake.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import torch


def scgpt_model_module():
    """``scgpt.model.model`` from the installed scgpt package, without running ``scgpt/__init__.py``
    (which imports torchtext, whose compiled library does not load with this torch)."""
    root = Path(importlib.util.find_spec("scgpt").submodule_search_locations[0])
    for name, path in (("scgpt", root), ("scgpt.model", root / "model")):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(path)]
            sys.modules[name] = module
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flash_attn is not installed": the PyTorch layers are used
        return importlib.import_module("scgpt.model.model")


def _perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=gen))


def _bert(job: dict, inputs: dict, out: Path) -> None:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(job["seed"])
    model = BertForMaskedLM(BertConfig(**job["config"])).eval()
    _perturb(model, job["seed"])
    if model.config.tie_word_embeddings:
        assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    model.save_pretrained(out / "safetensors")
    if "sharded" in job["formats"]:  # as a model larger than max_shard_size is saved: shards and an index
        model.save_pretrained(out / "sharded", max_shard_size="100KB")
        model.save_pretrained(out / "sharded_bin", max_shard_size="100KB", safe_serialization=False)
    if "bin" in job["formats"]:
        (out / "bin").mkdir()
        model.config.to_json_file(out / "bin" / "config.json")
        torch.save(model.state_dict(), out / "bin" / "pytorch_model.bin")
    with torch.no_grad():
        result = model(
            input_ids=torch.from_numpy(inputs["input_ids"]).long(),
            attention_mask=torch.from_numpy(inputs["attention_mask"]).long(),
            output_hidden_states=True,
        )
    np.save(out / "logits.npy", result.logits.numpy().astype(np.float32))
    np.save(out / "hidden.npy", result.hidden_states[-1].numpy().astype(np.float32))
    if "embed_inputs" in job:  # unmasked rows: last hidden states only
        rows = dict(np.load(job["embed_inputs"]))
        with torch.no_grad():
            result = model.bert(
                input_ids=torch.from_numpy(rows["input_ids"]).long(),
                attention_mask=torch.from_numpy(rows["attention_mask"]).long(),
            )
        np.save(out / "embed_hidden.npy", result.last_hidden_state.numpy().astype(np.float32))


def _scgpt(job: dict, inputs: dict, out: Path) -> None:
    cfg, vocab = job["config"], {str(k): int(v) for k, v in job["vocab"].items()}
    torch.manual_seed(job["seed"])
    model = (
        scgpt_model_module()
        .TransformerModel(
            ntoken=len(vocab),
            d_model=cfg["embsize"],
            nhead=cfg["nheads"],
            d_hid=cfg["d_hid"],
            nlayers=cfg["nlayers"],
            vocab=vocab,
            dropout=cfg["dropout"],
            pad_token="<pad>",
            pad_value=-2,
            do_mvc=True,
            input_emb_style="continuous",
            cell_emb_style="cls",
            use_fast_transformer=False,
        )
        .eval()
    )
    _perturb(model, job["seed"])
    ckpt = out / "ckpt"
    ckpt.mkdir()
    (ckpt / "args.json").write_text(
        json.dumps({**cfg, "input_emb_style": "continuous", "pad_token": "<pad>"})
    )
    (ckpt / "vocab.json").write_text(json.dumps(vocab))
    torch.save(model.state_dict(), ckpt / "best_model.pt")
    src = torch.from_numpy(inputs["gene_ids"]).long()
    values = torch.from_numpy(inputs["values"]).float()
    pad = torch.from_numpy(inputs["pad_mask"]).bool()
    with torch.no_grad():
        result = model(src, values, src_key_padding_mask=pad, MVC=True)
        hidden = model._encode(src, values, pad)
    np.save(out / "pred.npy", result["mlm_output"].numpy().astype(np.float32))
    np.save(out / "cell_emb.npy", result["cell_emb"].numpy().astype(np.float32))
    np.save(out / "mvc.npy", result["mvc_output"].numpy().astype(np.float32))
    np.save(out / "hidden.npy", hidden.numpy().astype(np.float32))


def main(jobs_path: str) -> None:
    torch.set_num_threads(2)
    for job in json.loads(Path(jobs_path).read_text()):
        out = Path(job["out"])
        out.mkdir(parents=True, exist_ok=True)
        inputs = dict(np.load(job["inputs"]))
        (_bert if job["family"] == "bert" else _scgpt)(job, inputs, out)
        print(f"reference {job['name']}: {out}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

"""The Equinox pretraining models are the reference networks: with the same weights, `GeneformerModel`
gives Hugging Face ``BertForMaskedLM``'s logits and `ScGPTModel` the published ``scgpt``
``TransformerModel``'s predictions, on the project's own token batches (with padding and masked
tokens), read from the references' own checkpoint files by the project's torch-free loaders.

The references run in .venv-reference (scripts/setup-reference.sh) through tests/reference_models.py,
once per session. Published shapes: Geneformer V1 (6 layers, width 256, 4 heads, MLP 512, ReLU, 2,048
positions, 25,426 tokens), a Geneformer V2-style shape (12 layers, 512, 8 heads, MLP 1,024, 4,096
positions, 20,275 tokens) and scGPT's whole-human model (12 layers, 512, 8 heads, d_hid 512, 60,697
tokens). A small untied GELU BERT covers the options Geneformer does not use.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omicsio_jax as oj
from materialize import make_synthetic_corpus, materialize
from train._cli import main
from train._errors import TrainError
from train._geneformer_model import GeneformerModel
from train._published import load_checkpoint
from train._scgpt_model import ScGPTModel
from train._transformer import PRESETS

ROOT = Path(__file__).resolve().parent.parent
REFERENCE_PYTHON = ROOT / ".venv-reference" / "bin" / "python"
pytestmark = pytest.mark.skipif(
    not REFERENCE_PYTHON.exists(), reason="no .venv-reference: run scripts/setup-reference.sh"
)
TOL = 1e-4
BERT_BASE = {"layer_norm_eps": 1e-12, "type_vocab_size": 2, "pad_token_id": 0}
CONFIGS = {
    "geneformer_v1": dict(
        BERT_BASE,
        num_hidden_layers=6,
        hidden_size=256,
        num_attention_heads=4,
        intermediate_size=512,
        hidden_act="relu",
        max_position_embeddings=2048,
        vocab_size=25_426,
        hidden_dropout_prob=0.02,
        attention_probs_dropout_prob=0.02,
    ),
    "geneformer_v2": dict(
        BERT_BASE,
        num_hidden_layers=12,
        hidden_size=512,
        num_attention_heads=8,
        intermediate_size=1024,
        hidden_act="relu",
        max_position_embeddings=4096,
        vocab_size=20_275,
        hidden_dropout_prob=0.02,
        attention_probs_dropout_prob=0.02,
    ),
    "small_untied_gelu": dict(
        BERT_BASE,
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        hidden_act="gelu",
        max_position_embeddings=512,
        vocab_size=20_275,
        layer_norm_eps=1e-6,
        tie_word_embeddings=False,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ),
}
SCGPT = {"embsize": 512, "nheads": 8, "d_hid": 512, "nlayers": 12, "dropout": 0.2, "max_seq_len": 1200}
SCGPT_TOKENS = 60_697
LENGTHS = {"geneformer_v1": 192, "geneformer_v2": 200, "small_untied_gelu": 200, "scgpt": 201}
ROWS = np.array([0, 3, 17, 42])


def _vocab(ensembl: np.ndarray, specials: dict, size: int, seed: int, *, drop_every: int) -> dict:
    """Ensembl id → token id for all but every ``drop_every``-th dataset gene, ids spread over
    ``[len(specials), size)``."""
    rng = np.random.default_rng(seed)
    kept = [e for i, e in enumerate(ensembl) if i % drop_every]
    ids = rng.choice(np.arange(len(specials), size), size=len(kept), replace=False)
    return {**specials, **{e: int(t) for e, t in zip(kept, ids, strict=True)}}


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory):
    """200 cells × 2,000 genes (≈150 expressed per cell: rows of 192–201 tokens hold padding)."""
    root = tmp_path_factory.mktemp("reference_ds")
    corpus = make_synthetic_corpus(
        root / "corpus", num_cells=200, num_genes=2000, seed=11, mean_nnz=150, progress=False
    )
    materialize(corpus.cells_parquet, root / "ds", progress=False)
    return root / "ds"


@pytest.fixture(scope="module")
def reference(small_dataset, tmp_path_factory):
    """Runs every reference model once; returns ``{name: (out_dir, batch, vocab_path)}``."""
    root = tmp_path_factory.mktemp("reference")
    ds = oj.open_dataset(small_dataset)
    ensembl = ds.features["ensembl_id"].to_numpy(dtype=object)
    v1 = _vocab(ensembl, {"<pad>": 0, "<mask>": 1}, 25_426, 1, drop_every=9)
    v2 = _vocab(ensembl, {"<pad>": 0, "<mask>": 1, "<cls>": 2, "<eos>": 3}, 20_275, 2, drop_every=7)
    sc = _vocab(ensembl, {"<pad>": 0, "<cls>": 1, "<eoc>": 2}, SCGPT_TOKENS, 3, drop_every=5)
    (root / "v1.pkl").write_bytes(pickle.dumps(v1))  # Geneformer ships its dictionaries as pickles
    (root / "v2.json").write_text(json.dumps(v2))
    (root / "scgpt.json").write_text(json.dumps(sc))
    taken = set(sc.values())
    scgpt_vocab = dict(sc, **{f"filler{i}": i for i in range(SCGPT_TOKENS) if i not in taken})
    outputs = {
        "geneformer_v1": oj.GeneformerTokens(max_len=192, special_tokens=False, vocab=root / "v1.pkl"),
        "geneformer_v2": oj.GeneformerTokens(max_len=200, vocab=root / "v2.json"),
        "small_untied_gelu": oj.GeneformerTokens(max_len=200, vocab=root / "v2.json"),
        "scgpt": oj.ScGPTTokens(max_len=201, vocab=root / "scgpt.json", mask_prob=0.4),
    }
    vocab_paths = {"geneformer_v1": "v1.pkl", "geneformer_v2": "v2.json", "small_untied_gelu": "v2.json"}
    jobs, batches, embed_rows = [], {}, {}
    for seed, (name, output) in enumerate(outputs.items()):
        batch = oj.tokenize(ds, ROWS, output, seed=seed)
        if name == "small_untied_gelu":  # and every cell unmasked, for the embed command
            unmasked = oj.GeneformerTokens(max_len=200, mask_prob=0.0, vocab=root / "v2.json")
            rows = oj.tokenize(ds, np.arange(ds.num_cells), unmasked)
            embed_rows[name] = {k: rows[k] for k in ("input_ids", "attention_mask")}
            np.savez(root / "embed_rows.npz", **embed_rows[name])
        if name == "scgpt":
            inputs = {
                "gene_ids": batch["gene_ids"],
                "values": batch["masked_values"],
                "pad_mask": batch["pad_mask"],
            }
            job = {"family": "scgpt", "config": SCGPT, "vocab": scgpt_vocab}
        else:
            inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
            job = {
                "family": "bert",
                "config": CONFIGS[name],
                "formats": {"geneformer_v1": ["bin"], "small_untied_gelu": ["sharded"]}.get(name, []),
            }
            if name in embed_rows:
                job["embed_inputs"] = str(root / "embed_rows.npz")
        np.savez(root / f"{name}.npz", **inputs)
        jobs.append(
            {
                **job,
                "name": name,
                "seed": 100 + seed,
                "inputs": str(root / f"{name}.npz"),
                "out": str(root / name),
            }
        )
        batches[name] = inputs
    (root / "jobs.json").write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    run = subprocess.run(
        [str(REFERENCE_PYTHON), str(ROOT / "tests" / "reference_models.py"), str(root / "jobs.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return {
        n: (
            root / n,
            dict(batches[n], **{f"embed_{k}": v for k, v in embed_rows.get(n, {}).items()}),
            root / vocab_paths[n] if n in vocab_paths else None,
        )
        for n in outputs
    }


@eqx.filter_jit
def _geneformer_outputs(model, ids, mask):
    hidden = jax.vmap(model.encode)(ids, mask)
    return jax.vmap(model.logits)(hidden), hidden


@eqx.filter_jit
def _scgpt_outputs(model, genes, values, pad):
    hidden, embedded = jax.vmap(model.encode_genes)(genes, values, pad)
    mvc = jax.vmap(model.predict_from_cell)(hidden[:, 0], embedded)
    return jax.vmap(model.predict_values)(hidden), hidden, mvc


def _max_diff(got, want, where=None) -> float:
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    return float(diff[where].max() if where is not None else diff.max())


def _check_bert(name: str, ckpt_dir: Path, out: Path, batch: dict) -> float:
    ckpt = load_checkpoint(f"hf:{ckpt_dir}")
    assert isinstance(ckpt.model, GeneformerModel) and ckpt.kind == "geneformer"
    assert (~batch["attention_mask"]).any() and batch["attention_mask"].any(1).all()  # padded, no empty row
    logits, hidden = _geneformer_outputs(
        ckpt.model, jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
    )
    want = np.load(out / "logits.npy")
    assert logits.shape == want.shape == (*batch["input_ids"].shape, CONFIGS[name]["vocab_size"])
    d_logits, d_hidden = _max_diff(logits, want), _max_diff(hidden, np.load(out / "hidden.npy"))
    print(f"{name} ({ckpt.path.name}): max |logit diff| {d_logits:.2e}, max |hidden diff| {d_hidden:.2e}")
    assert d_logits < TOL and d_hidden < TOL
    return d_logits


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_geneformer_v1_is_bert_for_masked_lm(reference, fmt):
    out, batch, _ = reference["geneformer_v1"]
    assert (batch["input_ids"] == 1).any()  # <mask> tokens are in the batch
    _check_bert("geneformer_v1", out / fmt, out, batch)
    ckpt = load_checkpoint(f"hf:{out / fmt}")
    assert ckpt.config == PRESETS["geneformer-v1"] and ckpt.vocab_size == 25_426 and ckpt.max_len == 2048
    assert ckpt.model.decoder is None  # tied to the word embeddings, as in the checkpoint


def test_geneformer_v2_shape_is_bert_for_masked_lm(reference):
    out, batch, _ = reference["geneformer_v2"]
    assert (batch["input_ids"][:, 0] == 2).all()  # <cls> first
    _check_bert("geneformer_v2", out / "safetensors", out, batch)


def test_untied_gelu_bert(reference):
    out, batch, _ = reference["small_untied_gelu"]
    _check_bert("small_untied_gelu", out / "safetensors", out, batch)
    assert load_checkpoint(f"hf:{out / 'safetensors'}").model.decoder is not None


@pytest.mark.parametrize("fmt", ["sharded", "sharded_bin"])
def test_a_sharded_checkpoint_is_the_same_network(reference, fmt, tmp_path):
    """save_pretrained splits a model larger than max_shard_size into shards and an index: read
    through the index, it is the same network; a shard missing is named."""
    out, batch, _ = reference["small_untied_gelu"]
    index = next((out / fmt).glob("*.index.json"))
    assert len(set(json.loads(index.read_text())["weight_map"].values())) > 1  # several shards
    assert load_checkpoint(f"hf:{out / fmt}").path == index
    _check_bert("small_untied_gelu", out / fmt, out, batch)
    partial = _copy(out / fmt, tmp_path / "partial")
    shard = sorted(set(json.loads(index.read_text())["weight_map"].values()))[-1]
    (partial / shard).unlink()
    with pytest.raises(TrainError, match=rf"lists shard {shard}, which is not in .*copy every shard"):
        load_checkpoint(f"hf:{partial}")


def test_scgpt_is_the_published_transformer_model(reference):
    out, batch, _ = reference["scgpt"]
    ckpt = load_checkpoint(f"scgpt:{out / 'ckpt'}")
    assert isinstance(ckpt.model, ScGPTModel) and ckpt.config == PRESETS["scgpt"]
    assert ckpt.vocab_size == SCGPT_TOKENS and (batch["values"] == -1).any()  # masked values in the input
    pad = batch["pad_mask"]
    assert pad.any() and (~pad).any(1).all()
    pred, hidden, mvc = _scgpt_outputs(
        ckpt.model, *(jnp.asarray(batch[k]) for k in ("gene_ids", "values", "pad_mask"))
    )
    # PyTorch's encoder returns zeros at padded positions (its nested-tensor fast path): compare real ones
    d_pred = _max_diff(pred, np.load(out / "pred.npy"), ~pad)
    d_hidden = _max_diff(hidden, np.load(out / "hidden.npy"), ~pad)
    d_cell = _max_diff(hidden[:, 0], np.load(out / "cell_emb.npy"))
    d_mvc = _max_diff(mvc, np.load(out / "mvc.npy"), ~pad)  # GEPC's values, from the cell embedding
    print(
        f"scgpt: max |pred diff| {d_pred:.2e}, max |hidden diff| {d_hidden:.2e}, max |cell emb diff| {d_cell:.2e}, "
        f"max |mvc diff| {d_mvc:.2e}"
    )
    assert d_pred < TOL and d_hidden < TOL and d_cell < TOL and d_mvc < TOL


def _expected_embedding(out: Path, batch: dict, specials: tuple[int, ...]) -> np.ndarray:
    hidden = np.load(out / "embed_hidden.npy").astype(np.float64)
    genes = batch["embed_attention_mask"] & ~np.isin(batch["embed_input_ids"], specials)
    return (np.einsum("bld,bl->bd", hidden, genes) / genes.sum(1, keepdims=True)).astype(np.float32)


def test_embed_command_writes_geneformer_cell_embeddings(reference, small_dataset, tmp_path, capsys):
    out, batch, vocab = reference["small_untied_gelu"]  # V2 rows
    emb_path = tmp_path / "emb.npy"
    argv = ["embed", str(small_dataset), "--init", f"hf:{out / 'safetensors'}", "--vocab", str(vocab)]
    assert main([*argv, "--max-len", "200", "--batch-size", "64", "--out", str(emb_path)]) == 0
    printed = capsys.readouterr().out
    assert (
        "1,714 of 2,000 dataset genes have a token (by Ensembl id); 286 skipped" in printed
        and "missing e.g. ENSG" in printed
    )
    emb = np.load(emb_path)
    assert emb.dtype == np.float32 and emb.shape == (200, 64)
    want = _expected_embedding(out, batch, (2, 3))  # the mean over gene tokens: no pad, <cls>, <eos>
    assert _max_diff(emb, want) < TOL
    cls_path = tmp_path / "cls.npy"
    assert main([*argv, "--max-len", "200", "--pool", "cls", "--out", str(cls_path)]) == 0
    assert _max_diff(np.load(cls_path), np.load(out / "embed_hidden.npy")[:, 0]) < TOL


def test_an_scgpt_checkpoints_own_vocab_of_gene_symbols_is_its_default_vocabulary(
    reference, small_dataset, tmp_path, capsys
):
    """scGPT publishes vocab.json keyed on gene symbols: with no --vocab, `--init scgpt:DIR` matches it
    to the dataset's gene names, and embeds as the same ids keyed on Ensembl ids given as --vocab."""
    out, _, _ = reference["scgpt"]
    ckpt = out / "ckpt"
    features = oj.open_dataset(small_dataset).features
    symbol_of = dict(zip(features["ensembl_id"], features["gene_name"], strict=True))
    by_id = json.loads((out.parent / "scgpt.json").read_text())
    own = tmp_path / "ckpt"
    own.mkdir()
    for name in ("args.json", "best_model.pt"):
        (own / name).symlink_to(ckpt / name)
    symbols = {symbol_of.get(k, k): v for k, v in json.loads((ckpt / "vocab.json").read_text()).items()}
    (own / "vocab.json").write_text(json.dumps(symbols))
    argv = ["embed", str(small_dataset), "--max-len", "201", "--batch-size", "100"]
    assert main([*argv, "--init", f"scgpt:{own}", "--out", str(tmp_path / "own.npy")]) == 0
    assert "(by gene symbol)" in capsys.readouterr().out
    given = ["--init", f"scgpt:{ckpt}", "--vocab", str(out.parent / "scgpt.json")]
    assert main([*argv, *given, "--out", str(tmp_path / "given.npy")]) == 0
    assert len(by_id) > 1_000
    np.testing.assert_array_equal(np.load(tmp_path / "own.npy"), np.load(tmp_path / "given.npy"))


def test_pretrain_starts_from_the_published_checkpoint(reference, small_dataset):
    from train._cli import parse_pretrain_config
    from train._pretrain import pretrain

    out, _, vocab = reference["small_untied_gelu"]
    argv = [
        str(small_dataset),
        "--init",
        f"hf:{out / 'safetensors'}",
        "--vocab",
        str(vocab),
        "--max-len",
        "64",
    ]
    options = [
        "--steps",
        "1",
        "--lr",
        "0",
        "--batch-size",
        "8",
        "--block-size",
        "4",
        "--fetch-factor",
        "2",
        "--dropout",
        "0.25",
        "--quiet",
    ]
    result = pretrain(
        parse_pretrain_config([*argv, *options])
    )  # learning rate 0: the checkpoint's parameters, at the rate --dropout gives
    loaded = load_checkpoint(f"hf:{out / 'safetensors'}").model
    got, want = eqx.filter(result.model, eqx.is_array), eqx.filter(loaded, eqx.is_array)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert result.vocab_size == 20_275 and np.isfinite(result.history[0]["loss"])
    drops = jax.tree.leaves(result.model, is_leaf=lambda n: isinstance(n, eqx.nn.Dropout))
    assert {n.p for n in drops if isinstance(n, eqx.nn.Dropout)} == {0.25}


# --- bad input: one-line errors naming the file, the value and the fix ---


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        data = np.ascontiguousarray(array, np.float32).tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def test_bad_checkpoints_are_one_line_errors(reference, tmp_path):
    from train._weights import read_safetensors

    src = reference["small_untied_gelu"][0] / "safetensors"
    weights = {k: np.array(v) for k, v in read_safetensors(src / "model.safetensors").items()}

    other = _copy(src, tmp_path / "other")
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(cfg, architectures=["BertForSequenceClassification"])))
    with pytest.raises(
        TrainError,
        match=r"config.json: model_type 'bert', architectures \['BertForSequenceClassification'\] is not a BertForMaskedLM",
    ):
        load_checkpoint(f"hf:{other}")
    (other / "config.json").write_text(json.dumps(dict(cfg, model_type="roberta")))
    with pytest.raises(TrainError, match="model_type 'roberta'"):
        load_checkpoint(f"hf:{other}")
    with pytest.raises(TrainError, match="not scGPT run arguments"):  # an HF directory given as scgpt:
        (other / "args.json").write_text((other / "config.json").read_text())
        load_checkpoint(f"scgpt:{other}")

    missing = _copy(src, tmp_path / "missing")
    _write_safetensors(
        missing / "model.safetensors", {k: v for k, v in weights.items() if "layer.1.output.dense" not in k}
    )
    with pytest.raises(
        TrainError,
        match=r"model.safetensors: missing weights bert.encoder.layer.1.output.dense.weight, bert.encoder.layer.1.output.dense.bias; not a complete BertForMaskedLM",
    ):
        load_checkpoint(f"hf:{missing}")

    extra = _copy(src, tmp_path / "extra")
    _write_safetensors(
        extra / "model.safetensors", dict(weights, **{"bert.pooler.dense.weight": np.zeros((64, 64))})
    )
    with pytest.raises(
        TrainError,
        match=r"model.safetensors: unexpected weights bert.pooler.dense.weight; BertForMaskedLM has no such weights",
    ):
        load_checkpoint(f"hf:{extra}")

    shape = _copy(src, tmp_path / "shape")
    (shape / "config.json").write_text(json.dumps(dict(cfg, vocab_size=20_000)))
    with pytest.raises(
        TrainError,
        match=r"weight bert.embeddings.word_embeddings.weight has shape \(20275, 64\) but the config asks for \(20000, 64\)",
    ):
        load_checkpoint(f"hf:{shape}")

    with pytest.raises(TrainError, match="--init must be hf:DIR"):
        load_checkpoint(f"onnx:{src}")


def test_a_pickle_holding_anything_but_tensors_is_refused(tmp_path):
    from train._weights import read_torch_pickle

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.mkdir, (str(marker),)

    (tmp_path / "bin").mkdir()
    path = tmp_path / "bin" / "pytorch_model.bin"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(
            "archive/data.pkl",
            pickle.dumps({"bert.embeddings.word_embeddings.weight": Payload()}, protocol=2),
        )
    with pytest.raises(
        TrainError,
        match=rf"pytorch_model.bin: refused to unpickle global {os.mkdir.__module__}.mkdir \(only tensors",
    ):
        read_torch_pickle(path)
    assert not marker.exists()
    (tmp_path / "bin" / "config.json").write_text(
        json.dumps({"model_type": "bert", **CONFIGS["small_untied_gelu"]})
    )
    with pytest.raises(TrainError, match="refused to unpickle global"):
        load_checkpoint(f"hf:{tmp_path / 'bin'}")


def test_vocabulary_must_fit_the_checkpoint(reference, small_dataset, tmp_path, capsys):
    out, _, _ = reference["geneformer_v1"]
    init = [
        "embed",
        str(small_dataset),
        "--init",
        f"hf:{out / 'safetensors'}",
        "--out",
        str(tmp_path / "e.npy"),
    ]
    nothing = tmp_path / "nothing.json"
    nothing.write_text(json.dumps({"<pad>": 0, "<mask>": 1, "ENSG99999999999": 2}))
    assert main([*init, "--vocab", str(nothing), "--no-special-tokens"]) == 2
    err = capsys.readouterr().err
    assert "shares no gene with" in err and len(err.strip().splitlines()) == 1
    big = tmp_path / "big.json"
    ensembl = oj.open_dataset(small_dataset).features["ensembl_id"].tolist()
    big.write_text(json.dumps({"<pad>": 0, "<mask>": 1, **{e: 30_000 + i for i, e in enumerate(ensembl)}}))
    assert main([*init, "--vocab", str(big), "--no-special-tokens"]) == 2
    assert "past the 25426 embedding rows" in capsys.readouterr().err
    assert main(init) == 2
    assert "needs --vocab FILE" in capsys.readouterr().err
    v1 = reference["geneformer_v1"][2]
    assert main([*init, "--vocab", str(v1)]) == 2  # V1's dictionary has no <cls>/<eos>
    err = capsys.readouterr().err
    assert (
        "names no <cls> token" in err and "--no-special-tokens" in err and len(err.strip().splitlines()) == 1
    )
    assert main([*init, "--vocab", str(v1), "--no-special-tokens", "--max-len", "4096"]) == 2
    assert "--max-len 4096 exceeds the 2048 positions" in capsys.readouterr().err


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))


def test_an_scgpt_checkpoint_trained_with_other_inputs_or_pooling_is_refused(reference, tmp_path):
    """scGPT run arguments this model does not implement (its bins, mask and pad values, input
    style, cell embedding): refused in one line naming the key, not loaded and fed inputs the run
    never saw (a checkpoint trained on 11 bins embedded exactly as one on 51)."""
    out, _, _ = reference["scgpt"]
    ckpt = out / "ckpt"
    args = json.loads((ckpt / "args.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    for name in ("best_model.pt", "vocab.json"):
        (other / name).symlink_to(ckpt / name)
    published = {
        "input_style": "binned",
        "n_bins": 51,
        "mask_value": -1,
        "pad_value": -2,
        "cell_emb_style": "cls",
    }
    (other / "args.json").write_text(json.dumps({**args, **published}))
    load_checkpoint(f"scgpt:{other}")  # scGPT's defaults, written out, load
    for key, value in {"input_style": "log1p", "n_bins": 11, "mask_value": -3, "pad_value": 0,
                       "cell_emb_style": "avg-pool"}.items():  # fmt: skip
        (other / "args.json").write_text(json.dumps({**args, **published, key: value}))
        with pytest.raises(TrainError, match=rf"args.json: {key} is {value!r}; ScGPTModel implements only"):
            load_checkpoint(f"scgpt:{other}")

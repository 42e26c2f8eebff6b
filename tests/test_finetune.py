"""`omicsio-train finetune`: a linear head on a pretrained encoder, trained whole or with the encoder
frozen, scored on held-out cells beside the linear probe, the MLP on log1p expression and the
majority class."""

from __future__ import annotations

import json
import re

import equinox as eqx
import jax
import numpy as np
import pytest

import omicsio_jax as oj
from train import TrainError
from train._cli import main
from train._finetune import finetune
from train._finetune_config import FinetuneConfig
from train._pretrain import load_pretrained

# Cheap on 2 cores: one device, short rows, a tiny encoder pretrained for 4 steps.
OPTIONS = ["--batch-size", "64", "--block-size", "4", "--fetch-factor", "4", "--devices", "1"]


@pytest.fixture(scope="module")
def pretrained(dataset_dir, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("finetune") / "pt"
    argv = ["pretrain", str(dataset_dir), "--tokens", "geneformer", "--max-len", "24", "--preset", "tiny"]
    argv += ["--batch-size", "16", "--block-size", "4", "--fetch-factor", "4", "--warmup-steps", "3"]
    assert main([*argv, "--steps", "4", "--devices", "1", "--checkpoint-dir", str(ckpt), "--quiet"]) == 0
    return ckpt


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    """600 rows drawn at random: every cell line is in both splits, so the majority class is a fair floor
    (a held-out plate lacks the training set's most common line)."""
    path = tmp_path_factory.mktemp("rows") / "held_out.npy"
    np.save(path, np.sort(np.random.default_rng(0).choice(3000, 600, replace=False)))
    return path


def _frozen(dataset_dir, pretrained, held_out, **options) -> FinetuneConfig:
    """A short fine-tuning of the head alone on the cheap settings, scored on the held-out rows."""
    return FinetuneConfig(
        str(dataset_dir),
        str(pretrained),
        "cell_type",
        freeze=True,
        eval_rows=str(held_out),
        batch_size=64,
        block_size=4,
        fetch_factor=4,
        num_devices=1,
        quiet=True,
        **options,
    )


def _leaves(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]


def test_finetuning_beats_the_majority_class_and_the_frozen_probe(
    dataset_dir, pretrained, held_out, tmp_path, capsys
):
    metrics = tmp_path / "finetune.json"
    argv = ["finetune", str(dataset_dir), "--init", str(pretrained), "--label", "cell_type", *OPTIONS]
    argv += ["--eval-rows", str(held_out), "--steps", "60", "--lr", "3e-3", "--encoder-lr", "1e-3"]
    argv += ["--probe-cells", "500", "--seed", "0", "--log-every", "30", "--out-metrics", str(metrics)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "step     60/60" in out
    report = json.loads(metrics.read_text())
    assert report["label"] == "cell_type" and report["steps"] == 60 and report["num_classes"] == 20
    assert report["freeze"] is False and report["pool"] == "mean" and report["probe_fit_cells"] == 500
    scores = report["models"]
    assert set(scores) == {"finetuned", "linear_probe", "mlp_log1p", "majority"}
    # all four are scored on the same 600 held-out cells
    assert {s["num_cells"] for s in scores.values()} == {600}
    # the printed summary holds the same numbers
    for title, name in [
        ("fine-tuned encoder + linear head", "finetuned"),
        ("linear probe on frozen embeddings", "linear_probe"),
        ("MLP on log1p expression", "mlp_log1p"),
        ("majority class", "majority"),
    ]:
        row = next(line for line in out.splitlines() if line.strip().startswith(title))
        assert row.split()[-2:] == [f"{scores[name]['accuracy']:.4f}", f"{scores[name]['macro_f1']:.4f}"]
    # Seeds 0, 1, 2 give 0.255, 0.223, 0.178 fine-tuned vs 0.042 majority and 0.072, 0.083, 0.073 probe:
    # adapting the 4-step encoder learns the cell lines its frozen embedding barely separates.
    fine = scores["finetuned"]
    assert fine["accuracy"] >= scores["majority"]["accuracy"] + 0.1
    assert fine["accuracy"] >= scores["linear_probe"]["accuracy"] + 0.08
    assert fine["macro_f1"] >= scores["linear_probe"]["macro_f1"] + 0.08
    assert scores["mlp_log1p"]["accuracy"] >= scores["majority"]["accuracy"] + 0.1


def test_freeze_trains_the_head_and_leaves_every_encoder_leaf_bit_identical(
    dataset_dir, pretrained, held_out
):
    loaded, _, _ = load_pretrained(pretrained)
    result = finetune(_frozen(dataset_dir, pretrained, held_out, steps=8, probe_cells=200, lr=3e-3))
    before, after = _leaves(loaded), _leaves(result.model.encoder)
    assert len(before) == len(after) > 0
    for a, b in zip(before, after, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    assert result.history[-1]["loss"] < result.history[0]["loss"]  # the head did learn
    assert result.to_dict()["freeze"] is True and "frozen encoder" in result.summary()


def test_the_finetuned_model_and_the_probe_see_the_same_held_out_tokens(
    dataset_dir, held_out, tmp_path, monkeypatch
):
    """Token batches may draw (scGPT samples and spreads ties by seed): the held-out cells are tokenized
    with one seed, the encoder's pretraining run's, for the fine-tuned model's score and for the
    linear probe's embeddings."""
    pretrained = tmp_path / "pt"
    argv = ["pretrain", str(dataset_dir), "--tokens", "geneformer", "--max-len", "24", "--preset", "tiny"]
    argv += ["--batch-size", "16", "--block-size", "4", "--fetch-factor", "4", "--steps", "1", "--seed", "3"]
    assert main([*argv, "--devices", "1", "--checkpoint-dir", str(pretrained), "--quiet"]) == 0
    held = np.load(held_out)
    seeds: list[int] = []
    make = oj.make_loader

    def recording(ds, **kw):
        rows, kind = kw.get("rows"), getattr(kw.get("output"), "kind", None)
        if kind in ("geneformer", "scgpt") and rows is not None and np.isin(rows, held).all():
            seeds.append(kw.get("seed", 0))
        return make(ds, **kw)

    monkeypatch.setattr(oj, "make_loader", recording)
    finetune(_frozen(dataset_dir, pretrained, held_out, steps=2, seed=5, probe_cells=100))  # seed: not 3
    assert seeds == [3, 3]  # the fine-tuned model's eval, then the probe's embeddings


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"label": "disease"}, r"--label 'disease' must be a categorical obs column .*\(missing\)"),
        (
            {"label": "organism"},
            r"--label 'organism' has 1 class\(es\) .*\(Homo sapiens\): nothing to classify",
        ),
        ({"init": "{tmp}/nope"}, r"--init .*/nope: not hf:DIR \(Geneformer\), scgpt:DIR or a directory"),
        ({"init": "hf:{tmp}/nope"}, r"--init hf:.*/nope: .*/nope is not a directory"),
        ({"init": "{tmp}"}, r"holds no pretraining checkpoint"),
        (
            {"freeze": True, "encoder_lr": 1e-4},
            r"--encoder-lr 0.0001 trains the encoder, but --freeze leaves",
        ),
        ({"eval_rows": None}, r"give the held-out cells with --eval-where"),
        ({"pool": "cls", "lr": 0.0}, r"--lr must be positive, got 0.0"),
    ],
)
def test_bad_inputs_are_one_line_errors(dataset_dir, pretrained, held_out, tmp_path, capsys, change, match):
    base = {"label": "cell_type", "init": str(pretrained), "eval_rows": str(held_out), "num_devices": 1}
    options = {**base, **{k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in change.items()}}
    config = FinetuneConfig(str(dataset_dir), options.pop("init"), options.pop("label"), **options)
    with pytest.raises(TrainError, match=match):
        finetune(config)
    argv = ["finetune", str(dataset_dir), "--init", config.init, "--label", config.label]
    argv += ["--eval-rows", str(held_out), "--devices", "1"]
    if config.freeze:
        argv.append("--freeze")
    for name in ("encoder_lr", "lr", "pool"):
        if name in change:
            argv += [f"--{name.replace('_', '-')}", str(change[name])]
    if config.eval_rows is None:
        return  # the command line requires --eval-where or --eval-rows (argparse's usage error)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("omicsio-train: error: ")
    assert re.search(match, err)

"""Does pretraining learn? Learning curves of the ``tiny`` preset, both tokenizers, on the synthetic corpus.

For each tokenizer, one ``omicsio-train pretrain`` run (`train.pretrain`) on a synthetic corpus of 20k
cells × 2,000 genes (~150 expressed per cell, 20 cell types whose expression programs differ:
``make_synthetic_corpus``'s default), checkpointed every ``--every`` steps. Each checkpoint, and the
random initialization (step 0), is then scored on held-out cells:

- the masked-token prediction (`train.masked_prediction`): Geneformer's top-1 accuracy of the masked
  genes, scGPT's share of masked values predicted to the right bin, each beside its frequency
  baseline (always the most frequent gene / bin);
- the linear probe of ``cell_type`` on frozen cell embeddings (`train.probe_pretraining`: 1,000
  cells fit it, 1,000 others score it; Geneformer mean-pooled, scGPT CLS, the commands' defaults).

The same probe on log1p of the cells' raw counts says how visible the label is in the cells
themselves. Then each final checkpoint is fine-tuned on ``cell_type`` (``omicsio-train finetune``,
``--finetune-steps`` steps, whole network) and scored on the held-out last plate beside the linear
probe, the MLP on log1p expression and the majority class (accuracy and macro-F1). The training time (``train_seconds``: `pretrain` alone, scoring excluded) is the CPU
budget the curve was bought with; one run per tokenizer, so it is not a median of rounds. Writes
``results/pretrain_learning.json`` and the plot ``results/pretrain_learning.png``.

    .venv/bin/python benchmarks/bench_pretrain.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
DATA = HERE / "data"
sys.path.insert(0, str(HERE))
from _provenance import provenance, write_result  # noqa: E402


def _curve(args, dataset: Path, tokens: str, work: Path) -> dict:
    import jax
    import numpy as np

    import omicsio_jax as oj
    from train import (
        Checkpoint,
        FinetuneConfig,
        PretrainConfig,
        build_model,
        embed,
        finetune,
        list_checkpoints,
        logistic_probe,
        masked_prediction,
        pretrain,
        pretrain_optimizer,
        probe_pretraining,
        probe_split,
    )

    config = PretrainConfig(
        str(dataset),
        tokens=tokens,
        max_len=args.max_len,
        batch_size=args.batch_size,
        steps=args.steps,
        warmup_steps=args.steps // 10,
        lr=args.lr,
        block_size=16,
        fetch_factor=16,
        probe_label="cell_type",
        probe_cells=args.probe_cells,
        checkpoint_dir=str(work / tokens),
        checkpoint_every=args.every,
        keep=args.steps // args.every + 1,
        quiet=True,
    )
    training = dataclasses.replace(config, probe_label=None)  # scored below, per checkpoint
    start = time.perf_counter()
    result = pretrain(training)
    train_seconds = time.perf_counter() - start
    ds = oj.open_dataset(dataset)
    codes, rows, fit, test = probe_split(config, ds)
    init = build_model(config, result.vocab_size, jax.random.split(jax.random.key(config.seed))[0])
    like = (init, pretrain_optimizer(config, args.steps).init(eqx_arrays(init)))
    models = [(0, init)] + [
        (step, Checkpoint(path, step, {}).load(like)[0]) for step, path in list_checkpoints(work / tokens)
    ]
    points = []
    for step, model in models:
        probe = probe_pretraining(config, ds, {"model": model})["accuracy"]["model"]
        masked = masked_prediction(model, ds, config, rows[test])
        point = {"step": step, "probe": probe, "masked": masked}
        if tokens == "scgpt":  # scGPT's cell embedding is CLS; the mean over its genes for comparison
            emb = embed(model, ds, config, rows, pool="mean")
            point["probe_mean_pool"] = logistic_probe(
                emb[fit], codes[rows[fit]], emb[test], codes[rows[test]]
            )
        points.append(point)
        print(
            f"{tokens} step {step:>5}: probe {probe:.3f}  masked {masked['accuracy']:.4f} "
            f"(baseline {masked['baseline']:.4f})",
            flush=True,
        )
    tuned = finetune(
        FinetuneConfig(
            str(dataset),
            str(work / tokens),
            "cell_type",
            steps=args.finetune_steps,
            batch_size=args.batch_size,
            block_size=16,
            fetch_factor=16,
            eval_where=f"batch = '{args.held_out_plate}'",
            probe_cells=args.probe_cells // 2,
            quiet=True,
        )
    )
    print(tuned.summary(), flush=True)
    losses = np.array([r["loss"] for r in result.history])
    window = max(1, args.steps // 50)
    return {
        "tokens": tokens,
        "train_seconds": train_seconds,
        "median_step_s": result.step_time_s,
        "data_wait_fraction": result.data_wait_fraction,
        "loss": {
            "window_steps": window,
            "step": [int(s) for s in range(window, len(losses) + 1, window)],
            "mean": [float(losses[i - window : i].mean()) for i in range(window, len(losses) + 1, window)],
        },
        "points": points,
        "random_init": points[0],
        "pretrained": points[-1],
        "probe_gain_points": 100 * (points[-1]["probe"] - points[0]["probe"]),
        "probe_cells": {"fit": len(fit), "test": len(test)},
        "chance": 1 / len(np.unique(codes[rows])),
        "finetune": tuned.to_dict(),
    }


def eqx_arrays(model):
    import equinox as eqx

    return eqx.filter(model, eqx.is_array)


def _log1p_probe(dataset: Path, args) -> float:
    import numpy as np

    import omicsio_jax as oj
    from train import PretrainConfig, logistic_probe, probe_split

    ds = oj.open_dataset(dataset)
    config = PretrainConfig(str(dataset), probe_label="cell_type", probe_cells=args.probe_cells)
    codes, rows, fit, test = probe_split(config, ds)
    indptr, indices, values = ds.read_csr(rows)
    x = np.zeros((len(rows), ds.num_genes), np.float32)
    x[np.repeat(np.arange(len(rows)), np.diff(indptr)), indices] = np.log1p(values)
    return logistic_probe(x[fit], codes[rows[fit]], x[test], codes[rows[test]])


def _plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = out["runs"]
    fig, axes = plt.subplots(len(runs), 3, figsize=(13, 3.6 * len(runs)), squeeze=False)
    for row, run in zip(axes, runs, strict=True):
        name, steps = run["tokens"], [p["step"] for p in run["points"]]
        row[0].plot(run["loss"]["step"], run["loss"]["mean"])
        row[0].set(
            title=f"{name}: training loss",
            xlabel="step",
            ylabel="MLM loss" if name == "geneformer" else "GEP + GEPC (masked MSE)",
        )
        row[1].plot(steps, [p["masked"]["accuracy"] for p in run["points"]], "o-", label="model")
        row[1].axhline(
            run["points"][0]["masked"]["baseline"], color="gray", ls="--", label="frequency baseline"
        )
        row[1].set(title=f"{name}: masked-token accuracy (held-out cells)", xlabel="step")
        row[2].plot(
            steps, [p["probe"] for p in run["points"]], "o-", label="pretrained (step 0: random init)"
        )
        if "probe_mean_pool" in run["points"][0]:
            row[2].plot(steps, [p["probe_mean_pool"] for p in run["points"]], "s-", label="mean-pooled")
        row[2].axhline(run["points"][0]["probe"], color="gray", ls="--", label="random init")
        row[2].axhline(out["probe_log1p_expression"], color="green", ls=":", label="log1p expression")
        row[2].axhline(run["chance"], color="red", ls=":", label="chance")
        row[2].set(title=f"{name}: linear probe of cell_type", xlabel="step", ylim=(0, 1.02))
        for ax in row[1:]:
            ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"tiny preset, synthetic corpus; {out['date']}, commit {out['commit'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", nargs="+", default=["geneformer", "scgpt"], choices=("geneformer", "scgpt"))
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--every", type=int, default=500, help="checkpoint (and score) every this many steps")
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--probe-cells", type=int, default=2000)
    p.add_argument("--finetune-steps", type=int, default=300)
    p.add_argument(
        "--held-out-plate", default="plate_09", help="fine-tuning's held-out cells (the last plate)"
    )
    p.add_argument("--out", default=str(HERE / "results" / "pretrain_learning.json"))
    args = p.parse_args()

    from materialize import make_synthetic_corpus, materialize

    corpus, dataset = DATA / "corpus_programs", DATA / "ds_programs"
    if not (dataset / "manifest.json").exists():
        c = make_synthetic_corpus(
            corpus, num_cells=20_000, num_genes=2000, mean_nnz=150, seed=7, write_h5ad=False
        )
        materialize(c.cells_parquet, dataset, overwrite=True, progress=False)
    with tempfile.TemporaryDirectory() as work:
        runs = [_curve(args, dataset, tokens, Path(work)) for tokens in args.tokens]
    out = {
        "benchmark": "bench_pretrain",
        **provenance(),
        "rounds": 1,
        "preset": "tiny",
        "corpus": {"cells": 20_000, "genes": 2000, "mean_nnz": 150, "seed": 7, "cell_types": 20},
        "steps": args.steps,
        "max_len": args.max_len,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "probe_log1p_expression": _log1p_probe(dataset, args),
        "runs": runs,
    }
    print(json.dumps({r["tokens"]: {k: r[k] for k in ("train_seconds", "probe_gain_points")} for r in runs}))
    path = Path(args.out)
    write_result(path, out)
    _plot(out, path.with_suffix(".png"))


if __name__ == "__main__":
    main()

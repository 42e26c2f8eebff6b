"""Does a short pretraining learn anything a linear probe can read? Pretrained vs random-init CLS embeddings.

Pretrains the ``tiny`` preset on the synthetic corpus (``make_synthetic_corpus``: 20k cells,
2,000 genes, ~150 expressed per cell, 20 cell lines with marker genes) with
``omicsio-train pretrain --probe-label cell_type``, then reports the linear-probe accuracy of the
trained model and of the same architecture at its random initialization (CLS, as the command does,
and mean-pooled embeddings for comparison), with the run's step time and data wait. One training run
per invocation: the step time is a side figure of that run (its whole length, ``seconds``), not a
median of rounds.

    .venv/bin/python benchmarks/bench_pretrain.py --tokens geneformer --steps 1500
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
DATA = HERE / "data"
sys.path.insert(0, str(HERE))
from _provenance import provenance, write_result  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="geneformer", choices=("geneformer", "scgpt"))
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--probe-cells", type=int, default=4000)
    p.add_argument(
        "--marker-fraction",
        type=float,
        nargs=3,
        default=None,
        metavar=("DRUG", "CELL_TYPE", "PLATE"),
        help="the corpus's share of draws from marker sets (make_synthetic_corpus; default its default)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import equinox as eqx
    import jax
    import numpy as np

    import omicsio_jax as oj
    from materialize import make_synthetic_corpus, materialize
    from materialize._synthetic import MARKER_FRACTION
    from train._pretrain import PretrainConfig, build_model, logistic_probe, pretrain

    fraction = tuple(args.marker_fraction or MARKER_FRACTION)
    suffix = "" if fraction == MARKER_FRACTION else "_" + "_".join(f"{f:g}" for f in fraction)
    corpus, dataset = DATA / f"corpus_probe{suffix}", DATA / f"ds_probe{suffix}"
    if not (dataset / "manifest.json").exists():
        c = make_synthetic_corpus(
            corpus,
            num_cells=20_000,
            num_genes=2000,
            mean_nnz=150,
            seed=7,
            write_h5ad=False,
            marker_fraction=fraction,
        )
        materialize(c.cells_parquet, dataset, overwrite=True, progress=False)
    config = PretrainConfig(
        str(dataset),
        tokens=args.tokens,
        max_len=args.max_len,
        batch_size=args.batch_size,
        steps=args.steps,
        warmup_steps=args.steps // 10,
        lr=args.lr,
        block_size=16,
        fetch_factor=16,
        probe_label="cell_type",
        probe_cells=args.probe_cells,
        quiet=True,
    )
    start = time.perf_counter()
    result = pretrain(config)
    seconds = time.perf_counter() - start
    ds = oj.open_dataset(dataset)
    models = {
        "pretrained": result.model,
        "random_init": build_model(
            config, result.vocab_size, jax.random.split(jax.random.key(config.seed))[0]
        ),
    }
    codes = np.asarray(ds.obs["cell_type"].codes)
    rng = np.random.default_rng([config.seed, 0x9B0BE])  # the cells and split the command's probe uses
    rows = np.sort(rng.choice(np.flatnonzero(codes >= 0), size=args.probe_cells, replace=False))
    split = rng.permutation(len(rows))
    fit, test = split[: len(rows) // 2], split[len(rows) // 2 :]
    mean_pool = {}
    for name, model in models.items():
        loader = oj.make_loader(
            ds,
            batch_size=256,
            sampling=oj.Stream(drop_remainder=False),
            output=config.output(masked=False),
            rows=rows,
            num_epochs=1,
        )
        inference = eqx.nn.inference_mode(model)
        chunks, index = [], []
        for batch in loader:
            keep = np.asarray(batch.mask)
            chunks.append(np.asarray(inference.embed(batch.x, pool="mean"))[keep])
            index.append(np.asarray(batch.index)[keep])
        emb = np.concatenate(chunks)[np.argsort(np.concatenate(index))]
        mean_pool[name] = logistic_probe(emb[fit], codes[rows[fit]], emb[test], codes[rows[test]])
    # how visible the label is in the cells themselves: the same probe on log1p of their raw counts
    indptr, indices, values = ds.read_csr(rows)
    expression = np.zeros((len(rows), ds.num_genes), np.float32)
    expression[np.repeat(np.arange(len(rows)), np.diff(indptr)), indices] = np.log1p(values)
    raw_probe = logistic_probe(expression[fit], codes[rows[fit]], expression[test], codes[rows[test]])
    out = {
        "benchmark": "bench_pretrain",
        **provenance(),
        "rounds": 1,
        "tokens": args.tokens,
        "steps": args.steps,
        "max_len": args.max_len,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "marker_fraction": fraction,
        "seconds": seconds,
        "first_loss": result.history[0]["loss"],
        "last_loss": result.history[-1]["loss"],
        "median_step_s": result.step_time_s,
        "data_wait_fraction": result.data_wait_fraction,
        "probe_cls": result.probe["accuracy"],
        "probe_mean_pool": mean_pool,
        "probe_log1p_expression": raw_probe,
        "probe_cells": {"fit": len(fit), "test": len(test)},
        "chance": 1 / len(np.unique(codes[rows])),
    }
    print(json.dumps(out, indent=1, default=str))
    write_result(args.out or HERE / "results" / f"pretrain_probe_{args.tokens}{suffix}.json", out)


if __name__ == "__main__":
    main()

"""Does the sampling strategy change what a classifier learns? (the scDataset paper's science check)

Part 1 — synthetic plate-structured corpus (`benchmarks/data/ds_200k`, 200k cells × 62,710 genes,
14 contiguous plates; `drug` and `cell_type` are plate-specific subsets on every plate but the last,
which holds every label). One epoch of the same MLP (`train`'s default hidden size), same seed, same
optimizer, on every plate but `plate_13`, evaluated on `plate_13`, once per sampling strategy:

    stream         file order                                   fetch_factor 1
    stream_buffer  file order, shuffled within each fetch       fetch_factor 256 (× batch)
    block          shuffled blocks of 16 cells                  fetch_factor 256
    random         true random: block_size 1                    fetch_factor 1

Reported per strategy: held-out accuracy and macro-F1, training cells/s, the share of step time spent
waiting for data, and the mean label entropy of the training minibatches (computed from the loader's
public `SamplingPlan`, no data read).

Part 2 — real data: scanpy's `pbmc68k_reduced` (700 cells × 765 genes, label `bulk_labels`),
materialized from its `.raw` (log-normalized, non-negative; `.X` is scaled with negatives, which the
training loop's fused `normalize_log1p` cannot take), a deterministic stratified 30% held out
(`TrainConfig.eval_rows`), the linear and MLP models trained for a few epochs and compared with
scikit-learn's LogisticRegression and NearestCentroid on the same split and the same features (the
loader's `normalize_log1p` output, recomputed in numpy and checked against the loader).

    scripts/setup-bench.sh        # installs the bench extra (scanpy, scikit-learn, ...)
    .venv/bin/python benchmarks/bench_train.py                     # both parts
    .venv/bin/python benchmarks/bench_train.py --estimate-steps 20 # time a few steps per strategy, exit

Results go to `benchmarks/results/train.json` and `benchmarks/results/train.md`. Each strategy is one
training run (an epoch: far longer than a timing window); its cells/s is a side figure of that run,
not a median of rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent
DATA = HERE / "data"
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
from _provenance import provenance, write_result  # noqa: E402

# name -> (sampling, block_size, fetch_factor); a None entry means "--block-size / --fetch-factor".
STRATEGIES = {
    "stream": ("stream", 16, 1),
    "stream_buffer": ("stream_buffer", 16, None),
    "block": ("block", None, None),
    "random": ("block", 1, 1),
}
STRATEGY_NOTES = {
    "stream": "file order",
    "stream_buffer": "file order + shuffle buffer of fetch_factor × batch cells",
    "block": "shuffled blocks, fetched fetch_factor × batch at a time",
    "random": "true random (block 1, fetch 1)",
}


def _setup_devices(num_devices: int) -> None:
    """Before jax is imported: ask XLA for ``num_devices`` CPU devices when more than one."""
    if num_devices > 1:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={num_devices}".strip()


# ----- part 1: sampling strategies on the synthetic corpus -----------------------------------------------


def strategy_settings(name: str, args: argparse.Namespace) -> tuple[str, int, int]:
    sampling, block, fetch = STRATEGIES[name]
    return (
        sampling,
        args.block_size if block is None else block,
        args.fetch_factor if fetch is None else fetch,
    )


def batch_label_entropy(
    labels, rows, *, batch_size: int, block_size: int, fetch_factor: int, seed: int, sampling: str
) -> dict:
    """Label entropy (bits) of every training minibatch of epoch 0, from the loader's `SamplingPlan`.

    Mirrors how the loader serves a fetch: ``fetch.rows`` permuted by
    ``default_rng(list(fetch.shuffle_key))`` (kept in order when the key is None), cut into
    ``num_batches`` minibatches. No cell data is read.
    """
    import numpy as np

    import omicsio_jax as oj

    plan = oj.SamplingPlan(
        np.unique(np.asarray(rows, np.int64)), batch_size, block_size, fetch_factor, seed, sampling
    )
    order = plan.epoch_order(0)
    batches = []
    for j in range(plan.fetches_per_epoch):
        fetch = plan.fetch(0, j, 0, order=order)
        served = (
            fetch.rows
            if fetch.shuffle_key is None
            else fetch.rows[np.random.default_rng(list(fetch.shuffle_key)).permutation(len(fetch.rows))]
        )
        b = plan.local_batch
        batches.extend(labels[served[k * b : (k + 1) * b]] for k in range(fetch.num_batches))
    h = oj.minibatch_entropy(batches)
    distinct = np.array([len(np.unique(x)) for x in batches])
    counts = np.bincount(labels[np.asarray(rows)])
    p = counts[counts > 0] / counts.sum()
    return {
        "mean_bits": float(h.mean()),
        "min_bits": float(h.min()),
        "population_bits": float(-(p * np.log2(p)).sum()),
        "mean_distinct_labels": float(distinct.mean()),
        "num_batches": len(batches),
    }


def run_strategy(
    args: argparse.Namespace, dataset: str, label: str, name: str, *, steps: int | None = None
) -> dict:
    """One `fit` of the MLP with strategy ``name``; returns its metrics."""
    from train import TrainConfig, fit

    sampling, block, fetch = strategy_settings(name, args)
    config = TrainConfig(
        dataset=str(dataset),
        label=label,
        model="mlp",
        hidden=args.hidden,
        lr=args.lr,
        batch_size=args.batch_size,
        block_size=block,
        fetch_factor=fetch,
        sampling=sampling,
        epochs=1,
        steps=steps,
        seed=args.seed,
        eval_where=None if steps else f"batch = '{args.eval_plate}'",
        eval_rows=None,
        eval_batch_size=args.eval_batch_size,
        num_devices=args.devices,
        num_threads=args.num_threads,
        prefetch=args.prefetch,
        quiet=True,
    )
    stamps: list[float] = []
    start = time.perf_counter()
    result = fit(config, callback=lambda record: stamps.append(time.perf_counter()))
    wall = time.perf_counter() - start
    # Throughput over the whole run after the first (compiling) step: every wait and stall included.
    run_cells_per_s = (
        (len(stamps) - 1) * args.batch_size / (stamps[-1] - stamps[0]) if len(stamps) > 1 else None
    )
    losses = [r["loss"] for r in result.history]
    tail = losses[-min(50, len(losses)) :]
    out = {
        "label": label,
        "strategy": name,
        "sampling": sampling,
        "block_size": block,
        "fetch_factor": fetch,
        "steps": result.num_steps,
        "train_cells": result.num_steps * args.batch_size,
        "median_step_s": result.step_time_s,
        "cells_per_s_median_step": args.batch_size / result.step_time_s,
        "cells_per_s": run_cells_per_s,
        "data_wait_fraction": result.data_wait_fraction,
        "first_step_s": stamps[0] - start if stamps else None,
        "train_s": stamps[-1] - start if stamps else None,
        "wall_s": wall,
        "final_loss_mean50": float(sum(tail) / len(tail)) if tail else None,
    }
    if result.eval is not None:
        out.update(
            accuracy=result.eval.accuracy, macro_f1=result.eval.macro_f1, eval_cells=result.eval.num_cells
        )
    return out


def low_signal_corpus(args: argparse.Namespace) -> Path:
    """The same plates and labels with ``--low-signal-nnz`` expressed genes per cell (default corpus:
    1,500), i.e. ~3% of that many marker draws per label instead of ~45: a task that does not saturate.
    Generated (parquet only) and materialized into ``benchmarks/data/`` on first use."""
    from materialize import InputOptions, make_synthetic_corpus, materialize

    m = args.low_signal_nnz
    ds_dir = DATA / f"ds_200k_nnz{m}"
    if (ds_dir / "manifest.json").exists():
        return ds_dir
    corpus_dir = DATA / f"corpus_200k_nnz{m}"
    print(f"generating {corpus_dir} (mean_nnz {m}) and materializing {ds_dir} ...", flush=True)
    corpus = make_synthetic_corpus(corpus_dir, num_cells=200_000, seed=0, mean_nnz=float(m), write_h5ad=False)
    materialize(
        corpus.cells_parquet,
        ds_dir,
        read=InputOptions(genes=corpus.genes_parquet),
        obs=["cell_type", "drug", "batch"],
        overwrite=True,
        progress=False,
    )
    return ds_dir


def synthetic_part(args: argparse.Namespace, dataset: str | Path, corpus: str) -> dict:
    import omicsio_jax as oj

    ds = oj.open_dataset(dataset)
    plates = ds.obs["batch"]
    train_rows = ds.rows_where("batch", [args.eval_plate], invert=True)
    info = {
        "corpus": corpus,
        "dataset": str(dataset),
        "num_cells": ds.num_cells,
        "mean_nnz": ds.manifest.nnz / ds.num_cells,
        "num_genes": ds.num_genes,
        "eval_plate": args.eval_plate,
        "train_cells": len(train_rows),
        "eval_cells": ds.num_cells - len(train_rows),
        "num_plates": len(plates.categories),
    }
    runs = []
    for label in args.labels:
        labels = ds.obs[label].codes
        info[f"num_classes_{label}"] = len(ds.obs[label].categories)
        for name in args.strategies:
            sampling, block, fetch = strategy_settings(name, args)
            ent = batch_label_entropy(
                labels,
                train_rows,
                batch_size=args.batch_size,
                block_size=block,
                fetch_factor=fetch,
                seed=args.seed,
                sampling=sampling,
            )
            print(f"[{corpus} / {label} / {name}] training ...", flush=True)
            row = run_strategy(args, dataset, label, name)
            row["corpus"], row["batch_entropy"] = corpus, ent
            runs.append(row)
            print(
                f"[{corpus} / {label} / {name}] acc {row['accuracy']:.4f}  macro-F1 {row['macro_f1']:.4f}  "
                f"{row['cells_per_s']:,.0f} cells/s  data wait {100 * row['data_wait_fraction']:.1f}%  "
                f"batch entropy {ent['mean_bits']:.2f} bits  ({row['wall_s']:.0f} s)",
                flush=True,
            )
            with open(args.partial, "a") as f:  # survives an interrupted run
                f.write(json.dumps(row) + "\n")
    return {"setup": info, "runs": runs}


def estimate(args: argparse.Namespace) -> None:
    """Time ``--estimate-steps`` steps of each strategy (no evaluation) and project one epoch."""
    import omicsio_jax as oj

    ds = oj.open_dataset(args.dataset)
    train_cells = len(ds.rows_where("batch", [args.eval_plate], invert=True))
    per_epoch = train_cells // args.batch_size
    for name in args.strategies:
        row = run_strategy(args, args.dataset, args.labels[0], name, steps=args.estimate_steps)
        print(
            f"{name:>14}: first step {row['first_step_s']:.1f} s, median step {1e3 * row['median_step_s']:.0f} ms "
            f"({row['cells_per_s_median_step']:,.0f} cells/s), data wait {100 * row['data_wait_fraction']:.0f}% "
            f"→ ~{per_epoch * row['median_step_s'] / 60:.1f} min/epoch ({per_epoch} steps)",
            flush=True,
        )


# ----- part 2: pbmc68k_reduced against scikit-learn ---------------------------------------------------------


def pbmc_h5ad() -> Path:
    import scanpy

    path = Path(scanpy.__file__).parent / "datasets" / "10x_pbmc68k_reduced.h5ad"
    if not path.exists():
        msg = f"{path} not found: the scanpy wheel ships it; reinstall scanpy"
        raise SystemExit(msg)
    return path


def normalize_log1p_np(x, target_sum: float = 1e4):
    """numpy twin of `train.normalize_log1p` (and of the loader's fused ``normalize_log1p``)."""
    import numpy as np

    total = x.sum(axis=1, keepdims=True)
    return np.log1p(x / np.where(total > 0, total, 1.0) * target_sum).astype(np.float32)


def pbmc_part(args: argparse.Namespace, workdir: Path) -> dict:
    import anndata
    import numpy as np
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import f1_score
    from sklearn.model_selection import train_test_split
    from sklearn.neighbors import NearestCentroid

    import omicsio_jax as oj
    from materialize import InputOptions, materialize
    from train import TrainConfig, accuracy, fit, macro_f1

    src = pbmc_h5ad()
    with warnings.catch_warnings():  # FutureWarnings about the legacy layout
        warnings.simplefilter("ignore", FutureWarning)
        adata = anndata.read_h5ad(src)
    raw = adata.raw.X
    raw_dense = raw.toarray() if hasattr(raw, "toarray") else np.asarray(raw)
    source_info = {
        "h5ad": str(src),
        "cells": adata.n_obs,
        "genes": adata.n_vars,
        "X_min": float(adata.X.min()),
        "X_max": float(adata.X.max()),
        "raw_min": float(raw_dense.min()),
        "raw_max": float(raw_dense.max()),
        "raw_is_integer": bool(np.allclose(raw_dense, np.round(raw_dense))),
        "matrix_used": "raw (use_raw=True): log-normalized, non-negative, not counts",
    }
    # The shipped file is in AnnData's legacy (pre-0.7) layout (obs as a structured array, `raw.X`),
    # which materialize's h5ad reader does not parse: rewrite it in the current layout first.
    modern = workdir / "pbmc68k_reduced.h5ad"
    adata.write_h5ad(modern)
    source_info["rewritten_as"] = f"anndata {version('anndata')} write_h5ad (legacy layout → current)"
    del adata, raw, raw_dense
    out = workdir / "pbmc68k_reduced"
    t0 = time.perf_counter()
    materialize(modern, out, read=InputOptions(use_raw=True), obs=["bulk_labels"], progress=False)
    source_info["materialize_s"] = time.perf_counter() - t0

    ds = oj.open_dataset(out)
    labels = ds.obs["bulk_labels"]
    codes = np.asarray(labels.codes)
    rows = np.arange(ds.num_cells)
    train_rows, test_rows = train_test_split(
        rows, test_size=args.pbmc_test_size, stratify=codes, random_state=args.seed
    )
    train_rows, test_rows = np.sort(train_rows), np.sort(test_rows)
    eval_path = workdir / "pbmc_eval_rows.npy"
    np.save(eval_path, test_rows.astype(np.int64))

    # The features the training loop sees: the loader's fused normalize_log1p of the stored matrix.
    indptr, indices, values = ds.read_csr(rows)
    x = np.zeros((ds.num_cells, ds.num_genes), np.float32)
    x[np.repeat(rows, np.diff(indptr)), indices] = values
    feats = normalize_log1p_np(x)
    check = oj.make_loader(
        ds,
        batch_size=len(test_rows),
        sampling=oj.Stream(fetch_factor=1, drop_remainder=False),
        output=oj.Dense(normalize="normalize_log1p"),
        rows=test_rows,
        num_epochs=1,
    )
    try:
        batch = next(iter(check))
        got_rows = np.asarray(batch.index)[np.asarray(batch.mask)]
        max_diff = float(np.abs(np.asarray(batch.x)[np.asarray(batch.mask)] - feats[got_rows]).max())
    finally:
        check.close()
    if max_diff > 1e-4:
        msg = f"numpy features differ from the loader's normalize_log1p by {max_diff}"
        raise SystemExit(msg)
    split = {
        "train_cells": len(train_rows),
        "test_cells": len(test_rows),
        "test_fraction": args.pbmc_test_size,
        "stratified_by": "bulk_labels",
        "split_seed": args.seed,
        "num_classes": len(labels.categories),
        "test_class_counts": dict(
            zip(
                labels.categories,
                np.bincount(codes[test_rows], minlength=len(labels.categories)).tolist(),
                strict=True,
            )
        ),
        "features": "log1p(x / x.sum(1) * 1e4) of raw (as the loader's normalize_log1p)",
        "loader_vs_numpy_max_abs_diff": max_diff,
    }

    y_tr, y_te = codes[train_rows], codes[test_rows]
    rows_out = []
    majority = np.bincount(y_tr).argmax()
    pred = np.full_like(y_te, majority)
    rows_out.append(
        {
            "method": "majority class",
            "kind": "baseline",
            "epochs": None,
            "accuracy": accuracy(y_te, pred),
            "macro_f1": macro_f1(y_te, pred),
            "fit_s": 0.0,
        }
    )
    for name, clf in (
        ("sklearn LogisticRegression", LogisticRegression(max_iter=5000, random_state=args.seed)),
        ("sklearn NearestCentroid", NearestCentroid()),
    ):
        t = time.perf_counter()
        clf.fit(feats[train_rows], y_tr)
        pred = clf.predict(feats[test_rows])
        fit_s = time.perf_counter() - t
        f1_sklearn = float(f1_score(y_te, pred, average="macro"))
        rows_out.append(
            {
                "method": name,
                "kind": "sklearn",
                "epochs": None,
                "accuracy": accuracy(y_te, pred),
                "macro_f1": macro_f1(y_te, pred),
                "macro_f1_sklearn": f1_sklearn,
                "fit_s": fit_s,
                "params": {k: v for k, v in clf.get_params().items() if isinstance(v, (int, float, str))},
            }
        )
        print(
            f"[pbmc] {name}: acc {rows_out[-1]['accuracy']:.4f}  macro-F1 {rows_out[-1]['macro_f1']:.4f}",
            flush=True,
        )
    for model in ("linear", "mlp"):
        for epochs in args.pbmc_epochs:
            config = TrainConfig(
                dataset=str(out),
                label="bulk_labels",
                model=model,
                **({"hidden": args.hidden} if model == "mlp" else {}),  # a linear model has no hidden layer
                lr=args.lr,
                batch_size=args.pbmc_batch_size,
                block_size=1,
                fetch_factor=1,
                sampling="block",
                epochs=epochs,
                seed=args.seed,
                eval_rows=str(eval_path),
                num_devices=args.devices,
                quiet=True,
            )
            t = time.perf_counter()
            result = fit(config)
            fit_s = time.perf_counter() - t
            rows_out.append(
                {
                    "method": f"train {model}",
                    "kind": "train",
                    "epochs": epochs,
                    "steps": result.num_steps,
                    "accuracy": result.eval.accuracy,
                    "macro_f1": result.eval.macro_f1,
                    "eval_cells": result.eval.num_cells,
                    "fit_s": fit_s,
                    "final_loss": result.history[-1]["loss"],
                }
            )
            print(
                f"[pbmc] train {model} {epochs} epochs: acc {result.eval.accuracy:.4f}  "
                f"macro-F1 {result.eval.macro_f1:.4f}  ({fit_s:.0f} s)",
                flush=True,
            )
    return {
        "source": source_info,
        "split": split,
        "train_config": {
            "batch_size": args.pbmc_batch_size,
            "lr": args.lr,
            "hidden": args.hidden,
            "sampling": "true random (block 1, fetch 1)",
            "optimizer": "adam",
        },
        "rows": rows_out,
    }


# ----- report ---------------------------------------------------------------------------------------------


def _fmt(v, spec: str, missing: str = "–") -> str:
    return missing if v is None else format(v, spec)


def _machine(m: dict | str) -> str:
    if isinstance(m, str):
        return m
    return f"{m['cpu']}, {m['usable_cores']} of {m['cores']} cores, {m['gpu'] or 'no GPU'}"


def markdown(result: dict) -> str:
    lines = [
        "# Training benchmark (`bench_train.py`)",
        "",
        f"Command: `{result['command']}`  ",
        f"Commit: `{result['commit']}`, {result['date']}  ",
        f"Machine: {_machine(result['machine'])}; JAX {result['versions']['jax']} "
        f"({result['devices']} CPU device(s)); total wall time {result['wall_s'] / 60:.1f} min.",
        "",
    ]
    c = result["config"]
    for part in result.get("synthetic") or []:
        s = part["setup"]
        lines += [
            f"## Sampling strategy vs. held-out accuracy: synthetic corpus, {s['corpus']}",
            "",
            f"`{Path(s['dataset']).name}`: {s['num_cells']:,} cells × {s['num_genes']:,} genes, "
            f"{s['mean_nnz']:,.0f} nonzeros per cell, {s['num_plates']} contiguous plates; "
            f"trained on the {s['train_cells']:,} cells of every plate but `{s['eval_plate']}`, evaluated on the "
            f"{s['eval_cells']:,} cells of `{s['eval_plate']}` (every label present). One epoch each; MLP "
            f"(hidden {c['hidden']}), adam lr {c['lr']}, batch {c['batch_size']}, seed {c['seed']}, "
            "`normalize_log1p` fused in the loader; the same model initialisation for every strategy. "
            "cells/s: training throughput after the first (compiling) step, every wait included; data wait: share "
            "of step time spent waiting for the next batch; batch entropy: mean label entropy of the "
            "training minibatches (population entropy of the training cells in brackets).",
            "",
        ]
        for label in c["labels"]:
            runs = [r for r in part["runs"] if r["label"] == label]
            if not runs:
                continue
            lines += [
                f"### label `{label}` ({s.get(f'num_classes_{label}', '?')} classes)",
                "",
                "| strategy | sampling | block | fetch factor | macro-F1 | accuracy | cells/s | data wait "
                "| batch entropy (bits) | wall s |",
                "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            ]
            for r in runs:
                e = r["batch_entropy"]
                lines.append(
                    f"| {r['strategy']} | {STRATEGY_NOTES[r['strategy']]} | {r['block_size']} | {r['fetch_factor']} "
                    f"| {r['macro_f1']:.4f} | {r['accuracy']:.4f} | {_fmt(r['cells_per_s'], ',.0f')} "
                    f"| {100 * r['data_wait_fraction']:.1f}% | {e['mean_bits']:.2f} ({e['population_bits']:.2f}) "
                    f"| {r['wall_s']:.0f} |"
                )
            lines.append("")
    pb = result.get("pbmc")
    if pb:
        sp, src, tc = pb["split"], pb["source"], pb["train_config"]
        lines += [
            "## Real data: scanpy `pbmc68k_reduced` against scikit-learn",
            "",
            f"{src['cells']} cells × {src['genes']} genes, label `bulk_labels` ({sp['num_classes']} classes). "
            f"Materialized from `.raw` (`use_raw=True`: log-normalized, values {src['raw_min']:.2f}..{src['raw_max']:.2f}, "
            f"not counts; `.X` is scaled, {src['X_min']:.2f}..{src['X_max']:.2f}, and would break the loop's "
            "`normalize_log1p`). Stratified split, seed "
            f"{sp['split_seed']}: {sp['train_cells']} training / {sp['test_cells']} held-out cells "
            "(passed to `TrainConfig.eval_rows`). Every method sees the same features, "
            "`log1p(x / x.sum(1) · 1e4)` of the stored matrix (the loader's fused `normalize_log1p`; numpy "
            f"copy checked against the loader, max |diff| {sp['loader_vs_numpy_max_abs_diff']:.1e}). `train` runs: "
            f"adam lr {tc['lr']}, batch {tc['batch_size']}, {tc['sampling']}, MLP hidden {tc['hidden']}.",
            "",
            "| method | epochs (steps) | accuracy | macro-F1 | fit s |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for r in pb["rows"]:
            ep = "–" if r["epochs"] is None else f"{r['epochs']} ({r['steps']})"
            lines.append(
                f"| {r['method']} | {ep} | {r['accuracy']:.4f} | {r['macro_f1']:.4f} | {r['fit_s']:.1f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default=str(DATA / "ds_200k"), help="materialized synthetic corpus")
    p.add_argument("--eval-plate", default="plate_13", help="held-out plate (the one holding every label)")
    p.add_argument("--labels", nargs="+", default=["cell_type", "drug"])
    p.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), default=list(STRATEGIES))
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16, help="block_size of the `block` strategy")
    p.add_argument(
        "--fetch-factor", type=int, default=256, help="fetch_factor of `block` and `stream_buffer`"
    )
    p.add_argument("--hidden", type=int, default=256, help="MLP hidden units (train's default)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--devices", type=int, default=1, help="CPU devices of the data mesh (>1: fake XLA devices)"
    )
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--eval-batch-size", type=int, default=1024)
    p.add_argument("--pbmc-epochs", type=int, nargs="+", default=[5, 20, 50])
    p.add_argument("--pbmc-batch-size", type=int, default=64)
    p.add_argument("--pbmc-test-size", type=float, default=0.3)
    p.add_argument(
        "--low-signal-nnz",
        type=int,
        default=60,
        help="also run the strategies on a copy of the corpus (same plates and labels) with this many "
        "expressed genes per cell, so ~3%% as many marker draws (0: skip; the minimum is 50)",
    )
    p.add_argument("--skip-synthetic", action="store_true")
    p.add_argument("--skip-pbmc", action="store_true")
    p.add_argument(
        "--estimate-steps",
        type=int,
        default=0,
        help="only time this many steps of each strategy and project an epoch, then exit",
    )
    p.add_argument("--out", default=str(RESULTS / "train.json"))
    p.add_argument("--md", default=str(RESULTS / "train.md"))
    args = p.parse_args(argv)
    _setup_devices(args.devices)
    args.partial = str(Path(tempfile.gettempdir()) / "bench_train.partial.jsonl")  # one line per finished run

    import jax

    if args.estimate_steps:
        estimate(args)
        return 0
    start = time.perf_counter()
    argv_used = sys.argv[1:] if argv is None else argv
    result = {
        "benchmark": "bench_train",
        **provenance([str(Path(__file__)), *argv_used]),
        "rounds": 1,
        "devices": args.devices,
        "versions": {k: version(k) for k in ("jax", "equinox", "optax", "grain", "scanpy", "scikit-learn")},
        "config": {
            k: v for k, v in vars(args).items() if k not in ("out", "md", "partial", "estimate_steps")
        },
    }
    Path(args.partial).unlink(missing_ok=True)
    if not args.skip_synthetic:
        result["synthetic"] = [synthetic_part(args, args.dataset, "default")]
        if args.low_signal_nnz:
            low = low_signal_corpus(args)
            result["synthetic"].append(
                synthetic_part(args, low, f"low-signal (mean_nnz {args.low_signal_nnz})")
            )
    if not args.skip_pbmc:
        with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
            result["pbmc"] = pbmc_part(args, Path(tmp))
    result["wall_s"] = time.perf_counter() - start
    result["jax_devices"] = [str(d) for d in jax.devices()]
    write_result(args.out, result)
    Path(args.md).write_text(markdown(result))
    Path(args.partial).unlink(missing_ok=True)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

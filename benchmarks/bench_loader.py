"""Loader throughput against the peers, in one run, on the same 200k-cell corpus.

Every configuration runs in a fresh process (so its peak RSS is its own): omicsio_jax's loader
(dense, csr, gene panel, true random), scDataset on the h5ad of the same cells, and Grain's stock
ArrayRecordDataSource + IndexSampler path on the same shards. Warm page cache first; then a cold
pass (page cache of the files dropped before the run) next to the files' sequential-read limit;
then a block_size × fetch_factor grid of throughput and plate-label entropy with a PNG plot.

    scripts/setup-bench.sh     # torch (CPU) + scDataset + matplotlib
    .venv/bin/python benchmarks/bench_loader.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
DATA = HERE / "data"


def _our_loader(
    dataset: str,
    *,
    batch_size: int,
    block_size: int,
    fetch_factor: int,
    output: str = "dense",
    genes: int | None = None,
    num_batches: int,
    warmup: int,
    seed: int = 0,
) -> dict:
    import jax

    import omicsio_jax as oj

    ds = oj.open_dataset(dataset)
    panel = None if genes is None else list(range(genes))
    loader = oj.make_loader(
        ds,
        batch_size=batch_size,
        block_size=block_size,
        fetch_factor=fetch_factor,
        seed=seed,
        num_epochs=None,
        output=output,
        genes=panel,
        obs=("batch",),
    )
    it = iter(loader)
    for _ in range(warmup):
        jax.block_until_ready(next(it).x)
    start = time.perf_counter()
    for _ in range(num_batches):
        batch = next(it)
        jax.block_until_ready(batch.x)
    seconds = time.perf_counter() - start
    shape = list(batch.x.shape) if output != "csr" else [batch_size, "csr"]
    return {
        "cells_per_s": num_batches * batch_size / seconds,
        "batches": num_batches,
        "seconds": seconds,
        "shape": shape,
    }


def peak_rss_bytes() -> int:
    """This process's peak RSS (VmHWM). Not ru_maxrss: Linux carries that across fork + exec, so a
    child would report its parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _child(spec: dict) -> dict:
    """Run one configuration (in the child process) and return its result with peak RSS."""
    sys.path.insert(0, str(HERE))
    if spec.get("cold"):
        from _peers import drop_page_cache

        spec["cache_dropped"] = drop_page_cache(spec["cold"])
    kind, kw = spec["kind"], spec["kwargs"]
    if kind == "ours":
        out = _our_loader(**kw)
    elif kind == "scdataset":
        from _peers import bench_scdataset

        out = bench_scdataset(**kw)
    else:
        from _peers import bench_grain_stock

        out = bench_grain_stock(**kw)
    out["peak_rss_mib"] = peak_rss_bytes() / 2**20
    return {**spec, **out}


def run(spec: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        return {
            **spec,
            "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode,
        }
    return json.loads(proc.stdout.strip().splitlines()[-1])


COMPACT = (
    DATA / "ds_200k_zstd1"
)  # the same cells with --compression zstd:1: 17% smaller, slower to decompress


def run_rounds(plan: list[tuple[str, dict]], rounds: int) -> list[dict]:
    """Run every configuration ``rounds`` times, round-robin (so a slow spell of the shared machine
    hits all of them), and keep each one's median cells/s, every run's figure and the peak RSS."""
    runs: dict[str, list[dict]] = {label: [] for label, _ in plan}
    for r in range(rounds):
        for label, spec in plan:
            result = run({"label": label, **spec})
            runs[label].append(result)
            shown = (
                f"{result['cells_per_s']:>10,.0f} cells/s  peak RSS {result['peak_rss_mib']:>6,.0f} MiB"
                if "error" not in result
                else f"ERROR {result['error']}"
            )
            print(f"[round {r + 1}/{rounds}] {label:58s} {shown}", flush=True)
    rows = []
    for label, results in runs.items():
        ok = [x for x in results if "error" not in x]
        if not ok:
            rows.append(results[-1])
            continue
        speeds = [x["cells_per_s"] for x in ok]
        row = {
            **ok[0],
            "cells_per_s": float(np.median(speeds)),
            "cells_per_s_runs": speeds,
            "peak_rss_mib": max(x["peak_rss_mib"] for x in ok),
        }
        rows.append(row)
        print(
            f"median of {len(ok)}: {label:52s} {row['cells_per_s']:>10,.0f} cells/s "
            f"(runs {', '.join(f'{v:,.0f}' for v in speeds)})",
            flush=True,
        )
    return rows


def ensure_data(corpus: Path) -> tuple[Path, Path, Path]:
    """The corpus, its materialized dataset (default compression zstd:-1, and zstd:1), and a
    dense-layout dataset of a 2,000-gene panel."""
    if not (corpus / "cells.h5ad").exists():
        from materialize import make_synthetic_corpus

        make_synthetic_corpus(corpus, num_cells=200_000, seed=0, progress=True)
    sparse, panel = DATA / "ds_200k", DATA / "ds_200k_panel2000"
    from materialize import materialize

    if not (sparse / "manifest.json").exists():
        materialize(corpus / "cells.parquet", sparse, overwrite=True)
    if not (panel / "manifest.json").exists():
        materialize(corpus / "cells.parquet", panel, panel=top_genes(corpus, 2000), overwrite=True)
    if not (COMPACT / "manifest.json").exists():
        materialize(corpus / "cells.parquet", COMPACT, compression="zstd:1", overwrite=True)
    return corpus, sparse, panel


def top_genes(corpus: Path, count: int) -> list[str]:
    """The ``count`` genes detected in most of the first 16k cells: a realistic focused panel."""
    import pyarrow.parquet as pq

    from omicsio_jax.format.csr import list_to_csr

    cells = pq.ParquetFile(corpus / "cells.parquet").read_row_groups([0, 1], columns=["gene_token_id"])
    _, tokens = list_to_csr(cells.column(0))
    names = pq.read_table(corpus / "gene_metadata.parquet", columns=["gene_name"]).column(0).to_pylist()
    detected = np.bincount(tokens.to_numpy(), minlength=len(names))
    return [names[i] for i in np.argsort(-detected, kind="stable")[:count]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--corpus", default=str(DATA / "corpus_200k"))
    p.add_argument("--skip-peers", action="store_true")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="run every configuration this many times, round-robin, and report the median",
    )
    p.add_argument("--out", default=str(HERE / "results" / "loader.json"))
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return
    corpus, sparse, panel = ensure_data(Path(args.corpus))
    h5ad, ds, ds_panel = str(corpus / "cells.h5ad"), str(sparse), str(panel)
    shards = [str(p) for p in sorted(Path(ds).glob("shard-*.arrayrecord"))]
    plan: list[tuple[str, dict]] = []

    def add(label: str, spec: dict) -> None:
        plan.append((label, spec))

    warm_batches = {64: 1500, 1024: 100}
    for bs in (64, 1024):
        common = {"batch_size": bs, "block_size": 16, "fetch_factor": 64}
        add(
            f"omicsio dense  b{bs} block16 fetch64",
            {
                "kind": "ours",
                "kwargs": {"dataset": ds, **common, "num_batches": warm_batches[bs], "warmup": 64},
            },
        )
        add(
            f"omicsio csr    b{bs} block16 fetch64",
            {
                "kind": "ours",
                "kwargs": {
                    "dataset": ds,
                    **common,
                    "output": "csr",
                    "num_batches": 3 * warm_batches[bs],
                    "warmup": 64,
                },
            },
        )
        add(
            f"omicsio dense  b{bs} block16 fetch64 (zstd:1 dataset)",
            {
                "kind": "ours",
                "kwargs": {"dataset": str(COMPACT), **common, "num_batches": warm_batches[bs], "warmup": 64},
            },
        )
        add(
            f"omicsio csr    b{bs} block16 fetch64 (zstd:1 dataset)",
            {
                "kind": "ours",
                "kwargs": {
                    "dataset": str(COMPACT),
                    **common,
                    "output": "csr",
                    "num_batches": 3 * warm_batches[bs],
                    "warmup": 64,
                },
            },
        )
        add(
            f"omicsio panel2000 (dense layout) b{bs} block16 fetch64",
            {
                "kind": "ours",
                "kwargs": {"dataset": ds_panel, **common, "num_batches": 3 * warm_batches[bs], "warmup": 64},
            },
        )
        add(
            f"omicsio panel2000 (from sparse) b{bs} block16 fetch64",
            {
                "kind": "ours",
                "kwargs": {
                    "dataset": ds,
                    **common,
                    "genes": 2000,
                    "num_batches": 3 * warm_batches[bs],
                    "warmup": 64,
                },
            },
        )
        add(
            f"omicsio true random b{bs} (block1 fetch1)",
            {
                "kind": "ours",
                "kwargs": {
                    "dataset": ds,
                    "batch_size": bs,
                    "block_size": 1,
                    "fetch_factor": 1,
                    "num_batches": max(20, 12_800 // bs),
                    "warmup": 4,
                },
            },
        )
        if not args.skip_peers:
            add(
                f"scDataset dense b{bs} block16 fetch64",
                {
                    "kind": "scdataset",
                    "kwargs": {
                        "h5ad_path": h5ad,
                        **common,
                        "num_batches": max(64, warm_batches[bs] // 4),
                        "seed": 0,
                    },
                },
            )
            add(
                f"scDataset true random b{bs}",
                {
                    "kind": "scdataset",
                    "kwargs": {
                        "h5ad_path": h5ad,
                        "batch_size": bs,
                        "block_size": 1,
                        "fetch_factor": 1,
                        "num_batches": max(20, 6_400 // bs),
                        "seed": 0,
                    },
                },
            )
            add(
                f"Grain stock ArrayRecord random b{bs}",
                {
                    "kind": "grain",
                    "kwargs": {
                        "dataset_dir": ds,
                        "batch_size": bs,
                        "num_batches": max(20, 6_400 // bs),
                        "seed": 0,
                    },
                },
            )

    rows = run_rounds(plan, args.rounds)
    plan = []

    # cold page cache: files dropped from the cache right before each run
    sys.path.insert(0, str(HERE))
    from _peers import drop_page_cache, sequential_read_limit

    cold = {
        "shards_sequential_bytes_per_s": sequential_read_limit(shards),
        "h5ad_sequential_bytes_per_s": sequential_read_limit([h5ad]),
        "cache_drop_works": drop_page_cache(shards),
    }
    print(
        f"cold sequential read: shards {cold['shards_sequential_bytes_per_s'] / 1e6:,.0f} MB/s, "
        f"h5ad {cold['h5ad_sequential_bytes_per_s'] / 1e6:,.0f} MB/s",
        flush=True,
    )
    add(
        "COLD omicsio dense b1024 block16 fetch64",
        {
            "kind": "ours",
            "cold": shards,
            "kwargs": {
                "dataset": ds,
                "batch_size": 1024,
                "block_size": 16,
                "fetch_factor": 64,
                "num_batches": 150,
                "warmup": 0,
            },
        },
    )
    add(
        "COLD omicsio csr   b1024 block16 fetch64",
        {
            "kind": "ours",
            "cold": shards,
            "kwargs": {
                "dataset": ds,
                "batch_size": 1024,
                "block_size": 16,
                "fetch_factor": 64,
                "output": "csr",
                "num_batches": 150,
                "warmup": 0,
            },
        },
    )
    add(
        "COLD omicsio csr   b1024 block16 fetch64 (zstd:1 dataset)",
        {
            "kind": "ours",
            "cold": [str(p) for p in sorted(COMPACT.glob("shard-*.arrayrecord"))],
            "kwargs": {
                "dataset": str(COMPACT),
                "batch_size": 1024,
                "block_size": 16,
                "fetch_factor": 64,
                "output": "csr",
                "num_batches": 150,
                "warmup": 0,
            },
        },
    )
    if not args.skip_peers:
        add(
            "COLD scDataset dense b64 block16 fetch64",
            {
                "kind": "scdataset",
                "cold": [h5ad],
                "kwargs": {
                    "h5ad_path": h5ad,
                    "batch_size": 64,
                    "block_size": 16,
                    "fetch_factor": 64,
                    "num_batches": 640,
                    "warmup": 0,
                    "seed": 0,
                },
            },
        )
    rows += run_rounds(plan, args.rounds)
    dataset_bytes = sum(os.path.getsize(s) for s in shards)
    cold["dataset_bytes_per_cell"] = dataset_bytes / 200_000
    cold["shards_sequential_cells_per_s"] = (
        cold["shards_sequential_bytes_per_s"] / cold["dataset_bytes_per_cell"]
    )

    result = {
        "benchmark": "bench_loader",
        "command": f"python benchmarks/bench_loader.py --rounds {args.rounds}",
        "rounds": args.rounds,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "rows": rows,
        "cold": cold,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()

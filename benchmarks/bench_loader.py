"""Loader throughput against the peers, in one run, on the same 200k-cell corpus.

Every configuration runs in a fresh process (so its peak RSS is its own): omicsio_jax's loader
(dense, csr, gene panel, true random), scDataset on the h5ad of the same cells, and Grain's stock
ArrayRecordDataSource + IndexSampler path on the same shards. Warm page cache first; then a cold
pass (page cache of the files dropped before the run) next to the files' sequential-read limit.
Each run discards its warm-up batches, then times a window of ``--seconds`` (at least 10); a cold
run's window also ends with its first epoch, the last cell read cold (``seconds`` says how long
it was). Every configuration runs ``--rounds`` times round-robin; figures are medians.

    scripts/setup-bench.sh     # torch (CPU) + scDataset + matplotlib
    .venv/bin/python benchmarks/bench_loader.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
DATA = HERE / "data"
sys.path.insert(0, str(HERE))
from _provenance import (  # noqa: E402
    MIN_WINDOW_S,
    add_window_options,
    baseline_commit,
    check_window,
    compare,
    medians,
    provenance,
    window,
    write_result,
)

BLOCK, FETCH = 16, 64


def make_loader_either(
    oj,
    ds,
    *,
    batch_size: int,
    block_size: int,
    fetch_factor: int,
    output: str,
    genes: list[int] | None = None,
    obs: tuple[str, ...] = (),
    seed: int = 0,
    num_epochs: int | None = None,
    num_threads: int | None = None,
):
    """``make_loader`` of whichever omicsio_jax this process imported: the option API, or the keyword
    API of a ``--baseline`` checkout made before it (the same loader, asked for in its words)."""
    if hasattr(oj, "Block"):
        return oj.make_loader(
            ds,
            batch_size=batch_size,
            sampling=oj.Block(block_size, fetch_factor),
            output=output if genes is None else oj.Panel(genes),
            obs=obs,
            seed=seed,
            num_epochs=num_epochs,
            read=oj.ReadOptions(num_threads=num_threads),
        )
    threads = {} if num_threads is None else {"num_threads": num_threads}
    return oj.make_loader(
        ds,
        batch_size=batch_size,
        block_size=block_size,
        fetch_factor=fetch_factor,
        output=output,
        genes=genes,
        obs=obs,
        seed=seed,
        num_epochs=num_epochs,
        **threads,
    )


def baseline_env(spec: dict) -> dict | None:
    """The environment of a run of a ``--baseline`` checkout (its package first on the path)."""
    path = spec.get("baseline")
    return None if path is None else {**os.environ, "PYTHONPATH": path}


def _our_loader(
    dataset: str,
    *,
    batch_size: int,
    block_size: int,
    fetch_factor: int,
    output: str = "dense",
    genes: int | None = None,
    seconds: float = MIN_WINDOW_S,
    warmup: int,
    cold: bool = False,
    seed: int = 0,
) -> dict:
    import jax

    import omicsio_jax as oj

    ds = oj.open_dataset(dataset)
    loader = make_loader_either(
        oj,
        ds,
        batch_size=batch_size,
        block_size=block_size,
        fetch_factor=fetch_factor,
        output=output,
        genes=None if genes is None else list(range(genes)),
        obs=("batch",),
        seed=seed,
        num_epochs=1 if cold else None,  # cold: the window ends with the first epoch at the latest
    )
    it = iter(loader)
    for _ in range(warmup):
        jax.block_until_ready(next(it).x)
    last = []

    def step() -> int:
        batch = next(it)
        jax.block_until_ready(batch.x)
        last[:] = [batch]
        return batch_size

    w = window(step, seconds=seconds)
    batch = last[0]
    shape = list(batch.x.shape) if output != "csr" else [batch_size, "csr"]
    loader.close()
    return {**w.as_dict(), "shape": shape}


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
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=baseline_env(spec),
    )
    if proc.returncode != 0:
        return {
            **spec,
            "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode,
        }
    return json.loads(proc.stdout.strip().splitlines()[-1])


COMPACT = DATA / "ds_200k_zstd1"  # the same cells with compression zstd:1: smaller, slower to decompress


def run_rounds(plan: list[tuple[str, dict]], rounds: int) -> list[dict]:
    """Run every configuration ``rounds`` times, round-robin (so a slow spell of the shared machine
    hits all of them), and keep each one's median cells/s, every run's figure and the peak RSS."""
    runs: dict[str, list[dict]] = {label: [] for label, _ in plan}
    for r in range(rounds):
        # every other round in reverse order: what a run leaves behind (page cache, clocks) does not
        # always land on the same next configuration
        for label, spec in plan if r % 2 == 0 else plan[::-1]:
            result = run({"label": label, **spec})
            runs[label].append(result)
            shown = (
                f"{result['cells_per_s']:>10,.0f} cells/s over {result['seconds']:5.1f} s  "
                f"peak RSS {result['peak_rss_mib']:>6,.0f} MiB"
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
        row = {
            **ok[0],
            **medians(ok, ("cells_per_s", "cells_per_cpu_s", "seconds", "batches")),
            "rounds": len(ok),
            "peak_rss_mib": max(x["peak_rss_mib"] for x in ok),
        }
        rows.append(row)
        print(
            f"median of {len(ok)}: {label:52s} {row['cells_per_s']:>10,.0f} cells/s "
            f"(runs {', '.join(f'{v:,.0f}' for v in row['cells_per_s_runs'])})",
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
    from materialize import Layout, materialize

    if not (sparse / "manifest.json").exists():
        materialize(corpus / "cells.parquet", sparse, overwrite=True)
    if not (panel / "manifest.json").exists():
        materialize(
            corpus / "cells.parquet", panel, layout=Layout(panel=top_genes(corpus, 2000)), overwrite=True
        )
    if not (COMPACT / "manifest.json").exists():
        materialize(corpus / "cells.parquet", COMPACT, layout=Layout(compression="zstd:1"), overwrite=True)
    return corpus, sparse, panel


def top_genes(corpus: Path, count: int) -> list[str]:
    """The ``count`` genes detected in most of the first 16k cells: a realistic focused panel."""
    import pyarrow.parquet as pq

    from omicsio_jax.format.arrow import list_to_csr

    cells = pq.ParquetFile(corpus / "cells.parquet").read_row_groups([0, 1], columns=["gene_token_id"])
    _, tokens = list_to_csr(cells.column(0))
    names = pq.read_table(corpus / "gene_metadata.parquet", columns=["gene_name"]).column(0).to_pylist()
    detected = np.bincount(tokens.to_numpy(), minlength=len(names))
    return [names[i] for i in np.argsort(-detected, kind="stable")[:count]]


def _label(what: str, bs: int, block: int = BLOCK, fetch: int = FETCH, note: str = "") -> str:
    return f"{what} b{bs} Block({block}, {fetch})" + (f" ({note})" if note else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--corpus", default=str(DATA / "corpus_200k"))
    p.add_argument("--skip-peers", action="store_true")
    p.add_argument("--only", metavar="REGEX", help="run only the configurations whose label matches")
    p.add_argument("--skip-cold", action="store_true", help="no cold page-cache pass")
    p.add_argument(
        "--baseline",
        metavar="CHECKOUT",
        help="also run the main omicsio configurations from this checkout of an earlier commit (a git "
        "worktree), in the same rounds: the code before a change against the code after it",
    )
    add_window_options(p)
    p.add_argument("--out", default=str(HERE / "results" / "loader.json"))
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return
    check_window(args)
    corpus, sparse, panel = ensure_data(Path(args.corpus))
    h5ad, ds, ds_panel = str(corpus / "cells.h5ad"), str(sparse), str(panel)
    shards = [str(p) for p in sorted(Path(ds).glob("shard-*.arrayrecord"))]
    window_s = args.seconds
    plan: list[tuple[str, dict]] = []

    baseline = None if args.baseline is None else str(Path(args.baseline).resolve())
    base_sha = None if baseline is None else baseline_commit(baseline)

    def ours(
        label: str,
        dataset: str,
        bs: int,
        *,
        warmup: int = 64,
        cold: list[str] | None = None,
        compare_baseline: bool = False,
        **kw,
    ) -> None:
        kwargs = {"dataset": dataset, "batch_size": bs, "block_size": BLOCK, "fetch_factor": FETCH,
                  "seconds": window_s, "warmup": warmup, **kw}  # fmt: skip
        if cold:
            kwargs["cold"] = True
        plan.append((label, {"kind": "ours", "kwargs": kwargs, **({"cold": cold} if cold else {})}))
        if compare_baseline and baseline is not None:
            plan.append(
                (f"{label} @ {base_sha[:7]}", {"kind": "ours", "kwargs": kwargs, "baseline": baseline})
            )

    for bs in (64, 1024):
        ours(_label("omicsio dense", bs), ds, bs, compare_baseline=True)
        ours(_label("omicsio csr", bs), ds, bs, output="csr", compare_baseline=True)
        ours(_label("omicsio dense", bs, note="zstd:1 dataset"), str(COMPACT), bs)
        ours(_label("omicsio csr", bs, note="zstd:1 dataset"), str(COMPACT), bs, output="csr")
        ours(_label("omicsio panel2000 (dense layout)", bs), ds_panel, bs)
        ours(_label("omicsio panel2000 (from sparse)", bs), ds, bs, genes=2000, compare_baseline=True)
        ours(_label("omicsio true random", bs, 1, 1), ds, bs, block_size=1, fetch_factor=1, warmup=4,
             compare_baseline=True)  # fmt: skip
        if not args.skip_peers:
            plan.append((f"scDataset dense b{bs} BlockShuffling(16) fetch_factor 64", {"kind": "scdataset", "kwargs": {
                "h5ad_path": h5ad, "batch_size": bs, "block_size": BLOCK, "fetch_factor": FETCH,
                "seconds": window_s, "seed": 0}}))  # fmt: skip
            plan.append((f"scDataset true random b{bs}", {"kind": "scdataset", "kwargs": {
                "h5ad_path": h5ad, "batch_size": bs, "block_size": 1, "fetch_factor": 1,
                "seconds": window_s, "seed": 0}}))  # fmt: skip
            plan.append((f"Grain stock ArrayRecord random b{bs}", {"kind": "grain", "kwargs": {
                "dataset_dir": ds, "batch_size": bs, "seconds": window_s, "seed": 0}}))  # fmt: skip

    only = None if args.only is None else re.compile(args.only)

    def chosen(plan: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
        return [(label, spec) for label, spec in plan if only is None or only.search(label)]

    rows = run_rounds(chosen(plan), args.rounds)
    plan = []

    # cold page cache: files dropped from the cache right before each run
    from _peers import drop_page_cache, sequential_read_limit

    cold = (
        None
        if args.skip_cold
        else {
            "shards_sequential_bytes_per_s": sequential_read_limit(shards),
            "h5ad_sequential_bytes_per_s": sequential_read_limit([h5ad]),
            "cache_drop_works": drop_page_cache(shards),
            "window": "each cold run's window ends after --seconds or with its first epoch, whichever comes first",
        }
    )
    print(
        ""
        if cold is None
        else f"cold sequential read: shards {cold['shards_sequential_bytes_per_s'] / 1e6:,.0f} MB/s, "
        f"h5ad {cold['h5ad_sequential_bytes_per_s'] / 1e6:,.0f} MB/s",
        flush=True,
    )
    ours(_label("COLD omicsio dense", 1024), ds, 1024, warmup=0, cold=shards)
    ours(_label("COLD omicsio csr", 1024), ds, 1024, warmup=0, cold=shards, output="csr")
    compact_shards = [str(p) for p in sorted(COMPACT.glob("shard-*.arrayrecord"))]
    ours(_label("COLD omicsio csr", 1024, note="zstd:1 dataset"), str(COMPACT), 1024, warmup=0,
         cold=compact_shards, output="csr")  # fmt: skip
    if not args.skip_peers:
        plan.append(("COLD scDataset dense b64 BlockShuffling(16) fetch_factor 64", {"kind": "scdataset", "cold": [h5ad],
            "kwargs": {"h5ad_path": h5ad, "batch_size": 64, "block_size": BLOCK, "fetch_factor": FETCH,
                       "seconds": window_s, "warmup": 0, "seed": 0, "max_epochs": 1}}))  # fmt: skip
    if cold is not None:
        rows += run_rounds(chosen(plan), args.rounds)
        dataset_bytes = sum(os.path.getsize(s) for s in shards)
        cold["dataset_bytes_per_cell"] = (
            dataset_bytes / json.loads((Path(ds) / "manifest.json").read_text())["num_cells"]
        )
        cold["shards_sequential_cells_per_s"] = (
            cold["shards_sequential_bytes_per_s"] / cold["dataset_bytes_per_cell"]
        )

    by = {r["label"]: r for r in rows}
    comparisons = []
    for bs in (64, 1024):
        comparisons += [
            compare(f"dense b{bs}, blocks of 16, fetch factor 64: omicsio ÷ scDataset",
                    by.get(_label("omicsio dense", bs)), by.get(f"scDataset dense b{bs} BlockShuffling(16) fetch_factor 64")),
            compare(f"true random b{bs}: omicsio ÷ scDataset",
                    by.get(_label("omicsio true random", bs, 1, 1)), by.get(f"scDataset true random b{bs}")),
            compare(f"true random b{bs}: omicsio ÷ Grain's stock ArrayRecord path",
                    by.get(_label("omicsio true random", bs, 1, 1)), by.get(f"Grain stock ArrayRecord random b{bs}")),
        ]  # fmt: skip
    if baseline is not None:  # this checkout against the earlier one, configuration by configuration
        comparisons += [
            compare(f"{r['label']}: this commit ÷ {base_sha[:7]}", by.get(r["label"].rsplit(" @ ", 1)[0]), r)
            for r in rows
            if r.get("baseline")
        ]
    result = {
        "benchmark": "bench_loader",
        **provenance(),
        "baseline": None if baseline is None else {"checkout": baseline, "commit": base_sha},
        "rounds": args.rounds,
        "window_s": window_s,
        "quick": args.quick,
        "rows": rows,
        "comparisons": [c for c in comparisons if c],
        "cold": cold,
    }
    write_result(args.out, result, quick=args.quick)


if __name__ == "__main__":
    main()

"""The corpus statistics' kernels on their own: time per nonzero of a partition's statistics and of
the finalizer's merge, with ``--baseline`` against another checkout in the same rounds.

A whole conversion's rounds on this 2-core machine vary by ±10%, more than a change to the
statistics alone moves them (`bench_scale.py`); this times the statistics without the rest of the
conversion around them. Each round runs one fresh process per checkout (alternating which goes
first), pinned to one core, which:

1. encodes the first ``--partitions`` row groups of the corpus (8,192 cells each) into records in
   memory, as materialize's encoder does (not timed);
2. ``partition``: for one partition after another, `StatsAccumulator.add` of its records and
   `StatsAccumulator.save` of its statistics file (what a materialize worker does per partition),
   until at least ``--seconds`` have passed;
3. ``merge``: for one saved partition after another, `GeneStats.load` and `GeneStats.add_to_dense`
   into the finalizer's table (one thread), until at least ``--seconds`` have passed;
4. ``file``: the dataset's ``gene_stats.parquet`` of the merged statistics (`GeneStats.write`, what
   the finalizer does once, after every partition) and its reading back (`GeneStats.read`), one
   after the other, until at least ``--seconds`` have passed.

Figures are nanoseconds per nonzero of the partitions handled (and millions of nonzeros per second);
for ``file``, milliseconds per file written and read, of the histogram entries given; medians of the
rounds.

    python benchmarks/bench_stats.py --rounds 5 --baseline /tmp/wt_old   # a worktree of another commit
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _provenance import (  # noqa: E402
    add_window_options,
    baseline_commit,
    check_window,
    compare,
    medians,
    provenance,
    run_json,
    write_result,
)

CORPUS = HERE / "data" / "corpus_131k"
PARTS = ("partition", "merge", "file")


def child(partitions: int, seconds: float) -> dict:
    """Steps 1–4 of the module docstring in this process; ``{part: (nonzeros, wall s, thread CPU s)}``
    (``file``: ``(histogram entries, wall s, thread CPU s, files)``)."""
    import time

    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import numpy as np
    import pyarrow.parquet as pq

    from omicsio_jax.format import NUM_BINS, GeneStats, StatsAccumulator, codec, empty_span
    from omicsio_jax.format.arrow import list_to_csr, to_numpy

    genes = pq.ParquetFile(CORPUS / "gene_metadata.parquet").metadata.num_rows
    cells = pq.ParquetFile(CORPUS / "cells.parquet")
    records = []
    for group in range(partitions):
        table = cells.read_row_group(group, columns=["gene_token_id", "gene_expression"])
        indptr, tokens = list_to_csr(table.column("gene_token_id"))
        _, values = list_to_csr(table.column("gene_expression"))
        buf, starts = codec.encode_csr(
            indptr, to_numpy(tokens), to_numpy(values), token_to_col=np.arange(genes, dtype=np.int32)
        )
        records.append((buf, starts, int(indptr[-1]), len(starts) - 1))

    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="omicsio-bench-stats-") as tmp:
        paths = [Path(tmp) / f"part-{k}.bin" for k in range(partitions)]
        accumulator = StatsAccumulator(genes, records[0][3])

        def partition(k: int) -> int:
            buf, starts, nnz, _ = records[k]
            accumulator.add(buf, starts, check=False)
            accumulator.save(paths[k])
            return nnz

        hist, span = np.zeros((genes, NUM_BINS), np.uint32), empty_span(genes)

        def merge(k: int) -> int:
            stats = GeneStats.load(paths[k])
            stats.add_to_dense(hist, span)
            del stats  # its arrays map the file
            return records[k][2]

        for name, step in (("partition", partition), ("merge", merge)):
            for k in range(partitions):  # warm-up: numba's start, the tables faulted in, every file saved
                step(k)
            nnz, k = 0, 0
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            while time.perf_counter() - wall0 < seconds:
                nnz += step(k % partitions)
                k += 1
            out[name] = (nnz, time.perf_counter() - wall0, time.thread_time() - cpu0)
        merged = GeneStats.from_dense(1, np.zeros(genes, np.int64), np.zeros((6, genes)), hist, span)
        file = Path(tmp) / "gene_stats.parquet"
        merged.write(file)  # warm-up
        GeneStats.read(file)
        files = 0
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        while time.perf_counter() - wall0 < seconds:
            merged.write(file)
            GeneStats.read(file)
            files += 1
        out["file"] = (len(merged.hist_counts), time.perf_counter() - wall0, time.thread_time() - cpu0, files)
    return out


def _row(label: str, part: str, runs: list[tuple]) -> dict:
    if part == "file":  # (histogram entries, wall, cpu, files)
        rounds = [
            {
                "ms_per_file": 1e3 * wall / files,
                "cpu_ms_per_file": 1e3 * cpu / files,
                "files_per_s": files / wall,
                "histogram_entries": entries,
                "seconds": wall,
            }
            for entries, wall, cpu, files in runs
        ]
    else:
        rounds = [
            {
                "ns_per_nonzero": 1e9 * wall / nnz,
                "cpu_ns_per_nonzero": 1e9 * cpu / nnz,
                "mnnz_per_s": nnz / wall / 1e6,
                "seconds": wall,
            }
            for nnz, wall, cpu in runs
        ]
    return {"label": label, **medians(rounds, rounds[0])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    p.add_argument(
        "--partitions", type=int, default=4, help="row groups of 8,192 cells of the corpus (default 4)"
    )
    p.add_argument("--baseline", help="a checkout (git worktree) of another commit, timed in the same rounds")
    p.add_argument("--out", default=str(HERE / "results" / "stats.json"))
    add_window_options(p)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(int(args.child[0]), float(args.child[1]))))
        return
    check_window(args)
    if not (CORPUS / "cells.parquet").exists():
        raise SystemExit(
            f"{CORPUS / 'cells.parquet'} is missing: make it with benchmarks/bench_scale.py first"
        )
    trees = [None] if args.baseline is None else [None, args.baseline]
    full = baseline_commit(args.baseline) if args.baseline else None
    sha = full[:7] if full else None
    runs: dict = {(tree, part): [] for tree in trees for part in PARTS}
    for r in range(args.rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            child_args = [__file__, "--child", str(args.partitions), repr(args.seconds)]
            for part, figures in run_json(child_args, checkout=tree).items():
                runs[tree, part].append(tuple(figures))
                at = f" @ {sha}" if tree else ""
                if part == "file":
                    _, wall, _, files = figures
                    print(f"round {r + 1}: {part}{at} {1e3 * wall / files:.1f} ms per file", flush=True)
                else:
                    nnz, wall, _ = figures
                    print(f"round {r + 1}: {part}{at} {1e9 * wall / nnz:.2f} ns per nonzero", flush=True)
    rows = {}
    for tree in trees:
        for part in PARTS:
            label = f"statistics {part}" + (f" @ {sha}" if tree else "")
            rows[label] = _row(label, part, runs[tree, part])
    comparisons = []
    if args.baseline:
        for part in PARTS:
            ours, theirs = rows[f"statistics {part}"], rows[f"statistics {part} @ {sha}"]
            key = "files_per_s" if part == "file" else "mnnz_per_s"
            comparisons.append(compare(f"statistics {part}: this commit ÷ {sha}", ours, theirs, key))
    result = {
        "benchmark": "bench_stats",
        **provenance(),
        "rounds": args.rounds,
        "window_s": args.seconds,
        "quick": args.quick,
        "input": f"{CORPUS.relative_to(HERE).as_posix()}/cells.parquet, first {args.partitions} row groups",
        **({} if args.baseline is None else {"baseline": {"checkout": args.baseline, "commit": full}}),
        "rows": list(rows.values()),
        "comparisons": [c for c in comparisons if c],
    }
    write_result(args.out, result, quick=args.quick)


if __name__ == "__main__":
    main()

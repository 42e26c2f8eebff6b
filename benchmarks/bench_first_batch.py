"""Time to the first batch on a dataset of 1,500 shards, and the bytes read to get there.

The dataset is ``ds_s3_50k``'s three full 16,384-cell shards hard-linked 500 times under one
manifest (`_replicate.py --link`: 1,500 shard files, 24.6M cells; the links share the page cache,
so "cold" below drops the cache of the three real files and every chunk index first, which makes
each distinct file's first open and reads cold). A block-sampled first fetch (batch 1,024 ×
fetch_factor 64 in blocks of 16) touches nearly every shard, so every shard is opened before the
first batch. Each run is a fresh process; ``first_batch_s`` counts from after the imports (those
``import omicsio_jax`` defers to first use, numba, Grain and Orbax, included and timed apart as
``lazy_imports_s``) to the first batch ready (``open_dataset``, ``make_loader`` and the first fetch
included); ``read_mb`` is the bytes the process read (``rchar``), by reader: omicsio_jax's chunk
reader (the default: no shard is opened as an ArrayRecord file, the chunks a read needs are read
from the chunk indexes' byte ranges) against ArrayRecord's own reader (``chunk_reader=False``, with
omicsio_jax's 64 KiB footer prefetch per open instead of ArrayRecord's default of 1 MiB). A latency,
not a throughput: every configuration runs ``--rounds`` times (fresh processes) and the report
quotes medians.

    .venv/bin/python benchmarks/bench_first_batch.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _provenance import add_window_options, check_window, provenance, write_result  # noqa: E402

SOURCE = HERE / "data" / "ds_s3_50k"
LINKED = HERE / "data" / "ds_1500_linked"
READERS = {
    "chunk reader (default)": {},
    "ArrayRecord's reader (64 KiB footer prefetch)": {"chunk_reader": False},
}


def _child(spec: dict) -> dict:
    import jax
    import numpy as np

    import omicsio_jax as oj

    start = time.perf_counter()
    import omicsio_jax.loaders.disk  # what `import omicsio_jax` defers to first use: numba, grain, orbax

    lazy_imports = time.perf_counter() - start
    sys.path.insert(0, str(HERE))
    from _peers import proc_io

    if spec["cold"]:
        from _peers import drop_page_cache

        root = Path(spec["dataset"])
        drop_page_cache(
            [SOURCE / f"shard-{i:05d}.arrayrecord" for i in range(3)] + sorted(root.glob("chunks/*.npy"))
        )
    read0, start = proc_io("rchar"), time.perf_counter()
    ds = oj.open_dataset(spec["dataset"], **spec["open"])
    loader = oj.make_loader(ds, batch_size=1024, sampling=oj.Block(16, 64), output=spec["output"], seed=0)
    jax.block_until_ready(next(iter(loader)).x)
    seconds = time.perf_counter() - start
    plan = oj.SamplingPlan(np.arange(ds.num_cells), 1024, 16, 64, 0)  # the loader's: its first fetch's cells
    touched = len(np.unique(plan.fetch(0, 0, 0).rows // ds.manifest.shard_cells))
    out = {
        "first_batch_s": seconds,
        "lazy_imports_s": lazy_imports,
        "read_mb": (proc_io("rchar") - read0) / 1e6,
        "shards": len(ds.manifest.shards),
        "shards_touched": touched,
        "cells": ds.num_cells,
    }
    loader.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    add_window_options(p, seconds=None)
    p.add_argument("--out", default=str(HERE / "results" / "first_batch.json"))
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return
    check_window(args)
    if not (LINKED / "manifest.json").exists():
        from _replicate import replicate
        from bench_s3 import ensure_dataset

        ensure_dataset(50_000, 16_384)  # SOURCE
        replicate(SOURCE, LINKED, 500, link=True)
    rows = []
    for r in range(args.rounds):
        for label, open_options in READERS.items():
            for output in ("dense", "csr"):
                for cold in (True, False):
                    spec = {"dataset": str(LINKED), "open": open_options, "output": output, "cold": cold}
                    proc = subprocess.run(
                        [sys.executable, __file__, "--child", json.dumps(spec)],
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    got = {
                        "reader": label,
                        "output": output,
                        "cache": "cold" if cold else "warm",
                        "round": r,
                        **json.loads(proc.stdout.strip().splitlines()[-1]),
                    }
                    rows.append(got)
                    print(
                        f"[round {r + 1}] {label:44s} {output:5s} {got['cache']}: {got['first_batch_s']:6.2f} s "
                        f"(+{got['lazy_imports_s']:.2f} s of imports), "
                        f"{got['read_mb']:8,.0f} MB read, {got['shards_touched']} of {got['shards']} shards",
                        flush=True,
                    )
    summary = []
    for label in READERS:
        for output in ("dense", "csr"):
            for cache in ("cold", "warm"):
                mine = [r for r in rows if (r["reader"], r["output"], r["cache"]) == (label, output, cache)]
                summary.append(
                    {
                        "label": f"{label}, {output}, {cache}",
                        "reader": label,
                        "output": output,
                        "cache": cache,
                        "first_batch_s": statistics.median(r["first_batch_s"] for r in mine),
                        "first_batch_s_runs": [r["first_batch_s"] for r in mine],
                        "lazy_imports_s": statistics.median(r["lazy_imports_s"] for r in mine),
                        "read_mb": statistics.median(r["read_mb"] for r in mine),
                        "shards": mine[0]["shards"],
                        "shards_touched": mine[0]["shards_touched"],
                    }
                )
    out = {
        "benchmark": "bench_first_batch",
        **provenance(),
        "rounds": args.rounds,
        "quick": args.quick,
        "summary": summary,
        "rows": rows,
    }
    write_result(args.out, out, quick=args.quick)


if __name__ == "__main__":
    main()

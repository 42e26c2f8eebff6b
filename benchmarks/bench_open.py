"""Materializing a collection of many small ``.h5ad`` files: their sources opened on threads against
on the pool's worker processes.

A CELLxGENE-style collection is ~1,500 ``.h5ad`` files, each with its own genes. Opening one reads
its var table (the Ensembl ids and symbols of 20k–40k genes) and obs columns through h5py, which
holds one lock per process: on threads they open one at a time, before any cell is written. From
``materialize._collection._POOL_OPEN_FROM`` such sources, `materialize` starts its pool first and
opens them on its workers.

The data (made on first use in benchmarks/data/, seed 0): ``--sources`` ``.h5ad`` files over a
universe of 62,710 Ensembl ids, each measuring a random 20k–40k of them (half listing their genes
shuffled), with ``--cells`` cells of ~2% nonzero counts, obs ``donor_id`` and ``is_primary_data``
and var ``feature_name``, as CELLxGENE writes them. Each round converts the collection once with
each way of opening, each in a fresh process (the order alternating from round to round), with
`materialize`'s defaults; a round's figure is whole conversions until they took ``--seconds``, and
the peak RSS of the process that ran them (the pool's workers apart).

    .venv/bin/python benchmarks/bench_open.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
DATA = HERE / "data"
sys.path.insert(0, str(HERE))
from _provenance import (  # noqa: E402
    add_window_options,
    check_window,
    compare,
    medians,
    provenance,
    write_result,
)
from bench_collection import UNIVERSE, materialize_round  # noqa: E402

WAYS = {"threads": "sources opened on threads", "workers": "sources opened on the pool's workers"}

# how each way is asked for: threads by making no collection worth the pool (a renamed setting fails
# the round, where setting it anew would measure the workers twice)
_THREADS = """
import materialize._collection as c
if not hasattr(c, "_POOL_OPEN_FROM"):
    sys.exit("bench_open: materialize._collection._POOL_OPEN_FROM is gone")
c._POOL_OPEN_FROM = 1 << 62
"""
BEFORE = {"threads": _THREADS, "workers": ""}


def _make_source(args: tuple[Path, int, int]) -> str:
    import anndata as ad
    import pandas as pd
    import scipy.sparse as sp

    root, k, cells = args
    rng = np.random.default_rng(k)
    ids = np.array([f"ENSG{i:011d}" for i in range(UNIVERSE)])
    width = int(rng.integers(20_000, 40_001))
    genes = np.sort(rng.choice(UNIVERSE, width, replace=False))
    if k % 2:
        genes = rng.permutation(genes)  # the file lists its genes in an order of its own
    x = sp.random(cells, width, density=0.02, format="csr", random_state=k, dtype=np.float32)
    x.data = np.ceil(x.data * 10)
    var = pd.DataFrame({"feature_name": pd.Categorical([f"G{g}" for g in genes])}, index=ids[genes])
    obs = pd.DataFrame(
        {
            "is_primary_data": rng.random(cells) > 0.3,
            "donor_id": pd.Categorical([f"d{k % 40}"] * cells),
        },
        index=[f"s{k}c{i}" for i in range(cells)],
    )
    path = root / f"source_{k:04d}.h5ad"
    ad.AnnData(X=x, obs=obs, var=var).write_h5ad(path)
    return str(path)


def make_data(root: Path, num_sources: int, cells: int) -> list[str]:
    """The sources' paths (made once per shape, on every core)."""
    done = root / "done.json"
    if done.exists():
        return json.loads(done.read_text())
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    print(f"writing {num_sources} .h5ad sources of {cells} cells in {root} ...", flush=True)
    with ProcessPoolExecutor() as pool:
        paths = list(pool.map(_make_source, [(root, k, cells) for k in range(num_sources)], chunksize=8))
    done.write_text(json.dumps(paths))
    return paths


def convert_round(paths: list[str], out: Path, seconds: float, way: str) -> dict:
    """Whole conversions in one fresh process until they took ``seconds`` together."""
    r = materialize_round(paths, out, seconds, before=BEFORE[way])
    per = r["seconds"] / r["conversions"]
    return {
        **r,
        "seconds_per_conversion": per,
        "sources_per_s": len(paths) / per,
        "peak_rss_mib": r["peak_rss_bytes"] / 2**20,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sources", type=int, default=300)
    p.add_argument("--cells", type=int, default=100, help="cells per source")
    add_window_options(p)
    p.add_argument("--out", default=str(HERE / "results" / "open.json"))
    args = p.parse_args()
    check_window(args)
    paths = make_data(DATA / f"h5ad_{args.sources}x{args.cells}", args.sources, args.cells)
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory(dir=DATA) as tmp:
        for r in range(args.rounds):
            for way in list(WAYS) if r % 2 == 0 else list(WAYS)[::-1]:
                runs[way].append(convert_round(paths, Path(tmp) / way, args.seconds, way))
                print(
                    f"round {r + 1}: {WAYS[way]}: {runs[way][-1]['seconds_per_conversion']:.2f} s", flush=True
                )
    rows = {
        way: {
            "label": f"materialize, {WAYS[way]}",
            "num_cells": runs[way][0]["num_cells"],
            "workers": runs[way][0]["workers"],
            **medians(runs[way], ["sources_per_s", "seconds_per_conversion", "seconds", "peak_rss_mib"]),
        }
        for way in WAYS
    }
    result = {
        "benchmark": "bench_open",
        **provenance(),
        "rounds": args.rounds,
        "window": "whole conversions, at least --seconds per round (seconds: the window)",
        "quick": args.quick,
        "data": {"sources": args.sources, "cells_per_source": args.cells, "universe_genes": UNIVERSE},
        "rows": list(rows.values()),
        "comparisons": [
            compare(
                "materialize: sources opened on the workers / on threads",
                rows["workers"],
                rows["threads"],
                key="sources_per_s",
            )
        ],
    }
    write_result(args.out, result, quick=args.quick)


if __name__ == "__main__":
    main()

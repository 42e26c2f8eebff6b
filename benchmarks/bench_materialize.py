"""Materialize throughput, peak memory and bytes per cell on the synthetic corpus.

For each corpus size and input format (parquet, h5ad, and the h5ad's cells stored by column, CSC,
as R's dgCMatrix and files converted from it hold them), runs `materialize` with its defaults (a worker per usable
core) in a fresh process several times and reports the median cells/s, the peak RSS of the main
process and of its largest child (a worker process, or a shard writer) and the dataset's bytes per
cell next to the h5ad and parquet files of the same cells. A round times one whole conversion;
``window_s`` records how long it took (the median, and every round's). Corpora are generated on
first use into benchmarks/data/ (git-ignored).

    python benchmarks/bench_materialize.py --sizes 50000 200000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _provenance import add_window_options, check_window, compare, provenance, write_result  # noqa: E402

_CHILD = """
import json, resource, sys, time
from pathlib import Path
from materialize import materialize
start = time.perf_counter()
result = materialize(sys.argv[1], sys.argv[2], progress=False)
seconds = time.perf_counter() - start
m = result.manifest
print(json.dumps({"seconds": seconds, "num_cells": m.num_cells, "nnz": m.nnz,
                  "dataset_bytes": sum(s.num_bytes for s in m.shards) + sum(f.num_bytes for f in m.files),
                  "workers": result.workers,
                  "child_peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
                  "peak_rss_bytes": next(int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines()
                                         if l.startswith("VmHWM:"))}))  # not ru_maxrss: it survives fork + exec
"""


def corpus_dir(num_cells: int, *, h5ad: bool = True) -> Path:
    """``data/corpus_<N>k`` (seed 0), made on first use; with ``h5ad=False`` its parquet alone suffices."""
    path = HERE / "data" / f"corpus_{num_cells // 1000}k"
    if not (path / ("cells.h5ad" if h5ad else "cells.parquet")).exists():
        from materialize import make_synthetic_corpus

        print(f"generating {num_cells:,}-cell corpus in {path} ...", flush=True)
        make_synthetic_corpus(path, num_cells=num_cells, seed=0, progress=True, write_h5ad=h5ad)
    return path


def csc_h5ad(corpus: Path) -> Path:
    """``cells_csc.h5ad`` beside the corpus's ``cells.h5ad``: the same cells, X stored by column
    (made on first use, through anndata)."""
    path = corpus / "cells_csc.h5ad"
    if not path.exists():
        import anndata as ad

        print(f"writing {path} (X by column) ...", flush=True)
        adata = ad.read_h5ad(corpus / "cells.h5ad")
        adata.X = adata.X.tocsc()
        adata.write_h5ad(path.with_suffix(".tmp.h5ad"))
        path.with_suffix(".tmp.h5ad").rename(path)
    return path


def run_once(source: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(source), str(out)], capture_output=True, text=True, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[50_000, 200_000])
    add_window_options(p, seconds=None, rounds_flag="--repeats")
    p.add_argument("--out", default=str(HERE / "results" / "materialize.json"))
    args = p.parse_args()
    check_window(args, rounds_attr="repeats", rounds_flag="--repeats")
    rows = []
    with tempfile.TemporaryDirectory(dir=HERE / "data" if (HERE / "data").exists() else None) as tmp:
        for size in args.sizes:
            corpus = corpus_dir(size)
            inputs = {
                "parquet": corpus / "cells.parquet",
                "h5ad": corpus / "cells.h5ad",
                "h5ad (CSC)": csc_h5ad(corpus),
            }
            for fmt, source in inputs.items():
                runs = [run_once(source, Path(tmp) / "out") for _ in range(args.repeats)]
                first = runs[0]
                row = {
                    "label": f"{size:,} cells from {fmt}",
                    "num_cells": first["num_cells"],
                    "input": fmt,
                    "cells_per_s": statistics.median(r["num_cells"] / r["seconds"] for r in runs),
                    "cells_per_s_runs": [r["num_cells"] / r["seconds"] for r in runs],
                    "window_s": statistics.median(r["seconds"] for r in runs),
                    "window_s_runs": [r["seconds"] for r in runs],
                    "peak_rss_mib_max": max(r["peak_rss_bytes"] for r in runs) / 2**20,
                    "child_peak_rss_mib_max": max(r["child_peak_rss_bytes"] for r in runs) / 2**20,
                    "workers": first["workers"],
                    "nnz": first["nnz"],
                    "dataset_bytes_per_cell": first["dataset_bytes"] / first["num_cells"],
                    "h5ad_bytes_per_cell": (corpus / "cells.h5ad").stat().st_size / first["num_cells"],
                    "input_bytes_per_cell": source.stat().st_size / first["num_cells"],
                    "parquet_bytes_per_cell": (corpus / "cells.parquet").stat().st_size / first["num_cells"],
                }
                rows.append(row)
                print(
                    f"{size:>8,} cells from {fmt:7s}: {row['cells_per_s']:9,.0f} cells/s (median of "
                    f"{args.repeats}: {[round(v) for v in row['cells_per_s_runs']]}), peak RSS {row['peak_rss_mib_max']:6,.0f} MiB "
                    f"+ largest child {row['child_peak_rss_mib_max']:4,.0f} MiB, {row['workers']} worker(s), "
                    f"{row['dataset_bytes_per_cell']:,.0f} B/cell (h5ad {row['h5ad_bytes_per_cell']:,.0f}, "
                    f"parquet {row['parquet_bytes_per_cell']:,.0f})",
                    flush=True,
                )
    result = {
        "benchmark": "bench_materialize",
        **provenance(),
        "rounds": args.repeats,
        "window": "one whole conversion per round (window_s: its seconds)",
        "quick": args.quick,
        "rows": rows,
        "comparisons": [
            c
            for size in args.sizes
            for c in [
                compare(
                    f"{size:,} cells: h5ad stored by column (CSC) / by row (CSR)",
                    *(
                        next((r for r in rows if r["label"] == f"{size:,} cells from {f}"), None)
                        for f in ("h5ad (CSC)", "h5ad")
                    ),
                )
            ]
            if c is not None
        ],
    }
    write_result(args.out, result, quick=args.quick)


if __name__ == "__main__":
    main()

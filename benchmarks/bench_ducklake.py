"""Materialize from a DuckLake catalog against the same parquet files read directly.

The synthetic corpus (``data/corpus_<N>k``, seed 0) is loaded into a DuckLake table by DuckDB's own
ducklake extension (``.venv-ducklake``, scripts/setup-ducklake.sh): ``CREATE TABLE rna_cells AS``
writes the lake's parquet data files. Each round then materializes, in a fresh process with
`materialize`'s defaults, ``ducklake:lake.ducklake#rna_cells`` and the lake's own data files given
as a glob (the same bytes on disk, no catalog), alternating which goes first. The figure is the
median cells/s of each and their ratio (DuckLake ÷ direct); a round times one whole conversion,
whose seconds are ``window_s``; both must write the same shards (``same_shards``).

    python benchmarks/bench_ducklake.py --cells 400000 --rounds 3
    python benchmarks/bench_ducklake.py --cells 20000 --quick        (a smoke run, results not kept)
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
from _provenance import ROOT, add_window_options, check_window, provenance, write_result  # noqa: E402
from bench_materialize import corpus_dir  # noqa: E402

LAKE_PYTHON = ROOT / ".venv-ducklake" / "bin" / "python"

_BUILD = """
import pathlib, site, sys
import duckdb
ext = next(p for r in site.getsitepackages() for p in pathlib.Path(r).rglob("ducklake.duckdb_extension"))
con = duckdb.connect(config={"allow_unsigned_extensions": "true"})
con.execute(f"LOAD '{ext}'")
con.execute("ATTACH 'ducklake:lake.ducklake' AS lake (DATA_PATH 'data/')")
con.execute(f"CREATE TABLE lake.rna_cells AS SELECT * FROM read_parquet('{sys.argv[1]}')")
con.execute(f"CREATE TABLE lake.gene_metadata AS SELECT * FROM read_parquet('{sys.argv[2]}')")
"""

_CHILD = """
import json, sys, time
from materialize import materialize
start = time.perf_counter()
result = materialize(sys.argv[1], sys.argv[2], progress=False)
print(json.dumps({"seconds": time.perf_counter() - start, "num_cells": result.manifest.num_cells,
                  "shards": [s.sha256 for s in result.manifest.shards], "workers": result.workers}))
"""


def build_lake(corpus: Path, folder: Path) -> None:
    """The corpus as DuckLake table ``rna_cells`` (and its gene table) in ``folder``."""
    if not LAKE_PYTHON.exists():
        raise SystemExit(f"{LAKE_PYTHON} is missing; run scripts/setup-ducklake.sh")
    folder.mkdir(parents=True, exist_ok=True)
    args = [str(corpus / "cells.parquet"), str(corpus / "gene_metadata.parquet")]
    subprocess.run([str(LAKE_PYTHON), "-c", _BUILD, *args], cwd=folder, check=True)


def run_once(source: str, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, source, str(out)], capture_output=True, text=True, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _row(label: str, runs: list[dict]) -> dict:
    return {
        "label": label,
        "num_cells": runs[0]["num_cells"],
        "workers": runs[0]["workers"],
        "cells_per_s": statistics.median(r["num_cells"] / r["seconds"] for r in runs),
        "cells_per_s_runs": [r["num_cells"] / r["seconds"] for r in runs],
        "window_s": statistics.median(r["seconds"] for r in runs),
        "window_s_runs": [r["seconds"] for r in runs],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", type=int, default=400_000, help="corpus size (default 400,000)")
    add_window_options(p, seconds=None)
    p.add_argument("--out", default=str(HERE / "results" / "ducklake.json"))
    args = p.parse_args()
    check_window(args)
    if not LAKE_PYTHON.exists():  # before a corpus is made for nothing
        raise SystemExit(f"{LAKE_PYTHON} is missing; run scripts/setup-ducklake.sh")
    corpus = corpus_dir(args.cells, h5ad=False)
    with tempfile.TemporaryDirectory(dir=HERE / "data") as tmp:
        lake = Path(tmp) / "lake"
        build_lake(corpus, lake)
        files = sorted((lake / "data" / "main" / "rna_cells").glob("*.parquet"))
        sources = {
            "ducklake": f"ducklake:{lake / 'lake.ducklake'}#rna_cells",
            "parquet": str(files[0].parent / "*.parquet"),
        }
        runs: dict[str, list[dict]] = {name: [] for name in sources}
        for k in range(args.rounds):
            order = list(sources) if k % 2 == 0 else list(reversed(sources))
            for name in order:
                runs[name].append(run_once(sources[name], Path(tmp) / f"out-{name}"))
        rows = [_row(name, runs[name]) for name in sources]
    same = {tuple(r["shards"]) for rs in runs.values() for r in rs}
    ratio = rows[0]["cells_per_s"] / rows[1]["cells_per_s"]
    for row in rows:
        print(
            f"{row['num_cells']:>9,} cells from {row['label']:8s}: {row['cells_per_s']:9,.0f} cells/s (median of "
            f"{args.rounds}: {[round(v) for v in row['cells_per_s_runs']]}; {row['window_s']:.1f} s a round, "
            f"{row['workers']} worker(s))",
            flush=True,
        )
    print(f"DuckLake / direct parquet: {ratio:.3f} (target ≥ 0.9); same shards: {len(same) == 1}", flush=True)
    result = {
        "benchmark": "bench_ducklake",
        **provenance(),
        "rounds": args.rounds,
        "window": "one whole conversion per round (window_s: its seconds)",
        "quick": args.quick,
        "data_files": len(files),
        "same_shards": len(same) == 1,
        "ratio_ducklake_over_parquet": ratio,
        "rows": rows,
    }
    write_result(args.out, result, quick=args.quick)


if __name__ == "__main__":
    main()

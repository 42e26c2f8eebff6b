"""Query latencies per stage, gene lookup by scan vs inverted index, and the in-memory loaders.

On the 200k-cell × 62,710-gene synthetic corpus (the parquet bench_materialize.py makes) and a
hive-partitioned copy of it (``dataset=<plate>/``, written here once), warm page cache:

- stage 1 (scalar columns), stage 2 (``list_contains``), stage 3 (a 10-gene panel by SQL list
  indexing, a 2,000-gene panel by streaming + numba scatter), stage 4 (full rows streamed as
  CSR, with this process's peak RSS);
- a gene lookup by scan and by index for a rare, a middling and a common gene, plus the index
  build (time, size);
- the stream loader (query → dense / panel batches), and the in-memory 2,000-gene panel
  loaders: load time from the dense materialized dataset, host-RAM and on-device throughput.

Every latency is the median of ``--repeats`` runs in this one process; every loader throughput the
median of ``--rounds`` windows of at least ``--seconds`` (each a fresh loader, after a warm-up).

    .venv/bin/python benchmarks/bench_materialize.py --sizes 200000   # makes data/corpus_200k
    .venv/bin/python benchmarks/bench_query.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
DATA = HERE / "data"
sys.path.insert(0, str(HERE))
from _provenance import (  # noqa: E402
    add_window_options,
    check_window,
    medians,
    provenance,
    require_input,
    window,
    write_result,
)


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median seconds of ``repeats`` calls (after one warm-up call) and the last result."""
    result = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def make_hive(corpus: Path, out: Path) -> Path:
    """The corpus split by plate into ``dataset=plate_XX/part.parquet`` (row order kept per plate)."""
    import duckdb

    if out.exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    con = duckdb.connect()
    con.execute("SET preserve_insertion_order = true")
    plates = [r[0] for r in con.execute(f"SELECT DISTINCT batch FROM '{corpus}' ORDER BY 1").fetchall()]
    for plate in plates:
        folder = tmp / f"dataset={plate}"
        folder.mkdir(parents=True)
        con.execute(
            f"COPY (SELECT * EXCLUDE (dataset) FROM '{corpus}' WHERE batch = '{plate}') "
            f"TO '{folder / 'part.parquet'}' (FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE 8192)"
        )
    shutil.copy(corpus.parent / "gene_metadata.parquet", tmp / "gene_metadata.parquet")
    tmp.rename(out)
    return out


def bench_stages(table, hive, repeats: int) -> dict:
    out = {}

    def stream_all():
        n = nnz = 0
        for b in table.stream_csr(batch_rows=8192):
            n += b.num_rows
            nnz += len(b.indices)
        return n, nnz

    rss_before = peak_rss_bytes()  # stage 4 first, so the peak RSS after it is its own
    t, (n, nnz) = timed(stream_all, repeats)
    out["stage4_stream_csr_all_cells"] = {
        "seconds": t,
        "cells": n,
        "cells_per_s": n / t,
        "nnz": nnz,
        "peak_rss_mib_before": rss_before / 2**20,
        "peak_rss_mib_after": peak_rss_bytes() / 2**20,
    }
    t, rows = timed(lambda: table.select("tissue = 'lung'"), repeats)
    out["stage1_select_where_tissue"] = {"seconds": t, "cells": len(rows)}
    t, meta = timed(lambda: table.metadata(["cell_id", "cell_type", "drug"], rowids=rows), repeats)
    out["stage1_metadata_of_selected"] = {"seconds": t, "cells": meta.num_rows}
    t, rows_h = timed(lambda: hive.select("dataset = 'plate_03'"), repeats)
    out["stage1_hive_partition_pruned"] = {"seconds": t, "cells": len(rows_h), "files": len(hive.files)}
    t, rows_h_scan = timed(lambda: hive.select("batch = 'plate_03'"), repeats)
    out["stage1_hive_same_cells_no_pruning"] = {"seconds": t, "cells": len(rows_h_scan)}

    genes = table.genes.names([100, 1000])
    t, hits = timed(lambda: table.cells_expressing(genes, mode="all", use_index=False), repeats)
    out["stage2_list_contains_2_genes_all_cells"] = {"seconds": t, "cells": len(hits)}
    many = list(range(0, 4000, 100))  # 40 genes: list_has_any
    t, hits_many = timed(lambda: table.cells_expressing(many, mode="any", use_index=False), repeats)
    out["stage2_list_has_any_40_genes_all_cells"] = {"seconds": t, "cells": len(hits_many)}
    t, hits_lung = timed(
        lambda: table.cells_expressing(genes, mode="all", rowids=rows, use_index=False), repeats
    )
    out["stage2_list_contains_2_genes_lung_cells"] = {"seconds": t, "cells": len(hits_lung)}

    panel10 = table.genes.names(list(range(0, 1000, 100)))
    sel = rows[:1000]
    t, res = timed(lambda: table.panel(panel10, rowids=sel, method="sql"), repeats)
    out["stage3_sql_10_genes_1000_cells"] = {"seconds": t, "cells": len(res.rowids)}
    spread = np.sort(np.random.default_rng(0).choice(table.num_cells, 1000, replace=False))
    t, res = timed(lambda: table.panel(panel10, rowids=spread, method="sql"), repeats)
    out["stage3_sql_10_genes_1000_spread_cells"] = {"seconds": t, "cells": len(res.rowids)}
    t, res = timed(lambda: table.panel(panel10, rowids=rows, method="sql"), repeats)
    out["stage3_sql_10_genes_lung_cells"] = {"seconds": t, "cells": len(res.rowids)}
    t, res = timed(lambda: table.panel(panel10, rowids=rows, method="scatter"), repeats)
    out["stage3_scatter_10_genes_lung_cells"] = {"seconds": t, "cells": len(res.rowids)}
    panel2k = list(range(2000))
    t, res = timed(lambda: table.panel(panel2k, rowids=rows, method="scatter"), repeats)
    out["stage3_scatter_2000_genes_lung_cells"] = {"seconds": t, "cells": len(res.rowids)}

    return out


def bench_index(table, index_dir: Path, repeats: int) -> dict:
    from materialize import build_gene_index

    shutil.rmtree(index_dir, ignore_errors=True)
    start = time.perf_counter()
    info = build_gene_index(table, index_dir, progress=False)
    build = time.perf_counter() - start
    size = (index_dir / "gene_cell_index.parquet").stat().st_size
    table.attach_index(index_dir)
    freq = table.sql(
        "SELECT gene_token_id, sum(len(cell_rowids)) AS n FROM gene_cell_index GROUP BY 1 ORDER BY 2"
    )
    tokens = freq.column(0).to_numpy()  # by ascending number of cells
    picks = {
        "rare": int(tokens[len(tokens) // 10]),
        "middling": int(tokens[len(tokens) // 2]),
        "common": int(tokens[-1]),
    }
    lookups = {}
    for label, token in picks.items():
        t_scan, a = timed(lambda token=token: table.cells_expressing([token], use_index=False), repeats)
        t_index, b = timed(lambda token=token: table.cells_expressing([token], use_index=True), repeats)
        assert np.array_equal(a, b)
        lookups[label] = {
            "gene_token_id": token,
            "cells": len(a),
            "scan_s": t_scan,
            "index_s": t_index,
            "speedup": t_scan / t_index,
        }
    two = [picks["middling"], picks["common"]]
    t_scan, a = timed(lambda: table.cells_expressing(two, mode="all", use_index=False), repeats)
    t_index, b = timed(lambda: table.cells_expressing(two, mode="all", use_index=True), repeats)
    assert np.array_equal(a, b)
    lookups["middling_and_common_all"] = {
        "cells": len(a),
        "scan_s": t_scan,
        "index_s": t_index,
        "speedup": t_scan / t_index,
    }
    return {
        "build_seconds": build,
        "index_bytes": size,
        "postings": info["postings"],
        "bytes_per_posting": size / info["postings"],
        "parquet_bytes": sum(f.stat().st_size for f in table.files),
        "lookups": lookups,
    }


def bench_loaders(table, panel_dataset: Path, *, seconds: float, rounds: int) -> dict:
    """cells/s of the stream and in-memory loaders (the medians; ``<name>_runs``: every round's)."""
    import jax

    import omicsio_jax as oj

    out = {}

    def throughput(name, make, batch_size):
        """A query streamed to its end is started again inside the window (passes back to back)."""

        def run():
            its = [iter(make())]
            for _ in range(3):
                jax.block_until_ready(next(its[0]).x)

            def step() -> int:
                try:
                    batch = next(its[0])
                except StopIteration:
                    its[0] = iter(make())
                    batch = next(its[0])
                jax.block_until_ready(batch.x)
                return batch_size

            w = window(step, seconds=seconds)
            if hasattr(its[0], "close"):
                its[0].close()
            return {"cells_per_s": w.cells_per_s, "seconds": w.seconds}

        got = medians([run() for _ in range(rounds)], ("cells_per_s", "seconds"))
        out[name], out[f"{name}_runs"] = got["cells_per_s"], got["cells_per_s_runs"]
        out[f"{name}_window_s_runs"] = got["seconds_runs"]

    ds = oj.open_dataset(panel_dataset)
    panel = [str(g) for g in ds.features["gene_name"]]  # the dataset's 2,000 most detected genes
    shuffled = oj.Stream(shuffle=True, fetch_factor=16384 // 1024)  # a shuffle window of 16,384 cells
    throughput(
        "stream_dense_full_transcriptome_b1024",
        lambda: oj.make_stream_loader(table, batch_size=1024, sampling=shuffled),
        1024,
    )
    throughput(
        "stream_panel_2000_b1024",
        lambda: oj.make_stream_loader(table, batch_size=1024, output=oj.Panel(panel), sampling=shuffled),
        1024,
    )

    start = time.perf_counter()
    data = oj.load_panel(ds, obs=("batch",), progress=False)
    out["load_panel_dense_dataset_seconds"] = time.perf_counter() - start
    out["load_panel_cells"] = data.num_cells
    out["panel_gib"] = data.nbytes / 2**30
    start = time.perf_counter()
    from_table = oj.load_panel(table, panel, obs=("batch",), progress=False)
    out["load_panel_from_table_seconds"] = time.perf_counter() - start
    assert np.array_equal(from_table.x, data.x)
    del from_table
    for batch_size in (1024, 4096):
        for prefetch in (0, 2):
            throughput(
                f"memory_host_b{batch_size}_prefetch{prefetch}",
                lambda b=batch_size, p=prefetch: oj.make_memory_loader(
                    data, batch_size=b, num_epochs=None, read=oj.ReadOptions(prefetch=p)
                ),
                batch_size,
            )
        throughput(
            f"memory_device_b{batch_size}",
            lambda b=batch_size: oj.make_memory_loader(data, batch_size=b, num_epochs=None, on_device=True),
            batch_size,
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=str(DATA / "corpus_200k" / "cells.parquet"))
    p.add_argument("--panel-dataset", default=str(DATA / "ds_200k_panel2000"))
    p.add_argument(
        "--repeats",
        type=int,
        help="runs of each query latency, the median reported (default 5; 1 with --quick)",
    )
    add_window_options(p)
    p.add_argument("--out", default=str(HERE / "results" / "query.json"))
    args = p.parse_args()
    require_input(
        args.corpus, "benchmarks/bench_materialize.py --sizes 200000 (data/corpus_200k)", "--corpus"
    )
    require_input(
        args.panel_dataset, "benchmarks/bench_loader.py (data/ds_200k_panel2000)", "--panel-dataset"
    )
    check_window(args)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5

    import omicsio_jax as oj

    corpus = Path(args.corpus)
    hive_dir = make_hive(corpus, DATA / "hive_200k")
    table = oj.open_table(corpus)
    hive = oj.open_table(hive_dir)
    results = {
        "benchmark": "bench_query",
        **provenance(),
        "repeats": args.repeats,
        "rounds": args.rounds,
        "window_s": args.seconds,
        "quick": args.quick,
        "corpus": str(corpus),
        "cells": table.num_cells,
        "genes": len(table.genes),
    }
    results["stages"] = bench_stages(table, hive, args.repeats)
    print(json.dumps(results["stages"], indent=1))
    results["index"] = bench_index(table, DATA / "index_200k", args.repeats)
    print(json.dumps(results["index"], indent=1))
    results["loaders_cells_per_s"] = bench_loaders(
        table, Path(args.panel_dataset), seconds=args.seconds, rounds=args.rounds
    )
    print(json.dumps(results["loaders_cells_per_s"], indent=1))
    write_result(args.out, results, quick=args.quick)


if __name__ == "__main__":
    main()

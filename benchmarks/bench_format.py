"""ArrayRecord group size × compression on realistic single-cell records.

Encodes cells of the synthetic corpus with the omicsio record codec, writes them with each
writer option, and measures write speed, bytes per cell, and read+decode speed for the two access
patterns that matter: blocks of 16 consecutive cells (the loader's default block) and single
random cells (block_size=1, true random sampling). Reads are warm (page cache). Each speed is the
median of ``--rounds`` windows of at least ``--seconds`` (writes: the whole file, again and again).

    python benchmarks/bench_format.py --cells 40000 --out benchmarks/results/format.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

from omicsio_jax.format import codec
from omicsio_jax.format.arrow import list_to_csr

HERE = Path(__file__).parent
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

GROUP_SIZES = (1, 4, 16, 64)
COMPRESSIONS = ("zstd:3", "zstd:1", "zstd:-1", "zstd:-5", "snappy", "uncompressed")
NUM_COLUMNS = np.iinfo(np.int32).max  # the records' columns are the corpus's gene token ids: no bound


def load_records(parquet: Path, num_cells: int) -> list[bytes]:
    """The first ``num_cells`` cells of the corpus as encoded records."""
    table = pq.read_table(parquet, columns=["gene_token_id", "gene_expression"]).slice(0, num_cells)
    indptr, genes = list_to_csr(table.column("gene_token_id"))
    _, values = list_to_csr(table.column("gene_expression"))
    buf, starts = codec.encode_csr(indptr, genes.to_numpy(), values.to_numpy())
    data = buf.tobytes()
    return [data[starts[i] : starts[i + 1]] for i in range(len(starts) - 1)]


def measure(
    records: list[bytes],
    path: str,
    group_size: int,
    compression: str,
    seed: int,
    *,
    seconds: float,
    rounds: int,
) -> dict:
    options = f"group_size:{group_size},{compression}"
    n = len(records)

    def write() -> int:
        writer = ArrayRecordWriter(path, options)
        for record in records:
            writer.write(record)
        writer.close()
        return n

    writes = [window(write, seconds=seconds).cells_per_s for _ in range(rounds)]
    rng = np.random.default_rng(seed)
    reader = ArrayRecordReader(path, "readahead_buffer_size:256K,max_parallelism:0")

    def block() -> int:
        b = int(rng.integers(n // 16))
        codec.decode_csr(codec.Records.of(reader.read(b * 16, b * 16 + 16), NUM_COLUMNS))
        return 16

    def single() -> int:
        c = int(rng.integers(n))
        codec.decode_csr(codec.Records.of(reader.read(c, c + 1), NUM_COLUMNS))
        return 1

    runs = [
        {
            "write_cells_per_s": writes[r],
            "read_block16_cells_per_s": window(block, seconds=seconds).cells_per_s,
            "read_single_cells_per_s": window(single, seconds=seconds).cells_per_s,
        }
        for r in range(rounds)
    ]
    reader.close()
    return {
        "group_size": group_size,
        "compression": compression,
        "bytes_per_cell": os.path.getsize(path) / n,
        **medians(runs, ("write_cells_per_s", "read_block16_cells_per_s", "read_single_cells_per_s")),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--corpus", default=str(HERE / "data" / "corpus_200k"), help="made with `omicsio-materialize synth`"
    )
    p.add_argument("--cells", type=int, default=40_000)
    p.add_argument("--group-sizes", type=int, nargs="+", default=list(GROUP_SIZES))
    p.add_argument("--compressions", nargs="+", default=list(COMPRESSIONS))
    add_window_options(p)
    p.add_argument("--out", default=str(HERE / "results" / "format.json"))
    args = p.parse_args()
    require_input(
        Path(args.corpus) / "cells.parquet",
        "benchmarks/bench_materialize.py --sizes 200000 (data/corpus_200k)",
        "--corpus",
    )
    check_window(args)
    records = load_records(Path(args.corpus) / "cells.parquet", args.cells)
    raw = sum(len(r) for r in records) / len(records)
    # warm up the numba kernels
    codec.decode_csr(codec.Records.of(records[:16], NUM_COLUMNS))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for group_size in args.group_sizes:
            for compression in args.compressions:
                row = measure(
                    records,
                    f"{tmp}/x.ar",
                    group_size,
                    compression,
                    0,
                    seconds=args.seconds,
                    rounds=args.rounds,
                )
                rows.append(row)
                print(
                    f"gs {group_size:3d} {compression:13s} {row['bytes_per_cell']:8.0f} B/cell  "
                    f"write {row['write_cells_per_s']:9,.0f}/s  block16 {row['read_block16_cells_per_s']:9,.0f}/s  "
                    f"single {row['read_single_cells_per_s']:8,.0f}/s",
                    flush=True,
                )
    result = {
        "benchmark": "bench_format",
        **provenance(),
        "rounds": args.rounds,
        "window_s": args.seconds,
        "quick": args.quick,
        "cells": args.cells,
        "raw_record_bytes_per_cell": raw,
        "rows": rows,
    }
    write_result(args.out, result, quick=args.quick)


if __name__ == "__main__":
    main()

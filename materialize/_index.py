"""`build_gene_index`: the inverted gene → cells index of a list-column table, in bounded memory.

One pass streams ``gene_token_id`` (never the expression values) and the ``dataset`` column.
Rows are gathered until ``memory_budget`` bytes of postings, counting-sorted by (gene, dataset)
in numba and spilled as a run of memory-mapped ``.npy`` files. A merge then walks the key space
in ranges of about a million postings, concatenating each key's row ids from every run (runs
are in row order, so row ids stay ascending), and writes one parquet row group per range.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numba as nb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from omicsio_jax import CellTable, DataValidationError, OmicsIOError
from omicsio_jax.format import (
    GENE_COLUMN,
    INDEX_FILE,
    INDEX_FORMAT,
    INDEX_MANIFEST,
    ROWID_COLUMN,
    is_remote,
    list_to_csr,
    progress_bar,
)

from ._shards import atomic_output_dir

DATASET_COLUMN = "dataset"
ROW_GROUP_POSTINGS = 1 << 20


@nb.njit(nogil=True, cache=True)
def _count_keys(indptr, genes, dcodes, num_datasets, counts):
    for i in range(indptr.shape[0] - 1):
        d = dcodes[i]
        for j in range(indptr[i], indptr[i + 1]):
            counts[np.int64(genes[j]) * num_datasets + d] += 1


@nb.njit(nogil=True, cache=True)
def _place(indptr, genes, dcodes, rowids, num_datasets, cursor, out):
    """Counting-sort scatter: posting (gene, dataset, rowid) goes to ``out[cursor[key]++]``."""
    for i in range(indptr.shape[0] - 1):
        d = dcodes[i]
        r = rowids[i]
        for j in range(indptr[i], indptr[i + 1]):
            key = np.int64(genes[j]) * num_datasets + d
            out[cursor[key]] = r
            cursor[key] += 1


@nb.njit(nogil=True, cache=True)
def _merge_range(run_keys, run_ptr, run_ids, lo, hi, cursor, out):
    """Append run's postings for keys in [lo, hi) at ``out[cursor[key - lo]]``."""
    a = np.searchsorted(run_keys, lo)
    b = np.searchsorted(run_keys, hi)
    for k in range(a, b):
        key = run_keys[k]
        n = run_ptr[k + 1] - run_ptr[k]
        c = cursor[key - lo]
        out[c : c + n] = run_ids[run_ptr[k] : run_ptr[k + 1]]
        cursor[key - lo] = c + n


class _Runs:
    """Sorted runs of postings spilled to a scratch directory as ``.npy`` (read back memory-mapped)."""

    def __init__(self, scratch: Path, num_keys: int, id_dtype):
        self.scratch, self.num_keys, self.id_dtype = scratch, num_keys, id_dtype
        self.paths: list[tuple[Path, Path, Path]] = []
        self.totals = np.zeros(num_keys, np.int64)

    def spill(
        self, batches: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]], num_datasets: int
    ) -> None:
        counts = np.zeros(self.num_keys, np.int64)
        for indptr, genes, dcodes, _ in batches:
            _count_keys(indptr, genes, dcodes, num_datasets, counts)
        keys = np.flatnonzero(counts)
        ptr = np.zeros(len(keys) + 1, np.int64)
        np.cumsum(counts[keys], out=ptr[1:])
        cursor = np.zeros(self.num_keys, np.int64)
        cursor[keys] = ptr[:-1]
        out = np.empty(int(ptr[-1]), self.id_dtype)
        for indptr, genes, dcodes, rowids in batches:
            _place(indptr, genes, dcodes, rowids.astype(self.id_dtype), num_datasets, cursor, out)
        self.totals += counts
        stem = self.scratch / f"run-{len(self.paths):05d}"
        paths = (stem.with_suffix(".keys.npy"), stem.with_suffix(".ptr.npy"), stem.with_suffix(".ids.npy"))
        for path, arr in zip(paths, (keys, ptr, out), strict=True):
            np.save(path, arr)
        self.paths.append(paths)

    def ranges(self) -> list[tuple[int, int]]:
        """Key ranges holding about ROW_GROUP_POSTINGS postings each (one key may exceed it alone)."""
        cum = np.cumsum(self.totals)
        out, lo = [], 0
        while lo < self.num_keys:
            base = cum[lo - 1] if lo else 0
            hi = int(np.searchsorted(cum, base + ROW_GROUP_POSTINGS, side="right"))
            hi = min(max(hi, lo + 1), self.num_keys)
            out.append((lo, hi))
            lo = hi
        return out


def build_gene_index(
    source: str | CellTable,
    out: str | Path,
    *,
    overwrite: bool = False,
    memory_budget: int = 512 << 20,
    batch_rows: int = 8192,
    progress: bool = True,
) -> dict:
    """Write ``out/gene_cell_index.parquet`` and ``out/index.json`` for a list-column table.

    ``source`` is anything `omicsio_jax.open_table` opens (or an open `CellTable`). The
    ``dataset`` column (a hive partition or a real column) groups the postings; a table without
    one is a single dataset named after the input. ``memory_budget`` bounds the postings held
    in RAM before a run is spilled. Like `materialize`, the output appears complete or not at all.
    Returns the summary written to ``index.json``.
    """
    if is_remote(str(out)):  # (a local path of its text, "s3:/bucket", was written after the whole build)
        msg = f"the index is written to a local folder, and {out} is on object storage: give a local OUT"
        raise OmicsIOError(msg)
    table = source if isinstance(source, CellTable) else CellTable(source)
    start = time.perf_counter()
    has_dataset = DATASET_COLUMN in table.scalar_columns
    datasets = (
        table.categories(DATASET_COLUMN) if has_dataset else [Path(table.spec.rstrip("/")).stem or "cells"]
    )
    datasets = [str(d) for d in datasets]
    if (
        has_dataset
        and table.sql(f"SELECT count(*) FROM cells WHERE {DATASET_COLUMN} IS NULL").column(0)[0].as_py()
    ):
        msg = f"{table.spec}: some cells have a null {DATASET_COLUMN}; the index needs one per cell"
        raise DataValidationError(msg)
    num_datasets = len(datasets)
    code_of = {d: i for i, d in enumerate(datasets)}
    num_tokens = table.genes.num_tokens
    id_dtype = np.uint32 if table.num_cells < (1 << 32) else np.int64
    budget_postings = max(memory_budget // (np.dtype(id_dtype).itemsize * 3), 1)  # ids + batch lists + sort
    columns = [GENE_COLUMN, *([DATASET_COLUMN] if has_dataset else [])]
    with (
        tempfile.TemporaryDirectory(prefix="omicsio-index-") as scratch,
        atomic_output_dir(Path(out), overwrite=overwrite, manifest=INDEX_MANIFEST) as tmp,
    ):
        runs = _Runs(Path(scratch), max(num_tokens, 1) * num_datasets, id_dtype)
        pending, held, nnz = [], 0, 0
        bar = progress_bar(
            total=table.num_cells, unit="cells", desc="index", progress=progress, unit_scale=True
        )
        for rb in table.stream(columns, batch_rows=batch_rows):
            indptr, genes = list_to_csr(rb.column(GENE_COLUMN))
            genes = genes.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
            if len(genes) and (genes.min() < 0 or genes.max() >= num_tokens):
                msg = (
                    f"{table.spec}: gene_token_id {int(genes.max() if genes.max() >= num_tokens else genes.min())}"
                    f" is outside the gene table (0..{num_tokens - 1})"
                )
                raise DataValidationError(msg)
            if has_dataset:
                enc = rb.column(DATASET_COLUMN).cast(pa.string()).dictionary_encode()
                lut = np.array([code_of[v] for v in enc.dictionary.to_pylist()], np.int32)
                dcodes = (
                    lut[enc.indices.to_numpy(zero_copy_only=False)] if len(lut) else np.zeros(0, np.int32)
                )
            else:
                dcodes = np.zeros(rb.num_rows, np.int32)
            rowids = rb.column(ROWID_COLUMN).to_numpy().astype(np.int64)
            pending.append((indptr, genes, dcodes, rowids))
            held += len(genes)
            nnz += len(genes)
            if held >= budget_postings:
                runs.spill(pending, num_datasets)
                pending, held = [], 0
            bar.update(rb.num_rows)
        if pending:
            runs.spill(pending, num_datasets)
        bar.close()
        _write_index(tmp / INDEX_FILE, runs, datasets, num_datasets, progress)
        info = {
            "format": INDEX_FORMAT,
            "table": table.fingerprint(),
            "num_cells": table.num_cells,
            "num_genes": num_tokens,
            "datasets": datasets,
            "postings": int(nnz),
            "rows": int(np.count_nonzero(runs.totals)),
            "seconds": round(time.perf_counter() - start, 2),
        }
        (tmp / INDEX_MANIFEST).write_text(json.dumps(info, indent=1) + "\n")
    return info


def _write_index(path: Path, runs: _Runs, datasets: list[str], num_datasets: int, progress: bool) -> None:
    opened = [tuple(np.load(p, mmap_mode="r") for p in paths) for paths in runs.paths]
    schema = pa.schema(
        [("gene_token_id", pa.int32()), ("dataset", pa.string()), ("cell_rowids", pa.list_(pa.int64()))]
    )
    dataset_names = pa.array(datasets, pa.string())
    writer = pq.ParquetWriter(
        path,
        schema,
        compression="zstd",
        use_dictionary=["dataset"],
        column_encoding={
            "gene_token_id": "DELTA_BINARY_PACKED",
            "cell_rowids.list.element": "DELTA_BINARY_PACKED",
        },
    )
    try:
        for lo, hi in progress_bar(runs.ranges(), desc="write index", progress=progress, unit="groups"):
            counts = runs.totals[lo:hi]
            keys = np.flatnonzero(counts)
            if len(keys) == 0:
                continue
            ptr = np.zeros(hi - lo + 1, np.int64)
            np.cumsum(counts, out=ptr[1:])
            cursor = ptr[:-1].copy()
            ids = np.empty(int(ptr[-1]), runs.id_dtype)
            for run_keys, run_ptr, run_ids in opened:
                _merge_range(run_keys, run_ptr, run_ids, lo, hi, cursor, ids)
            offsets = np.concatenate([ptr[keys], ptr[-1:]]).astype(np.int32)
            absolute = keys + lo
            rows = pa.table(
                {
                    "gene_token_id": pa.array((absolute // num_datasets).astype(np.int32)),
                    "dataset": dataset_names.take(pa.array((absolute % num_datasets).astype(np.int32))),
                    "cell_rowids": pa.ListArray.from_arrays(
                        pa.array(offsets), pa.array(ids.astype(np.int64))
                    ),
                },
                schema=schema,
            )
            writer.write_table(rows, row_group_size=len(keys))
    finally:
        writer.close()

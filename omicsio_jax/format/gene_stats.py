"""Corpus statistics: per cell ``n_counts`` / ``n_genes``, per gene moments and a median histogram.

Computed from the encoded records in one streaming pass (`StatsAccumulator`: at materialize, or by
``omicsio-materialize stats`` from the shards of an older dataset) and stored as
``gene_stats.parquet``, one row per gene column (with its median read off the histogram beside it,
for readers that need no more: `read_gene_medians`). Counts and histograms merge exactly; float sums
are added shard by shard in shard order, so materialize's partitions (a shard each) give the same
bits however they are spread over workers. (`GeneStats.merge` of parts of several shards each adds
their sums, which agree with one pass to rounding only.)

Per gene: ``n_cells`` (cells with a nonzero value), ``sum`` / ``sum_sq`` of the raw values,
``norm_sum`` / ``norm_sum_sq`` of ``x = value / n_counts · 1e4`` (scanpy's ``normalize_total``),
``log_sum`` / ``log_sum_sq`` of ``log1p(x)``, and a histogram of the positive ``x`` on a log scale
with 40 bins per octave over [2^-14, 2^14) (values outside are clamped into the end bins). Negative
values (``allow_negative``) count in the sums as scanpy's ``normalize_total`` + ``log1p`` and the
loader treat them (a row of negative total divides too, ``log1p`` below −1 is NaN; a row of total 0
adds 0). The nonzero median read off the histogram (geometric centre of the bin holding each
middle rank) is within a relative error of ``2^(1/80) − 1 = 0.87%`` of the exact median
(`MEDIAN_RELATIVE_ERROR`) whenever the middle values lie inside the range; counts ≥ 1 with
``n_counts`` ≤ 1.6·10^8 always do.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from omicsio_jax.core.buffers import RowBuffers
from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.format.stats_kernels import (
    BINS_PER_OCTAVE,
    LOW_EXPONENT,
    NUM_BINS,
    count_dtype,
    csr_into_dense,
    dense_to_csr,
    empty_span,
    medians_of,
)

STATS_NAME = "gene_stats.parquet"
MEDIAN = "median"  # the column of `GeneStats.medians` (files written before it have none)
TARGET_SUM = 1e4
MEDIAN_RELATIVE_ERROR = 2.0 ** (1.0 / (2 * BINS_PER_OCTAVE)) - 1.0
_SUMS = ("sum", "sum_sq", "norm_sum", "norm_sum_sq", "log_sum", "log_sum_sq")


@dataclasses.dataclass
class GeneStats:
    """Mergeable corpus statistics of ``num_cells`` cells over a dataset's gene columns.

    ``sums``: float64 ``(6, genes)`` in the order of ``_SUMS``; ``hist_ptr`` / ``hist_bins`` /
    ``hist_counts``: each gene's nonzero histogram bins as CSR (counts of any integer type; built
    from a dense table they come in the narrowest that holds them, `count_dtype`).
    """

    num_cells: int
    n_cells: np.ndarray
    sums: np.ndarray
    hist_ptr: np.ndarray
    hist_bins: np.ndarray
    hist_counts: np.ndarray

    @property
    def num_genes(self) -> int:
        return len(self.n_cells)

    def dense_hist(self) -> np.ndarray:
        """The histograms as ``(genes, bins)`` int64."""
        out = np.zeros((self.num_genes, NUM_BINS), np.int64)
        genes = np.repeat(np.arange(self.num_genes), np.diff(self.hist_ptr))
        out[genes, self.hist_bins] = self.hist_counts
        return out

    @classmethod
    def from_dense(
        cls,
        num_cells: int,
        n_cells: np.ndarray,
        sums: np.ndarray,
        hist: np.ndarray,
        span: np.ndarray | None = None,
        buffers: RowBuffers | None = None,
    ) -> GeneStats:
        """From ``(genes, bins)`` histograms, whose nonzero bins lie within ``span`` (`empty_span`,
        as `add_to_dense` widens it; default: anywhere); the histogram's arrays in ``buffers``' memory, if given."""
        ptr, bins, counts = dense_to_csr(hist, span, buffers)
        return cls(int(num_cells), n_cells.astype(np.int64), sums.astype(np.float64), ptr, bins, counts)

    _FIELDS = ("num_cells", "n_cells", "sums", "hist_ptr", "hist_bins", "hist_counts")

    def save(self, path: str | Path) -> None:
        """The statistics of a partition (merged at finalize; the dataset's own file is `write`'s
        parquet): the arrays one after another in NumPy's ``.npy`` format, in one file. An ``.npz``
        archive of the same arrays took twice as long, through its zip layer. Histogram counts are
        stored in the narrowest unsigned type that holds them (a partition of 16,384 cells: uint16,
        4 instead of 10 bytes per entry)."""
        top = int(self.hist_counts.max()) if len(self.hist_counts) else 0
        arrays = dataclasses.replace(self, hist_counts=self.hist_counts.astype(count_dtype(top), copy=False))
        path = Path(path)
        staged = path.with_name(f".{path.name}.tmp")
        with open(staged, "wb") as f:
            for name in self._FIELDS:
                np.save(f, np.asarray(getattr(arrays, name)), allow_pickle=False)
        os.replace(staged, path)  # a new file: a `load` mapping the one it replaces keeps reading it

    @classmethod
    def load(cls, path: str | Path) -> GeneStats:
        """`save`'s file, its arrays mapped read-only from the file rather than read into fresh
        memory (a partition's are ~28 MB); the counts keep the type they were stored in."""
        places = []
        with open(path, "rb") as f:
            for _ in cls._FIELDS:
                shape, fortran, dtype = _NPY_HEADERS[np.lib.format.read_magic(f)](f)
                places.append((shape, dtype, f.tell(), "F" if fortran else "C"))
                f.seek(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, os.SEEK_CUR)
        mapped = np.memmap(path, np.uint8, "r")  # one mapping of the file; each array a view into it
        arrays = {
            name: np.ndarray(shape, dtype, mapped, offset, order=order)
            for name, (shape, dtype, offset, order) in zip(cls._FIELDS, places, strict=True)
        }
        return cls(**{**arrays, "num_cells": int(arrays["num_cells"])})

    def add_to_dense(
        self, hist: np.ndarray, span: np.ndarray | None = None, genes: tuple[int, int] | None = None
    ) -> None:
        """``hist[gene, bin] += count`` for every histogram entry (merging into a dense accumulator),
        widening each gene's ``span`` of bins in use (`empty_span`) to its entries; with ``genes``
        ``(lo, hi)``, those of genes ``lo..hi-1`` alone (threads may add disjoint gene ranges at
        once: the kernel releases the GIL)."""
        if span is None:
            span = empty_span(self.num_genes)
        lo, hi = (0, self.num_genes) if genes is None else genes
        csr_into_dense(self.hist_ptr, self.hist_bins, self.hist_counts, hist, span, lo, hi)

    def gene_blocks(self, n: int) -> list[tuple[int, int]]:
        """``n`` consecutive gene ranges ``(lo, hi)`` holding about equal shares of the histogram
        entries (for `add_to_dense` on ``n`` threads); empty ones left out."""
        cuts = np.searchsorted(self.hist_ptr, np.linspace(0, self.hist_ptr[-1], n + 1)[1:-1])
        edges = [0, *(int(c) for c in cuts), self.num_genes]
        return [(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True) if a < b]

    def merge(self, other: GeneStats) -> GeneStats:
        """The statistics of both sets of cells (same gene columns): counts and histograms add, sums add."""
        if other.num_genes != self.num_genes:
            msg = f"cannot merge statistics over {self.num_genes:,} and {other.num_genes:,} gene columns"
            raise OmicsIOError(msg)
        hist, span = np.zeros((self.num_genes, NUM_BINS), np.int64), empty_span(self.num_genes)
        self.add_to_dense(hist, span)
        other.add_to_dense(hist, span)
        return GeneStats.from_dense(
            self.num_cells + other.num_cells, self.n_cells + other.n_cells, self.sums + other.sums, hist, span
        )

    def medians(self) -> np.ndarray:
        """Each gene's nonzero median of ``value / n_counts · 1e4`` (NaN for genes never expressed),
        within `MEDIAN_RELATIVE_ERROR` of the exact median."""
        centres = 2.0 ** ((np.arange(NUM_BINS) + 0.5) / BINS_PER_OCTAVE + LOW_EXPONENT)
        return medians_of(np.asarray(self.hist_ptr, np.int64), self.hist_bins, self.hist_counts, centres)

    def frame(self, n_measured: np.ndarray | None = None):
        """A pandas DataFrame, one row per gene column: counts, sums, means, variances (ddof=1), median.

        ``n_measured``: per gene, the cells whose source measured it (a collection's
        `GenePresence.measuring_cells`; default: every cell). Means and variances are over those
        cells alone, so a gene some sources did not measure is not read as zero in their cells; NaN
        for a gene no cell measured."""
        import pandas as pd

        if n_measured is None:
            n_measured = np.full(self.num_genes, self.num_cells, np.int64)
        n_measured = np.asarray(n_measured, np.int64)
        if n_measured.shape != (self.num_genes,):
            msg = f"n_measured holds {n_measured.shape} values for {self.num_genes:,} gene columns"
            raise OmicsIOError(msg)
        df = pd.DataFrame(
            {"n_cells": self.n_cells, "n_measured": n_measured, **dict(zip(_SUMS, self.sums, strict=True))}
        )
        n = np.where(n_measured > 0, n_measured, np.nan)
        for prefix in ("", "norm_", "log_"):
            mean = df[f"{prefix}sum"] / n
            df[f"{prefix}mean"] = mean
            # from one pass's sums: clamped at 0, where a constant gene's rounding left -1e-15 (a NaN
            # standard deviation); the cancellation's relative error grows as var / mean² shrinks
            var = (df[f"{prefix}sum_sq"] / n - mean**2) * (n / np.maximum(n - 1, 1))
            df[f"{prefix}var"] = var.clip(lower=0)
        df["median"] = self.medians()
        return df

    def write(self, path: str | Path) -> None:
        """The dataset's ``gene_stats.parquet`` (the arrays handed to Arrow in place: `from_numpy`).
        Each gene's histogram is two binary values, its bins' uint16 and its counts' bytes (the
        counts' type in the file's metadata), not two list columns, whose levels Parquet encodes
        and decodes entry by entry: a file of 9.0M histogram entries is written and read back in
        about half the time (``benchmarks/results/stats_file.json``). `read` reads both layouts."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        from omicsio_jax.format.arrow import from_numpy

        table = pa.table(
            {
                "n_cells": from_numpy(self.n_cells),
                **{name: from_numpy(self.sums[k]) for k, name in enumerate(_SUMS)},
                "hist_bins": _per_gene_bytes(self.hist_ptr, np.asarray(self.hist_bins, np.uint16)),
                "hist_counts": _per_gene_bytes(self.hist_ptr, self.hist_counts),
                MEDIAN: from_numpy(self.medians()),  # `read_gene_medians` reads this column alone
            }
        )
        meta = {
            "num_cells": self.num_cells,
            "target_sum": TARGET_SUM,
            "bins_per_octave": BINS_PER_OCTAVE,
            "low_exponent": LOW_EXPONENT,
            "num_bins": NUM_BINS,
            "hist_counts_dtype": np.dtype(self.hist_counts.dtype).str,  # e.g. "<u2"
        }
        table = table.replace_schema_metadata({"omicsio_jax.gene_stats": json.dumps(meta)})
        # the histograms take no dictionary (trying one, then falling back, costs time for nothing)
        pq.write_table(table, path, compression="zstd", use_dictionary=["n_cells"])

    @classmethod
    def read(cls, path: str | Path) -> GeneStats:
        """`write`'s file (one file, so ``ParquetFile``: ``read_table`` imports pyarrow's datasets,
        and pandas with them)."""
        import pyarrow.parquet as pq

        from omicsio_jax.format.arrow import to_numpy

        table = pq.ParquetFile(path).read()
        meta = json.loads(table.schema.metadata[b"omicsio_jax.gene_stats"])
        layout = (meta["bins_per_octave"], meta["low_exponent"], meta["num_bins"])
        if layout != (BINS_PER_OCTAVE, LOW_EXPONENT, NUM_BINS):
            msg = f"{path}: histogram layout {meta} is not this version's; rerun `omicsio-materialize stats`"
            raise OmicsIOError(msg)
        bins = table.column("hist_bins").combine_chunks()
        counts = table.column("hist_counts").combine_chunks()
        if "hist_counts_dtype" in meta:  # one binary value per gene (`write`)
            ptr, bins = _from_per_gene_bytes(bins, np.uint16)
            _, counts = _from_per_gene_bytes(counts, np.dtype(meta["hist_counts_dtype"]))
        else:  # files of earlier versions: two list columns
            ptr, bins, counts = (
                to_numpy(bins.offsets).astype(np.int64),
                to_numpy(bins.values),
                to_numpy(counts.values),
            )
        return cls(
            int(meta["num_cells"]),
            to_numpy(table.column("n_cells")),
            np.stack([to_numpy(table.column(name)) for name in _SUMS]),
            ptr,
            bins,
            counts,
        )


def _per_gene_bytes(ptr: np.ndarray, values: np.ndarray):
    """CSR ``values`` as one Arrow large_binary value per row: the rows' bytes, in place."""
    import pyarrow as pa

    values = np.ascontiguousarray(values)
    offsets = np.asarray(ptr, np.int64) * values.dtype.itemsize
    return pa.Array.from_buffers(
        pa.large_binary(), len(offsets) - 1, [None, pa.py_buffer(offsets), pa.py_buffer(values)]
    )


def _from_per_gene_bytes(column, dtype) -> tuple[np.ndarray, np.ndarray]:
    """`_per_gene_bytes`'s column back as CSR: the row pointer and the values (``dtype``)."""
    import pyarrow as pa

    dtype = np.dtype(dtype)
    column = column.cast(pa.large_binary()) if column.type != pa.large_binary() else column
    offsets = np.frombuffer(column.buffers()[1], np.int64)[column.offset : column.offset + len(column) + 1]
    buffer = column.buffers()[2]  # None: no gene has a histogram entry
    data = np.frombuffer(buffer, np.uint8) if buffer is not None else np.empty(0, np.uint8)
    data = data[offsets[0] : offsets[-1]]
    values = data.view(dtype) if data.ctypes.data % dtype.alignment == 0 else data.copy().view(dtype)
    return (offsets - offsets[0]) // dtype.itemsize, values


_NPY_HEADERS = {  # the .npy header readers by format version (np.save writes 1.0, or 2.0 for a huge header)
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
}


def _stats_path(dataset) -> Path:
    listed = any(f.path == STATS_NAME for f in dataset.manifest.files)
    path = dataset.local_path(STATS_NAME) if listed else None
    if path is None or not path.exists():
        msg = (
            f"{dataset.path} has no gene statistics (it was materialized before they existed); "
            f"add them with `omicsio-materialize stats {dataset.path}`"
        )
        raise OmicsIOError(msg)
    return path


def read_gene_stats(dataset) -> GeneStats:
    """The `GeneStats` of a `Dataset`; a one-line error naming the fix when it has none."""
    return GeneStats.read(_stats_path(dataset))


def read_gene_medians(dataset) -> np.ndarray:
    """`GeneStats.medians` of a `Dataset`: its statistics file's median column alone (~0.5 MB for
    60k genes, where the histograms it is read off are tens of MB), or read off the histograms in a
    file written before the column; a one-line error naming the fix when it has no statistics."""
    import pyarrow.parquet as pq

    from omicsio_jax.format.arrow import to_numpy

    path = _stats_path(dataset)
    file = pq.ParquetFile(path)
    if MEDIAN in file.schema_arrow.names:
        return to_numpy(file.read(columns=[MEDIAN]).column(0))
    return GeneStats.read(path).medians()

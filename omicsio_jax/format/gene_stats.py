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

import numba as nb
import numpy as np

from omicsio_jax.core.buffers import RowBuffers, aligned_empty, read_only
from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.core.kernels import prefetch
from omicsio_jax.format import codec

STATS_NAME = "gene_stats.parquet"
MEDIAN = "median"  # the column of `GeneStats.medians` (files written before it have none)
TARGET_SUM = 1e4
BINS_PER_OCTAVE = 40
LOW_EXPONENT = -14
NUM_BINS = 28 * BINS_PER_OCTAVE
MEDIAN_RELATIVE_ERROR = 2.0 ** (1.0 / (2 * BINS_PER_OCTAVE)) - 1.0
_SUMS = ("sum", "sum_sq", "norm_sum", "norm_sum_sq", "log_sum", "log_sum_sq")


_TABLE = 64  # integer counts up to this use per-cell tables of log1p and histogram bins
_AHEAD = 64  # entries ahead whose cache lines `_accumulate` and `_apply_hist` ask for
_ROWS_AHEAD = 4  # genes ahead whose histogram rows the per-gene passes ask for


@nb.njit(inline="always")
def _bin(x):
    b = np.int64(np.floor((np.log2(x) - LOW_EXPONENT) * BINS_PER_OCTAVE))
    return min(max(b, 0), NUM_BINS - 1)


@nb.njit(inline="always")
def _log_and_bin(v, x, log_table, bin_table):
    """``log1p(x)`` and the histogram bin of ``x = v · scale``: from the cell's tables when ``v`` is
    an integer count up to `_TABLE`."""
    c = np.int64(v)
    if c == v and c <= _TABLE:
        return log_table[c], bin_table[c]
    return np.log1p(x), _bin(x)


@nb.njit(inline="always")
def _prefetch_bins(hist, g, lo, hi):
    """Ask for the cache lines of ``hist[g, lo : hi + 1]`` (`prefetch`): a per-gene pass names the
    row a few genes ahead, whose start the hardware's prefetcher cannot guess (it follows one
    stream, and each gene's bins start at a new place of a table far larger than the caches)."""
    step = 64 // hist.itemsize
    base = np.int64(g) * hist.shape[1]
    for b in range(lo, hi + step, step):
        prefetch(hist, base + min(b, hi))


@nb.njit(inline="always")
def _prefetch_span_ahead(hist, span, g):
    """`_prefetch_bins` of the ``span`` of the row `_ROWS_AHEAD` genes after ``g`` (the last row at the end)."""
    ahead = min(g + _ROWS_AHEAD, hist.shape[0] - 1)
    _prefetch_bins(hist, ahead, span[ahead, 0], span[ahead, 1])


@nb.njit(inline="always")
def _add_raw(acc, g, v):
    g = np.uint32(g)  # unsigned: numba tests a signed index for wrapping around from the end
    acc[g, 6] += 1.0
    acc[g, 0] += v
    acc[g, 1] += v * v


@nb.njit(inline="always")
def _add_normalized(acc, g, x, lx):
    g = np.uint32(g)
    acc[g, 2] += x
    acc[g, 3] += x * x
    acc[g, 4] += lx
    acc[g, 5] += lx * lx


@nb.njit(nogil=True, cache=True)
def _accumulate(u8, u32, f32, starts, target_sum, n_counts, n_genes, acc, codes):
    """Per cell: ``n_counts``, ``n_genes``; per gene: ``acc[g]`` += (sum, sum_sq, norm_sum, norm_sum_sq,
    log_sum, log_sum_sq, n_cells); histogram increments as ``g << 11 | bin`` into ``codes`` (returns
    how many).

    One row of ``acc`` per gene (64-byte aligned) keeps a nonzero's seven updates in one cache
    line, fetched `_AHEAD` entries early (`prefetch`: the 4 MiB of sums miss the cache at random;
    per nonzero, 1,500 nonzeros per cell, measured on a 2-core AMD EPYC: 40 ns without, 15.7 ns
    16 entries ahead, 10.7 ns 64 ahead). A cell whose values are all
    positive (counts: nearly every cell) takes three loops, each doing one thing: its normalized
    and log values, then the sums, then its histogram codes (a code stored inside the sums' loop
    cost as much as the seven sums: 11 → 5.7 ns per nonzero measured); any other cell one loop
    with the tests."""
    width = 1
    for i in range(starts.shape[0]):
        width = max(width, np.int64(u32[starts[i] // 4 + 1]))
    cols = np.empty(width, np.int32)
    vals = np.empty(width, np.float32)
    xs = np.empty(width, np.float64)
    logs = np.empty(width, np.float64)
    bins = np.empty(width, np.uint32)
    log_table = np.empty(_TABLE + 1)
    bin_table = np.empty(_TABLE + 1, np.int64)
    stride = acc.shape[1]
    m = 0
    for i in range(starts.shape[0]):
        count = codec.decode_one(u8, u32, f32, starts[i], cols, vals, 0)
        for j in range(min(count, _AHEAD)):
            prefetch(acc, np.int64(cols[j]) * stride)
        total = 0.0
        nonzero = 0
        positive = True
        for j in range(count):
            total += np.float64(vals[j])
            nonzero += vals[j] != 0
            positive &= vals[j] > 0
        n_counts[i] = total
        n_genes[i] = nonzero
        scale = target_sum / total if total != 0 else 0.0  # a negative total (negative values) divides too
        if scale > 0:
            for c in range(1, _TABLE + 1):
                log_table[c] = np.log1p(c * scale)
                bin_table[c] = _bin(c * scale)
        if positive and scale > 0:
            for j in range(count):
                v = np.float64(vals[j])
                xs[j] = v * scale
                logs[j], bins[j] = _log_and_bin(v, xs[j], log_table, bin_table)
            for j in range(count):
                if j + _AHEAD < count:
                    prefetch(acc, np.int64(cols[j + _AHEAD]) * stride)
                _add_raw(acc, cols[j], np.float64(vals[j]))
                _add_normalized(acc, cols[j], xs[j], logs[j])
            out = codes[m : m + count]
            for j in range(count):
                out[j] = (np.uint32(cols[j]) << np.uint32(11)) | bins[j]
            m += count
            continue
        for j in range(count):
            if j + _AHEAD < count:
                prefetch(acc, np.int64(cols[j + _AHEAD]) * stride)
            g = cols[j]
            v = np.float64(vals[j])
            if v == 0:
                continue
            _add_raw(acc, g, v)
            if scale == 0:  # a row whose total is 0 stays 0
                continue
            x = v * scale
            if x > 0:  # the tables hold a positive scale's values
                lx, b = _log_and_bin(v, x, log_table, bin_table) if scale > 0 else (np.log1p(x), _bin(x))
                codes[m] = (np.uint32(g) << np.uint32(11)) | np.uint32(b)
                m += 1
            else:  # a negative value of a row whose total is positive, or the reverse
                lx = np.log1p(x)
            _add_normalized(acc, g, x, lx)
    return m


@nb.njit(nogil=True, cache=True)
def _apply_hist(codes, m, tmp, hist, span, spill):
    """``hist[g, bin] += 1`` for each code, widening ``span[g]`` (its lowest and highest bin in
    use), grouped by blocks of 64 genes first so the increments of a block land in 140 KiB of the
    table instead of all over it (3× faster than in arrival order). A bin already at its type's
    largest count keeps it, and the code goes to ``spill`` instead; returns how many did."""
    blocks = (hist.shape[0] >> 6) + 1
    starts = np.zeros(blocks + 1, np.int64)
    for i in range(m):
        starts[(codes[i] >> np.uint32(17)) + np.uint32(1)] += 1
    for k in range(blocks):
        starts[k + 1] += starts[k]
    for i in range(m):
        block = codes[i] >> np.uint32(17)
        tmp[np.uint64(starts[block])] = codes[i]
        starts[block] += 1
    full = np.iinfo(hist.dtype).max
    spilled = 0
    bins = hist.shape[1]
    for i in range(m):
        if i + _AHEAD < m:  # the line of an increment `_AHEAD` ahead (first touches miss: 12.6 → 9.9 ns)
            ahead = tmp[i + _AHEAD]
            prefetch(hist, np.int64(ahead >> np.uint32(11)) * bins + np.int64(ahead & np.uint32(2047)))
        g, b = tmp[i] >> np.uint32(11), tmp[i] & np.uint32(2047)  # unsigned indices (`_add_raw`)
        h = hist[g, b]
        if h == full:
            spill[spilled] = tmp[i]
            spilled += 1
        else:
            hist[g, b] = h + 1
        span[g, 0] = min(span[g, 0], np.int32(b))
        span[g, 1] = max(span[g, 1], np.int32(b))
    return spilled


@nb.njit(nogil=True, cache=True)
def _csr_layout(hist, span):
    """Row pointers of the nonzero bins of each row (looked for within its ``span``), and the
    largest count. Each pass over the rows asks for a row's bins `_ROWS_AHEAD` genes ahead
    (`_prefetch_bins`: this pass over a partition of 8,192 cells, 26 → 11 ms measured)."""
    genes = hist.shape[0]
    ptr = np.zeros(genes + 1, np.int64)
    top = 0
    for g in range(genes):
        _prefetch_span_ahead(hist, span, g)
        n = 0
        for b in range(span[g, 0], span[g, 1] + 1):
            c = hist[g, b]
            n += c != 0
            top = max(top, np.int64(c))
        ptr[g + 1] = ptr[g] + n
    return ptr, top


@nb.njit(nogil=True, cache=True)
def _fill_csr(hist, span, ptr, out_bins, out_counts):
    """Each row's nonzero bins and counts at its ``ptr``, without a branch: every bin of the span is
    written at ``k``, which moves on past a nonzero one (about half the bins of a span are zero, a
    branch on them mispredicted: 50 → 26 ms for a partition of 16,384 cells). The outputs hold one
    entry more than ``ptr[-1]``, where a row's trailing zeros land."""
    for g in range(hist.shape[0]):
        _prefetch_span_ahead(hist, span, g)
        k = ptr[g]
        row = hist[g]
        for b in range(span[g, 0], span[g, 1] + 1):
            c = row[b]
            out_bins[k] = b
            out_counts[k] = c
            k += c != 0


def _count_dtype(top: int) -> np.dtype:
    """The narrowest type of histogram counts up to ``top``: uint16, uint32 or int64."""
    return np.dtype(np.uint16 if top < 1 << 16 else np.uint32 if top < 1 << 32 else np.int64)


def empty_span(num_genes: int) -> np.ndarray:
    """Each gene's ``(lowest, highest)`` histogram bin in use, for none in use yet: the part of a
    gene's row that `_dense_to_csr` reads (a quarter of the table, or less, on real data)."""
    span = np.empty((num_genes, 2), np.int32)
    span[:, 0], span[:, 1] = NUM_BINS, -1
    return span


def _dense_to_csr(
    hist: np.ndarray, span: np.ndarray | None = None, buffers: RowBuffers | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row's nonzero bins (ascending) and counts, the counts in the narrowest type that holds
    them (a partition of 16,384 cells: uint16, 2 bytes per entry where int64 took 8, and 4× less
    fresh memory to fault in); one pass to count, one to fill, each within the rows' ``span``
    (default: whole rows). With ``buffers``, bins and counts are in their memory."""
    if span is None:
        span = np.empty((hist.shape[0], 2), np.int32)
        span[:, 0], span[:, 1] = 0, hist.shape[1] - 1
    ptr, top = _csr_layout(hist, span)
    n = int(ptr[-1])
    if buffers is None:
        bins, counts = np.empty(n + 1, np.uint16), np.empty(n + 1, _count_dtype(top))
    else:
        bins, counts = buffers.array(n + 1, np.uint16), buffers.array(n + 1, _count_dtype(top))
    _fill_csr(hist, span, ptr, bins, counts)
    return ptr, bins[:n], counts[:n]


@nb.njit(nogil=True, cache=True)
def _csr_into_dense(ptr, bins, counts, hist, span, lo_gene, hi_gene):
    for g in range(lo_gene, hi_gene):
        ahead = min(g + _ROWS_AHEAD, hi_gene - 1)
        if ptr[ahead] < ptr[ahead + 1]:
            _prefetch_bins(hist, ahead, np.int64(bins[ptr[ahead]]), np.int64(bins[ptr[ahead + 1] - 1]))
        lo, hi = ptr[g], ptr[g + 1]
        if lo == hi:
            continue
        for k in range(lo, hi):
            hist[g, bins[k]] += counts[k]
        span[g, 0] = min(span[g, 0], np.int32(bins[lo]))  # a row's bins rise
        span[g, 1] = max(span[g, 1], np.int32(bins[hi - 1]))


@nb.njit(nogil=True, cache=True)
def _clear_spans(hist, span):
    """Zero each row's ``span`` of bins (the only ones that can be nonzero) and mark it empty."""
    for g in range(hist.shape[0]):
        _prefetch_span_ahead(hist, span, g)
        lo, hi = span[g, 0], span[g, 1]
        if lo <= hi:
            hist[g, lo : hi + 1] = 0
        span[g, 0], span[g, 1] = NUM_BINS, -1


@nb.njit(nogil=True, cache=True)
def _medians(ptr, bins, counts, centres):
    """`GeneStats.medians`: per gene, the mean of the centres of the bins holding its two middle
    ranks (the lower and upper middle of an even count), found by one walk over its entries (a
    search per gene from Python took ~1 s for 60k genes); NaN for a gene without entries, the
    centre of its first bin for one whose counts are all 0."""
    out = np.full(ptr.shape[0] - 1, np.nan)
    for g in range(ptr.shape[0] - 1):
        lo, hi = ptr[g], ptr[g + 1]
        if lo == hi:
            continue
        n = np.int64(0)
        for k in range(lo, hi):
            n += np.int64(counts[k])
        lower, upper = (n - 1) // 2, n // 2  # the middle ranks, from 0
        a, seen = lo, np.int64(counts[lo])
        while a + 1 < hi and seen <= lower:  # the first entry whose running count passes the rank
            a += 1
            seen += np.int64(counts[a])
        b, through = a, seen
        while b + 1 < hi and through <= upper:
            b += 1
            through += np.int64(counts[b])
        out[g] = 0.5 * (centres[bins[a]] + centres[bins[b]])
    return out


@dataclasses.dataclass
class GeneStats:
    """Mergeable corpus statistics of ``num_cells`` cells over a dataset's gene columns.

    ``sums``: float64 ``(6, genes)`` in the order of ``_SUMS``; ``hist_ptr`` / ``hist_bins`` /
    ``hist_counts``: each gene's nonzero histogram bins as CSR (counts of any integer type; built
    from a dense table they come in the narrowest that holds them, `_count_dtype`).
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
        ptr, bins, counts = _dense_to_csr(hist, span, buffers)
        return cls(int(num_cells), n_cells.astype(np.int64), sums.astype(np.float64), ptr, bins, counts)

    _FIELDS = ("num_cells", "n_cells", "sums", "hist_ptr", "hist_bins", "hist_counts")

    def save(self, path: str | Path) -> None:
        """The statistics of a partition (merged at finalize; the dataset's own file is `write`'s
        parquet): the arrays one after another in NumPy's ``.npy`` format, in one file. An ``.npz``
        archive of the same arrays took twice as long, through its zip layer. Histogram counts are
        stored in the narrowest unsigned type that holds them (a partition of 16,384 cells: uint16,
        4 instead of 10 bytes per entry)."""
        top = int(self.hist_counts.max()) if len(self.hist_counts) else 0
        arrays = dataclasses.replace(self, hist_counts=self.hist_counts.astype(_count_dtype(top), copy=False))
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
        _csr_into_dense(self.hist_ptr, self.hist_bins, self.hist_counts, hist, span, lo, hi)

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
        return _medians(np.asarray(self.hist_ptr, np.int64), self.hist_bins, self.hist_counts, centres)

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
            df[f"{prefix}var"] = (df[f"{prefix}sum_sq"] / n - mean**2) * (n / np.maximum(n - 1, 1))
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


class StatsAccumulator:
    """Streams records (in row order) into `GeneStats` and per-cell ``n_counts`` / ``n_genes``.

    Float sums are kept per shard and added to the total when a shard ends, so the result depends
    only on the shard layout, not on how rows arrive in batches or parts.

    The histogram table holds ``count_dtype`` counts (uint16: 140 MB for 62,710 genes, where
    uint32 took 281 MB, each worker's first partition faulting all of it in); an increment past
    the type's largest count (65,535 cells of one partition in one bin of one gene) is kept
    aside and added back at `finish`, so the counts are exact whatever the partition's size.
    """

    def __init__(self, num_genes: int, shard_cells: int, count_dtype=np.uint16):
        self.shard_cells = shard_cells
        self.rows = 0
        self.hist = np.zeros((num_genes, NUM_BINS), count_dtype)
        self._spilled: list[np.ndarray] = []  # codes of increments past a full bin
        self.span = empty_span(num_genes)  # each gene's bins in use
        self.total = np.zeros((num_genes, 8), np.float64)  # the 6 sums, n_cells, padding
        self.partial = aligned_empty((num_genes, 8), np.float64)  # a gene's sums in one cache line
        self.partial[:] = 0
        self._buffers = RowBuffers(keep=5)  # a batch's histogram codes (3 arrays), `save`'s CSR (2)

    def add(
        self, buf: np.ndarray, starts: np.ndarray, *, check: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        """Add the records of the next rows; return their ``n_counts`` (float64) and ``n_genes`` (int32).
        ``check=False`` skips `codec.check_records` for records this process has just encoded
        (materialize: a second pass over every entry, ~0.2 ns each, that cannot find a fault)."""
        if check:
            u8, u32, f32 = codec.Records.check(buf, starts, self.hist.shape[0]).views(self.hist.shape[0])
        else:
            u8, u32, f32 = codec.views(read_only(buf))
        n = len(starts) - 1
        n_counts = np.empty(n, np.float64)
        n_genes = np.empty(n, np.int32)
        need = int(u32[starts[:-1] // 4 + 1].sum()) if n else 0  # entries per record header: ≥ the nonzeros
        codes, tmp = self._buffers.array(need, np.uint32), self._buffers.array(need, np.uint32)
        spill = self._buffers.array(need, np.uint32)
        done = 0
        while done < n:
            room = self.shard_cells - self.rows % self.shard_cells
            take = min(room, n - done)
            m = _accumulate(
                u8,
                u32,
                f32,
                starts[done : done + take],
                TARGET_SUM,
                n_counts[done : done + take],
                n_genes[done : done + take],
                self.partial,
                codes,
            )
            spilled = _apply_hist(codes, m, tmp, self.hist, self.span, spill)
            if spilled:
                self._spilled.append(spill[:spilled].copy())
            done += take
            self.rows += take
            if self.rows % self.shard_cells == 0:
                self._end_shard()
        return n_counts, n_genes

    def _end_shard(self) -> None:
        self.total += self.partial
        self.partial[:] = 0

    def finish(self) -> GeneStats:
        """The statistics of the rows added; the accumulator is empty again, ready for the next rows
        (only the spans of bins in use are zeroed: its table stays mapped, not faulted in anew)."""
        return self._finish(None)

    def save(self, path: str | Path) -> None:
        """`finish` and `GeneStats.save` to ``path`` in one, the histogram's CSR built in memory reused
        from one call to the next (a partition's statistics, the next partition's accumulator)."""
        self._finish(self._buffers).save(path)

    def _finish(self, buffers: RowBuffers | None) -> GeneStats:
        if self.rows % self.shard_cells:
            self._end_shard()
        stats = GeneStats.from_dense(
            self.rows, self.total[:, 6], self.total[:, :6].T, self.hist, self.span, buffers
        )  # copies (the histogram into ``buffers``' memory, if given)
        _clear_spans(self.hist, self.span)
        if self._spilled:
            _add_spilled(stats, np.concatenate(self._spilled))
            self._spilled = []
        self.total[:] = 0
        self.rows = 0
        return stats


_NPY_HEADERS = {  # the .npy header readers by format version (np.save writes 1.0, or 2.0 for a huge header)
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
}


def _add_spilled(stats: GeneStats, codes: np.ndarray) -> None:
    """Add to ``stats``' histogram the increments `_apply_hist` spilled (their bins, full, are among
    its entries); the counts widen to the narrowest type that holds them."""
    codes, extra = np.unique(codes, return_counts=True)
    genes = np.repeat(np.arange(stats.num_genes, dtype=np.uint32), np.diff(stats.hist_ptr))
    entries = (genes << np.uint32(11)) | stats.hist_bins  # the codes of the entries, ascending
    counts = stats.hist_counts.astype(np.int64)
    counts[np.searchsorted(entries, codes)] += extra
    stats.hist_counts = counts.astype(_count_dtype(int(counts.max())))


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


def seurat_hvg(mean: np.ndarray, var: np.ndarray, n_top: int, n_bins: int = 20) -> np.ndarray:
    """Columns of the ``n_top`` most variable genes by scanpy's ``flavor="seurat"`` definition, from
    the mean and variance (ddof=1) of the normalized values (scanpy's ``expm1`` of the log data); a
    gene of NaN mean (measured in no cell) is never chosen.

    Dispersion ``log(var / mean)`` is z-scored within 20 equal-width bins of ``log1p(mean)``
    (a bin holding one gene scores it 1); genes at or above the ``n_top``-th highest score are kept,
    as scanpy keeps them (ties may add genes).
    """
    import pandas as pd

    if isinstance(n_top, bool) or not isinstance(n_top, int | np.integer):
        msg = f"n must be an integer number of genes, got {n_top!r}: e.g. highly_variable_genes({min(2000, len(mean))})"
        raise TypeError(msg)
    mean, var = np.array(mean, dtype=np.float64), np.asarray(var, dtype=np.float64)
    measured = np.flatnonzero(~np.isnan(mean))
    if len(measured) < len(mean):  # genes no cell measured (a collection's NaN means): never chosen
        if not 0 < n_top <= len(measured):
            msg = f"n must lie in 1..{len(measured):,} (the genes measured in some cell), got {n_top}"
            raise OmicsIOError(msg)
        return measured[seurat_hvg(mean[measured], var[measured], n_top, n_bins)]
    if not 0 < n_top <= len(mean):
        msg = f"n must lie in 1..{len(mean):,} (the number of genes), got {n_top}"
        raise OmicsIOError(msg)
    mean[mean == 0] = 1e-12
    with np.errstate(divide="ignore", invalid="ignore"):
        dispersion = var / mean
        dispersion[dispersion == 0] = np.nan
        dispersion = np.log(dispersion)
    df = pd.DataFrame({"means": np.log1p(mean), "dispersions": dispersion})
    df["mean_bin"] = pd.cut(df["means"], bins=n_bins)
    stats = df.groupby("mean_bin", observed=True)["dispersions"].agg(avg="mean", dev="std")
    single = stats["dev"].isnull()
    stats.loc[single, "dev"] = stats.loc[single, "avg"]
    stats.loc[single, "avg"] = 0
    per_gene = stats.loc[df["mean_bin"]].set_index(df.index)
    norm = ((df["dispersions"] - per_gene["avg"]) / per_gene["dev"]).to_numpy()
    finite = norm[~np.isnan(norm)]
    if not len(finite):
        msg = f"none of the {len(mean):,} genes has a normalized dispersion (do any vary across the cells?): no highly variable genes to rank"
        raise OmicsIOError(msg)
    cutoff = np.sort(finite)[::-1][min(n_top, len(finite)) - 1]
    return np.flatnonzero(np.nan_to_num(norm, nan=-np.inf) >= cutoff)

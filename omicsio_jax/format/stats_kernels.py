"""The numba kernels of the corpus statistics (`omicsio_jax.format.gene_stats`): per-gene sums and
histogram increments from encoded records (`accumulate`, `apply_hist`), the dense histogram table to
CSR and back (`dense_to_csr`, `csr_into_dense`, `clear_spans`) and medians read off it (`medians_of`).

A histogram bin holds the positive ``x = value / n_counts · 1e4`` of a gene on a log scale: 40 bins
per octave over [2^-14, 2^14), values outside clamped into the end bins (`NUM_BINS` in all).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from omicsio_jax.core.buffers import RowBuffers
from omicsio_jax.core.kernels import prefetch
from omicsio_jax.format import codec

BINS_PER_OCTAVE = 40
LOW_EXPONENT = -14
NUM_BINS = 28 * BINS_PER_OCTAVE

_TABLE = 64  # integer counts up to this use per-cell tables of log1p and histogram bins
_AHEAD = 64  # entries ahead whose cache lines `accumulate` and `apply_hist` ask for
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
def accumulate(u8, u32, f32, starts, target_sum, n_counts, n_genes, acc, codes):
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
def apply_hist(codes, m, tmp, hist, span, spill):
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


def count_dtype(top: int) -> np.dtype:
    """The narrowest type of histogram counts up to ``top``: uint16, uint32 or int64."""
    return np.dtype(np.uint16 if top < 1 << 16 else np.uint32 if top < 1 << 32 else np.int64)


def empty_span(num_genes: int) -> np.ndarray:
    """Each gene's ``(lowest, highest)`` histogram bin in use, for none in use yet: the part of a
    gene's row that `dense_to_csr` reads (a quarter of the table, or less, on real data)."""
    span = np.empty((num_genes, 2), np.int32)
    span[:, 0], span[:, 1] = NUM_BINS, -1
    return span


def dense_to_csr(
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
        bins, counts = np.empty(n + 1, np.uint16), np.empty(n + 1, count_dtype(top))
    else:
        bins, counts = buffers.array(n + 1, np.uint16), buffers.array(n + 1, count_dtype(top))
    _fill_csr(hist, span, ptr, bins, counts)
    return ptr, bins[:n], counts[:n]


@nb.njit(nogil=True, cache=True)
def csr_into_dense(ptr, bins, counts, hist, span, lo_gene, hi_gene):
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
def clear_spans(hist, span):
    """Zero each row's ``span`` of bins (the only ones that can be nonzero) and mark it empty."""
    for g in range(hist.shape[0]):
        _prefetch_span_ahead(hist, span, g)
        lo, hi = span[g, 0], span[g, 1]
        if lo <= hi:
            hist[g, lo : hi + 1] = 0
        span[g, 0], span[g, 1] = NUM_BINS, -1


@nb.njit(nogil=True, cache=True)
def medians_of(ptr, bins, counts, centres):
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

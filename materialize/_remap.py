"""A source's rows moved into a collection's unified gene columns (`MemberMap.remap`): tokens mapped,
rows sorted again, genes of one id summed, in one numba pass. A source whose genes keep their order
among the unified ones (`MemberMap.in_order`) needs no move: its tokens go to the encoder with the
map from tokens to columns, as a single input's do.
"""

from __future__ import annotations

import dataclasses

import numba as nb
import numpy as np

from omicsio_jax import DataValidationError
from omicsio_jax.format import RowBuffers

_UNKNOWN, _DROPPED = -1, -2  # `MemberMap.col_of` codes of tokens that are no gene / not kept


@dataclasses.dataclass(frozen=True)
class MemberMap:
    """How one source's gene tokens become unified columns: ``col_of[token]`` is the token's column, or
    -1 (no gene of the source) / -2 (not kept: outside an intersection or a given gene list)."""

    col_of: np.ndarray
    num_columns: int
    in_order: bool = False  # every gene kept, in rising columns: rows stay sorted as they are mapped

    @property
    def measured(self) -> np.ndarray:
        """Bool over the unified columns: the genes this source measured."""
        out = np.zeros(self.num_columns, bool)
        out[self.col_of[self.col_of >= 0]] = True
        return out

    def remap(self, indptr: np.ndarray, tokens: np.ndarray, values: np.ndarray, locate) -> tuple:
        """A batch's rows in unified columns, sorted within rows, genes of one id summed; a token that
        is no gene of the source, or that does not follow the one before it, is a
        `DataValidationError` naming the row."""
        out_values = _OUTPUTS.array(len(tokens), np.float32 if values.dtype == np.float32 else np.float64)
        out_ptr = np.empty(len(indptr), np.int64)
        out_cols = _OUTPUTS.array(len(tokens), np.int32)
        bad = _remap(
            np.asarray(indptr, np.int64),
            np.asarray(tokens),
            values,
            self.col_of,
            out_ptr,
            out_cols,
            out_values,
        )
        if bad >= 0:
            row = int(np.searchsorted(indptr, bad, side="right") - 1)
            token = int(tokens[bad])
            if 0 <= token < len(self.col_of) and self.col_of[token] != _UNKNOWN:
                msg = f"gene_token_id not sorted in {locate(row)}: {token} after {int(tokens[bad - 1])}"
            else:
                msg = f"gene_token_id {token} in {locate(row)} is not in its gene table"
            raise DataValidationError(msg)
        n = int(out_ptr[-1])
        return out_ptr, out_cols[:n], out_values[:n]


_BUCKETS_PER_COLUMN = 4  # `_sort_row`'s buckets per column of a row
_RADIX_FROM = 2  # rows of at least this many times `_radix_row`'s buckets per digit go to it


# A batch's remapped columns and values (`RowBuffers.array`), in memory used again once nothing
# refers to it: up to 4 batches are alive at once (2 queued behind the reader, the one it makes, the
# one being encoded). A source's batch of 6M nonzeros takes 48 MB. In Arrow's pool, which held them
# before, the workers faulted in fresh pages for them, each zeroed by the kernel (50 sources of 6,000
# cells materialized with 2 workers, 5 alternating runs on a 2-core AMD EPYC: the workers' system time
# 2.9-3.8 s here, 3.2-6.5 s there).
_OUTPUTS = RowBuffers(keep=8)


@nb.njit(cache=True, nogil=True)
def _remap(indptr, tokens, values, col_of, out_ptr, out_cols, out_values):  # pragma: no cover
    """Rows into unified columns, written straight to the output; a row whose columns do not rise is
    sorted there (`_radix_row` if it is long, else `_sort_row`) and genes of one column summed.
    Returns -1, or the position of the first token that is unknown or not above the one before it.

    A row is moved by plain loops (a gather of its columns, a copy of its values) and checked after,
    by loops without branches; only a row that fails a check (a token out of order or unknown, or a
    gene not kept) is moved again token by token, to skip what is not kept or to find the bad token."""
    longest = 0
    for r in range(len(indptr) - 1):
        longest = max(longest, indptr[r + 1] - indptr[r])
    bits = 1  # `_radix_row`'s digit: half the bits of the highest column, rounded up
    while (np.int64(1) << (2 * bits)) <= max(np.int64(col_of.max()) if len(col_of) else 0, 1):
        bits += 1
    cols_b, vals_b = np.empty(longest, np.int32), np.empty(longest, out_values.dtype)
    hist = np.empty(max(_BUCKETS_PER_COLUMN * longest, 2 << bits, 1), np.int32)
    n = len(col_of)
    out_ptr[0] = 0
    k = 0
    for r in range(len(indptr) - 1):
        lo, hi = indptr[r], indptr[r + 1]
        m = hi - lo
        t, v = tokens[lo:hi], values[lo:hi]
        oc, ov = out_cols[k : k + m], out_values[k : k + m]  # k + m <= hi: the row fits in the output
        for j in range(m):
            oc[j] = col_of[min(max(t[j], 0), n - 1)]
        for j in range(m):
            ov[j] = v[j]
        bad = m > 0 and (t[0] < 0 or t[m - 1] >= n)
        for j in range(1, m):
            bad |= t[j] <= t[j - 1]
        low, top, falls = 0, 0, False
        for j in range(m):
            low, top = min(low, oc[j]), max(top, oc[j])
        for j in range(1, m):
            falls |= oc[j] <= oc[j - 1]
        if bad or low < 0:  # token by token: the bad token's place, or the genes not kept skipped
            m, last_col, last_token, falls = 0, -1, -1, False
            for j in range(lo, hi):
                tj = tokens[j]
                if tj < 0 or tj >= n or col_of[tj] == _UNKNOWN or tj <= last_token:
                    return j
                last_token = tj
                c = col_of[tj]
                if c == _DROPPED:
                    continue
                falls |= c <= last_col
                last_col, top = c, max(top, c)
                out_cols[k + m], out_values[k + m] = c, values[j]
                m += 1
        if falls and m >= _RADIX_FROM << bits:
            m = _radix_row(out_cols[k : k + m], out_values[k : k + m], bits, cols_b, vals_b, hist)
        elif falls:
            m = _sort_row(out_cols[k : k + m], out_values[k : k + m], top, cols_b, vals_b, hist)
        k += m
        out_ptr[r + 1] = k
    return -1


@nb.njit(cache=True, nogil=True, inline="always")
def _sort_row(cols, values, top, cols_b, vals_b, hist):  # pragma: no cover
    """``cols`` (in ``[0, top]``) sorted in place with their ``values``, those of one column summed in
    the order given; returns how many are left. A counting sort by the columns' high bits into about
    `_BUCKETS_PER_COLUMN` buckets per column (bucket ``c >> shift``), then an insertion sort, which
    finds each bucket's few columns already in place or nearly. Stable, so the sums are those of the
    order given. Indices are unsigned (numba tests a signed index for wrapping around from the end).

    Measured on a source of 1,000 nonzeros per row over 62,710 columns (2-core AMD EPYC): 6.2 ns per
    nonzero with as many buckets as columns and signed indices, 5.5 unsigned, 4.3 with 4 buckets per
    column (fewer columns share a bucket, so fewer are out of place; 8 per column: 4.9, the prefix
    sum over the buckets costing more than the insertions saved)."""
    m = len(cols)
    shift = np.uint32(0)
    while (top >> shift) >= max(_BUCKETS_PER_COLUMN * m, 1):
        shift += np.uint32(1)
    buckets = (top >> shift) + 1
    h = hist[:buckets]
    h[:] = 0
    for i in range(m):
        h[np.uint32(cols[i]) >> shift] += 1
    total = 0
    for d in range(buckets):
        count = h[d]
        h[d] = total
        total += count
    for i in range(m):
        c = cols[i]
        d = np.uint32(c) >> shift
        at = np.uint32(h[d])
        h[d] = at + 1
        cols_b[at], vals_b[at] = c, values[i]
    for i in range(1, m):
        c = cols_b[i]
        if c < cols_b[i - 1]:
            x, j = vals_b[i], i - 1
            while j >= 0 and cols_b[j] > c:
                cols_b[j + 1], vals_b[j + 1] = cols_b[j], vals_b[j]
                j -= 1
            cols_b[j + 1], vals_b[j + 1] = c, x
    return _summed(cols_b[:m], vals_b[:m], cols, values)


@nb.njit(cache=True, nogil=True, inline="always")
def _radix_row(cols, values, bits, cols_b, vals_b, hist):  # pragma: no cover
    """`_sort_row` for a long row: two counting passes, by the low ``bits`` of the columns and then by
    the rest (``2 * bits`` in all cover every column), both counted in one pass first; stable, so
    the genes of one column are summed in the order given, and sorted in place.

    Measured on rows of random columns (2-core AMD EPYC, ns per nonzero, `_sort_row` against this):
    62,710 columns (8-bit digits), 5.9 / 4.8 at 512 genes a row, 6.6 / 4.5 at 1,000, 9.3 / 9.6 at
    128; 70,000 columns (9-bit digits), 8.4 / 7.8 at 1,000, 8.3 / 6.5 at 3,000. So rows of at least
    `_RADIX_FROM` times a digit's buckets come here."""
    m = len(cols)
    size = np.uint32(1) << np.uint32(bits)
    low, shift = size - np.uint32(1), np.uint32(bits)
    hist[: 2 * size] = 0
    for i in range(m):
        c = np.uint32(cols[i])
        hist[c & low] += 1
        hist[size + (c >> shift)] += 1
    below_low, below_high = 0, 0
    for d in range(size):
        count_low, count_high = hist[d], hist[size + d]
        hist[d], hist[size + d] = below_low, below_high
        below_low += count_low
        below_high += count_high
    for i in range(m):
        c = np.uint32(cols[i])
        at = np.uint32(hist[c & low])
        hist[c & low] = at + 1
        cols_b[at], vals_b[at] = c, values[i]
    for i in range(m):
        c = np.uint32(cols_b[i])
        d = size + (c >> shift)
        at = np.uint32(hist[d])
        hist[d] = at + 1
        cols[at], values[at] = c, vals_b[i]
    return _summed(cols, values, cols, values)


@nb.njit(cache=True, nogil=True, inline="always")
def _summed(sorted_cols, sorted_values, cols, values):  # pragma: no cover
    """``sorted_cols`` and their values written to ``cols`` / ``values`` (the same arrays, or others),
    those of one column summed in the order given; returns how many are left."""
    w = 0
    for i in range(len(sorted_cols)):
        if w > 0 and cols[w - 1] == sorted_cols[i]:  # two genes of one id: summed
            values[w - 1] += sorted_values[i]
        else:
            cols[w], values[w] = sorted_cols[i], sorted_values[i]
            w += 1
    return w


def member_map(tokens: np.ndarray, cols: np.ndarray, num_columns: int) -> MemberMap:
    """The map of a source whose gene ``tokens`` go to unified ``cols`` (-1: not kept)."""
    tokens = np.asarray(tokens, np.int64)
    col_of = np.full(int(tokens.max()) + 1 if len(tokens) else 0, _UNKNOWN, np.int32)
    col_of[tokens] = np.where(np.asarray(cols) >= 0, cols, _DROPPED)
    known = col_of[col_of != _UNKNOWN]  # in token order
    in_order = bool(np.all(known >= 0) and np.all(np.diff(known) > 0))
    return MemberMap(col_of, num_columns, in_order)

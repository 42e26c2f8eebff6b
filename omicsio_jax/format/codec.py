"""The record codec: one ArrayRecord record per cell.

A record is a little-endian byte string whose length is a multiple of 4::

    header (8 bytes)   u8 codec version (=1) · u8 index code · u8 value code · u8 0 · u32 n
    indices            n gene columns, padded to 4 bytes    (absent for the dense layout)
    values             n values,       padded to 4 bytes

16-bit fields are stored as two byte planes (the n low bytes, then the n high bytes): gaps
between expressed genes are mostly < 256, so the high plane is nearly all zeros, which zstd
compresses faster and smaller than interleaved u16 (measured: 18% fewer bytes, 39% faster
writes on the synthetic corpus).

Index codes: ``INDEX_DENSE`` (dense layout: the record is a full row of ``n`` columns),
``INDEX_DELTA_U16`` (sorted columns stored as gaps, every gap ≤ 65,535; the first gap is
the first column), ``INDEX_U32`` (absolute columns). Value codes: ``VALUE_U8``,
``VALUE_U16``, ``VALUE_U32`` for integer-valued rows (counts; stored exactly) and
``VALUE_F32`` otherwise. The writer picks the narrowest lossless code per record, so
decoding always returns exactly the float32 values that were written.

Every kernel here works on a whole batch of records at once (numba, ``prange``, ``nogil``):
records are concatenated into one buffer with 4-aligned starts, so one call decodes a whole
fetch without a Python loop per cell. The decoders take `Records`: records checked once where they
were read (`Records.check`), then picked for each minibatch where they lie (`Records.select`),
neither copied nor checked again.
"""

from __future__ import annotations

import dataclasses
import math
from collections import namedtuple
from collections.abc import Callable

import numba as nb
import numpy as np

from omicsio_jax.core.buffers import read_only
from omicsio_jax.core.kernels import row_to_write, row_written, rows_scratch, store_fence

CODEC_VERSION = 1
HEADER_BYTES = 8

INDEX_DENSE = 0
INDEX_DELTA_U16 = 1
INDEX_U32 = 2

VALUE_F32 = 0
VALUE_U8 = 1
VALUE_U16 = 2
VALUE_U32 = 3

VALUE_WIDTH = np.array([4, 1, 2, 4], dtype=np.int64)
INDEX_WIDTH = np.array([0, 2, 4], dtype=np.int64)

# A cell with no values: what a loader decodes for a padding row.
EMPTY_RECORD = bytes([CODEC_VERSION, INDEX_U32, VALUE_F32, 0, 0, 0, 0, 0])


@nb.njit(inline="always")
def pad4(nbytes):
    return (nbytes + 3) & ~3


# Row problems found by `plan_sparse` (the codec never encodes an invalid row).
ROW_OK = 0
ROW_UNSORTED = 1
ROW_DUPLICATE = 2
ROW_UNKNOWN_GENE = 3
ROW_NOT_FINITE = 4
ROW_NEGATIVE = 5
ROW_OVERFLOW = 6

_F32_MAX = float(np.finfo(np.float32).max)
# A non-negative float32's bits, read as an int32, order as the float does: the value codes' limits.
_U8_TOP = int(np.float32(255.0).view(np.int32))
_U16_TOP = int(np.float32(65535.0).view(np.int32))


def plan_sparse(indptr, tokens, values, token_to_col, allow_negative):
    """Check each row and choose its codes; return ``(index_codes, value_codes, nbytes, problems, where)``.

    ``tokens`` are gene ids mapped to columns by ``token_to_col`` (-1 = unknown gene); a row is
    valid when its tokens ascend strictly, are known, and its values are finite float32 numbers
    (non-negative unless ``allow_negative``). ``problems[i]`` is a ``ROW_*`` code and
    ``where[i]`` the offending position in ``tokens`` (-1 if the row is valid).
    """
    return _plan_sparse(*_sparse_inputs(indptr, tokens, values, token_to_col), allow_negative)


def _sparse_inputs(indptr, tokens, values, token_to_col):
    """The planner's and encoder's inputs: the arrays as `read_only` views (one kind whatever they
    came from: one compilation), the values as float32 too (what is stored; the same array when they
    are float32), and `column_shift`."""
    if values.dtype == np.float32:
        values32 = values
    else:
        with np.errstate(over="ignore", invalid="ignore"):  # out of range: a problem the planner reports
            values32 = values.astype(np.float32)
    arrays = tuple(map(read_only, (indptr, tokens, values, values32, token_to_col)))
    return (*arrays, column_shift(arrays[-1]))


@nb.njit(nogil=True, cache=True)
def column_shift(token_to_col):
    """``s`` when ``token_to_col`` maps tokens ``s, s+1, …`` to columns ``0, 1, …`` and every token
    below ``s`` to -1 (the tokens are the columns, shifted: an AnnData's, a gene table numbered from
    ``s``), else -1. The kernels then compute the columns instead of looking them up."""
    n = token_to_col.shape[0]
    s = 0
    while s < n and token_to_col[s] < 0:
        s += 1
    for t in range(s, n):
        if token_to_col[t] != t - s:
            return -1
    return s


@nb.njit(inline="always")
def _exact_uint(f, bits):
    """Whether float32 ``f`` (its ``bits`` as int32) is stored exactly as an unsigned integer: sign bit
    clear (not -0.0), whole, below 2**32 (not +inf). Without a branch, so its loops vectorize."""
    return (bits >= 0) & (np.floor(f) == f) & (f <= 4294967295.0)


@nb.njit(inline="always")
def _scan_row(tok, val, val32, bits, token_to_col, shift, allow_negative):
    """``(ok, max_gap, integral, top)`` of one row in branch-free loops that vectorize: ``ok`` is
    False when the row has any problem (`_find_problem` then says which, and where), ``max_gap`` its
    largest column gap (the first gap is the first column), ``integral`` whether every value is
    stored exactly as an unsigned integer, and ``top`` the largest value's float32 bits."""
    n = tok.shape[0]
    if n == 0:
        return True, np.int64(0), True, np.int32(0)
    ordered = True
    after, before = tok[1:], tok[:-1]
    for k in range(n - 1):
        ordered &= after[k] > before[k]
    first, last = np.int64(tok[0]), np.int64(tok[n - 1])
    if not ordered or first < max(shift, 0) or last >= token_to_col.shape[0]:
        return False, np.int64(0), True, np.int32(0)
    known = True
    if shift >= 0:  # every token from the shift on is known, and its column is the token shifted
        max_gap = first - shift
        for k in range(n - 1):
            max_gap = max(max_gap, np.int64(after[k] - before[k]))
    else:
        max_gap = np.int64(0)
        prev = np.int64(0)
        for k in range(n):
            col = np.int64(token_to_col[tok[k]])
            known &= col >= 0
            max_gap = max(max_gap, col - prev)
            prev = col
    clean = True
    negative = False
    integral = True
    top = np.int32(0)
    for k in range(n):
        v = val[k]
        clean &= abs(v) <= _F32_MAX  # finite, and within float32 when the input is wider
        negative |= v < 0
        integral &= _exact_uint(val32[k], bits[k])
        top = max(top, bits[k])
    return known & clean & (allow_negative or not negative), max_gap, integral, top


@nb.njit(inline="always")
def _find_problem(tokens, values, token_to_col, lo, hi, allow_negative):
    """``(ROW_* code, position)`` of the first problem in row ``tokens[lo:hi]``."""
    num_tokens = token_to_col.shape[0]
    prev = np.int64(-1)
    for j in range(lo, hi):
        t = np.int64(tokens[j])
        v = values[j]
        if t <= prev:
            return (ROW_UNSORTED if t < prev else ROW_DUPLICATE), j
        if t < 0 or t >= num_tokens or token_to_col[t] < 0:
            return ROW_UNKNOWN_GENE, j
        if not math.isfinite(v):
            return ROW_NOT_FINITE, j
        if v < 0 and not allow_negative:
            return ROW_NEGATIVE, j
        if abs(v) > _F32_MAX:
            return ROW_OVERFLOW, j
        prev = t
    return ROW_OK, np.int64(-1)


@nb.njit(inline="always")
def _value_code(integral, top):
    if not integral:
        return VALUE_F32
    if top <= _U8_TOP:
        return VALUE_U8
    if top <= _U16_TOP:
        return VALUE_U16
    return VALUE_U32


@nb.njit(parallel=True, nogil=True, cache=True)
def _plan_sparse(indptr, tokens, values, values32, token_to_col, shift, allow_negative):
    n = indptr.shape[0] - 1
    bits = values32.view(np.int32)
    index_codes = np.zeros(n, np.uint8)
    value_codes = np.zeros(n, np.uint8)
    nbytes = np.zeros(n, np.int64)
    problems = np.zeros(n, np.int8)
    where = np.full(n, -1, np.int64)
    for i in nb.prange(n):
        lo, hi = indptr[i], indptr[i + 1]
        ok, max_gap, integral, top = _scan_row(
            tokens[lo:hi], values[lo:hi], values32[lo:hi], bits[lo:hi], token_to_col, shift, allow_negative
        )
        if not ok:
            problems[i], where[i] = _find_problem(tokens, values, token_to_col, lo, hi, allow_negative)
            continue
        ic = INDEX_DELTA_U16 if max_gap <= 65535 else INDEX_U32
        vc = _value_code(integral, top)
        index_codes[i] = ic
        value_codes[i] = vc
        nnz = hi - lo
        nbytes[i] = HEADER_BYTES + pad4(nnz * INDEX_WIDTH[ic]) + pad4(nnz * VALUE_WIDTH[vc])
    return index_codes, value_codes, nbytes, problems, where


@nb.njit(parallel=True, nogil=True, cache=True)
def plan_dense(rows):
    """Value code and record size for each row of a dense ``(n, width)`` float32 array."""
    n, width = rows.shape
    bits = rows.view(np.int32)
    value_codes = np.empty(n, np.uint8)
    nbytes = np.empty(n, np.int64)
    for i in nb.prange(n):
        row, row_bits = rows[i], bits[i]
        integral = True
        top = np.int32(0)
        for k in range(width):
            integral &= _exact_uint(row[k], row_bits[k])
            top = max(top, row_bits[k])
        vc = _value_code(integral, top)
        value_codes[i] = vc
        nbytes[i] = HEADER_BYTES + pad4(width * VALUE_WIDTH[vc])
    return value_codes, nbytes


@nb.njit(inline="always")
def _write_header(u8, u32, start, index_code, value_code, n):
    u8[start] = CODEC_VERSION
    u8[start + 1] = index_code
    u8[start + 2] = value_code
    u8[start + 3] = 0
    u32[start // 4 + 1] = n


@nb.njit(inline="always")
def _zero(u8, begin, end):
    pad = u8[begin:end]
    for k in range(pad.shape[0]):
        pad[k] = 0


# The writers index slices of the buffer by their loop's counter, which vectorizes where u8[pos + k]
# does not (see `RecordFields`).
@nb.njit(inline="always")
def _write_values(u8, u32, f32, pos, val, vc):
    """Write the values ``val`` (float32) in value code ``vc`` at byte ``pos``, padding included."""
    n = val.shape[0]
    if vc == VALUE_U8:
        out = u8[pos : pos + n]
        for k in range(n):
            out[k] = np.uint8(val[k])
    elif vc == VALUE_U16:
        low, high = u8[pos : pos + n], u8[pos + n : pos + 2 * n]
        for k in range(n):
            w = np.uint16(val[k])
            low[k] = np.uint8(w & 0xFF)
            high[k] = np.uint8(w >> 8)
    elif vc == VALUE_U32:
        out32 = u32[pos // 4 : pos // 4 + n]
        for k in range(n):
            out32[k] = np.uint32(val[k])
    else:
        outf = f32[pos // 4 : pos // 4 + n]
        for k in range(n):
            outf[k] = val[k]
    _zero(u8, pos + n * VALUE_WIDTH[vc], pos + pad4(n * VALUE_WIDTH[vc]))


@nb.njit(inline="always")
def _write_columns(u8, u32, pos, tok, token_to_col, shift, ic):
    """Write the columns of tokens ``tok`` in index code ``ic`` at byte ``pos``, padding included."""
    n = tok.shape[0]
    if ic == INDEX_DELTA_U16:  # gaps fit 16 bits: int32 arithmetic gives the same two bytes as int64
        low, high = u8[pos : pos + n], u8[pos + n : pos + 2 * n]
        if shift >= 0 and n > 0:  # gaps as differences of two slices (a carried previous does not vectorize)
            low[0] = np.uint8((tok[0] - shift) & 0xFF)
            high[0] = np.uint8(((tok[0] - shift) >> 8) & 0xFF)
            after, before, low1, high1 = tok[1:], tok[:-1], low[1:], high[1:]
            for k in range(n - 1):
                gap = after[k] - before[k]
                low1[k] = np.uint8(gap & 0xFF)
                high1[k] = np.uint8((gap >> 8) & 0xFF)
        elif shift < 0:
            prev = np.int32(0)
            for k in range(n):
                col = token_to_col[tok[k]]
                gap = col - prev
                low[k] = np.uint8(gap & 0xFF)
                high[k] = np.uint8((gap >> 8) & 0xFF)
                prev = col
    else:
        cols = u32[pos // 4 : pos // 4 + n]
        if shift >= 0:
            for k in range(n):
                cols[k] = np.uint32(tok[k] - shift)
        else:
            for k in range(n):
                cols[k] = np.uint32(token_to_col[tok[k]])
    _zero(u8, pos + n * INDEX_WIDTH[ic], pos + pad4(n * INDEX_WIDTH[ic]))


@nb.njit(parallel=True, nogil=True, cache=True)
def _encode_sparse(
    indptr, tokens, values32, token_to_col, shift, index_codes, value_codes, starts, u8, u32, f32
):
    """Write the records of rows planned by `_plan_sparse` into ``u8`` (and its views) at ``starts``."""
    for i in nb.prange(indptr.shape[0] - 1):
        lo, hi = indptr[i], indptr[i + 1]
        ic, vc = index_codes[i], value_codes[i]
        _write_header(u8, u32, starts[i], ic, vc, hi - lo)
        pos = starts[i] + HEADER_BYTES
        _write_columns(u8, u32, pos, tokens[lo:hi], token_to_col, shift, ic)
        _write_values(u8, u32, f32, pos + pad4((hi - lo) * INDEX_WIDTH[ic]), values32[lo:hi], vc)


@nb.njit(parallel=True, nogil=True, cache=True)
def encode_dense(rows, value_codes, starts, u8, u32, f32):
    """Write dense rows as ``INDEX_DENSE`` records at byte offsets ``starts``."""
    n, width = rows.shape
    for i in nb.prange(n):
        _write_header(u8, u32, starts[i], INDEX_DENSE, value_codes[i], width)
        _write_values(u8, u32, f32, starts[i] + HEADER_BYTES, rows[i], value_codes[i])


# A record's fields as slices of the batch buffer (`record_fields`), which the decoders index by the
# entry number k alone: a slice indexed by its loop's counter skips numba's negative-index
# wraparound and vectorizes, where u8[pos + k] does neither (decoding measured ~2x faster). Slices
# a record's codes do not use are empty or unread.
RecordFields = namedtuple(
    "RecordFields",
    "index_code value_code n gap_low gap_high columns value_low value_high value_u32 value_f32",
)


@nb.njit(inline="always")
def record_fields(u8, u32, f32, start):
    """The `RecordFields` of the record at byte ``start`` (``n``: its number of entries)."""
    ic, vc = u8[start + 1], u8[start + 2]
    n = np.int64(u32[start // 4 + 1])
    pos = start + HEADER_BYTES
    vpos = pos + pad4(n * INDEX_WIDTH[ic])
    return RecordFields(
        ic,
        vc,
        n,
        u8[pos : pos + n],
        u8[pos + n : pos + 2 * n],
        u32[pos // 4 : pos // 4 + n],
        u8[vpos : vpos + n],
        u8[vpos + n : vpos + 2 * n],
        u32[vpos // 4 : vpos // 4 + n],
        f32[vpos // 4 : vpos // 4 + n],
    )


@nb.njit(inline="always")
def gap_at(fields, k):
    """Gap k of an ``INDEX_DELTA_U16`` record: low byte in the first plane, high byte in the second."""
    return np.int64(fields.gap_low[k]) | (np.int64(fields.gap_high[k]) << 8)


@nb.njit(inline="always")
def value_at(fields, k):
    """Value k as float32. The value code is the same for every k: in a loop over k, LLVM hoists this
    branch out of the loop (measured as fast as one loop per code), so callers need not."""
    vc = fields.value_code
    if vc == VALUE_U8:
        return np.float32(fields.value_low[k])
    if vc == VALUE_U16:
        return np.float32(np.uint16(fields.value_low[k]) | (np.uint16(fields.value_high[k]) << 8))
    if vc == VALUE_U32:
        return np.float32(fields.value_u32[k])
    return fields.value_f32[k]


# What `check_records` finds wrong with a record (0: nothing). A record that passes is exactly what
# the writer makes of some valid row: every decoder may then read it without bounds checks.
RECORD_OK = 0
RECORD_SHORT = 1  # shorter than a header
RECORD_VERSION = 2  # unknown codec version or a nonzero reserved byte
RECORD_CODES = 3  # unknown index or value code
RECORD_LENGTH = 4  # the record's length is not what its header says
RECORD_COLUMNS = 5  # columns not strictly ascending, or past the dataset's columns
RECORD_WIDTH = 6  # a dense record whose width is not the dataset's
RECORD_VALUE = 7  # a float value that is not finite
RECORD_PADDING = 8  # a nonzero padding byte

RECORD_PROBLEMS = (
    "",
    "shorter than a record header",
    "unknown codec version",
    "unknown index or value code",
    "its length differs from what its header says",
    "its gene columns are not strictly ascending within the dataset's columns",
    "a dense record of the wrong width",
    "a value is not a finite number",
    "nonzero padding",
)


@nb.njit(inline="always")
def _padding_is_zero(u8, begin, end):
    for b in range(begin, end):
        if u8[b] != 0:
            return False
    return True


@nb.njit(inline="always")
def _check_one(u8, u32, f32, start, end, num_columns):
    if end - start < HEADER_BYTES:
        return RECORD_SHORT
    if start % 4 or (end - start) % 4:
        return RECORD_LENGTH
    if u8[start] != CODEC_VERSION or u8[start + 3] != 0:
        return RECORD_VERSION
    ic, vc, n = u8[start + 1], u8[start + 2], np.int64(u32[start // 4 + 1])
    if ic > INDEX_U32 or vc > VALUE_U32:
        return RECORD_CODES
    index_bytes, value_bytes = n * INDEX_WIDTH[ic], n * VALUE_WIDTH[vc]
    if end - start != HEADER_BYTES + pad4(index_bytes) + pad4(value_bytes):
        return RECORD_LENGTH
    pos = start + HEADER_BYTES
    if ic == INDEX_DENSE:
        if n != num_columns:
            return RECORD_WIDTH
    elif n > 0:
        # reductions over slices, which LLVM vectorizes (~0.25 ns per entry; indexing u8 at pos + k
        # does not vectorize, 1.3 ns): every gap after the first is positive and their sum, the
        # last column, is below num_columns; absolute columns ascend
        if ic == INDEX_DELTA_U16:
            low, high = u8[pos : pos + n], u8[pos + n : pos + 2 * n]
            last, smallest = np.uint64(low[0]) | (np.uint64(high[0]) << np.uint64(8)), np.uint64(1)
            for k in range(1, n):
                gap = np.uint64(low[k]) | (np.uint64(high[k]) << np.uint64(8))
                last += gap
                smallest = min(smallest, gap)
        else:
            cols = u32[pos // 4 : pos // 4 + n]
            last, smallest = np.uint64(cols[n - 1]), np.uint64(1)
            for k in range(1, n):
                smallest = min(smallest, np.uint64(cols[k] > cols[k - 1]))
        if smallest == 0 or last >= num_columns:
            return RECORD_COLUMNS
        if not _padding_is_zero(u8, pos + index_bytes, pos + pad4(index_bytes)):
            return RECORD_PADDING
    vpos = pos + pad4(index_bytes)
    if vc == VALUE_F32:
        finite, values = True, f32[vpos // 4 : vpos // 4 + n]
        for k in range(n):
            finite &= math.isfinite(values[k])
        if not finite:
            return RECORD_VALUE
    if not _padding_is_zero(u8, vpos + value_bytes, vpos + pad4(value_bytes)):
        return RECORD_PADDING
    return RECORD_OK


@nb.njit(parallel=True, nogil=True, cache=True)
def check_records(u8, u32, f32, starts, ends, num_columns):
    """``(index, problem)`` of the first malformed record (a ``RECORD_*`` code), or ``(-1, 0)``.

    Checks everything a decoder relies on: header, length, columns strictly ascending below
    ``num_columns`` (a dense record: exactly that wide), finite float values, zero padding. One
    parallel pass over the bytes the decoders then read from cache.
    """
    n = starts.shape[0]
    problems = np.zeros(n, np.int8)
    for i in nb.prange(n):
        problems[i] = _check_one(u8, u32, f32, starts[i], ends[i], num_columns)
    for i in range(n):
        if problems[i] != RECORD_OK:
            return i, np.int64(problems[i])
    return -1, np.int64(0)


@nb.njit(nogil=True, cache=True)
def _stored_nnz(u8, u32, f32, starts):
    """Nonzeros per record (a dense record counts its nonzero values)."""
    n = starts.shape[0]
    nnz = np.empty(n, np.int64)
    for i in range(n):
        start = starts[i]
        count = np.int64(u32[start // 4 + 1])
        if u8[start + 1] == INDEX_DENSE:
            fields = record_fields(u8, u32, f32, start)
            nonzero = 0
            for k in range(count):
                if value_at(fields, k) != 0:
                    nonzero += 1
            count = nonzero
        nnz[i] = count
    return nnz


@nb.njit(inline="always")
def decode_one(u8, u32, f32, start, indices, values, out):
    """Decode the record at byte ``start`` into ``indices``/``values`` from position ``out``;
    return the number of entries written (a dense record writes its nonzeros)."""
    fields = record_fields(u8, u32, f32, start)
    n = fields.n
    if fields.index_code == INDEX_DENSE:
        written = 0
        for k in range(n):
            v = value_at(fields, k)
            if v != 0:
                indices[out + written] = k
                values[out + written] = v
                written += 1
        return written
    # columns and values in loops of their own: the running sum of gaps is serial, the value
    # conversion then vectorizes. The sum in uint32 (it stays below the checked columns) and counts
    # of one byte (the common value code) in a loop of their own: 5% and 15% less time per entry
    # than an int64 sum and `value_at` in every loop, in two interleaved runs (csr slabs of 1,024
    # cells, one thread, 2-core EPYC)
    cols, vals = indices[out : out + n], values[out : out + n]
    if fields.index_code == INDEX_DELTA_U16:
        low, high = fields.gap_low, fields.gap_high
        col = np.uint32(0)
        for k in range(n):
            col += np.uint32(low[k]) | (np.uint32(high[k]) << np.uint32(8))
            cols[k] = col
    else:
        for k in range(n):
            cols[k] = fields.columns[k]
    if fields.value_code == VALUE_U8:
        counts = fields.value_low
        for k in range(n):
            vals[k] = np.float32(counts[k])
    else:
        for k in range(n):
            vals[k] = value_at(fields, k)
    return n


@nb.njit(parallel=True, nogil=True, cache=True)
def _decode_into_csr(u8, u32, f32, starts, indptr, indices, values):
    for i in nb.prange(starts.shape[0]):
        decode_one(u8, u32, f32, starts[i], indices, values, indptr[i])


@nb.njit(parallel=True, nogil=True, cache=True)
def _decode_into_slabs(u8, u32, f32, starts, nnz, positions, rows_per_slab, row_ids, indices, values):
    for i in nb.prange(starts.shape[0]):
        begin = positions[i]
        decode_one(u8, u32, f32, starts[i], indices, values, begin)
        row_ids[begin : begin + nnz[i]] = i % rows_per_slab


@nb.njit(inline="always")
def _fill_row(fields, row):
    """The record's values into ``row`` (zeros), at their columns. Checked: every column is one of
    ``row``'s (a dense record is exactly as wide). One loop per index code: LLVM hoists the value
    code's branch (see `value_at`) but not both."""
    if fields.index_code == INDEX_DENSE:
        for k in range(fields.n):
            row[k] = value_at(fields, k)
    elif fields.index_code == INDEX_DELTA_U16:
        col = np.int64(0)
        for k in range(fields.n):
            col += gap_at(fields, k)
            row[col] = value_at(fields, k)
    else:
        for k in range(fields.n):
            row[fields.columns[k]] = value_at(fields, k)


@nb.njit(inline="always")
def _clear_row(fields, row):
    """Zeros again where `_fill_row` wrote the record's values."""
    if fields.index_code == INDEX_DENSE:
        row[: fields.n] = 0.0
    elif fields.index_code == INDEX_DELTA_U16:
        col = np.int64(0)
        for k in range(fields.n):
            col += gap_at(fields, k)
            row[col] = 0.0
    else:
        for k in range(fields.n):
            row[fields.columns[k]] = 0.0


@nb.njit(parallel=True, nogil=True, cache=True)
def _decode_into_rows(u8, u32, f32, starts, out, scratch):
    """Records into the rows of ``out`` (rows past them zero), in ``len(scratch)`` parts on as many
    threads: each row built in its thread's ``scratch`` row (zeros, left zeros) and streamed out
    (`stream_row`), or, with a scratch of no columns, zeroed and written in place."""
    n, parts = out.shape[0], scratch.shape[0]
    for t in nb.prange(parts):
        for i in range(n * t // parts, n * (t + 1) // parts):
            row = row_to_write(out, i, scratch, t)
            if i < starts.shape[0]:
                fields = record_fields(u8, u32, f32, starts[i])
                _fill_row(fields, row)
                if row_written(out, i, row, scratch):
                    _clear_row(fields, row)
            else:
                row_written(out, i, row, scratch)  # a padding row: zeros
        store_fence()


def views(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The uint8/uint32/float32 views of a 4-aligned record buffer."""
    return buf, buf.view(np.uint32), buf.view(np.float32)


@dataclasses.dataclass(frozen=True, eq=False)
class Records:
    """Records the decoders read: record ``i`` is ``buf[begins[i]:ends[i]]`` (``buf`` a read-only,
    4-aligned uint8 buffer, which may hold other records too), every one checked by `check_records`
    against ``num_columns`` columns, so no decoder reads past a record, or writes past its output,
    or returns what the writer could not have written.

    Made by `check` (a loader: once per fetch, on the thread that read it) and `select` (each
    minibatch's records where they lie in their fetch: not copied, not checked again).

    >>> records = Records.check(*ds.read_buffer(0, 1024), ds.num_genes)     # doctest: +SKIP
    >>> indptr, indices, values = decode_csr(records)                      # doctest: +SKIP
    """

    buf: np.ndarray
    begins: np.ndarray
    ends: np.ndarray
    num_columns: int

    @classmethod
    def check(cls, buf: np.ndarray, starts: np.ndarray, num_columns: int) -> Records:
        """The records ``buf[starts[i]:starts[i + 1]]`` (``starts``: one entry per record plus the end),
        checked against ``num_columns`` columns. Raises `MalformedRecordError` for the first
        malformed one."""
        records = cls(read_only(buf), starts[:-1], starts[1:], int(num_columns))
        records._check(records.num_columns)
        return records

    @classmethod
    def of(cls, records: list[bytes], num_columns: int) -> Records:
        """``records`` joined (`join_records`) and checked."""
        return cls.check(*join_records(records), num_columns)

    @classmethod
    def padding(cls, n: int) -> Records:
        """``n`` empty records (padding rows)."""
        return cls.of([EMPTY_RECORD] * n, 0)

    def __len__(self) -> int:
        return self.begins.shape[0]

    def views(self, num_columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The buffer's uint8/uint32/float32 views, for a decoder of ``num_columns`` columns: records
        checked against another number of columns are checked again against these (a column past
        them, or a dense record of another width, is malformed here)."""
        if num_columns != self.num_columns:
            self._check(num_columns)
        return views(self.buf)

    def _check(self, num_columns: int) -> None:
        """Raise `MalformedRecordError` for the first record `check_records` refuses for ``num_columns``."""
        bad, problem = check_records(*views(self.buf), self.begins, self.ends, np.int64(num_columns))
        if bad >= 0:
            raise MalformedRecordError(int(bad), RECORD_PROBLEMS[problem])

    def select(self, positions: np.ndarray) -> Records:
        """Records ``positions`` (each ``>= 0``), in that order: where they lie, not copied."""
        return Records(self.buf, self.begins[positions], self.ends[positions], self.num_columns)


class MalformedRecordError(ValueError):
    """A record of a batch is not one the writer makes: record ``index`` of the batch, and why."""

    def __init__(self, index: int, reason: str):
        self.index, self.reason = index, reason
        super().__init__(f"record {index} of the batch is malformed ({reason}): the shard is corrupted")


def join_records(records: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate records into one aligned buffer whose length is a multiple of 4; return
    ``(buffer, starts)`` (starts has n+1 entries)."""
    lengths = np.fromiter((len(r) for r in records), dtype=np.int64, count=len(records))
    starts = np.zeros(len(records) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    data = b"".join(records)
    if len(data) % 4:  # only a damaged record has a length that is not a multiple of 4
        data += bytes(4 - len(data) % 4)
    buf = np.frombuffer(data, dtype=np.uint8)
    if buf.ctypes.data % 4:
        buf = buf.copy()
    return buf, starts


def decode_csr(records: Records) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode records into CSR ``(indptr int64, indices int32, values float32)``; dense records
    come back as their nonzero entries."""
    u8, u32, f32 = records.views(records.num_columns)
    nnz = _stored_nnz(u8, u32, f32, records.begins)
    indptr = np.zeros(len(nnz) + 1, dtype=np.int64)
    np.cumsum(nnz, out=indptr[1:])
    indices = np.empty(indptr[-1], dtype=np.int32)
    values = np.empty(indptr[-1], dtype=np.float32)
    _decode_into_csr(u8, u32, f32, records.begins, indptr, indices, values)
    return indptr, indices, values


class InvalidRowError(ValueError):
    """`encode_csr` met a row it cannot encode; ``row``, ``position`` and ``problem`` say where and why."""

    def __init__(self, row: int, position: int, problem: int):
        self.row, self.position, self.problem = row, position, problem
        super().__init__(f"row {row} is invalid (problem {problem} at position {position})")


def encode_csr(
    indptr: np.ndarray,
    tokens: np.ndarray,
    values: np.ndarray,
    *,
    token_to_col: np.ndarray | None = None,
    allow_negative: bool = True,
    out: Callable[[int], np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Check and encode CSR rows into records: one pass to plan, one to write, both parallel.

    ``token_to_col`` maps the ids in ``tokens`` to columns (default: ids are columns). Returns
    ``(buffer, starts)``: record ``i`` is ``buffer[starts[i]:starts[i+1]]``. ``out(nbytes)`` gives
    the buffer (uint8, ``nbytes`` long: say, shared memory another process writes out; default a
    new array). Raises `InvalidRowError` for the first row that is not sorted, unique, known and
    finite.
    """
    if token_to_col is None:
        top = int(tokens.max()) + 1 if len(tokens) else 0
        token_to_col = np.arange(max(top, 0), dtype=np.int32)
    indptr, tokens, values, values32, token_to_col, shift = _sparse_inputs(
        indptr, tokens, values, token_to_col
    )
    index_codes, value_codes, nbytes, problems, where = _plan_sparse(
        indptr, tokens, values, values32, token_to_col, shift, allow_negative
    )
    bad = np.flatnonzero(problems)
    if len(bad):
        i = int(bad[0])
        raise InvalidRowError(i, int(where[i]), int(problems[i]))
    starts, buf = _record_buffer(nbytes, out)
    _encode_sparse(
        indptr, tokens, values32, token_to_col, shift, index_codes, value_codes, starts[:-1], *views(buf)
    )
    return buf, starts


def encode_dense_rows(
    rows: np.ndarray, *, out: Callable[[int], np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Encode a dense float32 ``(n, width)`` array as ``INDEX_DENSE`` records; see `encode_csr`."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    value_codes, nbytes = plan_dense(rows)
    starts, buf = _record_buffer(nbytes, out)
    encode_dense(rows, value_codes, starts[:-1], *views(buf))
    return buf, starts


def _record_buffer(nbytes: np.ndarray, out) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, buffer)`` for records of these sizes, the buffer from ``out`` if given."""
    starts = np.zeros(len(nbytes) + 1, dtype=np.int64)
    np.cumsum(nbytes, out=starts[1:])
    size = int(starts[-1])
    buf = np.empty(size, dtype=np.uint8) if out is None else out(size)
    if buf.dtype != np.uint8 or buf.shape != (size,) or buf.ctypes.data % 4:
        msg = f"out({size}) must give a 4-aligned uint8 array of {size} bytes, got {buf.dtype} {buf.shape}"
        raise ValueError(msg)
    return starts, buf


def slab_dtypes(rows_per_slab: int, num_columns: int) -> tuple[np.dtype, np.dtype]:
    """The narrowest ``(row_ids, indices)`` dtypes of `decode_slabs` output: int16 row ids for up to
    32,767 rows per slab and uint16 columns for up to 65,536 columns, else int32."""
    row_dtype = np.dtype(np.int16 if rows_per_slab <= np.iinfo(np.int16).max else np.int32)
    index_dtype = np.dtype(np.uint16 if num_columns <= 1 << 16 else np.int32)
    return row_dtype, index_dtype


def decode_slabs(
    records: Records,
    *,
    num_rows: int,
    num_slabs: int,
    capacity: int,
    num_columns: int,
    empty=np.empty,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode records straight into fixed-shape padded sparse slabs, one per device.

    Rows are split into ``num_slabs`` equal groups (``num_rows`` may exceed the number of records:
    the missing rows are empty). Returns ``(row_ids, indices, values)`` of shape
    ``(num_slabs, capacity)``; entries past a slab's nonzeros are 0 (row 0, column 0, value 0).
    Row ids and columns take the narrowest dtype that holds them (`slab_dtypes`, given the number
    of columns): a third less to write and to move than int32. Raises ValueError when a slab
    holds more than ``capacity`` nonzeros. ``empty(shape, dtype)`` allocates the outputs.
    """
    n = len(records)
    rows_per_slab = num_rows // num_slabs
    row_dtype, index_dtype = slab_dtypes(rows_per_slab, num_columns)
    if n == 0:
        return tuple(np.zeros((num_slabs, capacity), dtype) for dtype in (row_dtype, index_dtype, np.float32))
    u8, u32, f32 = records.views(num_columns)
    nnz = np.zeros(num_rows, np.int64)
    nnz[:n] = _stored_nnz(u8, u32, f32, records.begins)
    per_slab = nnz.reshape(num_slabs, rows_per_slab)
    totals = per_slab.sum(axis=1)
    if totals.max() > capacity:
        msg = (
            f"a batch slab has {int(totals.max()):,} nonzeros but nnz_capacity is {capacity:,}: "
            f"pass nnz_capacity >= {int(totals.max()):,} to the output (oj.CSR(nnz_capacity=...), "
            "oj.Dense(on_device=True, nnz_capacity=...))"
        )
        raise ValueError(msg)
    # every slab's entries fill it from the start: only the padding after them needs zeroing
    row_ids = empty((num_slabs, capacity), row_dtype)
    indices = empty((num_slabs, capacity), index_dtype)
    values = empty((num_slabs, capacity), np.float32)
    for slab, total in enumerate(totals.tolist()):
        row_ids[slab, total:] = 0
        indices[slab, total:] = 0
        values[slab, total:] = 0
    positions = (np.cumsum(per_slab, axis=1) - per_slab + np.arange(num_slabs)[:, None] * capacity).reshape(
        -1
    )
    _decode_into_slabs(
        u8,
        u32,
        f32,
        records.begins,
        nnz,
        positions,
        rows_per_slab,
        row_ids.reshape(-1),
        indices.reshape(-1),
        values.reshape(-1),
    )
    return row_ids, indices, values


def decode_rows(records: Records, out: np.ndarray) -> np.ndarray:
    """Decode records straight into dense rows ``out`` (n ≥ records; extra rows are zeroed).

    One pass, no CSR in between: the fast path for dense output without normalization, and for
    datasets of the dense (gene panel) layout.
    """
    _decode_into_rows(*records.views(out.shape[1]), records.begins, out, rows_scratch(out))
    return out

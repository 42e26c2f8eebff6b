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
fetch without a Python loop per cell.
"""

from __future__ import annotations

import math
from collections import namedtuple

import numba as nb
import numpy as np

from omicsio_jax.core.buffers import read_only

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


@nb.njit(inline="always")
def _is_exact_uint(v):
    # +0.0 and positive integers up to 2**32 - 1 survive an integer round trip bit-exactly;
    # -0.0 does not (it would come back as +0.0). A cast round trip is cheaper than floor().
    if v > 0.0:
        return v <= 4294967295.0 and np.float64(np.uint32(v)) == v
    return v == 0.0 and math.copysign(1.0, v) > 0


@nb.njit(inline="always")
def _code_for(integral, vmax):
    if not integral:
        return VALUE_F32
    if vmax <= 255.0:
        return VALUE_U8
    if vmax <= 65535.0:
        return VALUE_U16
    return VALUE_U32


@nb.njit(inline="always")
def _value_code(values, lo, hi):
    vmax = 0.0
    for j in range(lo, hi):
        v = values[j]
        if not _is_exact_uint(v):
            return VALUE_F32
        if v > vmax:
            vmax = v
    return _code_for(True, vmax)


# Row problems found by `plan_sparse` (the codec never encodes an invalid row).
ROW_OK = 0
ROW_UNSORTED = 1
ROW_DUPLICATE = 2
ROW_UNKNOWN_GENE = 3
ROW_NOT_FINITE = 4
ROW_NEGATIVE = 5
ROW_OVERFLOW = 6

_F32_MAX = float(np.finfo(np.float32).max)


def plan_sparse(indptr, tokens, values, token_to_col, allow_negative):
    """Check each row and choose its codes; return ``(index_codes, value_codes, nbytes, problems, where)``.

    ``tokens`` are gene ids mapped to columns by ``token_to_col`` (-1 = unknown gene); a row is
    valid when its tokens ascend strictly, are known, and its values are finite float32 numbers
    (non-negative unless ``allow_negative``). ``problems[i]`` is a ``ROW_*`` code and
    ``where[i]`` the offending position in ``tokens`` (-1 if the row is valid). The arrays reach
    the kernel as `read_only` views, one kind whatever they came from (one compilation).
    """
    return _plan_sparse(*map(read_only, (indptr, tokens, values, token_to_col)), allow_negative)


@nb.njit(parallel=True, nogil=True, cache=True)
def _plan_sparse(indptr, tokens, values, token_to_col, allow_negative):
    n = indptr.shape[0] - 1
    num_tokens = token_to_col.shape[0]
    index_codes = np.zeros(n, np.uint8)
    value_codes = np.zeros(n, np.uint8)
    nbytes = np.zeros(n, np.int64)
    problems = np.zeros(n, np.int8)
    where = np.full(n, -1, np.int64)
    for i in nb.prange(n):
        lo, hi = indptr[i], indptr[i + 1]
        prev_token = np.int64(-1)
        prev_col = np.int64(0)
        max_gap = np.int64(0)
        vmax = 0.0
        integral = True
        code = ROW_OK
        for j in range(lo, hi):
            t = np.int64(tokens[j])
            v = values[j]
            if t <= prev_token:
                code = ROW_UNSORTED if t < prev_token else ROW_DUPLICATE
            elif t < 0 or t >= num_tokens or token_to_col[t] < 0:
                code = ROW_UNKNOWN_GENE
            elif not math.isfinite(v):
                code = ROW_NOT_FINITE
            elif v < 0 and not allow_negative:
                code = ROW_NEGATIVE
            elif abs(v) > _F32_MAX:
                code = ROW_OVERFLOW
            if code != ROW_OK:
                where[i] = j
                break
            col = np.int64(token_to_col[t])
            if col - prev_col > max_gap:
                max_gap = col - prev_col
            prev_token, prev_col = t, col
            f = np.float32(v)
            if integral and _is_exact_uint(f):
                if f > vmax:
                    vmax = f
            else:
                integral = False
        problems[i] = code
        ic = INDEX_DELTA_U16 if max_gap <= 65535 else INDEX_U32
        vc = _code_for(integral, vmax)
        index_codes[i] = ic
        value_codes[i] = vc
        nnz = hi - lo
        nbytes[i] = HEADER_BYTES + pad4(nnz * INDEX_WIDTH[ic]) + pad4(nnz * VALUE_WIDTH[vc])
    return index_codes, value_codes, nbytes, problems, where


@nb.njit(parallel=True, nogil=True, cache=True)
def plan_dense(rows):
    """Value code and record size for each row of a dense ``(n, width)`` float32 array."""
    n, width = rows.shape
    value_codes = np.empty(n, np.uint8)
    nbytes = np.empty(n, np.int64)
    for i in nb.prange(n):
        vc = _value_code(rows[i], 0, width)
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
def _write_values(u8, u32, f32, pos, values, lo, hi, vc):
    n = hi - lo
    for j in range(lo, hi):
        k = j - lo
        if vc == VALUE_U8:
            u8[pos + k] = np.uint8(values[j])
        elif vc == VALUE_U16:
            v = np.uint16(values[j])
            u8[pos + k] = np.uint8(v & 0xFF)
            u8[pos + n + k] = np.uint8(v >> 8)
        elif vc == VALUE_U32:
            u32[pos // 4 + k] = np.uint32(values[j])
        else:
            f32[pos // 4 + k] = values[j]


@nb.njit(parallel=True, nogil=True, cache=True)
def encode_sparse(indptr, tokens, values, token_to_col, index_codes, value_codes, starts, u8, u32, f32):
    """Write the records of rows planned by `plan_sparse` into ``u8`` (and its views) at ``starts``."""
    n = indptr.shape[0] - 1
    for i in nb.prange(n):
        lo, hi = indptr[i], indptr[i + 1]
        nnz = hi - lo
        start = starts[i]
        ic, vc = index_codes[i], value_codes[i]
        _write_header(u8, u32, start, ic, vc, nnz)
        pos = start + HEADER_BYTES
        prev = 0
        for j in range(lo, hi):
            col = token_to_col[tokens[j]]
            if ic == INDEX_DELTA_U16:
                gap = col - prev
                u8[pos + (j - lo)] = np.uint8(gap & 0xFF)
                u8[pos + nnz + (j - lo)] = np.uint8(gap >> 8)
                prev = col
            else:
                u32[pos // 4 + (j - lo)] = np.uint32(col)
        for b in range(pos + nnz * INDEX_WIDTH[ic], pos + pad4(nnz * INDEX_WIDTH[ic])):
            u8[b] = 0
        pos += pad4(nnz * INDEX_WIDTH[ic])
        _write_values(u8, u32, f32, pos, values, lo, hi, vc)
        end = pos + pad4(nnz * VALUE_WIDTH[vc])
        for b in range(pos + nnz * VALUE_WIDTH[vc], end):
            u8[b] = 0


@nb.njit(parallel=True, nogil=True, cache=True)
def encode_dense(rows, value_codes, starts, u8, u32, f32):
    """Write dense rows as ``INDEX_DENSE`` records at byte offsets ``starts``."""
    n, width = rows.shape
    for i in nb.prange(n):
        start = starts[i]
        vc = value_codes[i]
        _write_header(u8, u32, start, INDEX_DENSE, vc, width)
        pos = start + HEADER_BYTES
        _write_values(u8, u32, f32, pos, rows[i], 0, width, vc)
        end = pos + pad4(width * VALUE_WIDTH[vc])
        for b in range(pos + width * VALUE_WIDTH[vc], end):
            u8[b] = 0


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
    # conversion then vectorizes
    cols, vals = indices[out : out + n], values[out : out + n]
    if fields.index_code == INDEX_DELTA_U16:
        col = np.int64(0)
        for k in range(n):
            col += gap_at(fields, k)
            cols[k] = col
    else:
        for k in range(n):
            cols[k] = fields.columns[k]
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


@nb.njit(parallel=True, nogil=True, cache=True)
def _decode_into_rows(u8, u32, f32, starts, out):
    n = out.shape[0]
    for i in nb.prange(n):
        out[i, :] = 0.0
        if i >= starts.shape[0]:
            continue  # padding rows stay empty
        fields = record_fields(u8, u32, f32, starts[i])
        row = out[i]
        # checked: every column is one of `out`'s (a dense record is exactly as wide). One loop
        # per index code: LLVM hoists the value code's branch (see `value_at`) but not both.
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


def views(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The uint8/uint32/float32 views of a 4-aligned record buffer."""
    return buf, buf.view(np.uint32), buf.view(np.float32)


def checked_views(
    buf: np.ndarray, starts: np.ndarray, num_columns: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`views` of a batch of records, after `check_records` (columns below ``num_columns``).

    Raises `MalformedRecordError` for the first malformed record: no decoder ever reads past a
    record, or writes past its output, or returns what the writer could not have written.
    """
    u8, u32, f32 = views(read_only(buf))
    bad, problem = check_records(u8, u32, f32, starts[:-1], starts[1:], np.int64(num_columns))
    if bad >= 0:
        raise MalformedRecordError(int(bad), RECORD_PROBLEMS[problem])
    return u8, u32, f32


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


def decode_csr(
    buf: np.ndarray, starts: np.ndarray, num_columns: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode concatenated records into CSR ``(indptr int64, indices int32, values float32)``.

    ``starts`` has one entry per record plus the end of the buffer; dense records come back as
    their nonzero entries.
    """
    u8, u32, f32 = checked_views(buf, starts, num_columns)
    nnz = _stored_nnz(u8, u32, f32, starts[:-1])
    indptr = np.zeros(len(nnz) + 1, dtype=np.int64)
    np.cumsum(nnz, out=indptr[1:])
    indices = np.empty(indptr[-1], dtype=np.int32)
    values = np.empty(indptr[-1], dtype=np.float32)
    _decode_into_csr(u8, u32, f32, starts[:-1], indptr, indices, values)
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
) -> tuple[np.ndarray, np.ndarray]:
    """Check and encode CSR rows into records: one pass to plan, one to write, both parallel.

    ``token_to_col`` maps the ids in ``tokens`` to columns (default: ids are columns). Returns
    ``(buffer, starts)``: record ``i`` is ``buffer[starts[i]:starts[i+1]]``. Raises
    `InvalidRowError` for the first row that is not sorted, unique, known and finite.
    """
    if token_to_col is None:
        top = int(tokens.max()) + 1 if len(tokens) else 0
        token_to_col = np.arange(max(top, 0), dtype=np.int32)
    indptr, tokens, values, token_to_col = map(read_only, (indptr, tokens, values, token_to_col))
    index_codes, value_codes, nbytes, problems, where = _plan_sparse(
        indptr, tokens, values, token_to_col, allow_negative
    )
    bad = np.flatnonzero(problems)
    if len(bad):
        i = int(bad[0])
        raise InvalidRowError(i, int(where[i]), int(problems[i]))
    starts = np.zeros(len(nbytes) + 1, dtype=np.int64)
    np.cumsum(nbytes, out=starts[1:])
    buf = np.empty(starts[-1], dtype=np.uint8)
    encode_sparse(indptr, tokens, values, token_to_col, index_codes, value_codes, starts[:-1], *views(buf))
    return buf, starts


def encode_dense_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Encode a dense float32 ``(n, width)`` array as ``INDEX_DENSE`` records; see `encode_csr`."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    value_codes, nbytes = plan_dense(rows)
    starts = np.zeros(len(nbytes) + 1, dtype=np.int64)
    np.cumsum(nbytes, out=starts[1:])
    buf = np.empty(starts[-1], dtype=np.uint8)
    encode_dense(rows, value_codes, starts[:-1], *views(buf))
    return buf, starts


def slab_dtypes(rows_per_slab: int, num_columns: int) -> tuple[np.dtype, np.dtype]:
    """The narrowest ``(row_ids, indices)`` dtypes of `decode_slabs` output: int16 row ids for up to
    32,767 rows per slab and uint16 columns for up to 65,536 columns, else int32."""
    row_dtype = np.dtype(np.int16 if rows_per_slab <= np.iinfo(np.int16).max else np.int32)
    index_dtype = np.dtype(np.uint16 if num_columns <= 1 << 16 else np.int32)
    return row_dtype, index_dtype


def decode_slabs(
    buf: np.ndarray,
    starts: np.ndarray,
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
    n = len(starts) - 1
    rows_per_slab = num_rows // num_slabs
    row_dtype, index_dtype = slab_dtypes(rows_per_slab, num_columns)
    if n == 0:
        return tuple(np.zeros((num_slabs, capacity), dtype) for dtype in (row_dtype, index_dtype, np.float32))
    u8, u32, f32 = checked_views(buf, starts, num_columns)
    nnz = np.zeros(num_rows, np.int64)
    nnz[:n] = _stored_nnz(u8, u32, f32, starts[:-1])
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
        starts[:-1],
        nnz,
        positions,
        rows_per_slab,
        row_ids.reshape(-1),
        indices.reshape(-1),
        values.reshape(-1),
    )
    return row_ids, indices, values


def decode_rows(buf: np.ndarray, starts: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Decode records straight into dense rows ``out`` (n ≥ records; extra rows are zeroed).

    One pass, no CSR in between: the fast path for dense output without normalization, and for
    datasets of the dense (gene panel) layout.
    """
    _decode_into_rows(*checked_views(buf, starts, out.shape[1]), starts[:-1], out)
    return out

"""The codec's writer (`omicsio_jax.format.codec` states the layout): each row checked and given the
narrowest lossless codes (`plan_sparse`, `plan_dense`), then written as records (`encode_csr`,
`encode_dense_rows`), a whole batch per call."""

from __future__ import annotations

import math
from collections.abc import Callable

import numba as nb
import numpy as np

from omicsio_jax.core.buffers import read_only
from omicsio_jax.format.record_layout import (
    CODEC_VERSION,
    HEADER_BYTES,
    INDEX_DELTA_U16,
    INDEX_DENSE,
    INDEX_U32,
    INDEX_WIDTH,
    VALUE_F32,
    VALUE_U8,
    VALUE_U16,
    VALUE_U32,
    VALUE_WIDTH,
    pad4,
    views,
)

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
        if t < 0 or t >= num_tokens or token_to_col[t] < 0:  # first: -1 is no repeat of the start's -1
            return ROW_UNKNOWN_GENE, j
        if t <= prev:
            return (ROW_UNSORTED if t < prev else ROW_DUPLICATE), j
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

"""The codec's checker: `check_records` finds any record the writer could not have made, and `Records`
are records checked once, which every decoder then reads without bounds checks."""

from __future__ import annotations

import dataclasses
import math

import numba as nb
import numpy as np

from omicsio_jax.core.buffers import read_only
from omicsio_jax.format.record_layout import (
    CODEC_VERSION,
    EMPTY_RECORD,
    HEADER_BYTES,
    INDEX_DELTA_U16,
    INDEX_DENSE,
    INDEX_U32,
    INDEX_WIDTH,
    VALUE_F32,
    VALUE_U32,
    VALUE_WIDTH,
    join_records,
    pad4,
    views,
)

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

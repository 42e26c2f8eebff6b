"""The record layout of the codec (`omicsio_jax.format.codec` states it): its codes and widths, and
numba access to a record's fields, shared by the encoder, the checker and the decoders."""

from __future__ import annotations

from collections import namedtuple

import numba as nb
import numpy as np

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


def views(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The uint8/uint32/float32 views of a 4-aligned record buffer."""
    return buf, buf.view(np.uint32), buf.view(np.float32)


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

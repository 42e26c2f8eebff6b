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

This module holds the decoders and names the whole codec: the layout (`omicsio_jax.format.record_layout`),
the writer (`omicsio_jax.format.record_encode`) and the checker (`omicsio_jax.format.record_check`).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from omicsio_jax.core.kernels import row_to_write, row_written, rows_scratch, store_fence

# the codec's face: the checker, the writer and the layout, beside the decoders below
from omicsio_jax.format.record_check import RECORD_OK as RECORD_OK
from omicsio_jax.format.record_check import RECORD_PROBLEMS as RECORD_PROBLEMS
from omicsio_jax.format.record_check import MalformedRecordError as MalformedRecordError
from omicsio_jax.format.record_check import Records as Records
from omicsio_jax.format.record_check import check_records as check_records
from omicsio_jax.format.record_encode import ROW_DUPLICATE as ROW_DUPLICATE
from omicsio_jax.format.record_encode import ROW_NEGATIVE as ROW_NEGATIVE
from omicsio_jax.format.record_encode import ROW_NOT_FINITE as ROW_NOT_FINITE
from omicsio_jax.format.record_encode import ROW_OK as ROW_OK
from omicsio_jax.format.record_encode import ROW_OVERFLOW as ROW_OVERFLOW
from omicsio_jax.format.record_encode import ROW_UNKNOWN_GENE as ROW_UNKNOWN_GENE
from omicsio_jax.format.record_encode import ROW_UNSORTED as ROW_UNSORTED
from omicsio_jax.format.record_encode import InvalidRowError as InvalidRowError
from omicsio_jax.format.record_encode import column_shift as column_shift
from omicsio_jax.format.record_encode import encode_csr as encode_csr
from omicsio_jax.format.record_encode import encode_dense as encode_dense
from omicsio_jax.format.record_encode import encode_dense_rows as encode_dense_rows
from omicsio_jax.format.record_encode import plan_dense as plan_dense
from omicsio_jax.format.record_encode import plan_sparse as plan_sparse
from omicsio_jax.format.record_layout import CODEC_VERSION as CODEC_VERSION
from omicsio_jax.format.record_layout import EMPTY_RECORD as EMPTY_RECORD
from omicsio_jax.format.record_layout import HEADER_BYTES as HEADER_BYTES
from omicsio_jax.format.record_layout import INDEX_DELTA_U16 as INDEX_DELTA_U16
from omicsio_jax.format.record_layout import INDEX_DENSE as INDEX_DENSE
from omicsio_jax.format.record_layout import INDEX_U32 as INDEX_U32
from omicsio_jax.format.record_layout import INDEX_WIDTH as INDEX_WIDTH
from omicsio_jax.format.record_layout import VALUE_F32 as VALUE_F32
from omicsio_jax.format.record_layout import VALUE_U8 as VALUE_U8
from omicsio_jax.format.record_layout import VALUE_U16 as VALUE_U16
from omicsio_jax.format.record_layout import VALUE_U32 as VALUE_U32
from omicsio_jax.format.record_layout import VALUE_WIDTH as VALUE_WIDTH
from omicsio_jax.format.record_layout import RecordFields as RecordFields
from omicsio_jax.format.record_layout import gap_at as gap_at
from omicsio_jax.format.record_layout import join_records as join_records
from omicsio_jax.format.record_layout import pad4 as pad4
from omicsio_jax.format.record_layout import record_fields as record_fields
from omicsio_jax.format.record_layout import value_at as value_at
from omicsio_jax.format.record_layout import views as views


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

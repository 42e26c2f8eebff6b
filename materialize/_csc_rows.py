"""A CSC matrix's entries regrouped by blocks of rows, once, so that its rows read in one pass.

An AnnData matrix stored by column (CSC: R's dgCMatrix, and files converted from it) holds a cell's
entries in every column; rows read straight from it take a pass over all its entries per batch, a
conversion's time growing with the square of the cells. `regroup` makes two passes over the entries
instead, `CHUNK_ENTRIES` at a time (memory bounded by them): one counts each block's entries, the
next writes each chunk's entries of a block after those the block already holds, in three files
(each entry's row within its block, its column, its value's bits in the matrix's own type).
`RowBlocks` reads rows ``[lo, hi)`` from the blocks they fall in: a block's entries come in column
order, and a stable counting sort by row puts each row's entries in column order too (the CSR of
the same matrix).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import numba as nb
import numpy as np
from tqdm.auto import tqdm

from omicsio_jax import DataValidationError

CHUNK_ENTRIES = 1 << 22  # entries read from the matrix at a time
MAX_BLOCK_ROWS = 1 << 16  # a row within its block is stored as uint16
_FILES = ("rows", "cols", "vals")


@nb.njit(nogil=True, cache=True)
def _count_blocks(rows, shift, counts):  # pragma: no cover - numba
    """``counts[b]`` += the entries of block ``b`` (rows ``b << shift`` onwards) among ``rows`` (those
    past the blocks counted nowhere); returns the smallest and largest row seen, for the caller to
    refuse."""
    lo, hi = np.int64(0), np.int64(-1)
    if rows.shape[0]:
        lo = hi = np.int64(rows[0])
    blocks = counts.shape[0]
    for r in rows:
        r = np.int64(r)
        lo, hi = min(lo, r), max(hi, r)
        b = r >> shift
        if r >= 0 and b < blocks:
            counts[b] += 1
    return lo, hi


@nb.njit(nogil=True, cache=True)
def _by_block(rows, vals, ptr, e0, shift, counts, out_rows, out_cols, out_vals):  # pragma: no cover
    """Entries ``e0, e0 + 1, …`` of a CSC matrix (``rows``, ``vals``; ``ptr``: its column pointers)
    grouped by block, in their order within each (a stable counting sort by ``counts``, each block's
    entries, which become each block's end): each one's row within its block, column and value."""
    total = 0
    for b in range(counts.shape[0]):
        c = counts[b]
        counts[b] = total
        total += c
    col = np.searchsorted(ptr, e0, side="right") - 1
    mask = (np.int64(1) << shift) - 1
    for i in range(rows.shape[0]):
        while ptr[col + 1] <= e0 + i:
            col += 1
        r = np.int64(rows[i])
        j = counts[r >> shift]
        counts[r >> shift] = j + 1
        out_rows[j] = np.uint16(r & mask)
        out_cols[j] = col
        out_vals[j] = vals[i]


@nb.njit(nogil=True, cache=True)
def _by_row(rows, cols, vals, ptr, out_cols, out_vals):  # pragma: no cover - numba
    """A block's entries (each one's row within it, column, value) as CSR: ``ptr`` (zeros, one more
    than the rows) its row pointers, each row's entries in the order they came (a counting sort)."""
    n = ptr.shape[0] - 1
    for r in rows:
        ptr[np.int64(r) + 1] += 1
    for r in range(n):
        ptr[r + 1] += ptr[r]
    at = ptr[:n].copy()
    for i in range(rows.shape[0]):
        r = np.int64(rows[i])
        j = at[r]
        at[r] = j + 1
        out_cols[j] = cols[i]
        out_vals[j] = vals[i]


def check_rows(lo: int, hi: int, num_rows: int, where: str) -> None:
    """Refuse row indices ``lo..hi`` (the smallest and largest of some) outside ``0..num_rows-1``:
    ``where`` (a CSC matrix's indices) is damaged."""
    if lo < 0 or hi >= num_rows:
        msg = (
            f"{where} holds row {lo if lo < 0 else hi:,}, outside the matrix's {num_rows:,} rows: the "
            "file is damaged; rewrite it with anndata"
        )
        raise DataValidationError(msg)


def _bits(values: np.ndarray) -> np.ndarray:
    """``values`` as unsigned integers of their size: numba moves any type's bits so (float16's too)."""
    return values.view(f"u{values.dtype.itemsize}")


def _native(array: np.ndarray) -> np.ndarray:
    """``array`` in native byte order (numba reads no other)."""
    return array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))


def _write_at(fd: int, array: np.ndarray, offset: int) -> None:
    """All of ``array``'s bytes at ``offset`` of the file ``fd`` (a write may take fewer)."""
    view = memoryview(array).cast("B")
    while len(view):
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


@dataclasses.dataclass(frozen=True)
class RowBlocks:
    """The entries of a ``num_rows``-row matrix by blocks of ``1 << shift`` rows in ``folder``: block
    ``b``'s are entries ``starts[b]..starts[b + 1] - 1`` of each file. Picklable (a partition worker
    reads the files itself); reads keep the last block read, as batches of rows go through a block
    in order."""

    folder: str
    num_rows: int
    shift: int
    starts: np.ndarray
    value_type: str
    _last: list = dataclasses.field(default_factory=list, repr=False, compare=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_last": []}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def read(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows ``[lo, hi)`` as CSR ``(indptr, columns, values)``, columns ascending within rows."""
        lengths, cols, vals = [np.empty(0, np.int64)], [np.empty(0, np.int64)], [np.empty(0, self.value_type)]
        size = 1 << self.shift
        for b in range(lo >> self.shift, -(-hi >> self.shift)):
            ptr, c, v = self._block(b)
            first = b * size
            a, z = max(lo, first) - first, min(hi - first, len(ptr) - 1)
            lengths.append(np.diff(ptr[a : z + 1]))
            cols.append(c[ptr[a] : ptr[z]])
            vals.append(v[ptr[a] : ptr[z]])
        indptr = np.zeros(hi - lo + 1, np.int64)
        np.cumsum(np.concatenate(lengths), out=indptr[1:])
        return indptr, np.concatenate(cols), np.concatenate(vals)

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Block ``b`` as CSR of its rows (the last one read kept)."""
        if self._last and self._last[0] == b:
            return self._last[1]
        a, z = int(self.starts[b]), int(self.starts[b + 1])
        value = np.dtype(self.value_type)
        rows, cols, vals = (
            np.fromfile(Path(self.folder) / name, dtype=dtype, count=z - a, offset=a * dtype.itemsize)
            for name, dtype in zip(_FILES, (np.dtype(np.uint16), np.dtype(np.int32), value), strict=True)
        )
        ptr = np.zeros(min(1 << self.shift, self.num_rows - (b << self.shift)) + 1, np.int64)
        out_cols, out_vals = np.empty(z - a, np.int64), np.empty(z - a, value)
        _by_row(rows, cols, _bits(vals), ptr, out_cols, _bits(out_vals))
        self._last[:] = [b, (ptr, out_cols, out_vals)]
        return self._last[1]


def regroup(
    matrix, ptr: np.ndarray, num_rows: int, folder: str | Path, *, block_rows: int, label: str, progress: bool
) -> RowBlocks:
    """The entries of the CSC ``matrix`` group (``indices``, ``data``; h5py or zarr; ``ptr``: its
    ``indptr``, int64, checked) in ``folder`` (made; `RowBlocks`), by blocks of the largest power of
    two of rows up to ``block_rows`` (and `MAX_BLOCK_ROWS`). A row index outside ``0..num_rows-1``
    is refused as a damaged file, naming it."""
    shift = min(max(int(block_rows), 1), MAX_BLOCK_ROWS).bit_length() - 1
    indices, data = matrix["indices"], matrix["data"]
    first, end = int(ptr[0]), int(ptr[-1])
    value_type = data.dtype.newbyteorder("=").str
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    chunks = range(first, end, CHUNK_ENTRIES)
    counts = np.zeros(-(-num_rows >> shift), np.int64)
    with tqdm(
        total=2 * (end - first),
        unit="entries",
        unit_scale=True,
        disable=not progress,
        desc=f"regrouping {label} by row",
        file=sys.stderr,
        dynamic_ncols=True,
        delay=2.0,
    ) as bar:
        for e0 in chunks:  # pass 1: each block's entries
            rows = _native(indices[e0 : min(end, e0 + CHUNK_ENTRIES)])
            lo, hi = _count_blocks(rows, shift, counts)
            check_rows(lo, hi, num_rows, f"{label}: {matrix.name}/indices")
            bar.update(len(rows))
        starts = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=starts[1:])
        at = starts[:-1].copy()  # where each block's next entries go
        files = [os.open(folder / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600) for name in _FILES]
        try:
            for e0 in chunks:  # pass 2: each chunk's entries after those of their blocks so far
                e1 = min(end, e0 + CHUNK_ENTRIES)
                rows, vals = _native(indices[e0:e1]), _native(data[e0:e1])
                counts[:] = 0
                _count_blocks(rows, shift, counts)
                in_chunk = counts.copy()
                grouped = (np.empty(len(rows), np.uint16), np.empty(len(rows), np.int32), np.empty_like(vals))
                _by_block(
                    rows, _bits(vals), ptr, e0, shift, counts, grouped[0], grouped[1], _bits(grouped[2])
                )
                offset = 0
                for b in np.flatnonzero(in_chunk):
                    n = int(in_chunk[b])
                    for fd, array in zip(files, grouped, strict=True):
                        _write_at(fd, array[offset : offset + n], int(at[b]) * array.itemsize)
                    at[b] += n
                    offset += n
                bar.update(e1 - e0)
        finally:
            for fd in files:
                os.close(fd)
    return RowBlocks(str(folder), num_rows, shift, starts, value_type)

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

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numba as nb
import numpy as np

from omicsio_jax import DataValidationError
from omicsio_jax.format import progress_bar

from ._anndata_elements import native_order

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
    opened: Callable[[], contextlib.AbstractContextManager],
    ptr: np.ndarray,
    num_rows: int,
    folder: str | Path,
    *,
    value_type: str,
    block_rows: int,
    label: str,
    where: str,
    progress: bool,
    run: Callable[[Callable, list], Iterator] | None = None,
    workers: int = 1,
) -> RowBlocks:
    """The entries of a CSC matrix in ``folder`` (made; `RowBlocks`), by blocks of the largest power
    of two of rows up to ``block_rows`` (and `MAX_BLOCK_ROWS`). ``opened()`` opens the matrix group
    (``indices``, ``data``; h5py or zarr) in the process it is called in; ``ptr`` is its ``indptr``
    (int64, checked), ``value_type`` its values' (native order). The entries go in ranges of whole
    chunks, each pass's ranges through ``run(fn, items)`` (`Pool.map` on its ``workers``, each
    opening the file itself; default: one after the other here), each range's entries of a block
    after those of the ranges before it. A row index outside ``0..num_rows-1`` is refused as a
    damaged file, naming it (``where``: the matrix's indices; ``label`` is the input's, for the bar)."""
    shift = min(max(int(block_rows), 1), MAX_BLOCK_ROWS).bit_length() - 1
    first, end = int(ptr[0]), int(ptr[-1])
    blocks = -(-num_rows >> shift)
    step = max(1, -(-(end - first) // (CHUNK_ENTRIES * 4 * workers))) * CHUNK_ENTRIES  # ~4 ranges a worker
    ranges = [(e0, min(end, e0 + step)) for e0 in range(first, end, step)]
    run = run or (lambda fn, items: map(fn, items))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with progress_bar(
        total=2 * (end - first),
        unit="entries",
        unit_scale=True,
        progress=progress,
        desc=f"regrouping {label} by row",
        dynamic_ncols=True,
        delay=2.0,
    ) as bar:
        counts = np.zeros((len(ranges), blocks), np.int64)  # pass 1: each range's entries of each block
        for k, result in enumerate(run(_count_part, [(opened, e0, e1, shift, blocks) for e0, e1 in ranges])):
            if isinstance(result, BaseException):
                raise result
            counts[k], (lo, hi) = result
            check_rows(lo, hi, num_rows, where)
            bar.update(ranges[k][1] - ranges[k][0])
        starts = np.zeros(blocks + 1, np.int64)
        np.cumsum(counts.sum(axis=0), out=starts[1:])
        at = starts[:-1] + np.cumsum(counts, axis=0) - counts  # where each range's entries of a block go
        for name, size in zip(_FILES, (2, 4, np.dtype(value_type).itemsize), strict=True):
            with open(folder / name, "wb") as f:
                f.truncate(int(starts[-1]) * size)
        items = [(opened, ptr, e0, e1, shift, at[k], str(folder)) for k, (e0, e1) in enumerate(ranges)]
        for k, result in enumerate(run(_write_part, items)):  # pass 2
            if isinstance(result, BaseException):
                raise result
            bar.update(ranges[k][1] - ranges[k][0])
    return RowBlocks(str(folder), num_rows, shift, starts, value_type)


def _count_part(item) -> tuple[np.ndarray, tuple[int, int]]:
    """Pass 1 of `regroup` over entries ``e0..e1-1``: the entries of each block, and the smallest
    and largest row."""
    opened, e0, e1, shift, blocks = item
    counts = np.zeros(blocks, np.int64)
    lo, hi = 0, -1
    with opened() as matrix:
        for c0 in range(e0, e1, CHUNK_ENTRIES):
            rows = native_order(matrix["indices"][c0 : min(e1, c0 + CHUNK_ENTRIES)])
            a, z = _count_blocks(rows, shift, counts)
            lo, hi = (a, z) if hi < lo else (min(lo, a), max(hi, z))
    return counts, (int(lo), int(hi))


def _write_part(item) -> int:
    """Pass 2 of `regroup` over entries ``e0..e1-1``: each block's entries at ``at[b]`` onwards of
    each file; returns how many it wrote."""
    opened, ptr, e0, e1, shift, at, folder = item
    at = at.copy()
    files = [os.open(Path(folder) / name, os.O_WRONLY) for name in _FILES]
    try:
        with opened() as matrix:
            for c0 in range(e0, e1, CHUNK_ENTRIES):
                c1 = min(e1, c0 + CHUNK_ENTRIES)
                rows, vals = native_order(matrix["indices"][c0:c1]), native_order(matrix["data"][c0:c1])
                counts = np.zeros(len(at), np.int64)
                _count_blocks(rows, shift, counts)
                in_chunk = counts.copy()
                grouped = (np.empty(len(rows), np.uint16), np.empty(len(rows), np.int32), np.empty_like(vals))
                _by_block(
                    rows, _bits(vals), ptr, c0, shift, counts, grouped[0], grouped[1], _bits(grouped[2])
                )
                offset = 0
                for b in np.flatnonzero(in_chunk):
                    n = int(in_chunk[b])
                    for fd, array in zip(files, grouped, strict=True):
                        _write_at(fd, array[offset : offset + n], int(at[b]) * array.itemsize)
                    at[b] += n
                    offset += n
    finally:
        for fd in files:
            os.close(fd)
    return e1 - e0

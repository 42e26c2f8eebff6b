"""Streaming reads of a local parquet file's rows by pyarrow: its row groups, the cells a read decodes
at a time, and the one read a process leaves open for the next partition to go on from.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

DEFAULT_BATCH_CELLS = 8192  # DuckDB's list decoding prefers large batches (31.8k cells/s vs 30.4k at 2,048)
BATCH_VALUES = 1 << 22  # the nonzeros a pyarrow read of a parquet file decodes at a time, by default


def row_group_starts(metadata: pq.FileMetaData) -> np.ndarray:
    """The first row of each row group of a parquet file, and its row count last (int64)."""
    sizes = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
    return np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])


def cells_per_batch(metadata: pq.FileMetaData, column: str) -> int:
    """The cells a read of a parquet file decodes at a time by default: about `BATCH_VALUES` values
    of its list ``column`` (by the file's own count of them), as a power of two from 256 to
    `DEFAULT_BATCH_CELLS` (that, where the file has no such column or no rows).

    The arrays a batch passes through (Arrow's lists, the tokens and values, the encoded records)
    grow with its values. At 8,192 cells of ~1,500 nonzeros they are tens of MB each, past what the
    allocators keep for reuse, so every batch takes fresh pages, which the kernel zeroes: a fresh
    two-worker conversion of 50,000 such cells spent 2.5–5.0 s in the kernel against 0.6–1.5 s at
    2,048 cells, and 7.7–10.9 CPU-s in all against 6.2–7.9 (2-core AMD EPYC, 5 alternating runs)."""
    leaf = next(
        (j for j in range(metadata.num_columns) if metadata.schema.column(j).path.startswith(f"{column}.")),
        None,
    )
    groups = [metadata.row_group(g) for g in range(metadata.num_row_groups)]
    rows = sum(group.num_rows for group in groups)
    if leaf is None or not rows:
        return DEFAULT_BATCH_CELLS
    width = max(sum(group.column(leaf).num_values for group in groups) / rows, 1.0)  # values per row
    cells = 256
    while cells < DEFAULT_BATCH_CELLS and 2 * cells * width <= BATCH_VALUES:
        cells *= 2
    return cells


def group_of(starts: np.ndarray, row: int) -> int:
    """The row group (of `row_group_starts`' ``starts``) that holds ``row``."""
    return int(np.searchsorted(starts, row, side="right")) - 1


class ParquetStream:
    """An open read of a parquet file's rows from ``row`` on (``key``: whose read, of which file and
    columns): the batches still to come, and the rest of the batch last taken."""

    def __init__(
        self,
        key: tuple,
        path: Path,
        row: int,
        batch_cells: int | None,
        columns: list[str],
        use_threads: bool,
    ):
        """The read of ``path`` from the first row of the row group that holds ``row``, ``batch_cells``
        rows at a time (None: by the row width of its list ``columns[1]``, `cells_per_batch`)."""
        # read, not mapped: a file cut short raises, not SIGBUS; not pre-buffered: pyarrow keeps every
        # pre-buffered row group's raw bytes until the file is closed, and a stream goes on for as
        # many partitions as its process writes in a row
        reader = pq.ParquetFile(path, pre_buffer=False)
        self.key, self.starts = key, row_group_starts(reader.metadata)
        self.num_rows = int(self.starts[-1])
        group = self.group_of(row)
        self.row = int(self.starts[group])
        self._batches = reader.iter_batches(
            batch_cells or cells_per_batch(reader.metadata, columns[1]),
            row_groups=range(group, len(self.starts) - 1),
            columns=columns,
            use_threads=use_threads,
        )
        self._pending: pa.RecordBatch | None = None

    def group_of(self, row: int) -> int:
        return group_of(self.starts, row)

    def rows(self, lo: int, hi: int) -> Iterator[tuple[int, pa.RecordBatch]]:
        """``(first row, batch)`` of rows ``[lo, hi)`` (``lo >= self.row``); the rows before ``lo``
        are decoded and dropped."""
        while self.row < hi:
            rb = self._pending if self._pending is not None else next(self._batches, None)
            self._pending = None
            if rb is None:  # the file holds fewer rows than planned: the partition's count says so
                return
            a, b = max(lo - self.row, 0), min(hi - self.row, rb.num_rows)
            if b < rb.num_rows:
                self._pending = rb.slice(b)
            if a < b:
                yield self.row + a, rb.slice(a, b - a)
            self.row += b


class _Streams:
    """The stream a read of this process left open (at most one), taken by the read that goes on
    from it (any thread): one that starts at or after its row, in the same row group."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: ParquetStream | None = None

    def keep(self, stream: ParquetStream) -> None:
        with self._lock:
            self._open = stream

    def take(self, key: tuple, row: int) -> ParquetStream | None:
        with self._lock:
            stream, self._open = self._open, None
        if stream is None or stream.key != key or row < stream.row:
            return None
        if row < stream.num_rows and stream.group_of(row) != stream.group_of(stream.row):
            return None  # a later row group: a fresh read starts there, decoding nothing before it
        return stream

    def drop(self, owner: int) -> None:
        """Let go of the stream of the source ``owner`` (its ``id``), if it left one."""
        with self._lock:
            if self._open is not None and self._open.key[0] == owner:
                self._open = None


PARQUET_STREAMS = _Streams()

"""Reading records from shards: runs of cells read in one go, into one buffer.

`read_runs` is the one place records are read (`Dataset.read_records` / ``read_csr``, the
loaders' `FetchReader`): for a dataset on object storage it first has the chunks of all the runs
fetched together and pinned while they are read (`Dataset.prepared`). The records come back as
``(buf, starts)``, concatenated, what the decoders take: read by `chunk_reader.ChunkReader` from
the shards' chunks where the dataset allows it (`Dataset.chunk_reader`), else by ArrayRecord's
reader (`ShardReaders`) and joined. A chunk that cannot be read (`ReadFailed`: a hash, a short
file; ArrayRecord's reader, which does not raise on a file it cannot open — ``ok()`` is False —
raises a bare ``RuntimeError`` on a corrupted chunk) becomes a `DatasetFormatError` naming the
dataset, the shard, the cells and ``omicsio-materialize verify``, as does a record the codec finds
malformed (`records_checked`). A remote shard's failed read is first retried once with its chunks
fetched again (its cached copy, not the object, may be what is damaged).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from omicsio_jax.core.errors import DatasetFormatError
from omicsio_jax.format.codec import MalformedRecordError, join_records
from omicsio_jax.records.shard_files import ReadFailed, ShardFiles

if TYPE_CHECKING:
    from omicsio_jax.records.chunk_reader import ChunkReader


class RecordSource(ShardFiles, Protocol):
    """A dataset as `read_runs` sees it: its shard files, and the chunk reader it reads them with
    (None: ArrayRecord's reader)."""

    chunk_reader: ChunkReader | None


class ShardReaders:
    """ArrayRecord readers of a dataset's shards, opened on first use and checked; with
    ``per_thread`` each thread gets its own (a reader is then never shared across threads)."""

    def __init__(self, dataset: ShardFiles, options: str, *, per_thread: bool = False):
        self.dataset, self.options, self.per_thread = dataset, options, per_thread
        self._local = threading.local()
        self._shared: dict[int, ArrayRecordReader] = {}
        self._lock = threading.Lock()

    def _readers(self) -> dict[int, ArrayRecordReader]:
        if not self.per_thread:
            return self._shared
        readers = getattr(self._local, "readers", None)
        if readers is None:
            readers = self._local.readers = {}
        return readers

    def get(self, shard: int) -> ArrayRecordReader:
        with contextlib.nullcontext() if self.per_thread else self._lock:
            readers = self._readers()
            reader = readers.get(shard)
            if reader is None:
                path = self.dataset.local_path(self.dataset.manifest.shards[shard].path)
                reader = ArrayRecordReader(str(path), self.options)
                if not reader.ok():
                    raise ReadFailed(shard, 0, 0, f"{path} is not a readable ArrayRecord file")
                readers[shard] = reader
            return reader

    def drop(self, shard: int) -> None:
        with contextlib.nullcontext() if self.per_thread else self._lock:
            reader = self._readers().pop(shard, None)
        if reader is not None:
            reader.close()

    def close(self) -> None:
        with self._lock:
            for reader in self._shared.values():
                reader.close()
            self._shared.clear()


def consecutive_runs(sorted_rows: np.ndarray) -> list[tuple[int, int]]:
    """Split sorted unique ints into maximal ``[begin, end)`` runs of consecutive values."""
    if len(sorted_rows) == 0:
        return []
    breaks = np.flatnonzero(np.diff(sorted_rows) != 1) + 1
    begins = sorted_rows[np.concatenate(([0], breaks))]
    ends = sorted_rows[np.concatenate((breaks - 1, [len(sorted_rows) - 1]))] + 1
    return list(zip(begins.tolist(), ends.tolist(), strict=True))


def shard_pieces(row_runs: Sequence[tuple[int, int]], shard_cells: int) -> list[tuple[int, int, int]]:
    """``(shard, begin, end)`` record ranges within shards of the global ``[begin, end)`` runs."""
    pieces = []
    for begin, end in row_runs:
        while begin < end:
            shard = begin // shard_cells
            stop = min(end, (shard + 1) * shard_cells)
            pieces.append((shard, begin - shard * shard_cells, stop - shard * shard_cells))
            begin = stop
    return pieces


# a read from a remote dataset's cache that fails its checks is fetched again before the shard is
# called corrupted: a chunk another process sharing the cache dropped between the fetch and the
# read (rare; it takes that to happen twice in a row to need a third attempt) is not corruption
REMOTE_READ_ATTEMPTS = 3


def read_runs(
    dataset: RecordSource,
    readers: ShardReaders,
    row_runs: Sequence[tuple[int, int]],
    *,
    announce_first: bool = True,
    allocate=None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(buf, starts)`` of the records of the cells of every ``[begin, end)`` run, in order
    (``announce_first``: see `Dataset.prepared`; ``allocate``: see `ChunkReader.read`)."""
    pieces = shard_pieces(row_runs, dataset.manifest.shard_cells)
    refetch, attempts = None, 0
    while True:
        with dataset.prepared(pieces, refetch=refetch, announce_first=announce_first):
            try:
                if dataset.chunk_reader is not None:
                    return dataset.chunk_reader.read(pieces, allocate=allocate)
                return join_records(_read(readers, pieces))
            except ReadFailed as e:
                failed = e
        readers.drop(failed.shard)
        attempts += 1
        if not dataset.is_remote or attempts >= REMOTE_READ_ATTEMPTS:
            raise _corrupted(dataset, failed) from failed.__cause__
        refetch = failed.shard


def _read(readers: ShardReaders, pieces: list[tuple[int, int, int]]) -> list[bytes]:
    out: list[bytes] = []
    for shard, begin, end in pieces:
        reader = readers.get(shard)
        try:
            out.extend(reader.read(begin, end))
        except RuntimeError as e:  # riegeli: a chunk's hash does not match, or a chunk is truncated
            raise ReadFailed(shard, begin, end, str(e).strip().splitlines()[0]) from e
    return out


class records_checked:  # lower case, as a contextlib one; a class: cheaper, entered once a batch
    """Report a malformed record among the decoded records of global ``rows`` (in batch order) as a
    corrupted dataset naming its shard and cell (`DatasetFormatError`, with the fix)."""

    __slots__ = ("dataset", "rows")

    def __init__(self, dataset: ShardFiles, rows: np.ndarray):
        self.dataset, self.rows = dataset, rows

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, e, tb) -> bool:
        if not isinstance(e, MalformedRecordError):
            return False
        row = int(self.rows[e.index])
        shard = row // self.dataset.manifest.shard_cells
        record = row - shard * self.dataset.manifest.shard_cells
        raise _corrupted(self.dataset, ReadFailed(shard, record, record + 1, e.reason)) from e


def _corrupted(dataset: ShardFiles, failed: ReadFailed) -> DatasetFormatError:
    shard = dataset.manifest.shards[failed.shard]
    if failed.end == 0:
        where = "cannot be opened"
    elif failed.end - failed.begin == 1:
        where = f"cell {shard.first_cell + failed.begin} (record {failed.begin}) cannot be read"
    else:
        where = (
            f"cells {shard.first_cell + failed.begin}..{shard.first_cell + failed.end - 1} "
            f"(records {failed.begin}..{failed.end - 1}) cannot be read"
        )
    return DatasetFormatError.run_verify(
        dataset.path, f"{dataset.path}: shard {shard.path}: {where}: {failed.reason}"
    )

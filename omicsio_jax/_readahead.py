"""Kernel read-ahead for a local dataset: the exact byte ranges of a read, announced before it.

ArrayRecord's reader reads a range of records with blocking ``pread``s, one after another, so on
a dataset larger than the page cache a fetch's thousands of block reads run at a queue depth of
one. Before a batch of reads, `ReadAhead.advise` hands the kernel every byte range it will touch,
from the shards' chunk indexes (`posix_fadvise(POSIX_FADV_WILLNEED)`: the reads are queued at the
device's depth and nothing waits for them), touching chunks coalesced into one range; the reader
then finds its pages arriving or already in the cache. The pages belong to the page cache, not to
the process (its RSS does not grow), and a warm read pays one page-cache lookup per page.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ._chunks import ChunkIndex, chunk_index_path, chunks_of

if TYPE_CHECKING:
    from ._dataset import Dataset

_HAS_FADVISE = hasattr(os, "posix_fadvise")


def chunk_spans(index: ChunkIndex, chunks: np.ndarray) -> np.ndarray:
    """``(k, 2)`` byte ranges of sorted data ``chunks``, chunks that touch merged into one range."""
    ranges = index.chunk_bytes(chunks)
    if len(ranges) == 0:
        return ranges
    breaks = np.flatnonzero(ranges[1:, 0] != ranges[:-1, 1]) + 1
    return np.stack([ranges[np.concatenate(([0], breaks)), 0], ranges[np.concatenate((breaks - 1, [len(ranges) - 1])), 1]],
                    axis=1)


class ReadAhead:
    """Announces the byte ranges of records about to be read from a local dataset's shards.

    A shard's chunk index is loaded on its first use and kept (16 bytes per chunk: one byte per
    cell at 16 cells per chunk, about what each ArrayRecord reader keeps of its footer); a shard
    is opened for each call and closed after it (the kernel keeps the pages, not the descriptor),
    so a dataset of thousands of shards holds no descriptors. Counts what it announced
    (``advised_bytes``).
    """

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        self.group_size = int(dataset.manifest.array_record["group_size"])
        self._indexes: dict[int, ChunkIndex] = {}
        self._lock = threading.Lock()
        self.advised_bytes = 0

    def index(self, shard: int) -> ChunkIndex:
        index = self._indexes.get(shard)
        if index is None:
            path = self.dataset.local_path(chunk_index_path(self.dataset.manifest.shards[shard].path))
            index = ChunkIndex(np.load(path), self.group_size)  # not mmap: a mapping keeps a descriptor
            with self._lock:
                index = self._indexes.setdefault(shard, index)
        return index

    def advise(self, pieces: Sequence[tuple[int, int, int]]) -> None:
        """Start reading the chunks that hold the records ``(shard, begin, end)`` of ``pieces``."""
        if not _HAS_FADVISE or not pieces:
            return
        advised = 0
        for shard, chunks in chunks_of(pieces, self.group_size).items():
            spans = chunk_spans(self.index(shard), chunks)
            fd = os.open(self.dataset.local_path(self.dataset.manifest.shards[shard].path), os.O_RDONLY)
            try:
                for begin, end in spans.tolist():
                    os.posix_fadvise(fd, begin, end - begin, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)
            advised += int((spans[:, 1] - spans[:, 0]).sum())
        with self._lock:
            self.advised_bytes += advised

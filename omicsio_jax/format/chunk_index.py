"""Shard chunk indexes: which bytes of a shard a read of some of its records needs.

ArrayRecord compresses records in chunks of ``group_size`` (the manifest's ``array_record``
options) and keeps its chunk offsets in a footer that only its own reader parses. `materialize`
therefore writes, beside each shard, ``chunks/shard-NNNNN.npy``: a ``(3 + num_chunks, 2)`` uint64
array of ``[begin, end)`` byte ranges — the head of the file (signature), its footer chunk and its
postscript chunk (what a reader reads when it opens the file), then every data chunk in record
order. A reader of a shard on object storage fetches those ranges only (`ChunkIndex.ranges`) into a
sparse local copy, which ArrayRecord's own reader then reads as if it were whole (a read that
reaches a chunk never fetched fails on its chunk header hash; it cannot return wrong records).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import PurePosixPath

import numpy as np

CHUNK_INDEX_DIR = "chunks"
_OPEN_ROWS = 3  # head, footer chunk, postscript chunk


def load_chunk_index(path: str | os.PathLike[str]) -> np.ndarray:
    """A chunk index file's ``(rows, 2)`` uint64 array: the one ``.npy`` layout materialize writes
    is read directly (a third of ``np.load``'s time, which a first fetch over thousands of shards
    pays per shard); any other layout through ``np.load``."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] == b"\x93NUMPY\x01\x00":
        end = 10 + int.from_bytes(data[8:10], "little")
        header = data[10:end]
        if (
            b"'descr': '<u8'" in header
            and b"'fortran_order': False" in header
            and (len(data) - end) % 16 == 0
        ):
            return np.frombuffer(data, np.uint64, offset=end).reshape(-1, 2)
    return np.load(path)


def chunk_index_problem(rows: np.ndarray, *, num_cells: int, num_bytes: int, group_size: int) -> str | None:
    """Why ``rows`` cannot be the chunk index of a shard of ``num_cells`` cells in ``num_bytes`` bytes
    (a damaged or foreign file), or None: one ``[begin, end)`` range per opening range and per data
    chunk, each within the shard, the data chunks in file order."""
    expected = _OPEN_ROWS + -(-num_cells // group_size)
    if rows.ndim != 2 or rows.shape[1] != 2 or rows.dtype.kind not in "iu":
        return f"a {rows.dtype} array of shape {rows.shape}, not ({expected}, 2) integers"
    if len(rows) != expected:
        return f"{len(rows) - _OPEN_ROWS} data chunks, not {expected - _OPEN_ROWS} ({num_cells} cells)"
    ranges = rows.astype(np.int64)  # a uint64 past 2^63 turns negative: out of range below
    data = ranges[_OPEN_ROWS:]
    if (ranges < 0).any() or (ranges[:, 1] < ranges[:, 0]).any() or int(ranges.max(initial=0)) > num_bytes:
        return f"a byte range outside the shard's {num_bytes:,} bytes"
    if (data[1:, 0] < data[:-1, 1]).any():
        return "data chunks out of order"
    return None


def chunk_index_path(shard_path: str) -> str:
    """The chunk index of a shard, relative to the dataset root: ``chunks/shard-00003.npy``."""
    return f"{CHUNK_INDEX_DIR}/{PurePosixPath(shard_path).with_suffix('.npy').name}"


@dataclasses.dataclass(frozen=True)
class ChunkIndex:
    """The byte ranges of one shard; ``group_size`` records per data chunk."""

    rows: np.ndarray  # (3 + num_chunks, 2) uint64
    group_size: int

    @property
    def num_chunks(self) -> int:
        return len(self.rows) - _OPEN_ROWS

    @property
    def opening(self) -> np.ndarray:
        """``(3, 2)``: the ranges ArrayRecord's reader reads when it opens the file."""
        return self.rows[:_OPEN_ROWS].astype(np.int64)

    def chunks_of(self, begin: int, end: int) -> range:
        """Data chunks holding records ``[begin, end)`` of the shard."""
        if end <= begin:
            return range(0)
        return range(begin // self.group_size, (end - 1) // self.group_size + 1)

    def chunk_bytes(self, chunks: np.ndarray) -> np.ndarray:
        """``(len(chunks), 2)`` int64 byte ranges of data chunks."""
        return self.rows[_OPEN_ROWS + np.asarray(chunks, np.int64)].astype(np.int64)

    @property
    def data_bytes(self) -> int:
        data = self.rows[_OPEN_ROWS:]
        return int((data[:, 1] - data[:, 0]).sum())


def chunks_of(pieces: Sequence[tuple[int, int, int]], group_size: int) -> dict[int, np.ndarray]:
    """The data chunks (sorted, unique) per shard that hold the records ``(shard, begin, end)`` of ``pieces``."""
    if not pieces:
        return {}
    shard, begin, end = np.asarray(pieces, np.int64).T
    first, count = begin // group_size, (end - 1) // group_size + 1 - begin // group_size
    offsets = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
    keys = np.unique((np.repeat(shard, count) << 32) | (np.repeat(first, count) + offsets))
    shards, starts = np.unique(keys >> 32, return_index=True)
    return {int(s): part & 0xFFFFFFFF for s, part in zip(shards, np.split(keys, starts[1:]), strict=True)}


def merge_spans(needed: dict[int, np.ndarray], *, slack: float) -> dict[int, list[tuple[int, int]]]:
    """Byte spans to read for sorted, disjoint byte ranges ``(k, 2)`` per shard: touching ranges
    merge, and so do the smallest gaps while all gaps taken add up to ≤ ``slack`` × the needed bytes
    (``slack=0``: touching ranges only)."""
    shards = list(needed)
    gaps = [needed[s][1:, 0] - needed[s][:-1, 1] for s in shards]
    flat = np.concatenate([*gaps, np.zeros(0, np.int64)])
    total = sum(int((r[:, 1] - r[:, 0]).sum()) for r in needed.values())
    order = np.argsort(flat, kind="stable")
    merge = np.empty(len(flat), bool)
    merge[order] = np.cumsum(flat[order]) <= slack * total
    out, pos = {}, 0
    for s, g in zip(shards, gaps, strict=True):
        r, breaks = needed[s], np.flatnonzero(~merge[pos : pos + len(g)]) + 1
        pos += len(g)
        if len(r) == 0:
            out[s] = []
            continue
        begins = r[np.concatenate(([0], breaks)), 0].tolist()
        ends = r[np.concatenate((breaks - 1, [len(r) - 1])), 1].tolist()
        out[s] = list(zip(begins, ends, strict=True))
    return out

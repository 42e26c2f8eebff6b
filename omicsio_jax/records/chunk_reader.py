"""Records straight from a shard's chunks: ``pread``, riegeli's hash checks, zstd, in one numba pass.

ArrayRecord's Python reader returns a ``bytes`` object per record: it decompresses each chunk,
copies every record into a C++ string, then into a Python object under the GIL, and the loader
copied them once more into one buffer to decode. Reading a 16-cell block that way cost 2.4 µs
per cell here, of which zstd is 1.6. `ChunkReader` reads the same files itself, from the byte
ranges in the shards' chunk indexes (`chunk_index`): the chunks a read needs are read with one
``pread`` per run of touching chunks, and a nogil numba kernel checks and decodes them as
ArrayRecord's reader does (block headers skipped, riegeli's header and data hashes, the chunk's
kind, record count and compression: `riegeli_chunks`, which holds the kernels) and writes the
records asked for straight into one buffer, with their offsets: ``(buf, starts)``, what the
decoders take (a chunk needed whole is decompressed in place, with no copy at all).
Whatever fails (a short read, a hash, a size) is reported as the chunk's records being
unreadable, which the caller names by shard and cell (`runs`). Used for every local dataset,
and for a remote one's sparse mirrors, whose shards are zstd-compressed (or uncompressed) and have
chunk indexes; others are read by ArrayRecord's reader.

This module plans and issues the reads: which chunks a read needs and their byte ranges (`_Plan`),
read a group of about 4 MiB at a time (`_pread`, or with ``O_DIRECT`` through `direct_io`), each
group handed to the kernels.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from omicsio_jax.records import zstd
from omicsio_jax.records.riegeli_chunks import CHUNK_PROBLEMS, check_headers, decode_chunks
from omicsio_jax.records.shard_files import ReadFailed
from omicsio_jax.storage import direct_io

if TYPE_CHECKING:
    from omicsio_jax.records.shard_files import ShardFiles

_GROUP_BYTES = (
    4 << 20
)  # file bytes read and decoded per kernel call (each thread keeps a buffer of this size)
_DIRECT_GROUP_BYTES = 4 << 20  # the same, read with O_DIRECT: `direct_io.AHEAD` more of them in flight


def supported(dataset: ShardFiles) -> bool:
    """Whether `ChunkReader` can read ``dataset``'s shards: zstd-compressed (with a zstd library
    at hand) or uncompressed, with a chunk index for every shard."""
    compression = str(dataset.manifest.array_record.get("compression", ""))
    if not (compression == "uncompressed" or (compression.startswith("zstd") and zstd.available())):
        return False
    listed = {f.path for f in dataset.manifest.files}
    return all(dataset.chunk_index_path(shard) in listed for shard in range(len(dataset.manifest.shards)))


class ChunkReader:
    """Reads records of ``dataset``'s shards from their chunks (see the module docstring); safe to
    call from several threads at once (each uses its own zstd context; no descriptor is kept)."""

    def __init__(self, dataset: ShardFiles, *, direct: bool = False):
        self.dataset = dataset
        self.group_size = int(dataset.manifest.array_record["group_size"])
        self._num_cells = np.array([s.num_cells for s in dataset.manifest.shards], np.int64)
        self._local = threading.local()
        # with `direct`, file bytes are read with O_DIRECT, many groups in flight (`direct_io`)
        self._direct = direct_io.DirectReads() if direct else None

    @property
    def direct(self) -> bool:
        """Whether the shards are read with ``O_DIRECT``, bypassing the page cache."""
        return self._direct is not None

    def _read_buffer(self, size: int) -> np.ndarray:
        """This thread's buffer for file bytes, at least ``size`` long: reused, as fresh pages cost a
        fault each."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            buf = self._local.buf = np.empty(max(size, _GROUP_BYTES + (1 << 20)), np.uint8)
        return buf[:size]

    def read(
        self, pieces: Sequence[tuple[int, int, int]], *, allocate: Callable[[int], np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(buf, starts)`` of the records ``(shard, begin, end)`` of ``pieces``, in order (``buf``
        uint8, 4-aligned; ``starts`` int64, one more than the records). ``allocate(size)`` gives
        ``buf``'s memory (default: a new array). Raises `ReadFailed` naming the shard and records
        of the first chunk that cannot be read."""
        allocate = allocate or _new_bytes
        if not pieces:
            return np.zeros(0, np.uint8), np.zeros(1, np.int64)
        plan = _Plan.of(self, pieces)
        starts = np.empty(plan.num_records + 1, np.int64)
        out, used, record = np.empty(0, np.uint8), 0, 0
        fn = np.uint64(zstd.decompress_address() if zstd.available() else 0)
        dctx = np.uint64(zstd.thread_context() if zstd.available() else 0)
        for group, (raw, base, ends) in self._file_bytes(plan):
            # contiguous: a group given as a slice makes a strided column, a second compile of the kernel
            begins = np.ascontiguousarray(plan.ranges[group, 0])
            expected, chunk = plan.expected[group], plan.chunk[group]
            decoded, data, problem, k = check_headers(raw, base, begins, ends, expected)
            if problem:
                raise self._failed(int(plan.shard[group[k]]), chunk[k], problem)
            need = used + int(decoded.sum())
            if need > len(out):  # sized once from the first group's ratio; grown (doubling) if it was short
                size = max(need, 2 * len(out), plan.capacity(need - used, group))
                grown = allocate(size)
                grown[:used] = out[:used]
                out = grown
            used, problem, k = decode_chunks(
                raw,
                base,
                begins,
                ends,
                expected,
                decoded,
                data,
                plan.first[group],
                plan.stop[group],
                out,
                used,
                starts[record:],
                fn,
                dctx,
            )
            if problem:
                raise self._failed(int(plan.shard[group[k]]), chunk[k], problem)
            if self._direct is not None:
                self._direct.release(raw)
            record += int((plan.stop[group] - plan.first[group]).sum())
        starts[plan.num_records] = used
        return out[:used], starts

    def _file_bytes(self, plan: _Plan):
        """``(chunks, (bytes, offset of each chunk in them, each chunk's end))`` for each group of
        ``plan``'s chunks, in order (see `_pread`): read one group (of one shard) at a time into this
        thread's buffer, or with ``O_DIRECT``, many groups in flight, a group spanning shards
        (`direct_io.DirectReads`: a fetch of 4,096 cells over 192 shards is then 3 groups, not 150)."""
        if self._direct is None:
            for group in plan.groups(_GROUP_BYTES):
                fd = self._open(int(plan.shard[group[0]]))
                try:
                    yield group, _pread(fd, plan.ranges[group], self._read_buffer)
                finally:
                    os.close(fd)
            return
        shards, files = np.unique(plan.shard, return_inverse=True)
        paths = [self._checked_path(shard) for shard in shards.tolist()]
        groups = list(plan.groups(_DIRECT_GROUP_BYTES, by_shard=False))
        reads = self._direct.read_groups(paths, [(files[group], plan.ranges[group]) for group in groups])
        try:
            for group in groups:
                try:
                    got = next(reads)
                except direct_io.ReadError as e:
                    shard = int(shards[[str(p) for p in paths].index(e.filename)])
                    first = group[np.argmax(plan.shard[group] == shard)]
                    raise self._failed(shard, plan.chunk[first], 0, f"{e.filename}: {e.strerror}") from e
                yield group, got
        finally:
            reads.close()

    def _open(self, shard: int) -> int:
        """A descriptor of the shard's file, which must have the manifest's size (a truncated or replaced
        file is reported as not openable, as ArrayRecord's reader does)."""
        path = self.dataset.local_path(self.dataset.manifest.shards[shard].path)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise ReadFailed(shard, 0, 0, f"{path}: {e.strerror}") from e
        try:
            self._check_size(shard, path, os.fstat(fd).st_size)
        except ReadFailed:
            os.close(fd)
            raise
        return fd

    def _checked_path(self, shard: int):
        """The shard's file, checked as `_open` checks it."""
        path = self.dataset.local_path(self.dataset.manifest.shards[shard].path)
        try:
            size = os.stat(path).st_size
        except OSError as e:
            raise ReadFailed(shard, 0, 0, f"{path}: {e.strerror}") from e
        self._check_size(shard, path, size)
        return path

    def _check_size(self, shard: int, path, size: int) -> None:
        expected = self.dataset.manifest.shards[shard].num_bytes
        if size != expected:
            raise ReadFailed(shard, 0, 0, f"{path} has {size:,} bytes, the manifest lists {expected:,}")

    def _failed(self, shard: int, chunk: int, problem: int, reason: str = "") -> ReadFailed:
        begin = int(chunk) * self.group_size
        return ReadFailed(
            shard,
            begin,
            min(begin + self.group_size, int(self._num_cells[shard])),
            reason or CHUNK_PROBLEMS[problem],
        )


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The chunks a read decodes, in order: shard, chunk, records ``[first, stop)`` of it wanted,
    records it holds (``expected``), file byte range."""

    shard: np.ndarray
    chunk: np.ndarray
    first: np.ndarray
    stop: np.ndarray
    expected: np.ndarray
    ranges: np.ndarray

    @staticmethod
    def of(reader: ChunkReader, pieces: Sequence[tuple[int, int, int]]) -> _Plan:
        g = reader.group_size
        shard, begin, end = np.asarray(pieces, np.int64).reshape(-1, 3).T
        lo, count = begin // g, (end - 1) // g + 1 - begin // g
        piece = np.repeat(np.arange(len(shard)), count)
        chunk = lo[piece] + np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
        shards = shard[piece]
        ranges = np.empty((len(chunk), 2), np.int64)
        for s in np.unique(shards).tolist():
            mine = shards == s
            ranges[mine] = reader.dataset.chunk_index(s).chunk_bytes(chunk[mine])
        return _Plan(
            shards,
            chunk,
            np.maximum(begin[piece] - chunk * g, 0),
            np.minimum(end[piece] - chunk * g, g),
            np.minimum(reader._num_cells[shards] - chunk * g, g),
            ranges,
        )

    @property
    def num_records(self) -> int:
        return int((self.stop - self.first).sum())

    def groups(self, group_bytes: int, *, by_shard: bool = True):
        """Indices of runs of chunks, about ``group_bytes`` of file each (and of one shard, ``by_shard``)."""
        sizes = self.ranges[:, 1] - self.ranges[:, 0]
        cut = np.diff(np.cumsum(sizes) // group_bytes) != 0
        if by_shard:
            cut |= self.shard[1:] != self.shard[:-1]
        yield from np.split(np.arange(len(self.chunk)), np.flatnonzero(cut) + 1)

    def capacity(self, decoded: int, group: np.ndarray) -> int:
        """Bytes for the records of this group and every later one, at this group's decoded bytes per file byte."""
        sizes = self.ranges[:, 1] - self.ranges[:, 0]
        here, later = int(sizes[group].sum()), int(sizes[group[-1] + 1 :].sum())
        return decoded + int(later * decoded / max(here, 1) * 1.05) + (1 << 16)


def _new_bytes(size: int) -> np.ndarray:
    return np.empty(size, np.uint8)


def _pread(fd: int, ranges: np.ndarray, buffer=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The file bytes of ``ranges`` (sorted ``(k, 2)``), touching ones read with one ``pread``, into
    ``buffer(size)`` (default: a new array): ``(bytes, offset of each range in them, the ranges'
    ends)``, an end moved back to where the file ended if a read came back short (its chunk is then
    reported truncated)."""
    sizes = ranges[:, 1] - ranges[:, 0]
    base = np.zeros(len(ranges), np.int64)
    np.cumsum(sizes[:-1], out=base[1:])
    raw = (buffer or _new_bytes)(int(sizes.sum()))
    ends = ranges[:, 1].copy()
    breaks = np.flatnonzero(ranges[1:, 0] != ranges[:-1, 1]) + 1
    for lo, hi in zip(
        np.concatenate(([0], breaks)).tolist(), np.concatenate((breaks, [len(ranges)])).tolist(), strict=True
    ):
        start, stop = int(base[lo]), int(base[hi - 1] + sizes[hi - 1])
        got = os.preadv(fd, [memoryview(raw[start:stop])], int(ranges[lo, 0]))
        if got < stop - start:
            np.minimum(ends[lo:hi], int(ranges[lo, 0]) + got, out=ends[lo:hi])
    return raw, base, ends

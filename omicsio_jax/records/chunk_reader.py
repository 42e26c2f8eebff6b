"""Records straight from a shard's chunks: ``pread``, riegeli's hash checks, zstd, in one numba pass.

ArrayRecord's Python reader returns a ``bytes`` object per record: it decompresses each chunk,
copies every record into a C++ string, then into a Python object under the GIL, and the loader
copied them once more into one buffer to decode. Reading a 16-cell block that way cost 2.4 µs
per cell here, of which zstd is 1.6. `ChunkReader` reads the same files itself, from the byte
ranges in the shards' chunk indexes (`chunk_index`): the chunks a read needs are read with one
``pread`` per run of touching chunks, and a nogil numba kernel checks and decodes them as
ArrayRecord's reader does —

- a chunk's logical bytes skip the 24-byte block header at every 64 KiB of the file;
- its 40-byte header must hash (HighwayHash, `highwayhash`) to its ``header_hash``, its data to
  ``data_hash``; it must be a simple chunk (``'r'``) of the expected number of records;
- its data is a compression byte (zstd or none), the compressed record sizes (varints) and the
  compressed concatenated records; each compressed block is prefixed by its decompressed size —

and writes the records asked for straight into one buffer, with their offsets: ``(buf, starts)``,
what the decoders take (a chunk needed whole is decompressed in place, with no copy at all).
Whatever fails (a short read, a hash, a size) is reported as the chunk's records being
unreadable, which the caller names by shard and cell (`runs`). Used for every local dataset,
and for a remote one's sparse mirrors, whose shards are zstd-compressed (or uncompressed) and have
chunk indexes; others are read by ArrayRecord's reader.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from omicsio_jax.records import zstd
from omicsio_jax.records.highwayhash import RIEGELI_KEY, highway64, load_u64
from omicsio_jax.records.shard_files import ReadFailed
from omicsio_jax.storage import direct_io

if TYPE_CHECKING:
    from omicsio_jax.records.shard_files import ShardFiles

_BLOCK, _BLOCK_HEADER, _CHUNK_HEADER = 1 << 16, 24, 40
_SIMPLE_CHUNK = 0x72  # 'r'
_NO_COMPRESSION, _ZSTD = 0, 0x7A  # 'z'
_GROUP_BYTES = (
    4 << 20
)  # file bytes read and decoded per kernel call (each thread keeps a buffer of this size)
_DIRECT_GROUP_BYTES = 4 << 20  # the same, read with O_DIRECT: `direct_io.AHEAD` more of them in flight

CHUNK_OK = 0
_PROBLEMS = (
    "",
    "the file ends inside the chunk (truncated)",
    "chunk header hash mismatch",
    "chunk data hash mismatch",
    "not a chunk of records",
    "unexpected number of records in the chunk",
    "unsupported chunk compression",
    "chunk data cannot be decompressed",
    "record sizes do not match the chunk header",
)
_TRUNCATED, _HEADER_HASH, _DATA_HASH, _NOT_RECORDS, _RECORD_COUNT, _COMPRESSION, _DECOMPRESS, _SIZES = range(
    1, 9
)


def supported(dataset: ShardFiles) -> bool:
    """Whether `ChunkReader` can read ``dataset``'s shards: zstd-compressed (with a zstd library
    at hand) or uncompressed, with a chunk index for every shard."""
    compression = str(dataset.manifest.array_record.get("compression", ""))
    if not (compression == "uncompressed" or (compression.startswith("zstd") and zstd.available())):
        return False
    listed = {f.path for f in dataset.manifest.files}
    return all(dataset.chunk_index_path(shard) in listed for shard in range(len(dataset.manifest.shards)))


@intrinsic
def _memcpy(typingctx, dst, src, size):
    def codegen(context, builder, signature, args):
        byte_ptr = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(
            builder, builder.inttoptr(args[0], byte_ptr), builder.inttoptr(args[1], byte_ptr), args[2], 1
        )
        return context.get_dummy_value()

    return types.void(types.uint64, types.uint64, types.int64), codegen


@nb.njit(inline="always")
def copy_bytes(dst, dst_start, src, src_start, size):
    """``dst[dst_start:dst_start + size] = src[src_start:src_start + size]`` (uint8 arrays, bounds
    checked by the caller) as one ``memcpy``: numba's slice assignment and byte loops ran 5-10×
    slower (a record of 4.5 KB: 1.1 µs against 0.2)."""
    _memcpy(dst.ctypes.data + np.uint64(dst_start), src.ctypes.data + np.uint64(src_start), np.int64(size))


@nb.njit(inline="always")
def _logical_copy(raw, base, begin, end, dst, n):
    """The first ``n`` logical bytes of the chunk at file offset ``begin`` (its bytes in ``raw`` from
    ``base``; the chunk ends at ``end``) into ``dst``, skipping block headers; False if they overrun."""
    pos, written = begin, 0
    while written < n:
        if pos % _BLOCK == 0:
            pos += _BLOCK_HEADER
        take = min(n - written, _BLOCK - pos % _BLOCK)
        if pos + take > end:
            return False
        copy_bytes(dst, written, raw, base + pos - begin, take)
        written += take
        pos += take
    return True


@nb.njit(inline="always")
def _varint(b, p, end):
    """``(value, position after it)`` of the LEB128 varint at ``b[p]``; position -1 if malformed."""
    value, shift = np.uint64(0), np.uint64(0)
    while p < end and shift < 64:
        byte = b[p]
        value |= np.uint64(byte & 0x7F) << shift
        p += 1
        if byte < 0x80:
            return value, p
        shift += np.uint64(7)
    return value, -1


@nb.njit(nogil=True, cache=True)
def _headers(raw, base, begin, end, expected):
    """Check each chunk's header; ``(decoded sizes, data sizes, problem, chunk)`` (problem 0: all good)."""
    n = base.shape[0]
    decoded = np.zeros(n, np.int64)
    data = np.zeros(n, np.int64)
    header = np.empty(_CHUNK_HEADER, np.uint8)
    for k in range(n):
        if not _logical_copy(raw, base[k], begin[k], end[k], header, _CHUNK_HEADER):
            return decoded, data, _TRUNCATED, k
        if highway64(header, np.int64(8), np.int64(32), RIEGELI_KEY) != load_u64(header, 0):
            return decoded, data, _HEADER_HASH, k
        kind_and_count = load_u64(header, 24)
        if kind_and_count & np.uint64(0xFF) != _SIMPLE_CHUNK:
            return decoded, data, _NOT_RECORDS, k
        if np.int64(kind_and_count >> np.uint64(8)) != expected[k]:
            return decoded, data, _RECORD_COUNT, k
        data[k] = np.int64(load_u64(header, 8))
        decoded[k] = np.int64(load_u64(header, 32))
        if data[k] < 1 or data[k] > end[k] - begin[k]:
            return decoded, data, _TRUNCATED, k
    return decoded, data, CHUNK_OK, -1


@nb.njit(inline="always")
def _block(chunk, p, end, compression, fn, dctx, dst, dst_start, size):
    """The compressed block ``chunk[p:end]`` (its decompressed size first) into ``dst`` at
    ``dst_start``, which must come out as ``size`` bytes; False if it does not."""
    if compression == _NO_COMPRESSION:
        if end - p != size:
            return False
        copy_bytes(dst, dst_start, chunk, p, size)
        return True
    stated, p = _varint(chunk, p, end)
    if p < 0 or np.int64(stated) != size:
        return False
    return zstd.decompress(fn, dctx, dst, dst_start, size, chunk, p, end - p) == size


@nb.njit(nogil=True, cache=True)
def _decode(raw, base, begin, end, expected, decoded, data, first, stop, out, out_pos, starts, fn, dctx):
    """Check and decode each chunk; write records ``[first[k], stop[k])`` of chunk ``k`` to ``out``
    from ``out_pos`` on and their offsets to ``starts``; ``(new out_pos, problem, chunk)``."""
    n = base.shape[0]
    scratch = np.empty(_CHUNK_HEADER + data.max(), np.uint8)
    values = np.empty(decoded.max(), np.uint8)
    sizes = np.empty(10 * expected.max() + 16, np.uint8)
    record = 0
    for k in range(n):
        length = _CHUNK_HEADER + data[k]
        if begin[k] % _BLOCK != 0 and begin[k] // _BLOCK == (begin[k] + length - 1) // _BLOCK:
            if begin[k] + length > end[k]:  # no block header inside: read in place
                return out_pos, _TRUNCATED, k
            chunk = raw[base[k] : base[k] + length]
        else:
            if not _logical_copy(raw, base[k], begin[k], end[k], scratch, length):
                return out_pos, _TRUNCATED, k
            chunk = scratch[:length]
        if highway64(chunk, np.int64(_CHUNK_HEADER), data[k], RIEGELI_KEY) != load_u64(chunk, 16):
            return out_pos, _DATA_HASH, k
        compression = chunk[_CHUNK_HEADER]
        if compression != _NO_COMPRESSION and compression != _ZSTD:
            return out_pos, _COMPRESSION, k
        sizes_bytes, p = _varint(chunk, _CHUNK_HEADER + 1, length)
        if p < 0 or p + np.int64(sizes_bytes) > length:
            return out_pos, _SIZES, k
        values_at = p + np.int64(sizes_bytes)
        # the record sizes: `expected[k]` varints
        if compression == _NO_COMPRESSION:
            size_stream, size_len = chunk[p:values_at], np.int64(sizes_bytes)
        else:
            stated, q = _varint(chunk, p, values_at)
            if q < 0 or np.int64(stated) > sizes.shape[0]:
                return out_pos, _SIZES, k
            size_len = np.int64(stated)
            if zstd.decompress(fn, dctx, sizes, 0, size_len, chunk, q, values_at - q) != size_len:
                return out_pos, _DECOMPRESS, k
            size_stream = sizes
        lo, hi = first[k], stop[k]
        skip, wanted, q, total = 0, 0, 0, 0
        for r in range(expected[k]):
            size, q = _varint(size_stream, q, size_len)
            if q < 0:
                return out_pos, _SIZES, k
            if r < lo:
                skip += np.int64(size)
            elif r < hi:
                starts[record + r - lo] = out_pos + wanted
                wanted += np.int64(size)
            total += np.int64(size)
        if total != decoded[k] or q != size_len:
            return out_pos, _SIZES, k
        if lo == 0:  # the records asked for begin the chunk: decompress in place (a tail is overwritten next)
            if not _block(chunk, values_at, length, compression, fn, dctx, out, out_pos, total):
                return out_pos, _DECOMPRESS, k
        else:
            if not _block(chunk, values_at, length, compression, fn, dctx, values, 0, total):
                return out_pos, _DECOMPRESS, k
            copy_bytes(out, out_pos, values, skip, wanted)
        out_pos += wanted
        record += hi - lo
    return out_pos, CHUNK_OK, -1


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
            decoded, data, problem, k = _headers(raw, base, begins, ends, expected)
            if problem:
                raise self._failed(int(plan.shard[group[k]]), chunk[k], problem)
            need = used + int(decoded.sum())
            if need > len(out):  # sized once from the first group's ratio; grown (doubling) if it was short
                size = max(need, 2 * len(out), plan.capacity(need - used, group))
                grown = allocate(size)
                grown[:used] = out[:used]
                out = grown
            used, problem, k = _decode(
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
            reason or _PROBLEMS[problem],
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

"""A shard's sparse mirror on local disk: the file and its two sidecars, opened, emptied and locked.

A mirror is a file of the shard's size in the cache root holding the byte ranges fetched so far:
its opening ranges (head, footer and postscript chunks) when asked for, and the data chunks reads
needed. ``<mirror>.present`` (one byte per data chunk, memory-mapped) says which data chunks are
there; ``<mirror>.etag`` ties mirror and bitmap to the object's version (its ETag and size). What to
fetch, when and how much to keep is `omicsio_jax.dataset.mirrors.ShardMirrors`'s; this module holds
what one mirror is on disk.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from omicsio_jax.core.errors import DatasetFormatError
from omicsio_jax.dataset.cache import Counters, raise_if_rewritten, write_atomic
from omicsio_jax.format.chunk_index import ChunkIndex
from omicsio_jax.format.manifest import ShardEntry
from omicsio_jax.storage.store import S3Store


def flock(fd: int, operation: int) -> bool:
    """``flock(fd, operation)``; False if another process holds a conflicting lock (with
    ``LOCK_NB``). A file system without locks counts as granting them."""
    try:
        fcntl.flock(fd, operation)
    except BlockingIOError:
        return False
    except OSError:
        pass
    return True


def empty_keeping(fd: int, size: int, opening: list[tuple[int, bytes]]) -> None:
    """Drop a mirror's data in place (its inode kept, for the readers open on it): truncated to
    zero and back to ``size``, then its ``opening`` ranges ((offset, bytes)) written again."""
    os.ftruncate(fd, 0)
    os.ftruncate(fd, size)
    for b, blob in opening:
        os.pwrite(fd, blob, b)


def data_ranges(index: ChunkIndex) -> np.ndarray:
    """The byte range of every data chunk of a shard, ``(chunks, 2)``."""
    return index.chunk_bytes(np.arange(index.num_chunks))


def sidecar(path: Path, suffix: str) -> Path:
    """The mirror ``path``'s sidecar ``suffix`` (``".etag"`` or ``".present"``)."""
    return path.with_name(path.name + suffix)


def drop_files(path: Path) -> None:
    """Delete the mirror at ``path`` and its sidecars."""
    for p in (sidecar(path, ".etag"), sidecar(path, ".present"), path):
        p.unlink(missing_ok=True)


class Mirror:
    """A shard's mirror in this process: its fd, bitmaps and bookkeeping (guarded by
    `ShardMirrors`'s lock)."""

    def __init__(
        self,
        key: str,
        size: int,
        index: ChunkIndex,
        etag: str | None,
        fd: int,
        present: np.ndarray,
        opening: list[tuple[int, bytes]],
    ):
        self.key, self.size, self.index, self.etag = key, size, index, etag
        self.fd, self.present, self.opening = fd, present, opening
        self.sizes = np.diff(data_ranges(index), axis=1)[:, 0]
        self.inflight = np.zeros(index.num_chunks, bool)
        self.cached = int(self.sizes[present.astype(bool)].sum())
        self.pins = 0
        self.last_used = 0
        self.retired = False  # replaced by a mirror opened again (`ShardMirrors._retire_if_replaced`)


def get_opening(
    store: S3Store, counters: Counters, key: str, fd: int, opening: list[tuple[int, int]], etag: str | None
) -> list[bytes]:
    """GET the ``opening`` ranges of the object ``key`` (``If-Match: etag``) and write them into the
    mirror ``fd`` at their offsets; returns their bytes."""
    blobs = store.get_ranges(key, opening, etag)
    for (b, _), blob in zip(opening, blobs, strict=True):
        os.pwrite(fd, blob, b)
    counters.add(opening_gets=len(opening), opening_bytes=sum(len(x) for x in blobs))
    return blobs


def open_mirror(
    store: S3Store,
    counters: Counters,
    entry: ShardEntry,
    path: Path,
    chunk_index: Callable[[], ChunkIndex],
    *,
    opening: bool,
) -> Mirror:
    """HEAD the shard ``entry`` (its size must match the manifest), then take its chunk index
    (``chunk_index()``: loaded and checked once, `ChunkIndexes`), reuse or create its mirror at
    ``path`` (writing the opening ranges if ``opening``)."""
    url = store.describe(entry.path)
    info = store.head(entry.path)
    counters.add(head_requests=1)
    if info is None or info.size != entry.num_bytes:
        raise_if_rewritten(store, "shards", entry.path, num_bytes=entry.num_bytes, sha256=entry.sha256)
    if info is None:
        raise DatasetFormatError.run_verify(store.url, f"{url} is listed in the manifest but missing")
    if info.size != entry.num_bytes:
        raise DatasetFormatError.run_verify(
            store.url,
            f"{url}: {info.size:,} bytes, the manifest says {entry.num_bytes:,}: the shard was rewritten",
        )
    index = chunk_index()
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp_path, present_path = sidecar(path, ".etag"), sidecar(path, ".present")
    stamp = f"{info.etag} {info.size}\n"
    try:
        reuse = (
            stamp_path.read_text() == stamp
            and path.stat().st_size == info.size
            and present_path.stat().st_size == index.num_chunks
        )
    except OSError:
        reuse = False
    ranges = [(int(b), int(e)) for b, e in index.opening] if opening else []
    if reuse:
        fd = os.open(path, os.O_RDWR)
        blobs = [os.pread(fd, e - b, b) for b, e in ranges]
    else:  # new files renamed into place: a process still using the old ones keeps them whole
        stamp_path.unlink(missing_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
        np.zeros(index.num_chunks, np.uint8).tofile(tmp)
        os.replace(tmp, present_path)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, info.size)
            blobs = get_opening(store, counters, entry.path, fd, ranges, info.etag)
            os.replace(tmp, path)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        write_atomic(stamp_path, stamp)
    present = np.memmap(present_path, np.uint8, mode="r+") if index.num_chunks else np.zeros(0, np.uint8)
    kept = list(zip([b for b, _ in ranges], blobs, strict=True))
    return Mirror(entry.path, info.size, index, info.etag, fd, present, kept)

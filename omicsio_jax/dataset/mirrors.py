"""Shards on object storage, read through sparse local mirrors.

ArrayRecord's reader reads local files only. Each shard a read uses gets a mirror in the cache
root: a file of the shard's size holding its opening ranges (head, footer and postscript chunks,
what ArrayRecord's reader reads when it opens a file; not fetched for a dataset read by
`chunk_reader`, which never reads them, until a read that needs them fails and fetches them again)
and the data chunks reads have needed, fetched with
range GETs (``If-Match``: the ETag seen when this process first used the shard) and written at
their offsets. The stock reader then reads the mirror as if it were whole: a read that reaches a
chunk never fetched fails on the chunk's header hash, it cannot return wrong records. One mirror
on disk (its file, its sidecars, its locks) is `omicsio_jax.dataset.mirror_files`'s.

``<mirror>.present`` (one byte per data chunk, memory-mapped) says which chunks are there; a byte
is set only after its chunk's bytes are written and cleared before they are dropped, so a later
process reuses the cache. ``<mirror>.etag`` ties mirror and bitmap to the object's version: a shard
whose ETag or size changed since is fetched afresh.

`ShardMirrors.prepared` fetches the missing chunks of one call (every run of a fetch) together:
adjacent chunks and small gaps merge into one GET as long as the bytes fetched stay within 1.1 ×
the bytes needed (the gaps' chunks are kept too), the GETs run concurrently on a thread pool, and
concurrent calls never fetch the same chunk twice (one waits for the other's bytes). One lock
guards the bookkeeping only; no network or file I/O but an eviction's runs under it.

Data chunk bytes are kept within ``cache_bytes`` by dropping whole shards' data, least recently
used first (the mirror is truncated to zero and back and its opening ranges written again; the
readers open on it stay valid, as every read fetches its chunks again first). A shard being read
is pinned and dropped only after the read, so the budget can be exceeded while reads are in
flight, by the chunks they hold. Chunks left by an earlier process count against the budget from
the start and are dropped first. Processes sharing a cache directory (Grain's workers, several
jobs) each keep their own budget: a process holds a shared ``flock`` on a mirror while it reads it,
and another drops only mirrors it can lock exclusively at once (else it drops the next one), so no
process truncates the chunks another is reading. A read that still meets a chunk that is not there
(dropped between two reads, or damaged) fails its hash check and is fetched again (`runs.read_runs`
retries, `REMOTE_READ_ATTEMPTS` times in all); one whose mirror file another process deleted, or
renamed a fresh mirror over, opens the mirror at the path again for that retry.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from omicsio_jax.core.errors import DatasetFormatError
from omicsio_jax.dataset.cache import Counters, FileCache
from omicsio_jax.dataset.chunk_indexes import ChunkIndexes
from omicsio_jax.dataset.mirror_files import (
    Mirror,
    data_ranges,
    drop_files,
    empty_keeping,
    flock,
    get_opening,
    open_mirror,
    sidecar,
)
from omicsio_jax.format.chunk_index import (
    ChunkIndex,
    chunk_index_path,
    chunks_of,
    load_chunk_index,
    merge_spans,
)
from omicsio_jax.format.manifest import Manifest
from omicsio_jax.storage.store import S3Store

READ_SLACK = 0.1  # a GET may cover up to 10% more bytes than its needed chunks, to save GETs
MAX_GET_BYTES = 16 << 20  # longer ranges are split into concurrent GETs


def split_spans(spans: list[tuple[int, int]], max_bytes: int = MAX_GET_BYTES) -> list[tuple[int, int]]:
    """``spans`` cut into GETs of at most ``max_bytes`` (fetched concurrently)."""
    return [(b, min(b + max_bytes, end)) for begin, end in spans for b in range(begin, end, max_bytes)]


def covered_chunks(index: ChunkIndex, spans: list[tuple[int, int]]) -> np.ndarray:
    """Data chunks lying wholly inside ``spans`` (the needed ones and those of the gaps merged in)."""
    data = data_ranges(index)
    parts = [
        np.arange(np.searchsorted(data[:, 0], b, "left"), np.searchsorted(data[:, 1], e, "right"))
        for b, e in spans
    ]
    return np.concatenate([*parts, np.zeros(0, np.int64)])


class ShardMirrors:
    """The sparse mirrors of a remote dataset's shards under ``root``, within ``cache_bytes``."""

    def __init__(
        self,
        store: S3Store,
        manifest: Manifest,
        root: Path,
        files: FileCache,
        counters: Counters,
        *,
        cache_bytes: int,
        threads: int = 16,
        opening: bool = True,
    ):
        self.store, self.manifest, self.root, self.files, self.counters = (
            store,
            manifest,
            root,
            files,
            counters,
        )
        self.opening = opening  # fetch each shard's opening ranges (ArrayRecord's reader reads them; the chunk reader not)
        self.cache_bytes, self.group_size = cache_bytes, int(manifest.array_record["group_size"])
        # each shard's chunk index, loaded and checked once: the dataset's readers take it from here too
        self.chunk_indexes = ChunkIndexes(store.url, files.path)
        self._lock = threading.Condition()
        self._live: dict[int, Mirror] = {}
        self._opening: dict[int, Future] = {}
        self._tick = 0
        self._threads, self._pool = threads, None
        self._dormant: dict[int, tuple[float, int]] = {}  # left by an earlier process: (mtime, bytes)
        self._scan()
        self.cached = sum(b for _, b in self._dormant.values())  # data chunk bytes in the cache

    def path(self, shard: int) -> Path:
        return self.root / self.manifest.shards[shard].path

    # ----- the interface -------------------------------------------------------------------------
    @contextlib.contextmanager
    def prepared(
        self, pieces: Sequence[tuple[int, int, int]], *, refetch: int | None = None
    ) -> Iterator[None]:
        """Make the records of ``pieces`` ((shard, begin, end) within the shard) readable from the
        mirrors, and keep them (pinned) until the block ends; ``refetch``: fetch that shard's chunks
        and opening ranges again even if present (after a read of the mirror failed)."""
        chunks = chunks_of(pieces, self.group_size)
        if refetch is not None:
            with self._lock:
                self._retire_if_replaced(refetch)
        mirrors = self._pin(sorted(chunks))
        try:
            self._fetch(mirrors, chunks, refetch)
            yield
        finally:
            with self._lock:
                for m in mirrors.values():
                    m.pins -= 1
                    if not m.pins:
                        flock(m.fd, fcntl.LOCK_UN)
                        if m.retired:
                            os.close(m.fd)
                self._make_room(0)

    def close(self) -> None:
        """Close the mirrors' files and threads (a later read opens them again)."""
        with self._lock:
            pool, self._pool = self._pool, None
            for s, m in self._live.items():
                if m.cached:
                    self._dormant[s] = (time.time(), m.cached)
                os.close(m.fd)
            self._live.clear()
        if pool is not None:
            pool.shutdown(wait=True)

    def _retire_if_replaced(self, shard: int) -> None:
        """Forget this process's mirror of ``shard`` if its file is no longer the one at its path
        (another process sharing the cache dropped it, or renamed a fresh mirror over it): readers
        open the path, so the next pin opens the mirror again. Lock held."""
        m = self._live.get(shard)
        if m is None:
            return
        try:
            if os.path.samestat(os.fstat(m.fd), os.stat(self.path(shard))):
                return
        except OSError:
            pass
        del self._live[shard]
        self.cached -= m.cached
        m.retired = True
        if not m.pins:  # else the last call pinning it closes it
            os.close(m.fd)

    def _submit(self, fn, *args) -> Future:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="omicsio-mirror")
            return self._pool.submit(fn, *args)

    # ----- opening a shard's mirror ------------------------------------------------------------
    def _scan(self) -> None:
        """Account for the chunks an earlier process left in the cache (`dormant` until used)."""
        for shard, entry in enumerate(self.manifest.shards):
            present = sidecar(self.path(shard), ".present")
            if not present.exists():
                continue
            index_path = chunk_index_path(entry.path)
            local = self.files.cached(index_path) if index_path in self.files else None
            if local is None:
                self._drop_files(shard)
                continue
            sizes = np.diff(data_ranges(ChunkIndex(load_chunk_index(local), self.group_size)), axis=1)[:, 0]
            bits = np.fromfile(present, np.uint8)
            if len(bits) != len(sizes):
                self._drop_files(shard)
                continue
            self._dormant[shard] = (present.stat().st_mtime, int(sizes[bits.astype(bool)].sum()))

    def _drop_files(self, shard: int) -> None:
        drop_files(self.path(shard))

    def _pin(self, shards: list[int]) -> dict[int, Mirror]:
        with self._lock:
            futures = {}
            for s in shards:
                if s not in self._live:
                    if s not in self._opening:
                        dormant = self._dormant.pop(s, (0.0, 0))
                        self._opening[s] = self._submit(self._open, s, dormant)
                    futures[s] = self._opening[s]
        for f in futures.values():
            f.result()
        with self._lock:
            self._tick += 1
            mirrors = {s: self._live[s] for s in shards}
            for m in mirrors.values():
                m.pins += 1
                if m.pins == 1:  # no other process drops its chunks while this one reads them
                    flock(m.fd, fcntl.LOCK_SH)
                m.last_used = self._tick
            return mirrors

    def _open(self, shard: int, dormant: tuple[float, int]) -> None:
        """Open ``shard``'s mirror (`open_mirror`) on a pool thread; ``dormant``: what an earlier
        process left of it, counted back if the opening fails."""
        try:
            entry, path = self.manifest.shards[shard], self.path(shard)
            index = functools.partial(self.chunk_indexes.get, self.manifest, shard)
            m = open_mirror(self.store, self.counters, entry, path, index, opening=self.opening)
        except BaseException:
            with self._lock:
                del self._opening[shard]
                if dormant[1]:
                    self._dormant[shard] = dormant
            raise
        with self._lock:
            self._live[shard] = m
            del self._opening[shard]
            self.cached += m.cached - dormant[1]

    # ----- fetching chunks -----------------------------------------------------------------------
    def _fetch(self, mirrors: dict[int, Mirror], chunks: dict[int, np.ndarray], refetch: int | None) -> None:
        first = True
        while True:
            mine: dict[int, np.ndarray] = {}
            hits = 0
            with self._lock:
                for s, ids in chunks.items():
                    m = mirrors[s]
                    missing = ids if (first and s == refetch) else ids[m.present[ids] == 0]
                    take = missing[~m.inflight[missing]]
                    hits += len(ids) - len(missing)
                    if len(take):
                        m.inflight[take] = True
                        mine[s] = take
                self._make_room(sum(int(mirrors[s].sizes[t].sum()) for s, t in mine.items()))
            if first:
                self.counters.add(chunk_hits=hits)
            written: dict[int, np.ndarray] = {}
            try:
                if mine or (first and refetch is not None):
                    written = self._get_chunks(mirrors, mine, refetch if first else None)
            except BaseException:
                with self._lock:
                    for s, take in mine.items():
                        mirrors[s].inflight[take] = False
                    self._lock.notify_all()
                raise
            with self._lock:
                for s, ids in written.items():
                    m = mirrors[s]
                    fresh = ids[m.present[ids] == 0]
                    m.present[ids] = 1  # only now: the bytes are written
                    added = int(m.sizes[fresh].sum())
                    m.cached += added
                    self.cached += added
                for s, take in mine.items():
                    mirrors[s].inflight[take] = False
                self._lock.notify_all()
                self._lock.wait_for(
                    lambda: not any(mirrors[s].inflight[ids].any() for s, ids in chunks.items())
                )
                if all(mirrors[s].present[ids].all() for s, ids in chunks.items()):
                    return
            first = False  # another call failed to fetch some of ours: fetch them ourselves

    def _get_chunks(
        self, mirrors: dict[int, Mirror], mine: dict[int, np.ndarray], refetch: int | None
    ) -> dict[int, np.ndarray]:
        """GET the chunks ``mine`` (coalesced, concurrently) into the mirrors, and ``refetch``'s
        opening ranges; return the chunks now written per shard (``mine`` and merged gaps')."""
        needed = {s: mirrors[s].index.chunk_bytes(take) for s, take in mine.items()}  # in file order
        spans = merge_spans(needed, slack=READ_SLACK) if needed else {}
        futures = [self._submit(self._get_into, mirrors[s], split_spans(sp)) for s, sp in spans.items()]
        if refetch is not None:  # the opening ranges too: the mirror's may be damaged (or never fetched)
            m = mirrors[refetch]
            opening = [(int(b), int(e)) for b, e in m.index.opening]
            futures.append(self._submit(get_opening, self.store, self.counters, m.key, m.fd, opening, m.etag))
        for f in futures:
            f.result()
        if refetch is not None:
            m.opening = list(zip([b for b, _ in opening], futures[-1].result(), strict=True))
        self.counters.add(
            bytes_needed=sum(int((r[:, 1] - r[:, 0]).sum()) for r in needed.values()),
            chunk_misses=sum(len(t) for t in mine.values()),
        )
        return {s: covered_chunks(mirrors[s].index, sp) for s, sp in spans.items()}

    def _get_into(self, m: Mirror, ranges: list[tuple[int, int]]) -> None:
        blobs = self.store.get_ranges(m.key, ranges, m.etag)
        for (b, e), blob in zip(ranges, blobs, strict=True):
            if len(blob) != e - b:
                msg = f"{self.store.describe(m.key)}: asked for bytes {b}..{e - 1}, got {len(blob)} bytes"
                raise DatasetFormatError(msg)
            os.pwrite(m.fd, blob, b)
        self.counters.add(num_gets=len(ranges), bytes_fetched=sum(len(x) for x in blobs))

    # ----- staying within the budget -------------------------------------------------------------
    def _make_room(self, incoming: int) -> None:
        """Drop least recently used, unpinned shards' data until ``incoming`` more bytes fit (lock held)."""
        excess = self.cached + incoming - self.cache_bytes
        if excess <= 0:
            return
        candidates = [((0, mtime), s) for s, (mtime, b) in self._dormant.items() if b]
        candidates += [((1, m.last_used), s) for s, m in self._live.items() if m.cached and not m.pins]
        for _, s in sorted(candidates):
            if excess <= 0:
                break
            excess -= self._evict_dormant(s) if s in self._dormant else self._evict(self._live[s])

    def _evict(self, m: Mirror) -> int:
        if not flock(m.fd, fcntl.LOCK_EX | fcntl.LOCK_NB):
            return 0  # another process sharing the cache is reading this shard: drop another
        m.present[:] = 0  # first: a chunk is never marked present without its bytes
        empty_keeping(m.fd, m.size, m.opening)
        flock(m.fd, fcntl.LOCK_UN)
        freed, m.cached = m.cached, 0
        self.cached -= freed
        self.counters.add(evictions=1)
        return freed

    def _evict_dormant(self, shard: int) -> int:
        """Drop the chunks an earlier (or another) process left of ``shard``, in place as `_evict`
        does: another process may have the mirror open, and a file renamed or deleted under it
        would cost it a retry."""
        path = self.path(shard)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            fd = None
        try:
            if fd is not None and not flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB):
                return 0  # in use by another process: stays dormant here
            _, freed = self._dormant.pop(shard)
            local = self.files.cached(chunk_index_path(self.manifest.shards[shard].path))
            if fd is None or local is None:
                self._drop_files(shard)
            else:
                index = ChunkIndex(load_chunk_index(local), self.group_size)
                opening = [(int(b), int(e)) for b, e in index.opening]
                kept = [(b, os.pread(fd, e - b, b)) for b, e in opening]
                with open(sidecar(path, ".present"), "r+b") as f:
                    f.write(bytes(index.num_chunks))  # first: no chunk marked present without its bytes
                empty_keeping(fd, os.fstat(fd).st_size, kept)
        finally:
            if fd is not None:
                os.close(fd)
        self.cached -= freed
        self.counters.add(evictions=1)
        return freed

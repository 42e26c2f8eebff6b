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

import contextlib
import os
import queue
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from omicsio_jax.format.chunk_index import ChunkIndex, chunks_of, merge_spans

if TYPE_CHECKING:
    from omicsio_jax.records.shard_files import ShardFiles

_HAS_FADVISE = hasattr(os, "posix_fadvise")


class ReadAhead:
    """Announces the byte ranges of records about to be read from a local dataset's shards.

    A shard's chunk index is loaded on its first use and kept (16 bytes per chunk: one byte per
    cell at 16 cells per chunk, about what each ArrayRecord reader keeps of its footer); a shard
    is opened for each call and closed after it (the kernel keeps the pages, not the descriptor),
    so a dataset of thousands of shards holds no descriptors. `start` announces on a thread of its
    own, `advise` in the caller's. Counts what it announced (``advised_bytes``).

    The thread's queue is bounded (`QUEUE`: announcements it has not reached are dropped, as they
    are only hints); an exception it meets is raised by the next `start` (with its traceback), not
    lost; `close` is idempotent and may race `start`; a collected object stops its thread.
    """

    QUEUE = 8  # announcements waiting for the thread at most

    def __init__(self, dataset: ShardFiles):
        self.dataset = dataset
        self.group_size = int(dataset.manifest.array_record["group_size"])
        self._lock = threading.Lock()
        # [(thread, its queue)] while a thread runs, else [None]: shared with the finalizer
        self._worker: list[tuple[threading.Thread, queue.Queue] | None] = [None]
        self._error: BaseException | None = None
        self.advised_bytes = 0
        self.dropped = 0  # announcements dropped on a full queue
        weakref.finalize(self, ReadAhead._stop, self._worker)

    def index(self, shard: int) -> tuple[ChunkIndex, str]:
        """The shard's chunk index (`Dataset.chunk_index`) and its file's path."""
        return self.dataset.chunk_index(shard), str(
            self.dataset.local_path(self.dataset.manifest.shards[shard].path)
        )

    def start(self, pieces: Sequence[tuple[int, int, int]]) -> None:
        """`advise` on this object's own thread, so the read that follows starts at once: warm, it
        waits for nothing; cold, its first reads go one by one until the announcements, which are
        faster than the reads, overtake them. Raises what the thread met since the last call."""
        if not _HAS_FADVISE or not pieces:
            return
        with self._lock:
            error, self._error = self._error, None
            if error is not None:  # its thread has ended: the next call starts another
                self._worker[0] = None
                raise error
            if self._worker[0] is None:
                q: queue.Queue = queue.Queue(maxsize=self.QUEUE)
                thread = threading.Thread(
                    target=ReadAhead._work,
                    args=(weakref.ref(self), q),
                    daemon=True,
                    name="omicsio-jax-readahead",
                )
                self._worker[0] = thread, q
                thread.start()
            try:
                self._worker[0][1].put_nowait(list(pieces))
            except queue.Full:  # the thread is behind: this hint would arrive after its read anyway
                self.dropped += 1

    @staticmethod
    def _work(ref: weakref.ref, q: queue.Queue) -> None:
        while True:
            pieces = q.get()
            if pieces is None:
                return
            owner = ref()
            if owner is None:
                return
            try:
                owner.advise(pieces)
            except OSError:  # only a hint: the read itself reports a missing or unreadable shard
                pass
            except BaseException as e:  # handed to the reader: raised by its next `start`
                with owner._lock:
                    owner._error = e
                return
            finally:
                del owner

    @staticmethod
    def _stop(holder: list) -> None:
        """Stop the thread ``holder`` holds (if any) and empty ``holder``."""
        worker, holder[0] = holder[0], None
        if worker is not None:
            thread, q = worker
            while thread.is_alive():  # a full queue: make room for the stop
                try:
                    q.put(None, timeout=0.1)
                    break
                except queue.Full:
                    with contextlib.suppress(queue.Empty):
                        q.get_nowait()
            if thread is not threading.current_thread():
                thread.join(timeout=10)

    def close(self) -> None:
        """Stop the thread (a later `start` starts another); idempotent."""
        with self._lock:
            worker, self._worker[0] = self._worker[0], None
        ReadAhead._stop([worker])

    def advise(self, pieces: Sequence[tuple[int, int, int]]) -> None:
        """Start reading the chunks that hold the records ``(shard, begin, end)`` of ``pieces``."""
        if not _HAS_FADVISE or not pieces:
            return
        needed = {
            shard: self.index(shard)[0].chunk_bytes(chunks)
            for shard, chunks in chunks_of(pieces, self.group_size).items()
        }
        advised = 0
        for shard, spans in merge_spans(needed, slack=0.0).items():  # touching chunks: one range
            try:
                fd = os.open(self.index(shard)[1], os.O_RDONLY)
            except OSError:  # only a hint: the read itself reports a missing or unreadable shard
                continue
            try:
                for begin, end in spans:
                    os.posix_fadvise(fd, begin, end - begin, os.POSIX_FADV_WILLNEED)
                    advised += end - begin
            finally:
                os.close(fd)
        with self._lock:
            self.advised_bytes += advised

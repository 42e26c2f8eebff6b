"""Reading cells: one sorted batched read per segment, each segment read once, a few ahead.

`FetchReader` reads the records of any list of rows (in serving order): the distinct rows sorted,
one read per run of consecutive rows (for a dataset on object storage, the chunks of all runs are
fetched first, together: see `runs.read_runs`), kept as one buffer and checked once, on the thread
that read it (`Fetched`); each minibatch's records are picked from it in serving order where they
lie, neither copied nor checked again (`codec.Records`). `SegmentCache` makes sure each segment
(a fetch, see `schedule`) is read once per process however many threads ask for its
minibatches, and reads the next ones ahead on its own threads while the current one is decoded
(for a remote dataset, that read-ahead is the prefetch of the next fetches' chunks).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import numba as nb
import numpy as np

from omicsio_jax.core.buffers import RowBuffers
from omicsio_jax.dataset.dataset import Dataset
from omicsio_jax.format.codec import EMPTY_RECORD, Records
from omicsio_jax.records.riegeli_chunks import copy_bytes
from omicsio_jax.records.runs import ShardReaders, consecutive_runs, read_runs, records_checked

T = TypeVar("T")
_EMPTY = np.frombuffer(EMPTY_RECORD, np.uint8)


@nb.njit(nogil=True, cache=True)
def _gather(buf, begins, ends, positions, empty):
    """Records ``positions[i]`` of ``buf`` (-1: ``empty``) concatenated: ``(buf, starts)``."""
    n = positions.shape[0]
    out_starts = np.empty(n + 1, np.int64)
    out_starts[0] = 0
    for i in range(n):
        p = positions[i]
        size = empty.shape[0] if p < 0 else ends[p] - begins[p]
        out_starts[i + 1] = out_starts[i] + size
    out = np.empty(out_starts[n], np.uint8)
    for i in range(n):
        p = positions[i]
        if p < 0:
            copy_bytes(out, out_starts[i], empty, 0, empty.shape[0])
        else:
            copy_bytes(out, out_starts[i], buf, begins[p], ends[p] - begins[p])
    return out, out_starts


@dataclasses.dataclass(frozen=True)
class Fetched:
    """The records of a list of rows: those of its distinct rows, ascending, checked (``records``),
    and for each row of the list its record (``positions``, -1 for padding)."""

    records: Records
    positions: np.ndarray

    def take(self, lo: int, hi: int) -> Records:
        """The records of rows ``[lo, hi)`` of the list, in its order: where they lie in the fetch's
        buffer; a minibatch with padding rows (an epoch's last, a host's share of one) gets its
        records copied, with `EMPTY_RECORD` for each padding row."""
        positions = self.positions[lo:hi]
        if not len(positions) or positions.min() >= 0:
            return self.records.select(positions)
        r = self.records
        buf, starts = _gather(r.buf, r.begins, r.ends, positions, _EMPTY)
        return Records.check(buf, starts, r.num_columns)


class FetchReader:
    """Reads records of a dataset; safe to call from several threads at once.

    Records are read by the dataset's `ChunkReader` where it has one; otherwise each thread keeps
    its own ArrayRecord readers (a reader is not shared across threads). Each run of consecutive
    rows is one read.
    """

    def __init__(self, dataset: Dataset, *, reader_options: str | None = None, keep_buffers: int = 6):
        self.dataset = dataset
        self._readers = ShardReaders(dataset, reader_options or dataset.reader_options, per_thread=True)
        self._buffers = RowBuffers(keep=keep_buffers)  # fetches' memory, reused once a fetch is let go

    def release(self) -> None:
        """Let go of the fetches' memory kept for reuse (`RowBuffers.release`)."""
        self._buffers.release()

    def read_sorted(self, rows: np.ndarray, *, announce_first: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """``(buf, starts)`` of ascending ``rows``: one read per run of consecutive rows (a local
        dataset's byte ranges announced to the kernel first, or meanwhile: see `Dataset.prepared`)."""
        return read_runs(
            self.dataset,
            self._readers,
            consecutive_runs(rows),
            announce_first=announce_first,
            allocate=self._buffers.at_least,
        )

    def __call__(self, rows: np.ndarray, *, announce_first: bool = True) -> Fetched:
        """The records of ``rows`` (in any order; rows may repeat; -1 is padding), each distinct row
        read once and checked (a malformed one: `DatasetFormatError` naming its shard and cell)."""
        real = rows >= 0
        unique, inverse = np.unique(rows[real], return_inverse=True)
        buf, starts = self.read_sorted(unique, announce_first=announce_first)
        with records_checked(self.dataset, unique):
            records = Records.check(buf, starts, self.dataset.num_genes)
        positions = np.full(len(rows), -1, np.int64)
        positions[real] = inverse
        return Fetched(records, positions)


class OutputRecords:
    """Reads the records an output decodes: the dataset's own, or for an output per modality
    (`Modalities`) those of each modality it names, of the same rows, and no other."""

    def __init__(self, dataset: Dataset, modalities: tuple[str | None, ...]):
        self.single = modalities == (None,)
        self._readers = {name: FetchReader(dataset.modality(name)) for name in modalities}

    def __call__(self, rows: np.ndarray, *, announce_first: bool = True) -> Fetched | dict[str, Fetched]:
        """Records of ``rows`` (see `FetchReader`): a `Fetched`, or a dict of them by modality."""
        if self.single:
            return self._readers[None](rows, announce_first=announce_first)
        return {name: read(rows, announce_first=announce_first) for name, read in self._readers.items()}

    def release(self) -> None:
        """Let go of the memory kept for reuse by each modality's reader."""
        for reader in self._readers.values():
            reader.release()

    def join(self, records, lo: int, hi: int) -> Records | dict[str, Records]:
        """The `Records` of rows ``[lo, hi)`` (`Fetched.take`), or a dict of them by modality."""
        if self.single:
            return records.take(lo, hi)
        return {name: recs.take(lo, hi) for name, recs in records.items()}


_CLOSED = "the loader was closed while this batch was being read"


class CacheClosedError(RuntimeError):
    """A `SegmentCache` was closed while (or before) a key was asked of it."""


class _Entry:
    __slots__ = ("done", "error", "uses", "value")

    def __init__(self):
        self.done = threading.Event()
        self.value = None
        self.error: BaseException | None = None
        self.uses = 0


class SegmentCache(Generic[T]):
    """``get(key)`` returns ``load(key)``, computed once; the keys after it (``following``) are loaded
    meanwhile on ``threads`` background threads, as many as ``weight`` (default 1 per key) adds up
    to ``ahead``: a short segment (an epoch's tail) does not count as a whole one. The ``keep`` most
    recently asked keys stay, unless `used` says a key's value has served all its uses: it is then
    dropped at once (a reader that iterates in order holds only the segment it is on and those read
    ahead, not the ones it left).

    A key asked for now jumps the queue ahead of read-ahead work; the very first key is read before
    any read-ahead starts, so it does not share the cores with the next ones. Errors are raised by
    the `get` that asks for the key, not by the read-ahead. `close` stops the threads (also done
    when the cache is collected).
    """

    def __init__(
        self,
        load: Callable[[Hashable], T],
        following: Callable[[Hashable], Hashable | None],
        *,
        ahead: float = 2,
        threads: int = 2,
        keep: int = 4,
        weight: Callable[[Hashable], float] | None = None,
    ):
        self._load, self._following, self._ahead, self._keep = (
            load,
            following,
            ahead,
            max(keep, int(ahead) + 3),
        )
        self._weight = weight or (lambda key: 1.0)
        self._newest: Hashable | None = None
        self._early: dict[Hashable, int] = {}
        self._entries: collections.OrderedDict[Hashable, _Entry] = collections.OrderedDict()
        self._queue: collections.deque[Hashable] = collections.deque()
        self._cond = threading.Condition()
        self._stop = [False]
        self._threads = [
            threading.Thread(
                target=SegmentCache._work,
                args=(weakref.ref(self), self._cond, self._stop),
                daemon=True,
                name="omicsio-jax-read",
            )
            for _ in range(max(threads, 1))
        ]
        for t in self._threads:
            t.start()
        self._finalizer = weakref.finalize(
            self, SegmentCache._shutdown, self._cond, self._stop, self._threads, self._entries
        )

    def get(self, key: Hashable) -> T:
        with self._cond:
            if self._stop[0]:
                raise CacheClosedError(_CLOSED)
            cold = self._newest is None  # nothing asked yet: the first key waits for no read-ahead
            entry = self._entries.get(key)
            if entry is None:
                entry = self._add(key, urgent=True)
            if key != self._newest and not cold:  # the first ask for this key: move the read-ahead window on
                self._newest = key
                self._read_ahead(key)
        if cold:  # read the first key with the machine to itself, then start reading ahead
            entry.done.wait()
            with self._cond:
                self._newest = key
                self._read_ahead(key)
        entry.done.wait()
        error, value = entry.error, entry.value
        del entry  # (raised, the error's traceback holds this frame: not the entry that holds the error)
        if error is not None:
            raise error
        return value

    def used(self, key: Hashable, uses: int) -> None:
        """One use of ``key``'s value is over; after ``uses`` of them it is dropped (asked again, it is
        loaded again)."""
        with self._cond:
            entry = self._entries.get(key)
            if entry is None:  # used before it was asked for (a batch read on its own): counted when it is
                self._early[key] = self._early.get(key, 0) + 1
                return
            entry.uses += 1
            if entry.uses >= uses and entry.done.is_set():
                del self._entries[key]

    def _read_ahead(self, key: Hashable) -> None:
        if key in self._entries:  # (a first key may be used up and dropped before its first asker gets here)
            self._entries.move_to_end(key)
        nxt, covered = key, 0.0
        while covered < self._ahead:
            nxt = self._following(nxt)
            if nxt is None:
                break
            covered += self._weight(nxt)
            if nxt not in self._entries:
                self._add(nxt, urgent=False)
        self._evict()

    def _add(self, key: Hashable, *, urgent: bool) -> _Entry:
        entry = self._entries[key] = _Entry()
        entry.uses = self._early.pop(key, 0)
        if urgent:
            self._queue.appendleft(key)
        else:
            self._queue.append(key)
        self._cond.notify()
        return entry

    def _evict(self) -> None:
        while len(self._entries) > self._keep:
            oldest = next(iter(self._entries))
            if not self._entries[oldest].done.is_set():
                break
            del self._entries[oldest]

    @staticmethod
    def _work(ref: weakref.ref, cond: threading.Condition, stop: list[bool]) -> None:
        while True:
            with cond:
                while not stop[0]:
                    cache = ref()
                    if cache is None:
                        return
                    if cache._queue:
                        key = cache._queue.popleft()
                        entry = cache._entries.get(key)
                        load = cache._load
                        break
                    del cache
                    cond.wait(timeout=0.5)
                else:
                    return
            del cache
            if entry is None:  # evicted before it was read
                continue
            try:
                entry.value = load(key)
            except BaseException as e:  # handed to the `get` that wants it
                entry.error = e
            entry.done.set()
            del entry, load

    @staticmethod
    def _shutdown(
        cond: threading.Condition,
        stop: list[bool],
        threads: list[threading.Thread],
        entries: dict[Hashable, _Entry],
    ) -> None:
        with cond:
            stop[0] = True
            cond.notify_all()
            for (
                entry
            ) in entries.values():  # a `get` still waiting (a thread of a loader closed meanwhile) wakes
                if not entry.done.is_set():
                    entry.error = CacheClosedError(_CLOSED)
                    entry.done.set()
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout=30)
        with cond:
            entries.clear()  # the values read (a loader's fetched records) go now, not with the cache

    def close(self) -> None:
        """Stop the threads and let go of the values read. ``load`` and ``following`` are let go of
        too: they are usually bound methods of the cache's owner, which holds the cache, a cycle that
        would keep both (and what the owner holds, its batch buffers) until a garbage collection."""
        self._finalizer()
        self._load = self._following = self._weight = None

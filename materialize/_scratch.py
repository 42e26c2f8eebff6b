"""`Scratch`: what a worker keeps from one partition to the next (the statistics accumulator, the
shard writer's child process, the reading and statistics threads), so that writing many partitions
pays once for what each would otherwise set up anew. `write_partition` takes them and gives them
back; the runners (`_run`, `_pool`, `_dask`) make one per worker (a Dask worker's: per thread and
run) and close it when the run ends; a partition written without one has its own, closed when it ends.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from omicsio_jax import OmicsIOError
from omicsio_jax.format import StatsAccumulator

from ._shards import ShardWriterProcess, make_shard_writer


class Scratch:
    """What one process keeps from one partition to the next: the statistics accumulator, whose
    histogram table (genes × 1,120 bins of uint16: 140 MB at 62,710 genes) would otherwise be
    allocated and page-faulted in anew for every partition; the shard writer's child process
    with its shared-memory slots (a Python start and ~100 MB of fresh slots per partition); and
    the reading and statistics threads, whose allocator heaps (Arrow's mimalloc keeps one per
    thread) a new thread would fault in anew (`Background`). A partition that fails gives back
    neither the accumulator nor the writer. `close` stops the kept writer process and threads."""

    def __init__(self):
        self._stats: StatsAccumulator | None = None
        self._writer: ShardWriterProcess | None = None
        self._threads: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self._users = 0  # partitions writing with it now (`in_use`)
        self._closing = False  # `close` was called while one was

    def __enter__(self) -> Scratch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def in_use(self) -> Iterator[Scratch]:
        """Held while a partition writes with it: a `close` meanwhile (a Dask run's end closes every
        worker's scratches of the run, whatever its threads are doing) waits for the partition to
        end, so that its threads are never shut down under it."""
        with self._lock:
            self._users += 1
        try:
            yield self
        finally:
            with self._lock:
                self._users -= 1
                close = self._closing and not self._users
            if close:
                self._close_now()

    def close(self) -> None:
        """Stop the kept writer process and threads, now or, while a partition writes, when it ends.
        Work already queued on the threads still runs (nothing waiting on it is left hanging)."""
        with self._lock:
            if self._users:
                self._closing = True
                return
        self._close_now()

    def _close_now(self) -> None:
        self._drop_writer()
        threads, self._threads = self._threads, {}
        for executor in threads.values():
            executor.shutdown(wait=False)

    def thread(self, name: str) -> ThreadPoolExecutor:
        """The kept thread called ``name`` (an executor of one thread), started on first use."""
        executor = self._threads.get(name)
        if executor is None:
            executor = self._threads[name] = ThreadPoolExecutor(1, thread_name_prefix=name)
        return executor

    def _drop_writer(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.abort()  # it has nothing open: it was given back after `finish`

    def take_shard_writer(self, root: Path, **kw):
        """A shard writer opened on ``root`` (`make_shard_writer`'s arguments): the kept one, if any."""
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.open(root, **kw)
                return writer
            except OmicsIOError:  # the kept child has gone: start another
                writer.abort()
        return make_shard_writer(root, **kw)

    def give_back_shard_writer(self, writer) -> None:
        """``writer`` has finished its shards (`finish`): the next partition may open it again."""
        if isinstance(writer, ShardWriterProcess):  # the in-process writer keeps nothing
            self._drop_writer()
            self._writer = writer

    def take_stats(self, num_genes: int, shard_cells: int) -> StatsAccumulator:
        stats, self._stats = self._stats, None
        if stats is None or stats.hist.shape[0] != num_genes or stats.shard_cells != shard_cells:
            stats = StatsAccumulator(num_genes, shard_cells)
        return stats

    def give_back_stats(self, stats: StatsAccumulator) -> None:
        """``stats`` is empty again (`StatsAccumulator.finish` returned): the next partition may use it."""
        self._stats = stats

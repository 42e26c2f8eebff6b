"""Running partitions on a pool of local worker processes (running them in this process, and what
every runner shares, is `_run`'s).

Every runner calls the same `write_partition` and reports cells to one progress callback. The
local pool starts its workers as plain child processes (``python -c ...``, each in its own
session so Ctrl-C reaches only this process, each given the job once), not through
``multiprocessing``, so a script that calls `materialize` needs no ``if __name__ == "__main__"``
guard. A worker that dies (killed, out of memory) costs the partition it was writing: it is
written again by a fresh worker, up to ``retries`` times. A `DataValidationError` or
`OmicsIOError` in a worker is raised here with its message and stops the run.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait

import numba as nb

from omicsio_jax import OmicsIOError
from omicsio_jax.format import usable_cores

from ._partition import Job, write_partition
from ._plan import Partition
from ._run import Done, Progress, RunReport, error_reply, raise_worker_error, worker_error
from ._scratch import Scratch
from ._shards import ShardWriterDied

# The fewest cells a worker of the default pool is given. Starting one (an interpreter importing
# pyarrow, numba and the package, and its compression child) costs seconds, and one process already
# overlaps its reading, encoding and statistics on threads. On 2 cores, with cells of ~1,500 genes
# in partitions of 8,192, a 2-worker pool took ~1.3x one process's time at 65,536 cells and the
# same at 131,072; a larger pool gains more per worker, and a pool also confines a worker's death
# (out of memory) to its partition, so 2 workers from 65,536 cells on
MIN_CELLS_PER_WORKER = 1 << 15


def default_workers(num_cells: int) -> int:
    """The workers ``materialize`` runs ``num_cells`` cells on by default: the usable cores, at most
    one per `MIN_CELLS_PER_WORKER` cells (1: a smaller input is written in this process)."""
    return max(1, min(usable_cores(), num_cells // MIN_CELLS_PER_WORKER))


# -- the local process pool -------------------------------------------------------------------------


_WORKER_TMP = "omicsio-worker-"  # a worker's own temporary folder (its TMPDIR)
# where omicsio_jax's kernel locators make their private cache folder, given to a worker as this
# process's temporary directory: in the worker's own, its kernels would compile again every run
_KERNEL_TMPDIR = "OMICSIO_JAX_KERNEL_TMPDIR"


def serve(fd: int, parent: int) -> None:
    """A pool worker of process ``parent``: ``("job", job)`` once, then ``("run", partition)`` answered
    by ``("progress", n)`` messages and ``("done", result)`` or ``("error", kind, text)``; or
    ``("call", (fn, item))`` answered by ``("value", fn(item))`` or ``("error", kind, text)``
    (`Pool.map`). EOF from the parent, or the parent's end, stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    threading.Thread(target=_start_numba, name="omicsio-numba-start", daemon=True).start()
    # the parent's pid as it gave it, not os.getppid(): a parent killed while this worker was still
    # importing has already left it to another process, whose end it would have waited for
    threading.Thread(target=_exit_with, args=(parent,), name="omicsio-parent", daemon=True).start()
    conn = Connection(fd)
    job = None
    scratch = Scratch()  # this worker's memory and shard writer, reused from one partition to the next
    try:
        while True:
            message = conn.recv()
            if message[0] == "job":
                job = pickle.loads(message[1])
                continue
            if message[0] == "call":  # `Pool.map`: one call, its value or its error sent back
                try:
                    fn, item = pickle.loads(message[1])
                    reply = ("value", fn(item))
                except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides
                    reply = error_reply(e)
                conn.send(reply)
                continue
            part = message[1]
            try:
                result = write_partition(job, part, lambda n: conn.send(("progress", n)), scratch=scratch)
            except (EOFError, BrokenPipeError, ConnectionResetError):
                return
            except ShardWriterDied:  # as if this worker died: the pool writes the partition again
                return
            except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
                conn.send(error_reply(e))
                continue
            conn.send(("done", result))
    except (EOFError, OSError, KeyboardInterrupt):  # the parent has gone (a message cut short included)
        return
    finally:
        scratch.close()
        _remove_own_tmp()  # its folder (`_Worker`), removed here too: a parent killed cannot


def _remove_own_tmp() -> None:
    """Remove this worker's temporary folder (`_Worker` points ``TMPDIR`` at it)."""
    own = tempfile.gettempdir()
    if os.path.basename(own).startswith(_WORKER_TMP):
        shutil.rmtree(own, ignore_errors=True)


def _exit_with(parent: int) -> None:
    """Stop this worker within `_PARENT_POLL` seconds of its parent's end, whatever it is doing: a
    worker sees the parent go at its next message, but one killed outright (SIGKILL: no EOF reaches
    a worker between messages) would go on writing its partition, and on object storage upload it
    into a prefix whose lease a rerun has taken over. A worker runs in a session of its own (a
    Ctrl-C in the terminal is the parent's to handle), so a signal to the parent's group misses it."""
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL)
    _remove_own_tmp()
    os._exit(1)


_PARENT_POLL = 0.2


@nb.njit(cache=True)
def _one(x):  # pragma: no cover - compiled
    return x + 1


def _start_numba() -> None:
    """numba's start (its compiler's and type registries' setup, ~0.3 s, paid by the first kernel a
    process calls) while the worker waits for its job and unpickles it; its first partition then
    loads its kernels from the cache at once. A collection's workers start as its sources open, so
    this overlaps the opening too."""
    _one(1)


class _Worker:
    def __init__(self, core: int | None):
        parent, child = socket.socketpair()
        pin = "" if core is None else f"import os; os.sched_setaffinity(0, {{{core}}}); "
        code = f"{pin}from materialize._pool import serve; serve({child.fileno()}, {os.getpid()})"
        # the worker's temporary files (an object-storage run's partitions before their upload) go to
        # a folder of its own, removed when it stops: killed mid-partition, it cannot remove them
        self.tmp = tempfile.mkdtemp(prefix=_WORKER_TMP)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={_KERNEL_TMPDIR: tempfile.gettempdir(), **os.environ, "TMPDIR": self.tmp},
            )
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        finally:
            child.close()
        self.conn = Connection(parent.detach())
        self.core = core
        self.job: bytes | None = None  # the (pickled) job this worker holds
        self.part: Partition | None = None
        self.cells = 0  # progress reported for the current partition

    def allow(self, cores: Sequence[int]) -> None:
        """Let every thread of this worker, and of the processes it started (its shards' compressor),
        run on ``cores``; threads started later inherit them."""
        for tid in _threads_of(self.proc.pid):
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:  # the thread ended meanwhile
                continue

    def give(self, job_bytes: bytes) -> None:
        if self.job is not job_bytes:
            self.conn.send(("job", job_bytes))
            self.job = job_bytes

    def stop(self) -> None:
        """Kill the worker and the processes it started (its shard writer, in a session of its own so
        that Ctrl-C reaches only the worker, is not killed with it), and wait until they are gone: a
        writer left running would go on finishing a shard in the output's folder while it is removed."""
        if self.proc.poll() is None:
            started = _children_of(self.proc.pid)
            self.proc.kill()
            for pid in started:
                _kill_and_wait(pid)
        self.proc.wait()
        self.conn.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _children_of(pid: int) -> list[int]:
    """The child processes of process ``pid``, from ``/proc`` (none if it has exited)."""
    found = []
    for tid in _own_threads(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return found


def _own_threads(pid: int) -> list[int]:
    try:
        return sorted((int(t) for t in os.listdir(f"/proc/{pid}/task")), key=lambda t: t != pid)
    except OSError:  # exited, or no /proc
        return []


def _kill_and_wait(pid: int, timeout: float = 10.0) -> None:
    """SIGKILL process ``pid`` (not a child of this one) and wait until it has ended (gone, or a zombie
    its new parent has still to reap)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                    return
        except OSError:  # gone
            return
        time.sleep(0.002)


def _threads_of(pid: int) -> list[int]:
    """The threads of process ``pid`` (its main thread first: threads it starts inherit its cores) and
    of its child processes, from ``/proc`` (none if it has exited)."""
    found = _own_threads(pid)
    for child in _children_of(pid):
        found += _threads_of(child)
    return found


class Pool:
    """``workers`` local worker processes, started when it is made (with ``workers`` asked for, before
    the planning, so that their start overlaps it); one pool writes the primary's partitions and then
    every further modality's.

    With one worker per usable core (the default), worker *k* is pinned to the *k*-th core: a
    worker's threads (reading, encoding, statistics) then share one core's caches, as they do in a
    one-process run, instead of migrating between cores (~6% less user CPU time here). Once the
    last partition is handed out, a worker left without one frees its core, and every worker still
    writing is let onto all the cores (`_Worker.allow`), so that its reading, encoding and
    statistics threads overlap again: a run of few partitions otherwise ends with cores idle (3
    whole partitions on 2 cores: one core idle for a third of the run). The next run pins them again.

    >>> with Pool(4) as pool:                                          # doctest: +SKIP
    ...     pool.run(job, partitions, progress, on_done=finalizer.add)
    """

    def __init__(self, workers: int):
        self.workers: list[_Worker] = []
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.cores = cores
        pinned = cores if len(cores) == workers > 1 else [None] * workers
        try:
            for core in pinned:
                self.workers.append(_Worker(core))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.workers = []

    def shrink(self, workers: int) -> None:
        """Keep at most ``workers`` of the processes (for a plan of fewer partitions than processes)."""
        for worker in self.workers[workers:]:
            worker.stop()
        del self.workers[workers:]

    def run(
        self,
        job: Job,
        partitions: Sequence[Partition],
        progress: Progress,
        *,
        on_done: Done | None = None,
        retries: int = 2,
    ) -> RunReport:
        """Write ``partitions``, calling ``on_done(index)`` as each completes. A worker that dies
        mid-partition is replaced and its partition written again (at most ``retries`` times each);
        on any error every worker is stopped."""
        if not self.workers:  # closed: nothing would ever answer
            msg = "internal error: a run on a pool without workers (closed)"
            raise OmicsIOError(msg)
        job_bytes = pickle.dumps(job)
        queue = Schedule(partitions, run_length(len(partitions), len(self.workers)))
        attempts: dict[int, int] = {}
        pool = self.workers
        report = RunReport(min(len(pool), len(partitions)))
        done = 0
        widened: set[_Worker] = set()  # let onto every core at this run's tail: once is enough
        try:
            for worker in pool[: len(partitions)]:
                if worker.core is not None:
                    worker.allow([worker.core])  # pinned again, if the last run's tail widened it
                worker.give(job_bytes)
                _assign(worker, queue)
            while done < len(partitions):
                ready = wait([w.conn for w in pool if w.part is not None])
                for worker in [w for w in pool if w.conn in ready]:
                    try:
                        message = worker.conn.recv()
                    except (EOFError, OSError):
                        message = ("died", worker.proc.wait())
                    if message[0] == "progress":
                        worker.cells += message[1]
                        progress(message[1])
                    elif message[0] == "done":
                        done += 1
                        index = worker.part.index
                        worker.part, worker.cells = None, 0
                        _assign(worker, queue)  # first, so the worker goes on while this one is merged
                        if worker.part is None and worker.core is not None:
                            # nothing left to give: the pinned workers still busy may use its core
                            for busy in pool:
                                if busy.part is not None and busy.core is not None and busy not in widened:
                                    busy.allow(self.cores)
                                    widened.add(busy)
                        if on_done is not None:
                            on_done(index)
                    elif message[0] == "error":
                        raise_worker_error(message[1], message[2], worker.part)
                    else:  # the worker died: replace it, write its partition again
                        part = worker.part
                        attempts[part.index] = attempts.get(part.index, 0) + 1
                        if attempts[part.index] > retries:
                            msg = (
                                f"{part.describe()}: its worker died {attempts[part.index]} times (last exit "
                                f"code {message[1]}); is the machine out of memory?"
                            )
                            raise OmicsIOError(msg)
                        progress(-worker.cells)
                        report.redone.append(part.index)
                        queue.give_back(worker, part)
                        worker.stop()
                        replacement = _Worker(worker.core)
                        pool[pool.index(worker)] = replacement
                        replacement.give(job_bytes)
                        _assign(replacement, queue)
        except BaseException:
            self.close()  # workers may be mid-partition; nothing of this run is kept
            raise
        return report

    def map(
        self, fn: Callable[[object], object], items: Sequence[object], what: Callable[[object], str]
    ) -> Iterator[object]:
        """``fn(item)`` for each of ``items`` on the workers, one item at a time per worker (``fn``
        and the items are pickled: a function of a module, not a lambda). Yields the results in the
        items' order, each once it and those before it are back: a value, or the error the call
        raised as an exception object, not raised, so the caller chooses which to raise (``what``:
        what a call does to its item, e.g. ``opening a.h5ad``, for the message of an error that is
        not ours). A worker that dies stops the pool and raises `OmicsIOError` naming its item; so
        does letting go of the results while calls are still out (once every result is in, the
        pool goes on, ready for a run)."""
        pending = deque(enumerate(items))
        results: dict[int, object] = {}
        busy: dict[_Worker, int] = {}
        following = 0
        try:
            while following < len(items):
                for worker in self.workers:
                    if worker not in busy and pending:
                        k, item = pending.popleft()
                        worker.conn.send(("call", pickle.dumps((fn, item))))
                        busy[worker] = k
                if not busy:
                    msg = f"{what(items[following])}: the pool has no workers (closed)"
                    raise OmicsIOError(msg)
                ready = wait([w.conn for w in busy])
                for worker in [w for w in busy if w.conn in ready]:
                    k = busy.pop(worker)
                    try:
                        message = worker.conn.recv()
                    except (EOFError, OSError):
                        msg = f"{what(items[k])}: its worker process died (exit code {worker.proc.wait()})"
                        raise OmicsIOError(msg) from None
                    if message[0] == "value":
                        results[k] = message[1]
                    else:
                        results[k] = worker_error(message[1], message[2], what(items[k]))
                while following in results:
                    yield results.pop(following)
                    following += 1
        except GeneratorExit:  # let go of: the pool goes on unless calls are still out
            if busy:
                self.close()  # their answers would come to whatever the pool does next
            raise
        except BaseException:
            self.close()  # workers may be mid-call, or dead
            raise


def _assign(worker: _Worker, queue: Schedule) -> None:
    part = queue.next(worker)
    if part is not None:
        worker.part = part
        worker.conn.send(("run", part))


def run_length(num_partitions: int, num_workers: int) -> int:
    """How many consecutive partitions a worker takes at a time: up to 4, while each worker still
    gets two such runs (fewer partitions: one at a time, in order)."""
    return max(1, min(4, num_partitions // (2 * max(num_workers, 1))))


class Schedule:
    """Which partition a worker writes next. A worker takes ``run`` consecutive partitions at a time
    and writes them in order: a partition that starts inside a parquet row group then goes on from
    the stream its worker's last partition left open, where another worker would decode the group
    again from its first row (Parquet cannot start in between). Runs are handed out in the plan's
    order, so partitions complete nearly in order for the finalizer; once none is left, a worker
    takes the last partition another has still to write. A dead worker's partition and the rest of
    its run go back to the front."""

    def __init__(self, partitions: Sequence[Partition], run: int = 1):
        self._queue: deque[Partition] = deque(partitions)
        self._run = max(1, run)
        self._reserved: dict[object, deque[Partition]] = {}  # per worker: the rest of its run

    def next(self, worker: object) -> Partition | None:
        mine = self._reserved.get(worker)
        if mine:
            return mine.popleft()
        if self._queue:
            first = self._queue.popleft()
            take = min(self._run - 1, len(self._queue))
            self._reserved[worker] = deque(self._queue.popleft() for _ in range(take))
            return first
        donor = max(self._reserved.values(), key=len, default=None)
        return donor.pop() if donor else None

    def give_back(self, worker: object, part: Partition) -> None:
        for p in reversed([part, *self._reserved.pop(worker, ())]):
            self._queue.appendleft(p)

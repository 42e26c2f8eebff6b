"""Reads that bypass the page cache (``O_DIRECT``), many in flight from one thread: for a dataset larger than RAM.

On a dataset larger than the page cache, a buffered read of a cold chunk costs the kernel a page
cache fill, the eviction of an older page to make room for it, and a copy to the process: on the
2-core machine of the beyond-RAM benchmark 2.5 µs of CPU per cell read (16-cell chunks of 37 KiB
at random, 16 reads in flight), against 0.7 µs with ``O_DIRECT``, where the disk writes straight
into the process's buffer. Warm, the page cache is what makes reads cheap, so direct reads are for
datasets the page cache cannot hold (`Dataset`'s ``direct_io``).

``O_DIRECT`` needs the file offset, the length and the buffer address aligned to the device's
block: every range is widened to `ALIGN` (4 KiB) boundaries, and ranges whose widened spans touch
are read as one. A direct read has no kernel read-ahead, so the queue depth comes from here, and
not from threads: a pool of 16 reader threads (tried first) spent a quarter of the process's CPU
waking threads and passing the GIL. Reads are submitted with Linux's native asynchronous I/O
(``io_submit`` / ``io_getevents``, called from nogil numba kernels through libc's ``syscall``; see
`aio`) on a context per thread: `DirectReads.read_groups` keeps `AHEAD` groups of reads submitted
ahead of the one it hands out, which the caller decodes meanwhile. How many reads one ``io_submit``
carries matters more than how many are in flight: on the benchmark's disk, true random csr batches
of 1,024 read cold came at 26,454 cells/s (a read each) in groups of 1 MiB (~25 reads) with 4
ahead, and at 34,666 in groups of 4 MiB with 2 ahead (benchmarks/results/archive/
beyond_ram_1mib_groups.json and beyond_ram.json, runs whose files record no date or commit).

AIO contexts are a host-wide resource (``fs.aio-max-nr`` events in all, 65,536 by default): a
process keeps a small pool of them (`aio.contexts`, at most `MAX_CONTEXTS`), each leased by one
`DirectReads.read_groups` call at a time and sized from the host's remaining headroom, so many
processes with many reader threads share the host. Where no context can be had (the headroom spent,
``io_setup`` refused, or `MAX_CONTEXTS` calls reading at once), reads fall back to buffered reads
of the same bytes, with one warning per process. Only ``EAGAIN`` and ``EINTR`` are tried again; any
other error is a `ReadError` naming the file.
"""

from __future__ import annotations

import collections
import os
import platform
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from omicsio_jax.core.buffers import aligned_empty
from omicsio_jax.storage import aio
from omicsio_jax.storage.aio import MAX_CONTEXTS as MAX_CONTEXTS  # enforced by the pool, `aio.contexts`

ALIGN = 4096  # the widest logical block size of common devices (512 B or 4 KiB)
AHEAD = 2  # groups of reads submitted ahead of the one being decoded (~200 reads of 41 KiB in flight at 4 MiB groups)


def supported(path: str | os.PathLike[str]) -> bool:
    """Whether direct reads work here: Linux with native AIO (x86-64 or aarch64), and a file system
    holding ``path`` (a file) that accepts ``O_DIRECT`` (tmpfs and some FUSE mounts do not)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag or platform.machine() not in aio.SYSCALLS:
        return False
    context = aio.contexts().lease()
    if context is None:
        return False
    aio.contexts().give_back(context)
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError:
        return False
    try:
        buf = aligned_empty((ALIGN,), np.uint8, align=ALIGN)
        os.preadv(fd, [memoryview(buf)], 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def spans_of(
    ranges: np.ndarray, files: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(spans, span of each range, file of each span)``: byte ``ranges`` (``(k, 2)``, of files
    ``files``, default all of file 0; sorted by file then offset, not overlapping) widened to
    `ALIGN` boundaries, those of one file that then touch or overlap merged into one span."""
    files = np.zeros(len(ranges), np.int64) if files is None else np.asarray(files, np.int64)
    lo = ranges[:, 0] // ALIGN * ALIGN
    hi = -(-ranges[:, 1] // ALIGN) * ALIGN
    new = np.ones(len(ranges), bool)
    new[1:] = (lo[1:] > hi[:-1]) | (files[1:] != files[:-1])
    starts = np.flatnonzero(new)
    spans = (
        np.stack([lo[starts], np.maximum.reduceat(hi, starts)], axis=1)
        if len(starts)
        else np.zeros((0, 2), np.int64)
    )
    return spans, np.cumsum(new) - 1, files[starts]


class ReadError(OSError):
    """A direct read failed (``errno``, ``strerror`` and ``filename`` as the OS reported them)."""


class DirectReads:
    """Reads groups of byte ranges with ``O_DIRECT``, `AHEAD` groups in flight (see the module
    docstring), into aligned buffers it recycles (`release`). Safe to use from several threads
    at once: each has its own AIO context."""

    def __init__(self, keep: int = 2 * AHEAD + 2):
        self._free: collections.deque[np.ndarray] = collections.deque()
        self._keep = keep
        self._lock = threading.Lock()

    def read_groups(
        self,
        paths: Sequence[Path],
        groups: Sequence[tuple[np.ndarray, np.ndarray]],
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """For each group ``(files, ranges)`` (byte ranges ``(k, 2)`` of ``paths[files[i]]``, sorted
        by file then offset; a group may span files), in order: ``(buf, offset of each range in
        buf, the ranges' ends)``, an end moved back to where its file ended if it ended inside the
        range. `release` ``buf`` once it is decoded. Raises `ReadError` for a read the OS failed.
        Read with ``O_DIRECT`` on a context of this process's pool, or buffered where none can be
        had (see the module docstring)."""
        context = aio.contexts().lease()
        if context is None:
            yield from self._read_buffered(paths, groups)
            return
        try:
            yield from self._read_direct(context, paths, groups)
        finally:
            aio.contexts().give_back(context)

    def _read_direct(
        self, context: aio.Context, paths: Sequence[Path], groups: Sequence[tuple[np.ndarray, np.ndarray]]
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        _, _, getevents, submit = aio.SYSCALLS[platform.machine()]
        fn, errno_fn = np.uint64(aio.syscall_address()), np.uint64(aio.errno_address())
        ctx, capacity = context.id, context.events
        cut = [spans_of(ranges, files) for files, ranges in groups]
        first = np.zeros(len(groups) + 1, np.int64)
        np.cumsum([len(c[0]) for c in cut], out=first[1:])
        n = int(first[-1])
        spans = np.concatenate([c[0] for c in cut]) if n else np.zeros((0, 2), np.int64)
        span_files = np.concatenate([c[2] for c in cut]) if n else np.zeros(0, np.int64)
        iocbs, pointers = np.zeros((n, 8), np.uint64), np.zeros(n, np.uint64)
        address, fds = np.zeros(n, np.uint64), np.zeros(n, np.int64)
        got, events = np.full(n, aio.PENDING, np.int64), np.zeros((capacity, 4), np.int64)
        opened: dict[int, int] = {}
        bufs: dict[int, np.ndarray] = {}
        issued = 0  # reads [0, issued) are in the kernel's hands
        reaped = 0  # reads [0, reaped) have completed

        def wait_until(stop: int) -> None:
            nonlocal reaped
            if stop > reaped:
                err = aio.reap(fn, errno_fn, getevents, ctx, events, got, reaped, stop)
                if err:
                    path = paths[int(span_files[reaped])]
                    raise ReadError(
                        err, f"waiting for the reads failed (io_getevents: {os.strerror(err)})", str(path)
                    )
                reaped = stop

        def start(lo: int, hi: int) -> None:
            """Submit reads ``[lo, hi)``, at most ``capacity`` in flight: the oldest waited for first."""
            nonlocal issued
            while lo < hi:
                k = min(hi - lo, capacity)
                wait_until(lo + k - capacity)
                issued, err = aio.submit(
                    fn, errno_fn, submit, ctx, iocbs, pointers, lo, lo + k, fds, spans, address
                )
                if issued < lo + k:
                    reason = os.strerror(err) if err else "no reason given"
                    path = paths[int(span_files[issued])]
                    raise ReadError(
                        err, f"the kernel refused the asynchronous reads (io_submit: {reason})", str(path)
                    )
                lo += k

        submitted = 0  # groups [0, submitted) are submitted
        try:
            for g, (_, ranges) in enumerate(groups):
                while submitted < len(groups) and (
                    submitted <= g or (submitted <= g + AHEAD and first[submitted + 1] - first[g] <= capacity)
                ):
                    lo, hi = first[submitted], first[submitted + 1]
                    for f in np.unique(span_files[lo:hi]).tolist():
                        if f not in opened:
                            try:
                                opened[f] = os.open(paths[f], os.O_RDONLY | os.O_DIRECT)
                            except OSError as e:
                                raise ReadError(e.errno, e.strerror, str(paths[f])) from e
                        fds[lo:hi][span_files[lo:hi] == f] = opened[f]
                    sizes = spans[lo:hi, 1] - spans[lo:hi, 0]
                    buf = bufs[submitted] = self._buffer(int(sizes.sum()))
                    address[lo + 1 : hi] = np.cumsum(sizes[:-1])
                    address[lo:hi] += np.uint64(buf.ctypes.data)
                    start(int(lo), int(hi))
                    submitted += 1
                lo, hi = first[g], first[g + 1]
                wait_until(int(hi))
                buf = bufs.pop(g)
                spans_g, which, files_g = cut[g]
                yield (
                    buf,
                    *self._placed(
                        [paths[f] for f in files_g.tolist()], ranges, spans_g, which, got[lo:hi], buf
                    ),
                )
        finally:  # reads still in flight write into their buffers (and would complete into this
            # context's next user): wait for every one submitted before any buffer is reused
            if issued > reaped and aio.reap(fn, errno_fn, getevents, ctx, events, got, reaped, issued):
                context.broken = True  # not known to be idle: not leased again
            for fd in opened.values():
                os.close(fd)
            for buf in bufs.values():
                self.release(buf)

    def _read_buffered(
        self, paths: Sequence[Path], groups: Sequence[tuple[np.ndarray, np.ndarray]]
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """`read_groups` through the page cache: the same spans, one plain ``preadv`` each."""
        opened: dict[int, int] = {}
        try:
            for files, ranges in groups:
                spans, which, span_files = spans_of(ranges, files)
                sizes = spans[:, 1] - spans[:, 0]
                buf = self._buffer(int(sizes.sum()))
                got = np.zeros(len(spans), np.int64)
                at = 0
                for i, f in enumerate(span_files.tolist()):
                    try:
                        if f not in opened:
                            opened[f] = os.open(paths[f], os.O_RDONLY)
                        got[i] = os.preadv(opened[f], [memoryview(buf[at : at + sizes[i]])], int(spans[i, 0]))
                    except OSError as e:
                        raise ReadError(e.errno, e.strerror, str(paths[f])) from e
                    at += int(sizes[i])
                yield (
                    buf,
                    *self._placed([paths[f] for f in span_files.tolist()], ranges, spans, which, got, buf),
                )
        finally:
            for fd in opened.values():
                os.close(fd)

    @staticmethod
    def _placed(
        span_paths: Sequence[Path],
        ranges: np.ndarray,
        spans: np.ndarray,
        which: np.ndarray,
        got: np.ndarray,
        buf: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each range's offset in ``buf`` and its end, once every span's read (of file
        ``span_paths[i]``) is checked: a read the OS failed raises; a short read the file does not
        explain is completed by a plain read."""
        sizes = spans[:, 1] - spans[:, 0]
        dst = np.zeros(len(spans), np.int64)
        np.cumsum(sizes[:-1], out=dst[1:])
        if (got < 0).any():
            i = int(np.argmax(got < 0))
            raise ReadError(-int(got[i]), os.strerror(-int(got[i])), str(span_paths[i]))
        for i in np.flatnonzero(got < sizes).tolist():
            want = min(int(spans[i, 1]), os.stat(span_paths[i]).st_size) - int(spans[i, 0])
            if got[i] < want:
                with open(span_paths[i], "rb", buffering=0) as f:
                    got[i] += os.preadv(
                        f.fileno(),
                        [memoryview(buf[dst[i] + got[i] : dst[i] + want])],
                        int(spans[i, 0] + got[i]),
                    )
        base = dst[which] + ranges[:, 0] - spans[which, 0]
        return base, np.minimum(ranges[:, 1], (spans[:, 0] + got)[which])

    def _buffer(self, size: int) -> np.ndarray:
        """An aligned buffer of at least ``size`` bytes: a released one, else a new one."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) >= size:
                    del self._free[i]
                    return buf
        return aligned_empty((max(size, 1 << 20),), np.uint8, align=ALIGN)

    def release(self, buf: np.ndarray) -> None:
        """``buf`` (from `read_groups`) is no longer needed: later reads may reuse its memory."""
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buf)

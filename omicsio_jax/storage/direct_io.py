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
(``io_submit`` / ``io_getevents``, called from nogil numba kernels through libc's ``syscall``)
on a context per thread: `DirectReads.read_groups` keeps `AHEAD` groups of reads submitted ahead
of the one it hands out, which the caller decodes meanwhile. How many reads one ``io_submit``
carries matters more than how many are in flight: on the benchmark's disk, the loader's reads alone
ran at ~26k/s in groups of 1 MiB (~25 reads) whatever the number ahead, and at 35-37k/s in groups
of 4 or 8 MiB (1, 2 or 4 ahead alike; benchmarks/README.md, "Beyond RAM").
"""

from __future__ import annotations

import collections
import ctypes
import functools
import os
import platform
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from omicsio_jax.core.buffers import aligned_empty

ALIGN = 4096  # the widest logical block size of common devices (512 B or 4 KiB)
AHEAD = 2  # groups of reads submitted ahead of the one being decoded (~200 reads of 41 KiB in flight at 4 MiB groups)
_EVENTS = 2048  # the most reads one context has in flight

# Linux's AIO system calls: (io_setup, io_destroy, io_getevents, io_submit)
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
_PENDING = np.iinfo(np.int64).min  # a read not completed yet


@functools.cache
def _syscall_address() -> int:
    return ctypes.cast(ctypes.CDLL(None).syscall, ctypes.c_void_p).value


@intrinsic
def _syscall(typingctx, fn, number, a, b, c, d, e):
    """``long syscall(long number, ...)`` at address ``fn``, with five integer arguments (all
    passed: the kernel reads as many as the call has, and a missing one would be a stray register)."""

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        ptr = builder.inttoptr(args[0], ir.FunctionType(i64, [i64], var_arg=True).as_pointer())
        return builder.call(ptr, args[1:])

    return types.int64(
        types.uint64, types.int64, types.uint64, types.uint64, types.uint64, types.uint64, types.uint64
    ), codegen


@nb.njit(nogil=True, cache=True)
def _submit(fn, number, ctx, iocbs, pointers, first, stop, fds, spans, address):
    """Submit reads ``[first, stop)``: span ``i`` of file ``fds[i]`` into memory at ``address[i]``;
    returns the first read not submitted (``stop`` when all were; less if the kernel kept refusing)."""
    for i in range(first, stop):
        w = iocbs[i]
        w[0] = np.uint64(i)  # aio_data: which read this is
        w[1] = np.uint64(0)  # aio_key, aio_rw_flags
        w[2] = np.uint64(fds[i]) << np.uint64(
            32
        )  # aio_lio_opcode 0 (IOCB_CMD_PREAD), aio_reqprio 0, aio_fildes
        w[3] = np.uint64(address[i])
        w[4] = np.uint64(spans[i, 1] - spans[i, 0])
        w[5] = np.uint64(spans[i, 0])
        w[6] = np.uint64(0)
        w[7] = np.uint64(0)
        pointers[i] = np.uint64(iocbs.ctypes.data) + np.uint64(64 * i)
    i, tries = first, 0
    while i < stop:
        n = _syscall(
            fn,
            number,
            np.uint64(ctx),
            np.uint64(stop - i),
            np.uint64(pointers.ctypes.data) + np.uint64(8 * i),
            np.uint64(0),
            np.uint64(0),
        )
        if n <= 0:  # -1: EAGAIN / EINTR (tried again), else refused
            tries += 1
            if tries > 1000:
                return i
            continue
        i += n
    return stop


@nb.njit(nogil=True, cache=True)
def _reap(fn, number, ctx, events, got, first, stop):
    """Wait until reads ``[first, stop)`` have completed, recording each completed read's result
    (bytes read, or -errno) in ``got``; False if waiting fails."""
    tries = 0
    for i in range(first, stop):
        while got[i] == _PENDING:
            n = _syscall(
                fn,
                number,
                np.uint64(ctx),
                np.uint64(1),
                np.uint64(events.shape[0]),
                np.uint64(events.ctypes.data),
                np.uint64(0),
            )  # timeout NULL: wait
            if n < 0:  # EINTR: wait again
                tries += 1
                if tries > 1000:
                    return False
                continue
            for k in range(n):
                got[events[k, 0]] = np.int64(events[k, 2])
    return True


class _Context:
    """One thread's AIO context (destroyed with the thread's locals)."""

    __slots__ = ("_destroy", "id", "pid")

    def __init__(self):
        holder = ctypes.c_ulong(0)
        setup, destroy = _SYSCALLS[platform.machine()][:2]
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(ctypes.c_long(setup), ctypes.c_long(_EVENTS), ctypes.byref(holder)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_setup: {os.strerror(err)}")
        self.id, self.pid = holder.value, os.getpid()
        self._destroy = functools.partial(libc.syscall, ctypes.c_long(destroy), ctypes.c_ulong(self.id))

    def __del__(self):
        if self.pid == os.getpid():  # a forked child's copy is not its context (the kernel's is the parent's)
            self._destroy()


_local = threading.local()


def _thread_context() -> int:
    context = getattr(_local, "context", None)
    if context is None or context.pid != os.getpid():  # none yet, or the parent's, copied by a fork
        context = _local.context = _Context()
    return context.id


def physical_memory() -> int:
    """This machine's RAM in bytes (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def supported(path: str | os.PathLike[str]) -> bool:
    """Whether direct reads work here: Linux with native AIO (x86-64 or aarch64), and a file system
    holding ``path`` (a file) that accepts ``O_DIRECT`` (tmpfs and some FUSE mounts do not)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag or platform.machine() not in _SYSCALLS:
        return False
    try:
        _thread_context()
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
        range. `release` ``buf`` once it is decoded. Raises `ReadError` for a read the OS failed."""
        _, _, getevents, submit = _SYSCALLS[platform.machine()]
        fn, ctx = np.uint64(_syscall_address()), _thread_context()
        cut = [spans_of(ranges, files) for files, ranges in groups]
        first = np.zeros(len(groups) + 1, np.int64)
        np.cumsum([len(c[0]) for c in cut], out=first[1:])
        n = int(first[-1])
        spans = np.concatenate([c[0] for c in cut]) if n else np.zeros((0, 2), np.int64)
        iocbs, pointers = np.zeros((n, 8), np.uint64), np.zeros(n, np.uint64)
        address, fds = np.zeros(n, np.uint64), np.zeros(n, np.int64)
        got, events = np.full(n, _PENDING, np.int64), np.zeros((_EVENTS, 4), np.int64)
        opened: dict[int, int] = {}
        bufs: dict[int, np.ndarray] = {}
        submitted = 0  # groups [0, submitted) are submitted
        issued = 0  # reads [0, issued) are in the kernel's hands (a group's own, if it was refused part-way)
        try:
            for g, (_, ranges) in enumerate(groups):
                while submitted < len(groups) and (
                    submitted <= g or (submitted <= g + AHEAD and first[submitted + 1] - first[g] <= _EVENTS)
                ):
                    lo, hi = first[submitted], first[submitted + 1]
                    span_files = cut[submitted][2]
                    for f in np.unique(span_files).tolist():
                        if f not in opened:
                            try:
                                opened[f] = os.open(paths[f], os.O_RDONLY | os.O_DIRECT)
                            except OSError as e:
                                raise ReadError(e.errno, e.strerror, str(paths[f])) from e
                        fds[lo:hi][span_files == f] = opened[f]
                    sizes = spans[lo:hi, 1] - spans[lo:hi, 0]
                    buf = bufs[submitted] = self._buffer(int(sizes.sum()))
                    address[lo + 1 : hi] = np.cumsum(sizes[:-1])
                    address[lo:hi] += np.uint64(buf.ctypes.data)
                    issued = _submit(fn, submit, ctx, iocbs, pointers, lo, hi, fds, spans, address)
                    if issued < hi:
                        raise ReadError(
                            0,
                            "the kernel refused the asynchronous reads (io_submit)",
                            str(paths[int(span_files[issued - lo])]),
                        )
                    submitted += 1
                lo, hi = first[g], first[g + 1]
                if not _reap(fn, getevents, ctx, events, got, lo, hi):
                    raise ReadError(
                        0,
                        "waiting for the asynchronous reads failed (io_getevents)",
                        str(paths[int(cut[g][2][0])]),
                    )
                buf = bufs.pop(g)
                spans_g, which, span_files = cut[g]
                yield (
                    buf,
                    *self._placed(
                        [paths[f] for f in span_files.tolist()], ranges, spans_g, which, got[lo:hi], buf
                    ),
                )
        finally:  # reads still in flight write into their buffers (and would complete into this thread's
            # next call): wait for every one submitted before any buffer is reused
            if issued:
                _reap(fn, getevents, ctx, events, got, 0, issued)
            for fd in opened.values():
                os.close(fd)
            for buf in bufs.values():
                self.release(buf)

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

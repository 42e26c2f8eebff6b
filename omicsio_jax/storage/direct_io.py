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

AIO contexts are a host-wide resource (``fs.aio-max-nr`` events in all, 65,536 by default): a
process keeps a small pool of them (`MAX_CONTEXTS`), each leased by one `DirectReads.read_groups`
call at a time and sized from the host's remaining headroom, so many processes with many reader
threads share the host. Where no context can be had (the headroom spent, ``io_setup`` refused, or
`MAX_CONTEXTS` calls reading at once), reads fall back to buffered reads of the same bytes, with one
warning per process. Only ``EAGAIN`` and ``EINTR`` are tried again; any other error is a `ReadError`
naming the file.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import functools
import os
import platform
import threading
import warnings
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
_EVENTS = 2048  # the most reads one context has in flight (fewer where the host's headroom is short)
_MIN_EVENTS = 64  # a context smaller than this is not worth having: read buffered instead
MAX_CONTEXTS = 16  # per process: as many `read_groups` calls reading at once

# Linux's AIO system calls: (io_setup, io_destroy, io_getevents, io_submit)
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
_PENDING = np.iinfo(np.int64).min  # a read not completed yet
_EAGAIN, _EINTR = errno.EAGAIN, errno.EINTR


@functools.cache
def _syscall_address() -> int:
    return ctypes.cast(ctypes.CDLL(None).syscall, ctypes.c_void_p).value


@functools.cache
def _errno_address() -> int:
    return ctypes.cast(ctypes.CDLL(None).__errno_location, ctypes.c_void_p).value


@intrinsic
def _errno(typingctx, fn):
    """This thread's ``errno`` (``*__errno_location()``, the function at address ``fn``)."""

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        location = builder.inttoptr(args[0], ir.FunctionType(i32.as_pointer(), []).as_pointer())
        return builder.sext(builder.load(builder.call(location, [])), ir.IntType(64))

    return types.int64(types.uint64), codegen


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
def _submit(fn, errno_fn, number, ctx, iocbs, pointers, first, stop, fds, spans, address):
    """Submit reads ``[first, stop)``: span ``i`` of file ``fds[i]`` into memory at ``address[i]``;
    returns ``(the first read not submitted, errno)``: ``(stop, 0)`` when all were, else the error
    that stopped it (``EAGAIN`` and ``EINTR`` are tried again, a few times)."""
    for i in range(first, stop):
        w = iocbs[i]
        w[0] = np.uint64(i)  # aio_data: which read this is
        w[1] = np.uint64(0)  # aio_key, aio_rw_flags
        w[2] = np.uint64(fds[i]) << np.uint64(32)  # IOCB_CMD_PREAD, aio_reqprio 0, aio_fildes
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
        if n > 0:
            i += n
            continue
        err = _errno(errno_fn) if n < 0 else _EAGAIN
        if (err == _EAGAIN or err == _EINTR) and tries < 100:
            tries += 1
            continue
        return i, err
    return stop, 0


@nb.njit(nogil=True, cache=True)
def _reap(fn, errno_fn, number, ctx, events, got, first, stop):
    """Wait until reads ``[first, stop)`` have completed, recording each completed read's result
    (bytes read, or -errno) in ``got``; returns 0, or the errno of a wait that failed (``EINTR``
    is waited again)."""
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
            if n < 0:
                err = _errno(errno_fn)
                if err == _EINTR and tries < 1000:
                    tries += 1
                    continue
                return err
            for k in range(n):
                got[events[k, 0]] = np.int64(events[k, 2])
    return 0


def aio_headroom() -> int | None:
    """Events the host's AIO contexts may still reserve (``fs.aio-max-nr`` minus ``fs.aio-nr``);
    None where the kernel does not say."""
    try:
        with open("/proc/sys/fs/aio-max-nr") as most, open("/proc/sys/fs/aio-nr") as used:
            return int(most.read()) - int(used.read())
    except (OSError, ValueError):
        return None


class _Context:
    """An AIO context of ``events`` reads in flight (destroyed when collected, by the process that
    made it: a forked child's copy is not its context, the kernel's is the parent's)."""

    __slots__ = ("__weakref__", "_destroy", "broken", "events", "id", "pid")

    def __init__(self, events: int):
        holder = ctypes.c_ulong(0)
        setup, destroy = _SYSCALLS[platform.machine()][:2]
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(ctypes.c_long(setup), ctypes.c_long(events), ctypes.byref(holder)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_setup: {os.strerror(err)}")
        self.id, self.pid, self.events, self.broken = holder.value, os.getpid(), events, False
        self._destroy = functools.partial(libc.syscall, ctypes.c_long(destroy), ctypes.c_ulong(self.id))

    def __del__(self):
        if getattr(self, "pid", None) == os.getpid():  # (none made where io_setup refused)
            self._destroy()


class _Contexts:
    """This process's AIO contexts: at most `MAX_CONTEXTS`, each leased to one reader at a time."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pid, self._free, self._count = os.getpid(), [], 0
        self._warned = False

    def lease(self) -> _Context | None:
        """A context of this process (a free one, else a new one sized from the host's headroom), or
        None where none can be had (warned once per process: reads are then buffered)."""
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's contexts are not its own
                self._pid, self._free, self._count = os.getpid(), [], 0
            if self._free:
                return self._free.pop()
            if self._count >= MAX_CONTEXTS:
                reason = f"{MAX_CONTEXTS} threads of this process already read with O_DIRECT"
            else:
                room = aio_headroom()
                events = _EVENTS if room is None else min(_EVENTS, room // 4)
                if events < _MIN_EVENTS:
                    reason = f"the host's AIO events are nearly spent (fs.aio-max-nr headroom {room})"
                else:
                    try:
                        context = _Context(events)
                    except OSError as e:
                        reason = str(e)
                    else:
                        self._count += 1
                        return context
            warn, self._warned = not self._warned, True
        if warn:
            warnings.warn(
                f"omicsio_jax: reading buffered instead of with O_DIRECT: {reason} "
                "(raise the sysctl fs.aio-max-nr, or use fewer reader threads)",
                RuntimeWarning,
                stacklevel=4,
            )
        return None

    def give_back(self, context: _Context) -> None:
        """``context`` is free again (dropped if a read left it in doubt, or if it is a parent's)."""
        with self._lock:
            if context.pid != self._pid:
                return
            if context.broken:
                self._count -= 1
            else:
                self._free.append(context)


_CONTEXTS = _Contexts()


def supported(path: str | os.PathLike[str]) -> bool:
    """Whether direct reads work here: Linux with native AIO (x86-64 or aarch64), and a file system
    holding ``path`` (a file) that accepts ``O_DIRECT`` (tmpfs and some FUSE mounts do not)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag or platform.machine() not in _SYSCALLS:
        return False
    context = _CONTEXTS.lease()
    if context is None:
        return False
    _CONTEXTS.give_back(context)
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
        context = _CONTEXTS.lease()
        if context is None:
            yield from self._read_buffered(paths, groups)
            return
        try:
            yield from self._read_direct(context, paths, groups)
        finally:
            _CONTEXTS.give_back(context)

    def _read_direct(
        self, context: _Context, paths: Sequence[Path], groups: Sequence[tuple[np.ndarray, np.ndarray]]
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        _, _, getevents, submit = _SYSCALLS[platform.machine()]
        fn, errno_fn = np.uint64(_syscall_address()), np.uint64(_errno_address())
        ctx, capacity = context.id, context.events
        cut = [spans_of(ranges, files) for files, ranges in groups]
        first = np.zeros(len(groups) + 1, np.int64)
        np.cumsum([len(c[0]) for c in cut], out=first[1:])
        n = int(first[-1])
        spans = np.concatenate([c[0] for c in cut]) if n else np.zeros((0, 2), np.int64)
        span_files = np.concatenate([c[2] for c in cut]) if n else np.zeros(0, np.int64)
        iocbs, pointers = np.zeros((n, 8), np.uint64), np.zeros(n, np.uint64)
        address, fds = np.zeros(n, np.uint64), np.zeros(n, np.int64)
        got, events = np.full(n, _PENDING, np.int64), np.zeros((capacity, 4), np.int64)
        opened: dict[int, int] = {}
        bufs: dict[int, np.ndarray] = {}
        issued = 0  # reads [0, issued) are in the kernel's hands
        reaped = 0  # reads [0, reaped) have completed

        def wait_until(stop: int) -> None:
            nonlocal reaped
            if stop > reaped:
                err = _reap(fn, errno_fn, getevents, ctx, events, got, reaped, stop)
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
                issued, err = _submit(
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
            if issued > reaped and _reap(fn, errno_fn, getevents, ctx, events, got, reaped, issued):
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

"""Linux's native asynchronous I/O, for `direct_io`: the system calls, made from nogil numba
kernels, and this process's pool of AIO contexts.

Python has no binding for ``io_submit`` / ``io_getevents``. `submit` and `reap` are numba kernels
(``nogil``) that call libc's ``syscall`` at its address (`syscall_address`) and read the calling
thread's ``errno`` through ``__errno_location`` (`errno_address`), both by numba intrinsics: a group
of reads is described (one 64-byte ``iocb`` each), submitted and waited for in machine code, without
the GIL. `SYSCALLS` holds the four calls' numbers on the machines supported (x86-64 and aarch64); a
read not completed yet has the result `PENDING`.

AIO contexts are a host-wide resource (``fs.aio-max-nr`` events in all, 65,536 by default;
`aio_headroom` is what is left of them). `contexts` is this process's pool: at most `MAX_CONTEXTS`
contexts, each leased to one reader at a time, sized from the host's headroom and made by the
process that uses it (a forked child makes its own). Where none can be had, its ``lease`` warns once
per process and returns None, and the reader reads buffered instead.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
import threading
import warnings

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_EVENTS = 2048  # the most reads one context has in flight (fewer where the host's headroom is short)
_MIN_EVENTS = 64  # a context smaller than this is not worth having: read buffered instead
MAX_CONTEXTS = 16  # per process: as many `direct_io.DirectReads.read_groups` calls reading at once

# Linux's AIO system calls: (io_setup, io_destroy, io_getevents, io_submit)
SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
PENDING = np.iinfo(np.int64).min  # a read not completed yet
_EAGAIN, _EINTR = errno.EAGAIN, errno.EINTR


@functools.cache
def syscall_address() -> int:
    return ctypes.cast(ctypes.CDLL(None).syscall, ctypes.c_void_p).value


@functools.cache
def errno_address() -> int:
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
def syscall(typingctx, fn, number, a, b, c, d, e):
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
def submit(fn, errno_fn, number, ctx, iocbs, pointers, first, stop, fds, spans, address):
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
        n = syscall(
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
def reap(fn, errno_fn, number, ctx, events, got, first, stop):
    """Wait until reads ``[first, stop)`` have completed, recording each completed read's result
    (bytes read, or -errno) in ``got``; returns 0, or the errno of a wait that failed (``EINTR``
    is waited again)."""
    tries = 0
    for i in range(first, stop):
        while got[i] == PENDING:
            n = syscall(
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


class Context:
    """An AIO context of ``events`` reads in flight (destroyed when collected, by the process that
    made it: a forked child's copy is not its context, the kernel's is the parent's)."""

    __slots__ = ("__weakref__", "_destroy", "broken", "events", "id", "pid")

    def __init__(self, events: int):
        holder = ctypes.c_ulong(0)
        setup, destroy = SYSCALLS[platform.machine()][:2]
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(ctypes.c_long(setup), ctypes.c_long(events), ctypes.byref(holder)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_setup: {os.strerror(err)}")
        self.id, self.pid, self.events, self.broken = holder.value, os.getpid(), events, False
        self._destroy = functools.partial(libc.syscall, ctypes.c_long(destroy), ctypes.c_ulong(self.id))

    def __del__(self):
        if getattr(self, "pid", None) == os.getpid():  # (none made where io_setup refused)
            self._destroy()


class ContextPool:
    """This process's AIO contexts: at most `MAX_CONTEXTS`, each leased to one reader at a time."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pid, self._free, self._count = os.getpid(), [], 0
        self._warned = False

    def lease(self) -> Context | None:
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
                        context = Context(events)
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

    @property
    def made(self) -> int:
        """How many contexts this process holds (leased or free)."""
        return self._count

    @property
    def idle(self) -> int:
        """How many of them are free (not leased)."""
        return len(self._free)

    def give_back(self, context: Context) -> None:
        """``context`` is free again (dropped if a read left it in doubt, or if it is a parent's)."""
        with self._lock:
            if context.pid != self._pid:
                return
            if context.broken:
                self._count -= 1
            else:
                self._free.append(context)


# private on purpose: at exit, CPython clears a module's underscored names before the others, so the
# pool's contexts are destroyed (`Context.__del__`) while ``os`` is still bound
_CONTEXTS = ContextPool()


def contexts() -> ContextPool:
    """This process's pool of AIO contexts."""
    return _CONTEXTS

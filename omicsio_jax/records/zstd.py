"""zstd decompression that numba kernels call directly, without the GIL or a Python call per frame.

The library is the zstd that Python's own zstd module links (``compression.zstd`` from 3.14,
its ``backports.zstd`` before: a dependency of this package), else the system's ``libzstd``.
Kernels receive the function's address and a decompression context (``ZSTD_DCtx``, one per
thread: a context must not be used by two threads at once) as plain integers and call it
through `decompress`, an LLVM-level indirect call, so the compiled kernels stay cacheable (a
ctypes function referenced by a kernel would pin it to one process's addresses).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib
import threading

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

# ZSTD_isError: codes above (size_t)-ZSTD_error_maxCode (a few dozen) are errors
_ERROR_CODES = 1 << 12


def _candidates():
    for module in ("compression.zstd._zstd", "_zstd", "backports.zstd._zstd"):
        try:
            yield importlib.import_module(module).__file__
        except (ImportError, AttributeError):
            continue
    system = ctypes.util.find_library("zstd")
    if system:
        yield system


@functools.cache
def library() -> ctypes.CDLL | None:
    """A loaded library that exports zstd's decompression API, or None."""
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
            lib.ZSTD_decompressDCtx  # noqa: B018 - resolvable, or AttributeError
            lib.ZSTD_createDCtx  # noqa: B018
            lib.ZSTD_freeDCtx  # noqa: B018
        except (OSError, AttributeError):
            continue
        lib.ZSTD_createDCtx.restype = ctypes.c_void_p
        lib.ZSTD_createDCtx.argtypes = []
        lib.ZSTD_freeDCtx.restype = ctypes.c_size_t
        lib.ZSTD_freeDCtx.argtypes = [ctypes.c_void_p]
        return lib
    return None


def available() -> bool:
    return library() is not None


@functools.cache
def decompress_address() -> int:
    """The address of ``ZSTD_decompressDCtx`` (the first argument of `decompress`)."""
    return ctypes.cast(library().ZSTD_decompressDCtx, ctypes.c_void_p).value


class _Context:
    __slots__ = ("address",)

    def __init__(self):
        self.address = library().ZSTD_createDCtx()
        if not self.address:
            raise MemoryError("ZSTD_createDCtx failed")

    def __del__(self):
        lib = library()
        if lib is not None and self.address:
            lib.ZSTD_freeDCtx(self.address)


_local = threading.local()


def thread_context() -> int:
    """This thread's decompression context (created on first use, freed with the thread)."""
    context = getattr(_local, "context", None)
    if context is None:
        context = _local.context = _Context()
    return context.address


@intrinsic
def _call(typingctx, fn, dctx, dst, capacity, src, size):
    """``size_t fn(void* dctx, void* dst, size_t capacity, const void* src, size_t size)`` at address ``fn``."""

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        ptr = builder.inttoptr(args[0], ir.FunctionType(i64, [i64] * 5).as_pointer())
        return builder.call(ptr, args[1:])

    return types.uint64(
        types.uint64, types.uint64, types.uint64, types.int64, types.uint64, types.int64
    ), codegen


@nb.njit(inline="always")
def decompress(fn, dctx, dst, dst_start, capacity, src, src_start, size):
    """Decompress the zstd frame ``src[src_start:src_start + size]`` into ``dst`` at ``dst_start``
    (at most ``capacity`` bytes); the number of bytes written, or -1 on any error."""
    written = _call(fn, dctx, dst[dst_start:].ctypes.data, capacity, src[src_start:].ctypes.data, size)
    if written > np.uint64(0xFFFFFFFFFFFFFFFF - _ERROR_CODES):
        return np.int64(-1)
    return np.int64(written)

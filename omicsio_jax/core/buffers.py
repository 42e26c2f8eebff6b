"""Host buffers for batches: 64-byte aligned (XLA on CPU adopts them) and recycled once unreferenced."""

from __future__ import annotations

import gc
import math
import sys
import threading

import numpy as np

_ALIGN = 64


def aligned_empty(shape: tuple[int, ...], dtype=np.float32, *, align: int = _ALIGN) -> np.ndarray:
    """An uninitialized C-contiguous array whose data is 64-byte aligned (or ``align``-byte): XLA on
    CPU then adopts it as the device buffer instead of copying it (measured: 19 ms instead of 98 ms
    per 257 MB)."""
    dtype = np.dtype(dtype)
    return _aligned_view(np.empty(_nbytes(shape, dtype) + align, dtype=np.uint8), shape, dtype, align)


def read_only(array: np.ndarray) -> np.ndarray:
    """A read-only view of ``array`` (``array`` itself stays as it is). The kernels' inputs are
    passed as such views whatever the array came from (a file's bytes are read-only, a reused read
    buffer or an Arrow column may or may not be): numba compiles read-only arrays apart, so one kind
    of view means one compiled specialization of each kernel instead of two."""
    view = array.view()
    view.flags.writeable = False
    return view


def _nbytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return math.prod(shape) * dtype.itemsize  # (np.prod: 4% of the GIL's time at dense batch 64)


def _aligned_view(
    raw: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, align: int = _ALIGN
) -> np.ndarray:
    """The ``align``-byte-aligned ``(shape, dtype)`` array inside ``raw`` (uint8, ``align`` bytes of slack)."""
    offset = -raw.ctypes.data % align
    return raw[offset : offset + _nbytes(shape, dtype)].view(dtype).reshape(shape)


class RowBuffers:
    """Aligned output buffers, reused once nothing refers to them any more.

    A batch's buffer may be adopted by XLA (on CPU) and live on inside a jax.Array, so a buffer is
    only handed out again when its reference count says that no array, view or jax.Array holds it
    (every numpy view of a buffer refers to it directly; XLA holds the array it adopted). A fresh
    257 MB buffer costs ~80 ms of page faults here, more than decoding 1,024 cells into it (~10
    ms); a reused one costs nothing. At most ``keep`` buffers of each size are kept: a loader
    sizes it to the batches it can have in flight.

    XLA does not give back the arrays it adopted when their jax.Array goes: jaxlib queues the
    reference and drops it at the interpreter's next garbage collection (a callback jax registers,
    jax-ml/jax#14882). So when no buffer of a size is free, a collection of the youngest generation
    (`_collect_released`, tens of µs) first lets the batches the consumer has let go of come back.
    Without it a buffer came back one batch late: dense batches of 64 over 62,710 genes went round 3
    buffers of 16 MB instead of 2, and the rows were written to memory the caches no longer held.
    """

    def __init__(self, keep: int = 6):
        self._pools: dict[int, list[np.ndarray]] = {}
        self._spans: list[np.ndarray] = []  # `at_least`'s buffers, of any size
        self._keep = keep
        self._lock = threading.Lock()
        # The reference count of a buffer that only the pool holds, measured the way `empty` and
        # `num_free` take it (in a generator over a list): the list, the loop variable, the arguments.
        self._baseline = max(self._refs(r) for r in [np.empty(1)])

    @staticmethod
    def _refs(raw: np.ndarray) -> int:
        return sys.getrefcount(raw)

    def empty(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        """Like `aligned_empty`, reusing a buffer of this size that nothing refers to."""
        dtype = np.dtype(dtype)
        nbytes = _nbytes(shape, dtype)
        raw = self._free_one(nbytes)
        if raw is None and self._pools.get(nbytes):  # every one held, or not yet given back by XLA
            _collect_released()
            raw = self._free_one(nbytes)
        if raw is None:
            raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
            with self._lock:
                pool = self._pools.setdefault(nbytes, [])
                if len(pool) < self._keep:
                    pool.append(raw)
        return _aligned_view(raw, shape, dtype)

    def _free_one(self, nbytes: int) -> np.ndarray | None:
        with self._lock:
            return next((r for r in self._pools.get(nbytes, ()) if self._refs(r) <= self._baseline), None)

    def at_least(self, size: int) -> np.ndarray:
        """An aligned uint8 array of ``size`` bytes, for buffers whose sizes vary (a fetch's records):
        inside the smallest kept buffer of at least that many bytes that nothing refers to, else a
        new one with 1/8 to spare, kept in place of a free smaller one if ``keep`` are kept. (A new
        fetch buffer of 300 MB cost 21% of the loader's CPU in the kernel zeroing its pages, csr
        batch 1,024 on 2 cores.)"""
        need = size + _ALIGN
        raw = self._smallest_fitting(need)
        if raw is None and self._spans:  # every one held or too small, or not yet given back by XLA
            _collect_released()
            raw = self._smallest_fitting(need)
        if raw is None:
            raw = np.empty(need + need // 8, dtype=np.uint8)
            with self._lock:
                free = [r for r in self._spans if self._refs(r) <= self._baseline]
                if len(self._spans) >= self._keep and free:
                    smallest = min(free, key=len)  # (by identity: `list.remove` would compare arrays)
                    self._spans = [r for r in self._spans if r is not smallest]
                if len(self._spans) < self._keep:
                    self._spans.append(raw)
                del free
        return _aligned_view(raw, (size,), np.dtype(np.uint8))

    def array(self, n: int, dtype) -> np.ndarray:
        """An uninitialized array of ``n`` items of ``dtype`` in `at_least`'s memory: a kept buffer that
        nothing refers to any more, where it can (a fresh array of tens of MB costs its page faults
        each time: NumPy asks for huge pages past 4 MB, and the kernel zeroes every one)."""
        dtype = np.dtype(dtype)
        return self.at_least(n * dtype.itemsize).view(dtype)

    def _smallest_fitting(self, need: int) -> np.ndarray | None:
        with self._lock:
            fits = [r for r in self._spans if len(r) >= need and self._refs(r) <= self._baseline]
            return min(fits, key=len) if fits else None

    def release(self) -> None:
        """Keep no buffer any more (those in use stay with their users; a later call makes new ones):
        for an owner that is done, whose memory should go now, not when a garbage collection frees
        a reference cycle that may hold the owner."""
        with self._lock:
            self._pools, self._spans = {}, []

    def num_free(self) -> int:
        with self._lock:
            return sum(self._refs(r) <= self._baseline for pool in self._pools.values() for r in pool)


def _collect_released() -> None:
    """Drop the references XLA has let go of (`RowBuffers`): a collection of the youngest generation
    runs jax's callback. Outside any lock of ours: a collection may run other objects' finalizers."""
    gc.collect(0)

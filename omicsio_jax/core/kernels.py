"""numba helpers the kernels share: `prefetch`, LLVM's cache-line prefetch as a function numba
compiles, `stream_row`, rows written to memory around the caches, and `mix64`, splitmix64's
finalizer."""

from __future__ import annotations

import os
import platform
import threading
import time

import numba as nb
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from omicsio_jax.core.buffers import aligned_empty


@nb.njit(inline="always")
def mix64(z):
    """splitmix64's finalizer of a uint64 ``z``: every bit of the result depends on every bit of ``z``
    (the token outputs' draws, the cell-id hashes of materialize, the synthetic data's hashed bits)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@intrinsic
def prefetch(typingctx, array, index):
    """Ask for the cache line of ``array.flat[index]`` (a C-contiguous array) to be fetched for writing,
    without waiting for it: a kernel that will update a row of a table too large for the caches
    names it a few iterations ahead, so the misses overlap instead of stalling one by one. A hint
    only: nothing is read, and an index past the array faults nothing."""
    if not isinstance(array, types.Array) or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        pointer = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [pointer.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(
            fn, [pointer, ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)]
        )  # write, keep, data
        return context.get_dummy_value()

    return types.void(array, index), codegen


# -- rows written around the caches ------------------------------------------------------------------
#
# A dense batch can be far larger than the caches (batch 1,024 of 62,710 genes: 257 MB) and is read
# next by XLA or a host-to-device copy, not by this core. Zeroing its rows in place (memset) and
# scattering the values into them reads every line from memory before writing it (a store to a line
# not in the cache fetches it first), and the batch evicts what the cores were using. Built instead in
# a row of zeros that stays in the core's cache (`rows_scratch`), each row goes out with non-temporal
# stores (whole cache lines to memory, nothing fetched, nothing evicted) and the scratch row is zeroed
# again where the values went. A batch that stays in the last-level cache between batches loses by it
# (there the memset is cheap, and the streamed lines go all the way to memory). Measured on a 2-core
# AMD EPYC (32 MB of L3), one thread decoding batches of 62,710 columns into 2 outputs in turn: 64
# rows 134k rows/s in place, 126k streamed; 1,024 rows 67-74k in place, 124-130k streamed. But how
# much of the last-level cache a process has is not its size: on a host of the same name that shared
# it, 16 MiB copies ran at 11.6 GB/s against 74.1 at 4 MiB, and dense batches of 64 rows (16 MB) came
# 2.02x faster streamed (benchmarks/results/loader_stream_b64.json). So batches of at least
# `STREAM_MIN_BYTES` (32 MiB) are always streamed, and smaller ones down to `STREAM_PROBE_MIN_BYTES`
# where `cache_reach` finds that a pair of buffers of their size no longer stays in the cache this
# process has. x86-64 only (`STREAMING`), whose ``sfence`` orders the stores before the batch is
# handed on; elsewhere rows are written in place.

STREAMING = platform.machine().lower() in ("x86_64", "amd64")
STREAM_MIN_BYTES = 32 << 20
STREAM_PROBE_MIN_BYTES = 4 << 20
STREAM_ENV = "OMICSIO_JAX_STREAM_MIN_BYTES"  # a fixed threshold instead of the measured one
_LINE = 64
_scratch = threading.local()
_PROBE_ROUNDS = 7


class _Reach:
    """`cache_reach`'s answer for this process: measured once, on a thread of its own started by the
    first output that asks."""

    def __init__(self) -> None:
        self.value: int | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def get(self, *, wait: bool) -> int | None:
        """The answer, or None while it is being measured (``wait``: wait for it)."""
        if self.value is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._measure, name="omicsio-cache-reach", daemon=True
                    )
                    self._thread.start()
            if wait:
                self._thread.join()
        return self.value

    def _measure(self) -> None:
        self.value = cache_reach()


_REACH = _Reach()


def _fixed_threshold() -> int | None:
    """``$OMICSIO_JAX_STREAM_MIN_BYTES``, if set."""
    fixed = os.environ.get(STREAM_ENV)
    return int(fixed) if fixed else None


def stream_threshold(*, wait: bool = False) -> int:
    """The smallest output whose rows are streamed: ``$OMICSIO_JAX_STREAM_MIN_BYTES`` if set, else
    `cache_reach`, at most `STREAM_MIN_BYTES`. `cache_reach` runs once per process, on a thread of
    its own started when an output first asks: until it answers (``wait``: wait for it), outputs of
    `STREAM_MIN_BYTES` and more are streamed, so a loader's first batch does not wait for it."""
    fixed = _fixed_threshold()
    return _measured_threshold(wait=wait) if fixed is None else fixed


def _measured_threshold(*, wait: bool) -> int:
    """`cache_reach`'s answer, at most `STREAM_MIN_BYTES`; `STREAM_MIN_BYTES` until it answers."""
    reach = _REACH.get(wait=wait)
    return STREAM_MIN_BYTES if reach is None else min(reach, STREAM_MIN_BYTES)


def cache_reach() -> int:
    """The smallest output to stream on this host, from how fast pairs of buffers are filled one after
    the other, as a loader's two outputs are (`threshold_from_rates`): pairs of 1 MiB,
    `STREAM_PROBE_MIN_BYTES` and each power of two up to half `STREAM_MIN_BYTES`, each pair's median
    of `_PROBE_ROUNDS` fills in a row (sizes taken in turn give nothing: the lines a larger pair
    leaves to be written back slow the next pair's fills), in one buffer faulted in first."""
    sizes = [1 << 20]
    while sizes[-1] < STREAM_MIN_BYTES // 2:
        sizes.append(max(sizes[-1] * 2, STREAM_PROBE_MIN_BYTES))
    memory = np.ones(2 * sizes[-1], np.uint8)
    rates = {}
    for size in sizes:  # each pair filled again and again, as a loader's outputs are: its steady rate
        pair, times = (memory[:size], memory[size : 2 * size]), []
        for _ in range(_PROBE_ROUNDS + 1):  # the first fill only brings the pair in
            start = time.perf_counter()
            for buf in pair:
                buf.fill(0)
            times.append(time.perf_counter() - start)
        rates[size] = 2 * size / max(float(np.median(times[1:])), 1e-9)
    return threshold_from_rates(rates)


def threshold_from_rates(rates: dict[int, float]) -> int:
    """`cache_reach`'s choice from its fill rates by size: outputs larger than the last size filled at
    half the rate of the fastest smaller one or more, before the first one filled at less, are
    streamed (at least `STREAM_PROBE_MIN_BYTES`); if no size is filled at less, outputs of
    `STREAM_MIN_BYTES` and more. (The fastest smaller size, not the smallest: a call's own cost
    weighs on a pair of 1 MiB.)"""
    sizes = sorted(rates)
    fastest, fast = rates[sizes[0]], sizes[0]
    for size in sizes[1:]:
        if rates[size] < fastest / 2:
            return max(fast + 1, STREAM_PROBE_MIN_BYTES)
        fastest, fast = max(fastest, rates[size]), size
    return STREAM_MIN_BYTES


def streamed(out: np.ndarray) -> bool:
    """Whether ``out``'s rows are to be streamed around the caches: `STREAMING`, ``out`` C-contiguous
    with its items aligned (`stream_row` writes whole lines) and of at least `stream_threshold`
    (measured only for an output between `STREAM_PROBE_MIN_BYTES` and `STREAM_MIN_BYTES`)."""
    if not (STREAMING and out.flags.c_contiguous and out.flags.aligned):
        return False
    if out.nbytes >= STREAM_MIN_BYTES:
        return True
    fixed = _fixed_threshold()
    if fixed is not None:
        return out.nbytes >= fixed
    return out.nbytes >= STREAM_PROBE_MIN_BYTES and out.nbytes >= _measured_threshold(wait=False)


def rows_scratch(out: np.ndarray, threads: int | None = None) -> np.ndarray:
    """What a row kernel writing ``out`` builds its rows in, one row per numba thread (default:
    `numba.get_num_threads`): float32 zeros at least as wide as ``out`` if its rows are to be
    streamed (`streamed`), kept per Python thread (a kernel
    must leave them zero), else rows of no columns (written in place)."""
    threads = nb.get_num_threads() if threads is None else threads
    if not streamed(out):
        return np.zeros((threads, 0), np.float32)
    width = out.shape[1]
    kept = getattr(_scratch, "rows", None)
    if kept is None or kept.shape[0] < threads or kept.shape[1] < width:
        padded = -(-max(width, 1) // (_LINE // 4)) * (_LINE // 4)  # whole cache lines per row
        kept = aligned_empty((threads, padded), np.float32)
        kept[:] = 0.0
        _scratch.rows = kept
    return kept[:threads]


@intrinsic
def _stream_line(typingctx, dst, dst_index, src, src_index):
    """Store the 64 bytes of ``src`` from item ``src_index`` at ``dst`` from item ``dst_index`` (a
    64-byte aligned address) with a non-temporal hint: one whole cache line, written to memory
    without being fetched first."""
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array) and dst.dtype == src.dtype):
        return None

    def codegen(context, builder, signature, args):
        d = context.make_array(signature.args[0])(context, builder, args[0]).data
        s = context.make_array(signature.args[2])(context, builder, args[2]).data
        item = context.get_data_type(signature.args[0].dtype)
        line = ir.VectorType(item, _LINE // context.get_abi_sizeof(item))
        value = builder.load(builder.bitcast(builder.gep(s, [args[3]]), line.as_pointer()), align=1)
        store = builder.store(
            value, builder.bitcast(builder.gep(d, [args[1]]), line.as_pointer()), align=_LINE
        )
        if STREAMING:
            store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return types.void(dst, dst_index, src, src_index), codegen


@intrinsic
def _address(typingctx, array):
    """The address of ``array``'s first element."""
    if not isinstance(array, types.Array):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, ir.IntType(64))

    return types.uint64(array), codegen


@intrinsic
def store_fence(typingctx):
    """x86's ``sfence``: this thread's non-temporal stores are done before any store after it (a
    kernel's last step, before its output is handed to another thread); nothing elsewhere."""

    def codegen(context, builder, signature, args):
        if STREAMING:
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse.sfence"
            )
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@nb.njit(inline="always")
def stream_row(dst, src):
    """``dst[:] = src[: len(dst)]`` (rows of one dtype, its items a power of two bytes long, ``dst``
    aligned to them), the whole cache lines of ``dst`` with non-temporal stores (`STREAMING`; plain
    stores elsewhere). Follow a kernel's streamed rows with `store_fence`."""
    width, size = dst.shape[0], dst.itemsize
    lead = (_LINE - (_address(dst) & np.uint64(_LINE - 1))) & np.uint64(_LINE - 1)
    head = min(np.int64(lead) // size, width)
    for k in range(head):
        dst[k] = src[k]
    k, step = head, _LINE // size
    while k + step <= width:
        _stream_line(dst, k, src, k)
        k += step
    for j in range(k, width):
        dst[j] = src[j]


@nb.njit(inline="always")
def row_to_write(out, i, scratch, t):
    """The row a kernel writes row ``i`` of ``out`` in, on part ``t``: its part's ``scratch`` row
    (zeros) when rows are streamed (`rows_scratch`), else ``out[i]`` itself, zeroed."""
    if scratch.shape[1] > 0:
        return scratch[t, : out.shape[1]]
    row = out[i]
    row[:] = 0.0
    return row


@nb.njit(inline="always")
def row_written(out, i, row, scratch):
    """Row ``i`` done: streamed out of ``row`` when rows are streamed (True: zero ``row`` again
    where it was written), else nothing to do (False)."""
    if scratch.shape[1] > 0:
        stream_row(out[i], row)
        return True
    return False

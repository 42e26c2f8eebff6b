"""The token outputs' random draws: ``uniform(cell_key(seed, epoch, row), stream, i)``, splitmix64 of a
counter, so a cell's tokens depend only on ``(seed, epoch, global row)``, never on its batch or
worker; `uniforms` is the same function in plain Python, for references and tests."""

from __future__ import annotations

import numba as nb
import numpy as np

# random streams (the counter's high bits): one per kind of choice
STREAM_SUBSAMPLE, STREAM_TIES, STREAM_MASK, STREAM_MASK_KIND, STREAM_RANDOM_TOKEN = 1, 2, 3, 4, 5

_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1


@nb.njit(inline="always")
def _mix(z):
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


@nb.njit(inline="always")
def cell_key(seed, epoch, row):
    """The key of one cell's draws: splitmix64 chained over ``seed``, ``epoch`` and ``row``."""
    golden = np.uint64(_GOLDEN)
    z = _mix(np.uint64(seed) + golden)
    z = _mix(z ^ (np.uint64(epoch) + golden))
    return _mix(z ^ (np.uint64(row) + golden))


@nb.njit(inline="always")
def uniform(key, stream, i):
    """Draw ``i`` of ``stream`` for the cell ``key``: a float64 in [0, 1) with 53 random bits."""
    counter = (np.uint64(stream) << np.uint64(40)) + np.uint64(i) + np.uint64(1)
    return np.float64(_mix(key + counter * np.uint64(_GOLDEN)) >> np.uint64(11)) * (1.0 / 9007199254740992.0)


GAP_BLOCK = 32  # `selected_positions` makes its draws this many at a time


@nb.njit(inline="always")
def draws_at(key, stream, index, n, out):
    """``out[q] = uniform(key, stream, index[q])`` for ``q < n``, in a loop of its own: its 64-bit
    arithmetic vectorizes (several times the draws per second of one made beside other work)."""
    for q in range(n):
        out[q] = uniform(key, stream, index[q])


@nb.njit(inline="always")
def draws_from(key, stream, start, n, out):
    """``out[q] = uniform(key, stream, start + q)`` for ``q < n`` (vectorized, as `draws_at`)."""
    for q in range(n):
        out[q] = uniform(key, stream, start + q)


@nb.njit(inline="always")
def selected_positions(key, first, end, log_keep, positions, u):
    """The positions of ``[first, end)`` selected each with probability p (``log_keep =
    log1p(-p)``) written to ``positions``; returns how many. A Geometric(p) gap of positions
    skipped per draw of `STREAM_MASK` (draw ``d`` after the ``d``-th selected position): the same
    law as one Bernoulli(p) per position, with ~p·n draws instead of n. The draws are made
    `GAP_BLOCK` at a time into ``u`` (`draws_from`), the gaps' serial walk then reads them."""
    m = 0
    p = np.int64(first) - 1
    start = 0
    while True:
        draws_from(key, STREAM_MASK, start, GAP_BLOCK, u)
        for b in range(GAP_BLOCK):
            gap = np.log(max(u[b], 1.0 / 9007199254740992.0)) / log_keep
            p += 1 + np.int64(min(gap, 4.0e18))
            if p >= end:
                return m
            positions[m] = p
            m += 1
        start += GAP_BLOCK


def _mix_py(z: int) -> int:
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def uniforms(seed: int, epoch: int, row: int, stream: int, count: int) -> np.ndarray:
    """Draws ``0..count-1`` of ``stream`` for one cell, in plain Python integers (a reference)."""
    seed, epoch, row, stream, count = int(seed), int(epoch), int(row), int(stream), int(count)
    g = _GOLDEN
    z = _mix_py((seed + g) & _MASK64)
    z = _mix_py(z ^ ((epoch + g) & _MASK64))
    key = _mix_py(z ^ ((row + g) & _MASK64))
    out = np.empty(count, np.float64)
    for i in range(count):
        counter = ((stream << 40) + i + 1) & _MASK64
        out[i] = (_mix_py((key + counter * g) & _MASK64) >> 11) * (1.0 / 9007199254740992.0)
    return out

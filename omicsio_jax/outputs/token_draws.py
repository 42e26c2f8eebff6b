"""The token outputs' random draws: ``uniform(cell_key(seed, epoch, row), stream, i)``, splitmix64 of a
counter, so a cell's tokens depend only on ``(seed, epoch, global row)``, never on its batch or
worker; `uniforms` is the same function in plain Python, for references and tests."""

from __future__ import annotations

import numba as nb
import numpy as np

from omicsio_jax.core.kernels import mix64

# random streams (the counter's high bits): one per kind of choice
STREAM_SUBSAMPLE, STREAM_TIES, STREAM_MASK, STREAM_MASK_KIND, STREAM_RANDOM_TOKEN = 1, 2, 3, 4, 5

_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1
_STEP = 1.0 / 9007199254740992.0  # 2**-53: a draw's 53 random bits as a float in [0, 1)


@nb.njit(inline="always")
def cell_key(seed, epoch, row):
    """The key of one cell's draws: splitmix64 chained over ``seed``, ``epoch`` and ``row``."""
    golden = np.uint64(_GOLDEN)
    z = mix64(np.uint64(seed) + golden)
    z = mix64(z ^ (np.uint64(epoch) + golden))
    return mix64(z ^ (np.uint64(row) + golden))


@nb.njit(inline="always")
def uniform(key, stream, i):
    """Draw ``i`` of ``stream`` for the cell ``key``: a float64 in [0, 1) with 53 random bits."""
    counter = (np.uint64(stream) << np.uint64(40)) + np.uint64(i) + np.uint64(1)
    return np.float64(mix64(key + counter * np.uint64(_GOLDEN)) >> np.uint64(11)) * _STEP


GAP_BLOCK = 32  # `selected_positions` makes its draws this many at a time (its ``u`` holds 3 times this)


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


_SQRT2 = 1.4142135623730951
_LN2 = 0.6931471805599453
_MANTISSA = 0x000FFFFFFFFFFFFF
_ONE = 0x3FF0000000000000  # the bits of 1.0
# `_series` is within 2.1e-9 of the log relatively (the first term it leaves out, 2·s**11/11, against
# 2·s, with s**2 <= 0.0295), the gap's product by 1/log_keep within 3e-16 of the quotient: a gap within
# this share of itself from a whole number is taken again with libm's log and a division
_NEAR = 1e-7
_SMALLEST_BITS = 0x3CA0000000000000  # the bits of `_STEP`, the smallest draw but 0, which stands in for 0


@nb.njit(inline="always")
def _series(m, e):
    """``log(m·2**e)`` for ``m`` in [1, 2): ``m`` brought to [√½, √2), ``log m = 2·atanh(s)``, ``s = (m -
    1)/(m + 1)``, by its series to ``s**9`` (within 2.1e-9 of the log relatively: the gaps need no
    more). Without a branch and dividing by ``np.divide`` (``/`` tests for a zero divisor), so that a
    loop over it vectorizes."""
    big = np.float64(m > _SQRT2)
    m = m * (1.0 - 0.5 * big)
    s = np.divide(m - 1.0, m + 1.0)
    z = s * s
    t = 1.0 / 7 + z * (1.0 / 9)
    t = 1.0 / 5 + z * t
    t = 1.0 / 3 + z * t
    t = 1.0 + z * t
    return (e + big) * _LN2 + 2.0 * s * t


@nb.njit(inline="always")
def gaps(u, log_keep):
    """``u[GAP_BLOCK + b] = log(max(u[b], 2**-53)) / log_keep`` for ``b < GAP_BLOCK`` (``u``: ``3 *
    GAP_BLOCK`` float64, the last third scratch), up to an error that never moves a quotient's integer
    part: the gaps `selected_positions` walks are exactly those of libm's log and a division. numba's
    ``np.log`` is a call of libm's per value; `_series` in a loop over the block vectorizes instead
    (each draw split into exponent and mantissa through its bits). Should a quotient lie so near a
    whole number that the error could move its integer part (about one draw in a million), or be NaN,
    the block is taken again with libm's log and a division."""
    bits = u.view(np.uint64)
    q, e = u[GAP_BLOCK : 2 * GAP_BLOCK], u[2 * GAP_BLOCK : 3 * GAP_BLOCK]
    for b in range(GAP_BLOCK):  # mantissas (as 1.m) into q, exponents into e
        x = max(bits[b], np.uint64(_SMALLEST_BITS))  # a positive float's bits rise with it
        bits[GAP_BLOCK + b] = (x & np.uint64(_MANTISSA)) | np.uint64(_ONE)
        e[b] = np.float64(np.int64(x >> np.uint64(52)) - 1023)
    inverse = np.divide(1.0, log_keep)
    near = False
    for b in range(GAP_BLOCK):
        x = _series(q[b], e[b]) * inverse
        q[b] = x
        frac = x - np.floor(x)
        tol = _NEAR * x
        near |= not ((frac > tol) & (frac < 1.0 - tol))
    if near:
        for b in range(GAP_BLOCK):
            q[b] = np.log(max(u[b], _STEP)) / log_keep


@nb.njit(inline="always")
def selected_positions(key, first, end, log_keep, positions, u):
    """The positions of ``[first, end)`` selected each with probability p (``log_keep =
    log1p(-p)``) written to ``positions``; returns how many. A Geometric(p) gap of positions
    skipped per draw of `STREAM_MASK` (draw ``d`` after the ``d``-th selected position): the same
    law as one Bernoulli(p) per position, with ~p·n draws instead of n. The draws are made
    `GAP_BLOCK` at a time, turned into gaps (`gaps`; ``u``: ``3 * GAP_BLOCK`` float64 of scratch), which
    the serial walk then reads."""
    m = 0
    p = np.int64(first) - 1
    start = 0
    q = u[GAP_BLOCK : 2 * GAP_BLOCK]
    while True:
        draws_from(key, STREAM_MASK, start, GAP_BLOCK, u)
        gaps(u, log_keep)
        for b in range(GAP_BLOCK):
            p += 1 + np.int64(min(q[b], 4.0e18))
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
        out[i] = (_mix_py((key + counter * g) & _MASK64) >> 11) * _STEP
    return out

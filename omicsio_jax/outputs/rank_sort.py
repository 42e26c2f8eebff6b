"""Stable sorts of a cell's uint32 keys carrying a value each (numba, inlined into the token kernels):
a bucket pass on the keys' top bits finished by insertion, or LSD passes on every bit; with a
``limit``, a partial selection of the first keys. `order_bits` makes float32 values such keys."""

from __future__ import annotations

import numba as nb
import numpy as np

BUCKET_BITS = 11  # the bucket pass scatters keys on at most this many top bits of their span
INSERTION_BUDGET = 4  # insertion moves per key allowed to finish the order, before passes on every bit


@nb.njit(inline="always")
def _bucket(k, base, shift):
    """``(k - base) >> shift`` as an unsigned index: numba makes a signed index wrap around from
    the array's end, a test in every use (in the sort's inner loops, ~10% of Geneformer's kernel)."""
    return np.uint64(np.int64(k) - base) >> np.uint64(shift)


@nb.njit(inline="always")
def _scatter(src_k, src_v, dst_k, dst_v, n, counts, base, shift, digit):
    """One stable counting pass: ``src`` into ``dst`` ordered by the digit
    ``((key - base) >> shift) & digit``, whose histogram ``counts`` holds (turned into offsets)."""
    total = 0
    for d in range(digit + 1):
        c = counts[d]
        counts[d] = total
        total += c
    for i in range(n):
        k = src_k[i]
        d = _bucket(k, base, shift) & np.uint64(digit)
        j = counts[d]
        counts[d] = j + 1
        dst_k[np.uint32(j)] = k
        dst_v[np.uint32(j)] = src_v[i]


@nb.njit(inline="always")
def _copy(src_k, src_v, dst_k, dst_v, n):
    """``dst[:n] = src[:n]`` element by element: a slice copy checks for overlap and may allocate."""
    for i in range(n):
        dst_k[i] = src_k[i]
        dst_v[i] = src_v[i]


@nb.njit(inline="always")
def _lsd_passes(keys, vals, n, tmp_keys, tmp_vals, hist, kmin, bits):
    """Stable LSD passes on the ``bits`` low bits of ``key - kmin``: as few passes as they need (at
    most 3 of 11 bits), each digit as narrow as the passes allow (26 bits: 3 passes of 512 buckets)."""
    passes = (bits + 10) // 11
    width = (bits + passes - 1) // passes
    digit = (1 << width) - 1
    base = np.int64(kmin)
    for p in range(passes):
        for d in range(digit + 1):
            hist[p, d] = 0
    for i in range(n):  # every pass's histogram in one read of the keys
        k = np.int64(keys[i]) - base
        for p in range(passes):
            hist[p, (k >> (width * p)) & digit] += 1
    src_k, src_v, dst_k, dst_v = keys, vals, tmp_keys, tmp_vals
    for p in range(passes):
        _scatter(src_k, src_v, dst_k, dst_v, n, hist[p], base, width * p, digit)
        src_k, dst_k = dst_k, src_k
        src_v, dst_v = dst_v, src_v
    if passes % 2:
        _copy(src_k, src_v, keys, vals, n)


@nb.njit(inline="always")
def finish_by_insertion(keys, vals, n, budget):
    """Stable insertion sort of keys nearly in order; stops between two keys once it has moved
    ``budget`` of them, leaving a stable permutation, and says whether it finished."""
    moves = 0
    for j in range(1, n):
        k = keys[j]
        if keys[j - 1] <= k:
            continue
        if moves > budget:
            return False
        v = vals[j]
        m = j - 1
        while m >= 0 and keys[m] > k:
            keys[m + 1] = keys[m]
            vals[m + 1] = vals[m]
            m -= 1
        keys[m + 1] = k
        vals[m + 1] = v
        moves += j - 1 - m
    return True


@nb.njit(inline="always")
def _scatter_first(src_k, src_v, dst_k, dst_v, n, counts, base, shift, cut):
    """`_scatter` of the keys in buckets ``0..cut`` only, in place of the whole: the others all land
    on one spare slot past them (no branch). ``counts`` needs a spare bucket ``cut + 1``. Returns
    how many keys it placed."""
    total = 0
    for d in range(cut + 1):
        c = counts[d]
        counts[d] = total
        total += c
    counts[cut + 1] = total
    spare = np.uint64(cut + 1)
    for i in range(n):
        k = src_k[i]
        d = min(_bucket(k, base, shift), spare)
        j = counts[d]
        counts[d] = j + (d < spare)
        dst_k[np.uint32(j)] = k
        dst_v[np.uint32(j)] = src_v[i]
    return total


@nb.njit(inline="always")
def _span_bits(kmin, kmax):
    """The bits of ``kmax - kmin`` (0 when they are equal): what the sorts' passes work on."""
    span = np.int64(kmax) - np.int64(kmin)
    bits = 0
    while bits < 32 and (span >> bits) != 0:
        bits += 1
    return bits


@nb.njit(inline="always")
def sort_into(keys, vals, n, kmin, kmax, out_keys, out_vals, hist, limit):
    """Stable sort of ``keys[:n]`` (uint32 between ``kmin`` and ``kmax``, ascending) carrying
    ``vals``, into ``out_*`` where it says True, else in place (``keys`` and ``vals``; ``hist``: at
    least ``(3, 2048)`` int32 of scratch); only the first ``limit`` positions are sure to be in
    order (``limit >= n``: all of them). One stable scatter into buckets of the top `BUCKET_BITS`
    of the keys' span (``key - kmin``) leaves out of order only keys of one bucket (rare unless
    equal, and equal keys need no move); a stable insertion pass finishes. With ``limit < n``, the
    buckets past the one where the ``limit``-th key falls are left out of both (a partial
    selection: the genes ranked past a sequence's end cost a histogram count, not a sort). Keys
    that crowd one bucket (more than `INSERTION_BUDGET` moves per key) get LSD passes on every bit
    instead. Copies go element by element (`_copy`): numba's slice copies check for overlap and
    may allocate."""
    bits = _span_bits(kmin, kmax)
    if n < 2 or bits == 0:
        return False  # all keys equal: already in order
    width = min(bits, BUCKET_BITS)
    shift = bits - width
    base = np.int64(kmin)
    counts = hist[0]
    for d in range(1 << width):
        counts[d] = 0
    for i in range(n):
        counts[_bucket(keys[i], base, shift)] += 1
    cut = (1 << width) - 1
    if limit < n:  # the bucket of the limit-th key
        seen = 0
        for d in range(1 << width):
            seen += counts[d]
            if seen >= limit:
                cut = d
                break
    if cut < (1 << width) - 1:
        placed = _scatter_first(keys, vals, out_keys, out_vals, n, counts, base, shift, cut)
    else:
        _scatter(keys, vals, out_keys, out_vals, n, counts, base, shift, (1 << width) - 1)
        placed = n
    if not shift or finish_by_insertion(out_keys, out_vals, placed, INSERTION_BUDGET * placed):
        return True
    # the scatters only read the keys: passes on every bit sort them as they came, stably
    _lsd_passes(keys, vals, n, out_keys, out_vals, hist, kmin, bits)
    return False


@nb.njit(inline="always")
def rank_sort(keys, vals, n, kmin, kmax, out_keys, out_vals, hist, limit, distinct):
    """`sort_into`, or with ``distinct`` (keys seldom equal: a median of its own per gene) and a
    whole sort of keys wider than one bucket pass, `_lsd_passes` on every bit straight away (in
    place: returns False). Distinct keys crowd the bucket pass's buckets wherever the bulk of a
    cell's keys sits in a small part of their span, and its insertion pass then moves keys at
    unpredictable branches; equal keys (the corpus medians, bin centres shared by many genes) need
    no move, and there the bucket pass is the faster. Either way the same stable order."""
    bits = _span_bits(kmin, kmax)
    if distinct and n >= 2 and limit >= n and bits > BUCKET_BITS:
        _lsd_passes(keys, vals, n, out_keys, out_vals, hist, kmin, bits)
        return False
    return sort_into(keys, vals, n, kmin, kmax, out_keys, out_vals, hist, limit)


@nb.njit(inline="always")
def radix_sort(keys, vals, n, tmp_keys, tmp_vals, hist):
    """Stable sort of ``keys[:n]`` (uint32, ascending) carrying ``vals``, in place (`sort_into`,
    with ``tmp_*`` as its scratch)."""
    if n < 2:
        return
    kmin, kmax = keys[0], keys[0]
    for i in range(1, n):
        kmin, kmax = min(kmin, keys[i]), max(kmax, keys[i])
    if sort_into(keys, vals, n, kmin, kmax, tmp_keys, tmp_vals, hist, n):
        _copy(tmp_keys, tmp_vals, keys, vals, n)


@nb.njit(inline="always")
def order_bits(v):
    """uint32 whose unsigned order is the float32 order of ``v`` (negatives included)."""
    b = np.uint32(np.float32(v).view(np.uint32))
    if b & np.uint32(0x80000000):
        return ~b
    return b | np.uint32(0x80000000)

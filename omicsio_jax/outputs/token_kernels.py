"""Token batches for single-cell foundation models, computed from the encoded records by numba.

Two algorithms, exactly as the token specification (``docs/tokens.md``, from the published code) states
them; one pass per cell from its record (decode → keep → order → write), no dense intermediate:

- **Geneformer** (rank-value encoding): keep the genes with a token and a known median, rank them
  by ``count · (1 / median)`` (float32, descending; ties by ascending gene column), take the top
  ``L − 2`` (``L`` without special tokens), write ``[CLS] … [EOS]`` then PAD; MLM as Hugging
  Face's collator (15%: 80% MASK, 10% a random gene token, 10% unchanged).
- **scGPT** (binned values): bin every kept nonzero of the cell on its own quantile edges
  (``np.quantile`` linear, ``n_bins − 1`` edges) — ``"tahoe"`` deterministic, ``"scgpt"`` ties
  spread by a uniform draw — then sample ``L − 1`` of them without replacement when there are
  more, CLS first; mask Bernoulli(p) or exactly ``floor(m·p)`` positions.

Every random draw is ``uniform(cell_key(seed, epoch, row), stream, i)``: splitmix64 of a counter,
so a cell's tokens depend only on ``(seed, epoch, global row)``, never on its batch or worker.
`uniforms` is the same function in numpy, for references and tests.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from omicsio_jax.format import codec

PAD, CLS, EOC = 0, 1, 2  # Tahoe-100M's special tokens (EOC doubles as Geneformer V2's EOS)
IGNORE_INDEX = -100  # labels at positions that are not predicted (Hugging Face's convention)
PAD_VALUE = -2.0  # scGPT's value at CLS and padding positions
MASK_VALUE = -1.0  # scGPT's input value at masked positions

SMALL_COUNT = 255  # scGPT: cells whose kept values are all integers up to this are tallied, not sorted
_TALLY = SMALL_COUNT + 1

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
def _order_bits(v):
    """uint32 whose unsigned order is the float32 order of ``v`` (negatives included)."""
    b = np.uint32(np.float32(v).view(np.uint32))
    if b & np.uint32(0x80000000):
        return ~b
    return b | np.uint32(0x80000000)


@nb.njit(inline="always")
def _descending_key(v, im):
    """uint32 whose ascending order is the descending order of ``v · im`` (float32, non-negative)."""
    return ~np.uint32(np.float32(v * im).view(np.uint32))


_KEY_POSITIVE_MIN = np.uint32(0x807FFFFF)  # `_descending_key` of +inf
_KEY_POSITIVE_MAX = np.uint32(0xFFFFFFFE)  # `_descending_key` of the smallest positive float32


@nb.njit(inline="always")
def _max_count(u32, starts):
    m = 0
    for i in range(starts.shape[0]):
        m = max(m, np.int64(u32[starts[i] // 4 + 1]))
    return m


@nb.njit(inline="always")
def _sum_duplicates(cols, vals, count, canon, slot):
    """Entries of columns sharing an Ensembl id summed into the first such column (``canon``), in
    ascending column order again; ``slot`` (one -1 per column) is left as it was found."""
    n = 0
    for j in range(count):
        c = canon[cols[j]]
        s = slot[c]
        if s >= 0:
            vals[s] += vals[j]
        else:
            slot[c] = n
            cols[n] = c
            vals[n] = vals[j]
            n += 1
    for j in range(n):
        slot[cols[j]] = -1
    finish_by_insertion(cols, vals, n, n * n)  # only entries moved to a smaller column are out of place
    return n


# Each token kernel is a one-line ``prange`` over threads calling a plain function with a thread's
# rows (``_*_rows``): numba's parallel passes then see one call, not the whole body, and compile in
# a fraction of the time. ``np.int64(t)``: prange's index is unsigned in the parallel lowering, and
# the row function would otherwise be compiled a second time for it.


@nb.njit(parallel=True, nogil=True, cache=True)
def geneformer_kernel(threads, *args):
    """The rows of a batch on ``threads`` threads; ``args``: `_geneformer_rows`'s after ``t, threads``."""
    for t in nb.prange(threads):
        _geneformer_rows(np.int64(t), threads, *args)


@nb.njit(nogil=True, cache=True)
def _geneformer_rows(
    t,
    threads,
    u8,
    u32,
    f32,
    starts,
    rows,
    seed,
    epoch,
    gene,
    gene_scale,
    distinct,
    canon,
    has_dups,
    gene_tokens,
    special,
    mask_prob,
    pad_id,
    cls_id,
    eos_id,
    mask_id,
    input_ids,
    attention_mask,
    labels,
    length,
):
    """Rows ``t, t + threads, …`` of a batch (`geneformer_kernel`). ``gene[g]``: column ``g``'s scale
    (float32 bits: ``1 / median_g`` for a column with a token and a median, else 0, not kept) and
    token side by side, one cache line for both (``gene_scale``: the same memory as float32);
    ``distinct``: the scales are mostly distinct, so a cell's keys seldom tie (`rank_sort`)."""
    width = max(_max_count(u32, starts), 1)
    n_rows, L = input_ids.shape
    log_keep = np.log1p(-mask_prob)
    n_genes = gene_tokens.shape[0]
    first = 1 if special else 0
    cols = np.empty(width, np.int32)
    vals = np.empty(width, np.float32)
    keys = np.empty(width, np.uint32)
    kept_tok = np.empty(width, np.int32)
    sorted_keys = np.empty(width, np.uint32)
    sorted_tok = np.empty(width, np.int32)
    hist = np.empty((3, 2048), np.int32)
    masked = np.empty(L, np.int64)
    u_kind = np.empty(max(L, GAP_BLOCK), np.float64)
    u_token = np.empty(L, np.float64)
    slot = np.full(canon.shape[0] if has_dups else 1, -1, np.int32)
    for i in range(t, n_rows, threads):
        ids, att, lab = input_ids[i], attention_mask[i], labels[i]
        lab[:] = IGNORE_INDEX
        if rows[i] < 0:  # a padding row of the batch: all PAD, nothing attended
            ids[:] = pad_id
            att[:] = False
            length[i] = 0
            continue
        count = codec.decode_one(u8, u32, f32, starts[i], cols, vals, 0)
        if has_dups:
            count = _sum_duplicates(cols, vals, count, canon, slot)
        # every entry's descending key and token (the sort carries tokens, so no gather after it),
        # in a loop without a keep test, then the keys' range for the sort in a loop of its own
        # (vectorized); a cell with an entry not kept (no token or median, or a stored 0) is then
        # compacted to the kept ones
        for j in range(count):
            g = np.uint32(cols[j])  # unsigned: no test for wrapping around (`_bucket`)
            keys[j] = _descending_key(vals[j], gene_scale[g, 0])
            kept_tok[j] = gene[g, 1]
        kmin, kmax = np.uint32(0xFFFFFFFF), np.uint32(0)
        for j in range(count):
            kmin, kmax = min(kmin, keys[j]), max(kmax, keys[j])
        # every product > 0 (keys of positive floats, not 0 nor NaN) means every entry is kept (a
        # scale is >= 0); otherwise the exact test below decides (a product may underflow to 0)
        all_kept = (kmin >= _KEY_POSITIVE_MIN) & (kmax <= _KEY_POSITIVE_MAX)
        kept = count
        if not all_kept:  # compacted in place to the kept ones (advanced over without a branch)
            kept = 0
            kmin, kmax = np.uint32(0xFFFFFFFF), np.uint32(0)
            for j in range(count):
                key = keys[j]
                keys[kept], kept_tok[kept] = key, kept_tok[j]
                keep = (gene_scale[np.uint32(cols[j]), 0] > 0) & (vals[j] > 0)
                kmin = min(kmin, key) if keep else kmin
                kmax = max(kmax, key) if keep else kmax
                kept += keep
        ranked = kept_tok
        if rank_sort(
            keys, kept_tok, kept, kmin, kmax, sorted_keys, sorted_tok, hist, L - 2 * first, distinct
        ):
            ranked = sorted_tok
        k = min(kept, L - 2 * first)
        end = k + 2 * first
        if special:
            ids[0] = cls_id
        for r in range(k):
            ids[first + r] = ranked[r]
        if special:
            ids[first + k] = eos_id
        ids[end:] = pad_id
        att[:end] = True
        att[end:] = False
        length[i] = k
        if mask_prob <= 0:
            continue
        # the masked positions first (they depend on no token), then the draws of their
        # replacements (vectorized), then the replacements in a loop of independent iterations
        key = cell_key(seed, epoch, rows[i])
        m = selected_positions(key, first, first + k, log_keep, masked, u_kind)
        draws_at(key, STREAM_MASK_KIND, masked, m, u_kind)
        draws_at(key, STREAM_RANDOM_TOKEN, masked, m, u_token)
        for q in range(m):
            # the replacement chosen without a branch (80% MASK, 10% a random gene, 10% kept):
            # the random gene's draw is made either way, and a draw is a pure function of its
            # counter, so the tokens are those of drawing it only when used; the gene table is
            # read at that gene only when it is used, else at 0 (a cache line already at hand,
            # not a miss in a table of every gene)
            p = masked[q]
            token = ids[p]
            lab[p] = token
            u = u_kind[q]
            used = (u >= 0.8) & (u < 0.9)
            random_token = gene_tokens[min(np.int64(u_token[q] * n_genes), n_genes - 1) if used else 0]
            ids[p] = mask_id if u < 0.8 else (random_token if u < 0.9 else token)


@nb.njit(inline="always")
def _interval(edges, v):
    """(edges < v, edges <= v) counted by binary search: ``digitize(v, edges, right=True)`` and
    ``digitize(v, edges)`` for increasing edges."""
    lo, hi = 0, edges.shape[0]
    while lo < hi:
        mid = (lo + hi) >> 1
        if edges[mid] < v:
            lo = mid + 1
        else:
            hi = mid
    below = lo
    hi = edges.shape[0]
    while lo < hi:
        mid = (lo + hi) >> 1
        if edges[mid] <= v:
            lo = mid + 1
        else:
            hi = mid
    return below, lo


@nb.njit(inline="always")
def _pad_scgpt(gene_ids, values, masked_values, pad_mask, i, start, pad_id):
    """Positions ``start:`` of row ``i`` are padding (each written once per row, not filled then overwritten)."""
    gene_ids[i, start:] = pad_id
    values[i, start:] = PAD_VALUE
    masked_values[i, start:] = PAD_VALUE
    pad_mask[i, start:] = True


@nb.njit(parallel=True, nogil=True, cache=True)
def scgpt_kernel(threads, *args):
    """The rows of a batch on ``threads`` threads (as `geneformer_kernel`); ``args``: `_scgpt_rows`'s
    after ``t, threads``."""
    for t in nb.prange(threads):
        _scgpt_rows(np.int64(t), threads, *args)


@nb.njit(nogil=True, cache=True)
def _scgpt_rows(
    t,
    threads,
    u8,
    u32,
    f32,
    starts,
    rows,
    seed,
    epoch,
    tok,
    canon,
    has_dups,
    quantiles,
    spread_ties,
    mask_prob,
    exact_mask,
    pad_id,
    cls_id,
    gene_ids,
    values,
    masked_values,
    mask,
    pad_mask,
):
    """Rows ``t, t + threads, …`` of a batch (`scgpt_kernel`)."""
    width = max(_max_count(u32, starts), 1)
    n_rows, L = gene_ids.shape
    n_edges = quantiles.shape[0]
    log_keep = np.log1p(-mask_prob) if mask_prob < 1 else -np.inf
    cols = np.empty(width, np.int32)
    vals = np.empty(width, np.float32)
    kept_tok = np.empty(width, np.int32)
    kept_vals = np.empty(width, np.float32)
    keys = np.empty(width, np.uint32)
    order = np.empty(width, np.int32)
    tmp_keys = np.empty(width, np.uint32)
    tmp_order = np.empty(width, np.int32)
    pick = np.empty(width, np.int32)
    u = np.empty(max(width, GAP_BLOCK), np.float64)  # a cell's draws of one stream
    hist = np.empty((3, 2048), np.int32)
    edges = np.empty(n_edges, np.float64)
    tally = np.empty(_TALLY, np.int32)
    tallies = np.empty(4 * _TALLY, np.int32)  # four tallies end to end
    below_of = np.empty(_TALLY, np.int64)
    upto_of = np.empty(_TALLY, np.int64)
    slot = np.full(canon.shape[0] if has_dups else 1, -1, np.int32)
    for i in range(t, n_rows, threads):
        mask[i, :] = False
        if rows[i] < 0:
            _pad_scgpt(gene_ids, values, masked_values, pad_mask, i, 0, pad_id)  # a padding row of the batch
            continue
        gene_ids[i, 0] = cls_id
        values[i, 0] = PAD_VALUE
        masked_values[i, 0] = PAD_VALUE
        pad_mask[i, 0] = False
        count = codec.decode_one(u8, u32, f32, starts[i], cols, vals, 0)
        if has_dups:
            count = _sum_duplicates(cols, vals, count, canon, slot)
        # every entry's token (the sort and the sample carry tokens: no gather after them), then in
        # a loop of its own (vectorized) whether all are kept (a token and a value other than 0)
        for j in range(count):
            kept_tok[j] = tok[np.uint32(cols[j])]  # unsigned: no test for wrapping around (`_bucket`)
        all_kept = True
        small = True  # every kept value an integer count in 1..SMALL_COUNT: no sort needed
        for j in range(count):
            v = vals[j]
            kept_vals[j] = v
            all_kept &= (kept_tok[j] >= 0) & (v != 0)
            small &= (v >= 1) & (v <= SMALL_COUNT) & (v == np.floor(v))
        n = count
        if not all_kept:  # some dropped: compacted in place to the kept ones
            n = 0
            small = True
            for j in range(count):
                token, v = kept_tok[j], kept_vals[j]
                if token >= 0 and v != 0:
                    kept_tok[n], kept_vals[n] = token, v
                    small &= (v >= 1) & (v <= SMALL_COUNT) & (v == np.floor(v))
                    n += 1
        if n == 0:
            _pad_scgpt(gene_ids, values, masked_values, pad_mask, i, 1, pad_id)
            continue
        # quantile edges of the cell's kept values, as np.quantile(v, q) computes them (linear)
        if small:
            # four tallies, summed: increments of one count (most are 1) do not wait on each other;
            # unsigned indices, which numba does not test for wrapping around from the end
            for c in range(4 * _TALLY):
                tallies[c] = 0
            quads = n >> 2
            for q in range(quads):
                j = q << 2
                tallies[np.uint32(kept_vals[j])] += 1
                tallies[_TALLY + np.uint32(kept_vals[j + 1])] += 1
                tallies[2 * _TALLY + np.uint32(kept_vals[j + 2])] += 1
                tallies[3 * _TALLY + np.uint32(kept_vals[j + 3])] += 1
            for j in range(quads << 2, n):
                tallies[np.uint32(kept_vals[j])] += 1
            for c in range(_TALLY):
                tally[c] = (
                    tallies[c] + tallies[_TALLY + c] + tallies[2 * _TALLY + c] + tallies[3 * _TALLY + c]
                )
            ca, cum_a, cb, cum_b = 0, 0, 0, 0  # cursors: value and count of values <= value
        else:
            for j in range(n):
                keys[j] = _order_bits(kept_vals[j])
                order[j] = j
            radix_sort(keys, order, n, tmp_keys, tmp_order, hist)
        for e in range(n_edges):
            virtual = (n - 1) * quantiles[e]
            top = virtual >= n - 1
            lo = n - 1 if top else np.int64(np.floor(virtual))
            hi = lo if top else lo + 1
            if small:
                while cum_a <= lo:
                    ca += 1
                    cum_a += tally[ca]
                while cum_b <= hi:
                    cb += 1
                    cum_b += tally[cb]
                a, b = np.float32(ca), np.float32(cb)
            else:
                a, b = kept_vals[order[lo]], kept_vals[order[hi]]
            if top:
                edges[e] = a
                continue
            gamma = virtual - lo
            diff = b - a  # float32, as numpy subtracts the two float32 neighbours
            if gamma >= 0.5:
                edges[e] = b - diff * (1.0 - gamma)
            else:
                edges[e] = a + diff * gamma
        key = cell_key(seed, epoch, rows[i])
        if small:  # the bin interval of each count up to the largest, in one walk over the edges
            largest = SMALL_COUNT
            while tally[largest] == 0:
                largest -= 1
            below, upto = 0, 0
            for c in range(1, largest + 1):
                value = np.float64(c)
                while below < n_edges and edges[below] < value:
                    below += 1
                upto = max(upto, below)
                while upto < n_edges and edges[upto] <= value:
                    upto += 1
                below_of[c], upto_of[c] = below, upto
        m = n
        if n > L - 1:  # L - 1 of them, uniformly without replacement, in random order
            m = L - 1
            for j in range(n):
                pick[j] = j
            draws_from(key, STREAM_SUBSAMPLE, 0, m, u)
            for j in range(m):
                r = np.uint64(j + min(np.int64(u[j] * (n - j)), n - j - 1))
                pick[j], pick[r] = pick[r], pick[j]
        else:
            for j in range(n):
                pick[j] = j
        ids_row, values_row, masked_row = gene_ids[i], values[i], masked_values[i]
        if spread_ties:  # u[p]: the tie draw of the value sampled at p
            draws_at(key, STREAM_TIES, pick, m, u)
        if small and spread_ties:  # the common case in a loop of its own, free of branches
            for p in range(m):
                j = np.uint32(pick[p])
                c = np.uint32(kept_vals[j])
                below, upto = below_of[c], upto_of[c]
                b = np.float32(np.ceil(u[p] * (below - upto) + upto))
                ids_row[1 + p] = kept_tok[j]
                values_row[1 + p] = b
                masked_row[1 + p] = b
        else:
            for p in range(m):  # binned over all n values, but only the m kept are computed
                j = pick[p]
                if small:
                    c = np.int64(kept_vals[j])
                    below, upto = below_of[c], upto_of[c]
                else:
                    below, upto = _interval(edges, np.float64(kept_vals[j]))
                if not spread_ties:
                    b = np.float32(below + 1)
                else:  # drawn even without a tie (ceil(u·0 + l) = l): no branch to mispredict
                    b = np.float32(np.ceil(u[p] * (below - upto) + upto))
                ids_row[1 + p] = kept_tok[j]
                values_row[1 + p] = b
                masked_row[1 + p] = b
        pad_mask[i, 1 : 1 + m] = False
        _pad_scgpt(gene_ids, values, masked_values, pad_mask, i, 1 + m, pad_id)
        if exact_mask:
            c = np.int64(np.floor(m * mask_prob))
            for p in range(m):
                pick[p] = p + 1
            draws_from(key, STREAM_MASK, 0, c, u)
            for p in range(c):
                r = p + min(np.int64(u[p] * (m - p)), m - p - 1)
                pick[p], pick[r] = pick[r], pick[p]
                mask[i, pick[p]] = True
                masked_values[i, pick[p]] = MASK_VALUE
        elif mask_prob > 0:
            for q in range(selected_positions(key, 1, m + 1, log_keep, pick, u)):
                mask[i, pick[q]] = True
                masked_values[i, pick[q]] = MASK_VALUE

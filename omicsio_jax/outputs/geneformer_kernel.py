"""Geneformer's rank-value tokens from encoded records (`omicsio_jax.outputs.token_kernels` states the
algorithm)."""

from __future__ import annotations

import numba as nb
import numpy as np

from omicsio_jax.format import codec
from omicsio_jax.outputs.rank_sort import rank_sort
from omicsio_jax.outputs.token_draws import (
    GAP_BLOCK,
    STREAM_MASK_KIND,
    STREAM_RANDOM_TOKEN,
    cell_key,
    draws_at,
    selected_positions,
)
from omicsio_jax.outputs.token_kernels import IGNORE_INDEX, first_not_below, max_count, sum_duplicates


@nb.njit(inline="always")
def _descending_key(v, im):
    """uint32 whose ascending order is the descending order of ``v · im`` (float32, non-negative)."""
    return ~np.uint32(np.float32(v * im).view(np.uint32))


_KEY_POSITIVE_MIN = np.uint32(0x807FFFFF)  # `_descending_key` of +inf
_KEY_POSITIVE_MAX = np.uint32(0xFFFFFFFE)  # `_descending_key` of the smallest positive float32

# Geneformer's tokenizer ranks ``v / n_counts * 10,000 / median`` in float64; the sort's keys are
# ``v · (1 / median)`` rounded twice to float32, whose order is that one's except between genes
# whose values lie within 4·2^-24 of each other (their keys then at most 4 apart: ulps of float32 are
# 2^-24 to 2^-23 of a value): with medians given (a published dictionary), ranked keys as close as
# `NEAR_KEYS` are put in float64's order (`_float64_order`), and a truncated ranking is sorted
# `SORT_PAST` ranks past its end, so that a gene just outside it is seen too. The corpus medians
# (histogram bin centres, within 0.87% of the exact ones) are shared by many genes, whose keys tie
# by the hundred: there the float32 keys rank, ties by column.
NEAR_KEYS = 8
SORT_PAST = 64
TARGET_SUM = 10_000.0  # Geneformer's normalization (its order is the same for any positive one)


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
    medians,
    column_of_token,
    as_float64,
    distinct,
    canon,
    has_dups,
    random_ptr,
    random_tokens,
    row_source,
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
    ``medians``: each column's median (float64; what the scale is the inverse of), for the genes
    whose keys come close (`_float64_order`, where ``as_float64``: medians given, as Geneformer's
    tokenizer takes them); ``column_of_token``: each kept token's column (-1: none);
    ``distinct``: the scales are mostly distinct, so a cell's keys seldom tie (`rank_sort`);
    ``random_tokens[random_ptr[k] : random_ptr[k + 1]]``: the tokens MLM's random replacements of a
    cell of source ``row_source[i]`` are drawn from (`ReplacementTokens`)."""
    width = max(max_count(u32, starts), 1)
    n_rows, L = input_ids.shape
    log_keep = np.log1p(-mask_prob)
    first = 1 if special else 0
    cols = np.empty(width, np.int32)
    vals = np.empty(width, np.float32)
    keys = np.empty(width, np.uint32)
    kept_tok = np.empty(width, np.int32)
    sorted_keys = np.empty(width, np.uint32)
    sorted_tok = np.empty(width, np.int32)
    kept_cols = np.empty(width, np.int32)  # the kept entries' columns and values, where some are not
    kept_vals = np.empty(width, np.float32)
    exact = np.empty(width, np.float64)
    run_cols = np.empty(width, np.int32)
    hist = np.empty((3, 2048), np.int32)
    masked = np.empty(L, np.int64)
    u_kind = np.empty(max(L, 3 * GAP_BLOCK), np.float64)
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
            count = sum_duplicates(cols, vals, count, canon, slot)
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
        k_cols, k_vals = cols, vals
        if not all_kept:  # compacted in place to the kept ones (advanced over without a branch)
            kept = 0
            kmin, kmax = np.uint32(0xFFFFFFFF), np.uint32(0)
            k_cols, k_vals = kept_cols, kept_vals
            for j in range(count):
                key = keys[j]
                keys[kept], kept_tok[kept] = key, kept_tok[j]
                k_cols[kept], k_vals[kept] = cols[j], vals[j]
                keep = (gene_scale[np.uint32(cols[j]), 0] > 0) & (vals[j] > 0)
                kmin = min(kmin, key) if keep else kmin
                kmax = max(kmax, key) if keep else kmax
                kept += keep
        limit = L - 2 * first
        ranked, ranked_keys = kept_tok, keys
        sorted_to = min(kept, limit + SORT_PAST) if as_float64 else min(kept, limit)
        if rank_sort(keys, kept_tok, kept, kmin, kmax, sorted_keys, sorted_tok, hist, sorted_to, distinct):
            ranked, ranked_keys = sorted_tok, sorted_keys
        k = min(kept, limit)
        if as_float64 and _any_near(ranked_keys, sorted_to):
            if _near_end(ranked_keys, k, sorted_to, kept):  # a gene past the sorted ranks may belong in them
                sorted_to = kept
                if rank_sort(keys, kept_tok, kept, kmin, kmax, sorted_keys, sorted_tok, hist, kept, distinct):
                    ranked, ranked_keys = sorted_tok, sorted_keys
                else:  # sorted in place (the out arrays were its scratch)
                    ranked, ranked_keys = kept_tok, keys
            _float64_order(
                ranked_keys, ranked, k, sorted_to, k_cols, k_vals, kept, vals, count, medians,
                column_of_token, exact, run_cols,
            )  # fmt: skip
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
        lo = random_ptr[row_source[i]]  # the genes of the cell's source (every gene, in one dataset)
        n_genes = random_ptr[row_source[i] + 1] - lo
        for q in range(m):
            # the replacement chosen without a branch (80% MASK, 10% a random gene, 10% kept):
            # the random gene's draw is made either way, and a draw is a pure function of its
            # counter, so the tokens are those of drawing it only when used; the gene table is
            # read at that gene only when it is used, else at the source's first (a line at hand,
            # not a miss in a table of every gene), at an index chosen by arithmetic (a read
            # under a condition is a branch, mispredicted for one draw in ten)
            p = masked[q]
            token = ids[p]
            lab[p] = token
            u = u_kind[q]
            used = (u >= 0.8) & (u < 0.9)
            random_token = random_tokens[
                np.uint64(lo + min(np.int64(u_token[q] * n_genes), n_genes - 1) * used)
            ]
            ids[p] = mask_id if u < 0.8 else (random_token if u < 0.9 else token)


@nb.njit(inline="always")
def _near(ranked_keys, r):
    """Whether rank ``r``'s key lies within `NEAR_KEYS` of rank ``r - 1``'s (ranked keys ascend)."""
    return ranked_keys[r] - ranked_keys[r - 1] <= NEAR_KEYS


@nb.njit(inline="always")
def _any_near(ranked_keys, end):
    """Whether two neighbouring ranked keys of the first ``end`` lie within `NEAR_KEYS` (a loop
    without a branch: most cells have none)."""
    near = False
    for r in range(1, end):
        near |= _near(ranked_keys, r)
    return near


@nb.njit(inline="always")
def _near_end(ranked_keys, k, sorted_to, kept):
    """Whether ranks ``k - 1`` to ``sorted_to - 1`` (the sorted ones past the ranking's end) are all
    within `NEAR_KEYS` of each other, the ranks past them unsorted: a gene among those may lie as
    close to the last one kept, and only a whole sort says which."""
    if sorted_to >= kept or k == 0:
        return False
    for r in range(k, sorted_to):
        if not _near(ranked_keys, r):
            return False
    return True


@nb.njit(inline="always")
def _float64_order(
    ranked_keys,
    ranked,
    k,
    sorted_to,
    k_cols,
    k_vals,
    kept,
    vals,
    count,
    medians,
    column_of_token,
    exact,
    run_cols,
):
    """Ranks ``0..k-1`` in the order of Geneformer's float64 values (``v / n * 10,000 / median``,
    ``n`` the cell's total), where runs of keys at most `NEAR_KEYS` apart (ranks up to
    ``sorted_to``) may hold them otherwise: each run ordered by those values, descending, ties by
    ascending column (as the keys' ties are; Geneformer's own sort leaves their order to chance).
    A run's genes are found through ``column_of_token`` and a search of the kept columns (the
    sort moved the tokens, not the entries); a cell has a run or two, if any."""
    end = min(sorted_to, kept)
    total = -1.0
    r = 0
    while r < k:
        e = r + 1
        while e < end and _near(ranked_keys, e):
            e += 1
        if e - r > 1:
            if total < 0:  # n_counts, once per cell: exact for counts, as a sum in order is
                s0, s1, s2, s3 = 0.0, 0.0, 0.0, 0.0
                quads = count >> 2
                for q in range(quads):
                    j = q << 2
                    s0 += vals[j]
                    s1 += vals[j + 1]
                    s2 += vals[j + 2]
                    s3 += vals[j + 3]
                for j in range(quads << 2, count):
                    s0 += vals[j]
                total = (s0 + s1) + (s2 + s3)
            for p in range(r, e):
                c = column_of_token[ranked[p]]
                run_cols[p] = c
                v = np.float64(k_vals[first_not_below(k_cols, 0, kept, c)])
                exact[p] = v / total * TARGET_SUM / medians[c]
            for p in range(r + 1, e):  # insertion (the run is nearly in order): descending, ties by column
                x, c, token = exact[p], run_cols[p], ranked[p]
                q = p - 1
                while q >= r and (exact[q] < x or (exact[q] == x and run_cols[q] > c)):
                    exact[q + 1], run_cols[q + 1], ranked[q + 1] = exact[q], run_cols[q], ranked[q]
                    q -= 1
                exact[q + 1], run_cols[q + 1], ranked[q + 1] = x, c, token
        r = e

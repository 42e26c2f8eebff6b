"""scGPT's binned-value tokens from encoded records (`omicsio_jax.outputs.token_kernels` states the
algorithm)."""

from __future__ import annotations

import numba as nb
import numpy as np

from omicsio_jax.format import codec
from omicsio_jax.outputs.rank_sort import order_bits, radix_sort
from omicsio_jax.outputs.token_draws import (
    GAP_BLOCK,
    STREAM_MASK,
    STREAM_SUBSAMPLE,
    STREAM_TIES,
    cell_key,
    draws_at,
    draws_from,
    selected_positions,
)
from omicsio_jax.outputs.token_kernels import (
    MASK_VALUE,
    PAD_VALUE,
    first_not_below,
    max_count,
    sum_duplicates,
)

SMALL_COUNT = 255  # cells whose kept values are all integers up to this are tallied, not sorted
_TALLY = SMALL_COUNT + 1


@nb.njit(inline="always")
def _interval(edges, v):
    """(edges < v, edges <= v) counted by binary search: ``digitize(v, edges, right=True)`` and
    ``digitize(v, edges)`` for increasing edges."""
    below = lo = first_not_below(edges, 0, edges.shape[0], v)
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
    width = max(max_count(u32, starts), 1)
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
    u = np.empty(max(width, 3 * GAP_BLOCK), np.float64)  # a cell's draws of one stream
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
            count = sum_duplicates(cols, vals, count, canon, slot)
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
                keys[j] = order_bits(kept_vals[j])
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
        if exact_mask:  # Tahoe-x1's count and positions: its CLS value is its pad value, so 1..m-1
            n = max(m - 1, 0)
            c = np.int64(np.floor(n * mask_prob))
            for p in range(n):
                pick[p] = p + 1
            draws_from(key, STREAM_MASK, 0, c, u)
            for p in range(c):
                r = p + min(np.int64(u[p] * (n - p)), n - p - 1)
                pick[p], pick[r] = pick[r], pick[p]
                mask[i, pick[p]] = True
                masked_values[i, pick[p]] = MASK_VALUE
        elif mask_prob > 0:
            for q in range(selected_positions(key, 1, m + 1, log_keep, pick, u)):
                mask[i, pick[q]] = True
                masked_values[i, pick[q]] = MASK_VALUE

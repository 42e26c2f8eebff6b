"""Token batches for single-cell foundation models, computed from the encoded records by numba.

Two algorithms, exactly as the token specification (``docs/tokens.md``, from the published code) states
them; one pass per cell from its record (decode → keep → order → write), no dense intermediate
(`omicsio_jax.outputs.geneformer_kernel`, `omicsio_jax.outputs.scgpt_kernel`):

- **Geneformer** (rank-value encoding): keep the genes with a token and a known median, rank them
  by ``count · (1 / median)`` (float32, descending; ties by ascending gene column; with medians
  given, genes within a few float32 steps in the order of Geneformer's float64 values), take the top
  ``L − 2`` (``L`` without special tokens), write ``[CLS] … [EOS]`` then PAD; MLM as Hugging
  Face's collator (15%: 80% MASK, 10% a random gene token, 10% unchanged).
- **scGPT** (binned values): bin every kept nonzero of the cell on its own quantile edges
  (``np.quantile`` linear, ``n_bins − 1`` edges) — ``"tahoe"`` deterministic, ``"scgpt"`` ties
  spread by a uniform draw — then sample ``L − 1`` of them without replacement when there are
  more, CLS first; mask Bernoulli(p) or exactly ``floor((m−1)·p)`` of positions 1..m−1 (Tahoe-x1).

Every random draw is ``uniform(cell_key(seed, epoch, row), stream, i)`` (`omicsio_jax.outputs.token_draws`):
splitmix64 of a counter, so a cell's tokens depend only on ``(seed, epoch, global row)``, never on
its batch or worker. Orders are stable sorts of uint32 keys (`omicsio_jax.outputs.rank_sort`). This
module holds what both kernels share: the special values and the per-cell helpers.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from omicsio_jax.outputs.rank_sort import finish_by_insertion

PAD, CLS, EOC = 0, 1, 2  # Tahoe-100M's special tokens (EOC doubles as Geneformer V2's EOS)
IGNORE_INDEX = -100  # labels at positions that are not predicted (Hugging Face's convention)
PAD_VALUE = -2.0  # scGPT's value at CLS and padding positions
MASK_VALUE = -1.0  # scGPT's input value at masked positions


@nb.njit(inline="always")
def first_not_below(a, lo, hi, v):
    """The first index in ``lo..hi`` of the ascending ``a`` whose value is not below ``v`` (``hi``
    if none): a binary search."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if a[mid] < v:
            lo = mid + 1
        else:
            hi = mid
    return lo


@nb.njit(inline="always")
def max_count(u32, starts):
    m = 0
    for i in range(starts.shape[0]):
        m = max(m, np.int64(u32[starts[i] // 4 + 1]))
    return m


@nb.njit(inline="always")
def sum_duplicates(cols, vals, count, canon, slot):
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

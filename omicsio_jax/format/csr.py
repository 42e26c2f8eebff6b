"""CSR rows gathered in another order, in one numba pass (`take_rows`).

Kept apart from `omicsio_jax.format.arrow`, so that a reader of datasets does not load pyarrow.
"""

from __future__ import annotations

import numba as nb
import numpy as np


@nb.njit(nogil=True, cache=True)
def take_rows(indptr, indices, values, order):
    """CSR rows ``order`` of ``(indptr, indices, values)``, as a new CSR ``(indptr, indices, values)``."""
    counts = np.empty(order.shape[0], np.int64)
    for i in range(order.shape[0]):
        counts[i] = indptr[order[i] + 1] - indptr[order[i]]
    out_ptr = np.zeros(order.shape[0] + 1, np.int64)
    out_ptr[1:] = np.cumsum(counts)
    out_idx = np.empty(out_ptr[-1], indices.dtype)
    out_val = np.empty(out_ptr[-1], values.dtype)
    for i in range(order.shape[0]):
        lo = indptr[order[i]]
        out_idx[out_ptr[i] : out_ptr[i + 1]] = indices[lo : lo + counts[i]]
        out_val[out_ptr[i] : out_ptr[i + 1]] = values[lo : lo + counts[i]]
    return out_ptr, out_idx, out_val

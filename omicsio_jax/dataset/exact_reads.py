"""Reading exact cells by row number (`Dataset.check_rows`, `Dataset.read_buffer`, `Dataset.read_csr`):
the rows a user or a loader asks for, checked (`check_rows`), a range of cells' raw records
(`read_range`), and rows' records read as CSR in the order asked (`read_csr`).

The distinct rows are read sorted, one range read per run of consecutive rows (for a dataset on
object storage, the chunks of all runs fetched together: see `runs.read_runs`), decoded once, and
repeated or reordered afterwards. The loaders' batched reads are in `batched_reads`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from omicsio_jax.format import codec
from omicsio_jax.format.csr import take_rows
from omicsio_jax.records.runs import RecordSource, ShardReaders, consecutive_runs, read_runs, records_checked


def check_rows(rows: Sequence[int] | np.ndarray, num_cells: int) -> np.ndarray:
    """``rows`` as an int64 array, checked to be a 1-D sequence of valid row numbers of a dataset of
    ``num_cells`` cells."""
    arr = np.asarray(rows)
    if arr.ndim != 1:
        msg = f"rows must be a 1-D sequence of ints, got an array of shape {arr.shape}"
        raise TypeError(msg)
    if arr.size == 0:
        return arr.astype(np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        msg = f"rows must be integers, got dtype {arr.dtype}"
        raise TypeError(msg)
    arr = arr.astype(np.int64, copy=False)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= num_cells:
        bad = lo if lo < 0 else hi
        msg = f"row {bad} is out of range for a dataset of {num_cells:,} cells (valid: 0..{num_cells - 1})"
        raise IndexError(msg)
    return arr


def read_range(
    dataset: RecordSource, readers: ShardReaders, begin: int, end: int
) -> tuple[np.ndarray, np.ndarray]:
    """Raw records of ``dataset``'s cells ``[begin, end)`` concatenated, ``(buf uint8, starts int64)``
    (see `Dataset.read_buffer`), with one read per shard touched; a range that is not within its cells
    is an `IndexError`."""
    num_cells = dataset.manifest.num_cells
    if not 0 <= begin <= end <= num_cells:
        msg = f"cells [{begin}, {end}) are not a range within the {num_cells:,} cells of {dataset.path}"
        raise IndexError(msg)
    return read_runs(dataset, readers, [(begin, end)] if end > begin else [])


def read_csr(
    dataset: RecordSource, readers: ShardReaders, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The checked ``rows`` (`check_rows`) of ``dataset`` as CSR ``(indptr int64, indices int32,
    values float32)``, in the order given (``readers``: ArrayRecord's readers of its shards, for a
    dataset not read by its chunk reader)."""
    unique, inverse = np.unique(rows, return_inverse=True)
    buf, starts = read_runs(dataset, readers, consecutive_runs(unique))  # a remote dataset: one fetch for all
    if len(starts) == 1:
        return np.zeros(1, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32)
    with records_checked(dataset, unique):
        indptr, indices, values = codec.decode_csr(
            codec.Records.check(buf, starts, dataset.manifest.num_genes)
        )
    if len(unique) == len(rows) and np.array_equal(unique, rows):
        return indptr, indices, values
    return take_rows(indptr, indices, values, inverse.astype(np.int64))

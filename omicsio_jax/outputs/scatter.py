"""Scatter kernels: a minibatch of CSR rows becomes what the model eats.

Inputs are CSR rows: ``indptr`` int64 (n + 1), ``indices`` int32 gene columns, ``values``
float32. ``indptr`` may be a slice of a larger CSR (its first entry need not be 0). Columns
repeated within a row are added; with a ``normalize`` mode the transform is applied to each
entry before adding (the codec never writes repeated columns).

``normalize`` and ``target_sum`` are the modes of `omicsio_jax.outputs.normalize` (the one
definition, also of the on-device densify and of training's normalization); per row, ``total`` is
accumulated in float64 and rounded once to float32 (exact for counts, order-independent otherwise),
and each entry becomes ``log1p((v / total) * float32(target_sum))``, every step in float32. In this
order nothing overflows or turns subnormal for tiny totals (``target_sum / total`` can overflow, and
XLA on CPU flushes a subnormal ``total / target_sum`` to zero). `densify_on_device` sums in float32,
so its totals may differ in the last bit.

The numba kernels run in parallel over rows, write into a caller-provided ``out`` (reusable:
every row is zeroed first) and allocate nothing per row.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numba as nb
import numpy as np

from omicsio_jax.core.kernels import row_to_write, row_written, rows_scratch, store_fence
from omicsio_jax.format import codec
from omicsio_jax.outputs.normalize import NORMALIZE_LOG1P, Normalization, row_total, transform


@nb.njit(inline="always")
def _add_entry(row, col, v, gene_to_col, mapped, mode, total, target_sum):
    # entry (col, v) of a record into `row`: through `gene_to_col` if `mapped` (-1: not a column)
    c = col
    if mapped:
        c = gene_to_col[col]  # checked: col < len(gene_to_col)
    if c >= 0 and c < row.shape[0]:
        row[c] += transform(v, mode, total, target_sum)


@nb.njit(inline="always")
def _clear_entry(row, col, gene_to_col, mapped):
    # zero again where `_add_entry` added entry `col`
    c = col
    if mapped:
        c = gene_to_col[col]
    if c >= 0 and c < row.shape[0]:
        row[c] = 0.0


@nb.njit(parallel=True, nogil=True, cache=True)
def _scatter_csr_kernel(indptr, indices, values, gene_to_col, mapped, mode, target_sum, out, scratch):
    """CSR rows → rows of ``out``, columns through ``gene_to_col`` (if ``mapped``), written in place
    or streamed out as `_decode_scatter_kernel` writes records. Returns how many entries had a column
    outside ``[0, limit)`` (the genes of ``gene_to_col``, else ``out``'s columns): skipped."""
    n, parts = out.shape[0], scratch.shape[0]
    limit = gene_to_col.shape[0] if mapped else out.shape[1]
    bad = np.zeros(parts, np.int64)
    for t in nb.prange(parts):
        for i in range(n * t // parts, n * (t + 1) // parts):
            row = row_to_write(out, i, scratch, t)
            lo, hi = indptr[i], indptr[i + 1]
            total = row_total(values, lo, hi, mode)  # over all genes, as scanpy does
            for j in range(lo, hi):
                c = np.int64(indices[j])
                if c >= 0 and c < limit:
                    _add_entry(row, c, values[j], gene_to_col, mapped, mode, total, target_sum)
                else:
                    bad[t] += 1
            if row_written(out, i, row, scratch):
                for j in range(lo, hi):
                    c = np.int64(indices[j])
                    if c >= 0 and c < limit:
                        _clear_entry(row, c, gene_to_col, mapped)
        store_fence()
    return bad.sum()


@nb.njit(inline="always")
def _scatter_record(fields, row, gene_to_col, mapped, mode, target_sum):
    """A record's entries added into ``row``: columns through ``gene_to_col`` (if ``mapped``),
    values transformed as `transform` does."""
    total = np.float32(1.0)
    if mode == NORMALIZE_LOG1P:  # over all genes, accumulated in float64 like `row_total`
        acc = 0.0
        for k in range(fields.n):
            acc += codec.value_at(fields, k)
        total = np.float32(np.inf) if acc == 0 else np.float32(acc)
    # one loop per index code, as in `codec._fill_row` (measured faster than one loop that
    # branches on it)
    if fields.index_code == codec.INDEX_DENSE:
        for k in range(fields.n):
            _add_entry(row, k, codec.value_at(fields, k), gene_to_col, mapped, mode, total, target_sum)
    elif fields.index_code == codec.INDEX_DELTA_U16:
        col = np.int64(0)
        for k in range(fields.n):
            col += codec.gap_at(fields, k)
            _add_entry(row, col, codec.value_at(fields, k), gene_to_col, mapped, mode, total, target_sum)
    else:
        for k in range(fields.n):
            col = np.int64(fields.columns[k])
            _add_entry(row, col, codec.value_at(fields, k), gene_to_col, mapped, mode, total, target_sum)


@nb.njit(inline="always")
def _clear_record(fields, row, gene_to_col, mapped):
    """Zeros again where `_scatter_record` added the record's entries."""
    if fields.index_code == codec.INDEX_DENSE:
        for k in range(fields.n):
            _clear_entry(row, k, gene_to_col, mapped)
    elif fields.index_code == codec.INDEX_DELTA_U16:
        col = np.int64(0)
        for k in range(fields.n):
            col += codec.gap_at(fields, k)
            _clear_entry(row, col, gene_to_col, mapped)
    else:
        for k in range(fields.n):
            _clear_entry(row, np.int64(fields.columns[k]), gene_to_col, mapped)


@nb.njit(parallel=True, nogil=True, cache=True)
def _decode_scatter_kernel(u8, u32, f32, starts, gene_to_col, mapped, mode, target_sum, out, scratch):
    """Records → rows of ``out`` in one pass (`_scatter_record`); rows past the records stay zero.
    In ``len(scratch)`` parts, each row built in its part's ``scratch`` row and streamed out, or
    written in place with a scratch of no columns (as `codec._decode_into_rows`)."""
    n, parts = out.shape[0], scratch.shape[0]
    for t in nb.prange(parts):
        for i in range(n * t // parts, n * (t + 1) // parts):
            row = row_to_write(out, i, scratch, t)
            if i < starts.shape[0]:
                fields = codec.record_fields(u8, u32, f32, starts[i])
                _scatter_record(fields, row, gene_to_col, mapped, mode, target_sum)
                if row_written(out, i, row, scratch):
                    _clear_record(fields, row, gene_to_col, mapped)
            else:
                row_written(out, i, row, scratch)
        store_fence()


@nb.njit(parallel=True, nogil=True, cache=True)
def _pad_kernel(indptr, indices, values, row_ids, out_indices, out_values):
    base = indptr[0]
    for i in nb.prange(indptr.shape[0] - 1):
        for j in range(indptr[i], indptr[i + 1]):
            row_ids[j - base] = i
            out_indices[j - base] = indices[j]
            out_values[j - base] = values[j]


def _describe(arr: object) -> str:
    return f"{arr.dtype} array of shape {arr.shape}" if isinstance(arr, np.ndarray) else type(arr).__name__


def _check_1d(name: str, arr: object, dtype: type, length: int | None = None) -> None:
    if (
        not isinstance(arr, np.ndarray)
        or arr.dtype != dtype
        or arr.ndim != 1
        or length not in (None, arr.shape[0])
    ):
        want = f"a {'1-D' if length is None else f'({length},)'} {np.dtype(dtype)} array"
        msg = f"{name} must be {want}, got {_describe(arr)}: pass np.asarray({name}, np.{np.dtype(dtype)})"
        raise TypeError(msg)


def _check_csr(indptr: np.ndarray, indices: np.ndarray, values: np.ndarray) -> int:
    """Validate a CSR batch and return its number of rows."""
    _check_1d("indptr", indptr, np.int64)
    _check_1d("indices", indices, np.int32)
    _check_1d("values", values, np.float32)
    if len(indptr) == 0:
        msg = "indptr is empty: a batch of n rows needs n + 1 offsets (np.zeros(1, np.int64) for 0 rows)"
        raise ValueError(msg)
    if len(indices) != len(values):
        msg = f"indices has {len(indices)} entries but values has {len(values)}: they must match"
        raise ValueError(msg)
    if indptr[0] < 0 or indptr[-1] > len(indices) or np.any(indptr[1:] < indptr[:-1]):
        msg = f"indptr must be non-decreasing offsets in [0, {len(indices)}], got {indptr[0]} .. {indptr[-1]}"
        raise ValueError(msg)
    return len(indptr) - 1


def _check_out(out: np.ndarray | None, n: int, width: int | None) -> np.ndarray:
    if out is None:
        return np.empty((n, width), dtype=np.float32)
    if (
        not isinstance(out, np.ndarray)
        or out.dtype != np.float32
        or out.ndim != 2
        or out.shape[0] != n
        or width not in (None, out.shape[1])
        or not (out.flags.c_contiguous and out.flags.writeable)
    ):
        shape = f"({n}, {'panel_size' if width is None else width})"
        msg = f"out must be a writeable C-contiguous float32 array of shape {shape}, got {_describe(out)}"
        raise ValueError(msg)
    return out


def _raise_bad_index(indptr: np.ndarray, indices: np.ndarray, limit: int) -> None:
    seg = indices[indptr[0] : indptr[-1]]
    j = int(np.flatnonzero((seg < 0) | (seg >= limit))[0]) + int(indptr[0])
    row = int(np.searchsorted(indptr, j, side="right")) - 1
    msg = (
        f"indices[{j}] = {indices[j]} (row {row}) is outside [0, {limit}): the batch does not match "
        f"the gene axis (out is partly written)"
    )
    raise ValueError(msg)


def scatter_dense(
    indptr: np.ndarray,
    indices: np.ndarray,
    values: np.ndarray,
    num_genes: int,
    *,
    out: np.ndarray | None = None,
    normalize: str | None = None,
    target_sum: float = 1e4,
) -> np.ndarray:
    """Scatter CSR rows into a dense float32 ``(n, num_genes)`` array (``out`` if given).

    See the module docstring for ``normalize`` and ``target_sum``. Raises ValueError if a column
    lies outside ``[0, num_genes)``.
    """
    n = _check_csr(indptr, indices, values)
    mode = Normalization(normalize, target_sum).code
    if not isinstance(num_genes, int | np.integer) or num_genes < 0:
        msg = f"num_genes must be a non-negative integer, got {num_genes!r}"
        raise ValueError(msg)
    out = _check_out(out, n, int(num_genes))
    no_map = np.zeros(0, np.int32)
    target = np.float32(target_sum)
    if _scatter_csr_kernel(indptr, indices, values, no_map, False, mode, target, out, rows_scratch(out)):
        _raise_bad_index(indptr, indices, int(num_genes))
    return out


def decode_scatter(
    records: codec.Records,
    out: np.ndarray,
    *,
    gene_to_col: np.ndarray | None = None,
    normalize: str | None = None,
    target_sum: float = 1e4,
) -> np.ndarray:
    """Decode records straight into the rows of ``out``, one pass.

    The same result as `decode_csr` followed by `scatter_dense` (or `scatter_panel` with
    ``gene_to_col``), without the CSR in between; rows of ``out`` past the records are zeroed.
    Raises `MalformedRecordError` for a malformed record (a column past ``out``'s, or past
    ``gene_to_col``'s genes).
    """
    if gene_to_col is None and normalize is None:
        return codec.decode_rows(records, out)
    mode = Normalization(normalize, target_sum).code
    num_columns = out.shape[1] if gene_to_col is None else len(gene_to_col)  # of the records
    u8, u32, f32 = records.views(num_columns)
    mapped = gene_to_col is not None
    table = gene_to_col if mapped else np.zeros(0, np.int32)
    _decode_scatter_kernel(
        u8, u32, f32, records.begins, table, mapped, mode, np.float32(target_sum), out, rows_scratch(out)
    )
    return out


def scatter_panel(
    indptr: np.ndarray,
    indices: np.ndarray,
    values: np.ndarray,
    gene_to_col: np.ndarray,
    *,
    out: np.ndarray | None = None,
    normalize: str | None = None,
    target_sum: float = 1e4,
) -> np.ndarray:
    """Scatter CSR rows into ``(n, panel_size)``, keeping only genes with ``gene_to_col[g] >= 0``.

    ``gene_to_col`` (int32, one entry per gene, see `make_gene_to_col`) gives each gene's panel
    column or -1; ``panel_size`` is ``gene_to_col.max() + 1`` or ``out.shape[1]``. For
    ``"normalize_log1p"`` the row total covers all genes, not only the panel: scanpy normalizes
    before subsetting.
    """
    n = _check_csr(indptr, indices, values)
    mode = Normalization(normalize, target_sum).code
    _check_1d("gene_to_col", gene_to_col, np.int32)
    top = int(gene_to_col.max()) if len(gene_to_col) else -1
    out = _check_out(out, n, None if out is not None else top + 1)
    if top >= out.shape[1] or (len(gene_to_col) and gene_to_col.min() < -1):
        msg = f"gene_to_col must hold -1 or columns in [0, {out.shape[1]}), got {gene_to_col.min()} .. {top}"
        raise ValueError(msg)
    target = np.float32(target_sum)
    if _scatter_csr_kernel(indptr, indices, values, gene_to_col, True, mode, target, out, rows_scratch(out)):
        _raise_bad_index(indptr, indices, len(gene_to_col))
    return out


def make_gene_to_col(num_genes: int, panel_columns: Sequence[int] | np.ndarray) -> np.ndarray:
    """The int32 ``gene_to_col`` map of `scatter_panel`: gene ``panel_columns[k]`` goes to column ``k``."""
    cols = np.asarray(panel_columns).reshape(-1)
    if cols.size and cols.dtype.kind not in "iu":
        msg = f"panel_columns must hold integer column indices, got dtype {cols.dtype}"
        raise TypeError(msg)
    if cols.size and (cols.min() < 0 or cols.max() >= num_genes):
        msg = f"panel_columns must lie in [0, {num_genes}), got values {cols.min()} .. {cols.max()}"
        raise ValueError(msg)
    uniq, counts = np.unique(cols, return_counts=True)
    if (counts > 1).any():
        msg = f"panel_columns repeats genes {uniq[counts > 1][:10].tolist()}: each gene may appear once"
        raise ValueError(msg)
    gene_to_col = np.full(num_genes, -1, dtype=np.int32)
    gene_to_col[cols.astype(np.int64)] = np.arange(len(cols), dtype=np.int32)
    return gene_to_col


def pad_csr(
    indptr: np.ndarray,
    indices: np.ndarray,
    values: np.ndarray,
    *,
    capacity: int,
    out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Flatten CSR rows into fixed-shape COO arrays of length ``capacity`` for jit-friendly transfer.

    Returns ``(row_ids int32, indices int32, values float32, nnz)``: the first ``nnz`` entries are
    the batch's, the rest padding (row 0, column 0, value 0, which adds nothing when scattered).
    ``out`` may hold three such arrays to reuse.
    """
    _check_csr(indptr, indices, values)
    nnz = int(indptr[-1] - indptr[0])
    if not isinstance(capacity, int | np.integer) or nnz > capacity:
        msg = f"the batch has nnz={nnz} nonzeros but the capacity is {capacity!r}: "
        msg += f"raise nnz_capacity to {nnz}+"
        raise ValueError(msg)
    dtypes = (np.int32, np.int32, np.float32)
    out = tuple(np.empty(capacity, d) for d in dtypes) if out is None else tuple(out)
    for name, arr, dtype in zip(("out[0]", "out[1]", "out[2]"), out, dtypes, strict=True):
        _check_1d(name, arr, dtype, int(capacity))
    _pad_kernel(indptr, indices, values, *out)
    for arr in out:
        arr[nnz:] = 0
    return out[0], out[1], out[2], nnz


@functools.partial(jax.jit, static_argnames=("num_rows", "num_genes", "normalize", "target_sum"))
def densify_on_device(
    row_ids: jax.Array,
    indices: jax.Array,
    values: jax.Array,
    *,
    num_rows: int,
    num_genes: int,
    normalize: str | None = None,
    target_sum: float = 1e4,
) -> jax.Array:
    """Dense ``(num_rows, num_genes)`` float32 from `pad_csr` output, built on the device (jitted).

    ``normalize``/``target_sum`` as in the module docstring; row totals via ``segment_sum`` in
    float32. Entries of value 0 (the padding) are sent to row ``num_rows``, past the end, which the
    scatters drop: at (0, 0) a slab's padding, often a fifth of its entries, would be atomic adds
    to one address, serialized on a GPU. A stored 0 would have added nothing either.
    """
    normalization = Normalization(normalize, target_sum)
    dense = jnp.zeros((num_rows, num_genes), jnp.float32)
    if num_rows == 0 or num_genes == 0:
        return dense
    values = jnp.asarray(values, jnp.float32)
    rows = jnp.where(values == 0, num_rows, jnp.asarray(row_ids, jnp.int32))
    entries = normalization.apply_entries(values, rows, num_rows)
    return dense.at[rows, indices].add(entries, mode="drop")

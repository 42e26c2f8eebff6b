"""AnnData ``.h5ad`` input, read in row chunks with h5py so memory stays bounded.

The matrix is ``X``, a named layer or ``raw/X`` (CSR, CSC or dense); the gene table comes from
``var`` (``raw/var`` with ``use_raw``). Obs columns are sliced per chunk straight from their
AnnData encodings (categorical, string-array, numeric, nullable-*). Row indices of an AnnData
CSR matrix need not be sorted: they are sorted per row here (the list-column schema requires
ascending gene ids); duplicates stay an error.

Files written before anndata 0.7 are read too, as ``anndata.read_h5ad`` reads them: ``obs`` and
``var`` as one compound dataset each (the index its first field, fixed-length strings, a
categorical column's codes with its categories in ``uns/<column>_categories``), sparse matrices
marked ``h5sparse_format`` / ``h5sparse_shape``, and ``raw.X`` / ``raw.var`` at the top level;
and those of anndata 0.7 (dataframe encoding 0.1.0): a categorical column its codes, whose attribute
``categories`` refers to ``__categories/<column>``, a text column strings with no encoding. Arrays
stored big-endian are read in native byte order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import h5py
import numba as nb
import numpy as np
import pyarrow as pa

from omicsio_jax import DataValidationError
from omicsio_jax.format import as_input_path, is_remote

from . import _csc_rows
from ._anndata_elements import (
    CategoriesNotUtf8,
    Frame,
    as_text,
    encoding_of,
    gene_ids,
    gene_names,
    is_array,
    is_zarr,
    legacy_raw,
    native_order,
    nonzero_in_float32,
    open_zarr,
    without_stored_zeros,
)
from ._csc_rows import RowBlocks, check_rows, regroup
from ._mudata_obs import file_obs
from ._plan import Partition, whole_partitions
from ._sidecars import carried_obs
from ._source import Batch, Source, gene_table_from_arrow

# h5py reads each batch into fresh arrays; at 2,048 cells they are small enough for the allocator
# to reuse instead of page-faulting them in anew (52.7k cells/s vs 49.6k at 8,192, medians of 3).
DEFAULT_BATCH_CELLS = 2048


@nb.njit(parallel=True, nogil=True, cache=True)
def _sort_rows(indptr, indices, data):
    """Sort the rows whose column indices do not ascend.

    The check ORs the steps between neighbours, negative iff some step descends: branch-free,
    so it vectorizes (12x faster than counting descents).
    """
    for i in nb.prange(indptr.shape[0] - 1):
        lo, hi = indptr[i], indptr[i + 1]
        steps = np.int64(0)
        for j in range(lo + 1, hi):
            steps |= np.int64(indices[j]) - np.int64(indices[j - 1])
        if steps < 0:
            order = np.argsort(indices[lo:hi], kind="mergesort")
            indices[lo:hi] = indices[lo:hi][order]
            data[lo:hi] = data[lo:hi][order]


def open_h5(path) -> h5py.File:
    """An HDF5 input (``.h5ad``, ``.h5mu``) open for reading: an ``s3://`` object through fsspec in
    8 MiB ranges (h5py reads any file-like object)."""
    remote = is_remote(str(path))
    return h5py.File(as_input_path(str(path)).open("rb", block_size=8 << 20) if remote else path, "r")


def _cannot_open(path, e: Exception) -> DataValidationError:
    """The error of an AnnData file that cannot be read: a damaged file, or a process out of files."""
    if "Too many open files" in str(e):
        hint = "this process has too many files open: raise its limit (ulimit -n)"
    else:
        hint = "is it a complete AnnData .h5ad file?"
    return DataValidationError(f"cannot read {path}: {e} ({hint})")


class H5adSource(Source):
    """Cells of an AnnData file, ``batch_cells`` rows at a time."""

    def __init__(
        self,
        path: Path,
        *,
        layer: str | None = None,
        use_raw: bool = False,
        batch_cells: int = DEFAULT_BATCH_CELLS,
        group: str = "",
        cell_id: str = "cell_id",
    ):
        self.path, self._batch_cells = path, batch_cells
        self._cell_id = None if cell_id == "cell_id" else cell_id  # an obs column, else the obs names
        self.label = str(path) if not group else f"{path}:{group}"
        self._layer, self._use_raw, self.group = layer, use_raw, group
        self._by_row: RowBlocks | None = None  # a CSC matrix regrouped by row (`stage`)
        self._file = None
        try:  # a file refused is closed again (else it stays open in this process, h5py's lock held)
            self._open()
            try:
                with self._utf8("var"):
                    var = Frame(
                        self._root[legacy_raw(self._root, "var") if use_raw else "var"], self._root.get("uns")
                    )
                self.num_cells, num_vars = self._shape()
                self.genes = self._gene_table(var, num_vars)
            except (OSError, KeyError) as e:
                raise _cannot_open(path, e) from e
            if self._cell_id is not None and self._cell_id not in self._obs:
                msg = (
                    f"--cell-id (InputOptions(cell_id=...)) names obs column {self._cell_id!r}, which {self.label} "
                    f"does not have (its cell ids are its obs names unless one is named); obs: "
                    f"{', '.join(self._obs) or '(none)'}"
                )
                raise DataValidationError(msg)
            types = {name: col.type for name, col in self._obs.items() if name != self._cell_id}
            self.obs_columns = carried_obs(types, self.label)
            self.description = {
                "kind": "h5ad",
                "input": str(path),
                "matrix": self._matrix.name,
                "genes": "var",
            }
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        try:
            self._file = open_zarr(self.path) if is_zarr(self.path) else open_h5(self.path)
            self._root = self._file[self.group] if self.group else self._file  # an .h5mu modality: mod/<name>
            self._matrix = self._pick_matrix(self._layer, self._use_raw)
            with self._utf8("obs"):
                self._obs_frame = Frame(self._root["obs"], self._root.get("uns"))
            self._obs = dict(self._obs_frame.columns)
            if self.group and "obs" in self._file:  # an .h5mu modality: the file's own obs too
                mods = list(self._file["mod"].keys()) if "mod" in self._file else []
                with self._utf8("the file's obs"):
                    whole = Frame(self._file["obs"], self._file.get("uns"))
                self._obs.update(file_obs(whole, self._obs_frame, self._obs, mods))
        except (OSError, KeyError) as e:
            raise _cannot_open(self.path, e) from e

    def close(self) -> None:
        if self._file is not None:
            if isinstance(self._file, h5py.File):
                self._file.close()
            self._file = None

    def __getstate__(self) -> dict:
        """Pickled for partition workers without the open file (each worker opens its own)."""
        return {
            k: v
            for k, v in self.__dict__.items()
            if k not in ("_file", "_root", "_matrix", "_obs_frame", "_obs")
        }

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._file = None

    def plan(self, shard_cells: int) -> list[Partition]:
        return whole_partitions(self.num_cells, shard_cells)

    def part_of(self, first: int, num_cells: int) -> Partition:
        return Partition(0, first, num_cells)

    def raw_counts_hint(self, values: int = 65_536) -> str | None:
        """A note when the matrix read is ``X``, its first ``values`` stored values are not all
        integers (normalized) and ``raw/X``'s are (CELLxGENE's layout), else None."""
        if self._layer is not None or self._use_raw:
            return None
        raw_key = legacy_raw(self._root, "X")
        if raw_key not in self._root:
            return None

        def integral(matrix) -> bool:  # any stored values will do: the first ones, whatever the layout
            if is_array(matrix):
                sample = matrix[: max(1, values // max(matrix.shape[1], 1))]
            else:
                sample = matrix["data"][:values]
            return bool(np.all(sample == np.trunc(sample)))

        try:
            if integral(self._matrix) or not integral(self._root[raw_key]):
                return None
        except (OSError, KeyError):
            return None
        return (
            f"X of {self.label} looks normalized (non-integer values) while {raw_key} holds integer "
            "counts; pass --raw (use_raw=True) to materialize the counts"
        )

    def _pick_matrix(self, layer: str | None, use_raw: bool):
        if layer is not None and use_raw:
            msg = "choose either a layer or raw, not both"
            raise DataValidationError(msg)
        if layer is not None:
            layers = self._root.get("layers", {})
            if layer not in layers:
                msg = f"{self.label} has no layer {layer!r}; layers: {', '.join(layers) or '(none)'}"
                raise DataValidationError(msg)
            return layers[layer]
        if use_raw:
            matrix = legacy_raw(self._root, "X")
            if matrix not in self._root:  # (anndata writes an empty raw group into a zarr store without one)
                msg = (
                    f"{self.label} has no .raw: leave out --raw (use_raw=True; a sources file's raw for "
                    "it) to materialize its X"
                )
                raise DataValidationError(msg)
            return self._root[matrix]
        if "X" not in self._root:  # (X=None since anndata 0.8: the data may be in its layers alone)
            layers = list(self._root.get("layers", {}))
            msg = (
                f"{self.label} has no X; pick a layer with --layer (InputOptions(layer=...)): "
                f"{', '.join(layers) or '(none)'}"
            )
            raise DataValidationError(msg)
        return self._root["X"]

    def _shape(self) -> tuple[int, int]:
        m = self._matrix
        if is_array(m):
            self._sparse = None
            return int(m.shape[0]), int(m.shape[1])
        legacy = "h5sparse_format" in m.attrs and "encoding-type" not in m.attrs
        self._sparse = f"{as_text(m.attrs['h5sparse_format'])}_matrix" if legacy else encoding_of(m)
        if self._sparse not in ("csr_matrix", "csc_matrix"):
            encoding = (
                f"has encoding {self._sparse!r}"
                if legacy or "encoding-type" in m.attrs
                else "is a group without an encoding-type (no matrix AnnData wrote)"
            )
            msg = (
                f"{self.path}: matrix {m.name} {encoding}, which is read as csr_matrix, "
                "csc_matrix or a dense array; rewrite it with anndata (adata.X = scipy.sparse.csr_matrix(adata.X))"
            )
            raise DataValidationError(msg)
        shape = m.attrs["h5sparse_shape" if legacy else "shape"]
        self._check_pointers(m, int(shape[0] if self._sparse == "csr_matrix" else shape[1]))
        return int(shape[0]), int(shape[1])

    def _check_pointers(self, m, major: int) -> None:
        """Refuse a sparse matrix whose ``indptr`` does not frame its entries (scipy's own checks: as
        long as the rows, or columns, plus one; from 0, to at most the number of entries), which would
        read as other cells' values or silently lose some. Each batch checks that its part does not fall."""
        indptr, indices, data = m["indptr"], m["indices"], m["data"]
        length, entries, values = int(indptr.shape[0]), int(indices.shape[0]), int(data.shape[0])
        lines = "rows" if self._sparse == "csr_matrix" else "columns"
        if length != major + 1:
            problem = f"has {length:,} entries where its {major:,} {lines} need {major + 1:,}"
        elif int(indptr[0]) != 0:
            problem = f"starts at {int(indptr[0]):,}, not 0"
        # (an end short of the entries leaves some past it unused, which scipy allows)
        elif int(indptr[length - 1]) > entries:
            problem = f"ends at {int(indptr[length - 1]):,} where indices holds {entries:,} entries"
        elif values != entries:
            problem = f"frames {entries:,} indices but data holds {values:,} values"
        else:
            return
        msg = f"{self.label}: {m.name}/indptr {problem}: the file is damaged; rewrite it with anndata"
        raise DataValidationError(msg)

    def _falls(self, indptr: np.ndarray, what: str, first: int) -> None:
        """Refuse a part of ``indptr`` that falls (a damaged file), naming the first row or column."""
        steps = np.diff(indptr)
        if len(steps) and steps.min() < 0:
            at = first + int(np.argmax(steps < 0))
            msg = (
                f"{self.label}: {self._matrix.name}/indptr falls at {what} {at}: the file is damaged; "
                "rewrite it with anndata"
            )
            raise DataValidationError(msg)

    def _gene_table(self, var: Frame, num_vars: int) -> pa.Table:
        columns = {}
        for name, col in var.columns.items():
            if col.type is not None:
                with self._utf8(f"var column {name!r}"):
                    array = col.read(0, num_vars)
                columns[name] = array.dictionary_decode() if pa.types.is_dictionary(array.type) else array
        with self._utf8("var's index (the gene names)"):
            index = var.index(0, num_vars)
        tokens = columns.pop("gene_token_id", None)
        if tokens is not None:
            values = tokens.to_numpy(zero_copy_only=False)
            if not (np.issubdtype(values.dtype, np.integer) and np.all(np.diff(values) > 0)):
                columns["var_gene_token_id"], tokens = tokens, None
        self._token_of_col = (
            None if tokens is None else tokens.to_numpy(zero_copy_only=False).astype(np.int64)
        )
        if self._token_of_col is not None and np.array_equal(self._token_of_col, np.arange(num_vars)):
            self._token_of_col = None  # tokens are the column positions: no per-nonzero mapping
        table = {
            "gene_token_id": tokens if tokens is not None else pa.array(np.arange(num_vars, dtype=np.int64))
        }
        if "ensembl_id" not in columns:
            table["ensembl_id"] = gene_ids(index, columns)
        if "gene_name" not in columns:
            table["gene_name"] = gene_names(index, columns)
        table.update(columns)
        return gene_table_from_arrow(pa.table(table), f"var of {self.path}")

    def _read_csr(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        m = self._matrix
        if is_array(m):
            dense = native_order(np.asarray(m[lo:hi]))
            rows, cols = np.nonzero(nonzero_in_float32(dense))
            indptr = np.zeros(hi - lo + 1, dtype=np.int64)
            np.cumsum(np.bincount(rows, minlength=hi - lo), out=indptr[1:])
            return indptr, cols.astype(np.int64), dense[rows, cols]
        if self._sparse == "csr_matrix":
            indptr = m["indptr"][lo : hi + 1].astype(np.int64)
            self._falls(indptr, "row", lo)
            a, b = int(indptr[0]), int(indptr[-1])
            indices, data = m["indices"][a:b].astype(np.int32, copy=False), native_order(m["data"][a:b])
            indptr -= a
            _sort_rows(indptr, indices, data)
            return without_stored_zeros(indptr, indices, data)
        if self._by_row is not None:
            return without_stored_zeros(*self._by_row.read(lo, hi))
        return without_stored_zeros(*self._read_csc_rows(lo, hi))

    def _read_csc_rows(self, lo: int, hi: int):
        """Rows [lo, hi) of a CSC matrix not regrouped by row (`stage`): a pass over its entries,
        `_csc_rows.CHUNK_ENTRIES` at a time (memory bounded by them, not by the matrix: chunks of 4,096
        columns held every cell's entries of those columns, 1.4 GB for one batch at 80,000 cells),
        keeping those of the rows asked for."""
        m, chunk = self._matrix, _csc_rows.CHUNK_ENTRIES
        ptr = m["indptr"][:].astype(np.int64)
        self._falls(ptr, "column", 0)
        indices, data = m["indices"], m["data"]
        rows_parts, cols_parts = [np.empty(0, np.int64)], [np.empty(0, np.int64)]
        vals_parts = [np.empty(0, data.dtype.newbyteorder("="))]  # no entries: no rows' values
        for e0 in range(int(ptr[0]), int(ptr[-1]), chunk):
            e1 = min(int(ptr[-1]), e0 + chunk)
            rows = indices[e0:e1]
            if len(rows):
                check_rows(
                    int(rows.min()), int(rows.max()), self.num_cells, f"{self.label}: {m.name}/indices"
                )
            keep = np.flatnonzero((rows >= lo) & (rows < hi))
            if not len(keep):
                continue
            rows_parts.append(rows[keep].astype(np.int64) - lo)
            cols_parts.append(np.searchsorted(ptr, keep + e0, side="right") - 1)  # each entry's column
            vals_parts.append(native_order(data[e0:e1][keep]))
        rows, cols, vals = (np.concatenate(p) for p in (rows_parts, cols_parts, vals_parts))
        order = np.lexsort((cols, rows))
        indptr = np.zeros(hi - lo + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows, minlength=hi - lo), out=indptr[1:])
        return indptr, cols[order], vals[order]

    def stage(self, folder: str | None, *, progress: bool = False, pool=None) -> list[str]:
        """A CSC matrix of more cells than one batch regrouped by row into ``folder`` (`regroup`: two
        passes over its entries, on the ``pool``'s workers where there are any), so that each batch
        then reads its own entries alone; without a folder (a Dask run writing to object storage:
        its workers see no common local folder), the note that each batch passes over all of them."""
        if self._sparse != "csc_matrix" or self.num_cells <= self._batch_cells or self._by_row is not None:
            return []
        if folder is None:
            passes = -(-self.num_cells // self._batch_cells)
            return [
                f"{self._matrix.name} of {self.label} is stored by column (CSC), and a Dask run writing to "
                f"object storage reads it as it is: each batch of {self._batch_cells:,} cells reads every "
                f"entry of the matrix ({passes:,} passes over it); store it by row (CSR) for a conversion "
                "in one pass, e.g. adata.X = adata.X.tocsr() (or the layer read) and write the file again"
            ]
        workers = len(pool.workers) if pool is not None else 0
        with self._matrix_opened() as m:
            try:
                ptr = m["indptr"][:].astype(np.int64)
            except OSError as e:
                raise self._unreadable(0, self.num_cells, e) from e
            self._falls(ptr, "column", 0)
            value_type, where = m["data"].dtype.newbyteorder("=").str, f"{self.label}: {m.name}/indices"
        try:
            self._by_row = regroup(
                self._matrix_opened,
                ptr,
                self.num_cells,
                folder,
                value_type=value_type,
                block_rows=self._batch_cells,
                label=self.label,
                where=where,
                progress=progress,
                run=(lambda fn, items: pool.map(fn, items, lambda _: f"regrouping {self.label} by row"))
                if workers
                else None,
                workers=max(workers, 1),
            )
        except OSError as e:
            raise self._unreadable(0, self.num_cells, e) from e
        return []

    @contextlib.contextmanager
    def _matrix_opened(self) -> Iterator:
        """The matrix read, open in this process (a pickled copy on a worker opens its file, and
        closes it after)."""
        was_open = self._file is not None
        if not was_open:
            self._open()
        try:
            yield self._matrix
        finally:
            if not was_open:
                self.close()

    def batches(
        self, obs: list[str], part: Partition | None = None, *, threads: int | None = None
    ) -> Iterator[Batch]:
        first, end = (0, self.num_cells) if part is None else (part.first_cell, part.end_cell)
        for lo in range(first, end, self._batch_cells):
            hi = min(end, lo + self._batch_cells)
            indptr, tokens, values = self.read_rows(lo, hi)
            cell_ids = self.read_cell_ids(lo, hi)
            obs_arrays = {}
            for name in obs:
                try:
                    with self._utf8(f"obs column {name!r}"):
                        obs_arrays[name] = self._obs[name].read(lo, hi)
                except OSError as e:
                    raise self._unreadable(lo, hi, e) from e
            yield Batch(indptr, tokens, values, cell_ids, obs_arrays, self._locator(lo, cell_ids))

    def read_rows(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows ``[lo, hi)`` as raw CSR ``(indptr, gene tokens, values)``, tokens sorted within rows."""
        if self._file is None:
            self._open()
        try:
            indptr, cols, values = self._read_csr(lo, hi)
        except OSError as e:
            raise self._unreadable(lo, hi, e) from e
        if self._token_of_col is None:
            return indptr, cols, values
        if len(cols) and (cols.min() < 0 or cols.max() >= len(self._token_of_col)):
            bad = int(cols.min() if cols.min() < 0 else cols.max())
            msg = (
                f"{self.label}: {self._matrix.name} holds column {bad:,} in rows {lo}..{hi - 1}, outside its "
                f"{len(self._token_of_col):,} genes: the file is damaged; rewrite it with anndata"
            )
            raise DataValidationError(msg)
        return indptr, self._token_of_col[cols], values

    def read_cell_ids(self, lo: int, hi: int) -> pa.StringArray:
        """The cell ids of rows ``[lo, hi)``: the obs names, or the obs column ``cell_id`` named (as text)."""
        if self._file is None:
            self._open()
        try:
            with self._utf8("obs names" if self._cell_id is None else f"obs column {self._cell_id!r}"):
                if self._cell_id is None:
                    return self._obs_frame.index(lo, hi)
                ids = self._obs[self._cell_id].read(lo, hi)
            if ids.null_count:
                row = lo + int(np.flatnonzero(ids.is_null().to_numpy(zero_copy_only=False))[0])
                msg = f"cell id column {self._cell_id} is null in row {row} of {self.label}"
                raise DataValidationError(msg)
            return (ids.dictionary_decode() if pa.types.is_dictionary(ids.type) else ids).cast(pa.string())
        except OSError as e:
            raise self._unreadable(lo, hi, e) from e

    @contextlib.contextmanager
    def _utf8(self, what: str) -> Iterator[None]:
        """Text of ``what`` that is not UTF-8 (AnnData's encoding) as a one-line error naming it (and
        the column, for a column's categories)."""
        try:
            yield
        except UnicodeDecodeError as e:
            msg = f"{self.label}: {what} holds text that is not UTF-8 ({e}); write it again as UTF-8"
            raise DataValidationError(msg) from e
        except CategoriesNotUtf8 as e:
            msg = f"{self.label}: {what}: {e}; write it again as UTF-8"
            raise DataValidationError(msg) from e

    def _unreadable(self, lo: int, hi: int, e: OSError) -> DataValidationError:
        msg = f"cannot read rows {lo}..{hi - 1} of {self.label}: {e} (truncated or corrupted file?)"
        return DataValidationError(msg)

    def _locator(self, lo: int, cell_ids: pa.Array):
        return lambda i: f"row {lo + i} (cell_id {cell_ids[i].as_py()}) of {self.label}"

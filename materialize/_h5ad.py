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

from collections.abc import Iterator
from pathlib import Path

import h5py
import numba as nb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from omicsio_jax import DataValidationError
from omicsio_jax.format import is_remote

from ._genekeys import SYMBOL_COLUMNS, ensembl_like
from ._mudata_obs import file_obs
from ._plan import Partition, whole_partitions
from ._sidecars import carried_obs, obs_carried
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


def _is_array(node) -> bool:
    """An array (h5py Dataset, zarr Array), not a group."""
    return isinstance(node, h5py.Dataset) or (not isinstance(node, h5py.Group) and hasattr(node, "dtype"))


def _encoding(node) -> str:
    value = node.attrs.get("encoding-type", "array" if _is_array(node) else "dict")
    return value.decode() if isinstance(value, bytes) else str(value)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _strings(dataset, lo: int, hi: int) -> pa.StringArray:
    """Rows ``[lo, hi)`` of a string array (h5py Dataset, zarr Array) as Arrow strings. h5py's
    variable-length UTF-8 strings are read as NumPy strings (``astype("T")``), which Arrow takes
    whole: a var index of 35k ids in 7.2 ms, where h5py's bytes objects joined (`_text_array`) took
    9.2 ms; bytes that are not UTF-8 fail that read and go the other way, to the decoder's error."""
    if isinstance(dataset, h5py.Dataset) and _vlen_utf8(dataset.dtype):
        try:
            return pa.array(dataset.astype("T")[lo:hi], pa.string())
        except (UnicodeDecodeError, TypeError, ValueError, pa.ArrowException):
            pass
    return _text_array(np.asarray(dataset[lo:hi]))


def _vlen_utf8(dtype: np.dtype) -> bool:
    """A variable-length UTF-8 string type of h5py, where NumPy has ``StringDType`` (NumPy 2)."""
    info = h5py.check_string_dtype(dtype)
    return (
        info is not None
        and info.length is None
        and info.encoding == "utf-8"
        and hasattr(np.dtypes, "StringDType")
    )


def _text_array(values: np.ndarray) -> pa.StringArray:
    """A string array's values as Arrow strings. Bytes (h5py's variable- and fixed-length strings)
    are joined into Arrow's buffers and checked as UTF-8 at once, rather than decoded one by one
    (a var index of 60,000 ids: ~15 → ~7 ms beside h5py's read of them); anything else (zarr's str
    values) and bytes that are not UTF-8 (`_decoded` raises the decoder's error) go through Python."""
    items = values.tolist()
    try:
        data = b"".join(items)
    except TypeError:  # not bytes
        data = None
    if data is not None and len(data) < 2**31:
        offsets = np.zeros(len(items) + 1, np.int32)
        np.cumsum(np.fromiter(map(len, items), np.int32, len(items)), out=offsets[1:])
        array = pa.StringArray.from_buffers(len(items), pa.py_buffer(offsets), pa.py_buffer(data))
        try:
            array.validate(full=True)
            return array
        except pa.ArrowInvalid:
            pass
    return pa.array(_decoded(values), pa.string())


class _ObsColumn:
    """Slices one AnnData obs column into Arrow arrays. ``frame`` is the dataframe group holding it:
    in anndata 0.7's layout a categorical column is its codes, an array whose attribute
    ``categories`` names the categories' array in that group (an HDF5 object reference, a zarr path
    such as ``__categories/<column>``), as anndata's ``read_series`` finds them."""

    def __init__(self, node, frame=None):
        self.node, self.kind = node, _encoding(node)
        if self.kind == "array" and "categories" in node.attrs and frame is not None:
            self.kind, self.categories = "codes", _labels(_categories_of(node, frame))
            self.type = pa.dictionary(pa.int32(), pa.string())
        elif self.kind == "categorical":
            self.categories = _labels(node["categories"])
            self.type = pa.dictionary(pa.int32(), pa.string())
        elif self.kind == "array" and node.ndim == 1 and node.dtype.kind in "OSUT":
            self.kind, self.type = "string-array", pa.string()  # anndata 0.7's strings: no encoding
        elif self.kind in ("string-array", "nullable-string-array"):
            self.type = pa.string()
        elif self.kind in ("array", "nullable-integer", "nullable-boolean") or self.kind == "nullable-float":
            values = node if _is_array(node) else node["values"]
            self.type = None if values.ndim != 1 else pa.from_numpy_dtype(values.dtype)
        else:
            self.type = None
        if self.type is None:
            self._fall_back()

    def _fall_back(self) -> None:
        """An element this reader does not decode: anndata reads it (one obs column: bounded by the
        cells), and it is kept if it is one scalar per cell."""
        from anndata.io import read_elem

        try:
            values = read_elem(self.node)
            array = pa.array(np.asarray(values) if not hasattr(values, "dtype") or values.ndim == 1 else [])
        except Exception:  # noqa: BLE001 - anndata cannot read it either: the column is left out
            return
        if len(array) and obs_carried(array.type):
            self.kind, self.type, self._values = "read by anndata", array.type, array

    def read(self, lo: int, hi: int) -> pa.Array:
        node = self.node
        if self.kind == "read by anndata":
            return self._values.slice(lo, hi - lo)
        if self.kind in ("categorical", "codes"):
            codes = (node["codes"] if self.kind == "categorical" else node)[lo:hi].astype(np.int32)
            return pa.DictionaryArray.from_arrays(pa.array(codes, mask=codes < 0), self.categories)
        if self.kind == "string-array":
            return _strings(node, lo, hi)
        if self.kind == "array":
            return pa.array(_native(node[lo:hi]))
        mask = node["mask"][lo:hi].astype(bool)
        values = node["values"]
        if self.kind == "nullable-string-array":
            return pc.if_else(pa.array(mask), pa.nulls(len(mask), pa.string()), _strings(values, lo, hi))
        return pa.array(_native(values[lo:hi]), mask=mask)


def _categories_of(codes, frame):
    """The categories' array of anndata 0.7's codes ``codes`` in the dataframe group ``frame``."""
    ref = codes.attrs["categories"]
    try:
        return frame[ref.decode() if isinstance(ref, bytes) else ref]
    except (KeyError, ValueError) as e:  # h5py: ValueError for a reference to nothing
        msg = f"the categories of {codes.name} ({ref!r}) are not in the file"
        raise KeyError(msg) from e


def _labels(node) -> pa.StringArray:
    """A categorical's categories as text: strings as they are; bools and numbers as Arrow casts
    them to text (``"false"``/``"true"``, ``"2"``, ``"1.5"``), the labels a bool column gets, and a
    numeric one where a collection casts it to text beside a source's strings."""
    if node.ndim == 1 and node.dtype.kind not in "biuf":
        return _strings(node, 0, node.shape[0])
    values = _native(np.atleast_1d(node[...]))
    if values.dtype.kind not in "biuf":
        return _text_array(values)
    return pc.cast(pa.array(values.astype(np.float32) if values.dtype == np.float16 else values), pa.string())


def _without_stored_zeros(indptr: np.ndarray, indices: np.ndarray, data: np.ndarray) -> tuple:
    """Sparse rows without the zeros their matrix stores (an operation on an AnnData may leave explicit
    zeros): the entries a dense matrix's nonzeros give, and the records' "nonzeros only"."""
    keep = data != 0
    if keep.all():
        return indptr, indices, data
    kept = np.zeros(len(keep) + 1, np.int64)
    np.cumsum(keep, out=kept[1:])
    return kept[indptr], indices[keep], data[keep]


def _native(values: np.ndarray) -> np.ndarray:
    """``values`` in this machine's byte order: h5py keeps a file's (``>f8``), which numba's kernels
    and Arrow do not take."""
    return values if values.dtype.isnative else values.astype(values.dtype.newbyteorder("="))


def _decoded(values: np.ndarray) -> list[str]:
    """Strings of a fixed-length or variable-length string array (bytes decoded as UTF-8)."""
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values.tolist()]


class _LegacyColumn:
    """One field of a pre-0.7 compound ``obs``/``var`` dataset, with `_ObsColumn`'s interface."""

    def __init__(self, node: h5py.Dataset, field: str, categories: h5py.Dataset | None):
        self.node, self.field = node, field
        dtype = node.dtype.fields[field][0]
        self.categories = None
        if categories is not None and np.issubdtype(dtype, np.integer):
            cats = _labels(categories)
            if int(node.fields(field)[()].max(initial=-1)) < len(cats):  # anndata's test of which axis
                self.categories = cats
        if self.categories is not None:
            self.type = pa.dictionary(pa.int32(), pa.string())
        elif dtype.kind in "SU" or h5py.check_string_dtype(dtype) is not None:
            self.type = pa.string()
        elif dtype.kind in "biuf":
            self.type = pa.from_numpy_dtype(dtype)
        else:
            self.type = None

    def read(self, lo: int, hi: int) -> pa.Array:
        values = self.node.fields(self.field)[lo:hi]
        if self.categories is not None:
            codes = values.astype(np.int32)
            return pa.DictionaryArray.from_arrays(pa.array(codes, mask=codes < 0), self.categories)
        if self.type == pa.string():
            return _text_array(values)
        return pa.array(values)


class _Frame:
    """An AnnData dataframe on disk (``obs`` or ``var``): its index and columns, in the current
    layout (a group with ``_index`` and ``column-order``) or the one before anndata 0.7."""

    def __init__(self, node, uns):
        if not _is_array(node):
            name = node.attrs["_index"]
            self._index = node[name.decode() if isinstance(name, bytes) else name]
            self._field = None
            self.columns = {n: _ObsColumn(node[n], node) for n in node.attrs.get("column-order", [])}
            return
        fields = node.dtype.names
        if not fields:
            msg = f"{node.name} is neither a dataframe group nor a compound dataset"
            raise KeyError(msg)
        self._index, self._field = node, fields[0]
        self.columns = {
            f: _LegacyColumn(node, f, uns.get(f"{f}_categories") if uns is not None else None)
            for f in fields[1:]
        }

    def __len__(self) -> int:
        return int(self._index.shape[0])

    def index(self, lo: int, hi: int) -> pa.StringArray:
        if self._field is None:
            return _strings(self._index, lo, hi)
        return _text_array(self._index.fields(self._field)[lo:hi])


def _gene_names(index: pa.Array, columns: dict[str, pa.Array]) -> pa.Array:
    """The genes' names: ``var``'s index, unless it holds Ensembl ids and a symbol column is there
    (CELLxGENE: ids in the index, symbols in ``feature_name``), whose symbols are the names then."""
    if not ensembl_like(index):
        return index
    for name in SYMBOL_COLUMNS:
        column = columns.get(name)
        text = column is not None and (
            pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
        )
        if text and not ensembl_like(column):
            return column
    return index


def is_zarr(path) -> bool:
    """An AnnData zarr store (``.zarr``, zarr v2 or v3), local or ``s3://``."""
    return str(path).rstrip("/").endswith(".zarr")


def _open_zarr(path):
    import zarr

    if is_remote(path):  # through the same obstore filesystem as the other s3:// inputs
        from omicsio_jax.format import s3_filesystem

        url = str(path).rstrip("/")
        store = zarr.storage.FsspecStore(
            s3_filesystem(asynchronous=True), path=url.split("://", 1)[1], read_only=True
        )
        return zarr.open_group(store, mode="r")
    return zarr.open_group(str(path), mode="r")


def _legacy_raw(root, name: str) -> str:
    """``raw/<name>``, or the pre-0.7 ``raw.<name>`` where only that exists."""
    return f"raw.{name}" if f"raw.{name}" in root and "raw" not in root else f"raw/{name}"


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
    ):
        self.path, self._batch_cells = path, batch_cells
        self.label = str(path) if not group else f"{path}:{group}"
        self._layer, self._use_raw, self.group = layer, use_raw, group
        self._open()
        try:
            var = _Frame(
                self._root[_legacy_raw(self._root, "var") if use_raw else "var"], self._root.get("uns")
            )
            self.num_cells, num_vars = self._shape()
            self.genes = self._gene_table(var, num_vars)
        except (OSError, KeyError) as e:
            msg = f"cannot read {path}: {e} (is it a complete AnnData .h5ad file?)"
            raise DataValidationError(msg) from e
        self.obs_columns = carried_obs({name: col.type for name, col in self._obs.items()}, self.label)
        self.description = {"kind": "h5ad", "input": str(path), "matrix": self._matrix.name, "genes": "var"}

    def _open(self) -> None:
        try:
            # an s3:// object is read through fsspec in 8 MiB ranges (h5py reads any file-like object)
            self._file = (
                _open_zarr(self.path)
                if is_zarr(self.path)
                else h5py.File(
                    self.path.open("rb", block_size=8 << 20) if is_remote(self.path) else self.path, "r"
                )
            )
            self._root = self._file[self.group] if self.group else self._file  # an .h5mu modality: mod/<name>
            self._matrix = self._pick_matrix(self._layer, self._use_raw)
            self._obs_frame = _Frame(self._root["obs"], self._root.get("uns"))
            self._obs = dict(self._obs_frame.columns)
            if self.group and "obs" in self._file:  # an .h5mu modality: the file's own obs too
                mods = list(self._file["mod"].keys()) if "mod" in self._file else []
                whole = _Frame(self._file["obs"], self._file.get("uns"))
                self._obs.update(file_obs(whole, self._obs_frame, self._obs, mods))
        except (OSError, KeyError) as e:
            msg = f"cannot read {self.path}: {e} (is it a complete AnnData .h5ad file?)"
            raise DataValidationError(msg) from e

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
        raw_key = _legacy_raw(self._root, "X")
        if raw_key not in self._root:
            return None

        def integral(matrix) -> bool:  # any stored values will do: the first ones, whatever the layout
            if _is_array(matrix):
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
            if "raw" not in self._root and "raw.X" not in self._root:
                msg = f"{self.label} has no .raw"
                raise DataValidationError(msg)
            return self._root[_legacy_raw(self._root, "X")]
        return self._root["X"]

    def _shape(self) -> tuple[int, int]:
        m = self._matrix
        if _is_array(m):
            return int(m.shape[0]), int(m.shape[1])
        legacy = "h5sparse_format" in m.attrs and "encoding-type" not in m.attrs
        self._sparse = f"{_text(m.attrs['h5sparse_format'])}_matrix" if legacy else _encoding(m)
        if self._sparse not in ("csr_matrix", "csc_matrix"):
            msg = (
                f"{self.path}: matrix {m.name} has encoding {self._sparse!r}, which is read as csr_matrix, "
                "csc_matrix or a dense array; rewrite it with anndata (adata.X = scipy.sparse.csr_matrix(adata.X))"
            )
            raise DataValidationError(msg)
        shape = m.attrs["h5sparse_shape" if legacy else "shape"]
        return int(shape[0]), int(shape[1])

    def _gene_table(self, var: _Frame, num_vars: int) -> pa.Table:
        columns = {}
        for name, col in var.columns.items():
            if col.type is not None:
                array = col.read(0, num_vars)
                columns[name] = array.dictionary_decode() if pa.types.is_dictionary(array.type) else array
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
            table["ensembl_id"] = columns.pop("gene_ids", index)
        if "gene_name" not in columns:
            table["gene_name"] = _gene_names(index, columns)
        table.update(columns)
        return gene_table_from_arrow(pa.table(table), f"var of {self.path}")

    def _read_csr(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        m = self._matrix
        if _is_array(m):
            dense = _native(np.asarray(m[lo:hi]))
            rows, cols = np.nonzero(dense)
            indptr = np.zeros(hi - lo + 1, dtype=np.int64)
            np.cumsum(np.bincount(rows, minlength=hi - lo), out=indptr[1:])
            return indptr, cols.astype(np.int64), dense[rows, cols]
        if self._sparse == "csr_matrix":
            indptr = m["indptr"][lo : hi + 1].astype(np.int64)
            a, b = int(indptr[0]), int(indptr[-1])
            indices, data = m["indices"][a:b].astype(np.int32, copy=False), _native(m["data"][a:b])
            indptr -= a
            _sort_rows(indptr, indices, data)
            return _without_stored_zeros(indptr, indices, data)
        return _without_stored_zeros(*self._read_csc_rows(lo, hi))

    def _read_csc_rows(self, lo: int, hi: int, col_chunk: int = 4096):
        """Rows [lo, hi) of a CSC matrix: one pass over the columns per chunk of rows."""
        m = self._matrix
        indptr_all, indices, data = m["indptr"], m["indices"], m["data"]
        rows_parts, cols_parts = [np.empty(0, np.int64)], [np.empty(0, np.int64)]
        vals_parts = [np.empty(0, data.dtype.newbyteorder("="))]  # no columns: no rows' values
        num_cols = indptr_all.shape[0] - 1  # a zarr array has no len()
        for c0 in range(0, num_cols, col_chunk):
            c1 = min(num_cols, c0 + col_chunk)
            ptr = indptr_all[c0 : c1 + 1].astype(np.int64)
            rows = indices[ptr[0] : ptr[-1]].astype(np.int64)
            keep = (rows >= lo) & (rows < hi)
            cols = np.repeat(np.arange(c0, c1, dtype=np.int64), np.diff(ptr))
            rows_parts.append(rows[keep] - lo)
            cols_parts.append(cols[keep])
            vals_parts.append(_native(data[ptr[0] : ptr[-1]][keep]))
        rows, cols, vals = (np.concatenate(p) for p in (rows_parts, cols_parts, vals_parts))
        order = np.lexsort((cols, rows))
        indptr = np.zeros(hi - lo + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows, minlength=hi - lo), out=indptr[1:])
        return indptr, cols[order], vals[order]

    def batches(
        self, obs: list[str], part: Partition | None = None, *, threads: int | None = None
    ) -> Iterator[Batch]:
        first, end = (0, self.num_cells) if part is None else (part.first_cell, part.end_cell)
        for lo in range(first, end, self._batch_cells):
            hi = min(end, lo + self._batch_cells)
            indptr, tokens, values = self.read_rows(lo, hi)
            cell_ids = self.read_cell_ids(lo, hi)
            try:
                obs_arrays = {name: self._obs[name].read(lo, hi) for name in obs}
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
        return indptr, (cols if self._token_of_col is None else self._token_of_col[cols]), values

    def read_cell_ids(self, lo: int, hi: int) -> pa.StringArray:
        """The obs names of rows ``[lo, hi)``."""
        if self._file is None:
            self._open()
        try:
            return self._obs_frame.index(lo, hi)
        except OSError as e:
            raise self._unreadable(lo, hi, e) from e

    def _unreadable(self, lo: int, hi: int, e: OSError) -> DataValidationError:
        msg = f"cannot read rows {lo}..{hi - 1} of {self.label}: {e} (truncated or corrupted file?)"
        return DataValidationError(msg)

    def _locator(self, lo: int, cell_ids: pa.Array):
        return lambda i: f"row {lo + i} (cell_id {cell_ids[i].as_py()}) of {self.label}"

"""The elements of an AnnData file that `H5adSource` reads (``.h5ad`` through h5py, ``.zarr`` through
zarr): strings and their encodings, obs columns of every vintage (categorical, string-array,
numeric, nullable-*, and the compound datasets of files before anndata 0.7), the obs/var frames and
the gene names of ``var``."""

from __future__ import annotations

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from omicsio_jax.format import is_remote

from ._genekeys import ID_COLUMNS, SYMBOL_COLUMNS, ensembl_like
from ._sidecars import obs_carried


def is_array(node) -> bool:
    """An array (h5py Dataset, zarr Array), not a group."""
    return isinstance(node, h5py.Dataset) or (not isinstance(node, h5py.Group) and hasattr(node, "dtype"))


def encoding_of(node) -> str:
    value = node.attrs.get("encoding-type", "array" if is_array(node) else "dict")
    return value.decode() if isinstance(value, bytes) else str(value)


def as_text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def index_array(frame):
    """The array of an AnnData dataframe group's index: a ``nullable-string-array``'s values (what
    anndata writes for pandas' ``string`` dtype, pandas 3's default for text), else the array itself."""
    node = frame[as_text(frame.attrs["_index"])]
    return node["values"] if encoding_of(node) == "nullable-string-array" else node


def _strings(dataset, lo: int, hi: int) -> pa.StringArray:
    """Rows ``[lo, hi)`` of a string array (h5py Dataset, zarr Array) as Arrow strings. h5py's
    variable-length UTF-8 strings are read as NumPy strings (``astype("T")``), which Arrow takes
    whole: a var index of 35k ids in 7.2 ms, where h5py's bytes objects joined (`_text_array`) took
    9.2 ms; bytes that are not UTF-8 (h5py passes them through) fail Arrow's check of the result and
    go the other way, to the decoder's error."""
    if isinstance(dataset, h5py.Dataset) and _vlen_utf8(dataset.dtype):
        try:
            strings = pa.array(dataset.astype("T")[lo:hi], pa.string())
            strings.validate(full=True)
            return strings
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
        self.node, self.kind = node, encoding_of(node)
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
            values = node if is_array(node) else node["values"]
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
            return pa.array(native_order(node[lo:hi]))
        mask = node["mask"][lo:hi].astype(bool)
        values = node["values"]
        if self.kind == "nullable-string-array":
            return pc.if_else(pa.array(mask), pa.nulls(len(mask), pa.string()), _strings(values, lo, hi))
        return pa.array(native_order(values[lo:hi]), mask=mask)


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
    values = native_order(np.atleast_1d(node[...]))
    if values.dtype.kind not in "biuf":
        return _text_array(values)
    return pc.cast(pa.array(values.astype(np.float32) if values.dtype == np.float16 else values), pa.string())


# The largest magnitude float32 rounds to 0: half its smallest subnormal, 2^-149 (a tie, to even)
_FLOAT32_ZERO_BELOW = 2.0**-150


def nonzero_in_float32(values: np.ndarray) -> np.ndarray:
    """Where ``values`` stay nonzero as the float32 the records hold: a float64 of magnitude at most
    2^-150 (1e-300, say) becomes 0 there, and is no entry of a "nonzeros only" record (NaN is kept,
    for the checks that refuse it)."""
    if values.dtype.kind == "f" and values.dtype.itemsize > 4:
        return ~(np.abs(values) <= _FLOAT32_ZERO_BELOW)
    return values != 0


def without_stored_zeros(indptr: np.ndarray, indices: np.ndarray, data: np.ndarray) -> tuple:
    """Sparse rows without the zeros their matrix stores (an operation on an AnnData may leave explicit
    zeros) or that become zeros as float32 (`nonzero_in_float32`): the entries a dense matrix's
    nonzeros give, and the records' "nonzeros only"."""
    keep = nonzero_in_float32(data)
    if keep.all():
        return indptr, indices, data
    kept = np.zeros(len(keep) + 1, np.int64)
    np.cumsum(keep, out=kept[1:])
    return kept[indptr], indices[keep], data[keep]


def native_order(values: np.ndarray) -> np.ndarray:
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
            self.type = pa.from_numpy_dtype(dtype.newbyteorder("="))
        else:
            self.type = None

    def read(self, lo: int, hi: int) -> pa.Array:
        values = native_order(self.node.fields(self.field)[lo:hi])
        if self.categories is not None:
            codes = values.astype(np.int32)
            return pa.DictionaryArray.from_arrays(pa.array(codes, mask=codes < 0), self.categories)
        if self.type == pa.string():
            return _text_array(values)
        return pa.array(values)


class CategoriesNotUtf8(ValueError):
    """A column's categories hold text that is not UTF-8 (the message names the column)."""


def _categories_read(name: str, column):
    """``column()`` (a column, its categories read), text that is not UTF-8 in them named."""
    try:
        return column()
    except UnicodeDecodeError as e:
        msg = f"the categories of column {name!r} hold text that is not UTF-8 ({e})"
        raise CategoriesNotUtf8(msg) from e


class Frame:
    """An AnnData dataframe on disk (``obs`` or ``var``): its index and columns, in the current
    layout (a group with ``_index`` and ``column-order``) or the one before anndata 0.7."""

    def __init__(self, node, uns):
        if not is_array(node):
            self._index = index_array(node)
            self._field = None
            self.columns = {
                n: _categories_read(n, lambda n=n: _ObsColumn(node[n], node))
                for n in node.attrs.get("column-order", [])
            }
            return
        fields = node.dtype.names
        if not fields:
            msg = f"{node.name} is neither a dataframe group nor a compound dataset"
            raise KeyError(msg)
        self._index, self._field = node, fields[0]
        self.columns = {
            f: _categories_read(
                f, lambda f=f: _LegacyColumn(node, f, uns.get(f"{f}_categories") if uns is not None else None)
            )
            for f in fields[1:]
        }

    def __len__(self) -> int:
        return int(self._index.shape[0])

    def index(self, lo: int, hi: int) -> pa.StringArray:
        if self._field is None:
            return _strings(self._index, lo, hi)
        return _text_array(self._index.fields(self._field)[lo:hi])


def gene_ids(index: pa.Array, columns: dict[str, pa.Array]) -> pa.Array:
    """The genes' Ensembl ids, taken out of ``columns``: the first id column (`ID_COLUMNS`:
    ``gene_ids``, ``gene_id``, ``feature_id``) of text that holds them, else the index if it does
    (CELLxGENE), else ``gene_ids`` or the index whatever they hold."""
    for name in ID_COLUMNS:
        column = columns.get(name)
        if column is not None and _is_text(column) and ensembl_like(column):
            return columns.pop(name)
    return index if ensembl_like(index) else columns.pop("gene_ids", index)


def _is_text(column: pa.Array) -> bool:
    return pa.types.is_string(column.type) or pa.types.is_large_string(column.type)


def gene_names(index: pa.Array, columns: dict[str, pa.Array]) -> pa.Array:
    """The genes' names: ``var``'s index, unless it holds Ensembl ids and a symbol column is there
    (CELLxGENE: ids in the index, symbols in ``feature_name``), whose symbols are the names then."""
    if not ensembl_like(index):
        return index
    for name in SYMBOL_COLUMNS:
        column = columns.get(name)
        if column is not None and _is_text(column) and not ensembl_like(column):
            return column
    return index


def is_zarr(path) -> bool:
    """An AnnData zarr store (``.zarr``, zarr v2 or v3), local or ``s3://``."""
    return str(path).rstrip("/").endswith(".zarr")


def open_zarr(path):
    import zarr

    if is_remote(path):  # through the same obstore filesystem as the other s3:// inputs
        from omicsio_jax.format import s3_filesystem

        url = str(path).rstrip("/")
        store = zarr.storage.FsspecStore(
            s3_filesystem(asynchronous=True), path=url.split("://", 1)[1], read_only=True
        )
        return zarr.open_group(store, mode="r")
    return zarr.open_group(str(path), mode="r")


def legacy_raw(root, name: str) -> str:
    """``raw/<name>``, or the pre-0.7 ``raw.<name>`` where only that exists."""
    return f"raw.{name}" if f"raw.{name}" in root and "raw" not in root else f"raw/{name}"

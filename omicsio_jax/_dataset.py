"""`open_dataset` and `Dataset`: read a materialized dataset directory."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import numba as nb
import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from . import _codec
from ._errors import DatasetFormatError, OmicsIOError
from ._manifest import Manifest, read_manifest

# Range reads need a readahead buffer (readahead 0 makes them several times slower), but a
# large one wastes I/O on scattered reads: 256 KiB covers a block of cells.
DEFAULT_READER_OPTIONS = "readahead_buffer_size:256K,max_parallelism:0"


@dataclasses.dataclass(frozen=True)
class Categorical:
    """A categorical obs column: ``codes[i]`` indexes ``categories`` (-1 = missing)."""

    codes: np.ndarray
    categories: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.codes)

    def labels(self) -> np.ndarray:
        """The labels as a numpy object array (``None`` where missing)."""
        table = np.array([*self.categories, None], dtype=object)
        return table[np.where(self.codes < 0, len(self.categories), self.codes)]


@nb.njit(nogil=True, cache=True)
def take_rows(indptr, indices, values, order):
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


def runs(sorted_rows: np.ndarray) -> list[tuple[int, int]]:
    """Split sorted unique ints into maximal ``[begin, end)`` runs of consecutive values."""
    if len(sorted_rows) == 0:
        return []
    breaks = np.flatnonzero(np.diff(sorted_rows) != 1) + 1
    begins = sorted_rows[np.concatenate(([0], breaks))]
    ends = sorted_rows[np.concatenate((breaks - 1, [len(sorted_rows) - 1]))] + 1
    return list(zip(begins.tolist(), ends.tolist(), strict=True))


@contextlib.contextmanager
def corruption_reported(dataset_path) -> Iterator[None]:
    """Report the codec's ValueError for a malformed record as a corrupted dataset, with the fix."""
    try:
        yield
    except ValueError as e:
        msg = f"{dataset_path}: {e}; run `omicsio-materialize verify {dataset_path}`"
        raise DatasetFormatError(msg) from e


def decode_records(dataset_path, buf: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR of the records ``buf[starts[i]:starts[i+1]]``; a malformed record means a corrupted dataset."""
    if len(starts) < 2:
        return np.zeros(1, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32)
    with corruption_reported(dataset_path):
        return _codec.decode_csr(buf, starts)


def read_range(reader: Callable[[int], ArrayRecordReader], shard_cells: int, begin: int, end: int) -> list[bytes]:
    """Records of cells ``[begin, end)`` with one ``read(begin, end)`` per shard touched."""
    out: list[bytes] = []
    while begin < end:
        shard = begin // shard_cells
        stop = min(end, (shard + 1) * shard_cells)
        first = shard * shard_cells
        out.extend(reader(shard).read(begin - first, stop - first))
        begin = stop
    return out


class Dataset:
    """A materialized dataset: manifest, ArrayRecord shards and sidecars. Use `open_dataset`."""

    def __init__(self, path: str | os.PathLike[str], *, reader_options: str = DEFAULT_READER_OPTIONS):
        self.path = Path(path)
        self.manifest: Manifest = read_manifest(self.path)
        self.reader_options = reader_options
        self._readers: dict[int, ArrayRecordReader] = {}
        self._lock = threading.Lock()
        for shard in self.manifest.shards:
            if not (self.path / shard.path).exists():
                msg = f"{self.path}: shard {shard.path} listed in the manifest is missing"
                raise DatasetFormatError(msg)

    def __repr__(self) -> str:
        m = self.manifest
        return (
            f"Dataset({str(self.path)!r}, num_cells={m.num_cells:,}, num_genes={m.num_genes:,}, "
            f"layout={m.layout!r}, shards={len(m.shards)}, obs={list(self.obs)})"
        )

    @property
    def num_cells(self) -> int:
        return self.manifest.num_cells

    @property
    def num_genes(self) -> int:
        """Number of columns: genes of the full transcriptome, or of the panel for ``layout="dense"``."""
        return self.manifest.num_genes

    @property
    def layout(self) -> str:
        return self.manifest.layout

    @property
    def fingerprint(self) -> str:
        return self.manifest.fingerprint

    @functools.cached_property
    def features(self):
        """The gene table (a pandas DataFrame), one row per column, in column order."""
        import pyarrow.parquet as pq

        return pq.read_table(self.path / "features.parquet").to_pandas()

    @functools.cached_property
    def gene_stats(self):
        """Corpus statistics (a pandas DataFrame, one row per gene column, in column order):
        ``n_cells`` expressing, sums / means / variances of raw counts, of ``normalize_total(1e4)``
        (``norm_*``) and of its ``log1p`` (``log_*``), and the nonzero ``median`` of
        ``count / n_counts · 1e4`` (within 0.87%). Raises `OmicsIOError` naming
        ``omicsio-materialize stats`` for a dataset made without them."""
        from ._genestats import read_gene_stats

        return read_gene_stats(self).frame()

    def highly_variable_genes(self, n: int, *, n_bins: int = 20) -> np.ndarray:
        """Columns (ascending) of the ``n`` most variable genes, scanpy's ``flavor="seurat"`` on the
        normalized values, from the stored moments (no pass over the cells).

        >>> hvg = ds.highly_variable_genes(2000)                   # doctest: +SKIP
        >>> loader = oj.make_loader(ds, batch_size=64, output=oj.ScGPTTokens(genes=hvg))  # doctest: +SKIP
        """
        from ._genestats import seurat_hvg

        stats = self.gene_stats
        return seurat_hvg(stats["norm_mean"].to_numpy(), stats["norm_var"].to_numpy(), n, n_bins)

    @functools.cached_property
    def cell_ids(self) -> np.ndarray:
        """Cell ids in row order (numpy object array of str)."""
        import pyarrow.parquet as pq

        return pq.read_table(self.path / "cell_ids.parquet").column(0).to_numpy(zero_copy_only=False)

    @functools.cached_property
    def obs(self) -> Mapping[str, Categorical | np.ndarray]:
        """Obs sidecars by name: `Categorical` (codes + categories) or a numeric array (memory-mapped)."""
        out: dict[str, Categorical | np.ndarray] = {}
        for entry in self.manifest.obs:
            base = self.path / "obs" / entry.name
            if entry.kind == "categorical":
                codes = np.load(f"{base}.codes.npy", mmap_mode="r")
                categories = tuple(json.loads(Path(f"{base}.categories.json").read_text()))
                out[entry.name] = Categorical(codes, categories)
            else:
                out[entry.name] = np.load(f"{base}.npy", mmap_mode="r")
        return out

    def rows_where(self, column: str, values: Sequence[str | float], *, invert: bool = False) -> np.ndarray:
        """Global rows whose obs ``column`` takes one of ``values`` (all others with ``invert``).

        >>> held_out = ds.rows_where("batch", ["plate_13"])              # doctest: +SKIP
        >>> train = ds.rows_where("batch", ["plate_13"], invert=True)    # doctest: +SKIP
        """
        if column not in self.obs:
            msg = f"obs column {column!r} not in {self.path}; available: {', '.join(self.obs)}"
            raise KeyError(msg)
        data = self.obs[column]
        if isinstance(data, Categorical):
            unknown = [v for v in values if v not in data.categories]
            if unknown:
                msg = f"{unknown!r} not among the categories of {column!r}: {list(data.categories)[:10]}"
                raise KeyError(msg)
            keep = np.isin(data.codes, [data.categories.index(v) for v in values])
        else:
            keep = np.isin(np.asarray(data), np.asarray(values))
        return np.flatnonzero(~keep if invert else keep)

    def _reader(self, shard_index: int) -> ArrayRecordReader:
        with self._lock:
            reader = self._readers.get(shard_index)
            if reader is None:
                path = str(self.path / self.manifest.shards[shard_index].path)
                reader = ArrayRecordReader(path, self.reader_options)
                self._readers[shard_index] = reader
            return reader

    def gene_columns(self, genes: Sequence[str | int]) -> np.ndarray:
        """Columns of ``genes`` (names, Ensembl ids or column numbers), in the order given.

        >>> ds.gene_columns(["CD3E", "ENSG00000167286", 17])       # doctest: +SKIP
        """
        features = self.features
        lookup: dict[str, int] = {}
        for key in ("ensembl_id", "gene_name"):
            if key in features:
                for col, value in enumerate(features[key].astype(str)):
                    lookup.setdefault(value, col)
        cols, unknown = [], []
        for g in genes:
            if isinstance(g, (int, np.integer)):
                if not 0 <= int(g) < self.num_genes:
                    unknown.append(str(g))
                cols.append(int(g))
            elif str(g) in lookup:
                cols.append(lookup[str(g)])
            else:
                unknown.append(str(g))
        if unknown:
            msg = f"{len(unknown)} panel gene(s) not in {self.path}/features.parquet: {', '.join(unknown[:5])}"
            raise OmicsIOError(msg)
        return np.asarray(cols, dtype=np.int64)

    def check_rows(self, rows: Sequence[int] | np.ndarray) -> np.ndarray:
        """``rows`` as an int64 array, checked to be a 1-D sequence of valid row numbers."""
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
        if lo < 0 or hi >= self.num_cells:
            bad = lo if lo < 0 else hi
            msg = f"row {bad} is out of range for a dataset of {self.num_cells:,} cells (valid: 0..{self.num_cells - 1})"
            raise IndexError(msg)
        return arr

    def read_records(self, begin: int, end: int) -> list[bytes]:
        """Raw records of cells ``[begin, end)``: one range read per shard touched."""
        return read_range(self._reader, self.manifest.shard_cells, begin, end)

    def read_csr(self, rows: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Exact rows as CSR ``(indptr int64, indices int32, values float32)``, in the order asked.

        Rows may repeat and come in any order; consecutive rows are read with one range read.
        For ``layout="dense"`` the columns index the panel and only nonzero entries are returned.
        """
        rows = self.check_rows(rows)
        unique, inverse = np.unique(rows, return_inverse=True)
        records: list[bytes] = []
        for begin, end in runs(unique):
            records.extend(self.read_records(begin, end))
        if not records:
            return np.zeros(1, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32)
        indptr, indices, values = decode_records(self.path, *_codec.join_records(records))
        if len(unique) == len(rows) and np.array_equal(unique, rows):
            return indptr, indices, values
        return take_rows(indptr, indices, values, inverse.astype(np.int64))

    def close(self) -> None:
        with self._lock:
            for reader in self._readers.values():
                reader.close()
            self._readers.clear()

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_dataset(path: str | os.PathLike[str], *, reader_options: str = DEFAULT_READER_OPTIONS) -> Dataset:
    """Open a dataset directory written by ``omicsio-materialize``.

    >>> ds = open_dataset("out/")                       # doctest: +SKIP
    >>> ds.num_cells, ds.num_genes, ds.obs["drug"].categories[:3]   # doctest: +SKIP
    >>> indptr, indices, values = ds.read_csr([5, 0, 17])           # doctest: +SKIP
    """
    return Dataset(path, reader_options=reader_options)

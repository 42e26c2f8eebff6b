"""`open_dataset` and `Dataset`: read a materialized dataset, from a directory or object storage."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from omicsio_jax.core.errors import DatasetFormatError, OmicsIOError
from omicsio_jax.dataset.cache import IOStats
from omicsio_jax.dataset.exact_reads import check_rows, read_csr, read_range
from omicsio_jax.dataset.files import DatasetFiles, locate
from omicsio_jax.dataset.gene_columns import gene_columns
from omicsio_jax.dataset.modalities import FurtherModalities
from omicsio_jax.dataset.obs import Categorical, ObsColumns, rows_where
from omicsio_jax.dataset.presence import GenePresence, read_presence, require_presence
from omicsio_jax.format.chunk_index import ChunkIndex, chunk_index_path
from omicsio_jax.records.chunk_reader import ChunkReader
from omicsio_jax.records.runs import ShardReaders, records_checked

if TYPE_CHECKING:
    from omicsio_jax.dataset.remote import RemoteDataset

# Range reads need a readahead buffer (readahead 0 makes them several times slower), but a
# large one wastes I/O on scattered reads: 256 KiB covers a block of cells. Opening a reader reads
# the shard's footer; ArrayRecord's default prefetches 1 MiB for it (1,049 KB read per open,
# measured), where a 16,384-cell shard's footer and postscript are ~12 KB: 64 KiB makes it 116 KB
# and 0.1 ms, which is what a first fetch that touches every shard of a big dataset pays per shard.
DEFAULT_READER_OPTIONS = "readahead_buffer_size:256K,max_parallelism:0,footer_prefetch_bytes:65536"


class Dataset:
    """A materialized dataset: manifest, ArrayRecord shards and sidecars. Use `open_dataset`.

    ``path`` is the directory (a `Path`), or for a dataset on object storage its URL (a str);
    `local_path` gives the local file of any of its files.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        reader_options: str = DEFAULT_READER_OPTIONS,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_bytes: int | None = None,
        readahead: bool = True,
        chunk_reader: bool = True,
        direct_io: bool | None = None,
    ):
        self.reader_options = reader_options
        self._options = {
            "reader_options": reader_options,
            "cache_dir": cache_dir,
            "cache_bytes": cache_bytes,
            "readahead": readahead,
            "chunk_reader": chunk_reader,
            "direct_io": direct_io,
        }
        self._modalities = FurtherModalities(self, self._options, Dataset)
        # a further modality's dataset opened by its primary (`modality`): the cells that have the
        # modality (obs has_<name>), over which its genes' means and variances are taken
        self.modality_cells: int | None = None
        self.path, self.manifest = locate(path)
        self._files = DatasetFiles(self, self._options)
        self._readers = ShardReaders(self, reader_options)
        self.chunk_reader = ChunkReader(self, direct=self._files.direct) if self._files.chunks else None

    @property
    def _remote(self) -> RemoteDataset | None:
        """The local side of a dataset on object storage: its cache and shard mirrors (None for a local one)."""
        return self._files.remote

    @property
    def open_options(self) -> dict:
        """The options this dataset was opened with (`open_dataset`'s keywords): to open it again
        the same way, e.g. in another process, ``open_dataset(ds.path, **ds.open_options)``."""
        options = dict(self._options)
        if self._remote is not None:  # the cache it settled on
            options["cache_dir"], options["cache_bytes"] = self.cache_dir, self.cache_bytes
        return options

    def chunk_index_path(self, shard: int) -> str:
        """The chunk index of shard number ``shard``, relative to the dataset (``chunks/shard-00003.npy``)."""
        return chunk_index_path(self.manifest.shards[shard].path)

    def chunk_index(self, shard: int) -> ChunkIndex:
        """Shard ``shard``'s chunk index (the byte ranges of its chunks), loaded on first use and kept
        (16 bytes per chunk); for a remote dataset, downloaded then."""
        return self._files.chunk_indexes.get(self.manifest, shard)

    @property
    def is_remote(self) -> bool:
        """Whether the dataset lives on object storage (read through a local cache)."""
        return self._remote is not None

    @property
    def cache_dir(self) -> Path | None:
        """The local cache of a remote dataset (None for a local one)."""
        return None if self._remote is None else self._remote.root

    @property
    def cache_bytes(self) -> int | None:
        """The budget for a remote dataset's cached data chunks (None for a local one)."""
        return None if self._remote is None else self._remote.cache_bytes

    def local_path(self, relpath: str) -> Path:
        """The local file of the dataset's file ``relpath`` (``"features.parquet"``, ``"obs/drug.codes.npy"``).

        A local dataset's file of the manifest's ``files`` is checked against its size when first
        asked for (`ListedFiles`); a remote dataset's is downloaded into the cache on first use and
        checked against its size and SHA-256. A shard's is, remotely, its sparse local mirror,
        which holds the chunks that reads have fetched (see `prepared`). A ``relpath`` outside the
        dataset (absolute, or through ``..``: a manifest's obs name is part of its files' paths) is
        a `DatasetFormatError`.
        """
        return self._files.local_path(self.manifest, relpath)

    def prepared(
        self,
        pieces: Sequence[tuple[int, int, int]],
        *,
        refetch: int | None = None,
        announce_first: bool = True,
    ):
        """A context in which the records ``(shard, begin, end)`` of ``pieces`` can be read from
        `local_path` of their shards: for a remote dataset their chunks are fetched (all pieces'
        together) and kept until it ends; for a local one their byte ranges are announced to the
        kernel, which starts reading them all at once (`ReadAhead`): before the reads begin, or
        (``announce_first=False``) on a thread of its own while they do."""
        return self._files.prepared(pieces, refetch=refetch, announce_first=announce_first)

    def split(self, name: str, *, by: str | None = None) -> np.ndarray:
        """The rows (ascending) of split ``name`` of the split written by `oj.split` (by obs ``by``;
        None: the dataset's only split), for any loader's ``rows=``.

        >>> oj.split(ds, by="donor_id", fractions=(0.98, 0.01, 0.01), seed=0)   # doctest: +SKIP
        >>> loader = oj.make_loader(ds, batch_size=1024, rows=ds.split("train"))  # doctest: +SKIP
        """
        from omicsio_jax.dataset.splits import read_split

        return read_split(self, by).rows(self, name)

    def io_stats(self) -> IOStats:
        """What this dataset fetched from object storage since it was opened (zeros for a local one).

        >>> s = ds.io_stats()                                        # doctest: +SKIP
        >>> s.num_gets, s.bytes_fetched / s.bytes_needed, s.chunk_hits  # doctest: +SKIP
        """
        return IOStats() if self._remote is None else self._remote.io_stats()

    def __repr__(self) -> str:
        m = self.manifest
        return (
            f"Dataset({str(self.path)!r}, num_cells={m.num_cells:,}, num_genes={m.num_genes:,}, "
            f"layout={m.layout!r}, shards={len(m.shards)}, obs={list(self.obs)}"
            + (f", modalities={list(self.modalities)})" if m.modalities else ")")
        )

    @property
    def num_cells(self) -> int:
        return self.manifest.num_cells

    @property
    def modalities(self) -> tuple[str, ...]:
        """The modalities of the cells, this dataset's own first (``("rna",)`` for a single-modality
        dataset; ``("rna", "spliced", "unspliced", "atac")`` for a multiome one)."""
        return (self.manifest.modality, *(m.name for m in self.manifest.modalities))

    def modality(self, name: str | None = None) -> Dataset:
        """The dataset of modality ``name``: this one for its own (or None), else the further modality's
        dataset (opened once, with this one's options), whose row ``i`` is this one's cell ``i``.

        >>> atac = ds.modality("atac")                          # doctest: +SKIP
        >>> atac.num_genes, atac.features.columns               # doctest: +SKIP
        (200000, Index(['peak_token_id', 'chrom', 'start', 'end', 'peak_name'], dtype='object'))
        """
        if name is None or name == self.manifest.modality:
            return self
        return self._modalities.get(name)

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
        return self._table("features.parquet", self.num_genes, "genes").to_pandas()

    def _table(self, relpath: str, rows: int, of: str):
        """The dataset's parquet file ``relpath`` as an Arrow table of ``rows`` rows (one per of its
        ``of``): one that cannot be read or holds another count is damage, said as such."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(self.local_path(relpath))
        except (pa.ArrowException, OSError) as e:
            problem = f"{self.path}: its file {relpath} cannot be read ({str(e).strip()})"
            raise DatasetFormatError.run_verify(self.path, problem) from e
        if table.num_rows != rows:
            problem = (
                f"{self.path}: its file {relpath} has {table.num_rows:,} rows, the dataset {rows:,} {of}"
            )
            raise DatasetFormatError.run_verify(self.path, problem)
        return table

    @functools.cached_property
    def gene_stats(self):
        """Corpus statistics (a pandas DataFrame, one row per gene column, in column order):
        ``n_cells`` expressing, ``n_measured`` (the cells whose source measured the gene: a
        collection's sources measured some genes each, `presence`; else every cell), sums, and
        means / variances over the ``n_measured`` cells (a further modality's dataset, from
        ``ds.modality(name)``: the cells that have the modality) of raw counts, of ``normalize_total(1e4)``
        (``norm_*``) and of its ``log1p`` (``log_*``), and the nonzero ``median`` of
        ``count / n_counts · 1e4`` (within 0.87%). Raises `OmicsIOError` naming
        ``omicsio-materialize stats`` for a dataset made without them."""
        from omicsio_jax.format.gene_stats import read_gene_stats

        presence = self.presence
        if presence is not None:
            measuring = presence.measuring_cells()
        elif self.modality_cells is not None:  # a cell without the modality measured none of its genes
            measuring = np.full(self.num_genes, self.modality_cells, np.int64)
        else:
            measuring = None
        return read_gene_stats(self).frame(measuring)

    def highly_variable_genes(self, n: int, *, n_bins: int = 20) -> np.ndarray:
        """Columns (ascending) of the ``n`` most variable genes, scanpy's ``flavor="seurat"`` on the
        normalized values, from the stored moments (no pass over the cells). In a collection, each
        gene's moments are over the cells of the sources that measured it (`gene_stats`), and a gene
        no source measured is never chosen.

        >>> hvg = ds.highly_variable_genes(2000)                   # doctest: +SKIP
        >>> loader = oj.make_loader(ds, batch_size=64, output=oj.ScGPTTokens(genes=hvg))  # doctest: +SKIP
        """
        from omicsio_jax.format.hvg import seurat_hvg

        stats = self.gene_stats
        return seurat_hvg(stats["norm_mean"].to_numpy(), stats["norm_var"].to_numpy(), n, n_bins)

    @functools.cached_property
    def presence(self) -> GenePresence | None:
        """Which genes each source of a collection measured (`GenePresence`), None for one source."""
        return read_presence(self)

    def measured_genes(self, dataset_id: str) -> np.ndarray:
        """The genes the collection's source ``dataset_id`` measured: bool over the columns."""
        return require_presence(self, "measured_genes").of(dataset_id)

    @functools.cached_property
    def cell_ids(self) -> np.ndarray:
        """Cell ids in row order (numpy object array of str)."""
        return (
            self._table("cell_ids.parquet", self.num_cells, "cells").column(0).to_numpy(zero_copy_only=False)
        )

    @functools.cached_property
    def obs(self) -> Mapping[str, Categorical | np.ndarray]:
        """Obs sidecars by name: `Categorical` (codes + categories) or a numeric array (memory-mapped),
        each read on first access (for a remote dataset: downloaded then)."""
        return ObsColumns(
            self.manifest.obs,
            self.local_path,
            num_cells=self.manifest.num_cells,
            where=str(self.path),
        )

    def rows_where(self, column: str, values: Sequence[str | float], *, invert: bool = False) -> np.ndarray:
        """Global rows whose obs ``column`` takes one of ``values`` (all others with ``invert``). A bool
        column of the input (stored as the categories ``"false"`` / ``"true"``, so that a cell may
        have none) takes ``True`` / ``False`` as well; a date or time column (``datetime64`` /
        ``timedelta64``) takes its values as NumPy reads them (``"2024-05-01"``, `numpy.datetime64`).

        >>> primary = ds.rows_where("is_primary_data", [True])          # doctest: +SKIP
        >>> held_out = ds.rows_where("batch", ["plate_09"])              # doctest: +SKIP
        >>> train = ds.rows_where("batch", ["plate_09"], invert=True)    # doctest: +SKIP
        """
        return rows_where(self.obs, column, values, invert=invert)

    def gene_columns(self, genes: Sequence[str | int]) -> np.ndarray:
        """Columns of ``genes`` (names, Ensembl ids with or without their version, or column numbers;
        for a peak modality, peak names), in the order given.

        >>> ds.gene_columns(["CD3E", "ENSG00000167286", 17])       # doctest: +SKIP
        >>> ds.modality("atac").gene_columns(["chr1:10010-10460"])  # doctest: +SKIP
        """
        return gene_columns(self.features, self.num_genes, genes, str(self.path))

    def check_rows(self, rows: Sequence[int] | np.ndarray) -> np.ndarray:
        """``rows`` as an int64 array, checked to be a 1-D sequence of valid row numbers."""
        return check_rows(rows, self.num_cells)

    def read_records(self, begin: int, end: int) -> list[bytes]:
        """Raw records of cells ``[begin, end)``, one ``bytes`` each (see `read_buffer`)."""
        buf, starts = self.read_buffer(begin, end)
        return [buf[a:b].tobytes() for a, b in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True)]

    def read_buffer(self, begin: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Raw records of cells ``[begin, end)`` concatenated, ``(buf uint8, starts int64)`` (record
        ``i`` is ``buf[starts[i]:starts[i + 1]]``): what the codec's decoders take. One read per shard touched."""
        return read_range(self, self._readers, begin, end)

    def records_checked(self, rows: np.ndarray) -> contextlib.AbstractContextManager[None]:
        """A context that reports a malformed record among the decoded records of ``rows`` (global
        rows, in the order decoded) as this dataset's corruption: a `DatasetFormatError` naming the
        shard, the cell and ``omicsio-materialize verify``.

        >>> buf, starts = ds.read_buffer(0, 8192)                              # doctest: +SKIP
        >>> with ds.records_checked(np.arange(0, 8192)):                        # doctest: +SKIP
        ...     indptr, indices, values = decode_csr(Records.check(buf, starts, ds.num_genes))
        """
        return records_checked(self, rows)

    def read_csr(
        self, rows: Sequence[int] | np.ndarray, *, modality: str | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Exact rows as CSR ``(indptr int64, indices int32, values float32)``, in the order asked.

        Rows may repeat and come in any order; consecutive rows are read with one range read.
        For ``layout="dense"`` the columns index the panel and only nonzero entries are returned.
        ``modality`` reads another modality of the same cells (its columns: its own features), and
        none of this one's bytes.

        >>> indptr, peaks, counts = ds.read_csr([5, 0, 17], modality="atac")   # doctest: +SKIP
        """
        if modality is not None and modality != self.manifest.modality:
            return self.modality(modality).read_csr(rows)
        return read_csr(self, self._readers, self.check_rows(rows))

    def close(self) -> None:
        """Close the shard files, read-ahead and remote store, and hand the freed heap back to the
        system (`release_freed_memory`), so that a job reopening datasets keeps a flat footprint."""
        self._modalities.close()
        self._readers.close()
        self._files.close()

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_dataset(
    path: str | os.PathLike[str],
    *,
    reader_options: str = DEFAULT_READER_OPTIONS,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_bytes: int | None = None,
    readahead: bool = True,
    chunk_reader: bool = True,
    direct_io: bool | None = None,
) -> Dataset:
    """Open a dataset written by ``omicsio-materialize``: its directory, or the ``s3://bucket/prefix/``
    it was uploaded to (the same files under the prefix).

    A dataset on object storage reads like a local one. Its small files are downloaded on first
    use (checked against the manifest) and its shards read through sparse local copies that hold
    only the chunks reads need, fetched with concurrent range GETs, under ``cache_dir`` (default
    ``$OMICSIO_JAX_CACHE/datasets/<fingerprint>``, ``~/.cache/omicsio_jax`` without the variable),
    which later runs reuse. The fetched chunks are kept within ``cache_bytes`` (default:
    min(32 GiB, half the free space of the cache's filesystem)), least recently used shards
    dropped first. S3 is configured by the standard variables (``AWS_ENDPOINT_URL``,
    ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``). ``cache_dir`` and
    ``cache_bytes`` are ignored for a local directory, which is read in place. A local dataset
    larger than the memory this process may use (RAM or its cgroup's limit) is read with
    ``O_DIRECT`` (``direct_io``; None: decide by size): the disk writes into the loader's buffers,
    bypassing the page cache that cannot hold the dataset, with many reads in flight (Linux native
    AIO); a file system that refuses ``O_DIRECT`` (tmpfs) is read buffered. A buffered read first announces its exact byte ranges to the
    kernel (``readahead``), which reads them at the disk's queue depth. Records are read straight from the
    shards' chunks (``chunk_reader``: checked against riegeli's hashes and decompressed by one
    numba kernel per read, into one buffer, with no Python object per record) wherever the shards
    are zstd-compressed or uncompressed; ``chunk_reader=False`` (or other shards) reads them with
    ArrayRecord's own reader (``reader_options``).

    >>> ds = open_dataset("out/")                       # doctest: +SKIP
    >>> ds.num_cells, ds.num_genes, ds.obs["drug"].categories[:3]   # doctest: +SKIP
    >>> indptr, indices, values = ds.read_csr([5, 0, 17])           # doctest: +SKIP
    >>> ds = open_dataset("s3://atlas/tahoe/", cache_dir="/scratch/cache")   # doctest: +SKIP
    """
    return Dataset(
        path,
        reader_options=reader_options,
        cache_dir=cache_dir,
        cache_bytes=cache_bytes,
        readahead=readahead,
        chunk_reader=chunk_reader,
        direct_io=direct_io,
    )


def as_dataset(dataset: Dataset | str | os.PathLike[str], where: str) -> Dataset:
    """``dataset`` itself, or the dataset at a path (`open_dataset` with its defaults); anything else
    is a one-line error naming ``where`` (the call that was given it)."""
    if isinstance(dataset, Dataset):
        return dataset
    if isinstance(dataset, (str, os.PathLike)):
        return open_dataset(dataset)
    msg = f"{where} takes a dataset (oj.open_dataset(path)) or its path, got {type(dataset).__name__}"
    raise OmicsIOError(msg)

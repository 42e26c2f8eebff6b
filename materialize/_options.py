"""`materialize`'s option objects: how the input is read, how the shards are laid out, which further
modalities come along and where the partitions run. Each validates itself when made.

>>> materialize("atlas/**/*.parquet", "lung/", read=InputOptions(where="tissue = 'lung'"),
...             layout=Layout(shard_cells=16384), workers=Dask("tcp://scheduler:8786"))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path

from omicsio_jax import OmicsIOError

DEFAULT_SHARD_CELLS = 1 << 16
DEFAULT_GROUP_SIZE = 16
DEFAULT_COMPRESSION = "zstd:-1"  # see benchmarks/README.md: reads faster than zstd:1, for a few more bytes


def _check_writer_options(compression: object, options: str) -> None:
    """A one-line error, before anything is read, for a compression ArrayRecord's writer refuses: its
    options are parsed by opening a writer on a scratch file (the writers of the run would refuse
    them only once their first shard opens, in another process)."""
    import tempfile

    from array_record.python.array_record_module import ArrayRecordWriter

    if not isinstance(compression, str):
        msg = f"compression must be an ArrayRecord compression such as 'zstd:-1', got {compression!r}"
        raise OmicsIOError(msg)
    with tempfile.TemporaryDirectory(prefix="omicsio-options-") as scratch:
        try:
            ArrayRecordWriter(os.path.join(scratch, "check.arrayrecord"), options).close()
        except ValueError as e:
            msg = (
                f"compression {compression!r} is not one ArrayRecord takes ({e}); e.g. 'zstd:-1' (the "
                f"default), 'zstd:3', 'brotli:6', 'snappy' or 'uncompressed' (--compression)"
            )
            raise OmicsIOError(msg) from None


def _is_power_of_two(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


# the fields of `InputOptions` of a plain type: (name, the types it takes, those types in words)
_INPUT_TYPES = (
    *(
        (name, (str, type(None)), "a string or None")
        for name in ("where", "query", "layer", "gene_id_column", "table")
    ),
    ("genes", (str, os.PathLike, type(None)), "a string, a path or None"),
    ("use_raw", bool, "True or False"),
    ("allow_negative", bool, "True or False"),
)


def as_names(names):
    """``names`` (a sequence of names, a mapping or None), with a single name given as a string read as
    one name, not as the names of its letters: ``obs="cell_type"`` is ``obs=("cell_type",)``."""
    return (names,) if isinstance(names, str) else names


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """How the input is read.

    ``where`` keeps the cells a SQL predicate selects (a hive partition column prunes whole files);
    ``query`` is any DuckDB SELECT instead of a table (with an input: over its view ``cells``);
    ``genes`` the gene table (default: ``gene_metadata.parquet`` beside the input or in the nearest
    folder above it, or an AnnData's ``var``); ``layer`` / ``use_raw`` pick an AnnData matrix other
    than ``X``; ``cell_id`` names the cell id column; ``batch_cells`` cells are read at a time (default: by a parquet file's row width,
    about 4M values a batch; 8,192 through DuckDB, 2,048 from an AnnData file);
    ``allow_negative`` admits negative values (the default refuses them, as counts).

    For a collection (several sources), ``genes`` is ``"union"`` (default: every gene any source
    measured), ``"intersection"`` (the genes all measured) or a gene table / vocabulary fixing the
    genes and their order; ``gene_id_column`` names the column of Ensembl ids (default: found). A
    single AnnData input (``.h5ad``, ``.zarr``) given either is a collection of one; with a single
    table ``gene_id_column`` is refused (give the table as a collection of one: ``[path]``).

    A DuckLake catalog (``ducklake:lake.ducklake``) reads ``table`` at ``snapshot``: a snapshot id,
    a time (a `datetime` or ISO text: the last snapshot at or before it) or None, the latest.
    """

    where: str | None = None
    query: str | None = None
    genes: str | Path | None = None
    layer: str | None = None
    use_raw: bool = False
    cell_id: str = "cell_id"
    batch_cells: int | None = None
    allow_negative: bool = False
    gene_id_column: str | None = None
    table: str | None = None
    snapshot: int | str | datetime | None = None

    def __post_init__(self) -> None:
        for name, types, what in _INPUT_TYPES:
            value = getattr(self, name)
            if not isinstance(value, types):
                msg = f"InputOptions({name}=...) must be {what}, got {value!r}"
                raise TypeError(msg)
        if not isinstance(self.cell_id, str) or not self.cell_id:
            msg = f"InputOptions(cell_id=...) names the cell id column (default 'cell_id'), got {self.cell_id!r}"
            raise OmicsIOError(msg)
        if isinstance(self.snapshot, bool) or (isinstance(self.snapshot, int) and self.snapshot < 0):
            msg = f"InputOptions(snapshot=...) is a snapshot id ≥ 0, a time or None, got {self.snapshot!r}"
            raise OmicsIOError(msg)
        if self.batch_cells is not None and (
            not isinstance(self.batch_cells, int)
            or isinstance(self.batch_cells, bool)
            or self.batch_cells < 1
        ):
            msg = (
                f"InputOptions(batch_cells=...) must be a positive integer or None, got {self.batch_cells!r}"
            )
            raise OmicsIOError(msg)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the dataset is laid out on disk.

    ``shard_cells`` cells per ArrayRecord shard and ``group_size`` cells per compressed chunk (powers
    of two, ``group_size ≤ shard_cells``: blocks never straddle a shard), ``compression`` the
    ArrayRecord compression; ``panel`` (a file of one gene per line, or the genes themselves) stores
    dense rows of those genes only, the focused-gene layout.
    """

    shard_cells: int = DEFAULT_SHARD_CELLS
    group_size: int = DEFAULT_GROUP_SIZE
    compression: str = DEFAULT_COMPRESSION
    panel: str | Path | Sequence[str] | None = None

    def __post_init__(self) -> None:
        if not _is_power_of_two(self.shard_cells):
            msg = f"shard_cells must be a power of two (so blocks never straddle shards), got {self.shard_cells!r}"
            raise OmicsIOError(msg)
        if not _is_power_of_two(self.group_size) or self.group_size > self.shard_cells:
            msg = f"group_size must be a power of two ≤ shard_cells ({self.shard_cells:,}), got {self.group_size!r}"
            raise OmicsIOError(msg)
        if self.compression != DEFAULT_COMPRESSION:  # (the default's is known good: no check on import)
            _check_writer_options(self.compression, self.writer_options)

    @property
    def writer_options(self) -> str:
        """The ArrayRecord writer options of these shards, ``group_size:N,COMPRESSION``: always
        explicit (the library's default is group_size 65536 with brotli)."""
        return f"group_size:{self.group_size},{self.compression}"


@dataclasses.dataclass(frozen=True)
class Multimodal:
    """Several modalities of the same cells.

    ``layers`` are matrices over the primary's genes (splice layers: names of ``.h5ad`` / ``.h5mu``
    layers, or ``{name: table}`` for list-column tables); ``modalities`` have features of their own
    (``.h5mu``: names of its modalities, default all; tables: ``{name: table}`` or ``{name: (table,
    feature table)}``), aligned by ``cell_id`` with the primary, named ``primary``. One name may be
    given as a string (``layers="spliced"``). A cell a further modality lacks gets an empty row there
    and ``obs["has_<name>"] = False``, or with ``require_all`` an error.
    """

    layers: str | Sequence[str] | Mapping[str, str] | None = None
    modalities: str | Sequence[str] | Mapping[str, str | tuple[str, str]] | None = None
    primary: str = "rna"
    require_all: bool = False


@dataclasses.dataclass(frozen=True)
class Dask:
    """Partitions on the Dask cluster at ``scheduler`` (``tcp://host:8786``) or described by
    ``scheduler_file`` (``dask scheduler --scheduler-file``); the output must be storage every
    worker reaches (a shared file system, or ``s3://``)."""

    scheduler: str | None = None
    scheduler_file: str | None = None

    def __post_init__(self) -> None:
        if (self.scheduler is None) == (self.scheduler_file is None):
            msg = "Dask(...) takes one of scheduler='tcp://host:8786' or scheduler_file='scheduler.json'"
            raise OmicsIOError(msg)

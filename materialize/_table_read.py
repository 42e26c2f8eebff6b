"""Reading a `TableSource` partition's rows as batches: through DuckDB (a view over the partition's
files), or by pyarrow when they are plain local parquet files; and naming a bad row's file, row and
cell.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from omicsio_jax import DataValidationError
from omicsio_jax.format import (
    FILE_ROW_COLUMN,
    FILENAME_COLUMN,
    GENE_COLUMN,
    VALUE_COLUMN,
    connect,
    create_cells_view,
    damaged_hint,
    is_list_type,
    is_remote,
    list_to_csr,
    sql_ident,
    sql_str,
)

from ._parquet_stream import DEFAULT_BATCH_CELLS, PARQUET_STREAMS, ParquetStream
from ._plan import Partition
from ._source import Batch
from ._tahoe import FIRST_GENE, FIRST_VALUE, TAHOE_GENES, TAHOE_LAYOUT, TAHOE_VALUES, check_cls_pairs

_PART_FILES = "cells_of_files"  # a partition's files as they are, before `_create_part_view`


class TableReads:
    """The reading half of `TableSource` (which opens and plans the input): the rows of a partition,
    in order, as batches."""

    def _partition_sql(
        self, part: Partition | None, threads: int | None
    ) -> tuple[duckdb.DuckDBPyConnection, str]:
        """A connection and the SELECT of ``part``'s rows (all rows for None or an unsplit input)."""
        if part is None or part.spans is None:
            if self._con is None:  # unpickled in a worker: the whole input (a --query)
                self._con = connect(threads, remote=self._remote)
                if self.files:
                    create_cells_view(self._con, self.files, label=self.label, filename=True, file_rows=True)
            return self._con, self._sql
        con = connect(threads, remote=self._remote)
        files = [self.files[f] for f, _, _ in part.spans]
        create_cells_view(
            con,
            files,
            label=self.label,
            name=_PART_FILES,
            filename=True,
            file_rows=True,
            spans={i: (lo, hi) for i, (_, lo, hi) in enumerate(part.spans)},
        )
        self._create_part_view(con, files)
        arms = []
        for path, (_, lo, hi) in zip(files, part.spans, strict=True):
            rows = f"{FILE_ROW_COLUMN} >= {lo}" + ("" if hi is None else f" AND {FILE_ROW_COLUMN} < {hi}")
            arms.append(f"({FILENAME_COLUMN} = {sql_str(str(path))} AND {rows})")
        sql = f"SELECT * FROM cells WHERE {' OR '.join(arms)}"
        if self._where:
            sql = f"SELECT * FROM ({sql}) WHERE {self._where}"
        return con, self._shaped(sql)

    def _create_part_view(self, con: duckdb.DuckDBPyConnection, files: list[Path]) -> None:
        """View ``cells`` over a partition's files with the columns and types of the view over all of
        them (union by name): a column some other file adds is null here, and a column whose type
        differs among the files is cast as the whole input's view casts it, whichever files a
        partition holds. A file without the list columns (no cells: a table of another kind) is
        refused, rather than read as cells without genes."""
        stored = {
            name for (name,) in con.execute(f"SELECT name FROM pragma_table_info('{_PART_FILES}')").fetchall()
        }
        lists = (TAHOE_GENES, TAHOE_VALUES) if self.layout == TAHOE_LAYOUT else self._lists
        if len(files) > 1 and all(f.suffix == ".parquet" for f in files):
            owned = [(str(path), _parquet_columns(con, path)) for path in files]
        else:
            owned = [(", ".join(str(f) for f in files), stored)]
        for path, own in owned:
            missing = [n for n in lists if n not in own]
            if missing:
                msg = (
                    f"{path} of {self.label} has no column(s) {', '.join(missing)}, which other files of it "
                    "have: it holds no cells; leave it out (name the cell files, or a narrower glob)"
                )
                raise DataValidationError(msg)
        columns = ", ".join(
            f"CAST({sql_ident(n) if n in stored else 'NULL'} AS {kind}) AS {sql_ident(n)}"
            for n, kind in self._view_types.items()
        )
        con.execute(f"CREATE OR REPLACE TEMP VIEW cells AS SELECT {columns} FROM {_PART_FILES}")

    def batches(
        self, obs: list[str], part: Partition | None = None, *, threads: int | None = None
    ) -> Iterator[Batch]:
        spans = self._plain_spans(obs, part)
        if spans is not None:
            yield from self._parquet_batches(obs, spans, 0 if part is None else part.first_cell, threads)
            return
        con, sql = self._partition_sql(part, threads)
        columns = [self._cell_id_column, GENE_COLUMN, VALUE_COLUMN, *obs]
        if self.layout == TAHOE_LAYOUT:
            columns += [FIRST_GENE, FIRST_VALUE]
        located = FILENAME_COLUMN in self.schema.names and FILE_ROW_COLUMN in self.schema.names
        if located:
            columns += [FILENAME_COLUMN, FILE_ROW_COLUMN]
        select = ", ".join(sql_ident(c) for c in columns)
        first_row = 0 if part is None else part.first_cell
        try:
            reader = con.sql(f"SELECT {select} FROM ({sql})").to_arrow_reader(
                self._batch_cells or DEFAULT_BATCH_CELLS
            )
            for record_batch in reader:
                yield self._to_batch(record_batch, obs, first_row, located)
                first_row += record_batch.num_rows
        except duckdb.Error as e:
            raise DataValidationError(self._explain(e)) from e
        except (pa.ArrowException, OSError) as e:  # DuckDB's errors mid-stream come through Arrow's reader
            msg = f"cannot read {self.label}: {str(e).strip().splitlines()[0]}"
            raise DataValidationError(msg) from e

    def reader_for(self, obs: list[str], part: Partition | None = None) -> str:
        """Which library `batches` reads ``part``'s rows with: "pyarrow" or "duckdb"."""
        return "duckdb" if self._plain_spans(obs, part) is None else "pyarrow"

    def _plain_spans(
        self, obs: list[str], part: Partition | None
    ) -> list[tuple[int, int, int | None]] | None:
        """``part``'s row spans ``(file, lo, hi)`` when pyarrow can deliver its rows exactly as DuckDB
        would (local parquet files, no filter, query or Tahoe layout, and every file storing the
        columns read with the types DuckDB reports); else None, and DuckDB reads them."""
        if (
            self._where is not None
            or self._query is not None
            or self.layout == TAHOE_LAYOUT
            or not self.files
            or not pa.types.is_string(self.schema.field(self._cell_id_column).type)
        ):
            return None
        spans = (
            [(f, 0, None) for f in range(len(self.files))]
            if part is None or part.spans is None
            else part.spans
        )
        if all(self._is_plain(f, obs) for f, _, _ in spans):
            return spans
        return None

    def _is_plain(self, f: int, obs: list[str]) -> bool:
        path = self.files[f]
        if is_remote(path) or path.suffix != ".parquet":
            return False
        try:
            stored = pq.read_schema(path)
        except (OSError, pa.ArrowException):
            return False  # DuckDB reads it, and names what is wrong
        wanted = {
            self._cell_id_column: self.schema.field(self._cell_id_column).type,
            **{name: self.schema.field(name).type for name in obs},
        }
        if any(
            name not in stored.names or not _same_type(stored.field(name).type, kind)
            for name, kind in wanted.items()
        ):
            return False
        for name, internal in zip(self._lists, (GENE_COLUMN, VALUE_COLUMN), strict=True):
            if (
                name not in stored.names
                or not is_list_type(stored.field(name).type)
                or stored.field(name).type.value_type != self.schema.field(internal).type.value_type
            ):
                return False
        return True

    def _parquet_batches(self, obs: list[str], spans, first_row: int, threads: int | None) -> Iterator[Batch]:
        """The rows of ``spans`` read by pyarrow: 1.5–1.8 CPU-s per 10^5 cells of the synthetic corpus
        against DuckDB's 2.4–2.5, without DuckDB's fresh Arrow buffers (and page faults) per batch.

        pyarrow decodes a row group from its first row, and a file written with its defaults is one
        row group of up to a million rows: a read that stops inside a row group leaves its stream
        open (`PARQUET_STREAMS`, one per process), and the next read of this process that starts further
        on in the same row group (the next partition this process writes) goes on from there,
        decoding only the rows between, instead of decoding the group again from its first row."""
        names = [self._cell_id_column, GENE_COLUMN, VALUE_COLUMN, *obs]
        columns = [self._cell_id_column, *self._lists, *obs]
        use_threads = threads is None or threads > 1
        for f, lo, hi in spans:
            path = self.files[f]
            try:
                stat = os.stat(path)  # a file written again since is another stream
                key = (id(self), str(path), stat.st_size, stat.st_mtime_ns, tuple(columns), self._batch_cells)
                stream = PARQUET_STREAMS.take(key, lo) or ParquetStream(
                    key, path, lo, self._batch_cells, columns, use_threads
                )
                hi = stream.num_rows if hi is None else hi
                for row, rb in stream.rows(lo, hi):
                    rows = pa.RecordBatch.from_arrays(rb.columns, names=names)
                    yield self._to_batch(rows, obs, first_row, _FileRows(str(path), row))
                    first_row += rb.num_rows
                if stream.row < stream.num_rows:
                    PARQUET_STREAMS.keep(stream)
            except (OSError, pa.ArrowException) as e:
                msg = f"cannot read {path}: {e}"
                raise DataValidationError(msg) from e

    def _to_batch(
        self, rb: pa.RecordBatch, obs: list[str], first_row: int, located: bool | _FileRows
    ) -> Batch:
        cell_ids = rb.column(self._cell_id_column)
        if cell_ids.null_count:
            i = int(np.flatnonzero(cell_ids.is_null().to_numpy(zero_copy_only=False))[0])
            msg = f"cell id column {self._cell_id_column} is null in {_where(self.label, first_row, i, rb, located)}"
            raise DataValidationError(msg)
        cell_ids = cell_ids.cast(pa.string()) if not pa.types.is_string(cell_ids.type) else cell_ids
        locate = _Locator(self.label, first_row, cell_ids, rb, located)
        if self.layout == TAHOE_LAYOUT:
            check_cls_pairs(rb.column(FIRST_GENE), rb.column(FIRST_VALUE), locate, self._cell_id_column)
        gene_ptr, genes = list_to_csr(rb.column(GENE_COLUMN))
        value_ptr, values = list_to_csr(rb.column(VALUE_COLUMN))
        return Batch.from_arrow(
            gene_ptr, genes, value_ptr, values, cell_ids, {name: rb.column(name) for name in obs}, locate
        )


def _parquet_columns(con: duckdb.DuckDBPyConnection, path: Path) -> set[str]:
    """The column names a parquet file stores (from its footer; nested fields' names among them)."""
    try:
        return {
            n for (n,) in con.execute(f"SELECT name FROM parquet_schema({sql_str(str(path))})").fetchall()
        }
    except duckdb.Error as e:
        msg = f"cannot read {path}: {str(e).strip().splitlines()[0]}{damaged_hint(e)}"
        raise DataValidationError(msg) from e


def _same_type(stored: pa.DataType, wanted: pa.DataType) -> bool:
    """A file's column type as DuckDB reports it (a dictionary-encoded column reads as its values)."""
    return stored == wanted or (pa.types.is_dictionary(stored) and stored.value_type == wanted)


@dataclasses.dataclass(frozen=True)
class _FileRows:
    """A batch read from one file: its rows are that file's rows ``first``, ``first + 1``, …"""

    path: str
    first: int


def _where(label: str, first_row: int, i: int, rb: pa.RecordBatch, located: bool | _FileRows) -> str:
    """ "row R of FILE" (R counted within the file) when the batch carries or knows its rows' files."""
    if isinstance(located, _FileRows):
        return f"row {located.first + i} of {located.path}"
    if located:
        return f"row {rb.column(FILE_ROW_COLUMN)[i].as_py()} of {rb.column(FILENAME_COLUMN)[i].as_py()}"
    return f"row {first_row + i} of {label}"


class _Locator:
    """Describes a batch row as "row R (cell_id X) of FILE", R counted within its file."""

    def __init__(
        self, label: str, first_row: int, cell_ids: pa.Array, rb: pa.RecordBatch, located: bool | _FileRows
    ):
        self.label, self.first_row, self.cell_ids, self.rb, self.located = (
            label,
            first_row,
            cell_ids,
            rb,
            located,
        )

    def __call__(self, i: int) -> str:
        where = _where(self.label, self.first_row, i, self.rb, self.located)
        row, _, of = where.partition(" of ")
        return f"{row} (cell_id {self.cell_ids[i].as_py()}) of {of}"

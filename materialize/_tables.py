"""List-column table inputs: parquet (file, directory, glob, hive partitions), vortex, DuckDB queries.

Every table input becomes a DuckDB relation named ``cells``; ``--where`` filters it and
``--query`` may select from it (or from any file DuckDB can read). Rows stream out as Arrow
record batches in bounded memory, in file order. A partition of plain local parquet files (no
``--where`` or ``--query``, internal layout, every file storing the columns read with the types
DuckDB reports) is read by pyarrow instead: the same rows, faster, without DuckDB's fresh Arrow
buffers for every batch (`TableSource.reader_for`).

Two layouts are read, told apart by their columns:

- **internal**: ``gene_token_id`` list<int>, ``gene_expression`` list<float>, ``cell_id``, plus
  scalar obs columns.
- **Tahoe-100M as published** (``tahoebio/Tahoe-100M`` on Hugging Face, ``data/*.parquet``): chosen
  when the input (or ``--query``'s result) has list columns ``genes`` and ``expressions`` and
  neither ``gene_token_id`` nor ``gene_expression``. ``genes`` list<int64> holds token ids
  (gene index + 3; 0, 1, 2 are ``<pad>``, ``<cls>``, ``<eoc>``), ``expressions`` list<float32>
  the raw counts, and every row starts with the CLS pair (gene 1, expression -2.0). The reader
  checks that pair in every row (a row without it is a `DataValidationError` naming file, row
  and cell), strips it in SQL (``genes[2:]`` → ``gene_token_id``, ``expressions[2:]`` →
  ``gene_expression``) and takes ``BARCODE_SUB_LIB_ID`` as the cell id unless the input has a
  ``cell_id`` column (or ``--cell-id`` names another). The other scalar columns (``drug``,
  ``sample``, ``cell_line_id``, ``moa-fine``, ``canonical_smiles``, ``pubchem_cid``, ``plate``)
  are obs columns as usual; ``--where`` sees the published columns, before the CLS pair is
  stripped. The gene table is Tahoe's ``metadata/gene_metadata.parquet`` (``token_id``,
  ``ensembl_id``, ``gene_symbol``), found beside the input as usual or in a ``metadata/``
  folder next to one of the input's parent folders; it is read as ``token_id`` →
  ``gene_token_id``, ``gene_symbol`` → ``gene_name``, ``ensembl_id`` kept, so dataset column
  ``g`` is Tahoe token ``g + 3`` when the table is complete; a gene table holding tokens 0-2 is
  refused (a 0-based index would shift every column). Without a gene table the columns are the
  tokens 3..max seen (the specials are not genes), so ``g ↔ g + 3`` holds as well. Pass the
  ``data/`` folder or a glob, not the repository root: a directory is searched recursively and
  would take in the other ``metadata/*.parquet`` tables.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from omicsio_jax import DataValidationError
from omicsio_jax.format import (
    CELL_ID_COLUMN,
    FILE_ROW_COLUMN,
    FILENAME_COLUMN,
    GENE_COLUMN,
    GENE_TABLE_NAME,
    VALUE_COLUMN,
    check_derived_gene_space,
    connect,
    create_cells_view,
    expand_files,
    find_gene_table,
    is_list_type,
    is_remote,
    list_to_csr,
    register_s3,
    row_counts,
    sql_ident,
    sql_str,
)

from ._plan import Partition, partitions_from_boundaries, partitions_from_counts, range_of_counts
from ._sidecars import carried_obs
from ._source import Batch, Source, decoded_again_note, gene_table_from_arrow

DEFAULT_BATCH_CELLS = 8192  # DuckDB's list decoding prefers large batches (31.8k cells/s vs 30.4k at 2,048)
BATCH_VALUES = 1 << 22  # the nonzeros a pyarrow read of a parquet file decodes at a time, by default

INTERNAL_LAYOUT = "internal"
TAHOE_LAYOUT = "tahoe-100m"
TAHOE_GENES, TAHOE_VALUES, TAHOE_CELL_ID = "genes", "expressions", "BARCODE_SUB_LIB_ID"
TAHOE_CLS_TOKEN, TAHOE_CLS_VALUE = 1, -2.0
TAHOE_NUM_SPECIALS = 3  # <pad>, <cls>, <eoc>: gene g of the vocabulary is token g + 3
_PART_FILES = "cells_of_files"  # a partition's files as they are, before `_create_part_view`
_FIRST_GENE, _FIRST_VALUE = "__tahoe_first_gene", "__tahoe_first_expression"  # the CLS pair, checked per row


def detect_layout(schema: pa.Schema) -> str:
    """``"tahoe-100m"`` for list columns ``genes`` + ``expressions`` without the internal list columns."""
    names = set(schema.names)
    if GENE_COLUMN in names or VALUE_COLUMN in names:
        return INTERNAL_LAYOUT
    if all(n in names and is_list_type(schema.field(n).type) for n in (TAHOE_GENES, TAHOE_VALUES)):
        return TAHOE_LAYOUT
    return INTERNAL_LAYOUT


def tahoe_sql(sql: str) -> str:
    """Tahoe rows in the internal layout: lists without their first pair, which comes along to be checked."""
    genes, values = sql_ident(TAHOE_GENES), sql_ident(TAHOE_VALUES)
    return (
        f"SELECT * EXCLUDE ({genes}, {values}), "
        f"{genes}[2:] AS {GENE_COLUMN}, {values}[2:] AS {VALUE_COLUMN}, "
        f"{genes}[1] AS {_FIRST_GENE}, {values}[1] AS {_FIRST_VALUE} FROM ({sql})"
    )


def tahoe_gene_table(table: pa.Table) -> pa.Table:
    """Tahoe's gene metadata (``token_id``, ``gene_symbol``, ``ensembl_id``) under our column names."""
    if "token_id" not in table.column_names or "gene_token_id" in table.column_names:
        return table
    renames = {"token_id": "gene_token_id"}
    if "gene_name" not in table.column_names:
        renames["gene_symbol"] = "gene_name"
    return table.rename_columns([renames.get(n, n) for n in table.column_names])


NO_GENE_TABLE = "give a gene table with --genes"  # `check_derived_gene_space`'s fix, for materialize


def check_no_special_tokens(table: pa.Table, label: str) -> None:
    """A Tahoe gene table holding token 0, 1 or 2 is 0-based (or not Tahoe's): columns would shift."""
    tokens = table.column(GENE_COLUMN).to_numpy()
    if len(tokens) and tokens.min() < TAHOE_NUM_SPECIALS:
        msg = (
            f"gene table {label} maps token {int(tokens.min())} to a gene, but Tahoe-100M's genes lists "
            "reserve 0, 1, 2 for <pad>, <cls>, <eoc> (gene index + 3); give the table whose token_id values "
            "are the ids in genes (Tahoe's metadata/gene_metadata.parquet), or add 3 to a 0-based index"
        )
        raise DataValidationError(msg)


def find_tahoe_gene_table(files: list[Path]) -> Path | None:
    """``gene_metadata.parquet`` as usual, else in ``metadata/`` beside the inputs' folder or a parent
    (the published tree: ``data/train-*.parquet`` next to ``metadata/gene_metadata.parquet``)."""
    found = find_gene_table(files)
    if found is not None:
        return found
    roots = {f.parent for f in files}
    while len(roots) > 1 and {r.parent for r in roots} != roots:
        roots = {r.parent for r in roots}
    root = roots.pop()
    for folder in [root, *root.parents]:
        candidate = folder / "metadata" / GENE_TABLE_NAME
        if candidate.exists():
            return candidate
    return None


class TableSource(Source):
    """Cells from list-column tables, read through DuckDB (plain local parquet files: by pyarrow)."""

    def __init__(
        self,
        spec: str | None,
        *,
        where: str | None = None,
        query: str | None = None,
        genes: str | pa.Table | None = None,
        cell_id_column: str = "cell_id",
        batch_cells: int | None = None,
        lists: tuple[str, str] = (GENE_COLUMN, VALUE_COLUMN),
        find_genes: bool = True,
        con: duckdb.DuckDBPyConnection | None = None,
    ):
        """``lists`` names the token and value list columns (read as ``gene_token_id`` /
        ``gene_expression``); ``batch_cells`` the cells read at a time (default: `DEFAULT_BATCH_CELLS`
        through DuckDB, by each file's row width through pyarrow: `cells_per_batch`); ``genes`` is
        the gene table's path or the table itself (sorted, as `gene_table_from_arrow` makes it);
        without one it is looked for beside the input (unless not ``find_genes``), else the tokens
        seen make the columns."""
        self._lists = lists
        self._remote = (spec is not None and is_remote(spec)) or (query is not None and "s3://" in query)
        self._con = connect(remote=self._remote) if con is None else con
        self._batch_cells = batch_cells
        self._cell_id_column = cell_id_column
        self._where, self._query = where, query
        self._counts: list[int] | None = None  # rows per file, of an input whose every row is a cell
        self._row_groups: dict[int, np.ndarray | None] = {}  # row group starts per file, once asked
        self.files: list[Path] = []
        self.label = spec if spec is not None else "query"
        self._view_types: dict[str, str] = {}  # the view's columns over all files, and their DuckDB types
        if spec is not None:
            self.files = expand_files(spec)
            create_cells_view(self._con, self.files, label=spec, filename=True, file_rows=True)
            self._view_types = dict(
                self._con.execute("SELECT name, type FROM pragma_table_info('cells')").fetchall()
            )
        sql = "SELECT * FROM cells" if query is None else query
        published = self._schema_of(sql)
        self.layout = detect_layout(published)
        if where:
            sql = f"SELECT * FROM ({sql}) WHERE {where}"
        absent = [
            n for n in self._lists if self._lists != (GENE_COLUMN, VALUE_COLUMN) and n not in published.names
        ]
        if absent:
            msg = (
                f"{self.label} has no list column(s) {', '.join(absent)}; it has {', '.join(published.names)}"
            )
            raise DataValidationError(msg)
        shaped = self._shaped(sql)
        self._sql = shaped
        self.description = {
            "kind": "table",
            "input": spec,
            "files": [str(f) for f in self.files],
            "where": where,
            "query": query,
            "layout": self.layout,
        }
        # the published columns, unless a filter or renamed list columns make another query of them
        schema = published if shaped == sql and not where else self._schema_of(shaped)
        names = set(schema.names)
        if (
            self.layout == TAHOE_LAYOUT
            and cell_id_column == CELL_ID_COLUMN
            and CELL_ID_COLUMN not in names
            and TAHOE_CELL_ID in names
        ):
            self._cell_id_column = TAHOE_CELL_ID
        self.description["cell_id_column"] = self._cell_id_column
        self._check_schema(schema, published)
        self.schema = schema
        hidden = {
            self._cell_id_column,
            GENE_COLUMN,
            VALUE_COLUMN,
            FILENAME_COLUMN,
            FILE_ROW_COLUMN,
            _FIRST_GENE,
            _FIRST_VALUE,
        }
        self.obs_columns = carried_obs({f.name: f.type for f in schema if f.name not in hidden}, self.label)
        self.genes = self._gene_table(genes, find_genes)
        self.num_cells = self._count()

    def _schema_of(self, sql: str) -> pa.Schema:
        try:
            return self._con.sql(f"SELECT * FROM ({sql}) LIMIT 0").to_arrow_table().schema
        except duckdb.Error as e:
            raise DataValidationError(self._explain(e)) from e

    def _explain(self, e: duckdb.Error) -> str:
        text = str(e).strip().splitlines()[0]
        return f"cannot read {self.label}: {text}"

    def _check_schema(self, schema: pa.Schema, published: pa.Schema) -> None:
        missing = [c for c in (self._cell_id_column, GENE_COLUMN, VALUE_COLUMN) if c not in schema.names]
        if missing:
            tahoe = f"; Tahoe-100M's is {TAHOE_CELL_ID}" if self.layout == TAHOE_LAYOUT else ""
            msg = (
                f"{self.label} is missing required column(s) {', '.join(missing)}; it has "
                f"{', '.join(n for n in published.names if n not in (FILENAME_COLUMN, FILE_ROW_COLUMN))} "
                f"(use --cell-id to name another cell id column{tahoe})"
            )
            raise DataValidationError(msg)
        for name in (GENE_COLUMN, VALUE_COLUMN):
            if not is_list_type(schema.field(name).type):
                msg = f"column {name} of {self.label} must be a list column, got {schema.field(name).type}"
                raise DataValidationError(msg)

    def _gene_table(self, genes: str | pa.Table | None, find_genes: bool) -> pa.Table:
        if isinstance(genes, pa.Table):
            return genes
        if genes is None and self.files and find_genes:
            found = (find_tahoe_gene_table if self.layout == TAHOE_LAYOUT else find_gene_table)(self.files)
            genes = None if found is None else str(found)
        if genes is not None:
            if is_remote(genes):
                register_s3(self._con)
            try:
                table = self._con.sql(f"SELECT * FROM {sql_str(str(genes))}").to_arrow_table()
            except duckdb.Error as e:
                msg = f"cannot read gene table {genes}: {str(e).splitlines()[0]}"
                raise DataValidationError(msg) from e
            self.description["genes"] = genes
            table = gene_table_from_arrow(tahoe_gene_table(table), genes)
            if self.layout == TAHOE_LAYOUT:
                check_no_special_tokens(table, genes)
            return table
        # No gene table: the columns are the token ids 0..max seen (Tahoe: 3..max, the specials are no genes).
        sql = f"SELECT max(list_max({GENE_COLUMN})) FROM ({self._sql})"
        try:
            top = self._con.execute(sql).fetchall()[0][0]
        except duckdb.Error as e:
            raise DataValidationError(self._explain(e)) from e
        first = TAHOE_NUM_SPECIALS if self.layout == TAHOE_LAYOUT else 0
        check_derived_gene_space(top, self.label, NO_GENE_TABLE)
        self.description["genes"] = None
        tokens = np.arange(first, 0 if top is None else max(first, int(top) + 1), dtype=np.int32)
        return pa.table({GENE_COLUMN: pa.array(tokens)})

    def _count(self) -> int:
        if self._query is None and self._where is None and self.files:  # every row a cell: the footers'
            self._counts = self._row_counts()  # counts (kept for `plan` and `part_of`, pickled along
            return sum(self._counts)  # to the workers), not a scan by DuckDB
        try:
            return int(self._con.execute(f"SELECT count(*) FROM ({self._sql})").fetchall()[0][0])
        except duckdb.Error as e:
            raise DataValidationError(self._explain(e)) from e

    def __getstate__(self) -> dict:
        """Pickled for partition workers without the DuckDB connection (each worker opens its own)."""
        return {**self.__dict__, "_con": None}

    def close(self) -> None:
        """Release the DuckDB connection (a read opens another where it needs one) and the parquet
        stream a read left open."""
        _STREAMS.drop(id(self))
        if self._con is not None:
            self._con.close()
            self._con = None

    def plan(self, shard_cells: int) -> list[Partition]:
        """The partitions of this input: by the files' row counts, or (with ``--where``) by the rows
        that pass the filter, found in one pass over the filter's columns; a ``--query`` is one."""
        if self._query is not None or not self.files:
            return [Partition(0, 0, self.num_cells)]  # one partition, however many shards
        if self._where is None:
            return partitions_from_counts(self._counts, shard_cells)
        index = {str(f): i for i, f in enumerate(self.files)}
        sql = (
            f"SELECT {FILENAME_COLUMN}, {FILE_ROW_COLUMN} FROM (SELECT {FILENAME_COLUMN}, {FILE_ROW_COLUMN}, "
            f"row_number() OVER () - 1 AS n FROM cells WHERE {self._where}) WHERE n % {int(shard_cells)} = 0"
        )
        try:
            rows = self._con.execute(sql).fetchall()
        except duckdb.Error as e:
            raise DataValidationError(self._explain(e)) from e
        boundaries = [(index[name], int(row)) for name, row in rows]
        return partitions_from_boundaries(self.num_cells, shard_cells, boundaries, len(self.files))

    def plan_notes(self, partitions: Sequence[Partition]) -> list[str]:
        if len(partitions) < 2:
            return []
        again = sum(self.rows_decoded_before(p) for p in partitions)
        note = decoded_again_note(self.label, partitions, again, self.largest_row_group())
        return [] if note is None else [note]

    def rows_decoded_before(self, part: Partition) -> int:
        """The rows a read of ``part`` decodes before its first one: a read that starts inside a row
        group of a parquet file decodes it from its first row (pyarrow and DuckDB alike: Parquet
        cannot start in between). Local parquet files only (a remote footer is a round trip)."""
        if not part.spans:
            return 0
        f, lo, _ = part.spans[0]
        starts = self._group_starts(f)
        if starts is None:
            return 0
        return lo - int(starts[group_of(starts, lo)])

    def largest_row_group(self) -> int:
        """The most rows in one row group of the local parquet files whose row groups were read."""
        sizes = [int(np.diff(s).max()) for s in self._row_groups.values() if s is not None and len(s) > 1]
        return max(sizes, default=0)

    def _group_starts(self, f: int) -> np.ndarray | None:
        """The first rows of file ``f``'s row groups, and its row count last (None: not a local parquet
        file, or unreadable, which the read names)."""
        if f not in self._row_groups:
            path, starts = self.files[f], None
            if not is_remote(path) and path.suffix == ".parquet":
                try:
                    starts = row_group_starts(pq.read_metadata(path))
                except (OSError, pa.ArrowException):
                    pass
            self._row_groups[f] = starts
        return self._row_groups[f]

    def part_of(self, first: int, num_cells: int) -> Partition:
        if self._query is not None or self._where is not None or not self.files:
            msg = (
                f"{self.label}: a collection's member is read by cell range, which --where/--query "
                "inputs cannot be; materialize the filtered cells first, or query the whole collection"
            )
            raise DataValidationError(msg)
        return range_of_counts(self._counts, first, num_cells)

    def _row_counts(self) -> list[int]:
        try:
            return row_counts(self.files)
        except Exception as e:  # pyarrow and vortex raise their own errors for unreadable files
            msg = f"cannot read {self.label}: {e}"
            raise DataValidationError(msg) from e

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

    def _shaped(self, sql: str) -> str:
        """Rows in the internal layout: Tahoe's lists stripped of their CLS pair, or lists of other
        names (``peak_token_id`` / ``peak_accessibility``) under the internal ones."""
        if self.layout == TAHOE_LAYOUT:
            return tahoe_sql(sql)
        if self._lists == (GENE_COLUMN, VALUE_COLUMN):
            return sql
        tokens, values = (sql_ident(n) for n in self._lists)
        return (
            f"SELECT * EXCLUDE ({tokens}, {values}), {tokens} AS {GENE_COLUMN}, {values} AS {VALUE_COLUMN} "
            f"FROM ({sql})"
        )

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
            columns += [_FIRST_GENE, _FIRST_VALUE]
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
        open (`_STREAMS`, one per process), and the next read of this process that starts further
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
                stream = _STREAMS.take(key, lo) or _Stream(
                    key, path, lo, self._batch_cells, columns, use_threads
                )
                hi = stream.num_rows if hi is None else hi
                for row, rb in stream.rows(lo, hi):
                    rows = pa.RecordBatch.from_arrays(rb.columns, names=names)
                    yield self._to_batch(rows, obs, first_row, _FileRows(str(path), row))
                    first_row += rb.num_rows
                if stream.row < stream.num_rows:
                    _STREAMS.keep(stream)
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
            check_cls_pairs(rb.column(_FIRST_GENE), rb.column(_FIRST_VALUE), locate, self._cell_id_column)
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
        msg = f"cannot read {path}: {str(e).strip().splitlines()[0]}"
        raise DataValidationError(msg) from e


def _same_type(stored: pa.DataType, wanted: pa.DataType) -> bool:
    """A file's column type as DuckDB reports it (a dictionary-encoded column reads as its values)."""
    return stored == wanted or (pa.types.is_dictionary(stored) and stored.value_type == wanted)


def row_group_starts(metadata: pq.FileMetaData) -> np.ndarray:
    """The first row of each row group of a parquet file, and its row count last (int64)."""
    sizes = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
    return np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])


def cells_per_batch(metadata: pq.FileMetaData, column: str) -> int:
    """The cells a read of a parquet file decodes at a time by default: about `BATCH_VALUES` values
    of its list ``column`` (by the file's own count of them), as a power of two from 256 to
    `DEFAULT_BATCH_CELLS` (that, where the file has no such column or no rows).

    The arrays a batch passes through (Arrow's lists, the tokens and values, the encoded records)
    grow with its values. At 8,192 cells of ~1,500 nonzeros they are tens of MB each, past what the
    allocators keep for reuse, so every batch takes fresh pages, which the kernel zeroes: a fresh
    two-worker conversion of 50,000 such cells spent 2.5–5.0 s in the kernel against 0.6–1.5 s at
    2,048 cells, and 7.7–10.9 CPU-s in all against 6.2–7.9 (2-core AMD EPYC, 5 alternating runs)."""
    leaf = next(
        (j for j in range(metadata.num_columns) if metadata.schema.column(j).path.startswith(f"{column}.")),
        None,
    )
    groups = [metadata.row_group(g) for g in range(metadata.num_row_groups)]
    rows = sum(group.num_rows for group in groups)
    if leaf is None or not rows:
        return DEFAULT_BATCH_CELLS
    width = max(sum(group.column(leaf).num_values for group in groups) / rows, 1.0)  # values per row
    cells = 256
    while cells < DEFAULT_BATCH_CELLS and 2 * cells * width <= BATCH_VALUES:
        cells *= 2
    return cells


def group_of(starts: np.ndarray, row: int) -> int:
    """The row group (of `row_group_starts`' ``starts``) that holds ``row``."""
    return int(np.searchsorted(starts, row, side="right")) - 1


class _Stream:
    """An open read of a parquet file's rows from ``row`` on (``key``: whose read, of which file and
    columns): the batches still to come, and the rest of the batch last taken."""

    def __init__(
        self,
        key: tuple,
        path: Path,
        row: int,
        batch_cells: int | None,
        columns: list[str],
        use_threads: bool,
    ):
        """The read of ``path`` from the first row of the row group that holds ``row``, ``batch_cells``
        rows at a time (None: by the row width of its list ``columns[1]``, `cells_per_batch`)."""
        # read, not mapped: a file cut short raises, not SIGBUS; not pre-buffered: pyarrow keeps every
        # pre-buffered row group's raw bytes until the file is closed, and a stream goes on for as
        # many partitions as its process writes in a row
        reader = pq.ParquetFile(path, pre_buffer=False)
        self.key, self.starts = key, row_group_starts(reader.metadata)
        self.num_rows = int(self.starts[-1])
        group = self.group_of(row)
        self.row = int(self.starts[group])
        self._batches = reader.iter_batches(
            batch_cells or cells_per_batch(reader.metadata, columns[1]),
            row_groups=range(group, len(self.starts) - 1),
            columns=columns,
            use_threads=use_threads,
        )
        self._pending: pa.RecordBatch | None = None

    def group_of(self, row: int) -> int:
        return group_of(self.starts, row)

    def rows(self, lo: int, hi: int) -> Iterator[tuple[int, pa.RecordBatch]]:
        """``(first row, batch)`` of rows ``[lo, hi)`` (``lo >= self.row``); the rows before ``lo``
        are decoded and dropped."""
        while self.row < hi:
            rb = self._pending if self._pending is not None else next(self._batches, None)
            self._pending = None
            if rb is None:  # the file holds fewer rows than planned: the partition's count says so
                return
            a, b = max(lo - self.row, 0), min(hi - self.row, rb.num_rows)
            if b < rb.num_rows:
                self._pending = rb.slice(b)
            if a < b:
                yield self.row + a, rb.slice(a, b - a)
            self.row += b


class _Streams:
    """The stream a read of this process left open (at most one), taken by the read that goes on
    from it (any thread): one that starts at or after its row, in the same row group."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: _Stream | None = None

    def keep(self, stream: _Stream) -> None:
        with self._lock:
            self._open = stream

    def take(self, key: tuple, row: int) -> _Stream | None:
        with self._lock:
            stream, self._open = self._open, None
        if stream is None or stream.key != key or row < stream.row:
            return None
        if row < stream.num_rows and stream.group_of(row) != stream.group_of(stream.row):
            return None  # a later row group: a fresh read starts there, decoding nothing before it
        return stream

    def drop(self, owner: int) -> None:
        """Let go of the stream of the source ``owner`` (its ``id``), if it left one."""
        with self._lock:
            if self._open is not None and self._open.key[0] == owner:
                self._open = None


_STREAMS = _Streams()


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


def check_cls_pairs(first_gene: pa.Array, first_value: pa.Array, locate, cell_id_column: str) -> None:
    """Every Tahoe row starts with (gene 1, expression -2.0): name the first row that does not."""
    ok = pc.and_(pc.equal(first_gene, TAHOE_CLS_TOKEN), pc.equal(first_value, TAHOE_CLS_VALUE))
    ok = pc.fill_null(ok, False).to_numpy(zero_copy_only=False)
    if ok.all():
        return
    i = int(np.flatnonzero(~ok)[0])
    if first_gene[i].is_valid and first_value[i].is_valid:
        found = f"starts with (gene {first_gene[i].as_py()}, expression {first_value[i].as_py()})"
    else:
        found = "has empty or null genes/expressions lists"
    cell_id = "" if cell_id_column == CELL_ID_COLUMN else f"--cell-id {cell_id_column} "
    msg = (
        f"{locate(i)} {found} instead of Tahoe-100M's CLS pair (gene {TAHOE_CLS_TOKEN}, expression "
        f"{TAHOE_CLS_VALUE}), which every row of a genes/expressions table must start with; restore the "
        f"pair, or, for lists without it, read them as the internal layout: {cell_id}--query "
        '"SELECT * EXCLUDE (genes, expressions), genes AS gene_token_id, expressions AS gene_expression '
        'FROM cells"'
    )
    raise DataValidationError(msg)


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

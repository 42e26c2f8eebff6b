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
- **Tahoe-100M as published** (``tahoebio/Tahoe-100M`` on Hugging Face): list columns ``genes``
  and ``expressions``, each row starting with a CLS pair; see `_tahoe`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from omicsio_jax import DataValidationError
from omicsio_jax.format import (
    CELL_ID_COLUMN,
    FILE_ROW_COLUMN,
    FILENAME_COLUMN,
    GENE_COLUMN,
    VALUE_COLUMN,
    as_input_path,
    check_derived_gene_space,
    common_folder,
    connect,
    create_cells_view,
    damaged_hint,
    expand_files,
    find_gene_table,
    is_list_type,
    is_remote,
    register_s3,
    row_counts,
    sql_ident,
    sql_str,
)

from ._parquet_stream import PARQUET_STREAMS, group_of, row_group_starts
from ._plan import Partition, partitions_from_boundaries, partitions_from_counts, range_of_counts
from ._sidecars import carried_obs
from ._source import Source, decoded_again_note, gene_table_from_arrow, missing_columns
from ._table_read import TableReads
from ._tahoe import (
    FIRST_GENE,
    FIRST_VALUE,
    TAHOE_CELL_ID,
    TAHOE_LAYOUT,
    TAHOE_NUM_SPECIALS,
    check_no_special_tokens,
    detect_layout,
    find_tahoe_gene_table,
    tahoe_gene_table,
    tahoe_sql,
)

NO_GENE_TABLE = "give a gene table with --genes"  # `check_derived_gene_space`'s fix, for materialize


class TableSource(TableReads, Source):
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
            FIRST_GENE,
            FIRST_VALUE,
        }
        types = {f.name: f.type for f in schema if f.name not in hidden}
        if query is None and self.files:
            types = _with_stored_time_types(self.files, types)
        self.obs_columns = carried_obs(types, self.label)
        self.genes = self._gene_table(genes, find_genes)
        self.num_cells = self._count()

    def _schema_of(self, sql: str) -> pa.Schema:
        try:
            return self._con.sql(f"SELECT * FROM ({sql}) LIMIT 0").to_arrow_table().schema
        except duckdb.Error as e:
            raise DataValidationError(self._explain(e)) from e

    def _explain(self, e: duckdb.Error) -> str:
        text = str(e).strip().splitlines()[0]
        return f"cannot read {self.label}: {text}{damaged_hint(e)}"

    def _check_schema(self, schema: pa.Schema, published: pa.Schema) -> None:
        missing = [c for c in (self._cell_id_column, GENE_COLUMN, VALUE_COLUMN) if c not in schema.names]
        if missing:
            tahoe = f"; Tahoe-100M's is {TAHOE_CELL_ID}" if self.layout == TAHOE_LAYOUT else ""
            names = [n for n in published.names if n not in (FILENAME_COLUMN, FILE_ROW_COLUMN)]
            raise missing_columns(self.label, missing, names, self._cell_id_column, tahoe)
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
            if (
                found is not None
                and self.layout != TAHOE_LAYOUT
                and found.parent != common_folder(self.files)
            ):
                print(
                    f"materialize: genes from {found}, the nearest gene table in a folder above the input's; "
                    "pass --genes (genes=) to name another",
                    file=sys.stderr,
                )
        if genes is not None:
            if is_remote(genes):
                register_s3(self._con)
                # a missing bucket, an unreachable endpoint or bad credentials: the storage layer's
                # one-line error, not DuckDB's (whose text starts with the traceback of the
                # filesystem it called); a missing key is DuckDB's to report ("No files found")
                as_input_path(genes).exists()
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

    def row_in_file(self, row: int) -> tuple[str, int]:
        """The file of the dataset's ``row`` and its row there, where every row of the files is a cell
        (no ``--where`` or ``--query``); else the input, and ``row`` counted among its cells."""
        if self._counts is None:
            label = self.label if self._where is None else f"the cells of {self.label} that pass --where"
            return label, row
        ends = np.cumsum(self._counts)
        f = int(np.searchsorted(ends, row, side="right"))
        return str(self.files[f]), row - int(ends[f] - self._counts[f])

    def __getstate__(self) -> dict:
        """Pickled for partition workers without the DuckDB connection (each worker opens its own)."""
        return {**self.__dict__, "_con": None}

    def close(self) -> None:
        """Release the DuckDB connection (a read opens another where it needs one) and the parquet
        stream a read left open."""
        PARQUET_STREAMS.drop(id(self))
        self.rest()

    def rest(self) -> None:
        """Release the DuckDB connection, but not the parquet stream a read left open (one per
        process): the next partition of a worker's run goes on from it, where a fresh read would
        decode its row group again from the first row (a collection of 50 sources of 20,000 cells in
        row groups of 8,192 decoded ~5% of its cells twice)."""
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


def _with_stored_time_types(files: list, types: dict[str, pa.DataType]) -> dict[str, pa.DataType]:
    """``types`` (DuckDB's, by column) with the Arrow types parquet ``files`` keep for their durations
    and timestamps, where DuckDB reads others (a duration as its integer count, a timestamp in
    milliseconds or seconds as microseconds): the dataset keeps the files' unit and kind, where every
    file that has the column stores it so. Otherwise a timestamp keeps DuckDB's microseconds, which
    hold them all, and a duration in different units (counts of those units to DuckDB) is left out
    with a note. Files read only when the first holds such a column; other inputs: ``types``."""
    stored = _arrow_schema(files[0])
    kept = {
        f.name: f.type
        for f in stored or ()
        if f.name in types
        and f.type != types[f.name]
        and (
            pa.types.is_duration(f.type)
            or (pa.types.is_timestamp(f.type) and pa.types.is_timestamp(types[f.name]))
        )
    }
    mixed = set()
    for path in files[1:] if kept else ():
        schema = _arrow_schema(path)
        if schema is None:  # a file whose types are not known: DuckDB's for all
            kept = {}
            break
        for name in [n for n in kept if n in schema.names and schema.field(n).type != kept[n]]:
            if pa.types.is_duration(kept[name]):  # DuckDB's integers would be counts of different units
                print(
                    f"materialize: obs column {name!r} left out: it holds durations in {kept[name].unit} in "
                    f"{files[0]} and in {schema.field(name).type.unit} in {path} (cast it to one unit in "
                    "the input to keep it)",
                    file=sys.stderr,
                )
                mixed.add(name)
            del kept[name]
        if not kept:
            break
    return {name: kept.get(name, t) for name, t in types.items() if name not in mixed}


def _arrow_schema(path) -> pa.Schema | None:
    """A parquet file's Arrow schema (the one it stores), or None for another file or one that cannot
    be read (DuckDB's reading says what is wrong with it)."""
    if Path(path).suffix.lower() != ".parquet":
        return None
    try:
        return pq.read_schema(path)
    except (OSError, pa.ArrowException):
        return None

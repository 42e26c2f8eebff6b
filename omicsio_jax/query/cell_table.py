"""Progressive-refinement queries over list-column cell tables, through DuckDB.

Each stage reads only what it needs, so a question narrows the cells before touching the
expensive columns:

1. `CellTable.select` / `CellTable.metadata`: scalar columns only (projection; a ``where`` on
   hive partition columns prunes whole files).
2. `CellTable.cells_expressing`: gene presence via ``list_contains`` on ``gene_token_id``, never
   reading ``gene_expression`` (or via the inverted index, see `build_gene_index`).
3. `CellTable.panel`: a gene panel's expression for the chosen cells, by parallel list indexing
   (``list_position`` then ``gene_expression[pos]``) for small panels, or by streaming the rows
   through the numba panel scatter for large ones.
4. `CellTable.stream` / `CellTable.stream_csr`: full expression rows as Arrow record batches /
   CSR, in bounded memory.

Every row carries ``cell_rowid``, its position in the files taken in sorted order: the stable
handle the stages pass to each other (and the row of a dataset materialized from the same files).

`CellTable` runs the stages; the SQL that picks a query's cells is built in `cell_filter`, and a
panel's matrix in `panel_matrix`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from omicsio_jax.core.errors import DataValidationError, OmicsIOError
from omicsio_jax.format.arrow import is_list_type
from omicsio_jax.format.manifest import BOOL_CATEGORIES
from omicsio_jax.format.tables import (
    CELL_ID_COLUMN,
    GENE_COLUMN,
    ROWID_COLUMN,
    VALUE_COLUMN,
    check_derived_gene_space,
    connect,
    create_cells_view,
    expand_files,
    find_gene_table,
    sql_ident,
)
from omicsio_jax.query.cell_filter import checked_rowids, from_clause, presence_test, where_sql
from omicsio_jax.query.gene_table import GeneTable
from omicsio_jax.query.panel_matrix import (
    SQL_PANEL_MAX,
    panel_expression,
    panel_from_rows,
    scatter_panel_batches,
)
from omicsio_jax.query.results import CSRBatch, ObsSpec, PanelResult, arrow_csr, is_numeric_obs


class CellTable:
    """A list-column cell table (parquet file/directory/glob/hive partitions, or vortex files).

    >>> table = oj.open_table("atlas/")                                         # doctest: +SKIP
    >>> lung = table.select("tissue = 'lung'")                                  # stage 1: rowids
    >>> cd3 = table.cells_expressing(["CD3E", "CD3D"], mode="all", rowids=lung)  # stage 2
    >>> panel = table.panel(["CD3E", "CD8A", "GZMB"], rowids=cd3)               # stage 3: dense x
    >>> for batch in table.stream_csr(rowids=cd3): ...                          # stage 4: CSR

    ``con`` is the DuckDB connection: ``cells`` is the table (with ``cell_rowid``),
    ``gene_metadata`` the gene table, when an index is attached ``gene_cell_index``, and each
    further modality's table a view of its name (``modalities={"atac": "atac_cells/"}``), to join
    on ``cell_id``:

    >>> table = oj.open_table("rna_cells/", modalities={"atac": "atac_cells/"})   # doctest: +SKIP
    >>> table.sql("SELECT c.cell_id, len(a.peak_token_id) AS peaks FROM cells c "
    ...           "JOIN atac a USING (cell_id) WHERE c.drug = 'DMSO'")           # doctest: +SKIP
    """

    def __init__(
        self,
        spec: str | os.PathLike[str],
        *,
        genes: str | os.PathLike[str] | None = None,
        index: str | os.PathLike[str] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        threads: int | None = None,
        modalities: Mapping[str, str | os.PathLike[str]] | None = None,
    ):
        self.spec = str(spec)
        self.files = expand_files(self.spec)
        self.con = connect(threads)
        # one call on ``con`` at a time: DuckDB refuses a second ("connection is busy") rather than
        # waiting, and a stream's end checks its coverage with a query here while others run
        self._lock = threading.RLock()
        self.closed = False
        self._bases = create_cells_view(self.con, self.files, label=self.spec, rowid=True)
        self._prunable = self.files[0].suffix != ".vortex"
        self.schema = self.con.sql("SELECT * FROM cells LIMIT 0").to_arrow_table().schema
        for name in (GENE_COLUMN, VALUE_COLUMN):
            if name not in self.schema.names or not is_list_type(self.schema.field(name).type):
                msg = f"{self.spec} needs list columns {GENE_COLUMN} and {VALUE_COLUMN}; it has {', '.join(self.schema.names)}"
                raise DataValidationError(msg)
        self.num_cells = int(self.con.execute("SELECT count(*) FROM cells").fetchall()[0][0])
        if genes is None:
            found = find_gene_table(self.files)
            genes = None if found is None else str(found)
        if genes is not None:
            self.genes = GeneTable.load(genes, cache_dir=cache_dir)
        else:
            top = self.con.execute(f"SELECT max(list_max({GENE_COLUMN})) FROM cells").fetchall()[0][0]
            check_derived_gene_space(top, self.spec, "pass one with genes=")
            self.genes = GeneTable.from_token_ids(0 if top is None else int(top) + 1)
        self.modalities: dict[str, str] = {}
        self._modality_files: dict[str, list[Path]] = {}
        for name, table in (modalities or {}).items():
            if not name.isidentifier() or name in ("cells", "cells_all", "gene_metadata", "gene_cell_index"):
                msg = f"modality view name {name!r}: use a SQL identifier other than cells, gene_metadata, gene_cell_index"
                raise OmicsIOError(msg)
            self._modality_files[name] = expand_files(str(table))
            self.modalities[name] = str(table)
        self._add_views(self.con)
        self.index_path: Path | None = None
        if index is not None:
            self.attach_index(index)

    def close(self) -> None:
        """Close the table's DuckDB connection (idempotent); a query afterwards is an `OmicsIOError`."""
        with self._lock:
            self.closed = True
            self.con.close()

    def __enter__(self) -> CellTable:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CellTable({self.spec!r}, {self.num_cells} cells, {len(self.files)} file(s), {len(self.genes)} genes)"

    @property
    def scalar_columns(self) -> list[str]:
        """The columns stage 1 can read (everything but the list columns)."""
        return [f.name for f in self.schema if not is_list_type(f.type) and f.name != ROWID_COLUMN]

    # ----- helpers ---------------------------------------------------------------------------
    def sql(self, query: str) -> pa.Table:
        """Run any SQL over ``cells`` / ``gene_metadata`` / ``gene_cell_index`` and return Arrow.
        Safe from several threads: their queries take the table's connection in turn."""
        with self._lock:
            self._require_open()
            try:
                return self.con.sql(query).to_arrow_table()
            except duckdb.Error as e:
                msg = f"query over {self.spec} failed: {str(e).strip().splitlines()[0]}"
                raise OmicsIOError(msg) from e

    def _require_open(self) -> None:
        if self.closed:
            msg = (
                f"the table {self.spec} is closed (its with block ended, or close was called); open it again"
            )
            raise OmicsIOError(msg)

    def _query(
        self,
        head: str,
        where: str | None,
        rowids: Sequence[int] | np.ndarray | None,
        *extra: str,
        tail: str = "",
    ) -> pa.Table:
        """``head`` `from_clause` ``tail`` run on the table's connection, the ``rowids`` it registered
        there let go of after (a job selecting again and again would keep every set it gave)."""
        with self._lock:
            self._require_open()
            registered: list[str] = []
            try:
                return self.sql(f"{head}{self._from(where, rowids, *extra, registered=registered)}{tail}")
            finally:
                for name in registered:
                    self.con.unregister(name)

    def _from(
        self,
        where: str | None,
        rowids: Sequence[int] | np.ndarray | None,
        *extra: str,
        con: duckdb.DuckDBPyConnection | None = None,
        registered: list[str] | None = None,
    ) -> str:
        """`from_clause` over the table's files, ``rowids`` registered on ``con`` (default: the
        table's connection)."""
        return from_clause(
            self.con if con is None else con,
            where,
            rowids,
            *extra,
            files=self.files,
            bases=self._bases,
            prunable=self._prunable,
            num_cells=self.num_cells,
            registered=registered,
        )

    def obs_specs(self, names: Sequence[str]) -> list[ObsSpec]:
        """How each named obs column becomes an array, categories taken from the whole table (so
        codes are stable across queries)."""
        specs = []
        for name in names:
            self.require_columns([name])
            dtype = self.schema.field(name).type
            if is_numeric_obs(name, dtype, self.spec):
                specs.append(ObsSpec(name, None))
            else:  # a bool has both categories, as in a materialized dataset, whichever it holds
                bools = pa.types.is_boolean(dtype)
                specs.append(ObsSpec(name, BOOL_CATEGORIES if bools else tuple(self.categories(name))))
        return specs

    def check_where(self, where: str | None) -> None:
        """Refuse, in one line and before reading a row, a ``where`` that is not one expression over
        the table's columns (`where_sql`) or names a column it lacks."""
        if where:  # (an empty one is none, as in `from_clause`)
            self.sql(f"SELECT 1 FROM cells WHERE {where_sql(where)} LIMIT 0")

    def check_rowids(self, rowids: Sequence[int] | np.ndarray) -> np.ndarray:
        """``rowids`` sorted and unique, or a one-line error for ids that are not integers or lie
        outside the table (`checked_rowids`)."""
        return checked_rowids(rowids, self.num_cells)

    def require_columns(self, columns: Sequence[str]) -> list[str]:
        unknown = [c for c in columns if c not in self.schema.names]
        if unknown:
            msg = f"column(s) {', '.join(unknown)} not in {self.spec}; it has {', '.join(self.schema.names)}"
            raise OmicsIOError(msg)
        return list(columns)

    # ----- stage 1 ---------------------------------------------------------------------------
    def metadata(
        self,
        columns: Sequence[str] | None = None,
        *,
        where: str | None = None,
        rowids: Sequence[int] | np.ndarray | None = None,
    ) -> pa.Table:
        """Columns (default: every scalar one) of the matching cells, with ``cell_rowid``, in row order."""
        cols = self.require_columns(self.scalar_columns if columns is None else columns)
        select = ", ".join([ROWID_COLUMN, *(sql_ident(c) for c in cols if c != ROWID_COLUMN)])
        return self._query(f"SELECT {select}", where, rowids, tail=f" ORDER BY {ROWID_COLUMN}")

    def select(
        self, where: str | None = None, *, rowids: Sequence[int] | np.ndarray | None = None
    ) -> np.ndarray:
        """Sorted ``cell_rowid`` of the cells matching a predicate over scalar columns."""
        table = self._query(f"SELECT {ROWID_COLUMN}", where, rowids, tail=f" ORDER BY {ROWID_COLUMN}")
        return table.column(0).to_numpy().astype(np.int64)

    def categories(self, column: str, *, where: str | None = None) -> list:
        """Sorted distinct non-null values of a scalar column."""
        self.require_columns([column])
        col = sql_ident(column)
        return (
            self._query(f"SELECT DISTINCT {col}", where, None, f"{col} IS NOT NULL", tail=" ORDER BY 1")
            .column(0)
            .to_pylist()
        )

    # ----- stage 2 ---------------------------------------------------------------------------
    def cells_expressing(
        self,
        genes: Sequence[str | int] | str | int,
        *,
        mode: str = "any",
        where: str | None = None,
        rowids: Sequence[int] | np.ndarray | None = None,
        use_index: bool | None = None,
    ) -> np.ndarray:
        """Sorted ``cell_rowid`` of cells expressing any (or ``mode="all"``: every) given gene.

        Reads only ``gene_token_id`` (plus the columns ``where`` names). With an attached index
        (`attach_index`) and ``use_index`` not False, the lookup reads the index instead of
        scanning the lists, then applies ``where``/``rowids`` to the hits.
        """
        if mode not in ("any", "all"):
            msg = f"mode must be 'any' or 'all', got {mode!r}"
            raise OmicsIOError(msg)
        tokens = np.unique(self.genes.resolve(genes))
        if not len(tokens):  # "all" of no gene is every cell, "any" none: either is likelier a slip
            msg = "cells_expressing needs at least one gene, got none"
            raise OmicsIOError(msg)
        if use_index is None:
            use_index = self.index_path is not None
        if use_index:
            from omicsio_jax.format.gene_index import lookup

            if self.index_path is None:
                msg = "use_index=True but no index is attached: build one with `omicsio-materialize index`"
                raise OmicsIOError(msg)
            with self._lock:
                self._require_open()
                hits = lookup(self.con, tokens, mode=mode)
            if where is None and rowids is None:
                return hits
            if rowids is not None:
                hits = np.intersect1d(hits, self.check_rowids(rowids))
            return hits if where is None else self.select(where, rowids=hits)
        test = presence_test(tokens, mode)
        table = self._query(f"SELECT {ROWID_COLUMN}", where, rowids, test, tail=f" ORDER BY {ROWID_COLUMN}")
        return table.column(0).to_numpy().astype(np.int64)

    # ----- stage 3 ---------------------------------------------------------------------------
    def panel(
        self,
        genes: Sequence[str | int],
        *,
        where: str | None = None,
        rowids: Sequence[int] | np.ndarray | None = None,
        method: str = "auto",
        batch_rows: int = 8192,
    ) -> PanelResult:
        """Dense ``(cells, len(genes))`` float32 expression of a gene panel (0 where not expressed).

        ``method="sql"`` indexes the lists in DuckDB (one ``list_position`` per gene and cell:
        right for a few genes); ``"scatter"`` streams the rows through the numba panel scatter
        (one pass over each row: right for hundreds or thousands of genes); ``"auto"`` picks
        ``sql`` up to 64 genes.
        """
        tokens = self.genes.resolve(genes)
        names = self.genes.names(tokens)
        if len(np.unique(tokens)) != len(tokens):
            msg = "the panel names a gene twice"
            raise OmicsIOError(msg)
        if method == "auto":
            method = "sql" if len(tokens) <= SQL_PANEL_MAX else "scatter"
        if method == "sql":
            expr = panel_expression(tokens)
            table = self._query(
                f"SELECT {ROWID_COLUMN}, {expr} AS x", where, rowids, tail=f" ORDER BY {ROWID_COLUMN}"
            )
            return panel_from_rows(table, tokens, names)
        if method != "scatter":
            msg = f"method must be 'auto', 'sql' or 'scatter', got {method!r}"
            raise OmicsIOError(msg)
        batches = self.stream_csr(where=where, rowids=rowids, batch_rows=batch_rows)
        return scatter_panel_batches(batches, tokens, names, num_tokens=self.genes.num_tokens)

    # ----- stage 4 ---------------------------------------------------------------------------
    def stream(
        self,
        columns: Sequence[str] | None = None,
        *,
        where: str | None = None,
        rowids: Sequence[int] | np.ndarray | None = None,
        batch_rows: int = 8192,
    ) -> Iterator[pa.RecordBatch]:
        """Record batches of at most ``batch_rows`` rows in row order (``cell_rowid`` first), in
        bounded memory: DuckDB's streaming Arrow reader (``fetch_record_batch``), on a connection of
        the stream's own (`_reading_connection`), so that queries, and other streams, run while it
        is open (on the table's one connection each failed with DuckDB's "open result")."""
        if columns is None:  # the lists, and the cells' ids where the table has them
            columns = [GENE_COLUMN, VALUE_COLUMN, *[CELL_ID_COLUMN] * (CELL_ID_COLUMN in self.schema.names)]
        cols = self.require_columns([c for c in columns if c != ROWID_COLUMN])
        select = ", ".join([ROWID_COLUMN, *(sql_ident(c) for c in cols)])
        con = self._reading_connection()
        try:
            query = f"SELECT {select}{self._from(where, rowids, con=con)}"
            if rowids is not None:  # a semi-join may reorder rows
                query += f" ORDER BY {ROWID_COLUMN}"
            reader = con.sql(query).to_arrow_reader(batch_rows)
            for batch in reader:
                # DuckDB yields record batches of a fixed vector multiple; re-slice to batch_rows.
                for start in range(0, batch.num_rows, batch_rows):
                    yield batch.slice(start, batch_rows)
        except duckdb.Error as e:
            msg = f"streaming {self.spec} failed: {str(e).strip().splitlines()[0]}"
            raise OmicsIOError(msg) from e
        finally:
            con.close()

    def _reading_connection(self) -> duckdb.DuckDBPyConnection:
        """A new connection to the table's database with the views a ``where`` may name made again
        there: ``cells``, ``gene_metadata`` and the modalities' (a TEMP view and a registered table
        belong to the connection that made them; ``gene_cell_index`` is the database's). The files'
        rows are not counted again."""
        with self._lock:
            self._require_open()
            con = self.con.cursor()
        con.execute("SET enable_progress_bar = false")
        create_cells_view(con, self.files, label=self.spec, rowid=True, bases=self._bases)
        self._add_views(con)
        return con

    def _add_views(self, con: duckdb.DuckDBPyConnection) -> None:
        """``gene_metadata`` and the modalities' views on ``con``, beside its ``cells``: the table's
        connection, and each stream's again (`_reading_connection`)."""
        con.register("gene_metadata", self.genes.table)
        for name, files in self._modality_files.items():
            create_cells_view(con, files, label=self.modalities[name], name=name)

    def stream_csr(
        self,
        columns: Sequence[str] = (),
        *,
        where: str | None = None,
        rowids: Sequence[int] | np.ndarray | None = None,
        batch_rows: int = 8192,
    ) -> Iterator[CSRBatch]:
        """`stream` as CSR batches (see `arrow_csr`) plus the requested scalar columns."""
        for rb in self.stream(
            [GENE_COLUMN, VALUE_COLUMN, *columns], where=where, rowids=rowids, batch_rows=batch_rows
        ):
            indptr, indices, values = arrow_csr(rb)
            rows = rb.column(ROWID_COLUMN).to_numpy().astype(np.int64)
            yield CSRBatch(indptr, indices, values, rows, {c: rb.column(c) for c in columns})

    # ----- index -----------------------------------------------------------------------------
    def attach_index(self, path: str | os.PathLike[str]) -> None:
        """Use a `build_gene_index` output for gene-centric queries (view ``gene_cell_index``)."""
        from omicsio_jax.format.gene_index import open_index

        with self._lock:
            open_index(self.con, Path(path), table_spec=self.spec, table_fingerprint=self.fingerprint())
            self.index_path = Path(path)

    def fingerprint(self) -> dict:
        """What identifies the table's contents: each file's path, size and modification time."""
        out = []
        for f in self.files:
            st = f.stat()
            out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
        return {"files": out}


def open_table(
    spec: str | os.PathLike[str],
    *,
    genes: str | os.PathLike[str] | None = None,
    index: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    threads: int | None = None,
    modalities: Mapping[str, str | os.PathLike[str]] | None = None,
) -> CellTable:
    """Open list-column cell tables for queries: a parquet file, directory, glob or hive-partitioned
    folder, or vortex files. ``genes`` is the gene table (default: ``gene_metadata.parquet``
    beside the files), cached locally in ``cache_dir``; ``index`` attaches a gene index;
    ``modalities`` maps view names to the tables of further modalities of the same cells."""
    return CellTable(
        spec, genes=genes, index=index, cache_dir=cache_dir, threads=threads, modalities=modalities
    )

"""A further modality from a list-column table, aligned by ``cell_id`` with the primary's cells:
read as it is when its rows are the primary's cells in order, else spilled by partition first
(`_reorder`) (the overview: `materialize._modalities`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
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
    as_input_path,
    connect,
    create_cells_view,
    expand_files,
    is_remote,
    list_to_csr,
    sql_ident,
    sql_str,
)

from ._modality_features import check_same_genes, find_features, list_columns, read_features
from ._modality_inputs import ModalityInput
from ._parquet_stream import DEFAULT_BATCH_CELLS
from ._plan import Partition
from ._reorder import Spill, spill_by_partition
from ._source import Batch, Source
from ._tables import TableSource


class TableModality(Source):
    """A further modality from a list-column table, in the primary's row order (see `materialize._modalities`)."""

    def __init__(
        self,
        inp: ModalityInput,
        *,
        primary: str,
        primary_label: str,
        primary_cells: list[str],
        primary_genes: pa.Table,
        num_cells: int,
        shard_cells: int,
        spill: Path,
        require_all: bool,
        check_primary: bool = True,
        batch_cells: int = DEFAULT_BATCH_CELLS,
        subset: bool = False,
    ):
        """``primary_cells``: the primary's written partition sidecars, in order (their ``cell_id``);
        ``spill``: a local folder for the table's rows by partition, when they are not in the
        primary's order (see `_reorder`); ``subset``: the primary is a selection
        (``--where``/``--query``), so cells of the table outside it are left out, not refused."""
        self.name, self.layer = inp.name, inp.layer
        self.label = f"modality {inp.name} ({inp.table})"
        self._primary, self._primary_label = primary, primary_label
        self.num_cells = num_cells
        self.obs_columns = {}
        files = expand_files(inp.table)
        remote = any(not isinstance(f, Path) for f in files) or any(
            p.startswith("s3://") for p in primary_cells
        )
        con = connect(remote=remote)
        create_cells_view(con, files, label=inp.table, filename=True, file_rows=True, name="modality")
        schema = con.sql("SELECT * FROM modality LIMIT 0").to_arrow_table().schema
        if CELL_ID_COLUMN not in schema.names:
            msg = f"{self.label} has no {CELL_ID_COLUMN} column to align its cells by; it has {', '.join(schema.names)}"
            raise DataValidationError(msg)
        self.list_names = list_columns(schema, self.label)
        features = find_features(inp, files, self.list_names[0])
        if inp.layer:
            genes: pa.Table | None = primary_genes
            if inp.features is not None:
                check_same_genes(inp, read_features(inp.features, self.list_names[0]), primary_genes, primary)
        else:
            genes = None if features is None else read_features(features, self.list_names[0])
        self._require_all, self._subset = require_all, subset
        names = ", ".join(sql_str(p) for p in primary_cells)
        con.execute(
            f"CREATE VIEW primary_cells AS SELECT {CELL_ID_COLUMN}, row_number() OVER () - 1 AS __row "
            f"FROM read_parquet([{names}])"
        )
        self.present, self.aligned = self._align(con, inp, check_primary)
        self._reader = TableSource(
            inp.table, genes=genes, find_genes=False, batch_cells=batch_cells, lists=self.list_names
        )
        self._batch_cells, self._shard_cells = batch_cells, shard_cells
        self._spill: Spill | None = None
        self._parts: list[Partition] = []
        self._primary_cells: dict[int, str] = {}
        if not self.aligned:
            # the primary's partitions: one per shard, or one over every shard (a --query primary)
            first = 0
            for path in primary_cells:
                n = _num_rows(path)
                self._parts.append(Partition(first // shard_cells, first, n))
                self._primary_cells[first // shard_cells] = path
                first += n
            spill.mkdir(parents=True, exist_ok=True)
            spill_by_partition(
                con,
                self.list_names,
                num_rows=self._reader.num_cells,
                shard_cells=shard_cells,
                folder=spill,
                label=self.label,
                firsts=np.array([p.first_cell for p in self._parts], np.int64),
            )
            self._spill = Spill(spill)
        self.genes = self._reader.genes
        self.features_table = self._features_table(features)
        self.description = {
            "kind": "table",
            "modality": inp.name,
            "input": inp.table,
            "features": features,
            "files": [str(f) for f in files],
            "aligned": self.aligned,
            "present": int(self.present),
        }

    def _align(
        self, con: duckdb.DuckDBPyConnection, inp: ModalityInput, check_primary: bool
    ) -> tuple[int, bool]:
        """Check the cells can be aligned; return how many cells have the modality and whether the
        table's rows are already the primary's cells in order."""
        cid, where = sql_ident(CELL_ID_COLUMN), f"{FILENAME_COLUMN}, {FILE_ROW_COLUMN}"
        try:
            if check_primary:
                dup = con.sql(
                    f"SELECT {cid}, min(__row), max(__row) FROM primary_cells GROUP BY {cid} "
                    "HAVING count(*) > 1 ORDER BY 2 LIMIT 1"
                ).fetchall()
                if dup:
                    cell, a, b = dup[0]
                    msg = (
                        f"duplicate cell_id {cell} in the primary modality {self._primary} (rows {a} and {b} of "
                        f"{self._primary_label}): modalities are aligned by cell_id, which must be unique"
                    )
                    raise DataValidationError(msg)
            dup = con.sql(f"SELECT {cid} FROM modality GROUP BY {cid} HAVING count(*) > 1 LIMIT 1").fetchall()
            if dup:
                rows = con.execute(
                    f"SELECT {where} FROM modality WHERE {cid} = ? ORDER BY {where} LIMIT 2", [dup[0][0]]
                ).fetchall()
                msg = (
                    f"modality {inp.name}: duplicate cell_id {dup[0][0]} in row {rows[1][1]} of {rows[1][0]} "
                    f"(also row {rows[0][1]} of {rows[0][0]})"
                )
                raise DataValidationError(msg)
            null = con.sql(
                f"SELECT {where} FROM modality WHERE {cid} IS NULL ORDER BY {where} LIMIT 1"
            ).fetchall()
            if null:
                msg = f"modality {inp.name}: null cell_id in row {null[0][1]} of {null[0][0]}"
                raise DataValidationError(msg)
            stray = (
                []
                if self._subset
                else con.sql(
                    f"SELECT {cid}, {where} FROM modality ANTI JOIN primary_cells USING ({cid}) "
                    f"ORDER BY {where} LIMIT 1"
                ).fetchall()
            )
            if stray:
                cell, file, row = stray[0]
                msg = (
                    f"modality {inp.name}: cell_id {cell} in row {row} of {file} is not a cell of the primary "
                    f"modality {self._primary} ({self._primary_label}); a further modality's cells must be the "
                    "primary's"
                )
                raise DataValidationError(msg)
            present = con.sql(
                f"SELECT count(*) FROM modality SEMI JOIN primary_cells USING ({cid})"
            ).fetchall()[0][0]
            total = con.sql("SELECT count(*) FROM modality").fetchall()[0][0]
            if present < self.num_cells and self._require_all:
                cell, row = con.sql(
                    f"SELECT {cid}, __row FROM primary_cells ANTI JOIN modality USING ({cid}) "
                    "ORDER BY __row LIMIT 1"
                ).fetchall()[0]
                msg = (
                    f"modality {inp.name}: cell_id {cell} (row {row} of the primary {self._primary_label}) has no "
                    f"row in {inp.table} ({self.num_cells - present:,} cells lack it); without "
                    "--require-all-modalities they get empty rows and has_" + inp.name + " = False"
                )
                raise DataValidationError(msg)
            if present < self.num_cells or total > present:
                return present, False
            differ = con.sql(
                f"SELECT 1 FROM (SELECT {cid} AS a FROM primary_cells) POSITIONAL JOIN "
                f"(SELECT {cid} AS b FROM modality) WHERE a IS DISTINCT FROM b LIMIT 1"
            ).fetchall()
        except duckdb.Error as e:
            msg = f"cannot read {self.label}: {str(e).strip().splitlines()[0]}"
            raise DataValidationError(msg) from e
        return present, not differ

    def _features_table(self, features: str | None) -> pa.Table:
        """The feature table written with the modality: the primary's genes, the one given (its own
        column names), or the tokens seen."""
        if self.layer or features is None:
            return self.genes
        return self._reader.genes.rename_columns(
            [self.list_names[0] if n == GENE_COLUMN else n for n in self._reader.genes.column_names]
        )

    def publish(self, url: str) -> None:
        """Make the spilled partitions readable by workers on other machines (under ``url``)."""
        if self._spill is not None:
            self._spill.publish(url)

    def plan(self, shard_cells: int) -> list[Partition]:
        return self._reader.plan(shard_cells) if self.aligned else list(self._parts)

    def batches(
        self, obs: list[str], part: Partition | None = None, *, threads: int | None = None
    ) -> Iterator[Batch]:
        if self.aligned:
            for batch in self._reader.batches([], part, threads=threads):
                yield dataclasses.replace(batch, locate=_prefixed(self.name, batch.locate))
            return
        for p in [part] if part is not None else self.plan(self._shard_cells):
            yield from self._spilled_batches(p)

    def _spilled_batches(self, part: Partition) -> Iterator[Batch]:
        """Partition ``part`` from its spill file: its cells in the primary's order, absent ones empty."""
        ids = _read_cell_ids(self._primary_cells[part.index])
        tokens_column, values_column = self.list_names
        for table, rows, order in self._spill.partition(part.index):
            for lo in range(part.first_cell, part.end_cell, self._batch_cells):
                hi = min(part.end_cell, lo + self._batch_cells)
                i, j = np.searchsorted(rows, [lo, hi])
                positions = rows[i:j] - lo
                present = np.zeros(hi - lo, bool)
                present[positions] = True
                cell_ids = ids.slice(lo - part.first_cell, hi - lo)
                if j == i:
                    empty = np.zeros(hi - lo + 1, np.int64)
                    yield Batch(
                        empty,
                        np.zeros(0, np.int32),
                        np.zeros(0, np.float32),
                        cell_ids,
                        {},
                        lambda k, ids=cell_ids: f"modality {self.name}: cell_id {ids[k].as_py()}",
                        present,
                    )
                    continue
                sub = table.take(pa.array(order[i:j]))
                token_ptr, tokens = list_to_csr(sub.column(tokens_column).combine_chunks())
                value_ptr, values = list_to_csr(sub.column(values_column).combine_chunks())
                locate = _SourceLocator(
                    self.name, cell_ids, positions, sub.column(FILENAME_COLUMN), sub.column(FILE_ROW_COLUMN)
                )
                batch = Batch.from_arrow(
                    _spread(token_ptr, positions, hi - lo),
                    tokens,
                    _spread(value_ptr, positions, hi - lo),
                    values,
                    cell_ids,
                    {},
                    locate,
                    (tokens_column, values_column),
                )
                yield dataclasses.replace(batch, present=present)


def _spread(indptr: np.ndarray, positions: np.ndarray, num_rows: int) -> np.ndarray:
    """The CSR pointers of ``num_rows`` rows whose rows ``positions`` (ascending) are those of
    ``indptr``, the others empty."""
    counts = np.zeros(num_rows, np.int64)
    counts[positions] = np.diff(indptr)
    out = np.zeros(num_rows + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _num_rows(path: str) -> int:
    source = as_input_path(path).open("rb") if is_remote(path) else path
    return pq.read_metadata(source).num_rows


def _read_cell_ids(path: str) -> pa.Array:
    source = as_input_path(path).open("rb") if is_remote(path) else path
    return pq.read_table(source, columns=[CELL_ID_COLUMN]).column(0).combine_chunks()


def _prefixed(name: str, locate):
    return lambda i: f"modality {name}: {locate(i)}"


class _SourceLocator:
    """Names a batch row (at ``positions[k]``: the k-th spilled row) by the file and row it came from."""

    def __init__(self, name: str, cell_ids: pa.Array, positions: np.ndarray, files, rows):
        self.name, self.cell_ids, self.positions, self.files, self.rows = (
            name,
            cell_ids,
            positions,
            files,
            rows,
        )

    def __call__(self, i: int) -> str:
        k = int(np.searchsorted(self.positions, i))
        return (
            f"modality {self.name}: row {self.rows[k].as_py()} (cell_id {self.cell_ids[i].as_py()}) "
            f"of {self.files[k].as_py()}"
        )

"""DuckLake catalogs as an input: ``ducklake:CATALOG`` with a table and a snapshot.

``ducklake:lake.ducklake`` (a DuckDB file), ``ducklake:sqlite:lake.sqlite`` (or any SQLite file,
told by its header); the table by ``--table NAME`` or ``ducklake:CATALOG#NAME``; the snapshot by
``--snapshot N``, ``--at TIME`` (the last snapshot at or before it) or, by default, the latest.
The catalog is read as plain tables (`_ducklake_catalog`) and the data files by pyarrow
(`_ducklake_read`), so neither DuckDB's ducklake extension nor a DuckDB of its version is needed.

The cells are the table's rows at the snapshot in row-id order (insertion order, unchanged by
later compaction): materializing the same snapshot gives the same dataset, byte for byte,
whatever was committed since. Partitions are planned over the data files' rows less their
deletes, so each worker reads only its own files' row groups. ``--where`` first prunes whole files
by their partition values (or by number columns whose statistics say every row holds one value),
then is applied to the rows of the files left. The gene table is ``--genes``, else the lake's own
table ``gene_metadata`` at the same snapshot, else ``gene_metadata.parquet`` beside the catalog,
else the token ids seen.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from omicsio_jax import DataValidationError, OmicsIOError
from omicsio_jax.format import (
    CELL_ID_COLUMN,
    GENE_COLUMN,
    VALUE_COLUMN,
    check_derived_gene_space,
    connect,
    find_gene_table,
    is_list_type,
    is_remote,
    list_to_csr,
    register_s3,
    sql_str,
)

from ._ducklake_catalog import PREFIX, Catalog, lineage, resolve, split_spec
from ._ducklake_read import LakeReader, Run
from ._ducklake_table import LakeTable
from ._plan import Partition
from ._sidecars import carried_obs
from ._source import Batch, Source, gene_table_from_arrow, missing_columns
from ._tables import NO_GENE_TABLE

GENE_TABLE = "gene_metadata"
SMALL_BATCH = 256  # cells: smaller batches are joined (each batch costs the writer a fixed overhead)


def is_ducklake(spec) -> bool:
    return spec is not None and str(spec).startswith(PREFIX)


class DuckLakeSource(Source):
    """The cells of a DuckLake table at one snapshot (see the module doc)."""

    def __init__(
        self,
        spec: str,
        *,
        table: str | None = None,
        snapshot: int | str | datetime | None = None,
        where: str | None = None,
        genes: str | None = None,
        cell_id_column: str = CELL_ID_COLUMN,
        batch_cells: int | None = None,
    ):
        catalog_spec, named = split_spec(spec)
        if table is not None and named is not None and table != named:
            msg = f"{spec} names table {named!r} and --table names {table!r}; give one of them"
            raise OmicsIOError(msg)
        catalog = Catalog(catalog_spec)
        try:
            self.lake = lake = resolve(catalog, table or named or "", snapshot)
            gene_lake = self._gene_lake(catalog, lake) if genes is None else None
            digest, kind, folder = lineage(catalog, lake), catalog.kind, catalog.path.resolve().parent
        finally:
            catalog.close()
        self.label = lake.describe()
        self._cell_id_column, self._batch_cells, self._where = cell_id_column, batch_cells, where
        self._reader = LakeReader(lake, where=where)
        schema = pa.schema(list(self._reader.types.items()))
        self._check_schema(schema)
        self.schema = schema
        hidden = {cell_id_column, GENE_COLUMN, VALUE_COLUMN}
        self.obs_columns = carried_obs({f.name: f.type for f in schema if f.name not in hidden}, self.label)
        if where:
            self._reader.prune()
        self._reader.check_files()
        self._runs = self._reader.runs()
        self._kept: dict[int, np.ndarray] = {}  # packed masks of pieces that drop rows (this process only)
        counts = {}
        for piece in dict.fromkeys(p for p, _, _ in self._runs):
            keep = self._reader.kept(piece)
            if keep is not None:
                self._kept[piece] = np.packbits(keep)
        for piece, lo, hi, mask in self._masked_runs():
            counts[(piece, lo)] = hi - lo if mask is None else int(mask[lo:hi].sum())
        self.num_cells = sum(counts.values())
        self.description = {
            "kind": "ducklake",
            "input": spec,
            "catalog": lake.catalog,
            "catalog_kind": kind,
            "spec_version": lake.version,
            "table": lake.table,
            "table_uuid": lake.table_uuid,
            "snapshot": lake.snapshot,
            "snapshot_time": lake.snapshot_time,
            "lineage_sha256": digest,
            "where": where,
            "cell_id_column": cell_id_column,
        }  # no file names: a compaction after the snapshot rewrites them, not the snapshot's rows
        self.files = [_shown(f.path, folder) for f in lake.files]
        self.files_pruned = [self.files[i] for i in sorted(self._reader.pruned)]
        self.genes = self._gene_table(genes, gene_lake, folder)

    @staticmethod
    def _gene_lake(catalog: Catalog, lake: LakeTable) -> LakeTable | None:
        schema = lake.table.rpartition(".")[0]
        name = f"{schema}.{GENE_TABLE}" if schema else GENE_TABLE
        if name == lake.table:
            return None
        try:
            return resolve(catalog, name, lake.snapshot)
        except OmicsIOError:
            return None

    def _check_schema(self, schema: pa.Schema) -> None:
        missing = [c for c in (self._cell_id_column, GENE_COLUMN, VALUE_COLUMN) if c not in schema.names]
        if missing:
            raise missing_columns(self.label, missing, schema.names, self._cell_id_column)
        for name in (GENE_COLUMN, VALUE_COLUMN):
            if not is_list_type(schema.field(name).type):
                msg = f"column {name} of {self.label} must be a list column, got {schema.field(name).type}"
                raise DataValidationError(msg)

    def _gene_table(self, genes: str | None, gene_lake: LakeTable | None, folder: Path) -> pa.Table:
        if genes is not None:
            con = connect(remote=is_remote(genes))
            if is_remote(genes):
                register_s3(con)
            try:
                table = con.sql(f"SELECT * FROM {sql_str(str(genes))}").to_arrow_table()
            except duckdb.Error as e:
                msg = f"cannot read gene table {genes}: {str(e).splitlines()[0]}"
                raise DataValidationError(msg) from e
            self.description["genes"] = str(genes)
            return gene_table_from_arrow(table, str(genes))
        if gene_lake is not None:
            reader = LakeReader(gene_lake)
            reader.check_files()
            self.description["genes"] = gene_lake.describe()
            return gene_table_from_arrow(reader.read_all(), gene_lake.describe())
        found = find_gene_table([folder / "catalog"])
        if found is not None:
            self.description["genes"] = str(found)
            con = connect()
            return gene_table_from_arrow(
                con.sql(f"SELECT * FROM {sql_str(str(found))}").to_arrow_table(), str(found)
            )
        self.description["genes"] = None
        top = -1
        for batch in self.batches([]):
            if len(batch.tokens):
                top = max(top, int(batch.tokens.max()))
        check_derived_gene_space(top, self.label, NO_GENE_TABLE)
        return pa.table({GENE_COLUMN: pa.array(np.arange(top + 1, dtype=np.int32))})

    def __getstate__(self) -> dict:
        """Pickled for partition workers without the masks (a worker finds its own rows)."""
        return {**self.__dict__, "_kept": {}}

    def _mask(self, piece: int) -> np.ndarray | None:
        packed = self._kept.get(piece)
        if packed is None:
            return None
        piece_rows = (
            self.lake.inlined.num_rows
            if piece == self._reader.inlined
            else self.lake.files[piece].record_count
        )
        return np.unpackbits(packed, count=piece_rows).astype(bool)

    def _masked_runs(self) -> Iterator[tuple[int, int, int, np.ndarray | None]]:
        """The runs with their piece's kept rows (None: all), each mask unpacked once: a piece's runs
        need not be adjacent (row ids that interleave)."""
        last = {piece: n for n, (piece, _, _) in enumerate(self._runs)}
        masks: dict[int, np.ndarray | None] = {}
        for n, (piece, lo, hi) in enumerate(self._runs):
            if piece not in masks:
                masks[piece] = self._mask(piece)
            yield piece, lo, hi, masks[piece]
            if last[piece] == n:
                del masks[piece]

    def plan(self, shard_cells: int) -> list[Partition]:
        """Shard-aligned partitions over the runs: each span is (piece, first position, end position)."""
        out: list[Partition] = []
        spans: list[Run] = []
        first = filled = 0
        for piece, lo, hi, mask in self._masked_runs():
            kept = None if mask is None else np.flatnonzero(mask[lo:hi]) + lo
            left = hi - lo if kept is None else len(kept)
            a, used = lo, 0
            while left > 0:
                take = min(left, shard_cells - filled)
                b = a + take if kept is None else int(kept[used + take - 1]) + 1
                spans.append((piece, a, b))
                filled, left, used, a = filled + take, left - take, used + take, b
                if filled == shard_cells:
                    out.append(Partition(len(out), first, filled, _joined(spans)))
                    first, filled, spans = first + filled, 0, []
        if filled:
            out.append(Partition(len(out), first, filled, _joined(spans)))
        return out

    def batches(
        self, obs: list[str], part: Partition | None = None, *, threads: int | None = None
    ) -> Iterator[Batch]:
        spans = self._runs if part is None or part.spans is None else part.spans
        names = list(
            dict.fromkeys(
                [self._cell_id_column, GENE_COLUMN, VALUE_COLUMN, *obs, *self._reader.where_columns]
            )
        )
        con = connect(threads) if self._where else None
        last = {piece: n for n, (piece, _, _) in enumerate(spans)}
        ends: dict[int, int] = {}
        for piece, _, hi in spans:
            ends[piece] = max(ends.get(piece, 0), hi)
        open_: dict[int, tuple[Cursor, np.ndarray | None]] = {}  # piece → its scan and dropped rows
        held: list[Batch] = []  # small batches (short spans of pieces that interleave), to be joined
        held_cells = 0
        try:
            for n, (piece, lo, hi) in enumerate(spans):
                if piece not in open_:
                    cursor = Cursor(self._reader, piece, names, ends[piece], self._batch_cells, threads)
                    open_[piece] = (cursor, self._dropped(piece))
                cursor, drop = open_[piece]
                for first, rb in cursor.read(lo, hi):
                    positions = np.arange(first, first + rb.num_rows)
                    keep = np.ones(rb.num_rows, bool) if drop is None else ~drop[first : first + rb.num_rows]
                    if self._where:
                        keep &= self._reader.passes(rb, con)
                    if not keep.all():
                        rb, positions = rb.filter(pa.array(keep)), positions[keep]
                    if not rb.num_rows:
                        continue
                    batch = self._to_batch(rb, obs, piece, positions)
                    if batch.num_cells >= SMALL_BATCH:
                        if held:
                            yield _joined_batches(held)
                            held, held_cells = [], 0
                        yield batch
                        continue
                    held.append(batch)
                    held_cells += batch.num_cells
                    if held_cells >= SMALL_BATCH:
                        yield _joined_batches(held)
                        held, held_cells = [], 0
                if last[piece] == n:
                    open_.pop(piece)[0].close()
            if held:
                yield _joined_batches(held)
        finally:
            for cursor, _ in open_.values():
                cursor.close()

    def _dropped(self, piece: int) -> np.ndarray | None:
        """The rows of a piece dropped before ``where``: deleted, or committed after the snapshot."""
        if piece == self._reader.inlined:
            return None
        alive = self._reader.alive(piece)
        return None if alive is None else ~alive

    def _to_batch(self, rb: pa.RecordBatch, obs: list[str], piece: int, positions: np.ndarray) -> Batch:
        locate = _Rows(self._reader.label(piece), positions, rb.column(self._cell_id_column))
        cell_ids = rb.column(self._cell_id_column)
        if cell_ids.null_count:
            i = int(np.flatnonzero(cell_ids.is_null().to_numpy(zero_copy_only=False))[0])
            msg = f"cell id column {self._cell_id_column} is null in {locate(i)} ({self.label})"
            raise DataValidationError(msg)
        if not pa.types.is_string(cell_ids.type):
            cell_ids = cell_ids.cast(pa.string())
        gene_ptr, genes = list_to_csr(rb.column(GENE_COLUMN))
        value_ptr, values = list_to_csr(rb.column(VALUE_COLUMN))
        return Batch.from_arrow(
            gene_ptr, genes, value_ptr, values, cell_ids, {n: rb.column(n) for n in obs}, locate
        )


class Cursor:
    """One piece's rows ``[.., end)`` read span by span: a span at or after the last one read goes on
    with the same scan, so the many short spans of pieces whose row ids interleave cost one pass over
    the piece, not one scan each."""

    def __init__(self, reader: LakeReader, piece: int, names: list[str], end: int, batch_cells, threads):
        self._reader, self._piece, self._names, self._end = reader, piece, names, end
        self._batch_cells, self._threads = batch_cells, threads
        self._scan: Iterator[tuple[int, pa.RecordBatch]] | None = None
        self._at, self._rb = 0, None  # the first position of the batch held (or of the next one)

    def read(self, lo: int, hi: int) -> Iterator[tuple[int, pa.RecordBatch]]:
        """Positions ``[lo, hi)`` as (first position, batch)."""
        if self._scan is None or lo < self._at:
            self.close()
            self._scan = self._reader.read(
                self._piece, lo, self._end, self._names, batch_cells=self._batch_cells, threads=self._threads
            )
            self._at, self._rb = lo, None
        while True:
            if self._rb is None:
                got = next(self._scan, None)
                if got is None:
                    return
                self._at, self._rb = got
            end = self._at + self._rb.num_rows
            a, b = max(lo, self._at), min(hi, end)
            if a < b:
                yield a, self._rb.slice(a - self._at, b - a)
            if end > hi:
                return
            self._at, self._rb = end, None
            if end == hi:
                return

    def close(self) -> None:
        if self._scan is not None:
            self._scan.close()
        self._scan, self._rb = None, None


def _joined_batches(batches: list[Batch]) -> Batch:
    """Consecutive batches as one (their columns have the snapshot's types)."""
    if len(batches) == 1:
        return batches[0]
    starts = np.cumsum([0, *(b.num_cells for b in batches)])
    nnz = np.cumsum([0, *(int(b.indptr[-1]) for b in batches)])
    indptr = np.concatenate(
        [np.zeros(1, np.int64), *(b.indptr[1:] + n for b, n in zip(batches, nnz, strict=False))]
    )

    def locate(i: int) -> str:
        k = int(np.searchsorted(starts, i, side="right")) - 1
        return batches[k].locate(i - int(starts[k]))

    return Batch(
        indptr,
        np.concatenate([b.tokens for b in batches]),
        np.concatenate([b.values for b in batches]),
        pa.concat_arrays([b.cell_ids for b in batches]),
        {n: pa.concat_arrays([b.obs[n] for b in batches]) for n in batches[0].obs},
        locate,
    )


def _joined(spans: list[Run]) -> tuple[Run, ...]:
    """Adjacent spans of one piece as one."""
    out: list[Run] = []
    for piece, a, b in spans:
        if out and out[-1][0] == piece and out[-1][2] == a:
            out[-1] = (piece, out[-1][1], b)
        else:
            out.append((piece, a, b))
    return tuple(out)


def _shown(path: str, folder: Path) -> str:
    """A data file as the manifest records it: relative to the catalog's folder when inside it."""
    if is_remote(path):
        return path
    rel = os.path.relpath(path, folder)
    return path if rel.startswith("..") else rel


class _Rows:
    """Describes a batch row as "row R (cell_id X) of FILE", R its position in the file."""

    def __init__(self, label: str, positions: np.ndarray, cell_ids: pa.Array):
        self.label, self.positions, self.cell_ids = label, positions, cell_ids

    def __call__(self, i: int) -> str:
        cell = self.cell_ids[i].as_py()
        return f"row {int(self.positions[i])} (cell_id {cell}) of {self.label}"

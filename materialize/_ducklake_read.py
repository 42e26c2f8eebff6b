"""The rows of a resolved DuckLake table (`_ducklake_table.LakeTable`), read from its parquet files
and inlined rows by pyarrow, in row-id order.

A table's rows are its data files' rows and its inlined rows. Every row has a row id (an inlined
row's ``row_id``; a file's ``_ducklake_internal_row_id`` column where it has one, as the files
written by UPDATE, ``ducklake_merge_adjacent_files`` and ``ducklake_rewrite_data_files`` do, else
``row_id_start`` + position), unique among the rows of a snapshot and unchanged by UPDATE and
compaction, so reading the rows of a snapshot in row-id order gives the same sequence however the
files were later rewritten. The order is kept by *runs*: stretches of positions of one file (or of
the inlined rows) with consecutive row ids, sorted by their first row id (usually one run per
file). Where the row ids of pieces interleave (an UPDATE's new file and the rows it replaced,
deleted from the old one), those pieces' runs are cut at their dead rows, then rejoined where
nothing falls between. A row is *alive* when it is visible at the snapshot (a merged file's rows
carry their commit's snapshot) and not deleted (the file's delete file lists positions); it is
kept when alive and, with ``where``, passing it. The files are opened, and checked against the
catalog before they are read, by `_ducklake_files`.
"""

from __future__ import annotations

from collections.abc import Iterator

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from omicsio_jax import DataValidationError
from omicsio_jax.format import GENE_COLUMN, is_remote, sql_ident

from ._ducklake_files import check_file, open_file, read_deletes
from ._ducklake_table import ROW_ID, Column, DataFile, LakeTable, empty_table
from ._ducklake_types import sql_literal
from ._parquet_stream import DEFAULT_BATCH_CELLS, cells_per_batch, row_group_starts

INTERNAL_ROW_ID, INTERNAL_SNAPSHOT = "_ducklake_internal_row_id", "_ducklake_internal_snapshot_id"
FIELD_ID = b"PARQUET:field_id"
TAIL_BYTES = 1 << 16  # read at the end of a data file: its footer, in one request on object storage

Run = tuple[int, int, int]  # (piece, first position, end position): piece len(files) is the inlined rows


class LakeReader:
    """Reads `LakeTable` rows; ``where`` is a DuckDB predicate over the table's columns (view ``cells``)."""

    def __init__(self, lake: LakeTable, *, where: str | None = None):
        self.lake, self.where = lake, where
        self.types = {f.name: f.type for f in empty_table(lake.columns).schema if f.name != ROW_ID}
        self.where_columns = self._bind_where() if where else []
        self.deletes: list[np.ndarray | None] = [None] * len(lake.files)
        self.pruned: set[int] = set()
        self.with_row_ids: set[int] = set()  # files whose footer names INTERNAL_ROW_ID (set by check_files)

    @property
    def inlined(self) -> int:
        return len(self.lake.files)

    def label(self, piece: int) -> str:
        return "the rows inlined in the catalog" if piece == self.inlined else self.lake.files[piece].path

    def _bind_where(self) -> list[str]:
        """The columns ``where`` needs: the scalar ones if it binds to them alone, else all."""
        empty = empty_table(self.lake.columns).drop_columns([ROW_ID])
        scalar = [n for n, t in self.types.items() if not pa.types.is_nested(t)]
        con = duckdb.connect()
        for names in (scalar, list(self.types)):
            con.register("cells", empty.select(names))
            try:
                con.execute(f"SELECT ({self.where}) FROM cells LIMIT 0")
                return names
            except duckdb.Error as e:
                error = e
        msg = f"--where {self.where!r} cannot be applied to {self.lake.describe()}: {str(error).splitlines()[0]}"
        raise DataValidationError(msg) from error

    # -- before any data file is read ------------------------------------------------------------

    def prune(self) -> None:
        """Files whose rows all fail ``where``, known from partition values or equal min/max
        statistics (every row holds the same value), without opening them."""
        groups: dict[tuple[str, ...], list[int]] = {}
        for i, f in enumerate(self.lake.files):
            if f.constants:
                groups.setdefault(tuple(sorted(f.constants)), []).append(i)
        types = {c.name: c.sql_type for c in self.lake.columns}
        con = duckdb.connect()
        for names, members in groups.items():
            if any(n not in types for n in names):
                continue
            rows = ", ".join(
                "("
                + ", ".join(
                    [
                        str(i),
                        *(
                            f"CAST({sql_literal(self.lake.files[i].constants[n])} AS {types[n]})"
                            for n in names
                        ),
                    ]
                )
                + ")"
                for i in members
            )
            header = ", ".join(["__piece", *(sql_ident(n) for n in names)])
            try:
                passing = con.execute(
                    f"SELECT __piece FROM (VALUES {rows}) cells({header}) WHERE coalesce(({self.where}), false)"
                ).fetchall()
            except duckdb.Error:
                continue  # it needs other columns: these files are read
            self.pruned |= set(members) - {p for (p,) in passing}

    def check_files(self) -> None:
        """Every data and delete file still read is there, with the size (and footer size) the
        catalog recorded; then the deleted positions are read. A data file whose footer names
        `INTERNAL_ROW_ID` has its row ids there (`runs` reads the column; a name that is only in
        the footer's metadata reads as absent there)."""
        marker = INTERNAL_ROW_ID.encode()
        for i, f in enumerate(self.lake.files):
            if i in self.pruned:
                continue
            if marker in check_file(
                self.lake, f.path, f.file_size_bytes, f.footer_size, "data file", TAIL_BYTES
            ):
                self.with_row_ids.add(i)
            if f.delete is not None:
                check_file(
                    self.lake, f.delete.path, f.delete.file_size_bytes, f.delete.footer_size, "delete file"
                )
                self.deletes[i] = read_deletes(self.lake, f)

    # -- runs and kept rows ------------------------------------------------------------------------

    def runs(self) -> list[Run]:
        """Every (unpruned) piece's runs, in row-id order (after `check_files`)."""
        pieces: dict[int, np.ndarray | int] = {}  # piece → its row ids, or the first of consecutive ones
        for i, f in enumerate(self.lake.files):
            if i in self.pruned or f.record_count == 0:
                continue
            ids = self._internal(i, INTERNAL_ROW_ID) if i in self.with_row_ids else None
            if ids is not None:
                pieces[i] = ids.astype(np.int64, copy=False)
            elif f.row_id_start is not None:
                pieces[i] = f.row_id_start
            else:  # no row ids at all (never written so): after every other row, by file
                pieces[i] = (1 << 62) + (f.data_file_id << 32)
        if self.lake.inlined.num_rows:
            pieces[self.inlined] = self.lake.inlined.column(ROW_ID).to_numpy()
        spans = {
            p: (ids, ids + self._rows(p) - 1) if isinstance(ids, int) else (int(ids.min()), int(ids.max()))
            for p, ids in pieces.items()
        }
        interleaved = _overlapping(spans)
        keyed: list[tuple[int, int, int, Run]] = []  # (first row id, piece, run's index in the piece, run)
        for p, ids in pieces.items():
            if isinstance(ids, int) and p not in interleaved:
                keyed.append((ids, p, 0, (p, 0, self._rows(p))))
                continue
            if isinstance(ids, int):
                ids = np.arange(ids, ids + self._rows(p), dtype=np.int64)
            alive = self.alive(p) if p in interleaved and p != self.inlined else None
            runs = _consecutive(ids, alive)
            keyed += [(int(ids[a]), p, k, (p, a, b)) for k, (a, b) in enumerate(runs)]
        keyed.sort()
        out: list[Run] = []
        for n, (_, p, k, (_, a, b)) in enumerate(keyed):
            if out and out[-1][0] == p and keyed[n - 1][2] == k - 1:  # the piece's next run: rejoined
                out[-1] = (p, out[-1][1], b)
            else:
                out.append((p, a, b))
        return out

    def _rows(self, piece: int) -> int:
        return self.lake.inlined.num_rows if piece == self.inlined else self.lake.files[piece].record_count

    def _internal(self, piece: int, name: str) -> np.ndarray | None:
        f = self.lake.files[piece]
        try:
            reader = pq.ParquetFile(open_file(f.path))
            if name not in reader.schema_arrow.names:
                return None
            return reader.read(columns=[name]).column(name).to_numpy()
        except (OSError, pa.ArrowException) as e:
            msg = f"cannot read {f.path} of {self.lake.describe()}: {e}"
            raise DataValidationError(msg) from e

    def visible(self, piece: int) -> np.ndarray | None:
        """Which rows of a merged file were committed by the snapshot (None: all)."""
        f = self.lake.files[piece]
        if not f.partial:
            return None
        snaps = self._internal(piece, INTERNAL_SNAPSHOT)
        if snaps is not None:
            return snaps <= self.lake.snapshot
        counts = [tuple(int(x) for x in item.split(":")) for item in f.partial.split("|") if ":" in item]
        upto = max((n for s, n in counts if s <= self.lake.snapshot), default=0)
        return np.arange(f.record_count) < upto

    def alive(self, piece: int) -> np.ndarray | None:
        """The rows of a data file visible at the snapshot and not deleted (None: all)."""
        keep = self.visible(piece)
        if self.deletes[piece] is not None:
            keep = np.ones(self.lake.files[piece].record_count, bool) if keep is None else keep
            keep[self.deletes[piece]] = False
        return keep

    def kept(self, piece: int) -> np.ndarray | None:
        """The rows of a piece kept (None: all), reading the columns ``where`` needs if it has one."""
        keep = self.alive(piece) if piece < self.inlined else None
        if self.where:
            passed = [self.passes(rb) for _, rb in self.read(piece, 0, None, self.where_columns)]
            mask = np.concatenate(passed) if passed else np.zeros(0, bool)
            keep = mask if keep is None else keep & mask
        return keep

    def passes(self, rb: pa.RecordBatch, con: duckdb.DuckDBPyConnection | None = None) -> np.ndarray:
        con = con or duckdb.connect()
        con.register("cells", rb.select(self.where_columns))
        try:
            out = con.execute(f"SELECT coalesce(({self.where}), false) FROM cells").fetchnumpy()
        except duckdb.Error as e:
            msg = f"--where {self.where!r} failed on {self.lake.describe()}: {str(e).splitlines()[0]}"
            raise DataValidationError(msg) from e
        finally:
            con.unregister("cells")
        return np.asarray(next(iter(out.values())), dtype=bool)

    # -- reading -----------------------------------------------------------------------------------

    def read(
        self,
        piece: int,
        lo: int,
        hi: int | None,
        names: list[str],
        *,
        batch_cells: int | None = None,
        threads: int | None = None,
    ) -> Iterator[tuple[int, pa.RecordBatch]]:
        """Positions ``[lo, hi)`` of a piece as (first position, batch of the columns ``names``),
        ``batch_cells`` rows at a time (None: a data file's by its row width, `cells_per_batch`)."""
        if piece == self.inlined:
            table = self.lake.inlined.select(names)
            end = table.num_rows if hi is None else hi
            step = batch_cells or DEFAULT_BATCH_CELLS
            for a in range(lo, end, step):
                for rb in table.slice(a, min(step, end - a)).combine_chunks().to_batches():
                    yield a, rb
                    a += rb.num_rows
            return
        f = self.lake.files[piece]
        try:
            yield from self._read_file(
                f, lo, f.record_count if hi is None else hi, names, batch_cells, threads
            )
        except (OSError, pa.ArrowException) as e:
            msg = f"cannot read {f.path} of {self.lake.describe()}: {e}"
            raise DataValidationError(msg) from e

    def _read_file(self, f: DataFile, lo: int, hi: int, names: list[str], batch_cells: int | None, threads):
        # read, not mapped: a file cut short raises, not SIGBUS; pre-buffered (ranges coalesced into
        # fewer requests) on object storage only: pyarrow keeps pre-buffered row groups' raw bytes
        # until the file is closed, fresh memory per row group that a local read does not need
        reader = pq.ParquetFile(open_file(f.path), pre_buffer=is_remote(f.path))
        stored = _field_names(reader.schema_arrow, f.names)
        by_name = {c.name: c for c in self.lake.columns}
        read = list(
            dict.fromkeys(stored[by_name[n].column_id] for n in names if by_name[n].column_id in stored)
        )
        fill = {n: self._constant(f, by_name[n]) for n in names if by_name[n].column_id not in stored}
        starts = row_group_starts(reader.metadata)
        groups = [g for g in range(len(starts) - 1) if starts[g] < hi and starts[g + 1] > lo]
        row = int(starts[groups[0]]) if groups else lo
        if batch_cells is None:
            genes = by_name.get(GENE_COLUMN)
            stored_genes = None if genes is None else stored.get(genes.column_id)
            batch_cells = DEFAULT_BATCH_CELLS
            if stored_genes is not None:
                batch_cells = cells_per_batch(reader.metadata, stored_genes)
        batches = reader.iter_batches(
            batch_cells, row_groups=groups, columns=read, use_threads=threads is None or threads > 1
        )
        for rb in batches:
            a, b = max(lo - row, 0), min(hi - row, rb.num_rows)
            if a < b:
                part = rb.slice(a, b - a)
                columns = []
                for n in names:
                    if n in fill:
                        columns.append(fill[n].take(np.zeros(b - a, np.int64)))
                    else:
                        columns.append(_conform(part.column(stored[by_name[n].column_id]), self.types[n]))
                yield row + a, pa.RecordBatch.from_arrays(columns, names=names)
            row += rb.num_rows

    def _constant(self, f: DataFile, column: Column) -> pa.Array:
        """One value of a column a file does not store: its partition value, else the column's
        initial default (null without one)."""
        value = f.partition.get(column.column_id, column.initial_default)
        return (
            duckdb.connect()
            .sql(f"SELECT CAST({sql_literal(value)} AS {column.sql_type}) AS v")
            .to_arrow_table()
            .column(0)
            .combine_chunks()
        )

    def read_all(self, names: list[str] | None = None) -> pa.Table:
        """Every kept row (a small table: the gene table), in row-id order."""
        names = list(self.types) if names is None else names
        pieces, kept = [], {}
        for piece, lo, hi in self.runs():
            keep = kept[piece] if piece in kept else kept.setdefault(piece, self.kept(piece))
            for first, rb in self.read(piece, lo, hi, names):
                if keep is not None:
                    rb = rb.filter(pa.array(keep[first : first + rb.num_rows]))
                pieces.append(rb)
        if not pieces:
            return empty_table(self.lake.columns).select(names)
        return pa.Table.from_batches(pieces)


def _field_names(schema: pa.Schema, mapping: dict[int, str] | None) -> dict[int, str]:
    """Field id → top-level column name of a data file (its parquet field ids, or the catalog's name
    mapping for a file written without them)."""
    if mapping is not None:
        return {fid: name for fid, name in mapping.items() if name in schema.names}
    out = {}
    for field in schema:
        if field.metadata and FIELD_ID in field.metadata:
            out[int(field.metadata[FIELD_ID])] = field.name
    return out


def _conform(array: pa.Array, target: pa.DataType) -> pa.Array:
    """A stored column as the snapshot's type (a promoted type, a dictionary decoded); list columns
    whose values already match are kept as they are (their child field's name aside)."""
    if array.type == target:
        return array
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    if (
        (pa.types.is_list(array.type) or pa.types.is_large_list(array.type))
        and pa.types.is_list(target)
        and array.type.value_type == target.value_type
    ):
        return array
    return array.cast(target)


def _overlapping(spans: dict[int, tuple[int, int]]) -> set[int]:
    """The pieces whose row-id span (first, last) meets another's."""
    order = sorted(spans, key=lambda p: spans[p])
    out, reach = set(), None  # reach: the largest last row id of the pieces before
    for n, p in enumerate(order):
        first, last = spans[p]
        if (reach is not None and reach >= first) or (n + 1 < len(order) and spans[order[n + 1]][0] <= last):
            out.add(p)
        reach = last if reach is None else max(reach, last)
    return out


def _consecutive(ids: np.ndarray, alive: np.ndarray | None = None) -> list[tuple[int, int]]:
    """Position ranges over which ``ids`` go up by one (with ``alive``: of alive rows only, cut at
    every dead one)."""
    if len(ids) == 0:
        return []
    if alive is None:
        cuts = np.flatnonzero(np.diff(ids) != 1) + 1
        edges = [0, *cuts.tolist(), len(ids)]
        return list(zip(edges[:-1], edges[1:], strict=True))
    at = np.flatnonzero(alive)
    if len(at) == 0:
        return []
    cuts = np.flatnonzero((np.diff(at) != 1) | (np.diff(ids[at]) != 1)) + 1
    starts, ends = at[np.r_[0, cuts]], at[np.r_[cuts - 1, len(at) - 1]] + 1
    return list(zip(starts.tolist(), ends.tolist(), strict=True))

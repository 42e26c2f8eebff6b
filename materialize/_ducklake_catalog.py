"""A DuckLake catalog read as plain tables: which rows of which files make a table at a snapshot.

DuckLake (ducklake.select, specification 0.3) keeps a table's metadata in ordinary tables of a
DuckDB or SQLite database: ``ducklake_snapshot`` (one row per commit), ``ducklake_table`` and
``ducklake_column`` (valid from ``begin_snapshot`` until ``end_snapshot``, exclusive),
``ducklake_data_file`` (parquet files, paths relative to the table's folder, which is relative to
its schema's, which is relative to ``data_path`` in ``ducklake_metadata``), ``ducklake_delete_file``
(positional deletes: parquet ``file_path``, ``pos``) and ``ducklake_inlined_data_<table>_<schema
version>`` (small inserts kept in the catalog itself, one row per table row with its own
``begin_snapshot`` / ``end_snapshot``). Columns are matched by their ``column_id``, which data
files store as the parquet field id: a renamed column is read from older files by its id, and a
column added later reads as its ``initial_default`` (null without one) from files written before.

This module reads those tables with the runtime's own DuckDB (a DuckDB file, read only; never the
ducklake extension) or Python's ``sqlite3`` and resolves one table at one snapshot into a
`LakeTable` (`_ducklake_table`; its columns' types as DuckDB's, `_ducklake_types`): plain,
picklable data. `_ducklake` reads the rows.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import pyarrow as pa

from omicsio_jax import DataValidationError, OmicsIOError
from omicsio_jax.format import is_remote, sql_ident

from ._ducklake_table import ROW_ID, Column, DataFile, DeleteFile, LakeTable, empty_table
from ._ducklake_types import NUMERIC_SQL_TYPES, sql_literal, sql_type

PREFIX = "ducklake:"
VERSIONS = ("0.1", "0.2", "0.3")  # the specification versions whose tables this module reads
SQLITE_HEADER = b"SQLite format 3\x00"


def split_spec(spec: str) -> tuple[str, str | None]:
    """``ducklake:CATALOG[#TABLE]`` → (catalog, table or None); CATALOG may start ``sqlite:`` / ``duckdb:``."""
    body = spec[len(PREFIX) :] if spec.startswith(PREFIX) else spec
    catalog, sep, table = body.partition("#")
    return catalog, (table or None) if sep else None


class Catalog:
    """The metadata tables of a DuckLake catalog file (DuckDB or SQLite), read only."""

    def __init__(self, catalog: str):
        self.label = catalog
        kind, path = "", catalog
        for prefix in ("sqlite:", "duckdb:"):
            if catalog.startswith(prefix):
                kind, path = prefix[:-1], catalog[len(prefix) :]
        if is_remote(path):
            msg = f"DuckLake catalog {path}: the catalog must be a local DuckDB or SQLite file (its data files may be on s3://)"
            raise OmicsIOError(msg)
        self.path = Path(path)
        if not self.path.is_file():
            msg = f"DuckLake catalog {path} not found: give the catalog database file, e.g. ducklake:lake.ducklake"
            raise OmicsIOError(msg)
        if not kind:
            with open(self.path, "rb") as f:
                kind = "sqlite" if f.read(len(SQLITE_HEADER)) == SQLITE_HEADER else "duckdb"
        self.kind = kind
        try:
            if kind == "sqlite":
                self._con = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True)
            else:
                self._con = duckdb.connect(str(self.path), read_only=True)
        except (sqlite3.Error, duckdb.Error) as e:
            msg = f"cannot open DuckLake catalog {path} as a {kind} database: {str(e).splitlines()[0]}"
            raise OmicsIOError(msg) from e

    def rows(self, sql: str, params: tuple = ()) -> list[tuple]:
        try:
            return self._con.execute(sql, params).fetchall()
        except (sqlite3.Error, duckdb.Error) as e:
            msg = f"cannot read DuckLake catalog {self.label}: {str(e).splitlines()[0]} (is it a DuckLake catalog?)"
            raise DataValidationError(msg) from e

    def arrow(self, sql: str, params: tuple = ()) -> pa.Table:
        """A query's rows as Arrow: typed by DuckDB, or (SQLite) as Python values, to be cast."""
        if self.kind == "duckdb":
            try:
                return self._con.sql(sql, params=params).to_arrow_table()
            except duckdb.Error as e:
                msg = f"cannot read DuckLake catalog {self.label}: {str(e).splitlines()[0]}"
                raise DataValidationError(msg) from e
        cur = self._con.execute(sql, params)
        names = [d[0] for d in cur.description]
        rows = cur.fetchall()
        return pa.table({n: pa.array([r[i] for r in rows]) for i, n in enumerate(names)})

    def close(self) -> None:
        self._con.close()


def parse_time(value) -> datetime:
    """A snapshot time (a datetime from DuckDB, text from SQLite) or a user's ISO time, in UTC; a
    time without a zone is UTC."""
    if isinstance(value, datetime):
        t = value
    else:
        try:
            t = datetime.fromisoformat(str(value).strip())
        except ValueError as e:
            msg = f"--at {value!r} is not an ISO time; write e.g. 2026-05-01T12:00:00 (UTC) or 2026-05-01 12:00:00+02:00"
            raise OmicsIOError(msg) from e
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def resolve(catalog: Catalog, table: str, snapshot: int | str | datetime | None) -> LakeTable:
    """``table`` (``name`` or ``schema.name``) as of ``snapshot``: an id, a time (the last snapshot
    at or before it) or None (the latest)."""
    meta = dict(catalog.rows("SELECT key, value FROM ducklake_metadata WHERE scope IS NULL"))
    version = meta.get("version")
    if version not in VERSIONS:
        msg = (
            f"DuckLake catalog {catalog.label} has specification version {version!r}; this reader knows "
            f"{', '.join(VERSIONS)}: materialize with a release that reads {version}, or export the table to parquet"
        )
        raise OmicsIOError(msg)
    if meta.get("encrypted", "false") == "true":
        msg = f"DuckLake catalog {catalog.label} encrypts its data files, which this reader cannot decrypt; export the table to parquet"
        raise OmicsIOError(msg)
    snaps = catalog.rows("SELECT snapshot_id, snapshot_time FROM ducklake_snapshot ORDER BY snapshot_id")
    if not snaps:
        msg = f"DuckLake catalog {catalog.label} has no snapshots"
        raise DataValidationError(msg)
    s, when = _snapshot(catalog, snaps, snapshot)
    schema, name = table.rpartition(".")[::2] if "." in table else ("main", table)
    live = "{0}.begin_snapshot <= ? AND ({0}.end_snapshot IS NULL OR {0}.end_snapshot > ?)"
    tables = catalog.rows(
        f"SELECT t.table_id, t.table_uuid, s.schema_name, t.table_name, s.path, s.path_is_relative, t.path, "
        f"t.path_is_relative FROM ducklake_table t JOIN ducklake_schema s USING (schema_id) "
        f"WHERE {live.format('t')} AND {live.format('s')} ORDER BY s.schema_name, t.table_name",
        (s, s, s, s),
    )
    found = [r for r in tables if r[2] == schema and r[3] == name]
    if not found:
        listed = ", ".join(r[3] if r[2] == "main" else f"{r[2]}.{r[3]}" for r in tables) or "(none)"
        msg = (
            f"DuckLake catalog {catalog.label} has no table {table!r} at snapshot {s}; its tables then: {listed} "
            f"(--table NAME, or ducklake:CATALOG#NAME)"
            if table
            else f"name the table of DuckLake catalog {catalog.label} to read with --table NAME (or "
            f"ducklake:CATALOG#NAME); its tables at snapshot {s}: {listed}"
        )
        raise OmicsIOError(msg)
    table_id, uuid, _, _, schema_path, schema_rel, table_path, table_rel = found[0]
    folder = _join(_join(_data_path(catalog, meta), schema_path, schema_rel), table_path, table_rel)
    columns = _columns(catalog, table_id, s)
    lake = LakeTable(
        catalog.label,
        table,
        str(uuid),
        s,
        when.isoformat(),
        version,
        columns,
        _files(catalog, table_id, s, folder, columns),
        pa.table({}),
    )
    lake.inlined = _inlined(catalog, table_id, s, columns)
    return lake


def _snapshot(catalog: Catalog, snaps: list[tuple], snapshot) -> tuple[int, datetime]:
    latest = snaps[-1][0]
    if snapshot is None:
        return latest, parse_time(snaps[-1][1])
    if isinstance(snapshot, int):
        for sid, when in snaps:
            if sid == snapshot:
                return sid, parse_time(when)
        msg = (
            f"DuckLake catalog {catalog.label} has no snapshot {snapshot}; the latest is {latest} "
            f"(snapshots {snaps[0][0]}..{latest}); pass --snapshot {latest}, or none for the latest"
        )
        raise OmicsIOError(msg)
    at = parse_time(snapshot)
    before = [(sid, parse_time(when)) for sid, when in snaps if parse_time(when) <= at]
    if not before:
        first = parse_time(snaps[0][1]).isoformat()
        msg = (
            f"--at {at.isoformat()} is before the first snapshot of DuckLake catalog {catalog.label} "
            f"(snapshot {snaps[0][0]} at {first}); give a time at or after {first}"
        )
        raise OmicsIOError(msg)
    return before[-1]


def _data_path(catalog: Catalog, meta: dict) -> str:
    """``data_path``: a URL, an absolute folder, or one relative to the catalog's folder (else to the
    working directory, where DuckDB 1.4 resolves it when it writes)."""
    path = meta.get("data_path") or f"{catalog.path.name}.files/"
    if is_remote(path) or os.path.isabs(path):
        return path
    beside = catalog.path.resolve().parent / path
    if beside.exists() or not Path(path).exists():
        return str(beside) + "/"
    return str(Path(path).resolve()) + "/"


def _join(base: str, path: str | None, relative) -> str:
    if path is None:
        return base
    if not relative:
        return path
    return base.rstrip("/") + "/" + path


def _columns(catalog: Catalog, table_id: int, s: int) -> list[Column]:
    rows = catalog.rows(
        "SELECT column_id, column_name, column_type, initial_default, parent_column FROM ducklake_column "
        "WHERE table_id = ? AND begin_snapshot <= ? AND (end_snapshot IS NULL OR end_snapshot > ?) "
        "ORDER BY column_order",
        (table_id, s, s),
    )
    kids: dict[int, list[tuple]] = {}
    for row in rows:
        if row[4] is not None:
            kids.setdefault(row[4], []).append(row)

    def typed(row) -> str:
        return sql_type(row[2], [(k[1], typed(k)) for k in kids.get(row[0], [])])

    return [Column(r[0], r[1], typed(r), r[3]) for r in rows if r[4] is None]


def _files(catalog: Catalog, table_id: int, s: int, folder: str, columns: list[Column]) -> list[DataFile]:
    live = "begin_snapshot <= ? AND (end_snapshot IS NULL OR end_snapshot > ?)"
    files = catalog.rows(
        "SELECT data_file_id, path, path_is_relative, file_format, record_count, file_size_bytes, footer_size, "
        "row_id_start, partition_id, encryption_key, partial_file_info, mapping_id FROM ducklake_data_file "
        f"WHERE table_id = ? AND {live} ORDER BY data_file_id",
        (table_id, s, s),
    )
    deletes = {
        r[0]: r[1:]
        for r in catalog.rows(
            "SELECT data_file_id, path, path_is_relative, format, delete_count, file_size_bytes, footer_size, "
            f"encryption_key FROM ducklake_delete_file WHERE table_id = ? AND {live} ORDER BY delete_file_id",
            (table_id, s, s),
        )
    }
    by_id = {c.column_id: c for c in columns}
    parts: dict[int, dict[int, str | None]] = {}
    for fid, key, value in catalog.rows(
        "SELECT v.data_file_id, c.column_id, v.partition_value FROM ducklake_file_partition_value v "
        "JOIN ducklake_data_file f USING (data_file_id) JOIN ducklake_partition_column c "
        "ON c.partition_id = f.partition_id AND c.partition_key_index = v.partition_key_index "
        "WHERE v.table_id = ? AND lower(c.transform) = 'identity'",
        (table_id,),
    ):
        parts.setdefault(fid, {})[key] = value
    stats: dict[int, dict[str, str]] = {}
    numeric = {c.column_id: c.name for c in columns if c.sql_type in NUMERIC_SQL_TYPES}
    for fid, cid, low, high, nulls, nan in catalog.rows(
        "SELECT data_file_id, column_id, min_value, max_value, null_count, contains_nan "
        "FROM ducklake_file_column_stats WHERE table_id = ?",
        (table_id,),
    ):
        if cid in numeric and low is not None and low == high and nulls == 0 and not nan:
            stats.setdefault(fid, {})[numeric[cid]] = low
    mappings = _name_mappings(catalog, table_id)
    out = []
    for fid, path, rel, fmt, count, size, footer, row_id, _, key, partial, mapping in files:
        where = f"data file {path} of table id {table_id} in DuckLake catalog {catalog.label}"
        if str(fmt).lower() != "parquet" or key is not None:
            msg = f"{where} is {'encrypted' if key is not None else fmt}; this reader reads plain parquet: export the table to parquet"
            raise OmicsIOError(msg)
        delete = None
        if fid in deletes:
            dpath, drel, dfmt, dcount, dsize, dfooter, dkey = deletes[fid]
            if str(dfmt).lower() != "parquet" or dkey is not None:
                msg = f"delete file {dpath} of {where} is not plain parquet; export the table to parquet"
                raise OmicsIOError(msg)
            delete = DeleteFile(_join(folder, dpath, drel), dsize, dfooter, int(dcount))
        partition = parts.get(fid, {})
        constants = {**stats.get(fid, {}), **{by_id[k].name: v for k, v in partition.items() if k in by_id}}
        names = None if mapping is None else mappings.get(mapping, {})
        out.append(
            DataFile(
                fid,
                _join(folder, path, rel),
                int(count),
                size,
                footer,
                row_id,
                partial,
                names,
                partition,
                constants,
                delete,
            )
        )
    return out


def _name_mappings(catalog: Catalog, table_id: int) -> dict[int, dict[int, str]]:
    """mapping id → (field id → top-level column name in the file), for files added without field ids."""
    out: dict[int, dict[int, str]] = {}
    for mapping, name, target in catalog.rows(
        "SELECT m.mapping_id, m.source_name, m.target_field_id FROM ducklake_name_mapping m "
        "JOIN ducklake_column_mapping c USING (mapping_id) WHERE c.table_id = ? AND m.parent_column IS NULL",
        (table_id,),
    ):
        out.setdefault(mapping, {})[target] = name
    return out


def _inlined(catalog: Catalog, table_id: int, s: int, columns: list[Column]) -> pa.Table:
    """The inlined rows visible at ``s``, with the snapshot's column names and types, by row id."""
    con = duckdb.connect()
    pieces = []
    for name, version in catalog.rows(
        "SELECT table_name, schema_version FROM ducklake_inlined_data_tables WHERE table_id = ? ORDER BY schema_version",
        (table_id,),
    ):
        began = catalog.rows(
            "SELECT min(snapshot_id) FROM ducklake_snapshot WHERE schema_version = ?", (version,)
        )[0][0]
        then = {c.column_id: c.name for c in _columns(catalog, table_id, s if began is None else began)}
        raw = catalog.arrow(
            f"SELECT * FROM {sql_ident(name)} WHERE begin_snapshot <= ? AND (end_snapshot IS NULL OR end_snapshot > ?)",
            (s, s),
        )
        if raw.num_rows == 0:
            continue
        select = []
        for c in columns:
            stored = then.get(c.column_id)
            value = sql_ident(stored) if stored in raw.column_names else sql_literal(c.initial_default)
            select.append(f"CAST({value} AS {c.sql_type}) AS {sql_ident(c.name)}")
        select.append(f"CAST(row_id AS BIGINT) AS {ROW_ID}")
        con.register("inlined", raw)
        pieces.append(con.sql(f"SELECT {', '.join(select)} FROM inlined").to_arrow_table())
        con.unregister("inlined")
    if not pieces:
        return empty_table(columns)
    return pa.concat_tables(pieces).sort_by(ROW_ID)


def lineage(catalog: Catalog, lake: LakeTable) -> str:
    """SHA-256 of the catalog's snapshot rows up to the one read: the same for the same snapshot of
    the same catalog, whatever was committed after it."""
    rows = catalog.rows(
        "SELECT snapshot_id, snapshot_time, schema_version, next_catalog_id, next_file_id FROM ducklake_snapshot "
        "WHERE snapshot_id <= ? ORDER BY snapshot_id",
        (lake.snapshot,),
    )
    text = "\n".join(f"{r[0]}|{parse_time(r[1]).isoformat()}|{r[2]}|{r[3]}|{r[4]}" for r in rows)
    return hashlib.sha256(f"{lake.table_uuid}\n{text}".encode()).hexdigest()

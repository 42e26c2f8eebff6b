"""A DuckLake table resolved at one snapshot (`LakeTable`): its columns, its data files with their
delete files, and its inlined rows, as plain, picklable data.

`_ducklake_catalog` resolves a table of a catalog into it; `_ducklake_read` reads its rows, whose
row ids are the column ``ROW_ID``. Neither imports the other: the catalog is closed once the table
is resolved, and the reader holds only the table.
"""

from __future__ import annotations

import dataclasses

import duckdb
import pyarrow as pa

from omicsio_jax.format import sql_ident

ROW_ID = "__ducklake_row_id"


@dataclasses.dataclass(frozen=True)
class Column:
    """A top-level column of the table at the snapshot: its field id, name and DuckDB type."""

    column_id: int
    name: str
    sql_type: str
    initial_default: str | None


@dataclasses.dataclass(frozen=True)
class DeleteFile:
    path: str
    file_size_bytes: int | None
    footer_size: int | None
    delete_count: int


@dataclasses.dataclass(frozen=True)
class DataFile:
    """A data file of the table at the snapshot. ``partial``: ``partial_file_info`` of a file that
    merged several commits (its rows carry their snapshot); ``names``: field id → column name of a
    file registered without field ids; ``constants``: column → the one value every row holds
    (identity partition value, or equal min/max statistics of a number), for pruning."""

    data_file_id: int
    path: str
    record_count: int
    file_size_bytes: int | None
    footer_size: int | None
    row_id_start: int | None
    partial: str | None
    names: dict[int, str] | None
    partition: dict[int, str | None]  # None: a NULL partition value
    constants: dict[str, str | None]
    delete: DeleteFile | None


@dataclasses.dataclass
class LakeTable:
    """One table of a catalog as of one snapshot."""

    catalog: str
    table: str
    table_uuid: str
    snapshot: int
    snapshot_time: str
    version: str
    columns: list[Column]
    files: list[DataFile]
    inlined: pa.Table  # visible inlined rows (the columns above, then ROW_ID), by row id

    def describe(self) -> str:
        return f"DuckLake table {self.table} of {self.catalog} at snapshot {self.snapshot}"


def empty_table(columns: list[Column]) -> pa.Table:
    """No rows, the columns' Arrow types (as DuckDB gives them) and the row id."""
    select = [f"CAST(NULL AS {c.sql_type}) AS {sql_ident(c.name)}" for c in columns]
    return (
        duckdb.connect()
        .sql(f"SELECT {', '.join([*select, f'0::BIGINT AS {ROW_ID}'])} LIMIT 0")
        .to_arrow_table()
    )

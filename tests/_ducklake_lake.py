"""Write a DuckLake lake with DuckDB's own ducklake extension and record what it reads back.

Run by ``.venv-ducklake/bin/python`` (DuckDB 1.4.4 with the extension, see scripts/setup-ducklake.sh):

    _ducklake_lake.py CATALOG DATA_DIR RECORD_DIR build     the history of `build`, recorded
    _ducklake_lake.py CATALOG DATA_DIR RECORD_DIR more      a later insert (RECORD_DIR/inserted.parquet)
    _ducklake_lake.py CATALOG DATA_DIR - compact            ducklake_merge_adjacent_files
    _ducklake_lake.py CATALOG DATA_DIR RECORD_DIR updates   the history of `updates`, recorded
    _ducklake_lake.py CATALOG DATA_DIR RECORD_DIR rewrite   ducklake_rewrite_data_files, recorded

CATALOG is a DuckDB file or ``sqlite:FILE``. After ``build`` (or ``updates``, ``rewrite``), RECORD_DIR holds
``snapshots.json`` (snapshot id → time, and which snapshots hold ``rna_cells``) and, for every such
snapshot N, ``rna_cells-N.parquet``: ``SELECT rowid, * FROM rna_cells AT (VERSION => N) ORDER BY
rowid`` as the extension returns it, plus ``lung-N.parquet`` with ``WHERE organ = 'lung'`` once the
column is called so. Rows are drawn from ``numpy.random.default_rng(seed)`` with fixed seeds.
"""

from __future__ import annotations

import json
import pathlib
import site
import sys

import duckdb
import numpy as np

NUM_GENES = 60


def extension(name: str) -> str:
    for root in site.getsitepackages():
        for path in pathlib.Path(root).rglob(f"{name}.duckdb_extension"):
            return str(path)
    raise SystemExit(f"no {name}.duckdb_extension in {site.getsitepackages()}; run scripts/setup-ducklake.sh")


def cells(seed: int, prefix: str, n: int, tissues: list[str]) -> list[tuple]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        k = int(rng.integers(0, 12))
        genes = sorted(rng.choice(NUM_GENES, size=k, replace=False).tolist())
        values = rng.integers(1, 40, size=k).astype(float).tolist()
        rows.append((f"{prefix}{i:04d}", genes, values, tissues[i % len(tissues)], f"ds{i % 3}"))
    return rows


def insert(con, rows: list[tuple], table: str = "rna_cells") -> None:
    """One INSERT of all ``rows`` (one statement per row would be inlined, row by row)."""

    def literal(value) -> str:
        if isinstance(value, str):
            return "'" + value.replace("'", "''") + "'"
        if isinstance(value, list):
            return "[" + ", ".join(map(str, value)) + "]"
        return str(value)

    values = ", ".join("(" + ", ".join(literal(v) for v in row) + ")" for row in rows)
    con.execute(f"INSERT INTO {table} VALUES {values}")


def create_tables(con) -> None:
    """The gene table and the empty cell table every lake starts from."""
    con.execute("CREATE TABLE gene_metadata (gene_token_id INTEGER, gene_name VARCHAR)")
    con.execute(f"INSERT INTO gene_metadata SELECT i, 'G' || i FROM range({NUM_GENES}) r(i)")
    con.execute(
        "CREATE TABLE rna_cells (cell_id VARCHAR, gene_token_id INTEGER[], gene_expression FLOAT[], "
        "tissue VARCHAR, dataset VARCHAR)"
    )


def build(con) -> None:
    """Two inserts written as files, deletes, a renamed and an added column, an insert small enough
    to be inlined in the catalog, a partitioned insert, deletes from files and from inlined rows."""
    create_tables(con)
    insert(con, cells(1, "a", 300, ["lung", "liver", "brain"]))
    insert(con, cells(2, "b", 200, ["liver", "lung"]))
    con.execute("DELETE FROM rna_cells WHERE cell_id IN ('a0003', 'a0100', 'a0299', 'b0000', 'b0150')")
    con.execute("ALTER TABLE rna_cells RENAME COLUMN tissue TO organ")
    con.execute("ALTER TABLE rna_cells ADD COLUMN donor INTEGER DEFAULT 7")
    insert(con, [(*r, 11) for r in cells(3, "c", 4, ["lung", "brain"])])  # inlined: ≤ 10 rows
    con.execute("ALTER TABLE rna_cells SET PARTITIONED BY (organ)")
    insert(con, [(*r, i) for i, r in enumerate(cells(4, "d", 120, ["lung", "liver", "brain"]))])
    con.execute("DELETE FROM rna_cells WHERE cell_id IN ('c0001', 'd0004', 'd0005', 'a0004')")


def updates(con) -> None:
    """Two inserts written as files, a delete, UPDATEs of rows scattered over both (new files that
    hold their rows' row ids), an UPDATE of a row updated before, one small enough to be inlined."""
    create_tables(con)
    insert(con, cells(1, "a", 150, ["lung", "liver", "brain"]))
    insert(con, cells(2, "b", 100, ["liver", "lung"]))
    con.execute("DELETE FROM rna_cells WHERE cell_id IN ('a0003', 'b0050')")
    con.execute("UPDATE rna_cells SET tissue = 'kidney' WHERE right(cell_id, 1) = '7'")
    con.execute(
        "UPDATE rna_cells SET dataset = 'ds9', gene_expression = list_transform(gene_expression, v -> v * 2) "
        "WHERE right(cell_id, 2) IN ('17', '40', '41', '42', '99') OR cell_id = 'a0000'"
    )
    con.execute("UPDATE rna_cells SET tissue = 'heart' WHERE cell_id IN ('a0060', 'b0027')")  # inlined


def rewrite(con) -> None:
    con.execute("CALL ducklake_rewrite_data_files('lake', delete_threshold => 0.0)")


def more(con, out: pathlib.Path) -> None:
    """An insert; its rows also go to ``inserted.parquet`` as given (the extension of DuckDB 1.4.4
    cannot read this lake back in a later session: it binds the inlined rows of older schema
    versions by the column names of the snapshot read)."""
    rows = [(*r, 5) for r in cells(5, "e", 50, ["lung", "liver"])]
    insert(con, rows)
    con.execute("CREATE TABLE memory.main.inserted AS SELECT * FROM rna_cells LIMIT 0")
    insert(con, rows, "memory.main.inserted")
    out.mkdir(parents=True, exist_ok=True)
    con.execute(f"COPY memory.main.inserted TO '{out}/inserted.parquet'")


def compact(con) -> None:
    con.execute("CALL ducklake_merge_adjacent_files('lake')")


def record(con, out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    snaps = con.execute(
        "SELECT snapshot_id, snapshot_time::VARCHAR FROM ducklake_snapshots('lake') ORDER BY 1"
    ).fetchall()
    having, unreadable = [], {}
    for sid, _ in snaps:
        try:
            columns = [
                c[0]
                for c in con.execute(f"DESCRIBE SELECT * FROM rna_cells AT (VERSION => {sid})").fetchall()
            ]
        except duckdb.Error:
            continue  # no rna_cells yet
        at = f"rna_cells AT (VERSION => {sid})"
        try:
            con.execute(f"COPY (SELECT rowid, * FROM {at} ORDER BY rowid) TO '{out}/rna_cells-{sid}.parquet'")
            if "organ" in columns:
                con.execute(
                    f"COPY (SELECT rowid, * FROM {at} WHERE organ = 'lung' ORDER BY rowid) TO '{out}/lung-{sid}.parquet'"
                )
        except duckdb.Error as e:  # DuckDB 1.4.4 cannot read some snapshots back after a compaction
            unreadable[sid] = str(e).splitlines()[0]
            continue
        having.append(sid)
    times = {str(sid): when for sid, when in snaps}
    (out / "snapshots.json").write_text(
        json.dumps({"times": times, "rna_cells": having, "unreadable": unreadable})
    )


def main() -> None:
    catalog, data, out, phase = sys.argv[1:5]
    con = duckdb.connect(config={"allow_unsigned_extensions": "true"})
    con.execute("SET TimeZone = 'UTC'")
    con.execute(f"LOAD '{extension('ducklake')}'")
    if catalog.startswith("sqlite:"):
        con.execute(f"LOAD '{extension('sqlite_scanner')}'")
    con.execute(f"ATTACH 'ducklake:{catalog}' AS lake (DATA_PATH '{data}', DATA_INLINING_ROW_LIMIT 10)")
    con.execute("USE lake")
    recorded = {"build": build, "updates": updates, "rewrite": rewrite}
    if phase in recorded:
        recorded[phase](con)
        record(con, pathlib.Path(out))
    elif phase == "more":
        more(con, pathlib.Path(out))
    else:
        compact(con)


if __name__ == "__main__":
    main()

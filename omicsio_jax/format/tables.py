"""List-column cell tables (parquet file / directory / glob / hive partitions, vortex) as a DuckDB view.

Shared by `materialize` (which streams the view into shards) and the query API (which adds a
stable ``cell_rowid``). Files are always taken in sorted path order, so row ``r`` of the view is
the same cell for every reader: with no ``--where``/``--query``, ``cell_rowid`` equals the
row of the materialized dataset.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from omicsio_jax.core.errors import DataValidationError
from omicsio_jax.storage.input_files import expand_objects, is_glob, local_glob, register_s3
from omicsio_jax.storage.store import is_remote

# the columns the views add to a table's own: a name of DuckDB's choosing for the source file (not
# DuckDB's default ``filename``, a name input tables use), DuckDB's fixed name for a row's position
# in its file, and a cell's position in the whole table
FILENAME_COLUMN = "omicsio_source_file"
FILE_ROW_COLUMN = "file_row_number"
ROWID_COLUMN = "cell_rowid"
GENE_TABLE_NAME = "gene_metadata.parquet"  # found beside the input when no gene table is given
GENE_COLUMN = "gene_token_id"
VALUE_COLUMN = "gene_expression"
CELL_ID_COLUMN = "cell_id"


def check_derived_gene_space(top: int | None, where: str, give: str) -> None:
    """Without a gene table the genes are the token ids 0..``top`` (the largest seen): refuse a
    ``top`` outside int32 before that gene space is allocated (2^40 would ask for 4 TiB); ``give``
    says how the caller takes a gene table (``"give a gene table with --genes"``)."""
    if top is not None and int(top) > np.iinfo(np.int32).max:
        msg = (
            f"{GENE_COLUMN} {int(top)} in {where} is outside 0..2^31-1; without a gene table the genes "
            f"are the ids 0..{int(top)}: {give}, or fix the id"
        )
        raise DataValidationError(msg)


def connect(threads: int | None = None, *, remote: bool = False) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection as every reader of cell tables uses one (materialize, `CellTable`, the gene
    table): rows kept in file order, no progress bar, ``threads`` threads (None: DuckDB's default),
    and with ``remote`` ``s3://`` URLs readable (`register_s3`)."""
    con = duckdb.connect()
    con.execute("SET preserve_insertion_order = true")
    con.execute("SET enable_progress_bar = false")
    if threads is not None:
        con.execute(f"SET threads = {int(threads)}")
    if remote:
        register_s3(con)
    return con


def sql_str(text: str) -> str:
    """A SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def sql_ident(name: str) -> str:
    """A SQL identifier (quoted)."""
    return '"' + name.replace('"', '""') + '"'


def expand_files(spec: str) -> list[Path]:
    """Files named by a path, a directory (searched recursively) or a glob, sorted, the gene table
    (``gene_metadata.parquet``) left out of a directory's or a glob's; the same for ``s3://`` keys,
    prefixes and globs (as `ObjectPath`)."""
    path = Path(spec)
    if is_remote(spec):
        files = expand_objects(spec, (".parquet", ".vortex"), GENE_TABLE_NAME)
    elif path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.suffix in (".parquet", ".vortex") and p.is_file() and p.name != GENE_TABLE_NAME
        )
    elif is_glob(spec):
        files = sorted(
            Path(p) for p in local_glob(spec) if Path(p).is_file() and Path(p).name != GENE_TABLE_NAME
        )
    else:
        files = [path] if path.exists() else []
    if not files:
        msg = f"no input files found for {spec!r} (expected a .parquet/.vortex file, a directory or a glob)"
        raise DataValidationError(msg)
    return files


# what DuckDB says of a file whose bytes are not a whole parquet file (not of a missing one, a
# refused request or a bad query)
_DAMAGED = ("magic bytes", "too small to be a Parquet file", "Could not read enough bytes", "orrupt")


def damaged_hint(e: duckdb.Error) -> str:
    """What to suspect of a file DuckDB could not read: a truncated or damaged one where it failed
    on the bytes themselves (not on a query or a column)."""
    text = str(e)
    damaged = any(s in text for s in _DAMAGED)
    return " (a truncated or damaged file?)" if damaged else ""


def common_folder(files: list[Path]) -> Path:
    """The innermost folder that holds every one of ``files`` (in it or below it)."""
    roots = {f.parent for f in files}
    while len(roots) > 1 and {r.parent for r in roots} != roots:
        roots = {r.parent for r in roots}
    return roots.pop()


def find_gene_table(files: list[Path]) -> Path | None:
    """``gene_metadata.parquet`` in the inputs' common folder or one of its parents."""
    for root in [common_folder(files), *files[0].parents]:
        candidate = root / GENE_TABLE_NAME
        if candidate.exists():
            return candidate
    return None


def row_counts(files: list[Path]) -> list[int]:
    """Rows per file, from the footers (several files at once: each is a round trip on object storage)."""
    from concurrent.futures import ThreadPoolExecutor

    if files[0].suffix == ".vortex":
        import vortex as vx

        def count(f) -> int:
            return len(vx.open(str(f)))
    else:
        import pyarrow.parquet as pq

        def count(f) -> int:
            if is_remote(f):
                with f.open("rb") as handle:
                    return pq.read_metadata(handle).num_rows
            return pq.read_metadata(f).num_rows

    if len(files) == 1:  # no threads to start for one footer
        return [count(files[0])]
    with ThreadPoolExecutor(min(16, len(files))) as pool:
        return list(pool.map(count, files))


def create_cells_view(
    con: duckdb.DuckDBPyConnection,
    files: list[Path],
    *,
    label: str,
    filename: bool = False,
    rowid: bool = False,
    name: str = "cells",
    file_rows: bool = False,
    spans: dict[int, tuple[int, int | None]] | None = None,
    bases: list[int] | None = None,
) -> list[int]:
    """Create view ``name`` over ``files``: hive partition columns included, union by column name.

    ``filename`` adds the source file of each row and ``file_rows`` its ``file_row_number``;
    ``spans`` (vortex only) restricts file ``i`` to rows ``[lo, hi)`` (``hi`` None: to its end),
    read by index (parquet files are restricted by a ``file_row_number`` predicate instead, which
    DuckDB pushes into the scan). ``rowid`` adds ``cell_rowid``, the row's
    position in the concatenation of the files in sorted order (from each file's row count, so
    it stays right under any filter), and returns the first ``cell_rowid`` of each file. For
    parquet, ``rowid`` also creates ``<name>_all``: the same rows with ``filename`` and
    ``file_row_number``, on which DuckDB skips row groups (see `rowid_pruning`). ``bases``: those
    first ``cell_rowid``s, known already (the same view made again on another connection), so
    the files' rows are not counted again.
    """
    vortex = [f for f in files if f.suffix == ".vortex"]
    if vortex and len(vortex) != len(files):
        msg = f"{label!r} mixes .vortex and other files; use them separately"
        raise DataValidationError(msg)
    # a table's own cell_rowid is refused when the table is first opened, not on each connection
    # its view is made again on (`bases` known): DESCRIBE binds the view, reading every file's schema
    check_rowid = rowid and bases is None
    if bases is None:
        try:
            counts = row_counts(files) if rowid else []
        except Exception as e:  # pyarrow and vortex raise their own errors for unreadable files
            msg = f"cannot read {label}: {e}"
            raise DataValidationError(msg) from e
        bases = [sum(counts[:i]) for i in range(len(counts))]
    if any(is_remote(f) for f in files):
        register_s3(con)
    if vortex:
        import vortex as vx

        arms = []
        for i, path in enumerate(files):
            lo, hi = (spans or {}).get(i, (0, None))
            try:
                vf = vx.open(str(path))
                if lo == 0 and hi is None:
                    table = vf.to_dataset()
                else:
                    hi = len(vf) if hi is None else hi
                    table = vf.to_arrow(indices=vx.array(pa.array(np.arange(lo, hi, dtype=np.uint64))))
                con.register(f"_{name}_vortex_{i}", table)
            except Exception as e:  # vortex raises plain Exceptions for unreadable files
                msg = f"cannot read {path}: {e}"
                raise DataValidationError(msg) from e
            _check_rowid(con, f"_{name}_vortex_{i}", str(path), rowid=check_rowid, added=False)
            extra = f", {sql_str(str(path))} AS {FILENAME_COLUMN}" if filename else ""
            # a window with no ORDER BY streams and keeps the scan order
            if file_rows:
                extra += f", CAST({lo} + row_number() OVER () - 1 AS BIGINT) AS {FILE_ROW_COLUMN}"
            if rowid:
                extra += f", CAST({bases[i]} + row_number() OVER () - 1 AS BIGINT) AS {ROWID_COLUMN}"
            arms.append(f"SELECT *{extra} FROM _{name}_vortex_{i}")
        con.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS " + " UNION ALL BY NAME ".join(arms))
        if rowid:
            con.execute(f"CREATE OR REPLACE TEMP VIEW {name}_all AS SELECT * FROM {name}")
        return bases
    names = ", ".join(sql_str(str(f)) for f in files)
    source = (
        f"read_parquet([{names}], filename = {sql_str(FILENAME_COLUMN)}, file_row_number = true, "
        "hive_partitioning = true, union_by_name = true)"
    )
    hidden = ([] if file_rows else [FILE_ROW_COLUMN]) + ([] if filename else [FILENAME_COLUMN])
    columns = f"* EXCLUDE ({', '.join(hidden)})" if hidden else "*"
    extra = ""
    if rowid:
        cases = " ".join(f"WHEN {sql_str(str(f))} THEN {b}" for f, b in zip(files, bases, strict=True))
        extra = f", CAST(CASE {FILENAME_COLUMN} {cases} END + file_row_number AS BIGINT) AS {ROWID_COLUMN}"
    try:
        con.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS SELECT {columns}{extra} FROM {source}")
        if rowid:
            con.execute(f"CREATE OR REPLACE TEMP VIEW {name}_all AS SELECT *{extra} FROM {source}")
    except duckdb.Error as e:
        if f'adds column "{FILE_ROW_COLUMN}"' in str(e):
            raise DataValidationError(_reserved(label, FILE_ROW_COLUMN)) from e
        msg = f"cannot read {label}: {str(e).strip().splitlines()[0]}{damaged_hint(e)}"
        raise DataValidationError(msg) from e
    _check_rowid(con, name, label, rowid=check_rowid)
    return bases


def _reserved(label: str, column: str) -> str:
    """The error for a table with a column of a name a view adds to each row."""
    return (
        f"{label} has a column named {column!r}, a name the tables' views give a row's position; "
        f"rename it in the files, or materialize from --query "
        f'"SELECT * RENAME ({column} AS source_{column}) FROM ..."'
    )


def _check_rowid(
    con: duckdb.DuckDBPyConnection, name: str, label: str, *, rowid: bool, added: bool = True
) -> None:
    """Refuse a table with a ``cell_rowid`` column of its own: DuckDB renames the view's, and every
    query by ``cell_rowid`` would read the table's values instead. ``name``: the view, whose last
    column is the one it adds (``added``), or a file's table, which has none of its own."""
    if not rowid:
        return
    columns = [row[0] for row in con.execute(f"DESCRIBE {name}").fetchall()]
    if (columns[-1] != ROWID_COLUMN) if added else (ROWID_COLUMN in columns):
        raise DataValidationError(_reserved(label, ROWID_COLUMN))


def rowid_pruning(
    files: list[Path], bases: list[int], rowids: np.ndarray, *, gap: int = 8192, max_spans: int = 64
) -> str:
    """A predicate on ``filename`` / ``file_row_number`` that DuckDB pushes into the parquet scan,
    covering sorted unique ``rowids``: files without any are skipped, and within a file only the
    row groups of a few spans of rows (split where ids are more than ``gap`` apart) are read."""
    ends = [*bases[1:], np.iinfo(np.int64).max]
    arms = []
    for path, lo, hi in zip(files, bases, ends, strict=True):
        local = rowids[(rowids >= lo) & (rowids < hi)] - lo
        if len(local) == 0:
            continue
        cuts = np.flatnonzero(np.diff(local) > gap) + 1
        if len(cuts) >= max_spans:
            cuts = cuts[:0]  # too scattered: one span
        starts = local[np.concatenate(([0], cuts))]
        stops = local[np.concatenate((cuts - 1, [len(local) - 1]))]
        spans = " OR ".join(
            f"file_row_number BETWEEN {a} AND {b}"
            for a, b in zip(starts.tolist(), stops.tolist(), strict=True)
        )
        arms.append(f"({FILENAME_COLUMN} = {sql_str(str(path))} AND ({spans}))")
    return "(" + (" OR ".join(arms) or "false") + ")"

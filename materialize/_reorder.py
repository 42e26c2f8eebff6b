"""Putting a modality's table in the primary's row order, out of core: `Spill` and `read_spilled`.

DuckDB cannot do it within bounded memory: a sort or a hash join that carries list columns does
not spill them (DuckDB 2.0: a 300 MB parquet of ATAC lists, ~1.7 GB in memory, ran out of memory
under a 2 GB limit, with or without insertion order). So only the scalar part goes through
DuckDB: the primary row of each of the table's rows (a join on ``cell_id``), written to a
memory-mapped array. Then one streaming pass over the table sends each row, with its primary
row, to the spill file of the partition (shard) it lands in: Arrow IPC files, uncompressed so that
a partition's writer can memory-map its file and take its rows in order, a few thousand at a time.
Memory stays one batch of the table plus the open files' buffers, whatever the number of cells;
the spill files take the table's uncompressed size on disk until the modality is written.
"""

from __future__ import annotations

import resource
import tempfile
from collections.abc import Iterator
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
from pyarrow import ipc

from omicsio_jax import DataValidationError
from omicsio_jax.format import CELL_ID_COLUMN, FILE_ROW_COLUMN, FILENAME_COLUMN, open_store, sql_ident

ROW = "__row"  # a spilled row's primary row
_READ_ROWS = 8192
JOIN_MEMORY = "1GB"


def spill_name(partition: int) -> str:
    return f"p-{partition:05d}.arrow"


def _raise_open_files_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


def spill_by_partition(
    con: duckdb.DuckDBPyConnection,
    lists: tuple[str, str],
    *,
    num_rows: int,
    shard_cells: int,
    folder: Path,
    label: str,
    firsts: np.ndarray,
) -> int:
    """Write the rows of view ``modality`` (``cell_id``, the ``lists``, file and row) whose cell is one
    of view ``primary_cells`` to ``folder/p-NNNNN.arrow`` by the partition of that cell, with its
    primary row (``__row``); return how many were written. ``firsts``: the first primary row of each
    partition (one per ``shard_cells`` rows, or one over every shard of a ``--query`` primary), a
    partition numbered by its first shard."""
    cid = sql_ident(CELL_ID_COLUMN)
    con.execute(f"SET memory_limit = '{JOIN_MEMORY}'")  # the join of cell ids spills beyond it
    targets = np.lib.format.open_memmap(folder / "targets.npy", mode="w+", dtype=np.int64, shape=(num_rows,))
    targets[:] = -1
    try:
        joined = con.sql(
            f"SELECT m.__mrow, p.__row FROM (SELECT {cid}, row_number() OVER () - 1 AS __mrow "
            f"FROM modality) m JOIN primary_cells p USING ({cid})"
        )
        for rb in joined.to_arrow_reader(1 << 20):
            targets[rb.column(0).to_numpy()] = rb.column(1).to_numpy()
        columns = ", ".join(sql_ident(c) for c in (CELL_ID_COLUMN, *lists, FILENAME_COLUMN, FILE_ROW_COLUMN))
        reader = con.sql(f"SELECT {columns} FROM modality").to_arrow_reader(_READ_ROWS)
        writers: dict[int, ipc.RecordBatchFileWriter] = {}
        _raise_open_files_limit(len(firsts) + 256)
        first, written = 0, 0
        try:
            for rb in reader:
                rows = np.asarray(targets[first : first + rb.num_rows])
                first += rb.num_rows
                keep = np.flatnonzero(rows >= 0)
                firsts_of = firsts[np.searchsorted(firsts, rows, side="right") - 1]  # of each row's partition
                parts = firsts_of[keep] // shard_cells
                order = keep[np.argsort(parts, kind="stable")]
                bounds = np.flatnonzero(np.diff(np.sort(parts))) + 1
                for chunk in np.split(order, bounds) if len(order) else []:
                    part = int(firsts_of[chunk[0]] // shard_cells)
                    out = rb.take(pa.array(chunk)).append_column(ROW, pa.array(rows[chunk]))
                    writer = writers.get(part)
                    if writer is None:
                        writer = writers[part] = ipc.new_file(folder / spill_name(part), out.schema)
                    writer.write_batch(out)
                    written += len(chunk)
        finally:
            for writer in writers.values():
                writer.close()
    except duckdb.Error as e:
        msg = f"cannot read {label}: {str(e).strip().splitlines()[0]}"
        raise DataValidationError(msg) from e
    finally:
        del targets
        (folder / "targets.npy").unlink(missing_ok=True)
    return written


class Spill:
    """Where a modality's partitions were spilled: a local folder and, for a run whose output is on
    object storage, the ``s3://`` prefix they were uploaded to (for Dask workers on other machines)."""

    def __init__(self, folder: Path):
        self.folder, self.url = folder, None
        self.names = {p.name for p in folder.glob("p-*.arrow")}

    def publish(self, url: str) -> None:
        """Upload the spill files under ``url``, where every worker can read them."""
        open_store(url).upload(self.folder, sorted(self.names))
        self.url = url

    def partition(self, index: int) -> Iterator[tuple[pa.Table, np.ndarray, np.ndarray]]:
        """Partition ``index``'s spilled rows, memory-mapped, with their primary rows in ascending order
        and the order that sorts them (``table.take(order[i:j])`` materializes just those rows);
        yielded while the file is open. No spilled rows: an empty table."""
        name = spill_name(index)
        if name not in self.names:
            yield pa.table({ROW: pa.array([], pa.int64())}), np.zeros(0, np.int64), np.zeros(0, np.int64)
        elif (self.folder / name).exists():
            yield from _mapped(self.folder / name)
        else:  # a worker on another machine: fetch it first
            with tempfile.TemporaryDirectory(prefix="omicsio-spill-") as tmp:
                open_store(self.url).download(name, Path(tmp) / name)
                yield from _mapped(Path(tmp) / name)


def _mapped(path: Path) -> Iterator[tuple[pa.Table, np.ndarray, np.ndarray]]:
    with pa.memory_map(str(path)) as source:
        table = ipc.open_file(source).read_all()
        rows = table.column(ROW).to_numpy()
        order = np.argsort(rows, kind="stable")
        yield table, rows[order], order
        del table

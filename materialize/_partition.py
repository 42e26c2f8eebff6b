"""`write_partition`: one partition of a materialize run, written by any process that can read the
input and reach the output — this one, a local worker process or a Dask worker.

A partition's output is its shards (with their chunk indexes) at their final names, plus a small
sidecar folder ``_parts/p-NNNNN/``: ``cells.parquet`` (cell ids, obs values, ``n_counts``,
``n_genes``), ``gene_stats.bin`` (the partition's corpus statistics, merged exactly by
`_finalize`) and ``part.json``, written last, which marks the partition complete. Writing a
partition again (a retried task) rewrites the same bytes, so a worker killed mid-partition costs
that partition's redo and nothing else.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from omicsio_jax import OmicsIOError
from omicsio_jax.format import (
    CHUNK_INDEX_DIR,
    VALUE_F32,
    Background,
    FileEntry,
    ShardEntry,
    StatsAccumulator,
    chunk_index_path,
    file_entry,
    from_numpy,
    open_store,
    small_pages,
)

from ._panel import Panel
from ._plan import Partition
from ._scratch import Scratch
from ._source import Source
from ._validate import GeneIndex, encode_batch

PARTS_DIR = "_parts"
VALUES_COUNTS, VALUES_NONNEGATIVE, VALUES_REAL = "counts", "nonnegative", "real"  # the manifest's values
PART_DONE = "part.json"
PART_CELLS = "cells.parquet"
PART_STATS = "gene_stats.bin"
N_COUNTS, N_GENES = "n_counts", "n_genes"  # obs sidecars computed from the cells
_NO_ROWS = (np.zeros(1, np.int64), np.empty(0, np.int32), np.empty(0, np.float32))  # indptr, tokens, values
PRESENT = "present"  # a further modality's part sidecar: whether each cell has it
CELL_ID = "cell_id"  # the part sidecar's cell id column (whatever the input's is named)
# the dataset's own obs columns: an input's of those names are renamed (`dataset_obs_names`)
OWN_OBS = (CELL_ID, N_COUNTS, N_GENES)


def dataset_obs_names(obs: Sequence[str]) -> dict[str, str]:
    """The dataset's name of each input obs column: its own, but for one named as a column the
    dataset makes itself (``cell_id``: the cell ids that ``--cell-id`` chose, which the part sidecar
    holds under that name; ``n_counts`` / ``n_genes``: computed from the cells), kept as ``input_``
    and its name (``input_n_genes_2``, ... if that is taken)."""
    fields = {name: name for name in obs}
    taken = {*obs, *OWN_OBS, PRESENT}
    for name in OWN_OBS:
        if name in fields:
            renamed, k = f"input_{name}", 1
            while renamed in taken:
                k += 1
                renamed = f"input_{name}_{k}"
            fields[name] = renamed
            taken.add(renamed)
    return fields


@dataclasses.dataclass(frozen=True)
class Job:
    """Everything a worker needs to write any partition of one run (pickled once per worker)."""

    source: Source
    obs: tuple[str, ...]
    gene_index: GeneIndex
    panel: Panel | None
    allow_negative: bool
    shard_cells: int
    options: str
    staging: str  # the run's output root: a local (hidden, partial) directory or an s3:// prefix
    token: str  # this run's identity: sidecars of another run are never mixed in
    threads: int | None = None  # DuckDB / numba threads per worker process (None: their defaults)
    presence: bool = False  # a further modality: record which cells have it (`Batch.present`)
    stats: bool = True  # corpus statistics: gene_stats.bin and obs n_counts / n_genes per partition

    @property
    def obs_fields(self) -> dict[str, str]:
        """The dataset's name of each obs column, by its name in the input (`dataset_obs_names`)."""
        return dataset_obs_names(self.obs)

    @property
    def num_columns(self) -> int:
        return self.gene_index.num_genes if self.panel is None else self.panel.features.num_rows

    @property
    def sidecars(self) -> tuple[str, ...]:
        """A partition's sidecar files the finalizer merges (its cells table; its statistics with ``stats``)."""
        return (PART_CELLS, PART_STATS) if self.stats else (PART_CELLS,)


@dataclasses.dataclass(frozen=True)
class PartResult:
    """What a partition wrote (the content of its ``part.json``)."""

    token: str
    index: int
    first_cell: int
    num_cells: int
    nnz: int
    shards: tuple[ShardEntry, ...]
    files: tuple[FileEntry, ...]  # the shards' chunk indexes
    values: str = VALUES_COUNTS  # what its values are (see `_ValueKinds`)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self)) + "\n"

    @classmethod
    def from_json(cls, text: str) -> PartResult:
        raw = json.loads(text)
        return cls(
            raw["token"],
            raw["index"],
            raw["first_cell"],
            raw["num_cells"],
            raw["nnz"],
            tuple(ShardEntry(**s) for s in raw["shards"]),
            tuple(FileEntry(**f) for f in raw["files"]),
            raw.get("values", VALUES_COUNTS),
        )


def part_dir(index: int) -> str:
    return f"{PARTS_DIR}/p-{index:05d}"


def write_partition(
    job: Job,
    part: Partition,
    progress: Callable[[int], None] | None = None,
    *,
    scratch: Scratch | None = None,
) -> PartResult:
    """Write ``part``'s shards and sidecars under ``job.staging``; return what ``part.json`` says.
    ``scratch``: memory to reuse, for a process that writes several partitions.

    Pure and idempotent: the same job and partition always write the same bytes. Raises
    `DataValidationError` naming the file, row and cell of the first cell that breaks the schema.
    """
    store = open_store(job.staging)
    if job.threads is not None:
        _limit_threads(job.threads)
    with contextlib.ExitStack() as stack:
        stack.enter_context(small_pages())  # its batches' arrays, made and let go of one by one
        local = store.local_root
        if local is None:  # object storage: write here, then upload
            local = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="omicsio-part-")))
        own = (
            stack.enter_context(Scratch()) if scratch is None else scratch
        )  # a lone partition's: closed here
        with own.in_use():
            result = _write_local(job, part, local, progress, own)
        if store.local_root is None:
            names = [s.path for s in result.shards] + [f.path for f in result.files]
            names += [f"{part_dir(part.index)}/{name}" for name in (*job.sidecars, PART_DONE)]
            store.upload(local, names)  # part.json last: the partition is complete only then
    return result


def _write_local(job: Job, part: Partition, root: Path, progress, scratch: Scratch) -> PartResult:
    sidecar = root / part_dir(part.index)
    sidecar.mkdir(parents=True, exist_ok=True)
    for stale in (sidecar / PART_DONE, sidecar / f".{PART_DONE}.tmp"):
        stale.unlink(missing_ok=True)
    fields = job.obs_fields
    obs_types = {fields[name]: job.source.obs_columns[name] for name in job.obs}
    schema = pa.schema(
        [
            (CELL_ID, pa.string()),
            *obs_types.items(),
            *([(N_COUNTS, pa.float64()), (N_GENES, pa.int32())] if job.stats else []),
            *([(PRESENT, pa.bool_())] if job.presence else []),
        ]
    )
    shards = scratch.take_shard_writer(
        root,
        shard_cells=job.shard_cells,
        options=job.options,
        first_shard=part.index,
        index_dir=CHUNK_INDEX_DIR,
    )
    stats = scratch.take_stats(job.num_columns, job.shard_cells) if job.stats else None
    cells = pq.ParquetWriter(sidecar / PART_CELLS, schema, compression="zstd")
    nnz = 0
    kinds = _ValueKinds()
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shards.abort)
        cleanup.callback(cells.close)
        # statistics on their own thread (numba releases the GIL), in batch order, beside encoding;
        # what is still queued there is waited for before the writers close
        statistics = scratch.thread("materialize-stats")
        pending: collections.deque = collections.deque()
        cleanup.callback(lambda: concurrent.futures.wait(list(pending)))
        reader = Background(
            lambda: job.source.batches(list(job.obs), part, threads=job.threads),
            2,
            executor=scratch.thread("materialize-reader"),
        )
        cleanup.callback(reader.close)
        # numba's start (the first kernel call of a process: ~0.3 s) here, beside the reader's first
        # read, rather than in the reader after it (a collection's remap calls a kernel before encoding)
        encode_batch(*_NO_ROWS, job.gene_index, allow_negative=False, locate=str)
        for batch in reader:
            buf, starts, batch_nnz = encode_batch(
                batch.indptr,
                batch.tokens,
                batch.values,
                job.gene_index if batch.genes is None else batch.genes,
                allow_negative=job.allow_negative,
                locate=batch.locate,
                panel=job.panel,
                out=shards.buffer,  # straight into the memory the shard writer writes out
            )
            nnz += batch_nnz
            columns = {
                CELL_ID: batch.cell_ids,
                **{fields[n]: _cast(batch.obs[n], obs_types[fields[n]]) for n in job.obs},
            }
            if job.presence:
                columns[PRESENT] = pa.array(
                    np.ones(batch.num_cells, bool) if batch.present is None else batch.present
                )
            if job.allow_negative and kinds.kind != VALUES_REAL:
                kinds.add_values(batch.values)  # here: the reader may reuse the batch's arrays
            readers = (
                statistics.submit(_add_stats, stats, cells, schema, columns, buf, starts),
                statistics.submit(kinds.add_records, buf, starts),
            )
            pending.extend(readers)  # before the write: if it raises, the cleanup still waits for them
            shards.write(buf, starts, readers=readers)  # the buffer is not reused before they are done
            while pending and (pending[0].done() or len(pending) > 2):  # at most 2 batches behind
                pending.popleft().result()  # raises what the statistics thread raised
            if progress is not None:
                progress(batch.num_cells)
        for future in pending:
            future.result()
        cleanup.pop_all()
    cells.close()
    try:
        entries = tuple(shards.finish())
    except BaseException:
        shards.abort()
        raise
    scratch.give_back_shard_writer(shards)
    num_cells = sum(s.num_cells for s in entries)
    if num_cells != part.num_cells:
        msg = (
            f"{job.source.label}: {part.describe()} read {num_cells:,} cells where the plan counted "
            f"{part.num_cells:,}; did the input change during the run?"
        )
        raise OmicsIOError(msg)
    if stats is not None:
        stats.save(sidecar / PART_STATS)
        scratch.give_back_stats(stats)
    files = tuple(file_entry(root, chunk_index_path(s.path)) for s in entries)
    result = PartResult(
        job.token, part.index, part.first_cell, part.num_cells, nnz, entries, files, kinds.kind
    )
    staged = sidecar / f".{PART_DONE}.tmp"
    staged.write_text(result.to_json())
    os.replace(staged, sidecar / PART_DONE)
    return result


class _ValueKinds:
    """What a partition's values are: `VALUES_COUNTS` while every record is stored with an integer
    value code (the codec's exact u8/u16/u32: every value a non-negative integer), else
    `VALUES_NONNEGATIVE`, or `VALUES_REAL` once a value is negative (only with ``allow_negative``)."""

    def __init__(self):
        self.kind = VALUES_COUNTS

    def add_records(self, buf: np.ndarray, starts: np.ndarray) -> None:
        """Read the value codes of a batch's encoded records (on the statistics thread)."""
        if self.kind != VALUES_COUNTS or len(starts) < 2:
            return
        at = starts[:-1]
        codes = buf[at + 2]
        sizes = buf.view(np.uint32)[at // 4 + 1]  # the records are 4-aligned
        if np.any((codes == VALUE_F32) & (sizes > 0)):
            self.kind = VALUES_NONNEGATIVE

    def add_values(self, values: np.ndarray) -> None:
        """Note a negative among a batch's raw values (the caller checks only with ``allow_negative``)."""
        if len(values) and values.min() < 0:
            self.kind = VALUES_REAL


def merge_value_kinds(kinds) -> str:
    """The kind of values of partitions of these kinds: the widest."""
    order = (VALUES_COUNTS, VALUES_NONNEGATIVE, VALUES_REAL)
    return max(kinds, key=order.index, default=VALUES_COUNTS)


def _add_stats(
    stats: StatsAccumulator | None, cells: pq.ParquetWriter, schema: pa.Schema, columns: dict, buf, starts
):
    """A batch's cells table, with its corpus statistics (``stats``, unless None) added (from the
    records `encode_batch` has just written: not checked again)."""
    if stats is not None:
        n_counts, n_genes = stats.add(buf, starts, check=False)
        columns = {
            **columns,
            N_COUNTS: from_numpy(n_counts, pa.float64()),
            N_GENES: from_numpy(n_genes, pa.int32()),
        }
    cells.write_table(pa.table(columns, schema=schema))


def _cast(array: pa.Array, dtype: pa.DataType) -> pa.Array:
    """An obs column as the type the plan saw (a partition's files may hold a narrower one)."""
    return array if array.type == dtype else array.cast(dtype)


def read_part(store, index: int) -> PartResult | None:
    """The ``part.json`` of partition ``index`` under a store, or None if it is not complete."""
    text = store.read_text(f"{part_dir(index)}/{PART_DONE}")
    return None if text is None else PartResult.from_json(text)


def _limit_threads(threads: int) -> None:
    """Keep a worker process to its share of the cores in numba's parallel kernels."""
    import numba

    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))

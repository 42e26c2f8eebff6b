"""Joining the written partitions into one dataset, manifest last.

`Finalizer` merges partitions while the rest are still being written: the runner hands it each
partition as it completes (`Finalizer.add`, in any order), and a thread of its own merges every
partition whose predecessors are merged, so that after the last one only its merge and the
dataset's own files remain. That thread first loads the merge's numba kernels (a process's first
numba call: ~1–2 s, numba importing its registries) and faults in the histogram table, while the
first partitions are still being written. It must keep up with every worker (16 workers on 16
cores wrote 17 partitions a second, where one merge took ~65 ms): it adds a partition's
histograms on four threads, each a range of genes, and hands the partition's shards to four more
that flush them to disk. Each merge checks that the partition left a complete sidecar
(``part.json``) of this run, covering the next cells of the plan; appends its cell ids and obs
values to the dataset's sidecar writers (categorical codes are unified there: the categories of
all partitions, sorted); and merges its corpus statistics (counts and histograms add; float sums
are added partition by partition, in order, exactly as a one-process run adds them shard by
shard). `Finalizer.finish` merges whatever was not handed to it, writes the statistics and the
gene table, and at last the manifest.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from omicsio_jax import OmicsIOError
from omicsio_jax.format import (
    MANIFEST_NAME,
    NUM_BINS,
    STATS_NAME,
    GeneStats,
    Manifest,
    ModalityEntry,
    ObsEntry,
    empty_span,
    file_entry,
    fsync_path,
)

from ._partition import (
    CELL_ID,
    N_COUNTS,
    N_GENES,
    PART_CELLS,
    PART_STATS,
    PRESENT,
    Job,
    PartResult,
    merge_value_kinds,
    part_dir,
    read_part,
)
from ._plan import Partition
from ._shards import scratch_folder
from ._sidecars import CellIdWriter, NumericWriter, check_obs_name, make_obs_writer

FEATURES_NAME = "features.parquet"


def check_part(job: Job, store, part: Partition, expected_first: int) -> PartResult:
    """The ``part.json`` of ``part``, read back from the output: present, of this run, and covering
    the planned cells from ``expected_first`` on."""
    done = read_part(store, part.index)
    where = store.describe(f"{part_dir(part.index)}/part.json")
    if done is None:
        msg = (
            f"{part.describe()} has no sidecar at finalize ({where} is missing): its worker did not "
            "finish; run materialize again"
        )
        raise OmicsIOError(msg)
    if done.token != job.token:
        msg = f"{where} belongs to another materialize run; run materialize again into a fresh output"
        raise OmicsIOError(msg)
    if (done.first_cell, done.num_cells) != (
        part.first_cell,
        part.num_cells,
    ) or done.first_cell != expected_first:
        msg = (
            f"{where} covers cells {done.first_cell:,}..{done.first_cell + done.num_cells - 1:,}, the plan "
            f"has {part.first_cell:,}..{part.end_cell - 1:,}"
        )
        raise OmicsIOError(msg)
    return done


def _presence(store, root: Path, relpath: str) -> pa.Array:
    """A further modality's partition sidecar's flags: which of the partition's cells have it."""
    if store.local_root is not None:
        return pq.read_table(root / relpath, columns=[PRESENT]).column(0).combine_chunks()
    local = root / relpath
    local.parent.mkdir(parents=True, exist_ok=True)
    store.download(relpath, local)
    try:
        return pq.read_table(local, columns=[PRESENT]).column(0).combine_chunks()
    finally:
        local.unlink()


def finalize(job: Job, store, partitions: Sequence[Partition], **kw) -> Manifest:
    """Write the dataset's sidecars and manifest from the partitions' sidecars (all merged here);
    return the manifest. ``kw``: `Finalizer.finish`'s."""
    with Finalizer(job, store, partitions) as finalizer:
        return finalizer.finish(**kw)


_FLUSH_THREADS = 4  # shards flushed to disk at once: a partition's fsync took as long as its merge
# threads adding a partition's histograms to the table, each a range of genes: one took ~65 ms a
# partition of 8,192 cells on a 16-core Xeon, where 16 workers wrote 17 partitions a second
_MERGE_THREADS = 4


def _load_merge_kernels() -> None:
    """Call the numba kernels of a merge and of `finish` once, on a partition file of one cell
    (`GeneStats.save`/`load`: the same array types as a partition's), so that the first real
    merge does not pay numba's start."""
    one = GeneStats(
        1,
        np.ones(1, np.int64),
        np.zeros((6, 1)),
        np.array([0, 1]),
        np.zeros(1, np.uint16),
        np.ones(1, np.int64),
    )
    hist, span = np.zeros((1, NUM_BINS), np.uint32), empty_span(1)
    with scratch_folder("kernels") as tmp:
        one.save(os.path.join(tmp, "stats.bin"))
        loaded = GeneStats.load(os.path.join(tmp, "stats.bin"))
        loaded.add_to_dense(hist, span)
        del loaded  # its arrays map the file
    GeneStats.from_dense(1, one.n_cells, one.sums, hist, span)


class Finalizer:
    """Merges a run's partitions as they complete, then writes the dataset's files (`finish`).

    >>> with Finalizer(job, store, partitions) as finalizer:          # doctest: +SKIP
    ...     pool.run(job, partitions, progress, on_done=finalizer.add)
    ...     manifest = finalizer.finish(features=..., codec=..., ...)
    """

    def __init__(self, job: Job, store, partitions: Sequence[Partition]):
        self.job, self.store, self.partitions = job, store, list(partitions)
        self._position = {p.index: k for k, p in enumerate(self.partitions)}
        self._scratch = None
        if store.local_root is not None:
            self.root = store.local_root
        else:  # object storage: sidecars are downloaded here, the dataset's own files written here
            self._scratch = scratch_folder("finalize")
            self.root = Path(self._scratch.name)
        fields = job.obs_fields
        for name in fields.values():
            check_obs_name(name, job.source.label)
        if fields.get(CELL_ID, CELL_ID) != CELL_ID:
            column = job.source.description.get("cell_id_column")
            ids = f"column {column} (--cell-id)" if column else "its obs index"
            print(
                f"materialize: obs column {CELL_ID} of {job.source.label} kept as {fields[CELL_ID]}: "
                f"the dataset's cell ids come from {ids}",
                file=sys.stderr,
            )
        (self.root / "obs").mkdir(parents=True, exist_ok=True)
        obs_types = {fields[name]: job.source.obs_columns[name] for name in job.obs}
        if job.stats:  # the cells' own statistics, computed by the partitions
            obs_types |= {N_COUNTS: pa.float64(), N_GENES: pa.int32()}
        self._writers = [make_obs_writer(self.root / "obs", name, kind) for name, kind in obs_types.items()]
        one_input = job.source.description.get("kind") != "collection"  # sources may share cell ids
        self._cell_ids = CellIdWriter(self.root, unique_in=job.source.row_in_file if one_input else None)
        self._n_cells = np.zeros(job.num_columns, np.int64)
        self._sums = np.zeros((6, job.num_columns), np.float64)
        self._hist = np.zeros((job.num_columns, NUM_BINS), np.uint32) if job.stats else None
        self._span = empty_span(job.num_columns) if job.stats else None  # each gene's bins in use
        self._merged: list[PartResult] = []
        self._completed: set[int] = set()  # positions handed to `add`, not yet queued for merging
        self._queued = 0  # partitions (a prefix of the plan) queued for merging
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="materialize-finalize")
        self._flush = ThreadPoolExecutor(_FLUSH_THREADS, thread_name_prefix="materialize-fsync")
        self._adders = ThreadPoolExecutor(_MERGE_THREADS, thread_name_prefix="materialize-merge")
        self._pending: list[Future] = []
        self._flushing: list[Future] = []
        if job.stats:
            self._pending.append(self._thread.submit(self._prepare))
        self._open = True

    def __enter__(self) -> Finalizer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
        self._flush.shutdown(wait=True, cancel_futures=True)
        self._adders.shutdown(wait=True, cancel_futures=True)
        self._close_writers()
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

    def _close_writers(self) -> None:
        if self._open:
            self._open = False
            self._cell_ids.close()
            for writer in self._writers:
                writer.close()

    def _prepare(self) -> None:
        """Before the first merge, while partitions are being written: load the merge's kernels and
        fault in the histogram table (~280 MB for 62,710 genes: ~1 s of the kernel zeroing pages,
        which the first merge otherwise paid after the first partition)."""
        _load_merge_kernels()
        self._hist.fill(0)

    def add(self, index: int) -> None:
        """Partition ``index`` is complete: merge it (in the background) once its predecessors are."""
        self._completed.add(self._position[index])
        while self._queued in self._completed:
            self._completed.discard(self._queued)
            self._pending.append(self._thread.submit(self._merge, self.partitions[self._queued]))
            self._queued += 1

    def _merge(self, part: Partition) -> None:
        expected_first = self._merged[-1].first_cell + self._merged[-1].num_cells if self._merged else 0
        done = check_part(self.job, self.store, part, expected_first)
        sidecar = self.root / part_dir(done.index)
        if self.store.local_root is None:
            sidecar.mkdir(parents=True, exist_ok=True)
            for name in self.job.sidecars:
                self.store.download(f"{part_dir(done.index)}/{name}", sidecar / name)
        table = pq.ParquetFile(sidecar / PART_CELLS).read()  # read_table would import pyarrow.dataset: 0.2 s
        self._cell_ids.append(table.column(CELL_ID).combine_chunks())
        for writer in self._writers:
            writer.append(table.column(writer.name).combine_chunks())
        if self.job.stats:
            stats = GeneStats.load(sidecar / PART_STATS)
            self._n_cells += stats.n_cells
            self._sums += stats.sums
            blocks = stats.gene_blocks(_MERGE_THREADS)
            for future in [
                self._adders.submit(stats.add_to_dense, self._hist, self._span, b) for b in blocks
            ]:
                future.result()
        if self.store.local_root is not None:  # flushed now, while the rest are written, not all at the end
            self._flushing += [
                self._flush.submit(fsync_path, self.root / shard.path) for shard in done.shards
            ]
        self._merged.append(done)

    def finish(
        self,
        *,
        features: pa.Table,
        codec: dict,
        array_record: dict,
        source: dict,
        created_by: str,
        modality: str = "rna",
        modalities: tuple[ModalityEntry, ...] = (),
        tables: Mapping[str, pa.Table] | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> Manifest:
        """Merge the partitions not merged yet, write the dataset's sidecars and manifest; return the
        manifest. ``modalities``: the further modalities, written under their paths with the same
        partitions, whose presence flags become obs ``has_<name>``; ``tables``: further files of the
        dataset (relative path → table, written as parquet and listed); ``before_commit``: called
        just before the manifest is put on object storage (a run that may no longer write raises)."""
        for future in self._pending:
            future.result()  # raises what a merge raised
        for part in self.partitions[self._queued :]:
            self._merge(part)
        self._queued = len(self.partitions)
        for future in self._flushing:
            future.result()
        self._close_writers()
        root, store, parts = self.root, self.store, self._merged
        remote = store.local_root is None
        presence = [NumericWriter(root / "obs", f"has_{m.name}", pa.bool_()) for m in modalities]
        try:
            for entry, writer in zip(modalities, presence, strict=True):
                for done in parts:
                    writer.append(_presence(store, root, f"{entry.path}/{part_dir(done.index)}/{PART_CELLS}"))
        finally:
            for writer in presence:
                writer.close()
        num_cells = sum(p.num_cells for p in parts)
        if self.job.stats:
            GeneStats.from_dense(num_cells, self._n_cells, self._sums, self._hist, self._span).write(
                root / STATS_NAME
            )
        self._hist = None
        self._cell_ids.finish()
        writers = [*self._writers, *presence]
        obs_entries = [ObsEntry(w.name, w.kind, w.finish(), w.num_categories) for w in writers]
        pq.write_table(features, root / FEATURES_NAME, compression="zstd")
        for relpath, table in (tables or {}).items():
            pq.write_table(table, root / relpath, compression="zstd")
        relpaths = [
            FEATURES_NAME,
            CellIdWriter.path,
            *([STATS_NAME] if self.job.stats else []),
            *(tables or {}),
        ]
        relpaths += [p for w in writers for p in w.files()]
        files = tuple(file_entry(root, p) for p in relpaths) + tuple(f for p in parts for f in p.files)
        manifest = Manifest(
            num_cells=num_cells,
            num_genes=features.num_rows,
            nnz=sum(p.nnz for p in parts),
            layout="sparse" if self.job.panel is None else "dense",
            codec=codec,
            array_record=array_record,
            shard_cells=self.job.shard_cells,
            shards=tuple(s for p in parts for s in p.shards),
            files=files,
            obs=tuple(obs_entries),
            source=source,
            created_by=created_by,
            modality=modality,
            modalities=modalities,
            values=merge_value_kinds(p.values for p in parts),
        ).with_fingerprint()
        if remote:
            store.upload(root, relpaths)
        (root / MANIFEST_NAME).write_text(manifest.to_json())
        if remote:
            if before_commit is not None:
                before_commit()
            store.upload(root, [MANIFEST_NAME])  # last: the dataset is complete only now
        return manifest

"""`finalize`: join the written partitions into one dataset, manifest last.

Checks that every planned partition left a complete sidecar (``part.json``) of this run and that
their cell ranges are contiguous and complete; then appends each partition's cell ids and obs
values, in order, to the dataset's sidecar writers (categorical codes are unified there: the
categories of all partitions, sorted), merges the corpus statistics (counts and histograms add;
float sums are added partition by partition, in order, exactly as a one-process run adds them
shard by shard), writes the gene table, and at last the manifest.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from omicsio_jax import OmicsIOError
from omicsio_jax._genestats import NUM_BINS, STATS_NAME, GeneStats
from omicsio_jax._manifest import MANIFEST_NAME, Manifest, ModalityEntry, ObsEntry, file_entry

from ._partition import (
    N_COUNTS,
    N_GENES,
    PART_CELLS,
    PART_STATS,
    PRESENT,
    Job,
    PartResult,
    part_dir,
    read_part,
)
from ._plan import Partition
from ._sidecars import CellIdWriter, NumericWriter, make_obs_writer

FEATURES_NAME = "features.parquet"


def check_parts(job: Job, store, partitions: Sequence[Partition]) -> list[PartResult]:
    """The ``part.json`` of every partition, read back from the output: present, of this run, and
    covering the planned cells contiguously."""
    parts, expected_first = [], 0
    for part in partitions:
        done = read_part(store, part.index)
        where = store.describe(f"{part_dir(part.index)}/part.json")
        if done is None:
            msg = (f"{part.describe()} has no sidecar at finalize ({where} is missing): its worker did not "
                   "finish; run materialize again")
            raise OmicsIOError(msg)
        if done.token != job.token:
            msg = f"{where} belongs to another materialize run; run materialize again into a fresh output"
            raise OmicsIOError(msg)
        if (done.first_cell, done.num_cells) != (part.first_cell, part.num_cells) or done.first_cell != expected_first:
            msg = (f"{where} covers cells {done.first_cell:,}..{done.first_cell + done.num_cells - 1:,}, the plan "
                   f"has {part.first_cell:,}..{part.end_cell - 1:,}")
            raise OmicsIOError(msg)
        expected_first = done.first_cell + done.num_cells
        parts.append(done)
    return parts


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


def finalize(job: Job, store, partitions: Sequence[Partition], *, features: pa.Table, codec: dict,
             array_record: dict, source: dict, created_by: str, modality: str = "rna",
             modalities: tuple[ModalityEntry, ...] = ()) -> Manifest:
    """Write the dataset's sidecars and manifest from the partitions' sidecars; return the manifest.
    ``modalities``: the further modalities, written under their paths with the same partitions,
    whose presence flags become obs ``has_<name>``."""
    parts = check_parts(job, store, partitions)
    args = (parts, features, codec, array_record, source, created_by, modality, modalities)
    if store.local_root is not None:
        return _finalize_in(job, store, store.local_root, *args)
    with tempfile.TemporaryDirectory(prefix="omicsio-finalize-") as scratch:
        return _finalize_in(job, store, Path(scratch), *args)


def _finalize_in(job: Job, store, root: Path, parts: list[PartResult], features: pa.Table, codec: dict,
                 array_record: dict, source: dict, created_by: str, modality: str,
                 modalities: tuple[ModalityEntry, ...]) -> Manifest:
    remote = store.local_root is None
    (root / "obs").mkdir(exist_ok=True)
    obs_writers = [make_obs_writer(root / "obs", name, job.source.obs_columns[name]) for name in job.obs]
    stat_writers = [make_obs_writer(root / "obs", N_COUNTS, pa.float64()),
                    make_obs_writer(root / "obs", N_GENES, pa.int32())]
    presence = [NumericWriter(root / "obs", f"has_{m.name}", pa.bool_()) for m in modalities]
    writers = [*obs_writers, *stat_writers]
    cell_ids = CellIdWriter(root)
    num_columns = job.num_columns
    n_cells = np.zeros(num_columns, np.int64)
    sums = np.zeros((6, num_columns), np.float64)
    hist = np.zeros((num_columns, NUM_BINS), np.uint32)
    try:
        for done in parts:
            sidecar = root / part_dir(done.index)
            if remote:
                sidecar.mkdir(parents=True, exist_ok=True)
                for name in (PART_CELLS, PART_STATS):
                    store.download(f"{part_dir(done.index)}/{name}", sidecar / name)
            table = pq.read_table(sidecar / PART_CELLS)
            cell_ids.append(table.column("cell_id").combine_chunks())
            for writer in writers:
                writer.append(table.column(writer.name).combine_chunks())
            for entry, writer in zip(modalities, presence, strict=True):
                writer.append(_presence(store, root, f"{entry.path}/{part_dir(done.index)}/{PART_CELLS}"))
            stats = GeneStats.load(sidecar / PART_STATS)
            n_cells += stats.n_cells
            sums += stats.sums
            stats.add_to_dense(hist)
    finally:
        cell_ids.close()
        for writer in [*writers, *presence]:
            writer.close()
    writers += presence
    num_cells = sum(p.num_cells for p in parts)
    GeneStats.from_dense(num_cells, n_cells, sums, hist).write(root / STATS_NAME)
    del hist
    cell_ids.finish()
    obs_entries = [ObsEntry(w.name, w.kind, w.finish(), w.num_categories) for w in writers]
    pq.write_table(features, root / FEATURES_NAME, compression="zstd")
    relpaths = [FEATURES_NAME, CellIdWriter.path, STATS_NAME] + [p for w in writers for p in w.files()]
    files = tuple(file_entry(root, p) for p in relpaths) + tuple(f for p in parts for f in p.files)
    manifest = Manifest(
        num_cells=num_cells,
        num_genes=features.num_rows,
        nnz=sum(p.nnz for p in parts),
        layout="sparse" if job.panel is None else "dense",
        codec=codec,
        array_record=array_record,
        shard_cells=job.shard_cells,
        shards=tuple(s for p in parts for s in p.shards),
        files=files,
        obs=tuple(obs_entries),
        source=source,
        created_by=created_by,
        modality=modality,
        modalities=modalities,
    ).with_fingerprint()
    if remote:
        store.upload(root, relpaths)
    (root / MANIFEST_NAME).write_text(manifest.to_json())
    if remote:
        store.upload(root, [MANIFEST_NAME])  # last: the dataset is complete only now
    return manifest

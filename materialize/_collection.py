"""Collections: several sources (``.h5ad`` files, list-column tables, in any mix) as one dataset.

The cells are the sources' cells one source after the other, in the order given; each gets the obs
``dataset_id`` of its source (and the per-source obs of a sources file: ``assay``, ``donor_id``,
...); a source's own obs ``dataset_id`` (CELLxGENE's files carry one) is kept as
``input_dataset_id`` (`CollectionSource._obs_types`). The genes are one space
(`_genespace.GeneSpace`), and what each source measured is kept: ``presence.parquet``, one bitmap
over the dataset's genes per source, listed in the manifest like every other file
(`omicsio_jax.Dataset.presence`). Shards are cut from the concatenated cells as from one input, so
a shard may hold the end of one source and the start of the next; each source is read by cell
range (`Source.part_of`) on whatever worker writes the shard.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from omicsio_jax.format import (
    connect,
    from_numpy,
    one_array,
    release_freed_memory,
    repeated_text,
    text_array,
)

from ._collection_sources import DATASET_ID, Sources
from ._genespace import UNION, GeneSpace, first_few
from ._plan import Partition, whole_partitions
from ._source import Batch, Source, decoded_again_note, obs_kind
from ._validate import GeneIndex

INPUT_DATASET_ID = "input_dataset_id"  # the dataset's name of a source's own obs column dataset_id
_OPEN_THREADS = 8  # sources opened at once (`_open_members`)
_POOL_OPEN_FROM = 48  # .h5ad / .h5mu sources from which they open on a pool's workers (`opens_on_workers`)


def _kept_type(dtype: pa.DataType) -> pa.DataType | None:
    """The type a per-source obs of Arrow type ``dtype`` is kept as: its own (numbers, bools, text),
    text (no value given, dates, times, decimals: as Arrow writes them), or None (lists, structs, ...)."""
    if pa.types.is_null(dtype) or pa.types.is_temporal(dtype) or pa.types.is_decimal(dtype):
        return pa.string()
    return dtype if obs_kind(dtype) is not None else None


def _unified_type(types: list[pa.DataType]) -> pa.DataType:
    """One Arrow type for an obs column the sources give in ``types`` (uint64 where every one is
    unsigned and one is uint64: its values need not fit int64)."""
    plain = [t.value_type if pa.types.is_dictionary(t) else t for t in types]
    if all(pa.types.is_boolean(t) for t in plain):
        return pa.bool_()
    if all(pa.types.is_unsigned_integer(t) for t in plain) and pa.uint64() in plain:
        return pa.uint64()
    if all(pa.types.is_integer(t) for t in plain):
        return pa.int64()
    if all(pa.types.is_integer(t) or pa.types.is_floating(t) for t in plain):
        return pa.float64()
    return pa.string()


def _repeated(value, n: int) -> pa.Array:
    """``n`` copies of a source's own obs value, as Arrow (without ``pa.array`` for text and
    numbers, which imports pandas: see `text_array`)."""
    if isinstance(value, str):
        return repeated_text(value, n)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return from_numpy(np.full(n, value))
    return pa.array([value] * n)


def _as(array: pa.Array | pa.ChunkedArray, dtype: pa.DataType) -> pa.Array:
    array = one_array(array)
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    return array if array.type == dtype else pc.cast(array, dtype)


class CollectionSource(Source):
    """Several sources' cells, one after the other, in one gene space (see the module docstring)."""

    def __init__(self, sources: Sources, members: Sequence[Source], space: GeneSpace):
        # the members without their gene tables: the gene space holds what reading needs, and the
        # tables (~1 MB a source of 60k genes) would stay alive through the whole run and go to every
        # worker with the pickled job
        self.sources, self.members, self.space = sources, [_without_genes(m) for m in members], space
        self.label = f"collection of {len(members)} sources"
        self.genes = space.genes
        self._firsts = np.concatenate([[0], np.cumsum([m.num_cells for m in members])]).astype(np.int64)
        self.num_cells = int(self._firsts[-1])
        self._inputs: dict[str, str] = {}  # obs kept under another name: the dataset's name -> the sources'
        self.obs_notes: dict[str, str] = {}
        self.obs_columns, self.notes = self._obs_types()
        self.description = {
            "kind": "collection",
            "genes": "the sources' genes, unified by Ensembl id",
            "sources": [
                {DATASET_ID: i, "input": p, "kind": m.description.get("kind"), "cells": m.num_cells, **about}
                for i, p, m, about in zip(
                    sources.dataset_ids, sources.paths, members, space.members, strict=True
                )
            ],
        }

    def _obs_types(self) -> tuple[dict[str, pa.DataType], list[str]]:
        """The obs columns' types (the sources' own and the per-source ones, unified), and a note for
        each per-source obs of a type no obs column can hold (left out). A source's own obs
        ``dataset_id`` is kept as ``input_dataset_id`` (``input_dataset_id_2``, ... if that is taken),
        said in ``obs_notes`` (where that column is kept): the dataset's ``dataset_id`` is the
        collection's id of each source."""
        given: dict[str, list[pa.DataType]] = {}
        for m in self.members:
            for name, dtype in m.obs_columns.items():
                given.setdefault(name, []).append(dtype)
        notes = []
        if DATASET_ID in given:
            taken, renamed, k = {*given, *self.sources.obs}, INPUT_DATASET_ID, 1
            while renamed in taken:
                k += 1
                renamed = f"{INPUT_DATASET_ID}_{k}"
            given = {renamed if n == DATASET_ID else n: ts for n, ts in given.items()}
            self._inputs[renamed] = DATASET_ID
            having = [
                i
                for i, m in zip(self.sources.dataset_ids, self.members, strict=True)
                if DATASET_ID in m.obs_columns
            ]
            self.obs_notes[renamed] = (
                f"obs column {DATASET_ID} of {len(having):,} source(s) ({first_few(having)}) kept as {renamed}: the "
                f"dataset's {DATASET_ID} is the collection's id of each source (from its path, or the "
                "sources file's dataset_id)"
            )
        for name, dtype in self.sources.obs_types.items():
            kept = _kept_type(dtype)
            if kept is None:
                notes.append(
                    f"per-source obs {name!r} is of type {dtype}, which no obs column holds (numbers, bools, "
                    "text, dates and times): left out; give its values as text"
                )
            else:
                given.setdefault(name, []).append(kept)
        given.pop(DATASET_ID, None)
        return {DATASET_ID: pa.string(), **{n: _unified_type(ts) for n, ts in given.items()}}, notes

    def plan(self, shard_cells: int) -> list[Partition]:
        return whole_partitions(self.num_cells, shard_cells)

    def plan_notes(self, partitions: Sequence[Partition]) -> list[str]:
        """The note of `decoded_again_note` over the sources' reads: each partition's read starts
        in the source that holds its first cell."""
        again = 0
        for part in partitions:
            k = int(np.searchsorted(self._firsts, part.first_cell, side="right")) - 1
            member, lo = self.members[k], part.first_cell - int(self._firsts[k])
            again += member.rows_decoded_before(
                member.part_of(lo, min(part.num_cells, member.num_cells - lo))
            )
        largest = max((m.largest_row_group() for m in self.members), default=0)
        note = decoded_again_note(f"the {self.label}", partitions, again, largest)
        return [] if note is None else [note]

    def presence(self) -> pa.Table:
        """One row per source: its dataset id, its cells (``first_cell``, ``num_cells``: sources are
        contiguous), how many genes it measured and their bits (packed, little-endian bit order, over
        the dataset's columns)."""
        measured = [m.measured for m in self.space.maps]
        return pa.table(
            {
                DATASET_ID: text_array(list(self.sources.dataset_ids)),
                "first_cell": from_numpy(self._firsts[:-1]),
                "num_cells": from_numpy(np.diff(self._firsts)),
                "num_measured": from_numpy(np.array([int(m.sum()) for m in measured], np.int64)),
                "measured": text_array(
                    [np.packbits(m, bitorder="little").tobytes() for m in measured], binary=True
                ),
            }
        )

    def batches(
        self, obs: list[str], part: Partition | None = None, *, threads: int | None = None
    ) -> Iterator[Batch]:
        first, end = (0, self.num_cells) if part is None else (part.first_cell, part.end_cell)
        for k, member in enumerate(self.members):
            lo, hi = max(first, int(self._firsts[k])), min(end, int(self._firsts[k + 1]))
            if lo >= hi:
                continue
            own = [
                self._inputs.get(n, n)
                for n in obs
                if self._inputs.get(n, n) in member.obs_columns
                and self._given(n, k) is None
                and n != DATASET_ID
            ]
            local = member.part_of(lo - int(self._firsts[k]), hi - lo)
            try:
                for batch in member.batches(own, local, threads=threads):
                    yield self._in_space(k, batch, obs)
            finally:  # its file (or connection) opened again where it is read again: a worker reading
                # the sources of its partitions one after another held every one it had read open,
                # ~1.4 MB of h5py's caches each, until the run ended (past `ulimit -n` at ~1,000 sources)
                member.rest()

    def _given(self, name: str, k: int):
        values = self.sources.obs.get(name)
        return None if values is None else values[k]

    def _in_space(self, k: int, batch: Batch, obs: list[str]) -> Batch:
        source = self.space.maps[k]
        if source.in_order:  # rows stay sorted as their tokens are mapped: the encoder maps them
            indptr, cols, values = batch.indptr, batch.tokens, batch.values
            description = f"source {self.sources.dataset_ids[k]} ({self.sources.paths[k]})"
            genes = GeneIndex(source.col_of, source.num_columns, description)
        else:  # moved into the unified columns here, each row sorted again
            indptr, cols, values = source.remap(batch.indptr, batch.tokens, batch.values, batch.locate)
            genes = None
        n = batch.num_cells
        columns = {}
        for name in obs:
            dtype = self.obs_columns[name]
            if name == DATASET_ID:
                columns[name] = repeated_text(self.sources.dataset_ids[k], n)
            elif (value := self._given(name, k)) is not None:
                columns[name] = _as(_repeated(value, n), dtype)
            elif (own := self._inputs.get(name, name)) in batch.obs:
                columns[name] = _as(batch.obs[own], dtype)
            else:
                columns[name] = pa.nulls(n, dtype)
        return Batch(indptr, cols, values, batch.cell_ids, columns, batch.locate, genes=genes)

    def stage(self, folder: str | None, *, progress: bool = False, pool=None) -> list[str]:
        """Each member's `Source.stage`, in a folder of its own."""
        return [
            note
            for k, member in enumerate(self.members)
            for note in member.stage(
                None if folder is None else f"{folder}/member-{k}", progress=progress, pool=pool
            )
        ]

    def close(self) -> None:
        for member in self.members:
            member.close()


def _without_genes(source: Source) -> Source:
    light = copy.copy(source)
    light.genes = None
    return light


def opens_on_workers(sources: Sources) -> bool:
    """Whether `_open_members` opens a collection's ``.h5ad`` / ``.h5mu`` sources on a pool's worker
    processes, given one: from `_POOL_OPEN_FROM` of them. h5py reads under one lock per process, so
    threads open them one at a time, ~40 ms each (mostly the var table's strings): about a minute
    for CELLxGENE's ~1,500 files, on the serial path before any cell is written."""
    return sum(_h5py_bound(p) for p in sources.paths) >= _POOL_OPEN_FROM


def _h5py_bound(path: str) -> bool:
    return Path(path).suffix in (".h5ad", ".h5mu")


def _picklable(fn: object) -> bool:
    try:
        pickle.dumps(fn)
    except Exception:  # noqa: BLE001 - a lambda, a closure: not for another process
        return False
    return True


def _open_closed(item: tuple[Callable[[str, dict, object], Source], str, dict]) -> Source:
    """A source opened on a pool worker (`Pool.map`) and sent back, closed (`_opened`): its
    pickled form holds no open file."""
    open_member, path, own = item
    return _opened(open_member, path, own, None)


def _opened(open_member: Callable[[str, dict, object], Source], path: str, own: dict, con) -> Source:
    """``open_member(path, own, con)``, an ``.h5ad`` / ``.h5mu`` closed again at once, and the heap
    freed given back (`release_freed_memory`: glibc keeps the ~6 MiB an ``.h5ad`` opened and closed
    leaves freed rather than reusing it for the next one, so a worker that opened its share of 1,500
    sources would keep gigabytes while it writes cells). An open h5py file keeps ~6 MiB of caches:
    300 sources open together until their genes were unified took 2.6 GB of RSS (1,500 would take
    ~12 GB); a source opens its file again where its cells are read."""
    try:
        source = open_member(path, own, con)
        if _h5py_bound(path):
            source.close()
        return source
    finally:
        release_freed_memory()


def _open_members(
    sources: Sources,
    open_member: Callable[[str, dict, object], Source],
    database,
    opened: Callable[[int, bool], None] | None = None,
    pool=None,
) -> list[Source]:
    """Every source opened, in order, on a few threads: opening reads a source's metadata, schema
    and gene table (DuckDB, pyarrow and object-store reads, outside the GIL), ~10 ms a local
    parquet source and a round trip or more a remote one. Table sources share one DuckDB
    ``database``, each on a connection of its own to it (a database of its own costs ~12 ms to
    make). With a ``pool`` of worker processes (`materialize._pool.Pool`), a picklable
    ``open_member`` and enough ``.h5ad`` / ``.h5mu`` sources (`opens_on_workers`), those open on
    its workers meanwhile, one per worker at a time (h5py holds one lock per process).
    ``opened(num_cells, every)`` is called as each source opens, in the sources' order, with the
    cells of those open so far (``every``: all of them). The first failing source's error (in the
    sources' order) is raised once every other has opened, and those are closed again."""
    paths = sources.paths
    elsewhere = set()
    if pool is not None and pool.workers and opens_on_workers(sources) and _picklable(open_member):
        elsewhere = {k for k, p in enumerate(paths) if _h5py_bound(p)}
    members, error, cells = [], None, 0
    with ThreadPoolExecutor(min(len(paths) - len(elsewhere), _OPEN_THREADS) or 1) as threads:
        futures = {
            k: threads.submit(_opened, open_member, p, sources.reading_of(k), database.cursor())
            for k, p in enumerate(paths)
            if k not in elsewhere
        }
        opening = (
            pool.map(
                _open_closed,
                [(open_member, paths[k], sources.reading_of(k)) for k in sorted(elsewhere)],
                lambda item: f"opening {item[1]}",
            )
            if elsewhere
            else iter(())
        )
        for k in range(len(paths)):
            try:
                member = next(opening) if k in elsewhere else futures[k].result()
                if isinstance(member, BaseException):
                    raise member
                members.append(member)
                cells += members[-1].num_cells
                if opened is not None and error is None:
                    opened(cells, k == len(paths) - 1)
            except BaseException as e:  # raised below, once the others are closed
                error = error or e
    if error is not None:
        for m in members:
            m.close()
        raise error
    return members


def open_collection(
    sources: Sources,
    open_member: Callable[[str, dict, object], Source],
    *,
    genes: str | Path | None = None,
    id_column: str | None = None,
    report: Callable[[str], None] | None = None,
    opened: Callable[[int, bool], None] | None = None,
    pool=None,
) -> CollectionSource:
    """Open every source (``open_member(path, its own reading options, a DuckDB connection)``),
    unify their genes (``genes``: ``"union"``, the default, ``"intersection"`` or a gene table /
    vocabulary) and report what was matched how. ``opened(num_cells, every)`` is called as the
    sources open, with the cells of those open so far (``every``: all, before their genes are
    unified): `materialize` starts its workers as soon as the cells are worth them all, so that
    their start overlaps the opening of the rest and the unifying. With a ``pool`` of worker
    processes, many ``.h5ad`` / ``.h5mu`` sources open on its workers (`_open_members`)."""
    database = connect()  # closed last: closing it closes the members' connections to it
    try:
        members = _open_members(sources, open_member, database, opened, pool)
        try:
            labels = [f"{i} ({p})" for i, p in zip(sources.dataset_ids, sources.paths, strict=False)]
            space = GeneSpace.build(
                [m.genes for m in members],
                labels,
                genes=UNION if genes is None else genes,
                id_column=id_column,
            )
        finally:
            for m in members:  # each source's files and connections open again where its cells are read
                m.close()
        collection = CollectionSource(sources, members, space)
        del members  # the sources' gene tables, held by nothing else now
        # what the gene tables and the unifying's arrays took (~2 MB a source), given back to the
        # system: Arrow's allocator and glibc's keep freed memory for reuse, and this process then
        # held it through the whole run (3.9 GB of 4.9 at 1,200 sources, while the workers wrote)
        release_freed_memory()
        pa.default_memory_pool().release_unused()
        for note in (*space.notes, *collection.notes):
            if report is not None:
                report(note)
        return collection
    finally:
        database.close()

"""Collections: several sources (``.h5ad`` files, list-column tables, in any mix) as one dataset.

The cells are the sources' cells one source after the other, in the order given; each gets the obs
``dataset_id`` of its source (and the per-source obs of a sources file: ``assay``, ``donor_id``,
...). The genes are one space (`_genespace.GeneSpace`), and what each source measured is kept:
``presence.parquet``, one bitmap over the dataset's genes per source, listed in the manifest like
every other file (`omicsio_jax.Dataset.presence`). Shards are cut from the concatenated cells as
from one input, so a shard may hold the end of one source and the start of the next; each source
is read by cell range (`Source.part_of`) on whatever worker writes the shard.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from omicsio_jax import OmicsIOError
from omicsio_jax.format import (
    connect,
    from_numpy,
    is_remote,
    one_array,
    release_freed_memory,
    repeated_text,
    text_array,
)

from ._genespace import UNION, GeneSpace
from ._plan import Partition, whole_partitions
from ._source import Batch, Source, decoded_again_note, obs_kind
from ._validate import GeneIndex

DATASET_ID = "dataset_id"
READING = ("layer", "raw")  # a sources file's columns that say how to read a source, not obs
_OPEN_THREADS = 8  # sources opened at once (`_open_members`)
_POOL_OPEN_FROM = 48  # .h5ad / .h5mu sources from which they open on a pool's workers (`opens_on_workers`)
_SUFFIXES = (".h5ad", ".h5mu", ".parquet", ".vortex", ".zarr", ".csv")


def dataset_id_of(path: str) -> str:
    """A source's dataset id by default: its file or folder name without suffix (a glob: its folder)."""
    text = re.split(r"[*?\[]", str(path), maxsplit=1)[0] if re.search(r"[*?\[]", str(path)) else str(path)
    name = text.rstrip("/").rsplit("/", 1)[-1]
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _default_ids(paths: tuple[str, ...]) -> tuple[str, ...]:
    """The file names (``a.h5ad`` → ``a``), or the folders' where the names repeat
    (``plate_1/cells.parquet`` → ``plate_1``)."""
    ids = tuple(dataset_id_of(p) for p in paths)
    if len(set(ids)) < len(ids):
        folders = tuple(
            dataset_id_of(p.rstrip("/").rsplit("/", 1)[0]) if "/" in p.rstrip("/") else p for p in paths
        )
        if len(set(folders)) == len(folders):
            return folders
    return ids


@dataclasses.dataclass(frozen=True)
class Sources:
    """The sources of a collection: ``paths``, their ``dataset_ids`` (default: the file names) and
    per-source ``obs`` (column → one value per source, None: not given), of ``obs_types`` (default:
    bool, int64, float64 or string, from the values); ``reading`` may give an AnnData source its own
    ``layer`` or ``raw`` (column → one value per source, None: the run's; ``raw`` a bool, or true /
    false, yes / no, 1 / 0 as text), which replace the run's ``layer`` and ``use_raw`` for it.

    >>> materialize(Sources.read("sources.csv"), "atlas/")                    # doctest: +SKIP
    >>> materialize(Sources(("a.h5ad", "b.h5ad"), obs={"assay": ("10x 3' v3", "Smart-seq2")}), "atlas/")  # doctest: +SKIP
    >>> materialize(["a.h5ad", "b.h5ad", "plates/*.parquet"], "atlas/")      # the same, ids a, b, plates  # doctest: +SKIP
    """

    paths: tuple[str, ...]
    dataset_ids: tuple[str, ...] = ()
    obs: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    obs_types: Mapping[str, pa.DataType] = dataclasses.field(default_factory=dict)
    reading: Mapping[str, tuple] = dataclasses.field(default_factory=dict)  # per source: layer, raw

    def __post_init__(self) -> None:
        paths = tuple(str(p) for p in self.paths)
        object.__setattr__(self, "paths", paths)
        if not paths:
            msg = "a collection needs at least one source"
            raise OmicsIOError(msg)
        ids = tuple(self.dataset_ids) or _default_ids(paths)
        object.__setattr__(self, "dataset_ids", ids)
        if len(ids) != len(paths):
            msg = f"{len(paths)} sources but {len(ids)} dataset ids"
            raise OmicsIOError(msg)
        for name, values in self.obs.items():
            if len(values) != len(paths):
                msg = f"obs {name!r} gives {len(values)} value(s) for {len(paths)} sources: give one per source (None: not known)"
                raise OmicsIOError(msg)
        self._check_reading()
        inferred = {n: _value_type(v) for n, v in self.obs.items() if n not in self.obs_types}
        object.__setattr__(self, "obs_types", {**inferred, **self.obs_types})
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            msg = (
                f"dataset id(s) {', '.join(repeated)} name more than one source; give each source its own "
                "(a sources file with columns path, dataset_id: --sources sources.csv)"
            )
            raise OmicsIOError(msg)

    @classmethod
    def read(cls, path: str | Path) -> Sources:
        """A sources file (CSV, TSV or parquet): column ``path`` (relative to the file's folder), optional
        ``dataset_id`` (an empty cell: the file's name, as without the column), ``layer`` and ``raw``,
        and any per-source obs columns. A CSV / TSV file's values are read as written (``001`` stays
        ``001``, ``1.10`` is not ``1.1``); an obs column of one is numbers only where every value reads
        back as written (`_text_obs`)."""
        path = Path(path)
        try:
            if path.suffix == ".parquet":
                import pyarrow.parquet as pq

                table = pq.read_table(path)
            else:
                table = _read_text_table(path, "\t" if path.suffix == ".tsv" else ",")
        except (OSError, pa.ArrowException) as e:
            msg = f"cannot read the sources file {path}: {e}"
            raise OmicsIOError(msg) from e
        if "path" not in table.column_names:
            msg = f"sources file {path} has no column 'path' (it has {', '.join(table.column_names)})"
            raise OmicsIOError(msg)
        paths = []
        for p in table.column("path").to_pylist():
            if not p:
                msg = f"sources file {path} has a row without a path"
                raise OmicsIOError(msg)
            p = str(p)
            paths.append(p if is_remote(p) or Path(p).is_absolute() else str(path.parent / p))
        ids = ()
        if DATASET_ID in table.column_names:  # an empty cell: the source's default id, as without the column
            given = table.column(DATASET_ID).to_pylist()
            ids = tuple(
                str(i) if i is not None and str(i) != "" else default
                for i, default in zip(given, _default_ids(tuple(paths)), strict=True)
            )
        extra = [n for n in table.column_names if n not in ("path", DATASET_ID, *READING)]
        obs, types = {}, {}
        for n in extra:
            values = tuple(None if v == "" else v for v in table.column(n).to_pylist())
            dtype = table.schema.field(n).type
            obs[n], types[n] = _text_obs(values) if path.suffix != ".parquet" else (values, dtype)
        reading = {n: tuple(table.column(n).to_pylist()) for n in READING if n in table.column_names}
        return cls(tuple(paths), ids, obs, types, reading)

    def reading_of(self, k: int) -> dict:
        """Source ``k``'s own reading options (``layer``, ``raw``: a bool) where the sources file gives
        them."""
        return {n: v[k] for n, v in self.reading.items() if v[k] is not None and v[k] != ""}

    def _check_reading(self) -> None:
        """Each source's ``raw`` as a bool (True / False, or their spellings in text: true / false, yes /
        no, 1 / 0, in any case; empty or None: the run's), anything else a one-line error naming the
        source; ``layer`` as text."""
        reading = dict(self.reading)
        for name, values in reading.items():
            if len(values) != len(self.paths):
                msg = (
                    f"{name} gives {len(values)} value(s) for {len(self.paths)} sources: give one per "
                    "source (None: the run's)"
                )
                raise OmicsIOError(msg)
        if "raw" in reading:
            reading["raw"] = tuple(
                _raw_flag(v, f"{i} ({p})")
                for v, i, p in zip(reading["raw"], self.dataset_ids, self.paths, strict=True)
            )
        if "layer" in reading:
            reading["layer"] = tuple(None if v is None or v == "" else str(v) for v in reading["layer"])
        object.__setattr__(self, "reading", reading)


_TRUE, _FALSE = ("true", "yes", "1"), ("false", "no", "0")


def _raw_flag(value, source: str) -> bool | None:
    """A sources file's ``raw`` value as a bool (None: not given, the run's); see `Sources._check_reading`."""
    if value is None or value == "":
        return None
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, float | np.floating) and np.isnan(value):  # a null of a column of numbers
        return None
    if isinstance(value, int | float | np.integer | np.floating) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    msg = (
        f"raw of source {source} is {value!r}: give true or false (also yes / no, 1 / 0), or leave it "
        "empty for the run's --raw"
    )
    raise OmicsIOError(msg)


def _read_text_table(path: Path, delimiter: str) -> pa.Table:
    """A CSV / TSV file with every column as text, as written (no type inference)."""
    import pyarrow.csv as pacsv

    parse = pacsv.ParseOptions(delimiter=delimiter)
    with pacsv.open_csv(path, parse_options=parse) as reader:  # the column names
        names = reader.schema.names
    text = pacsv.ConvertOptions(column_types=dict.fromkeys(names, pa.string()))
    return pacsv.read_csv(path, parse_options=parse, convert_options=text)


_BOOLS = {"true": True, "false": False}


def _text_obs(values: tuple) -> tuple[tuple, pa.DataType]:
    """A per-source obs column given as text (None: not given) as values and their type: bools where
    every value is true or false (in any case), integers where every value reads back as written
    (``7``, not ``007`` or ``+7``), floats where every value reads back as written as a float or an
    integer (``1.5`` and ``2``, not ``1.50`` or ``1e3``), else the text itself (dates included)."""
    present = [v for v in values if v is not None]
    if not present:
        return values, pa.null()
    if all(v.lower() in _BOOLS for v in present):
        return tuple(None if v is None else _BOOLS[v.lower()] for v in values), pa.bool_()
    numbers = dict.fromkeys(present)
    for text in numbers:
        numbers[text] = _number(text)
        if numbers[text] is None:
            return values, pa.string()
    if all(isinstance(n, int) for n in numbers.values()):
        return tuple(None if v is None else numbers[v] for v in values), pa.int64()
    if any(float(n) != n for n in numbers.values()):  # an integer a float64 does not hold
        return values, pa.string()
    return tuple(None if v is None else float(numbers[v]) for v in values), pa.float64()


def _number(text: str) -> int | float | None:
    """``text`` as the int64 or the finite float it is written as (``str(int)``, ``repr(float)``),
    else None."""
    try:
        value = int(text)
    except ValueError:
        pass
    else:
        return value if str(value) == text and -(2**63) <= value < 2**63 else None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if np.isfinite(value) and repr(value) == text else None


def _value_type(values: Sequence) -> pa.DataType:
    """The Arrow type of a per-source obs given as Python values (None: not given for that source)."""
    present = [v for v in values if v is not None]
    if not present:
        return pa.null()
    if all(isinstance(v, bool | np.bool_) for v in present):
        return pa.bool_()
    if all(isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_) for v in present):
        return pa.int64()
    if all(
        isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool | np.bool_)
        for v in present
    ):
        return pa.float64()
    return pa.string()


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
        each per-source obs of a type no obs column can hold (left out)."""
        given: dict[str, list[pa.DataType]] = {}
        for m in self.members:
            for name, dtype in m.obs_columns.items():
                given.setdefault(name, []).append(dtype)
        notes = []
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
                n for n in obs if n in member.obs_columns and self._given(n, k) is None and n != DATASET_ID
            ]
            local = member.part_of(lo - int(self._firsts[k]), hi - lo)
            for batch in member.batches(own, local, threads=threads):
                yield self._in_space(k, batch, obs)

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
            elif name in batch.obs:
                columns[name] = _as(batch.obs[name], dtype)
            else:
                columns[name] = pa.nulls(n, dtype)
        return Batch(indptr, cols, values, batch.cell_ids, columns, batch.locate, genes=genes)

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
        for note in (*space.notes, *collection.notes):
            if report is not None:
                report(note)
        return collection
    finally:
        database.close()

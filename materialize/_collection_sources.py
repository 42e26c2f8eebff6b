"""The sources of a collection (`Sources`): their paths, dataset ids, per-source obs and reading
options, given in Python or read from a sources file (CSV, TSV or parquet)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from omicsio_jax import ObjectStoreError, OmicsIOError
from omicsio_jax.format import as_input_path, glob_root, is_glob, is_remote

DATASET_ID = "dataset_id"
READING = ("layer", "raw")  # a sources file's columns that say how to read a source, not obs
_SUFFIXES = (".h5ad", ".h5mu", ".parquet", ".vortex", ".zarr", ".csv")
DUCKLAKE = "ducklake:"  # a DuckLake catalog's scheme (`materialize._ducklake`)


def dataset_id_of(path: str) -> str:
    """A source's dataset id by default: its file or folder name without suffix (a glob: its folder)."""
    name = _before_wildcards(str(path)).rstrip("/").rsplit("/", 1)[-1]
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _parents(path: str) -> list[str]:
    """The folders above what `dataset_id_of` names (a glob's: above its folder)."""
    return [part for part in _before_wildcards(path).rstrip("/").split("/")[:-1] if part not in ("", ".")]


def _before_wildcards(path: str) -> str:
    """``path`` as written, or a glob's text before its first wildcard past the folders it names as
    written (`glob_root`: ``run[1]/*.parquet`` → ``run[1]/``)."""
    if not is_glob(path):
        return path
    parts = path.split("/")
    k = glob_root(path)
    rest = re.split(r"[*?\[]", "/".join(parts[k:]), maxsplit=1)[0]
    return "/".join([*parts[:k], rest]) if k else rest


def _default_ids(paths: tuple[str, ...]) -> tuple[str, ...]:
    """The file names (``a.h5ad`` → ``a``); where names repeat, the folders' (``plate_1/cells.parquet``
    → ``plate_1``) if every source has one of its own, else the shortest ends of the paths that tell
    the sources apart (``a.h5ad``, ``d2/a.h5ad`` → ``a``, ``d2/a``). A path given twice keeps its
    repeated id (refused by `Sources`)."""
    ids = tuple(dataset_id_of(p) for p in paths)
    if len(set(ids)) == len(ids):
        return ids
    parents = [_parents(p) for p in paths]
    if all(parents):
        folders = tuple(dataset_id_of(q[-1]) for q in parents)
        if len(set(folders)) == len(folders):
            return folders
    for depth in range(1, max(map(len, parents)) + 1):
        ends = tuple("/".join([*q[-depth:], i]) for q, i in zip(parents, ids, strict=True))
        if len(set(ends)) == len(ends):
            return ends
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
                "(a sources file's dataset_id column: --sources FILE, with columns path, dataset_id)"
            )
            raise OmicsIOError(msg)

    @classmethod
    def read(cls, path: str | Path) -> Sources:
        """A sources file (CSV, TSV or parquet): column ``path`` (relative to the file's folder), optional
        ``dataset_id`` (an empty cell: the file's name, as without the column), ``layer`` and ``raw``,
        and any per-source obs columns. A CSV / TSV file's values are read as written (``001`` stays
        ``001``, ``1.10`` is not ``1.1``); an obs column of one is numbers only where every value reads
        back as written (`_text_obs`)."""
        path = as_input_path(str(path))  # a local file or an s3:// object (its paths relative to its prefix)
        try:
            with path.open("rb") as f:
                data = pa.py_buffer(f.read())  # a small file, read once
            if path.suffix == ".parquet":
                import pyarrow.parquet as pq

                table = pq.read_table(pa.BufferReader(data))
            else:
                table = _read_text_table(data, "\t" if path.suffix == ".tsv" else ",")
        except (OSError, pa.ArrowException, ObjectStoreError) as e:
            text = str(e).strip()  # (a CSV parse error goes on with the row's text, over lines)
            msg = f"cannot read the sources file {path}: {text.splitlines()[0] if text else type(e).__name__}"
            raise OmicsIOError(msg) from e
        repeated = sorted({n for n in table.column_names if table.column_names.count(n) > 1})
        if repeated:
            msg = (
                f"sources file {path} names column(s) {', '.join(repeated)} more than once: keep one of each"
            )
            raise OmicsIOError(msg)
        if not table.num_rows:
            msg = f"sources file {path} lists no sources (a header and no rows): give one row per source"
            raise OmicsIOError(msg)
        if "path" not in table.column_names:
            msg = f"sources file {path} has no column 'path' (it has {', '.join(table.column_names)})"
            raise OmicsIOError(msg)
        paths = []
        for p in table.column("path").to_pylist():
            if not p:
                msg = f"sources file {path} has a row without a path"
                raise OmicsIOError(msg)
            paths.append(_from_folder(str(p), path.parent))
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


def _from_folder(path: str, folder) -> str:
    """A sources file's ``path`` as read from the file's ``folder``: a relative local path joined to
    it, so is the catalog of a ``ducklake:[sqlite:|duckdb:]CATALOG[#TABLE]`` (the scheme stays in
    front); an ``s3://`` or absolute one as written."""
    if path.startswith(DUCKLAKE):
        catalog, sep, table = path[len(DUCKLAKE) :].partition("#")
        kind = next((k for k in ("sqlite:", "duckdb:") if catalog.startswith(k)), "")
        return DUCKLAKE + kind + _from_folder(catalog[len(kind) :], folder) + sep + table
    return path if is_remote(path) or Path(path).is_absolute() else str(folder / path)


def refuse_ducklake_sources(sources: Sources, table: str | None = None) -> None:
    """Refuse a DuckLake catalog among a collection's sources, before anything is opened, saying what
    to do instead (``table``: the run's --table, for the command shown). A catalog's table is read
    in partitions of its own data files, not by the cell ranges a collection's shards ask of each of
    their sources."""
    path = next((p for p in sources.paths if p.startswith(DUCKLAKE)), None)
    if path is None:
        return
    named = path.partition("#")[2]
    alone = f"omicsio-materialize {path} OUT" + ("" if named else f" --table {table or 'TABLE'}")
    name = named or table or "TABLE"
    msg = (
        f"source {path}: a DuckLake catalog cannot be a member of a collection; materialize it as a "
        f"dataset of its own ({alone}), or export its table to parquet (DuckDB with the ducklake "
        f"extension: COPY lake.{name} TO '{name}.parquet') and give that file as the source"
    )
    raise OmicsIOError(msg)


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


def _read_text_table(data: pa.Buffer, delimiter: str) -> pa.Table:
    """A CSV / TSV file's bytes as a table with every column as text, as written (no type inference)."""
    import pyarrow.csv as pacsv

    parse = pacsv.ParseOptions(delimiter=delimiter)
    with pacsv.open_csv(pa.BufferReader(data), parse_options=parse) as reader:  # the column names
        names = reader.schema.names
    text = pacsv.ConvertOptions(column_types=dict.fromkeys(names, pa.string()))
    return pacsv.read_csv(pa.BufferReader(data), parse_options=parse, convert_options=text)


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

"""The manifest: what a materialized dataset directory holds, with sizes and checksums.

A dataset directory looks like::

    out/
      manifest.json             written last: its presence marks the dataset complete
      shard-00000.arrayrecord   one record per cell (see `codec`), shard_cells cells per shard
      shard-00001.arrayrecord
      features.parquet          the gene table, one row per column of the data, in column order
      cell_ids.parquet          one string per cell, in row order
      obs/<name>.codes.npy      categorical obs: int32 codes (-1 = missing) ...
      obs/<name>.categories.json  ... and their categories
      obs/<name>.npy            numeric, datetime64 or timedelta64 obs
      modalities/<name>/        a further modality of the same cells (say ATAC, or a splice layer):
                                a complete dataset of its own, row i the same cell as row i here
      obs/has_<name>.npy        ... and whether each cell has it (bool)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from omicsio_jax.core.errors import DatasetFormatError, UnknownNameError
from omicsio_jax.storage.store import is_remote, open_store, s3_url

FORMAT_NAME = "omicsio_jax.dataset"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
# a collection's measured genes: one row per source (dataset_id, first_cell, num_cells, num_measured,
# measured: the genes' bits, packed little-endian); listed among the manifest's files like any other
PRESENCE_NAME = "presence.parquet"
LAYOUTS = ("sparse", "dense")
# a bool obs column's categories, both always (its codes 0 False, 1 True, -1 missing)
BOOL_CATEGORIES = ("false", "true")


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """A file of the dataset with its size and SHA-256."""

    path: str
    num_bytes: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class ShardEntry:
    """One ArrayRecord shard: cells ``[first_cell, first_cell + num_cells)``."""

    path: str
    first_cell: int
    num_cells: int
    num_bytes: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class ObsEntry:
    """One obs sidecar column: ``kind`` is ``"categorical"``, ``"numeric"``, ``"datetime"`` (dates
    and timestamps, ``datetime64``) or ``"timedelta"`` (times of day and durations, ``timedelta64``)."""

    name: str
    kind: str
    dtype: str
    num_categories: int | None = None


@dataclasses.dataclass(frozen=True)
class ModalityEntry:
    """A further modality of the dataset's cells: a complete dataset of its own under ``path``
    (``modalities/<name>``), whose row ``i`` is the cell of the primary's row ``i`` (an empty row where
    the cell lacks the modality, see the primary's ``obs/has_<name>``). ``features`` is ``"primary"``
    when its columns are the primary's genes (splice layers), else ``"own"`` (peaks, proteins)."""

    name: str
    path: str
    num_features: int
    layout: str
    nnz: int
    features: str
    fingerprint: str
    manifest_sha256: str


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Everything known about a dataset directory; serialised as ``manifest.json``."""

    num_cells: int
    num_genes: int
    nnz: int
    layout: str
    codec: dict[str, Any]
    array_record: dict[str, Any]
    shard_cells: int
    shards: tuple[ShardEntry, ...]
    files: tuple[FileEntry, ...]
    obs: tuple[ObsEntry, ...]
    source: dict[str, Any]
    created_by: str
    fingerprint: str = ""
    modality: str = "rna"  # the name of the modality the top-level shards hold
    modalities: tuple[ModalityEntry, ...] = ()  # the further ones, aligned by row
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    # on object storage, where a replaced dataset's files live: the prefix ``gen-...`` under the
    # manifest's (see `dataset_root`); "" (never written) for files beside the manifest
    generation: str = ""
    # what the values are: "counts" (every value a non-negative integer), "nonnegative" or "real";
    # "" (never written) where the writer did not record it
    values: str = ""

    def with_fingerprint(self) -> Manifest:
        """Return a copy whose ``fingerprint`` is computed from the content description."""
        return dataclasses.replace(self, fingerprint=compute_fingerprint(self))

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        for optional in ("generation", "values"):
            if not fields[optional]:
                del fields[optional]
        return json.dumps(fields, indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Manifest:
        fields = dict(raw)
        fields["shards"] = tuple(ShardEntry(**s) for s in raw["shards"])
        fields["files"] = tuple(FileEntry(**f) for f in raw["files"])
        fields["obs"] = tuple(ObsEntry(**o) for o in raw["obs"])
        fields["modalities"] = tuple(ModalityEntry(**m) for m in raw.get("modalities", ()))
        return cls(**fields)

    def modality_entry(self, name: str) -> ModalityEntry:
        """The entry of the further modality ``name`` (KeyError naming those there are)."""
        for entry in self.modalities:
            if entry.name == name:
                return entry
        msg = f"no modality {name!r}; this dataset has {', '.join([self.modality, *(m.name for m in self.modalities)])}"
        raise UnknownNameError(msg)


# Statistics derived from the cells (written at materialize or added later by `omicsio-materialize
# stats`) and the shards' chunk indexes (derived from the shards): not part of the fingerprint, so
# adding them to an older dataset keeps its identity.
DERIVED_FILES = ("gene_stats.parquet", "obs/n_counts.npy", "obs/n_genes.npy")
SPLITS_DIR = "splits/"  # the split sidecars: `omicsio_jax.dataset.splits`
DERIVED_DIRS = ("chunks/", SPLITS_DIR)


def is_derived(path: str) -> bool:
    return path in DERIVED_FILES or path.startswith(DERIVED_DIRS)


def compute_fingerprint(manifest: Manifest) -> str:
    """SHA-256 over the content description: shape, layout, codec and every file checksum but
    the `DERIVED_FILES`.

    The source description and the creating version are left out, so the same data written
    from parquet or from h5ad gets the same fingerprint.
    """
    content = {
        "format_version": manifest.format_version,
        "num_cells": manifest.num_cells,
        "num_genes": manifest.num_genes,
        "nnz": manifest.nnz,
        "layout": manifest.layout,
        "codec": manifest.codec,
        "shard_cells": manifest.shard_cells,
        "shards": [(s.num_cells, s.sha256) for s in manifest.shards],  # (the values kind follows from them)
        "files": sorted((f.path, f.sha256) for f in manifest.files if not is_derived(f.path)),
    }
    if manifest.modalities:  # a single-modality dataset keeps the fingerprint it always had
        content["modality"] = manifest.modality
        content["modalities"] = [(m.name, m.path, m.features, m.fingerprint) for m in manifest.modalities]
    blob = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def fsync_path(path) -> None:
    """Flush a file's or a directory's data and metadata to disk (a directory: its entries)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: str | os.PathLike[str], *, chunk_bytes: int = 8 << 20) -> str:
    """SHA-256 of a file, read in chunks (constant memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def manifest_lock(root: str | os.PathLike[str]) -> Iterator[None]:
    """An exclusive ``flock`` on the dataset's folder ``root`` while its manifest is read, changed and
    replaced by a process that adds files to a dataset others may add to too (`oj.split`,
    ``omicsio-materialize stats``): two at once would each list only their own files, the one that
    replaced the manifest last dropping the other's. Where the file system has no ``flock`` on a
    folder (some network ones), none."""
    import fcntl

    try:
        fd = os.open(root, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):  # no flock here: no lock
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def file_entry(root: Path, relpath: str) -> FileEntry:
    full = root / relpath
    return FileEntry(relpath, full.stat().st_size, sha256_file(full))


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read and check ``<path>/manifest.json`` (``path`` a directory or an ``s3://`` URL); raise
    `DatasetFormatError` with a fix if absent or foreign."""
    if is_remote(path):
        url = s3_url(path)
        text = open_store(url).read_text(MANIFEST_NAME)
        if text is None:
            msg = (
                f"{url!r} has no {MANIFEST_NAME}: it is not a materialized dataset, or its upload did not "
                f"finish ({MANIFEST_NAME} is uploaded last); check the URL"
            )
            raise DatasetFormatError(msg)
        return parse_manifest(text, f"{url}/{MANIFEST_NAME}")
    root = Path(path)
    if not root.is_dir():
        msg = f"{str(root)!r} is not a directory: pass the output directory of `omicsio-materialize`"
        raise DatasetFormatError(msg)
    mpath = root / MANIFEST_NAME
    if not mpath.exists():
        # inputs of `omicsio-materialize` (a glance at the first entries), not a dataset that lost its manifest
        inputs = (".parquet", ".vortex", ".h5ad", ".h5mu", ".zarr")
        found = [p for _, p in zip(range(1000), root.rglob("*"), strict=False) if p.suffix in inputs]
        if found and not any(root.glob("shard-*.arrayrecord")):
            suffixes = sorted({p.suffix for p in found})
            # a folder of tables is one input; AnnData files are each one
            tables = {".parquet", ".vortex"} & set(suffixes)
            arg = f"{root}/" if tables else f"{root}/*{suffixes[0]}"
            msg = (
                f"{str(root)!r} has no {MANIFEST_NAME}: it holds input files ({', '.join(suffixes)}), not a "
                f"materialized dataset; materialize it first: `omicsio-materialize {arg} OUT/`, then open OUT/"
            )
            raise DatasetFormatError(msg)
        partial = ".partial-" in root.name
        msg = (
            f"{str(root)!r} has no {MANIFEST_NAME}: it is the unfinished output of a materialize run that "
            "was stopped; open the output it was to become, or run the conversion again (a run into that "
            "output removes this folder)"
            if partial
            else f"{str(root)!r} has no {MANIFEST_NAME}: it is not a materialized dataset, or its "
            "materialization did not finish (run `omicsio-materialize` into it again)"
        )
        raise DatasetFormatError(msg)
    try:
        text = mpath.read_text()
    except OSError as e:
        msg = f"cannot parse {mpath}: {e}"
        raise DatasetFormatError(msg) from e
    return parse_manifest(text, str(mpath))


def dataset_root(path: str | os.PathLike[str], manifest: Manifest) -> str | os.PathLike[str]:
    """Where the files of the dataset whose manifest at ``path`` is ``manifest`` live: ``path``
    itself, or on object storage its current generation, ``path/gen-...``.

    Replacing a dataset on object storage (``materialize(..., overwrite=True)``) writes the new one
    under a new generation prefix, switches the manifest at ``path`` (one PUT) to point there, then
    deletes the old files: a reader sees one whole dataset or the other, and one that opened the old
    generation keeps a consistent view of it (its objects are never rewritten in place)."""
    if not manifest.generation:
        return path
    generation = PurePosixPath(manifest.generation)
    if not is_remote(path) or len(generation.parts) != 1 or not manifest.generation.startswith("gen-"):
        msg = f"{path}: {MANIFEST_NAME} names generation {manifest.generation!r}, which is not one of its prefixes"
        raise DatasetFormatError(msg)
    return f"{s3_url(path)}/{manifest.generation}"


def parse_manifest(text: str, where: str) -> Manifest:
    """The manifest in ``text`` (read from ``where``), checked to be one this version reads."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        msg = f"cannot parse {where}: {e}"
        raise DatasetFormatError(msg) from e
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        found = raw.get("format") if isinstance(raw, dict) else None
        msg = f"{where} is not an omicsio_jax manifest (format={found!r})"
        raise DatasetFormatError(msg)
    if raw.get("format_version") != FORMAT_VERSION:
        msg = (
            f"{where} has format_version {raw.get('format_version')}, this omicsio_jax reads "
            f"version {FORMAT_VERSION}: re-materialize the dataset or install a matching omicsio_jax"
        )
        raise DatasetFormatError(msg)
    try:
        manifest = Manifest.from_dict(raw)
        _check_types(manifest)
        _check_layout(manifest)
    except (KeyError, TypeError, ValueError) as e:
        msg = f"{where} is malformed: {e}"
        raise DatasetFormatError(msg.replace("\n", " ")) from e
    return manifest


_JSON_TYPES = {"int": int, "str": str, "dict[str, Any]": dict}


def _check_types(entry) -> None:
    """Every field of a manifest (or of one of its entries) holds a value of its declared type
    (counts non-negative): a hand-edited or damaged manifest fails here, not in a reader later."""
    for field in dataclasses.fields(entry):
        value, kind = getattr(entry, field.name), field.type
        name = f"{type(entry).__name__}.{field.name}"
        if kind.startswith("tuple["):
            if not isinstance(value, tuple):
                raise TypeError(f"{name} is {value!r}, not a list")
            for item in value:
                _check_types(item)
            continue
        if kind == "int | None" and value is None:
            continue
        want = _JSON_TYPES[kind.removesuffix(" | None")]
        if not isinstance(value, want) or isinstance(value, bool) or (want is int and value < 0):
            raise TypeError(
                f"{name} is {value!r}, not {'a non-negative int' if want is int else want.__name__}"
            )


def _check_layout(m: Manifest) -> None:
    """The shards are what the readers assume (shard ``i`` holds cells ``[i·shard_cells, ...)``, every
    shard full but the last, together ``num_cells``), and the sizes the decoders take are in range: a
    hand-edited or damaged manifest would otherwise read a cell from another one's place."""
    if m.layout not in LAYOUTS:
        raise ValueError(f"layout is {m.layout!r}, not one of {', '.join(LAYOUTS)}")
    if m.num_genes > np.iinfo(np.int32).max:  # columns are int32 in every decoder's output
        raise ValueError(f"num_genes is {m.num_genes:,}, more than int32 columns hold")
    group_size = m.array_record.get("group_size")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"array_record.group_size is {group_size!r}, not a positive int")
    if m.shard_cells < 1:
        raise ValueError(f"shard_cells is {m.shard_cells}, not a positive int")
    expected = -(-m.num_cells // m.shard_cells)
    if len(m.shards) != expected:
        raise ValueError(
            f"{len(m.shards)} shards for {m.num_cells:,} cells of {m.shard_cells:,} per shard, not {expected}"
        )
    for i, shard in enumerate(m.shards):
        first = i * m.shard_cells
        cells = min(m.shard_cells, m.num_cells - first)
        if (shard.first_cell, shard.num_cells) != (first, cells):
            raise ValueError(
                f"shard {i} ({shard.path}) holds cells {shard.first_cell:,}+{shard.num_cells:,}, not {first:,}+{cells:,}"
            )
        if shard.path != f"shard-{i:05d}.arrayrecord":  # the name materialize gives shard i, and no other
            raise ValueError(f"shard {i} is {shard.path!r}, not shard-{i:05d}.arrayrecord")


def verify_dataset(path: str | os.PathLike[str]) -> list[str]:
    """Recheck sizes and SHA-256 of every file in the manifest (``path`` a directory or an ``s3://``
    URL, whose objects are streamed, not stored); return a list of problems (empty if sound)."""
    manifest = read_manifest(path)
    path = dataset_root(path, manifest)
    entries = [(s.path, s.num_bytes, s.sha256) for s in manifest.shards]
    entries += [(f.path, f.num_bytes, f.sha256) for f in manifest.files]
    if is_remote(path):
        store = open_store(path)
        sizes = dict(store.list())

        def sha_of(relpath: str) -> str:
            return _sha256_object(store, relpath, sizes[relpath])
    else:
        root = Path(path)
        sizes = {p: (root / p).stat().st_size for p, _, _ in entries if (root / p).exists()}

        def sha_of(relpath: str) -> str:
            return sha256_file(root / relpath)

    problems = []
    for relpath, num_bytes, sha in entries:
        size = sizes.get(relpath)
        if size is None:
            problems.append(f"{relpath}: missing")
            continue
        if size != num_bytes:
            problems.append(f"{relpath}: {size} bytes, manifest says {num_bytes}")
            continue
        actual = sha_of(relpath)
        if actual != sha:
            problems.append(f"{relpath}: sha256 {actual[:16]}…, manifest says {sha[:16]}…")
    if compute_fingerprint(manifest) != manifest.fingerprint:
        problems.append("manifest.json: fingerprint does not match its content")
    for entry in manifest.modalities:
        problems += _verify_modality(path, entry)
    return problems


def _verify_modality(path: str | os.PathLike[str], entry: ModalityEntry) -> list[str]:
    """A further modality's own dataset, checked through and against its entry in the primary's manifest."""
    sub = f"{s3_url(path)}/{entry.path}" if is_remote(path) else Path(path) / entry.path
    manifest_path = f"{entry.path}/{MANIFEST_NAME}"
    if is_remote(path):
        text = open_store(str(sub)).read_text(MANIFEST_NAME)
        if text is None:
            return [f"{manifest_path}: missing"]
        sha = hashlib.sha256(text.encode()).hexdigest()
    elif not (Path(sub) / MANIFEST_NAME).exists():
        return [f"{manifest_path}: missing"]
    else:
        sha = sha256_file(Path(sub) / MANIFEST_NAME)
    if sha != entry.manifest_sha256:
        return [f"{manifest_path}: sha256 {sha[:16]}…, manifest says {entry.manifest_sha256[:16]}…"]
    return [f"{entry.path}/{problem}" for problem in verify_dataset(sub)]


def _sha256_object(store, key: str, num_bytes: int, *, piece_bytes: int = 8 << 20, window: int = 8) -> str:
    """SHA-256 of an object, streamed by concurrent range GETs of ``window`` pieces at a time."""
    digest = hashlib.sha256()
    starts = range(0, num_bytes, piece_bytes)
    for i in range(0, len(starts), window):
        ranges = [(b, min(b + piece_bytes, num_bytes)) for b in starts[i : i + window]]
        for blob in store.get_ranges(key, ranges, None):
            digest.update(blob)
    return digest.hexdigest()

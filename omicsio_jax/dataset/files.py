"""An open dataset's files (`Dataset`): where they are, checked, how reads reach them, and their
closing.

`locate` finds the dataset at a path: a local directory that holds every shard its manifest lists,
or on object storage the current generation of its root. `DatasetFiles` gives the local file of
each of its files (`Dataset.local_path`), checked: a local dataset's against the manifest's sizes
(`ListedFiles`), a remote one's downloaded into its cache (`remote.RemoteDataset`). It decides how
the shards are read: from their chunks where they allow it (`ChunkReader`), and a local dataset's
with ``O_DIRECT`` if asked, or by default if they add up to more than the memory this process may
use. Before a read (`Dataset.prepared`) it fetches a remote dataset's chunks, or announces a local
one's byte ranges to the kernel (`ReadAhead`) where they are read through the page cache. Closing
the files hands the freed heap back to the system.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omicsio_jax.core.errors import DatasetFormatError
from omicsio_jax.dataset.chunk_indexes import ChunkIndexes
from omicsio_jax.dataset.listed_files import ListedFiles
from omicsio_jax.format.manifest import Manifest, dataset_root, read_manifest
from omicsio_jax.records.chunk_reader import supported as chunks_readable
from omicsio_jax.records.readahead import ReadAhead
from omicsio_jax.records.shard_files import ShardFiles
from omicsio_jax.storage import direct_io
from omicsio_jax.storage.memory import memory_limit, release_freed_memory
from omicsio_jax.storage.store import is_remote, s3_url

if TYPE_CHECKING:
    from omicsio_jax.dataset.remote import RemoteDataset


def locate(path: str | os.PathLike[str]) -> tuple[Path | str, Manifest]:
    """The root (a `Path`, or for a dataset on object storage its URL) and manifest of the dataset
    at ``path``. A local directory must hold every shard its manifest lists. On object storage the
    root is a replaced dataset's current generation, whose manifest reads as no generation's:
    reopening the root (`Dataset.open_options`, Grain's workers) reads this one even after a later
    switch."""
    if is_remote(path):
        url = s3_url(path)  # not str(path).rstrip("/"): "s3://" would become the local "s3:"
        manifest = read_manifest(url)
        return dataset_root(url, manifest), dataclasses.replace(manifest, generation="")
    # absolute: every read opens the dataset's files by path, and a process may change its working
    # directory after opening it (Hydra does; so may a library), which must not make the dataset
    # read as replaced nor send Grain's workers to another folder
    root = Path(path).absolute()
    manifest = read_manifest(root)
    for shard in manifest.shards:
        if not (root / shard.path).exists():
            msg = f"{root}: shard {shard.path} listed in the manifest is missing"
            raise DatasetFormatError(msg)
    return root, manifest


class DatasetFiles:
    """The files of ``dataset`` (its ``path`` and ``manifest`` found by `locate`), opened with the
    ``options`` it was opened with (`open_dataset`'s keywords): ``cache_dir`` and ``cache_bytes``
    for a remote one's cache, ``readahead``, and ``chunk_reader`` and ``direct_io``, which decide
    `chunks` and `direct`."""

    def __init__(self, dataset: ShardFiles, options: Mapping[str, Any]):
        root = self._root = dataset.path
        self.remote: RemoteDataset | None = None
        self.readahead: ReadAhead | None = None
        # read straight from the chunks (`ChunkReader`) where the shards allow it, else by ArrayRecord's reader
        self.chunks = options["chunk_reader"] and chunks_readable(dataset)
        if isinstance(root, Path):
            self._listed = ListedFiles(root)
            self.direct = self.chunks and _direct_io(root, dataset.manifest, options["direct_io"])
            # a direct read has no use for the page cache's read-ahead
            if options["readahead"] and not self.direct:
                self.readahead = ReadAhead(dataset)
            self.chunk_indexes = ChunkIndexes(root, dataset.local_path)
        else:
            from omicsio_jax.dataset.remote import RemoteDataset

            self.remote = RemoteDataset(
                root,
                dataset.manifest,
                cache_dir=options["cache_dir"],
                cache_bytes=options["cache_bytes"],
                opening=not self.chunks,
            )  # the chunk reader reads no footer
            self.direct = self.chunks and bool(options["direct_io"])  # as asked
            # one set of chunk indexes per dataset: a remote one's are its mirrors' (loaded and checked once)
            self.chunk_indexes = self.remote.mirrors.chunk_indexes

    def local_path(self, manifest: Manifest, relpath: str) -> Path:
        """The local file of the dataset's file ``relpath`` (see `Dataset.local_path`), ``manifest``
        the dataset's as it is now."""
        parts = relpath.replace("\\", "/").split("/")
        if relpath.startswith(("/", "\\")) or ".." in parts or "\0" in relpath:
            msg = (
                f"{self._root}: its manifest names the file {relpath!r}, outside the dataset; the manifest "
                "is damaged or was not written by omicsio-materialize: materialize the dataset again"
            )
            raise DatasetFormatError(msg)
        if self.remote is None:
            return self._listed.checked(manifest, relpath)
        return self.remote.local_path(relpath)

    def prepared(self, pieces: Sequence[tuple[int, int, int]], *, refetch: int | None, announce_first: bool):
        """A context in which ``pieces`` can be read from `local_path` of their shards (see
        `Dataset.prepared`): a remote dataset's chunks fetched, a local one's byte ranges announced."""
        if self.remote is None:
            if self.readahead is not None:
                (self.readahead.advise if announce_first else self.readahead.start)(pieces)
            return contextlib.nullcontext()
        return self.remote.mirrors.prepared(pieces, refetch=refetch)

    def close(self) -> None:
        """Close the read-ahead and a remote dataset's store, then hand the freed heap back to the
        system (`release_freed_memory`), so that a job reopening datasets keeps a flat footprint."""
        if self.readahead is not None:
            self.readahead.close()
        if self.remote is not None:
            self.remote.close()
        release_freed_memory()


def _direct_io(root: Path, manifest: Manifest, wanted: bool | None) -> bool:
    """Whether to read the shards with ``O_DIRECT`` (`direct_io`): if asked, or by default if they
    add up to more than the memory this process may use (`memory_limit`: RAM, or a container's
    cgroup limit; the page cache cannot hold them); and if their file system allows it."""
    if wanted is False or not manifest.shards:
        return False
    if wanted is None:  # beyond the memory this process may use; an unknown size is never "beyond"
        limit = memory_limit()
        if limit is None or sum(s.num_bytes for s in manifest.shards) <= limit:
            return False
    return direct_io.supported(root / manifest.shards[0].path)

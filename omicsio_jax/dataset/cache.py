"""The local cache of a dataset on object storage: where it lives, its budget, its checked files.

A dataset opened from ``s3://bucket/prefix/`` is read through a cache root (``cache_dir``, by
default ``<user cache>/datasets/<fingerprint>``, the user cache being ``$OMICSIO_JAX_CACHE`` or
``~/.cache/omicsio_jax``) laid out like the dataset directory itself: the small files of
``manifest.files`` (features, cell ids, obs, gene statistics, chunk indexes) are downloaded there
once, whole, and checked against the manifest's size and SHA-256 (`FileCache`); the shards get
sparse mirrors there (see `mirrors`). `IOStats` counts what was fetched.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import threading
from pathlib import Path

from omicsio_jax.core.errors import DatasetFormatError, OmicsIOError
from omicsio_jax.format.manifest import MANIFEST_NAME, Manifest, sha256_file
from omicsio_jax.storage.store import ObjectChangedError, ObjectStoreError, S3Store, default_cache_dir

MAX_CACHE_BYTES = 32 << 30


@dataclasses.dataclass(frozen=True)
class IOStats:
    """What a dataset on object storage fetched since it was opened (all zeros for a local one).

    ``bytes_fetched / bytes_needed`` is the read amplification of the data chunk GETs: the needed
    bytes are those of the missing chunks that reads asked for, the fetched ones add the small
    gaps merged into the same GET. Opening ranges (head, footer and postscript of each shard) and
    whole-file downloads of the small files are counted apart.
    """

    num_gets: int = 0  # range GETs of data chunks
    bytes_fetched: int = 0  # bytes those GETs returned
    bytes_needed: int = 0  # bytes of the missing chunks they were issued for
    chunk_hits: int = 0  # chunks a read needed that were already in the cache
    chunk_misses: int = 0  # chunks a read needed that were fetched
    opening_gets: int = 0  # GETs of shards' opening ranges
    opening_bytes: int = 0
    head_requests: int = 0  # one per shard first used by this process
    files_downloaded: int = 0  # small files (manifest.files) downloaded whole
    file_bytes: int = 0
    evictions: int = 0  # times a shard's data chunks were dropped to stay within cache_bytes
    cached_bytes: int = 0  # data chunk bytes in the cache now
    cache_bytes: int = 0  # the budget for them

    @property
    def fetch_ratio(self) -> float:
        """``bytes_fetched / bytes_needed`` (1.0 when nothing was fetched)."""
        return self.bytes_fetched / self.bytes_needed if self.bytes_needed else 1.0


class Counters:
    """Thread-safe running totals of `IOStats` fields."""

    def __init__(self):
        self._lock = threading.Lock()
        self._values: collections.Counter[str] = collections.Counter()

    def add(self, **amounts: int) -> None:
        with self._lock:
            self._values.update(amounts)

    def snapshot(self, **current: int) -> IOStats:
        with self._lock:
            return IOStats(**{**self._values, **current})


def default_cache_root(fingerprint: str) -> Path:
    """``<user cache>/datasets/<fingerprint>``: one cache per dataset content, whatever its URL."""
    return default_cache_dir() / "datasets" / fingerprint


def default_cache_bytes(root: Path) -> int:
    """min(32 GiB, half the free space of the filesystem holding ``root``), at open time."""
    return min(MAX_CACHE_BYTES, shutil.disk_usage(root).free // 2)


def make_cache_root(root: Path) -> Path:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        msg = (
            f"cannot create the dataset cache {root}: {e.strerror}; pass cache_dir= or set OMICSIO_JAX_CACHE"
        )
        raise OmicsIOError(msg) from e
    return root


def write_atomic(path: Path, text: str) -> None:
    """Write a small text file under a temporary name, then rename it into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class FileCache:
    """The files of ``manifest.files`` of a remote dataset, downloaded once into ``root`` and checked.

    A file is downloaded under a temporary name, checked against the manifest's size and SHA-256,
    then renamed into place; ``<file>.sha256`` then records the checksum it was checked against, so
    a later process reuses it without rehashing and a file the manifest now lists with another
    checksum (gene statistics recomputed) is downloaded again.
    """

    def __init__(self, store: S3Store, manifest: Manifest, root: Path, counters: Counters):
        self.store, self.root, self.counters = store, root, counters
        self._entries = {f.path: f for f in manifest.files}
        self._lock = threading.Lock()
        self._file_locks: dict[str, threading.Lock] = {}

    def __contains__(self, relpath: str) -> bool:
        return relpath in self._entries

    def cached(self, relpath: str) -> Path | None:
        """The local copy of ``relpath`` if one checked against the current manifest is there."""
        entry, dest = self._entries[relpath], self.root / relpath
        try:
            if _marker(dest).read_text().strip() == entry.sha256 and dest.stat().st_size == entry.num_bytes:
                return dest
        except OSError:
            pass
        return None

    def path(self, relpath: str) -> Path:
        """The local copy of ``relpath``, downloaded and checked on first use."""
        if relpath not in self._entries:
            msg = (
                f"{self.store.describe(relpath)} is not listed in the manifest's files: the dataset was made "
                "by an older omicsio-materialize; re-materialize it, or add it with `omicsio-materialize stats`"
            )
            raise DatasetFormatError(msg)
        found = self.cached(relpath)
        if found is not None:
            return found
        with self._lock:
            lock = self._file_locks.setdefault(relpath, threading.Lock())
        with lock:
            return self.cached(relpath) or self._download(relpath)

    def _download(self, relpath: str) -> Path:
        entry, dest = self._entries[relpath], self.root / relpath
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}-{threading.get_ident()}.tmp")
        url = self.store.describe(relpath)
        try:
            self._fetch(relpath, tmp)
            size, sha = tmp.stat().st_size, sha256_file(tmp)
            if size != entry.num_bytes or sha != entry.sha256:
                raise_if_rewritten(self.store, "files", relpath, sha256=entry.sha256)
                raise DatasetFormatError.run_verify(
                    self.store.url,
                    f"{url}: {size:,} bytes with sha256 {sha[:16]}…, the manifest says {entry.num_bytes:,} "
                    f"bytes with {entry.sha256[:16]}…: the object is corrupted or was rewritten",
                )
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        write_atomic(_marker(dest), entry.sha256 + "\n")
        self.counters.add(files_downloaded=1, file_bytes=entry.num_bytes)
        return dest

    def _fetch(self, relpath: str, tmp: Path) -> None:
        try:
            self.store.download(relpath, tmp)
        except ObjectChangedError:
            raise
        except ObjectStoreError as e:
            if self.store.head(relpath) is None:
                raise_if_rewritten(self.store, "files", relpath, sha256=self._entries[relpath].sha256)
                missing = f"{self.store.describe(relpath)} is listed in the manifest but missing"
                raise DatasetFormatError.run_verify(self.store.url, missing) from e
            raise


def raise_if_rewritten(store: S3Store, listing: str, relpath: str, **expected: object) -> None:
    """Raise `ObjectChangedError` if the prefix's manifest no longer lists ``relpath`` in its
    ``listing`` (``"files"``, ``"shards"``) with the ``expected`` fields (``sha256=...``, and
    ``num_bytes=...`` for a shard) of the manifest the dataset was opened with (the dataset was
    rewritten, or replaced by a new generation, since it was opened): an object missing or changed is
    then another dataset's, not a damaged one. Used by `FileCache` for the small files and by the
    shard mirrors (`mirrors`)."""
    text = store.read_text(MANIFEST_NAME)
    try:
        current = json.loads(text) if text is not None else {}
        listed = {e["path"]: tuple(e[k] for k in expected) for e in current.get(listing, [])}
        same = not current.get("generation") and listed.get(relpath) == tuple(expected.values())
    except (ValueError, TypeError, KeyError, AttributeError):
        same = False
    if not same:
        msg = (
            f"{store.describe(relpath)} is no longer the one the dataset's manifest lists: the "
            f"dataset was rewritten under {store.url} since it was opened; open it again"
        )
        raise ObjectChangedError(msg)


def _marker(dest: Path) -> Path:
    return dest.with_name(f"{dest.name}.sha256")

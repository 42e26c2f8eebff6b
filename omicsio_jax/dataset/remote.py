"""A dataset on object storage, as `Dataset` sees it: local files for every relative path.

`RemoteDataset` joins the store, the cache root and its budget, the checked small files
(`cache.FileCache`) and the shards' sparse mirrors (`mirrors.ShardMirrors`).
"""

from __future__ import annotations

import os
from pathlib import Path

from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.dataset.cache import (
    Counters,
    FileCache,
    IOStats,
    default_cache_bytes,
    default_cache_root,
    make_cache_root,
)
from omicsio_jax.dataset.mirrors import ShardMirrors
from omicsio_jax.format.manifest import Manifest
from omicsio_jax.storage.store import S3Store


class RemoteDataset:
    """The local side of the dataset at ``url``: its cache root, small files and shard mirrors."""

    def __init__(
        self,
        url: str,
        manifest: Manifest,
        *,
        cache_dir: str | os.PathLike[str] | None,
        cache_bytes: int | None,
        opening: bool = True,
    ):
        if cache_bytes is not None and (isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int)):
            msg = f"cache_bytes must be an int (bytes), got {type(cache_bytes).__name__}"
            raise TypeError(msg)
        if cache_bytes is not None and cache_bytes <= 0:
            msg = f"cache_bytes must be positive, got {cache_bytes}; e.g. cache_bytes=64 << 30 for 64 GiB"
            raise OmicsIOError(msg)
        self.store = S3Store(url)
        root = Path(cache_dir) if cache_dir is not None else default_cache_root(manifest.fingerprint)
        self.root = make_cache_root(root)
        self.cache_bytes = cache_bytes if cache_bytes is not None else default_cache_bytes(self.root)
        self.counters = Counters()
        self.files = FileCache(self.store, manifest, self.root, self.counters)
        self.mirrors = ShardMirrors(
            self.store,
            manifest,
            self.root,
            self.files,
            self.counters,
            cache_bytes=self.cache_bytes,
            opening=opening,
        )
        self._shards = {s.path for s in manifest.shards}

    def local_path(self, relpath: str) -> Path:
        """A shard's sparse mirror, or a small file downloaded and checked on first use."""
        if relpath in self._shards:
            return self.root / relpath
        return self.files.path(relpath)

    def io_stats(self) -> IOStats:
        return self.counters.snapshot(cached_bytes=self.mirrors.cached, cache_bytes=self.cache_bytes)

    def close(self) -> None:
        self.mirrors.close()

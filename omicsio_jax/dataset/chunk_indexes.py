"""A dataset's chunk indexes (`Dataset.chunk_index`): the byte ranges of each shard's chunks, each
loaded on its first use, checked against its shard's manifest entry, and kept (`ChunkIndexes`).

The readers find a shard's chunks through it (`ReadAhead`, `ChunkReader`), so a damaged or foreign
index file is a `DatasetFormatError` naming it, its shard and ``omicsio-materialize verify``, not
reads of the wrong bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from omicsio_jax.core.errors import DatasetFormatError
from omicsio_jax.format.chunk_index import ChunkIndex, chunk_index_path, chunk_index_problem, load_chunk_index
from omicsio_jax.format.manifest import Manifest


class ChunkIndexes:
    """The chunk indexes of the dataset at ``where`` (its directory or URL, for messages), read from
    ``local_path`` (the local file of one of its files: `Dataset.local_path`; for a remote dataset,
    downloaded then). Safe to use from several threads at once: two that load the same index at
    once both return the one stored first."""

    def __init__(self, where: Path | str, local_path: Callable[[str], Path]):
        self._where, self._local_path = where, local_path
        self._indexes: dict[int, ChunkIndex] = {}
        self._lock = threading.Lock()

    def get(self, manifest: Manifest, shard: int) -> ChunkIndex:
        """Shard ``shard``'s chunk index (of ``manifest``'s shards), loaded on first use and kept
        (16 bytes per chunk)."""
        index = self._indexes.get(shard)
        if index is None:
            entry = manifest.shards[shard]
            relpath = chunk_index_path(entry.path)
            group_size = int(manifest.array_record["group_size"])
            try:
                rows = load_chunk_index(self._local_path(relpath))
            except (OSError, ValueError, EOFError) as e:
                problem = f"cannot be read ({type(e).__name__}: {e})"
            else:
                problem = chunk_index_problem(
                    rows, num_cells=entry.num_cells, num_bytes=entry.num_bytes, group_size=group_size
                )
            if problem is not None:
                raise DatasetFormatError.run_verify(
                    self._where,
                    f"{self._where}: the chunk index {relpath} of shard {entry.path} is damaged: {problem}",
                )
            index = ChunkIndex(rows, group_size)
            with self._lock:
                index = self._indexes.setdefault(shard, index)
        return index

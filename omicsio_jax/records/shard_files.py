"""What the record readers need of a dataset (`ShardFiles`), and how a failed read is reported (`ReadFailed`).

The readers of this layer never see `omicsio_jax.Dataset`: a dataset hands itself to them as a
`ShardFiles`, the few members they use, so the readers stay beneath the dataset in the layering.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

from omicsio_jax.format.chunk_index import ChunkIndex
from omicsio_jax.format.manifest import Manifest


class ReadFailed(Exception):
    """Records ``[begin, end)`` of shard ``shard`` cannot be read, for ``reason``."""

    def __init__(self, shard: int, begin: int, end: int, reason: str):
        super().__init__(reason)
        self.shard, self.begin, self.end, self.reason = shard, begin, end, reason


class ShardFiles(Protocol):
    """A materialized dataset as its shards' readers see it."""

    path: Path | str
    manifest: Manifest

    @property
    def is_remote(self) -> bool:
        """Whether the shards live on object storage (read through local mirrors)."""
        ...

    def local_path(self, relpath: str) -> Path:
        """The local file of the dataset's file ``relpath`` (a shard: its local mirror)."""
        ...

    def chunk_index(self, shard: int) -> ChunkIndex:
        """Shard ``shard``'s chunk index."""
        ...

    def chunk_index_path(self, shard: int) -> str:
        """Where shard ``shard``'s chunk index lies, relative to the dataset."""
        ...

    def prepared(
        self,
        pieces: Sequence[tuple[int, int, int]],
        *,
        refetch: int | None = None,
        announce_first: bool = True,
    ) -> AbstractContextManager[object]:
        """A context in which the records ``(shard, begin, end)`` of ``pieces`` can be read."""
        ...

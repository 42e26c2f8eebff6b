"""ArrayRecord shard writing and the all-or-nothing output directory."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from omicsio_jax import OmicsIOError
from omicsio_jax._manifest import MANIFEST_NAME, ShardEntry, fsync_path, sha256_file


def writer_options(group_size: int, compression: str) -> str:
    """The ArrayRecord writer options, always explicit (the library default is group_size 65536 + brotli)."""
    return f"group_size:{group_size},{compression}"


class ShardWriter:
    """Writes records to ``shard-NNNNN.arrayrecord`` files of exactly ``shard_cells`` records each."""

    def __init__(self, root: Path, *, shard_cells: int, options: str):
        self.root, self.shard_cells, self.options = root, shard_cells, options
        self.shards: list[ShardEntry] = []
        self.num_bytes = 0
        self._writer: ArrayRecordWriter | None = None
        self._in_shard = 0
        self._first_cell = 0

    def _open_next(self) -> None:
        name = f"shard-{len(self.shards):05d}.arrayrecord"
        self._writer = ArrayRecordWriter(str(self.root / name), self.options)
        self._name = name

    def _close_current(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        path = self.root / self._name
        size = path.stat().st_size
        self.shards.append(ShardEntry(self._name, self._first_cell, self._in_shard, size, sha256_file(path)))
        self.num_bytes += size
        self._first_cell += self._in_shard
        self._writer, self._in_shard = None, 0

    def write(self, buf: np.ndarray, starts: np.ndarray) -> None:
        """Append the records ``buf[starts[i]:starts[i+1]]`` in order."""
        data = buf.tobytes()
        bounds = starts.tolist()
        for i in range(len(bounds) - 1):
            if self._writer is None:
                self._open_next()
            self._writer.write(data[bounds[i] : bounds[i + 1]])
            self._in_shard += 1
            if self._in_shard == self.shard_cells:
                self._close_current()

    def close(self) -> list[ShardEntry]:
        self._close_current()
        return self.shards

    def abort(self) -> None:
        """Release the open shard file after a failure (the directory is removed anyway)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


@contextlib.contextmanager
def atomic_output_dir(out: Path, *, overwrite: bool, manifest: str = MANIFEST_NAME) -> Iterator[Path]:
    """Yield a hidden temporary sibling of ``out``; on success it replaces ``out`` by rename.

    On any exception (Ctrl-C included) the temporary directory is removed and an existing
    ``out`` is left untouched. A hard kill can leave only a hidden ``.<name>.partial-*`` sibling
    without a manifest, which `open_dataset` refuses and the next run ignores.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        msg = f"output {str(out)!r} already exists; pass --overwrite (overwrite=True) to replace it"
        raise OmicsIOError(msg)
    if out.exists() and not (out / manifest).exists() and any(out.iterdir()):
        msg = f"refusing to overwrite {str(out)!r}: it is not empty and has no {manifest}"
        raise OmicsIOError(msg)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        for name in os.listdir(tmp):
            if os.path.isfile(tmp / name):
                fsync_path(tmp / name)
        if not (tmp / manifest).exists():
            msg = f"internal error: the output was finished without {manifest}"
            raise OmicsIOError(msg)
        if out.exists():
            old = out.parent / f".{out.name}.old-{secrets.token_hex(4)}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

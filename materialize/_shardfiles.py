"""ArrayRecord shard files, written in this process or in a child process fed through shared memory.

ArrayRecord's Python `write` compresses while holding the GIL, so inside the materialize process
it stalls the reader and the encoder. `materialize` therefore runs the writing in a child
process: the parent encodes each batch into a shared-memory slot (an anonymous ``memfd``) and
sends only the slot number and the record offsets over a socket; the child slices, compresses and
writes the records, and hashes each finished shard.

This module is that child when run as a script (``python -P _shardfiles.py FD``). It imports only
the standard library and array_record, so the child starts in a few tens of milliseconds
instead of the second that importing ``omicsio_jax`` (and JAX) takes.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import signal
import sys
import traceback
from pathlib import Path

from array_record.python.array_record_module import ArrayRecordWriter

# (path, first_cell, num_cells, num_bytes, sha256): the fields of omicsio_jax's ShardEntry.
ShardTuple = tuple[str, int, int, int, str]


class ShardFiles:
    """Appends records to ``shard-NNNNN.arrayrecord`` files of exactly ``shard_cells`` records each."""

    def __init__(self, root: str | os.PathLike[str], shard_cells: int, options: str):
        self.root, self.shard_cells, self.options = Path(root), shard_cells, options
        self.shards: list[ShardTuple] = []
        self._writer: ArrayRecordWriter | None = None
        self._name = ""
        self._in_shard = 0
        self._first_cell = 0

    def write(self, data, bounds) -> None:
        """Append the records ``data[bounds[i]:bounds[i+1]]`` in order (``data``: any buffer)."""
        view = memoryview(data)
        for i in range(len(bounds) - 1):
            if self._writer is None:
                self._name = f"shard-{len(self.shards):05d}.arrayrecord"
                self._writer = ArrayRecordWriter(str(self.root / self._name), self.options)
            self._writer.write(bytes(view[bounds[i] : bounds[i + 1]]))
            self._in_shard += 1
            if self._in_shard == self.shard_cells:
                self._finish_shard()

    def _finish_shard(self) -> None:
        self._writer.close()
        self._writer = None
        path = self.root / self._name
        with open(path, "rb") as f:
            sha = hashlib.file_digest(f, "sha256").hexdigest()
        self.shards.append((self._name, self._first_cell, self._in_shard, path.stat().st_size, sha))
        self._first_cell += self._in_shard
        self._in_shard = 0

    def close(self) -> list[ShardTuple]:
        if self._writer is not None:
            self._finish_shard()
        return self.shards

    def abort(self) -> None:
        """Release the open shard file after a failure (the output directory is removed anyway)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _peak_rss_bytes() -> int | None:
    """This process's VmHWM (Linux), for the benchmarks' memory figures."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


def serve(fd: int) -> None:
    """The child's loop: messages from the parent, one at a time, over the socket ``fd``.

    ``("open", root, shard_cells, options)``; ``("slot", k, size)`` followed by the slot's file
    descriptor; ``("write", k, bounds)`` with the record offsets as int64 bytes, answered by
    ``("done", k)`` once the slot may be reused; ``("close",)`` answered by ``("closed", (shards, peak_rss_bytes))``.
    Any failure is answered by ``("error", text)``. The parent going away (EOF) aborts.
    """
    from multiprocessing.connection import Connection
    from multiprocessing.reduction import recv_handle

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and tells us to stop
    conn = Connection(fd)
    files: ShardFiles | None = None
    slots: dict[int, mmap.mmap] = {}
    try:
        while True:
            message = conn.recv()
            op = message[0]
            if op == "open":
                files = ShardFiles(*message[1:])
            elif op == "slot":
                k, size = message[1:]
                slot_fd = recv_handle(conn)
                if k in slots:
                    slots[k].close()
                slots[k] = mmap.mmap(slot_fd, size, prot=mmap.PROT_READ)
                os.close(slot_fd)
            elif op == "write":
                k, bounds = message[1:]
                files.write(slots[k], memoryview(bounds).cast("q"))
                conn.send(("done", k))
            elif op == "close":
                conn.send(("closed", (files.close(), _peak_rss_bytes())))
                files = None
                return
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the parent has gone (it aborted, or died): stop quietly
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        detail = "".join(traceback.format_exception_only(e)).strip()
        try:
            conn.send(("error", detail))
        except OSError:
            traceback.print_exc()
    finally:
        if files is not None:
            files.abort()


if __name__ == "__main__":
    serve(int(sys.argv[1]))

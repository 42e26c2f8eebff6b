"""ArrayRecord shard files, written in this process or in a child process fed through shared memory.

ArrayRecord's Python `write` compresses while holding the GIL, so inside the materialize process
it stalls the reader and the encoder. `materialize` therefore runs the writing in a child
process: the parent encodes each batch into a shared-memory slot (an anonymous ``memfd``) and
sends only the slot number and the record offsets over a socket; the child slices, compresses and
writes the records, and hashes each finished shard.

This module is that child when run as a script (``python -P _shardfiles.py FD``). It imports only
the standard library, numpy and array_record, so the child starts in a few tens of milliseconds.

Beside each shard it writes the shard's chunk index (``chunks/shard-NNNNN.npy``, see
`omicsio_jax.format.chunk_index`): the byte range of every data chunk, found by walking the riegeli chunk
headers of the finished file, so that a reader of the shard on object storage can fetch exactly
the chunks a read needs.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import signal
import struct
import sys
import traceback
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

# (path, first_cell, num_cells, num_bytes, sha256): the fields of omicsio_jax's ShardEntry.
ShardTuple = tuple[str, int, int, int, str]


# riegeli's layout (riegeli/doc/riegeli_records_file_format.md): a 24-byte block header at every
# multiple of 64 KiB interrupts the sequence of chunks, each a 40-byte header and its data.
_BLOCK, _BLOCK_HEADER, _CHUNK_HEADER = 1 << 16, 24, 40
_USABLE = _BLOCK - _BLOCK_HEADER
_RECORDS_CHUNK = ord("r")  # a simple chunk of records (ArrayRecord writes no transposed chunks here)


def _read_logical(f, pos: int, n: int) -> bytes:
    """``n`` bytes of the chunk sequence from file position ``pos``, skipping block headers."""
    out = bytearray()
    while n > 0:
        if pos % _BLOCK == 0:
            pos += _BLOCK_HEADER
        take = min(n, _BLOCK - pos % _BLOCK)
        piece = os.pread(f, take, pos)
        if len(piece) != take:
            msg = f"truncated riegeli file: {take} bytes expected at {pos}"
            raise OSError(msg)
        out += piece
        pos, n = pos + take, n - take
    return bytes(out)


def _chunk_end(begin: int, data_size: int, num_records: int) -> int:
    """Where the chunk starting at ``begin`` ends (the format's AddWithOverhead / RoundUpToPossibleChunkBoundary)."""
    size = _CHUNK_HEADER + data_size
    with_headers = begin + size + (size + (begin + _USABLE - 1) % _BLOCK) // _USABLE * _BLOCK_HEADER
    pos = begin + num_records
    remaining = _BLOCK - 1 - (pos + _BLOCK - 1) % _BLOCK
    return max(with_headers, pos + max(remaining - (_USABLE - 1), 0))


def chunk_ranges(path: str | os.PathLike[str], num_records: int) -> np.ndarray:
    """Byte ranges ``(k, 2)`` uint64 of an ArrayRecord file written here: its head (the chunks before
    the first record), its footer chunk and its postscript chunk (what a reader reads on opening),
    then one row per data chunk, in record order."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size, pos, chunks = os.fstat(fd).st_size, 0, []
        while pos < size:
            _, data_size, _, type_and_records, _ = struct.unpack(
                "<QQQQQ", _read_logical(fd, pos, _CHUNK_HEADER)
            )
            num = type_and_records >> 8
            end = _chunk_end(pos, data_size, num)
            chunks.append((pos, end, type_and_records & 0xFF, num))
            pos = end
    finally:
        os.close(fd)
    records = [c for c in chunks if c[2] == _RECORDS_CHUNK]
    data, seen = [], 0
    for chunk in records:
        if seen >= num_records:
            break
        data.append(chunk)
        seen += chunk[3]
    footer = records[len(data) :]
    if seen != num_records or len(footer) != 2 or not data:
        msg = f"{path}: unexpected ArrayRecord layout ({seen} records in {len(data)} data chunks, {len(footer)} after)"
        raise OSError(msg)
    rows = [(0, data[0][0]), footer[0][:2], footer[1][:2]] + [c[:2] for c in data]
    return np.array(rows, dtype=np.uint64)


class ShardFiles:
    """Appends records to ``shard-NNNNN.arrayrecord`` files of exactly ``shard_cells`` records each,
    numbered from ``first_shard``; with ``index_dir`` each finished shard's `chunk_ranges` go to
    ``<index_dir>/shard-NNNNN.npy``."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        shard_cells: int,
        options: str,
        first_shard: int = 0,
        index_dir: str | None = None,
    ):
        self.root, self.shard_cells, self.options = Path(root), shard_cells, options
        self.first_shard, self.index_dir = first_shard, index_dir
        self.shards: list[ShardTuple] = []
        self._writer: ArrayRecordWriter | None = None
        self._name = ""
        self._in_shard = 0
        self._first_cell = first_shard * shard_cells

    def write(self, data, bounds) -> None:
        """Append the records ``data[bounds[i]:bounds[i+1]]`` in order (``data``: any buffer)."""
        view = memoryview(data)
        for i in range(len(bounds) - 1):
            if self._writer is None:
                self._name = f"shard-{self.first_shard + len(self.shards):05d}.arrayrecord"
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
        if self.index_dir is not None:
            index = self.root / self.index_dir / Path(self._name).with_suffix(".npy").name
            index.parent.mkdir(exist_ok=True)
            np.save(index, chunk_ranges(path, self._in_shard))
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


def serve(fd: int) -> None:
    """The child's loop: messages from the parent, one at a time, over the socket ``fd``.

    ``("open", root, shard_cells, options, first_shard, index_dir)``; ``("slot", k, size)`` followed
    by the slot's file descriptor; ``("write", k, bounds)`` with the record offsets as int64 bytes, answered by
    ``("done", k)`` once the slot may be reused; ``("close",)`` answered by ``("closed", shards)``,
    after which another ``open`` may follow (the slots stay mapped). Any failure is answered by
    ``("error", text)`` and ends the child. The parent going away (EOF) aborts an open shard and ends it.
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
                closed, files = files.close(), None
                conn.send(("closed", closed))
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

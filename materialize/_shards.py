"""ArrayRecord shard writing and the all-or-nothing output directory."""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from concurrent import futures
from concurrent.futures import Future
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from pathlib import Path

import numpy as np

from omicsio_jax import OmicsIOError
from omicsio_jax.format import MANIFEST_NAME, ShardEntry, exchange_paths, fsync_path

from ._shardfiles import ShardFiles


class ShardWriter:
    """Writes records to ``shard-NNNNN.arrayrecord`` files of exactly ``shard_cells`` records each,
    in this process (see `ShardWriterProcess` for the faster child-process writer)."""

    def __init__(
        self,
        root: Path,
        *,
        shard_cells: int,
        options: str,
        first_shard: int = 0,
        index_dir: str | None = None,
    ):
        self._files = ShardFiles(root, shard_cells, options, first_shard, index_dir)

    @staticmethod
    def buffer(nbytes: int) -> np.ndarray:
        """A buffer of ``nbytes`` to encode the next batch into (see `ShardWriterProcess.buffer`)."""
        return np.empty(nbytes, dtype=np.uint8)

    def write(self, buf: np.ndarray, starts: np.ndarray, *, readers=()) -> None:
        """Append the records ``buf[starts[i]:starts[i+1]]`` in order (``readers``: see
        `ShardWriterProcess.write`; here the records are written before this returns)."""
        self._files.write(buf, starts.tolist())

    def close(self) -> list[ShardEntry]:
        return [ShardEntry(*shard) for shard in self._files.close()]

    finish = close  # nothing to keep between partitions in this process

    def abort(self) -> None:
        self._files.abort()


class _Slot:
    """A shared-memory buffer (an anonymous memfd) mapped here and in the writer process."""

    def __init__(self, index: int, size: int):
        self.index, self.size = index, size
        self.fd = os.memfd_create(f"omicsio-slot-{index}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size)
        self.array = np.frombuffer(self.map, dtype=np.uint8)

    def close(self) -> None:
        self.array = None
        try:
            self.map.close()
        except BufferError:  # a view still lives (say, in a traceback): unmapped when it goes
            pass
        os.close(self.fd)


class ShardWriterDied(OmicsIOError):
    """The shard writer process ended without a word (killed, or out of memory): its partition's
    worker is as good as dead, and a pool writes the partition again (`materialize._pool.serve`)."""


class ShardWriterProcess:
    """`ShardWriter` run in a child process, fed through ``depth`` shared-memory slots.

    The batch is encoded straight into a free slot (`buffer`), and `write` hands the slot over and
    returns; the child compresses and writes it (holding its own GIL, not ours). Errors in the child
    are raised here, at the next call.
    `finish` closes the shards and keeps the child and its slots for the next `open` (a worker
    writing partition after partition spares a Python start and its slots' page faults each
    time); `close` finishes and stops the child.
    """

    def __init__(
        self,
        root: Path,
        *,
        shard_cells: int,
        options: str,
        first_shard: int = 0,
        index_dir: str | None = None,
        depth: int = 3,
    ):
        parent, child = socket.socketpair()
        script = Path(__file__).with_name("_shardfiles.py")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-P", str(script), str(child.fileno())],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # Ctrl-C reaches only the parent
        finally:
            child.close()
        self._conn = Connection(parent.detach())
        self._slots: list[_Slot | None] = []
        self._free: list[int] = []  # slots not in the child's hands; the others await its "done"
        self._readers: dict[int, tuple[Future, ...]] = {}  # slot → who may still read its last batch
        self._taken: _Slot | None = None  # the slot `buffer` gave, until `write`
        self._depth = depth
        self.open(
            root, shard_cells=shard_cells, options=options, first_shard=first_shard, index_dir=index_dir
        )

    def open(
        self,
        root: Path,
        *,
        shard_cells: int,
        options: str,
        first_shard: int = 0,
        index_dir: str | None = None,
    ) -> None:
        """Start writing shards under ``root`` (at construction, or again after `finish`)."""
        self._send("open", str(root), shard_cells, options, first_shard, index_dir)

    @property
    def pid(self) -> int:
        """The child process's id."""
        return self._proc.pid

    @staticmethod
    def available() -> bool:
        """Shared memory by memfd (Linux) and a Python executable to start the child with."""
        return hasattr(os, "memfd_create") and bool(sys.executable)

    def _send(self, *message) -> None:
        try:
            self._conn.send(message)
        except OSError:  # the child has gone: raise what it reported (replies may be queued before it)
            while True:
                self._receive(None)

    def _receive(self, expected: str | None):
        """The child's next reply (of kind ``expected`` unless None); its error or exit raises."""
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            msg = f"writing shards failed: the shard writer process exited with code {self._proc.wait()}"
            raise ShardWriterDied(msg) from None
        if message[0] == "error":
            msg = f"writing shards failed: {message[1]}"
            raise OmicsIOError(msg)
        if expected is not None and message[0] != expected:
            msg = f"internal error: the shard writer replied {message[0]!r}, expected {expected!r}"
            raise OmicsIOError(msg)
        return message[1]

    def _slot_for(self, nbytes: int) -> _Slot:
        if not self._free and len(self._slots) < self._depth:
            self._slots.append(None)
            self._free.append(len(self._slots) - 1)
        if not self._free:
            self._free.append(self._receive("done"))
        k = self._free.pop()
        futures.wait(self._readers.pop(k, ()))  # their errors are theirs to raise, not ours
        slot = self._slots[k]
        if slot is None or slot.size < nbytes:
            if slot is not None:
                slot.close()
            slot = self._slots[k] = _Slot(k, max(nbytes + nbytes // 4, mmap.PAGESIZE))
            self._send("slot", k, slot.size)
            send_handle(self._conn, slot.fd, self._proc.pid)
        return slot

    def buffer(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of a free slot, to encode the next batch into: `write` then hands the slot to the
        child without a copy (a write of any other buffer copies it into a slot)."""
        self._give_back_taken()
        self._taken = self._slot_for(nbytes)
        return self._taken.array[:nbytes]

    def _give_back_taken(self) -> None:
        if self._taken is not None:  # a buffer never written (its batch failed, or it was empty)
            self._free.append(self._taken.index)
            self._taken = None

    def write(self, buf: np.ndarray, starts: np.ndarray, *, readers: Iterable[Future] = ()) -> None:
        """Hand the records ``buf[starts[i]:starts[i+1]]`` to the writer process. ``readers``: futures
        still reading ``buf`` (the statistics); its slot takes no other batch until they are done."""
        taken = self._taken
        if len(starts) < 2:
            self._give_back_taken()
            return
        if taken is not None and buf.ctypes.data == taken.array.ctypes.data:
            slot, self._taken = taken, None
        else:
            self._give_back_taken()
            slot = self._slot_for(buf.nbytes)
            slot.array[: buf.nbytes] = buf.view(np.uint8).reshape(-1)
        self._readers[slot.index] = tuple(readers)
        self._send("write", slot.index, np.ascontiguousarray(starts, dtype=np.int64).tobytes())

    def finish(self) -> list[ShardEntry]:
        """Close the shards written since `open`; the child waits for the next `open`."""
        self._give_back_taken()
        while len(self._free) < len(self._slots):
            self._free.append(self._receive("done"))
        self._send("close")
        return [ShardEntry(*shard) for shard in self._receive("closed")]

    def close(self) -> list[ShardEntry]:
        shards = self.finish()
        self._shutdown()
        return shards

    def abort(self) -> None:
        """Stop the child: it closes its open shard, if any (the directory is removed by the caller);
        after `finish` nothing is open and this simply ends the kept child."""
        self._shutdown()

    def _shutdown(self) -> None:
        if self._conn.closed:
            return
        self._conn.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        for slot in self._slots:
            if slot is not None:
                slot.close()
        self._slots.clear()


def make_shard_writer(
    root: Path, *, shard_cells: int, options: str, first_shard: int = 0, index_dir: str | None = None
) -> ShardWriter | ShardWriterProcess:
    """The child-process writer where shared memory is available (Linux), else the in-process one.
    Shards are numbered from ``first_shard``; ``index_dir`` receives their chunk indexes."""
    kwargs = dict(shard_cells=shard_cells, options=options, first_shard=first_shard, index_dir=index_dir)
    if ShardWriterProcess.available():
        return ShardWriterProcess(root, **kwargs)
    return ShardWriter(root, **kwargs)


def check_output_dir(out: Path, *, overwrite: bool, manifest: str = MANIFEST_NAME) -> None:
    """Refuse an output that is not free: a dataset (``manifest`` present) without ``overwrite``,
    and at once, ``overwrite`` or not, a file or a non-empty folder that is not a dataset. An
    absent output or an empty folder is free."""
    if not out.exists():
        return
    if not out.is_dir():
        msg = f"refusing to overwrite {str(out)!r}: it is a file, not a dataset directory; give another output path"
        raise OmicsIOError(msg)
    if (out / manifest).exists():
        if not overwrite:
            msg = f"output {str(out)!r} already exists; pass --overwrite (overwrite=True) to replace it"
            raise OmicsIOError(msg)
    elif any(out.iterdir()):
        msg = (
            f"refusing to write into {str(out)!r}: it is not empty and has no {manifest} (it is not a "
            "dataset); give another output path, or an empty directory"
        )
        raise OmicsIOError(msg)


class InterruptedAfterWriting(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) after the output was complete and in place, while the dataset it replaced was
    being removed; the message says where its remains are."""


def _remove_stale_partials(out: Path, manifest: str = MANIFEST_NAME) -> None:
    """Remove the partial directories of ``out`` that runs killed outright (SIGKILL) left behind, and the
    remains of datasets it replaced that a run was stopped while removing (only once ``out`` holds
    the dataset that replaced them): those whose process no longer runs on this host. A running
    process's may be a run in progress."""
    # as `atomic_output_dir` names them
    stale = re.compile(rf"\.{re.escape(out.name)}\.(partial|old)-(?P<pid>\d+)-[0-9a-f]{{8}}")
    replaced = (out / manifest).exists()
    for folder, match in _left_by_gone_processes(out.parent, stale):
        if match[1] == "old" and not replaced:  # a swap cut short: the only copy of that dataset
            continue
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            print(
                f"materialize: removed {str(folder)!r}, left by an earlier run into {str(out)!r} "
                f"(process {match['pid']}, no longer running)",
                file=sys.stderr,
            )


def scratch_folder(kind: str) -> tempfile.TemporaryDirectory:
    """A temporary folder ``omicsio-<kind>-<pid>-…`` (removed when closed), once those of its kind that
    processes no longer running on this host left (a run killed outright leaves its own: an
    ``s3://`` run's finalize folder holds up to its dataset's sidecars) are removed."""
    named = re.compile(rf"omicsio-{re.escape(kind)}-(?P<pid>\d+)-.+")
    for folder, _ in _left_by_gone_processes(Path(tempfile.gettempdir()), named):
        shutil.rmtree(folder, ignore_errors=True)
    return tempfile.TemporaryDirectory(prefix=f"omicsio-{kind}-{os.getpid()}-")


def _left_by_gone_processes(parent: Path, named: re.Pattern) -> Iterator[tuple[Path, re.Match]]:
    """The folders in ``parent`` (not links) whose names ``named`` matches, with the match, whose
    process (group ``pid``) no longer runs on this host."""
    for folder in parent.iterdir() if parent.is_dir() else ():
        match = named.fullmatch(folder.name)
        if match and not folder.is_symlink() and folder.is_dir() and not process_running(int(match["pid"])):
            yield folder, match


def process_running(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, OSError):  # a number no process can have
        return False
    return True


@contextlib.contextmanager
def atomic_output_dir(out: Path, *, overwrite: bool, manifest: str = MANIFEST_NAME) -> Iterator[Path]:
    """Yield a hidden temporary sibling of ``out``; on success it replaces ``out`` by rename.

    ``out`` may be absent, an empty folder, or with ``overwrite`` a dataset (`check_output_dir`).
    On any exception (Ctrl-C included) the temporary directory is removed and an existing
    ``out`` is left untouched. A hard kill can leave only a hidden ``.<name>.partial-<pid>-<hex>``
    sibling (without a manifest, which `open_dataset` refuses; or, once swapped, the dataset it
    replaced), which the next run into ``out`` removes once its process has ended. A dataset that
    ``out`` held swaps places with the new one in one step (`exchange_paths`; where the file system
    cannot, it is renamed aside as ``.<name>.old-<pid>-<hex>`` first), then is removed: a Ctrl-C
    while it is removed is `InterruptedAfterWriting` (the new output is complete), and the next run
    into ``out`` removes what is left of it.
    """
    out = Path(out)
    check_output_dir(out, overwrite=overwrite, manifest=manifest)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _output_lock(out):
        yield from _atomic_output_dir(out, overwrite=overwrite, manifest=manifest)


@contextlib.contextmanager
def _output_lock(out: Path) -> Iterator[None]:
    """Hold ``.<name>.lock`` beside ``out`` (``flock``) while a run writes it: a second run into the
    same output at once is refused in one line, where both would write and the one that renamed last
    would win, each saying it had materialized its dataset there. The lock file goes when the run
    ends (removed while held, and taken again if another run removed it meanwhile). On a file system
    without ``flock`` (some network ones) runs are not kept apart."""
    lock = out.parent / f".{out.name}.lock"
    fd = _take_lock(lock, out)
    try:
        yield
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(lock)
            os.close(fd)


def _take_lock(lock: Path, out: Path) -> int | None:
    """A descriptor of ``lock`` under an exclusive ``flock``, or None where the file system has no
    ``flock``; `OmicsIOError` while another run holds it. A lock file its holder removed as this
    run took it is taken again, anew."""
    import fcntl

    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            msg = (
                f"another materialize run is writing {str(out)!r} (it holds {lock.name}); wait for it to end, "
                "or give another output"
            )
            raise OmicsIOError(msg) from None
        except OSError:  # no flock here: no lock
            os.close(fd)
            return None
        try:
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _atomic_output_dir(out: Path, *, overwrite: bool, manifest: str) -> Iterator[Path]:
    _remove_stale_partials(out, manifest)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    replaced = None  # the dataset ``out`` held, moved aside once the new one is complete
    try:
        yield tmp
        for name in os.listdir(tmp):
            if os.path.isfile(tmp / name):
                fsync_path(tmp / name)
        if not (tmp / manifest).exists():
            msg = f"internal error: the output was finished without {manifest}"
            raise OmicsIOError(msg)
        check_output_dir(out, overwrite=overwrite, manifest=manifest)  # as it is now, after the run
        if (out / manifest).exists():
            if exchange_paths(tmp, out):  # in one step: a reader opening ``out`` finds the old
                replaced = tmp  # dataset or the new one, never none
            else:  # no such swap here: ``out`` is missing between the renames
                replaced = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
                out.rename(replaced)
                tmp.rename(out)
        else:  # absent or an empty folder: one rename, which refuses a folder written into since the check
            try:
                tmp.rename(out)
            except OSError as e:
                msg = f"cannot move the finished output into {str(out)!r}: {e.strerror or e}; give another output path"
                raise OmicsIOError(msg) from e
        fsync_path(out.parent)
    except BaseException:
        if replaced is not None and replaced.exists() and not out.exists():  # stopped between the renames
            replaced.rename(out)  # the old dataset back in its place
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if replaced is not None:  # the new output is in place: an interruption now is no failure of it
        try:
            shutil.rmtree(replaced)
        except KeyboardInterrupt as e:
            msg = (
                f"{out} is written; what is left of the dataset it replaced, in {replaced}, is removed by the "
                f"next run into {out}"
            )
            raise InterruptedAfterWriting(msg) from e

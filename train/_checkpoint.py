"""Checkpoints in the dependency-free Equinox format: one directory per step, published atomically.

    ckpt/step-000200/state.eqx    model + optimizer state (`equinox.tree_serialise_leaves`)
    ckpt/step-000200/meta.json    step, PRNG key data, seed, loader state, config, dataset fingerprint

A checkpoint is written into a hidden sibling (``.step-000200.tmp-<pid>``), fsynced, and renamed
into place, so a kill leaves at most a hidden partial directory (or, saving a step again, the
step's first copy hidden, which the next run puts back: `remove_partials`); the latest checkpoint
is found by scanning the step directories; the last ``keep`` are kept. `EquinoxCheckpoints` is this
format behind the interface `fit` uses (`train._orbax.OrbaxCheckpoints` is the other).

The run writing a directory holds an exclusive ``flock`` on its ``.writer.lock`` (`lock_writer`),
which names the run, for as long as it writes there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import equinox as eqx

from ._errors import CheckpointMismatchError, TrainError

STATE_FILE = "state.eqx"
META_FILE = "meta.json"
LOCK_FILE = ".writer.lock"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"step-(\d+)")
_OLD_COPY = re.compile(r"\.(step-\d+)\.old-\d+")  # a step's first copy, moved aside to save it again


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A published checkpoint: its directory, step and metadata."""

    path: Path
    step: int
    meta: dict

    def load(self, like: Any) -> Any:
        """The saved pytree, shaped like ``like`` (same structure, shapes and dtypes)."""
        return eqx.tree_deserialise_leaves(self.path / STATE_FILE, like)

    def restore_loader(self, loader) -> None:
        """Set ``loader`` to the state saved with this checkpoint."""
        loader.set_state(self.meta["loader_state"])


class EquinoxCheckpoints:
    """The checkpoints of one run in ``directory`` (see the module docstring). The run that writes
    them (``writing``) locks the directory (`lock_writer`) until `close`, then deletes the partials
    a killed run left; a reader (``embed``, ``finetune --init``) does neither, as a hidden folder may
    be the save of a run still training there."""

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 3, writing: bool = True):
        self.directory, self.keep = Path(directory), keep
        self._lock = lock_writer(self.directory) if writing else None
        if writing:
            try:
                remove_partials(self.directory)
            except BaseException:  # (Ctrl-C while a killed run's partials are deleted) the lock goes too
                self.close()
                raise

    def latest(self) -> Checkpoint | None:
        return latest_checkpoint(self.directory)

    def save(self, step: int, tree: Any, meta: dict, loader) -> Path:
        """Write ``tree`` with ``meta`` and the loader's state as the checkpoint of ``step``."""
        return save_checkpoint(
            self.directory, step, tree, {**meta, "loader_state": loader.get_state()}, keep=self.keep
        )

    def close(self) -> None:
        """Release the directory to another writer (nothing is written in the background here)."""
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None


def checkpoint_path(directory: str | os.PathLike[str], step: int) -> Path:
    return Path(directory) / f"step-{step:06d}"


def list_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Published checkpoints ``(step, path)`` in ``directory``, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _STEP_DIR.fullmatch(entry.name)
        if m and _complete(entry):
            found.append((int(m.group(1)), entry))
    return sorted(found)


def _complete(path: Path) -> bool:
    return (path / META_FILE).is_file() and (path / STATE_FILE).is_file()


def latest_checkpoint(directory: str | os.PathLike[str]) -> Checkpoint | None:
    """The checkpoint with the highest step, or None."""
    found = list_checkpoints(directory)
    if not found:
        return None
    step, path = found[-1]
    return Checkpoint(path, step, json.loads((path / META_FILE).read_text()))


def _sync(*paths: Path) -> None:
    """Flush files' and directories' (their entries') data and metadata to disk, in order."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_checkpoint(
    directory: str | os.PathLike[str], step: int, tree: Any, meta: dict, *, keep: int = 3
) -> Path:
    """Write ``tree`` and ``meta`` as the checkpoint of ``step``, atomically; keep the last ``keep``."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(root, step)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    eqx.tree_serialise_leaves(tmp / STATE_FILE, tree)
    meta = {"format_version": FORMAT_VERSION, "step": step, **meta}
    (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
    _sync(tmp / STATE_FILE, tmp / META_FILE, tmp)
    if final.exists():  # the same step saved again: a kill between the renames leaves the first
        # copy hidden, put back as the step by the next run's `remove_partials`
        old = root / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _sync(root)
    for _, path in list_checkpoints(root)[: -max(keep, 1)]:
        shutil.rmtree(path, ignore_errors=True)
    return final


def remove_partials(directory: str | os.PathLike[str]) -> None:
    """Delete the hidden folders killed runs left: partial saves, and the first copy of a step saved
    again (`save_checkpoint`). A run killed between that save's two renames left the first copy as
    the step's only one (with ``keep=1`` the run's only checkpoint): where the step is missing, that
    copy is put back as the step before anything is deleted. Only the writer, holding the directory's
    lock (`lock_writer`), calls this: a running writer's hidden folders are its saves in progress."""
    root = Path(directory)
    if not root.is_dir():
        return
    restored = False
    for entry in sorted(root.iterdir()):
        m = _OLD_COPY.fullmatch(entry.name)
        if m and not (root / m.group(1)).exists() and _complete(entry):
            os.replace(entry, root / m.group(1))
            restored = True
    if restored:
        _sync(root)
    for entry in root.iterdir():
        if entry.is_dir() and entry.name.startswith(".step-"):
            shutil.rmtree(entry, ignore_errors=True)


def lock_writer(directory: str | os.PathLike[str]) -> int | None:
    """Take the exclusive ``flock`` on ``directory``'s `LOCK_FILE` for the run about to write
    checkpoints there, and write its pid and host into it; return the file's descriptor (closing it
    releases the lock), or None where the file system has no ``flock`` (some network ones).

    Two writers (a requeued job started while the old one still runs) would each delete the other's
    save in progress as a killed run's partial and both write steps: the second is refused, naming
    the first. The kernel releases a killed run's lock, so that never blocks the next run."""
    import fcntl
    import socket

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 1024).decode(errors="replace").strip() or "its pid not written yet"
        os.close(fd)
        msg = (
            f"{root} is the checkpoint directory of a run still writing there ({holder}): stop that run "
            "first, or pass another --checkpoint-dir"
        )
        raise TrainError(msg) from None
    except OSError:  # no flock on this file system: no guard
        os.close(fd)
        return None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}".encode())
    except BaseException:  # (a full disk, Ctrl-C) not left locked by a descriptor no one can close
        os.close(fd)
        raise
    return fd


def check_compatible(checkpoint: Checkpoint, now: dict) -> None:
    """Refuse to resume ``checkpoint`` if its recorded identity differs from ``now``'s: raises
    `CheckpointMismatchError` listing, one line per key, the value in the checkpoint and now."""
    saved = checkpoint.meta.get("identity", {})
    diffs = [
        f"  {k}: in checkpoint {saved.get(k)!r}, now {now.get(k)!r}"
        for k in sorted(set(saved) | set(now))
        if saved.get(k) != now.get(k)
    ]
    if diffs:
        msg = (
            f"cannot resume from {checkpoint.path}: it was written by another run (use the same dataset "
            "and options, or a fresh --checkpoint-dir):\n" + "\n".join(diffs)
        )
        raise CheckpointMismatchError(msg)

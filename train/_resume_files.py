"""The input files a resumed run must share with its checkpoint — ``--vocab``, ``--medians``,
``--eval-rows`` — compared by what they hold, not by where they lie.

A run records ``<option>_sha256`` in its checkpoint's identity for each: the sha256 of the file's
bytes (`file_sha256`), and for ``--eval-rows`` of the held-out rows it parsed (`rows_sha256`), as
a file re-saved with another dtype or order holds out the same cells. The path decides nothing:
the same file by a relative or absolute path, through a symlink, or copied beside a run moved to
another folder resumes; a file changed in place, which would tokenize or hold out differently, is
refused in one line naming it (`check_files`). A pretraining checkpoint read by ``embed`` or
``finetune --init`` reads its run's files again from their paths: one changed since is refused too
(`check_read_again`).

Checkpoints written before these digests recorded the path instead (``<option>``): they are
compared by path, as they were written, since the content they read is not known.
"""

from __future__ import annotations

import hashlib

import numpy as np

from ._errors import CheckpointMismatchError, TrainError

# each file option, and what a changed one does to the run (the refusal says it)
FILE_OPTIONS = {
    "vocab": "is not the file its run read",
    "medians": "is not the file its run read",
    "eval_rows": "holds other rows than its run held out",
}
_SHOWN = 16  # hex digits of a digest an error shows


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def file_sha256(name: str, path: str | None) -> str | None:
    """The sha256 (hex) of the bytes of ``path``, the file of option ``name`` (None: not given); an
    unreadable one is a one-line `TrainError` naming the option."""
    if path is None:
        return None
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError as e:
        msg = f"cannot read {_flag(name)} {path}: {e.strerror or e}"
        raise TrainError(msg) from e
    return digest.hexdigest()


def rows_sha256(rows: np.ndarray | None) -> str | None:
    """The sha256 (hex) of held-out ``rows`` (sorted, unique) as int64; None without them."""
    return None if rows is None else hashlib.sha256(np.asarray(rows, np.int64).tobytes()).hexdigest()


def with_file_digests(identity: dict, digests: dict[str, str | None]) -> dict:
    """``identity`` with each file option of ``digests`` recorded as ``<option>_sha256``, its path left out."""
    paths_left_out = {k: v for k, v in identity.items() if k not in digests}
    return {**paths_left_out, **{f"{name}_sha256": digest for name, digest in digests.items()}}


def check_files(checkpoint, identity: dict, config) -> dict:
    """Refuse, in one line, to resume ``checkpoint`` where a file option of ``config`` holds other
    content than the file its run read; return the identity the rest is compared with
    (`train._checkpoint.check_compatible`): ``identity`` itself, or for a checkpoint that recorded a
    file by its path only, ``identity`` with that option's path in place of its digest."""
    saved = checkpoint.meta.get("identity", {})
    read = checkpoint.meta.get("config", {})
    compared = dict(identity)
    for name, changed in FILE_OPTIONS.items():
        key = f"{name}_sha256"
        if key not in identity:
            continue
        if key not in saved and name in saved:  # written before the digests: compared by path
            del compared[key]
            compared[name] = getattr(config, name)
            continue
        then, now = saved.get(key), identity[key]
        if then == now:
            continue
        flag, given, old = _flag(name), getattr(config, name), read.get(name)
        what = "sha256 of the rows" if name == "eval_rows" else "sha256"
        if then is None:
            why = f"its run had no {flag}, now {flag} {given}; drop {flag}"
        elif now is None:
            why = f"its run had {flag} {old} ({what} {then[:_SHOWN]}), now none; give that file again"
        else:
            why = (
                f"{flag} {given} {changed} ({old}): {what} {then[:_SHOWN]} in checkpoint, "
                f"{now[:_SHOWN]} now; give {'the same rows' if name == 'eval_rows' else 'that file'}"
            )
        msg = f"cannot resume from {checkpoint.path}: {why}, or a fresh --checkpoint-dir"
        raise CheckpointMismatchError(msg)
    return compared


def check_read_again(meta: dict, config, source: str) -> None:
    """Refuse, in one line, to tokenize with a pretraining checkpoint's ``--vocab`` or ``--medians``
    (``config``'s, read again from where its run read them: ``embed --checkpoint-dir``,
    ``finetune --init DIR``) once the file holds other content than its run read (the digests of
    ``meta``'s identity): the checkpoint's embeddings are those of the tokens that file made. A
    checkpoint that recorded the path only is not checked."""
    saved = meta.get("identity", {})
    for name in ("vocab", "medians"):
        then, path = saved.get(f"{name}_sha256"), getattr(config, name)
        if then is None or path is None:
            continue
        now = file_sha256(name, path)
        if now != then:
            msg = (
                f"{source}: its run's {_flag(name)} {path} has changed since it was read (sha256 "
                f"{then[:_SHOWN]} then, {now[:_SHOWN]} now), and the checkpoint's token embeddings are "
                "those of the file it read: put that file back"
            )
            raise TrainError(msg)

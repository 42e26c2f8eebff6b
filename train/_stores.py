"""A run's checkpoint store: which one a configuration opens (`open_checkpoints`: the Equinox or the
Orbax format, refusing a folder of the other), and the checkpoint it resumes (`restorable`), or the
one-line refusal of a fresh run over another run's checkpoints (`check_resumed`)."""

from __future__ import annotations

from pathlib import Path

import jax

from . import _checkpoint as ckpt
from ._config import TrainConfig
from ._errors import TrainError
from ._resume_files import check_files


def open_checkpoints(config: TrainConfig, *, writing: bool = True):
    """The run's checkpoint store (`EquinoxCheckpoints` or `OrbaxCheckpoints`), or None without a
    directory; ``writing``: a run that saves to it (from one process only, in the Equinox format),
    which holds the directory's writer lock (and, in the Equinox format, deletes the partial saves a
    killed run left there); a reader (``embed``, ``finetune --init``) takes no lock."""
    if config.checkpoint_dir is None:
        return None
    other = _other_format(Path(config.checkpoint_dir), config.checkpoint_format)
    if other is not None:  # read as empty, the run would start over and write its steps beside them
        msg = (
            f"{config.checkpoint_dir} holds {other} checkpoints, and this run writes "
            f"{config.checkpoint_format}: pass --checkpoint-format {other} to resume them, or choose "
            "another --checkpoint-dir"
        )
        raise TrainError(msg)
    if writing and config.checkpoint_format == "equinox" and jax.process_count() > 1:
        msg = (
            f"checkpoint_format 'equinox' writes one folder from every process, {jax.process_count()} JAX "
            "processes here: pass --checkpoint-format orbax (checkpoint_format='orbax'), which saves each "
            "process's loader state"
        )
        raise TrainError(msg)
    if config.checkpoint_format == "orbax":
        from ._orbax import OrbaxCheckpoints

        return OrbaxCheckpoints(config.checkpoint_dir, keep=config.keep, writing=writing)
    return ckpt.EquinoxCheckpoints(config.checkpoint_dir, keep=config.keep, writing=writing)


def _other_format(root: Path, fmt: str) -> str | None:
    """The other checkpoint format whose steps ``root`` holds (Equinox's ``step-*`` folders, Orbax's
    numbered ones), if it holds no step of ``fmt``'s: else None."""
    if not root.is_dir():
        return None
    steps = [p.name for p in root.iterdir() if p.is_dir()]
    equinox = any(name.startswith("step-") for name in steps)
    orbax = any(name.isdigit() for name in steps)
    if fmt == "orbax" and equinox and not orbax:
        return "equinox"
    if fmt != "orbax" and orbax and not equinox:
        return "orbax"
    return None


def check_resumed(config: TrainConfig, latest) -> None:
    """A one-line error where the checkpoint directory holds checkpoints (``latest``, else None) and
    ``config`` does not resume them: a fresh run there would write its steps beside another run's."""
    if latest is not None and not config.resume:
        msg = (
            f"{config.checkpoint_dir} already holds checkpoints (latest: {latest.path.name}); pass --resume "
            "to continue that run, or choose an empty --checkpoint-dir"
        )
        raise TrainError(msg)


def restorable(config: TrainConfig, store, identity: dict):
    """The checkpoint to resume (checked against ``identity``, its input files by content:
    `train._resume_files.check_files`), or None for a fresh run."""
    latest = None if store is None else store.latest()
    check_resumed(config, latest)
    if latest is not None:
        ckpt.check_compatible(latest, check_files(latest, identity, config))
    return latest

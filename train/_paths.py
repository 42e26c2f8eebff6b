"""The path options of the training commands, checked before a run starts: a file where a directory
goes (or the reverse) is a one-line `TrainError` naming the option, not an ``OSError`` mid-run."""

from __future__ import annotations

import tempfile
from pathlib import Path

from ._errors import TrainError

# every path option of omicsio-train and its subcommands (a config's or parsed arguments' attribute)
# that names a local directory or file; ``--init`` and the dataset may be hf:DIR / URLs and are not here
_DIRECTORIES = ("checkpoint_dir",)
_FILES = ("metrics", "out", "out_metrics", "eval_rows", "vocab", "medians")
_OUTPUTS = ("checkpoint_dir", "metrics", "out", "out_metrics")  # written: a file is made there first


def check_paths(options: object) -> None:
    """Raise `TrainError` for the first path option of ``options`` that cannot be what it names:
    a directory option that is a file or lies under one, a file option that is a directory or lies
    under a file. Missing paths pass (outputs are created; inputs say so when read)."""
    for name in (*_DIRECTORIES, *_FILES):
        value = getattr(options, name, None)
        if value is None:
            continue
        option, path = f"--{name.replace('_', '-')}", Path(value)
        if name in _FILES and path.is_dir():
            msg = f"{option} {value} is a directory, not a file; give a file path"
            raise TrainError(msg)
        start = path if name in _DIRECTORIES else path.parent
        blocking = next((p for p in (start, *start.parents) if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            msg = f"{option} {value}: {blocking} is a file, not a directory; remove it or give another path"
            raise TrainError(msg)
        if name in _OUTPUTS:
            _check_writable(option, value, next(p for p in (start, *start.parents) if p.exists()))


def _check_writable(option: str, value: object, folder: Path) -> None:
    """A one-line `TrainError` unless a file can be made in ``folder`` (the output's nearest existing
    folder), tried with one: a read-only or special file system would otherwise fail the run at its
    first write, after the work it was to keep (permissions alone do not tell, e.g. for root)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        msg = f"{option} {value}: cannot write in {folder} ({e.strerror or e}); give another path"
        raise TrainError(msg) from None

"""The data and delete files of a resolved DuckLake table (`_ducklake_table.LakeTable`) as stored:
opened where they are (a local path, or an object on object storage), checked against what the
catalog recorded when they were committed, and a delete file's deleted positions read.

A file is checked before any of its rows is read: it is there, it has the size the catalog recorded
(``file_size_bytes``) and its parquet footer has the length the catalog recorded (``footer_size``),
so a file changed or cut short since its commit is refused by name rather than read as other rows.
`_ducklake_read` checks each file it reads this way, and keeps the positions of the delete files.
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from omicsio_jax import DataValidationError
from omicsio_jax.format import as_input_path, is_remote

from ._ducklake_table import DataFile, LakeTable

PARQUET_MAGIC = b"PAR1"


def open_file(path: str):
    return as_input_path(path).open() if is_remote(path) else path


def check_file(
    lake: LakeTable, path: str, size: int | None, footer: int | None, what: str, tail_bytes: int = 8
) -> bytes:
    """The file's last bytes: its footer too, with ``tail_bytes`` > 8 (one more read where it is longer)."""
    where = f"{what} {path} of {lake.describe()}"
    try:
        if is_remote(path):
            with as_input_path(path).open() as handle:
                actual = handle.size
                tail = _tail(handle, actual, tail_bytes)
        else:
            actual = os.path.getsize(path)
            with open(path, "rb") as handle:
                tail = _tail(handle, actual, tail_bytes)
    except (OSError, FileNotFoundError) as e:
        msg = f"{where} is missing ({e.__class__.__name__}); restore it, or materialize a snapshot that does not use it"
        raise DataValidationError(msg) from e
    except Exception as e:  # the object store's own errors
        if "not found" not in str(e).lower():
            raise
        msg = f"{where} is missing; restore it, or materialize a snapshot that does not use it"
        raise DataValidationError(msg) from e
    if size is not None and actual != size:
        msg = (
            f"{where} is {actual:,} bytes but the catalog recorded {size:,}: it changed since it was "
            "committed; restore the committed file, or materialize a snapshot that does not use it"
        )
        raise DataValidationError(msg)
    stored = int.from_bytes(tail[-8:-4], "little") if len(tail) >= 8 and tail[-4:] == PARQUET_MAGIC else None
    if footer is not None and stored != footer:
        msg = (
            f"{where} has a parquet footer of {stored} bytes but the catalog recorded {footer}: it changed "
            "since it was committed; restore the committed file, or materialize a snapshot that does not use it"
        )
        raise DataValidationError(msg)
    return tail


def read_deletes(lake: LakeTable, f: DataFile) -> np.ndarray:
    """The positions ``f``'s delete file lists, sorted, checked against the catalog's count."""
    try:
        pos = pq.read_table(open_file(f.delete.path), columns=["pos"]).column("pos").to_numpy()
    except (OSError, pa.ArrowException, KeyError) as e:
        msg = f"cannot read delete file {f.delete.path} of {lake.describe()}: {e}"
        raise DataValidationError(msg) from e
    pos = np.unique(pos.astype(np.int64))
    if len(pos) != f.delete.delete_count or (len(pos) and (pos[0] < 0 or pos[-1] >= f.record_count)):
        msg = (
            f"delete file {f.delete.path} of {lake.describe()} lists {len(pos):,} positions in "
            f"0..{f.record_count - 1:,} where the catalog counts {f.delete.delete_count:,}; restore the committed file"
        )
        raise DataValidationError(msg)
    return pos


def _tail(handle, size: int, count: int) -> bytes:
    """The last ``count`` bytes of a file (all of them if fewer), and its whole parquet footer."""
    handle.seek(max(size - count, 0))
    tail = handle.read(count)
    footer = int.from_bytes(tail[-8:-4], "little") + 8 if count > 8 and tail[-4:] == PARQUET_MAGIC else 0
    if len(tail) < footer <= size:
        handle.seek(size - footer)
        tail = handle.read(footer)
    return tail

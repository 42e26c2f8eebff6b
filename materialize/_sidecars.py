"""Streaming writers for everything beside the shards: obs sidecars and cell ids.

Each writer appends one batch at a time to a raw file, so memory stays constant in the number
of cells; `finish` turns the raw file into its final form (``.npy``, categories sorted).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from omicsio_jax import OmicsIOError
from omicsio_jax.format import sql_ident, to_numpy, to_numpy_filled

from ._source import CATEGORICAL, obs_kind

_CHUNK = 1 << 20


def _write_npy(dest: Path, raw: Path, raw_dtype, out_dtype, num_rows: int, convert=None) -> None:
    """Stream a raw file into an ``.npy`` file; ``convert(chunk, first_row)`` maps each chunk."""
    raw_dtype, out_dtype = np.dtype(raw_dtype), np.dtype(out_dtype)
    with open(raw, "rb") as src, open(dest, "wb") as dst:
        header = {
            "descr": np.lib.format.dtype_to_descr(out_dtype),
            "fortran_order": False,
            "shape": (num_rows,),
        }
        np.lib.format.write_array_header_1_0(dst, header)
        first_row = 0
        while chunk := src.read(_CHUNK * raw_dtype.itemsize):
            values = np.frombuffer(chunk, dtype=raw_dtype)
            if convert is not None:
                values = convert(values, first_row)
            dst.write(values.astype(out_dtype, copy=False).tobytes())
            first_row += len(values)
    raw.unlink()


def check_obs_name(name: str, label: str) -> None:
    """An obs column's name is its sidecar's file name (``obs/<name>.npy``, ``obs/<name>.codes.npy``,
    as the dataset reads it back): refuse a name that is no plain file name, so that nothing is
    ever written outside ``obs/`` (the finalizer checks every obs column of the input before it
    makes their writers; the other writers' names are fixed, or ``has_<modality>`` of a checked
    modality name)."""
    bad = next((c for c in ("/", "\\", "\0") if c in name), None)
    too_long = len(f"{name}.categories.json".encode()) > 255
    if bad is None and not too_long:
        return
    why = f"it holds {bad!r}" if bad is not None else "it is too long"
    new = sql_ident(re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_")[:64] or "obs")
    old = sql_ident(name)
    msg = (
        f"obs column {name!r} of {label} cannot be stored: its name is the sidecar's file name "
        f"(obs/<name>.npy) and {why}; rename it (a table: --query 'SELECT * EXCLUDE ({old}), "
        f"{old} AS {new} FROM cells') or leave it out (--obs with the columns to keep)"
    )
    raise OmicsIOError(msg)


class CategoricalWriter:
    """Strings, dictionaries or bools → int32 codes (-1 = missing) + sorted categories."""

    kind = CATEGORICAL

    def __init__(self, directory: Path, name: str):
        self.name, self.directory = name, directory
        self._raw = directory / f"{name}.codes.raw"
        self._file = open(self._raw, "wb")  # noqa: SIM115 - closed in finish()
        self._codes: dict[str, int] = {}
        self.num_rows = 0

    def append(self, array: pa.Array | pa.ChunkedArray) -> None:
        if pa.types.is_boolean(array.type):
            array = pc.cast(array, pa.string())
        if not pa.types.is_dictionary(array.type):
            array = pc.dictionary_encode(array)
        if isinstance(array, pa.ChunkedArray):
            for chunk in array.chunks:
                self.append(chunk)
            return
        labels = [str(v) for v in array.dictionary.to_pylist()]
        lookup = np.array(
            [self._codes.setdefault(v, len(self._codes)) for v in labels] + [-1], dtype=np.int32
        )
        indices = to_numpy_filled(array.indices, len(labels))
        self._file.write(lookup[indices].tobytes())
        self.num_rows += len(array)

    def close(self) -> None:
        """Release the raw file (idempotent; `finish` calls it too)."""
        self._file.close()

    def finish(self) -> str:
        self.close()
        categories = sorted(self._codes)
        remap = np.empty(len(categories) + 1, dtype=np.int32)
        for rank, label in enumerate(categories):
            remap[self._codes[label]] = rank
        remap[-1] = -1
        dest = self.directory / f"{self.name}.codes.npy"
        _write_npy(dest, self._raw, np.int32, np.int32, self.num_rows, lambda codes, _: remap[codes])
        (self.directory / f"{self.name}.categories.json").write_text(json.dumps(categories) + "\n")
        return "int32"

    @property
    def num_categories(self) -> int:
        return len(self._codes)

    def files(self) -> list[str]:
        return [f"obs/{self.name}.codes.npy", f"obs/{self.name}.categories.json"]


class NumericWriter:
    """Integers or floats → one ``.npy``: integers as int64, or uint64 for a uint64 column (its values
    need not fit int64: hashed ids); integer columns with missing values become float64 with NaN."""

    kind = "numeric"
    num_categories = None

    def __init__(self, directory: Path, name: str, dtype: pa.DataType):
        self.name, self.directory = name, directory
        self._is_int = pa.types.is_integer(dtype)
        integers = np.uint64 if pa.types.is_uint64(dtype) else np.int64
        self._dtype = np.dtype(integers if self._is_int else dtype.to_pandas_dtype())
        self._raw = directory / f"{name}.raw"
        self._file = open(self._raw, "wb")  # noqa: SIM115 - closed in finish()
        self._missing: list[np.ndarray] = []
        self.num_rows = 0

    def append(self, array: pa.Array | pa.ChunkedArray) -> None:
        if array.null_count:
            if self._is_int:
                self._missing.append(
                    self.num_rows + np.flatnonzero(pc.is_null(array).to_numpy(zero_copy_only=False))
                )
                array = pc.fill_null(array, 0)
            else:
                array = pc.fill_null(array, float("nan"))
        self._file.write(np.asarray(to_numpy(array), dtype=self._dtype).tobytes())
        self.num_rows += len(array)

    def close(self) -> None:
        """Release the raw file (idempotent; `finish` calls it too)."""
        self._file.close()

    def finish(self) -> str:
        self.close()
        dest = self.directory / f"{self.name}.npy"
        if not self._missing:
            _write_npy(dest, self._raw, self._dtype, self._dtype, self.num_rows)
            return str(self._dtype)
        missing = np.concatenate(self._missing)  # only the missing positions are held in memory

        def with_nan(values: np.ndarray, first_row: int) -> np.ndarray:
            out = values.astype(np.float64)
            here = missing[(missing >= first_row) & (missing < first_row + len(values))]
            out[here - first_row] = np.nan
            return out

        _write_npy(dest, self._raw, self._dtype, np.float64, self.num_rows, with_nan)
        return "float64"

    def files(self) -> list[str]:
        return [f"obs/{self.name}.npy"]


def make_obs_writer(directory: Path, name: str, dtype: pa.DataType) -> CategoricalWriter | NumericWriter:
    """The writer for an obs column of Arrow type ``dtype`` (see `obs_kind`)."""
    if obs_kind(dtype) == CATEGORICAL:
        return CategoricalWriter(directory, name)
    return NumericWriter(directory, name, dtype)


class CellIdWriter:
    """Cell ids in row order, streamed into ``cell_ids.parquet``."""

    path = "cell_ids.parquet"

    def __init__(self, root: Path):
        schema = pa.schema([("cell_id", pa.string())])
        self._writer = pq.ParquetWriter(root / self.path, schema, compression="zstd", use_dictionary=False)

    def append(self, cell_ids: pa.Array) -> None:
        self._writer.write_table(pa.table({"cell_id": cell_ids}))

    def finish(self) -> None:
        self._writer.close()

    close = finish

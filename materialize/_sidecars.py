"""Streaming writers for everything beside the shards: obs sidecars and cell ids.

Each writer appends one batch at a time to a raw file, so memory stays constant in the number
of cells; `finish` turns the raw file into its final form (``.npy``, categories sorted). Which
input columns become obs sidecars, and as what, is `carried_obs` / `make_obs_writer`:

- text, dictionaries and bools: categorical (int32 codes + sorted categories; a bool column has
  both of ``false`` and ``true``, so its codes are 0 / 1);
- integers and floats: numeric (`NumericWriter`); decimals as float64 (the nearest double);
- timestamps and dates: ``datetime64`` in the input's unit (a timezone-aware timestamp as UTC,
  dates as ``datetime64[D]``), times of day (since midnight) and durations as ``timedelta64``;
  NaT where missing;
- anything else (bytes, lists, structs, intervals) is left out, with a note on stderr naming it.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from omicsio_jax import DataValidationError, OmicsIOError
from omicsio_jax.format import BOOL_CATEGORIES, sql_ident, to_numpy, to_numpy_filled

from ._source import CATEGORICAL, NUMERIC, obs_kind
from ._validate import UniqueStrings

_CHUNK = 1 << 20
DATETIME = "datetime"  # the obs kinds of the sidecars of dates and timestamps (datetime64) ...
TIMEDELTA = "timedelta"  # ... and of times of day and durations (timedelta64)
_NAT = np.iinfo(np.int64).min  # datetime64 / timedelta64's "not a time"


def temporal_dtype(dtype: pa.DataType) -> np.dtype | None:
    """The NumPy type of the sidecar of a column of Arrow type ``dtype`` holding dates or times (None
    for any other): a timestamp's ``datetime64`` in its unit (one with a timezone as UTC, the instant
    Arrow stores), ``datetime64[D]`` for date32 and ``[ms]`` for date64; a time of day's or a
    duration's ``timedelta64`` in its unit (a time of day: since midnight)."""
    if pa.types.is_timestamp(dtype):
        return np.dtype(f"datetime64[{dtype.unit}]")
    if pa.types.is_date32(dtype):
        return np.dtype("datetime64[D]")
    if pa.types.is_date64(dtype):
        return np.dtype("datetime64[ms]")
    if pa.types.is_time(dtype) or pa.types.is_duration(dtype):
        return np.dtype(f"timedelta64[{dtype.unit}]")
    return None


def _left_out_because(dtype: pa.DataType | None) -> str | None:
    """Why no obs sidecar holds a column of Arrow type ``dtype`` (None: one does; ``dtype`` None: a
    column its reader does not decode)."""
    if dtype is None:
        return "its reader does not decode it as one value per cell"
    if obs_kind(dtype) is not None or temporal_dtype(dtype) is not None or pa.types.is_decimal(dtype):
        return None
    if pa.types.is_null(dtype):
        return "it holds only nulls"
    if pa.types.is_nested(dtype):
        return f"its values ({dtype}) are not one value per cell"
    return (
        f"no obs sidecar holds its type {dtype} (numbers, decimals, bools, text, dates, times and "
        "durations do); convert it to one of those in the input to keep it"
    )


def obs_carried(dtype: pa.DataType) -> bool:
    """Whether an obs sidecar holds a column of Arrow type ``dtype``."""
    return _left_out_because(dtype) is None


def carried_obs(columns: Mapping[str, pa.DataType | None], label: str) -> dict[str, pa.DataType]:
    """The columns of ``columns`` (name → Arrow type, None where the reader cannot decode one) that
    become obs sidecars, with their type; each other one is left out with a note on stderr naming it
    and why (asked for by name with ``obs=``, it is refused as not found)."""
    kept = {}
    for name, dtype in columns.items():
        why = _left_out_because(dtype)
        if why is None:
            kept[name] = dtype
        else:
            print(f"materialize: obs column {name!r} of {label} left out: {why}", file=sys.stderr)
    return kept


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
        self._bools = False  # a bool column was appended (`finish` gives it both categories)
        self.num_rows = 0

    def append(self, array: pa.Array | pa.ChunkedArray) -> None:
        if pa.types.is_boolean(array.type):
            self._bools = True
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
        # bools (a bool column, or a categorical's labels of them: pandas' of True alone) get both
        # categories whatever the cells hold, so that a code means the same in every dataset: 0 False,
        # 1 True (sorted), -1 missing. With only the values seen, an all-True column's True was code 0.
        if self._bools or (self._codes and set(self._codes) <= set(BOOL_CATEGORIES)):
            for label in BOOL_CATEGORIES:
                self._codes.setdefault(label, len(self._codes))
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


class _RawColumn:
    """A column's values appended to a raw file ``<name>.raw``, one batch at a time; `finish` (each
    writer's) turns it into ``obs/<name>.npy``."""

    num_categories = None

    def __init__(self, directory: Path, name: str):
        self.name, self.directory = name, directory
        self._raw = directory / f"{name}.raw"
        self._file = open(self._raw, "wb")  # noqa: SIM115 - closed in finish()
        self.num_rows = 0

    def close(self) -> None:
        """Release the raw file (idempotent; `finish` calls it too)."""
        self._file.close()

    def files(self) -> list[str]:
        return [f"obs/{self.name}.npy"]


class NumericWriter(_RawColumn):
    """Integers, floats or decimals → one ``.npy``: integers as int64, or uint64 for a uint64 column
    (its values need not fit int64: hashed ids); integer columns with missing values become float64
    with NaN; decimals float64 (each the nearest double)."""

    kind = NUMERIC

    def __init__(self, directory: Path, name: str, dtype: pa.DataType):
        super().__init__(directory, name)
        self._is_int = pa.types.is_integer(dtype)
        self._cast = pa.float64() if pa.types.is_decimal(dtype) else None
        integers = np.uint64 if pa.types.is_uint64(dtype) else np.int64
        floats = np.float64 if self._cast is not None else dtype.to_pandas_dtype()
        self._dtype = np.dtype(integers if self._is_int else floats)
        self._missing: list[np.ndarray] = []

    def append(self, array: pa.Array | pa.ChunkedArray) -> None:
        if self._cast is not None:
            array = pc.cast(array, self._cast)
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


class TemporalWriter(_RawColumn):
    """Dates, timestamps, times of day or durations → one ``.npy`` of `temporal_dtype` (NaT where
    missing): ``datetime64`` (kind ``"datetime"``) or ``timedelta64`` (kind ``"timedelta"``)."""

    def __init__(self, directory: Path, name: str, dtype: pa.DataType):
        super().__init__(directory, name)
        self._type, self._dtype = dtype, temporal_dtype(dtype)
        self.kind = DATETIME if self._dtype.kind == "M" else TIMEDELTA

    def append(self, array: pa.Array | pa.ChunkedArray) -> None:
        if isinstance(array, pa.ChunkedArray):
            for chunk in array.chunks:
                self.append(chunk)
            return
        # a batch in another type than the column's: e.g. DuckDB's microseconds of a file's
        # milliseconds, or its integer counts of a duration
        if array.type != self._type:
            array = array.cast(self._type)
        stored = array.view(pa.int32() if array.type.bit_width == 32 else pa.int64())  # Arrow's integers
        values = to_numpy_filled(stored, 0).astype(np.int64)  # in the type's unit
        if array.null_count:
            values[pc.is_null(array).to_numpy(zero_copy_only=False)] = _NAT
        self._file.write(values.tobytes())
        self.num_rows += len(array)

    def finish(self) -> str:
        self.close()
        dest = self.directory / f"{self.name}.npy"
        _write_npy(dest, self._raw, np.int64, self._dtype, self.num_rows, lambda v, _: v.view(self._dtype))
        return str(self._dtype)


def make_obs_writer(
    directory: Path, name: str, dtype: pa.DataType
) -> CategoricalWriter | NumericWriter | TemporalWriter:
    """The writer for an obs column of Arrow type ``dtype`` (one `carried_obs` keeps)."""
    if obs_kind(dtype) == CATEGORICAL:
        return CategoricalWriter(directory, name)
    if temporal_dtype(dtype) is not None:
        return TemporalWriter(directory, name, dtype)
    if obs_kind(dtype) == NUMERIC or pa.types.is_decimal(dtype):
        return NumericWriter(directory, name, dtype)
    msg = f"obs column {name!r} cannot be stored: {_left_out_because(dtype)}"
    raise OmicsIOError(msg)


class CellIdWriter:
    """Cell ids in row order, streamed into ``cell_ids.parquet``. With ``unique_in`` (the input's
    ``row_in_file``: a dataset row's file and row there), `finish` refuses a cell id that occurs
    twice, naming it and the files and rows of both
    (`UniqueStrings`: 8 bytes a cell on disk beside the dataset while it is written, none in memory)."""

    path = "cell_ids.parquet"

    def __init__(self, root: Path, *, unique_in: Callable[[int], tuple[str, int]] | None = None):
        self.root, self.unique_in = root, unique_in
        schema = pa.schema([("cell_id", pa.string())])
        self._writer = pq.ParquetWriter(root / self.path, schema, compression="zstd", use_dictionary=False)
        self._unique = None if unique_in is None else UniqueStrings(root / ".cell-id-hashes")

    def append(self, cell_ids: pa.Array) -> None:
        self._writer.write_table(pa.table({"cell_id": cell_ids}))
        if self._unique is not None:
            self._unique.add(cell_ids)

    def close(self) -> None:
        """Release the files (idempotent; `finish` calls it too)."""
        self._writer.close()
        if self._unique is not None:
            self._unique.close()

    def finish(self) -> None:
        """Close the file; raise `DataValidationError` for a cell id that occurs twice (``unique_in``)."""
        self.close()
        if self._unique is None:
            return
        try:
            twice = self._unique.first_repeat(
                lambda: pq.ParquetFile(self.root / self.path).iter_batches(columns=["cell_id"])
            )
        finally:
            shutil.rmtree(self._unique.scratch, ignore_errors=True)
        if twice is not None:
            cell_id, first, again = twice
            (file, a), (other, b) = self.unique_in(first), self.unique_in(again)
            where = (
                f"rows {a} and {b} of {file}"
                if file == other
                else f"row {a} of {file} and row {b} of {other}"
            )
            msg = (
                f"duplicate cell_id {cell_id} in {where}: a dataset's cell ids must be unique; make them "
                "unique in the input, or name a unique column with --cell-id (InputOptions(cell_id=...))"
            )
            raise DataValidationError(msg)

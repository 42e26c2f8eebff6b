"""What the cell table's queries hand back: `CSRBatch` (streamed rows as CSR), `PanelResult` (a gene
panel's expression), `arrow_csr` (a record batch's list columns as CSR) and `ObsSpec` (an obs column
as codes or numbers)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from omicsio_jax.core.errors import DataValidationError, OmicsIOError
from omicsio_jax.format.arrow import list_to_csr
from omicsio_jax.format.tables import GENE_COLUMN, VALUE_COLUMN


@dataclasses.dataclass(frozen=True)
class CSRBatch:
    """Rows of a stream as CSR (``indptr`` int64 from 0, ``indices`` int32 token ids, ``values``
    float32), with each row's ``cell_rowid`` and the requested scalar columns (Arrow arrays)."""

    indptr: np.ndarray
    indices: np.ndarray
    values: np.ndarray
    rowids: np.ndarray
    columns: dict[str, pa.Array]

    @property
    def num_rows(self) -> int:
        return len(self.indptr) - 1


@dataclasses.dataclass(frozen=True)
class PanelResult:
    """Stage 3: ``x[i, k]`` is the expression of ``token_ids[k]`` (``genes[k]``) in cell ``rowids[i]``."""

    x: np.ndarray
    rowids: np.ndarray
    token_ids: np.ndarray
    genes: list[str]


def arrow_csr(batch: pa.RecordBatch | pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(indptr, indices, values)`` of a record batch's ``gene_token_id``/``gene_expression`` columns.

    Right for chunked and sliced columns (offsets accumulated per chunk); indices and values are
    zero-copy views when the child arrays already are int32/float32 without nulls.
    """
    gene_ptr, genes = list_to_csr(batch.column(GENE_COLUMN))
    value_ptr, values = list_to_csr(batch.column(VALUE_COLUMN))
    if not np.array_equal(gene_ptr, value_ptr):
        row = int(np.flatnonzero(np.diff(gene_ptr) != np.diff(value_ptr))[0])
        msg = f"row {row} of the batch has {GENE_COLUMN} and {VALUE_COLUMN} of different lengths"
        raise DataValidationError(msg)
    if genes.null_count or values.null_count:
        raise DataValidationError(NULL_ELEMENTS)
    indices = genes.to_numpy(zero_copy_only=False)
    if indices.dtype != np.int32:
        if len(indices) and (indices.min() < 0 or indices.max() > np.iinfo(np.int32).max):
            msg = f"{GENE_COLUMN} holds values outside int32"
            raise DataValidationError(msg)
        indices = indices.astype(np.int32)
    return gene_ptr, indices, values.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)


NULL_ELEMENTS = f"null elements inside {GENE_COLUMN}/{VALUE_COLUMN} lists"


def is_numeric_obs(name: str, dtype: pa.DataType, where: str) -> bool:
    """Whether a table's obs column ``name`` of ``dtype`` goes into batches as numbers (else as the
    codes of its categories), as a materialized dataset's obs do: integers, floats and decimals
    (DuckDB's type for a literal such as ``0.5``) as numbers, bools as codes into `BOOL_CATEGORIES`;
    a column of lists or structs (the genes and values), or of dates and times, is refused."""
    if pa.types.is_nested(dtype):
        msg = f"obs {name!r} of {where} holds {dtype}, not one value per cell: pass obs columns"
        raise OmicsIOError(msg)
    if pa.types.is_temporal(dtype):  # (as codes, its dates went into batches as category numbers)
        msg = (
            f"obs {name!r} of {where} holds {dtype} values, which batches do not carry: leave it out of "
            "obs= and look it up by the batch's index (its cells' cell_rowid), e.g. "
            f"table.metadata([{name!r}], rowids=...)"
        )
        raise OmicsIOError(msg)
    return pa.types.is_integer(dtype) or pa.types.is_floating(dtype) or pa.types.is_decimal(dtype)


@dataclasses.dataclass(frozen=True)
class ObsSpec:
    """How an obs column becomes an array: categorical (int32 codes into ``categories``, -1 =
    missing) or numeric (float32, NaN = missing)."""

    name: str
    categories: tuple | None

    def encode(self, column: pa.Array | pa.ChunkedArray) -> np.ndarray:
        if self.categories is None:
            try:
                numbers = pc.cast(column, pa.float32())  # an integer float32 does not hold exactly is refused
            except pa.ArrowInvalid as e:
                msg = (
                    f"obs {self.name!r} holds {column.type} values that float32 batches cannot hold exactly "
                    f"({str(e).splitlines()[0]}): leave it out of obs= and look it up by the batch's index "
                    "(its cells' cell_rowid)"
                )
                raise OmicsIOError(msg) from e
            return pc.fill_null(numbers, np.nan).to_numpy(zero_copy_only=False)
        if pa.types.is_boolean(column.type):  # codes into BOOL_CATEGORIES: False 0, True 1
            return pc.fill_null(pc.cast(column, pa.int32()), -1).to_numpy(zero_copy_only=False)
        codes = pc.index_in(column, value_set=pa.array(self.categories, type=column.type))
        return pc.fill_null(codes, -1).to_numpy(zero_copy_only=False).astype(np.int32)

"""Validate a batch of cells against the list-column schema while encoding it.

The codec's planning pass (numba, parallel) checks every invariant, converts INT64/FLOAT64
input (with range checks) and maps gene_token_id to the columns of the gene table. The first
broken row becomes a one-line `DataValidationError` naming the file, the row, the cell_id and
the invariant.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from omicsio_jax import DataValidationError
from omicsio_jax.format import (
    ROW_DUPLICATE,
    ROW_NEGATIVE,
    ROW_NOT_FINITE,
    ROW_UNKNOWN_GENE,
    ROW_UNSORTED,
    InvalidRowError,
    encode_csr,
    encode_dense_rows,
    plan_sparse,
)

from ._panel import Panel


@dataclasses.dataclass(frozen=True)
class GeneIndex:
    """Maps gene_token_id → column; ``token_to_col[t] == -1`` for tokens not in the gene table."""

    token_to_col: np.ndarray
    num_genes: int
    description: str
    names: tuple[str, str] = ("gene_token_id", "gene_expression")  # the input's list columns, for messages

    @classmethod
    def from_tokens(
        cls,
        tokens: np.ndarray,
        description: str,
        names: tuple[str, str] = ("gene_token_id", "gene_expression"),
    ) -> GeneIndex:
        """Columns follow ascending token order, so sorted token lists stay sorted."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= 2**31):
            msg = f"gene_token_id values in {description} must lie in 0..2^31-1 (found {tokens.min()}..{tokens.max()})"
            raise DataValidationError(msg)
        if len(np.unique(tokens)) != len(tokens):
            msg = f"gene_token_id is not unique in {description}"
            raise DataValidationError(msg)
        token_to_col = np.full(int(tokens.max()) + 1 if len(tokens) else 0, -1, dtype=np.int32)
        token_to_col[np.sort(tokens)] = np.arange(len(tokens), dtype=np.int32)
        return cls(token_to_col, len(tokens), description, names)


def encode_batch(
    indptr: np.ndarray,
    tokens: np.ndarray,
    values: np.ndarray,
    genes: GeneIndex,
    *,
    allow_negative: bool,
    locate: Callable[[int], str],
    panel: Panel | None = None,
    out: Callable[[int], np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Validate a raw CSR batch and encode it; return ``(buffer, starts, nnz)``.

    ``locate(i)`` describes batch row ``i`` (file, row, cell_id) for the error message. With a
    ``panel`` the rows are scattered to the panel's columns and stored dense. ``out(nbytes)`` gives
    the buffer to encode into (`encode_csr`'s ``out``).
    """
    if not np.issubdtype(tokens.dtype, np.integer):
        msg = f"{genes.names[0]} must be a list of integers, got element type {tokens.dtype} in {locate(0)}"
        raise DataValidationError(msg)
    if np.issubdtype(values.dtype, np.integer) or values.dtype == np.float16:
        values = values.astype(np.float64)
    elif not np.issubdtype(values.dtype, np.floating):
        msg = f"{genes.names[1]} must be a list of numbers, got element type {values.dtype} in {locate(0)}"
        raise DataValidationError(msg)
    if panel is None:
        try:
            buf, starts = encode_csr(
                indptr,
                tokens,
                values,
                token_to_col=genes.token_to_col,
                allow_negative=allow_negative,
                out=out,
            )
        except InvalidRowError as e:
            raise DataValidationError(_describe(e, tokens, values, genes, locate)) from None
        return buf, starts, len(tokens)
    *_, problems, where = plan_sparse(indptr, tokens, values, genes.token_to_col, allow_negative)
    bad = np.flatnonzero(problems)
    if len(bad):
        e = InvalidRowError(int(bad[0]), int(where[bad[0]]), int(problems[bad[0]]))
        raise DataValidationError(_describe(e, tokens, values, genes, locate))
    dense = panel.scatter(indptr, tokens, values, genes.token_to_col)
    buf, starts = encode_dense_rows(dense, out=out)
    return buf, starts, int(np.count_nonzero(dense))


def _describe(e: InvalidRowError, tokens, values, genes: GeneIndex, locate) -> str:
    j, code = e.position, e.problem
    token_name, value_name = genes.names
    token, value = int(tokens[j]), float(values[j])
    where = locate(e.row)
    if code == ROW_UNSORTED:
        return f"{token_name} not sorted in {where}: {token} after {int(tokens[j - 1])}"
    if code == ROW_DUPLICATE:
        return f"duplicate {token_name} in {where}: {token} appears twice"
    if code == ROW_UNKNOWN_GENE:
        return f"{token_name} {token} in {where} is not in the gene table ({genes.description})"
    if code == ROW_NOT_FINITE:
        return f"{value_name} is {value} (not finite) in {where} at {token_name} {token}"
    if code == ROW_NEGATIVE:
        return (
            f"negative {value_name} {value} in {where} at {token_name} {token} "
            "(pass --allow-negative / allow_negative=True for data such as scaled values)"
        )
    return f"{value_name} {value} in {where} at {token_name} {token} overflows float32"

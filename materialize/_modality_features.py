"""A modality table's columns and its feature table: its token and value list columns, and the
feature table given or found beside it, read as a gene table."""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from omicsio_jax import DataValidationError
from omicsio_jax.format import (
    GENE_COLUMN,
    VALUE_COLUMN,
    connect,
    is_list_type,
    is_remote,
    sql_str,
)

from ._modality_inputs import ModalityInput
from ._source import gene_table_from_arrow

_FEATURE_TABLES = ("{name}_features.parquet", "peaks.parquet", "features.parquet")


def list_columns(schema: pa.Schema, label: str) -> tuple[str, str]:
    """The token and value list columns of a modality table: ``gene_token_id`` / ``gene_expression``,
    else the one ``*_token_id`` list column and the one other list column (``peak_accessibility``)."""
    if GENE_COLUMN in schema.names:
        return GENE_COLUMN, VALUE_COLUMN
    lists = [f.name for f in schema if is_list_type(f.type)]
    tokens = [n for n in lists if n.endswith("_token_id")]
    values = [n for n in lists if n not in tokens]
    if len(tokens) != 1 or len(values) != 1:
        msg = (
            f"{label}: a modality table needs one <feature>_token_id list column and one value list column "
            f"(gene_token_id / gene_expression, peak_token_id / peak_accessibility); it has list columns "
            f"{', '.join(lists) or '(none)'}"
        )
        raise DataValidationError(msg)
    return tokens[0], values[0]


def find_features(inp: ModalityInput, files: list[Path], token_column: str) -> str | None:
    """The feature table given, else one named like `_FEATURE_TABLES` beside the table's files or
    in their parent folder (not one of the input files). A ``peaks.parquet`` / ``features.parquet``
    without the table's ``token_column`` is another modality's (ATAC's peaks beside a protein table)."""
    if inp.features is not None:
        return inp.features
    folders = dict.fromkeys(folder for f in files for folder in (f.parent, f.parent.parent))
    for folder in folders:
        for pattern in _FEATURE_TABLES:
            candidate = folder / pattern.format(name=inp.name)
            if candidate in files or not candidate.exists():
                continue
            if pattern == _FEATURE_TABLES[0] or token_column in _column_names(candidate):
                return str(candidate)
    return None


def _column_names(path: Path) -> list[str]:
    """The columns of a parquet file; all of them unknown (``[]``) for one that cannot be read."""
    try:
        return pq.read_schema(path).names
    except (OSError, pa.ArrowException):
        return []


def read_features(path: str, token_column: str) -> pa.Table:
    """A feature table keyed by ``token_column`` (``peak_token_id``), as a gene table (``gene_token_id``)."""
    try:
        table = connect(remote=is_remote(path)).sql(f"SELECT * FROM {sql_str(path)}").to_arrow_table()
    except duckdb.Error as e:
        msg = f"cannot read feature table {path}: {str(e).splitlines()[0]}"
        raise DataValidationError(msg) from e
    if token_column != GENE_COLUMN and token_column in table.column_names:
        table = table.rename_columns([GENE_COLUMN if n == token_column else n for n in table.column_names])
    elif token_column != GENE_COLUMN:
        msg = f"feature table {path} has no {token_column} column (it has {', '.join(table.column_names)})"
        raise DataValidationError(msg)
    return gene_table_from_arrow(table, path)


def check_same_genes(inp: ModalityInput, features: pa.Table, primary_genes: pa.Table, primary: str) -> None:
    tokens = features.column(GENE_COLUMN).to_numpy()
    ours = primary_genes.column(GENE_COLUMN).to_numpy()
    if not np.array_equal(np.sort(tokens), np.sort(ours)):
        extra = np.setdiff1d(tokens, ours)
        detail = (
            f"gene_token_id {int(extra[0])} is not among the primary's genes"
            if len(extra)
            else f"it has {len(tokens):,} genes, the primary {len(ours):,}"
        )
        msg = (
            f"layer {inp.name}: its gene table {inp.features} differs from the gene space of the primary modality "
            f"{primary} ({detail}); a layer shares the primary's genes"
        )
        raise DataValidationError(msg)

"""Stage 3 of a cell table query: a gene panel's dense expression, as a `PanelResult`.

Two ways to the same matrix: for a few genes, DuckDB indexes the lists (`panel_expression`, one
``list_position`` per gene and cell, read back by `panel_from_rows`); for hundreds or thousands,
the rows stream as CSR through the numba panel scatter (`scatter_panel_batches`, one pass over
each row). `CellTable.panel` picks between them at `SQL_PANEL_MAX` genes.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pyarrow as pa

from omicsio_jax.format.tables import GENE_COLUMN, ROWID_COLUMN, VALUE_COLUMN
from omicsio_jax.outputs.scatter import make_gene_to_col, scatter_panel
from omicsio_jax.query.results import NULL_ELEMENTS, CSRBatch, PanelResult

SQL_PANEL_MAX = 64  # above this many genes, stage 3 streams rows through the numba panel scatter


def panel_expression(tokens: np.ndarray) -> str:
    """The SQL list of a row's expression of each of ``tokens``, in order (0 where not expressed):
    ``list_position`` then ``gene_expression[pos]``, as ``FLOAT[]``. A row with a null inside its
    lists fails the query, as the scatter path refuses it (`arrow_csr`), rather than reading as 0."""
    literal = "[" + ", ".join(map(str, tokens.tolist())) + "]::INTEGER[]"
    nulls = " OR ".join(f"len({c}) > list_count({c})" for c in (GENE_COLUMN, VALUE_COLUMN))
    return (
        f"CASE WHEN {nulls} THEN error('{NULL_ELEMENTS}') ELSE "
        f"list_transform({literal}, lambda g: coalesce("
        f"{VALUE_COLUMN}[list_position({GENE_COLUMN}, g)], 0))::FLOAT[] END"
    )


def panel_from_rows(table: pa.Table, tokens: np.ndarray, names: list[str]) -> PanelResult:
    """The panel of rows that hold ``cell_rowid`` and ``x`` (a `panel_expression`)."""
    x = table.column("x").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(table.num_rows, len(tokens))
    return PanelResult(x, table.column(ROWID_COLUMN).to_numpy().astype(np.int64), tokens, names)


def scatter_panel_batches(
    batches: Iterable[CSRBatch], tokens: np.ndarray, names: list[str], *, num_tokens: int
) -> PanelResult:
    """The panel of streamed CSR rows, each batch through the numba panel scatter; ``num_tokens``
    is the gene table's width (widened to the panel's largest token id)."""
    gene_to_col = make_gene_to_col(max(num_tokens, int(tokens.max(initial=-1)) + 1), tokens)
    parts, ids = [], []
    for b in batches:
        parts.append(
            scatter_panel(
                b.indptr,
                b.indices,
                b.values,
                gene_to_col,
                out=np.empty((b.num_rows, len(tokens)), np.float32),
            )
        )
        ids.append(b.rowids)
    x = np.concatenate(parts) if parts else np.zeros((0, len(tokens)), np.float32)
    return PanelResult(x, np.concatenate(ids) if ids else np.zeros(0, np.int64), tokens, names)

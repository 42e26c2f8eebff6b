"""Which cells a query over a cell table reads, as SQL: `from_clause` (a predicate, further tests
and chosen ``cell_rowid``, with the row-group pruning of parquet files) and `presence_test` (stage
2's test for a set of genes on ``gene_token_id``, which never reads ``gene_expression``).

Plain functions of the files, their first ``cell_rowid``s and the connection, so that `CellTable`
builds every stage's ``FROM cells WHERE ...`` the same way, on its own connection and on each
stream's.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.format.tables import GENE_COLUMN, ROWID_COLUMN, rowid_pruning

_CHAIN_MAX = 32  # up to this many genes, stage 2 tests presence with one list_contains per gene
_counter = itertools.count()


def from_clause(
    con: duckdb.DuckDBPyConnection,
    where: str | None,
    rowids: Sequence[int] | np.ndarray | None,
    *extra: str,
    files: list[Path],
    bases: list[int],
    prunable: bool,
    num_cells: int,
    registered: list[str] | None = None,
) -> str:
    """`` FROM cells WHERE ...``: ``where`` (`where_sql`), ``extra`` tests and, for ``rowids``, a
    semi-join against an Arrow table registered on ``con`` (its name appended to ``registered``, for
    the caller to unregister once the query has run) plus (parquet) a ``file_row_number`` range
    predicate that lets DuckDB read only the row groups holding them. ``rowids`` must be integers
    below ``num_cells``, the table's cells (one outside would select nothing, silently)."""
    clauses = [where_sql(where)] if where else []
    source = "cells"
    if rowids is not None:
        ids = checked_rowids(rowids, num_cells)
        name = f"_rowids_{next(_counter)}"
        con.register(name, pa.table({ROWID_COLUMN: ids}))
        if registered is not None:
            registered.append(name)
        clauses.append(f"{ROWID_COLUMN} IN (SELECT {ROWID_COLUMN} FROM {name})")
        if prunable:
            source = "cells_all"
            clauses.append(rowid_pruning(files, bases, ids))
    clauses.extend(extra)
    return f" FROM {source}" + ((" WHERE " + " AND ".join(clauses)) if clauses else "")


def checked_rowids(rowids: Sequence[int] | np.ndarray, num_cells: int) -> np.ndarray:
    """``rowids`` sorted and unique as int64, or a one-line `OmicsIOError` for ids that are not
    integers (a bool mask, floats) or lie outside the table's ``num_cells`` cells: either would
    select other cells, or none, without a word."""
    given = np.asarray(rowids)
    if given.size and (given.ndim != 1 or not np.issubdtype(given.dtype, np.integer)):
        msg = (
            f"rowids must be a 1-D sequence of integer cell_rowids, got {given.dtype} of shape {given.shape}"
        )
        raise OmicsIOError(msg)
    ids = np.unique(given.astype(np.int64))
    if len(ids) and (ids[0] < 0 or ids[-1] >= num_cells):
        bad = int(ids[0] if ids[0] < 0 else ids[-1])
        msg = (
            f"rowids hold cell_rowid {bad:,}, outside the table's {num_cells:,} cells (0..{num_cells - 1:,})"
        )
        raise OmicsIOError(msg)
    return ids


def where_sql(where: str) -> str:
    """``where``, a predicate over the table's columns, as the SQL a ``WHERE`` holds, bracketed: it
    must parse as one expression, so that it cannot close the brackets around it (``1=1) OR (1=1``
    would select past the ``rowids`` beside it), add a statement, or comment out what follows it
    (a ``--`` comment ends at the newline after it). A one-line `OmicsIOError` otherwise."""
    try:
        duckdb.SQLExpression(where)
    except duckdb.Error as e:
        msg = (
            f"where={where!r} is not one SQL expression ({str(e).strip().splitlines()[0]}): give a "
            "predicate over the table's columns, such as \"tissue = 'lung' AND n_genes > 200\""
        )
        raise OmicsIOError(msg) from None
    return f"(\n{where}\n)"


def presence_test(tokens: np.ndarray, mode: str) -> str:
    """The SQL test that a row's ``gene_token_id`` holds any (``mode="any"``) or every (``"all"``)
    of the sorted unique token ids ``tokens``."""
    if len(tokens) <= _CHAIN_MAX:  # list_contains chains are ~10x faster than list_has_any/all
        test = (" OR " if mode == "any" else " AND ").join(
            f"list_contains({GENE_COLUMN}, {t})" for t in tokens.tolist()
        ) or "false"
        return f"({test})"
    literal = "[" + ", ".join(map(str, tokens.tolist())) + "]::INTEGER[]"
    return f"list_has_{mode}({GENE_COLUMN}, {literal})"

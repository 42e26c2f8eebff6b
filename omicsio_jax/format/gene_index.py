"""The inverted gene index ``gene_cell_index (gene_token_id INT32, dataset VARCHAR, cell_rowids LIST<INT64>)``.

One row per (gene, dataset) that has any expressing cell, sorted by gene then dataset, with
the cells' ``cell_rowid`` ascending; row groups of about a million row ids, so the parquet
statistics on ``gene_token_id`` let a lookup read one row group per gene instead of every
cell's gene list. Built offline by ``omicsio-materialize index`` (`materialize.build_gene_index`);
``index.json`` beside it records the table files it was built from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.format.tables import sql_str

if TYPE_CHECKING:
    import duckdb

INDEX_FILE = "gene_cell_index.parquet"
INDEX_MANIFEST = "index.json"
INDEX_FORMAT = 1


def open_index(
    con: duckdb.DuckDBPyConnection, path: Path, *, table_spec: str, table_fingerprint: dict
) -> dict:
    """Check that the index at ``path`` was built from the files of the cell table ``table_spec``
    (whose `CellTable.fingerprint` is ``table_fingerprint``) and register it as view ``gene_cell_index``
    on ``con``."""
    manifest_path = path / INDEX_MANIFEST
    if not manifest_path.exists():
        msg = f"{path} is not a gene index (no {INDEX_MANIFEST}); build one with `omicsio-materialize index`"
        raise OmicsIOError(msg)
    info = json.loads(manifest_path.read_text())
    if info.get("format") != INDEX_FORMAT:
        msg = f"{path}: index format {info.get('format')!r} is not {INDEX_FORMAT}; rebuild it"
        raise OmicsIOError(msg)
    if info["table"] != table_fingerprint:
        built = [Path(f[0]).name for f in info["table"]["files"]]
        msg = (
            f"the gene index at {path} was built from other files or versions ({', '.join(built[:3])}"
            f"{'...' if len(built) > 3 else ''}) than {table_spec}; rebuild it with "
            f"`omicsio-materialize index {table_spec} {path} --overwrite`"
        )
        raise OmicsIOError(msg)
    con.execute(
        f"CREATE OR REPLACE VIEW gene_cell_index AS SELECT * FROM read_parquet({sql_str(str(path / INDEX_FILE))})"
    )
    return info


def lookup(con: duckdb.DuckDBPyConnection, tokens: np.ndarray, *, mode: str) -> np.ndarray:
    """Sorted row ids of cells expressing any / all of ``tokens`` (unique token ids), from the index."""
    if len(tokens) == 0:
        return np.zeros(0, np.int64)
    literal = ", ".join(map(str, tokens.tolist()))
    table = con.sql(
        f"SELECT gene_token_id, cell_rowids FROM gene_cell_index WHERE gene_token_id IN ({literal})"
    ).to_arrow_table()
    ids = table.column("cell_rowids").combine_chunks().flatten().to_numpy()
    if mode == "any" or len(tokens) == 1:
        return np.unique(ids).astype(np.int64)
    # A cell appears once per gene (it sits in exactly one dataset), so "all" = seen len(tokens) times.
    uniq, counts = np.unique(ids, return_counts=True)
    return uniq[counts == len(tokens)].astype(np.int64)

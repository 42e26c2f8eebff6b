"""The Tahoe-100M layout of list-column tables, as published: detected, reshaped and checked.

**Tahoe-100M as published** (``tahoebio/Tahoe-100M`` on Hugging Face, ``data/*.parquet``): chosen
when the input (or ``--query``'s result) has list columns ``genes`` and ``expressions`` and
neither ``gene_token_id`` nor ``gene_expression``. ``genes`` list<int64> holds token ids
(gene index + 3; 0, 1, 2 are ``<pad>``, ``<cls>``, ``<eoc>``), ``expressions`` list<float32>
the raw counts, and every row starts with the CLS pair (gene 1, expression -2.0). The reader
checks that pair in every row (a row without it is a `DataValidationError` naming file, row
and cell), strips it in SQL (``genes[2:]`` → ``gene_token_id``, ``expressions[2:]`` →
``gene_expression``) and takes ``BARCODE_SUB_LIB_ID`` as the cell id unless the input has a
``cell_id`` column (or ``--cell-id`` names another). The other scalar columns (``drug``,
``sample``, ``cell_line_id``, ``moa-fine``, ``canonical_smiles``, ``pubchem_cid``, ``plate``)
are obs columns as usual; ``--where`` sees the published columns, before the CLS pair is
stripped. The gene table is Tahoe's ``metadata/gene_metadata.parquet`` (``token_id``,
``ensembl_id``, ``gene_symbol``), found beside the input as usual or in a ``metadata/``
folder next to one of the input's parent folders; it is read as ``token_id`` →
``gene_token_id``, ``gene_symbol`` → ``gene_name``, ``ensembl_id`` kept, so dataset column
``g`` is Tahoe token ``g + 3`` when the table is complete; a gene table holding tokens 0-2 is
refused (a 0-based index would shift every column). Without a gene table the columns are the
tokens 3..max seen (the specials are not genes), so ``g ↔ g + 3`` holds as well. Pass the
``data/`` folder or a glob, not the repository root: a directory is searched recursively and
would take in the other ``metadata/*.parquet`` tables.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from omicsio_jax import DataValidationError
from omicsio_jax.format import (
    CELL_ID_COLUMN,
    GENE_COLUMN,
    GENE_TABLE_NAME,
    VALUE_COLUMN,
    find_gene_table,
    is_list_type,
    sql_ident,
)

INTERNAL_LAYOUT = "internal"
TAHOE_LAYOUT = "tahoe-100m"
TAHOE_GENES, TAHOE_VALUES, TAHOE_CELL_ID = "genes", "expressions", "BARCODE_SUB_LIB_ID"
TAHOE_CLS_TOKEN, TAHOE_CLS_VALUE = 1, -2.0
TAHOE_NUM_SPECIALS = 3  # <pad>, <cls>, <eoc>: gene g of the vocabulary is token g + 3
FIRST_GENE, FIRST_VALUE = "__tahoe_first_gene", "__tahoe_first_expression"  # the CLS pair, checked per row


def detect_layout(schema: pa.Schema) -> str:
    """``"tahoe-100m"`` for list columns ``genes`` + ``expressions`` without the internal list columns."""
    names = set(schema.names)
    if GENE_COLUMN in names or VALUE_COLUMN in names:
        return INTERNAL_LAYOUT
    if all(n in names and is_list_type(schema.field(n).type) for n in (TAHOE_GENES, TAHOE_VALUES)):
        return TAHOE_LAYOUT
    return INTERNAL_LAYOUT


def tahoe_sql(sql: str) -> str:
    """Tahoe rows in the internal layout: lists without their first pair, which comes along to be checked."""
    genes, values = sql_ident(TAHOE_GENES), sql_ident(TAHOE_VALUES)
    return (
        f"SELECT * EXCLUDE ({genes}, {values}), "
        f"{genes}[2:] AS {GENE_COLUMN}, {values}[2:] AS {VALUE_COLUMN}, "
        f"{genes}[1] AS {FIRST_GENE}, {values}[1] AS {FIRST_VALUE} FROM ({sql})"
    )


def tahoe_gene_table(table: pa.Table) -> pa.Table:
    """Tahoe's gene metadata (``token_id``, ``gene_symbol``, ``ensembl_id``) under our column names."""
    if "token_id" not in table.column_names or "gene_token_id" in table.column_names:
        return table
    renames = {"token_id": "gene_token_id"}
    if "gene_name" not in table.column_names:
        renames["gene_symbol"] = "gene_name"
    return table.rename_columns([renames.get(n, n) for n in table.column_names])


def check_no_special_tokens(table: pa.Table, label: str) -> None:
    """A Tahoe gene table holding token 0, 1 or 2 is 0-based (or not Tahoe's): columns would shift."""
    tokens = table.column(GENE_COLUMN).to_numpy()
    if len(tokens) and tokens.min() < TAHOE_NUM_SPECIALS:
        msg = (
            f"gene table {label} maps token {int(tokens.min())} to a gene, but Tahoe-100M's genes lists "
            "reserve 0, 1, 2 for <pad>, <cls>, <eoc> (gene index + 3); give the table whose token_id values "
            "are the ids in genes (Tahoe's metadata/gene_metadata.parquet), or add 3 to a 0-based index"
        )
        raise DataValidationError(msg)


def find_tahoe_gene_table(files: list[Path]) -> Path | None:
    """``gene_metadata.parquet`` as usual, else in ``metadata/`` beside the inputs' folder or a parent
    (the published tree: ``data/train-*.parquet`` next to ``metadata/gene_metadata.parquet``)."""
    found = find_gene_table(files)
    if found is not None:
        return found
    roots = {f.parent for f in files}
    while len(roots) > 1 and {r.parent for r in roots} != roots:
        roots = {r.parent for r in roots}
    root = roots.pop()
    for folder in [root, *root.parents]:
        candidate = folder / "metadata" / GENE_TABLE_NAME
        if candidate.exists():
            return candidate
    return None


def check_cls_pairs(first_gene: pa.Array, first_value: pa.Array, locate, cell_id_column: str) -> None:
    """Every Tahoe row starts with (gene 1, expression -2.0): name the first row that does not."""
    ok = pc.and_(pc.equal(first_gene, TAHOE_CLS_TOKEN), pc.equal(first_value, TAHOE_CLS_VALUE))
    ok = pc.fill_null(ok, False).to_numpy(zero_copy_only=False)
    if ok.all():
        return
    i = int(np.flatnonzero(~ok)[0])
    if first_gene[i].is_valid and first_value[i].is_valid:
        found = f"starts with (gene {first_gene[i].as_py()}, expression {first_value[i].as_py()})"
    else:
        found = "has empty or null genes/expressions lists"
    cell_id = "" if cell_id_column == CELL_ID_COLUMN else f"--cell-id {cell_id_column} "
    msg = (
        f"{locate(i)} {found} instead of Tahoe-100M's CLS pair (gene {TAHOE_CLS_TOKEN}, expression "
        f"{TAHOE_CLS_VALUE}), which every row of a genes/expressions table must start with; restore the "
        f"pair, or, for lists without it, read them as the internal layout: {cell_id}--query "
        '"SELECT * EXCLUDE (genes, expressions), genes AS gene_token_id, expressions AS gene_expression '
        'FROM cells"'
    )
    raise DataValidationError(msg)

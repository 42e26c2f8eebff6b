"""A source's gene ids, found in its gene table: Ensembl ids (version suffixes stripped) or, for a
source without them, its gene symbols; and the gene lists (`read_gene_list`) that fix a collection's
genes.

`gene_keys` takes the column it is told to use, else the first of ``ensembl_id``, ``gene_ids``,
``gene_id``, ``feature_id`` (or any other string column) holding Ensembl ids (``ENSG…``,
``ENSMUSG…``); a source with none is keyed by gene symbol (``feature_name``, ``gene_symbol``,
``gene_name``), for `_genespace.GeneSpace` to match through the symbols the other sources give their
Ensembl ids.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from omicsio_jax import DataValidationError, OmicsIOError
from omicsio_jax.format import (
    ENSEMBL_GENE_ID,
    GENE_TABLE_NAME,
    VERSION_SUFFIX,
    from_numpy,
    one_array,
    strip_version,
    to_numpy_filled,
)

ID_COLUMNS = ("ensembl_id", "gene_ids", "gene_id", "feature_id")
SYMBOL_COLUMNS = ("feature_name", "gene_symbol", "gene_symbols", "symbol", "gene_name")


def _text(table: pa.Table, name: str) -> pa.Array:
    column = one_array(table.column(name))  # not a copy of each gene table (`combine_chunks` made one)
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    return column.cast(pa.string())


def _present(values: pa.Array) -> pa.Array:
    """A text array with its empty values made null: an empty id or symbol names no gene (genes
    sharing "" are not one gene). The array itself when it has none (most gene tables)."""
    lengths = pc.binary_length(values)
    if not np.any(to_numpy_filled(lengths, 1) == 0):
        return values
    # compared with an array of zeros, not a scalar (``pa.scalar`` imports pandas: see `text_array`)
    empty = pc.equal(lengths, from_numpy(np.zeros(len(values), np.int32), lengths.type))
    return pc.if_else(empty, pa.nulls(len(values), values.type), values)


def _ensembl_share(values: pa.Array, sample: int = 4096) -> float:
    """The share of the non-empty values that are Ensembl ids (of up to ``sample`` spread over them)."""
    present = np.flatnonzero(to_numpy_filled(pc.binary_length(values), 0))
    if len(present) > sample:
        present = present[np.linspace(0, len(present) - 1, sample).astype(np.int64)]
    present = values.take(from_numpy(present))
    if not len(present):
        return 0.0
    return pc.sum(pc.match_substring_regex(present, ENSEMBL_GENE_ID.pattern)).as_py() / len(present)


def ensembl_like(values: pa.Array) -> bool:
    """Whether most non-empty values of a text array are Ensembl ids (``ENSG…``, ``ENSMUSG…``)."""
    return _ensembl_share(values) >= 0.5


def _stripped(values: pa.Array) -> pa.Array:
    """Ensembl ids without their version suffix, as `strip_version` writes them (``ENSG….12`` →
    ``ENSG…``, ``ENSG….14_PAR_Y`` → ``ENSG…_PAR_Y``); other values unchanged. Values without a "."
    anywhere (most gene tables) are returned after one scan of their bytes: Arrow's ``match_substring``
    took ~45 ns a value (2 ms a source of 40k genes, the largest share of a collection's serial setup)."""
    data = values.buffers()[2]  # the characters of a string array (and maybe more: then just slower)
    if data is None or not np.any(np.frombuffer(data, np.uint8) == ord(".")):
        return values
    ensembl = pc.match_substring_regex(values, ENSEMBL_GENE_ID.pattern)
    if not pc.any(ensembl).as_py():
        return values
    unversioned = pc.replace_substring_regex(values, VERSION_SUFFIX.pattern, "", max_replacements=1)
    return pc.if_else(ensembl, unversioned, values)


@dataclasses.dataclass(frozen=True)
class GeneKeys:
    """A source's genes in gene-table order: ``ids`` (Ensembl ids without version, or symbols when
    ``by == "symbol"``; null: no id, empty ids made null), ``symbols`` (null where unknown or empty)
    and the column read."""

    ids: pa.Array
    symbols: pa.Array
    by: str
    column: str


def gene_keys(genes: pa.Table, label: str, id_column: str | None = None, *, source: bool = True) -> GeneKeys:
    """How a source's genes are matched (see the module docstring); a one-line error naming the source,
    its columns and the fix when it has no gene id, or (a ``source``: not a given gene list) no gene
    table (a list-column table without one: its genes are token ids only)."""
    names = [n for n in genes.column_names if n != "gene_token_id"]
    if source and not names:
        msg = (
            f"{label} has no gene table: its genes are token ids only, which a collection cannot match "
            f"across sources; put its gene table beside it as {GENE_TABLE_NAME} (columns gene_token_id, "
            "ensembl_id), in its folder or one above"
        )
        raise DataValidationError(msg)
    texts = {n: _text(genes, n) for n in names if _is_text(genes.schema.field(n).type)}
    symbols_of = next(
        (_present(texts[n]) for n in SYMBOL_COLUMNS if n in texts and _ensembl_share(texts[n]) < 0.5),
        pa.nulls(genes.num_rows, pa.string()),
    )
    if id_column is not None:
        if id_column not in texts:
            msg = (
                f"{label} has no text column {id_column!r} to take gene ids from; "
                f"its gene table has {', '.join(names) or 'no columns'}"
            )
            raise DataValidationError(msg)
        ids = texts[id_column]
        by = "ensembl" if _ensembl_share(ids) >= 0.5 else "id"
        return GeneKeys(_present(_stripped(ids)), symbols_of, by, id_column)
    candidates = [n for n in ID_COLUMNS if n in texts] + [n for n in texts if n not in ID_COLUMNS]
    for name in candidates:
        if _ensembl_share(texts[name]) >= 0.5:
            return GeneKeys(_present(_stripped(texts[name])), symbols_of, "ensembl", name)
    numbered = []  # symbol columns of numbers only: positions (anndata's index once names are lost)
    for name in SYMBOL_COLUMNS:
        if name in texts and pc.max(pc.binary_length(texts[name])).as_py():
            if _positions(texts[name]):
                numbered.append(name)
                continue
            return GeneKeys(_present(texts[name]), _present(texts[name]), "symbol", name)
    why = (
        f"its {', '.join(numbered)} holds positions (0, 1, 2, …, as AnnData writes genes whose names "
        "were lost), which name no gene"
        if numbered
        else f"no symbol column ({', '.join(SYMBOL_COLUMNS)}) is there"
    )
    msg = (
        f"{label} has no gene id column: none of {', '.join(ID_COLUMNS)} holds Ensembl ids (ENSG…) and "
        f"{why} (it has {', '.join(names) or 'none'}); name the column with --gene-id-column "
        "(gene_id_column=...)"
    )
    raise DataValidationError(msg)


def _positions(values: pa.Array) -> bool:
    """Whether text values are ``0, 1, 2, …`` in order: AnnData's index once gene names were lost
    (numbers in another order, such as Entrez ids, name genes)."""
    expected = pa.array(np.arange(len(values)).astype(str))
    return len(values) > 0 and values.null_count == 0 and values.equals(expected.cast(values.type))


def _is_text(dtype: pa.DataType) -> bool:
    if pa.types.is_dictionary(dtype):
        dtype = dtype.value_type
    return pa.types.is_string(dtype) or pa.types.is_large_string(dtype)


def read_gene_list(path: str | Path) -> list[str]:
    """The genes of a given gene table or vocabulary, in order: a parquet / CSV / TSV gene table
    (its id column found as for a source), a JSON ``{gene id: token}`` vocabulary (Geneformer's token
    dictionary, in token order) or a text file of one id per line."""
    path = Path(path)
    suffix = path.suffix.lower()
    if not path.is_file():
        msg = (
            f"gene list {path} not found: --genes (genes=) takes union, intersection, or a gene table / "
            "vocabulary (.parquet, .csv, .tsv, .json, or a text file of one id per line)"
        )
        raise OmicsIOError(msg)
    try:
        genes = _read_genes(path, suffix)
    except OmicsIOError:
        raise
    except (OSError, ValueError, TypeError) as e:  # unreadable, not UTF-8, not JSON, not a table
        text = str(e).strip()
        msg = (
            f"cannot read the gene list {path}: {text.splitlines()[0] if text else type(e).__name__}; "
            "--genes (genes=) takes a gene table (.parquet, .csv, .tsv), a JSON vocabulary "
            "{gene id: token} or a text file of one id per line"
        )
        raise OmicsIOError(msg) from e
    if not genes:
        msg = f"gene list {path} holds no gene ids (a vocabulary: no Ensembl ids, ENSG…): it would leave no genes"
        raise OmicsIOError(msg)
    return genes


def _read_genes(path: Path, suffix: str) -> list[str]:
    if suffix == ".json":
        vocab = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(vocab, dict):
            msg = f"gene vocabulary {path} must be a JSON object {{gene id: token}}"
            raise OmicsIOError(msg)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in vocab.values()):
            msg = f"gene vocabulary {path} must map each gene id to an integer token"
            raise OmicsIOError(msg)
        return [
            strip_version(k)
            for k, _ in sorted(vocab.items(), key=lambda kv: kv[1])
            if ENSEMBL_GENE_ID.fullmatch(k)
        ]
    if suffix in (".parquet", ".csv", ".tsv"):
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path)
        else:
            import pyarrow.csv as pacsv

            table = pacsv.read_csv(
                path, parse_options=pacsv.ParseOptions(delimiter="\t" if suffix == ".tsv" else ",")
            )
        keys = gene_keys(table, f"gene table {path}", source=False)
        return [k for k in keys.ids.to_pylist() if k]
    return [
        strip_version(line.strip()) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()
    ]

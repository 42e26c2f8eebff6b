"""One gene space for a collection: every source's genes matched by Ensembl id, and each source's rows
moved into it.

A source's gene ids are found in its gene table (`gene_keys`): the column it is told to use, else
the first of ``ensembl_id``, ``gene_ids``, ``gene_id``, ``feature_id`` (or any other string column)
holding Ensembl ids (``ENSG…``, ``ENSMUSG…``), version suffixes (``ENSG….12``) stripped; a source
with none is matched by gene symbol (``feature_name``, ``gene_symbol``, ``gene_name``), through the
symbols the other sources give their Ensembl ids, and flagged in the report. `GeneSpace.build`
unifies the sources' genes: the union in order of first appearance (the first source's genes keep
their order), the genes every source measured, or a given gene table / vocabulary; two genes of one
source with the same id are summed. `MemberMap.remap` moves a batch of a source's rows into the
unified columns, sorted within each row, in one numba pass.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numba as nb
import numpy as np
import pyarrow as pa

from omicsio_jax import DataValidationError, OmicsIOError

ID_COLUMNS = ("ensembl_id", "gene_ids", "gene_id", "feature_id")
SYMBOL_COLUMNS = ("feature_name", "gene_symbol", "gene_symbols", "symbol", "gene_name")
UNION, INTERSECTION = "union", "intersection"
_ENSEMBL = re.compile(r"^ENS[A-Z]*G\d{6,}(\.\d+)?$")
_UNKNOWN, _DROPPED = -1, -2  # `MemberMap.lut` codes of tokens that are no gene / not kept


def _strings(table: pa.Table, name: str) -> list[str | None]:
    column = table.column(name)
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    return [None if v is None else str(v) for v in column.to_pylist()]


def _ensembl_share(values: list[str | None]) -> float:
    present = [v for v in values if v]
    return sum(bool(_ENSEMBL.match(v)) for v in present) / len(present) if present else 0.0


def strip_version(gene_id: str) -> str:
    """``ENSG00000141510.17`` → ``ENSG00000141510``; other ids unchanged."""
    return gene_id.split(".", 1)[0] if _ENSEMBL.match(gene_id) else gene_id


@dataclasses.dataclass(frozen=True)
class GeneKeys:
    """A source's genes in gene-table order: ``ids`` (Ensembl ids without version, or symbols when
    ``by == "symbol"``; None: no id), ``symbols`` (None where unknown) and the column read."""

    ids: list[str | None]
    symbols: list[str | None]
    by: str
    column: str


def gene_keys(genes: pa.Table, label: str, id_column: str | None = None) -> GeneKeys:
    """How a source's genes are matched (see the module docstring); a one-line error naming the source,
    its columns and the fix when it has no gene id."""
    names = [n for n in genes.column_names if n != "gene_token_id"]
    texts = {n: _strings(genes, n) for n in names if _is_text(genes.schema.field(n).type)}
    symbols_of = next(
        (texts[n] for n in SYMBOL_COLUMNS if n in texts and _ensembl_share(texts[n]) < 0.5),
        [None] * genes.num_rows,
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
        return GeneKeys([None if v is None else strip_version(v) for v in ids], symbols_of, by, id_column)
    candidates = [n for n in ID_COLUMNS if n in texts] + [n for n in texts if n not in ID_COLUMNS]
    for name in candidates:
        if _ensembl_share(texts[name]) >= 0.5:
            ids = [None if v is None else strip_version(v) for v in texts[name]]
            return GeneKeys(ids, symbols_of, "ensembl", name)
    for name in SYMBOL_COLUMNS:
        if name in texts and any(texts[name]):
            return GeneKeys(texts[name], texts[name], "symbol", name)
    msg = (
        f"{label} has no gene id column: none of {', '.join(ID_COLUMNS)} holds Ensembl ids (ENSG…) and "
        f"no symbol column ({', '.join(SYMBOL_COLUMNS)}) is there (it has {', '.join(names) or 'none'}); "
        "name the column with --gene-id-column (gene_id_column=...)"
    )
    raise DataValidationError(msg)


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
    try:
        if suffix == ".json":
            vocab = json.loads(path.read_text())
            if not isinstance(vocab, dict):
                msg = f"gene vocabulary {path} must be a JSON object {{gene id: token}}"
                raise OmicsIOError(msg)
            return [
                strip_version(k) for k, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if _ENSEMBL.match(k)
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
            keys = gene_keys(table, f"gene table {path}")
            return [k for k in keys.ids if k]
        return [strip_version(line.strip()) for line in path.read_text().splitlines() if line.strip()]
    except OSError as e:
        msg = f"cannot read the gene list {path}: {e}"
        raise OmicsIOError(msg) from e


@dataclasses.dataclass(frozen=True)
class MemberMap:
    """How one source's gene tokens become unified columns.

    ``lut[token]`` is the token's rank among the source's kept genes ordered by (column, token), or
    -1 (no gene of the source) / -2 (not kept: outside an intersection or a given gene list);
    ``rank_col[rank]`` its column. ``ordered``: kept genes' columns rise with their tokens and no two
    share one, so a sorted row stays sorted and rows are mapped without sorting.
    """

    lut: np.ndarray
    rank_col: np.ndarray
    ordered: bool
    num_columns: int

    @property
    def measured(self) -> np.ndarray:
        """Bool over the unified columns: the genes this source measured."""
        out = np.zeros(self.num_columns, bool)
        out[self.rank_col] = True
        return out

    def remap(self, indptr: np.ndarray, tokens: np.ndarray, values: np.ndarray, locate) -> tuple:
        """A batch's rows in unified columns, sorted within rows, duplicates summed; a token that is no
        gene of the source is a `DataValidationError` naming the row."""
        out_values = np.empty(len(tokens), np.float32 if values.dtype == np.float32 else np.float64)
        out_ptr = np.empty_like(indptr, dtype=np.int64)
        out_cols = np.empty(len(tokens), np.int64)
        bad = _remap(
            np.asarray(indptr, np.int64),
            np.asarray(tokens),
            values,
            self.lut,
            self.rank_col,
            self.ordered,
            out_ptr,
            out_cols,
            out_values,
        )
        if bad >= 0:
            row = int(np.searchsorted(indptr, bad, side="right") - 1)
            token = int(tokens[bad])
            known = 0 <= token < len(self.lut) and self.lut[token] != _UNKNOWN
            what = "appears twice" if known else "is not in its gene table"
            msg = f"gene_token_id {token} in {locate(row)} {what}"
            raise DataValidationError(msg)
        n = int(out_ptr[-1])
        return out_ptr, out_cols[:n], out_values[:n]


@nb.njit(cache=True, nogil=True)
def _remap(indptr, tokens, values, lut, rank_col, ordered, out_ptr, out_cols, out_values):  # pragma: no cover
    """Rows into unified columns; returns -1, or the position of the first unknown or repeated token."""
    num_ranks = len(rank_col)
    slot = np.zeros(num_ranks, np.float64)
    seen = np.zeros((num_ranks + 7) // 8 * 8, np.uint8)
    words = seen.view(np.uint64)
    out_ptr[0] = 0
    k = 0
    for r in range(len(indptr) - 1):
        lo_rank, hi_rank = num_ranks, -1
        for j in range(indptr[r], indptr[r + 1]):
            t = tokens[j]
            if t < 0 or t >= len(lut) or lut[t] == _UNKNOWN:
                return j
            rank = lut[t]
            if rank == _DROPPED:
                continue
            if ordered:
                out_cols[k] = rank_col[rank]
                out_values[k] = values[j]
                k += 1
                continue
            if seen[rank]:
                return j
            seen[rank] = 1
            slot[rank] = values[j]
            lo_rank = min(lo_rank, rank)
            hi_rank = max(hi_rank, rank)
        if not ordered and hi_rank >= 0:
            for w in range(lo_rank // 8, hi_rank // 8 + 1):
                if words[w] == 0:
                    continue
                for rank in range(w * 8, w * 8 + 8):
                    if seen[rank]:
                        seen[rank] = 0
                        col = rank_col[rank]
                        if k > out_ptr[r] and out_cols[k - 1] == col:  # two genes of one id: summed
                            out_values[k - 1] += slot[rank]
                        else:
                            out_cols[k] = col
                            out_values[k] = slot[rank]
                            k += 1
        out_ptr[r + 1] = k
    return -1


def member_map(tokens: np.ndarray, cols: np.ndarray, num_columns: int) -> MemberMap:
    """The map of a source whose gene ``tokens`` (ascending) go to unified ``cols`` (-1: not kept)."""
    tokens = np.asarray(tokens, np.int64)
    cols = np.asarray(cols, np.int64)
    lut = np.full(int(tokens.max()) + 1 if len(tokens) else 0, _UNKNOWN, np.int32)
    kept = cols >= 0
    order = np.lexsort((tokens[kept], cols[kept]))
    ranks = np.empty(int(kept.sum()), np.int32)
    ranks[order] = np.arange(len(order), dtype=np.int32)
    lut[tokens] = _DROPPED
    lut[tokens[kept]] = ranks
    rank_col = cols[kept][order].astype(np.int32)
    ordered = bool(np.all(np.diff(cols[kept]) > 0))
    return MemberMap(lut, rank_col, ordered, num_columns)


@dataclasses.dataclass(frozen=True)
class GeneSpace:
    """The collection's genes (``genes``: ``gene_token_id`` = column, ``ensembl_id``, ``gene_name``),
    each source's `MemberMap`, what was matched how (``members``, for the manifest) and the notes to
    report (``notes``: symbol-matched sources, summed duplicates, conflicting symbols)."""

    genes: pa.Table
    maps: tuple[MemberMap, ...]
    members: tuple[dict, ...]
    notes: tuple[str, ...]

    @classmethod
    def build(
        cls,
        tables: list[pa.Table],
        labels: list[str],
        *,
        genes: str | Path = UNION,
        id_column: str | None = None,
    ) -> GeneSpace:
        """Unify the gene tables of the sources ``labels`` (``genes``: ``"union"``, ``"intersection"``
        or the path of a gene table / vocabulary fixing the genes and their order)."""
        keys = [gene_keys(t, label, id_column) for t, label in zip(tables, labels, strict=True)]
        notes: list[str] = []
        symbol_of: dict[str, str] = {}  # Ensembl id → its first symbol
        id_of: dict[str, str] = {}  # symbol → its first Ensembl id
        conflicts = []
        for k, label in zip(keys, labels, strict=True):
            if k.by == "symbol":
                continue
            for gene_id, symbol in zip(k.ids, k.symbols, strict=True):
                if gene_id is None or symbol is None:
                    continue
                first = symbol_of.setdefault(gene_id, symbol)
                if first != symbol:
                    conflicts.append(f"{gene_id} is {first} before, {symbol} in {label}")
                id_of.setdefault(symbol, gene_id)
        if conflicts:
            notes.append(
                f"{len(conflicts):,} Ensembl id(s) carry different symbols in different sources (matched by "
                f"id, first symbol kept), e.g. {conflicts[0]}"
            )
        resolved = []
        for k, label in zip(keys, labels, strict=True):
            if k.by != "symbol":
                resolved.append(k.ids)
                continue
            ids = [None if s is None else id_of.get(s, f"symbol:{s}") for s in k.symbols]
            matched = sum(1 for i in ids if i is not None and not i.startswith("symbol:"))
            notes.append(
                f"{label} has no Ensembl ids: its {len(ids):,} genes were matched by symbol ({k.column}), "
                f"{matched:,} to another source's Ensembl id"
            )
            resolved.append(ids)
        order = _unified_order(resolved, genes)
        column = {key: c for c, key in enumerate(order)}
        maps, members = [], []
        for t, k, ids, label in zip(tables, keys, resolved, labels, strict=True):
            cols = np.array([-1 if i is None else column.get(i, -1) for i in ids], np.int64)
            present = [i for i in ids if i is not None]
            duplicates = len(present) - len(set(present))
            if duplicates:
                notes.append(f"{label}: {duplicates:,} gene(s) share an id with another of its genes: summed")
            tokens = t.column("gene_token_id").to_numpy()
            maps.append(member_map(tokens, cols, len(order)))
            members.append(
                {
                    "genes": len(ids),
                    "measured": len(np.unique(maps[-1].rank_col)),
                    "matched_by": k.by,
                    "gene_id_column": k.column,
                    "duplicates_summed": duplicates,
                }
            )
        ensembl = [None if key.startswith("symbol:") else key for key in order]
        names = [key[len("symbol:") :] if key.startswith("symbol:") else symbol_of.get(key) for key in order]
        table = pa.table(
            {
                "gene_token_id": pa.array(np.arange(len(order), dtype=np.int64)),
                "ensembl_id": pa.array(ensembl, pa.string()),
                "gene_name": pa.array(names, pa.string()),
            }
        )
        return cls(table, tuple(maps), tuple(members), tuple(notes))


def _unified_order(resolved: list[list[str | None]], genes: str | Path) -> list[str]:
    if genes == UNION:
        seen: dict[str, None] = {}
        for ids in resolved:
            seen.update((i, None) for i in ids if i is not None and i not in seen)
        return list(seen)
    if genes == INTERSECTION:
        common = set.intersection(*({i for i in ids if i is not None} for ids in resolved))
        first = dict.fromkeys(i for i in resolved[0] if i in common)
        if not first:
            msg = "the sources have no gene in common: --genes intersection would leave no column"
            raise DataValidationError(msg)
        return list(first)
    return list(dict.fromkeys(read_gene_list(genes)))

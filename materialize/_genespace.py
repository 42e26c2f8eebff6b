"""One gene space for a collection: every source's genes matched by Ensembl id, and each source's rows
moved into it.

A source's gene ids are found in its gene table (`gene_keys`): the column it is told to use, else
the first of ``ensembl_id``, ``gene_ids``, ``gene_id``, ``feature_id`` (or any other string column)
holding Ensembl ids (``ENSG…``, ``ENSMUSG…``), version suffixes (``ENSG….12``) stripped; a source
with none is matched by gene symbol (``feature_name``, ``gene_symbol``, ``gene_name``), through the
symbols the other sources give their Ensembl ids, and flagged in the report. `GeneSpace.build`
unifies the sources' genes: the union (`union_order`: in an order that keeps each source's own
wherever the sources agree, so sources listing their genes in one common order move into it by
copies alone), the genes every source measured, or a given gene table / vocabulary; two genes of
one source with the same id are summed. `MemberMap.remap` moves a batch of a source's rows into the
unified columns, sorted within each row, in one numba pass; a source whose genes keep their order
among the unified ones (`MemberMap.in_order`) needs no move: its tokens go to the encoder with the
map from tokens to columns, as a single input's do.

A gene without an id (null or empty: spike-ins, transgenes) is keyed by its symbol (``symbol:GFP``),
a gene of its own without an Ensembl id, as a symbol-only source's unmatched genes are; one without
a symbol either is dropped. Both are reported; no two genes are ever one because they share "".
"""

from __future__ import annotations

import dataclasses
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numba as nb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from omicsio_jax import DataValidationError, OmicsIOError
from omicsio_jax.format import RowBuffers, from_numpy, one_array, text_array, to_numpy, to_numpy_filled

ID_COLUMNS = ("ensembl_id", "gene_ids", "gene_id", "feature_id")
SYMBOL_COLUMNS = ("feature_name", "gene_symbol", "gene_symbols", "symbol", "gene_name")
UNION, INTERSECTION = "union", "intersection"
_ENSEMBL = re.compile(r"^ENS[A-Z]*G\d{6,}(\.\d+)?$")
_ENSEMBL_RE2 = r"^ENS[A-Z]*G[0-9]{6,}(\.[0-9]+)?$"  # the same, for Arrow's RE2
_KEY_THREADS = 8  # sources whose gene keys are found at once (`GeneSpace.build`)
_UNKNOWN, _DROPPED = -1, -2  # `MemberMap.col_of` codes of tokens that are no gene / not kept
_BY_SYMBOL = "symbol:"  # the key of a gene without an Ensembl id: its symbol after this (`_symbol_keys`)


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
    return pc.sum(pc.match_substring_regex(present, _ENSEMBL_RE2)).as_py() / len(present)


def ensembl_like(values: pa.Array) -> bool:
    """Whether most non-empty values of a text array are Ensembl ids (``ENSG…``, ``ENSMUSG…``)."""
    return _ensembl_share(values) >= 0.5


def _stripped(values: pa.Array) -> pa.Array:
    """Ensembl ids without their version suffix (``ENSG….12`` → ``ENSG…``); other values unchanged.
    Values without a "." anywhere (most gene tables) are returned after one scan of their bytes:
    Arrow's ``match_substring`` took ~45 ns a value (2 ms a source of 40k genes, the largest share of
    a collection's serial setup)."""
    data = values.buffers()[2]  # the characters of a string array (and maybe more: then just slower)
    if data is None or not np.any(np.frombuffer(data, np.uint8) == ord(".")):
        return values
    versioned = pc.and_(pc.starts_with(values, "ENS"), pc.match_substring(values, "."))
    if not pc.any(versioned).as_py():
        return values
    head = pc.replace_substring_regex(values, r"(?s)\..*", "", max_replacements=1)  # up to the first "."
    return pc.if_else(versioned, head, values)


def strip_version(gene_id: str) -> str:
    """``ENSG00000141510.17`` → ``ENSG00000141510``; other ids unchanged."""
    return gene_id.split(".", 1)[0] if _ENSEMBL.match(gene_id) else gene_id


@dataclasses.dataclass(frozen=True)
class GeneKeys:
    """A source's genes in gene-table order: ``ids`` (Ensembl ids without version, or symbols when
    ``by == "symbol"``; null: no id, empty ids made null), ``symbols`` (null where unknown or empty)
    and the column read."""

    ids: pa.Array
    symbols: pa.Array
    by: str
    column: str


def gene_keys(genes: pa.Table, label: str, id_column: str | None = None) -> GeneKeys:
    """How a source's genes are matched (see the module docstring); a one-line error naming the source,
    its columns and the fix when it has no gene id."""
    names = [n for n in genes.column_names if n != "gene_token_id"]
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
    for name in SYMBOL_COLUMNS:
        if name in texts and pc.max(pc.binary_length(texts[name])).as_py():
            return GeneKeys(_present(texts[name]), _present(texts[name]), "symbol", name)
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
    if not path.is_file():
        msg = (
            f"gene list {path} not found: --genes (genes=) takes union, intersection, or a gene table / "
            "vocabulary (.parquet, .csv, .tsv, .json, or a text file of one id per line)"
        )
        raise OmicsIOError(msg)
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
            return [k for k in keys.ids.to_pylist() if k]
        return [strip_version(line.strip()) for line in path.read_text().splitlines() if line.strip()]
    except OSError as e:
        msg = f"cannot read the gene list {path}: {e}"
        raise OmicsIOError(msg) from e


@dataclasses.dataclass(frozen=True)
class MemberMap:
    """How one source's gene tokens become unified columns: ``col_of[token]`` is the token's column, or
    -1 (no gene of the source) / -2 (not kept: outside an intersection or a given gene list)."""

    col_of: np.ndarray
    num_columns: int
    in_order: bool = False  # every gene kept, in rising columns: rows stay sorted as they are mapped

    @property
    def measured(self) -> np.ndarray:
        """Bool over the unified columns: the genes this source measured."""
        out = np.zeros(self.num_columns, bool)
        out[self.col_of[self.col_of >= 0]] = True
        return out

    def remap(self, indptr: np.ndarray, tokens: np.ndarray, values: np.ndarray, locate) -> tuple:
        """A batch's rows in unified columns, sorted within rows, genes of one id summed; a token that
        is no gene of the source, or that does not follow the one before it, is a
        `DataValidationError` naming the row."""
        out_values = _OUTPUTS.array(len(tokens), np.float32 if values.dtype == np.float32 else np.float64)
        out_ptr = np.empty(len(indptr), np.int64)
        out_cols = _OUTPUTS.array(len(tokens), np.int32)
        bad = _remap(
            np.asarray(indptr, np.int64),
            np.asarray(tokens),
            values,
            self.col_of,
            out_ptr,
            out_cols,
            out_values,
        )
        if bad >= 0:
            row = int(np.searchsorted(indptr, bad, side="right") - 1)
            token = int(tokens[bad])
            if 0 <= token < len(self.col_of) and self.col_of[token] != _UNKNOWN:
                msg = f"gene_token_id not sorted in {locate(row)}: {token} after {int(tokens[bad - 1])}"
            else:
                msg = f"gene_token_id {token} in {locate(row)} is not in its gene table"
            raise DataValidationError(msg)
        n = int(out_ptr[-1])
        return out_ptr, out_cols[:n], out_values[:n]


_BUCKETS_PER_COLUMN = 4  # `_sort_row`'s buckets per column of a row
_RADIX_FROM = 2  # rows of at least this many times `_radix_row`'s buckets per digit go to it


# A batch's remapped columns and values (`RowBuffers.array`), in memory used again once nothing
# refers to it: up to 4 batches are alive at once (2 queued behind the reader, the one it makes, the
# one being encoded). A source's batch of 6M nonzeros takes 48 MB. In Arrow's pool, which held them
# before, the workers faulted in fresh pages for them, each zeroed by the kernel (50 sources of 6,000
# cells materialized with 2 workers, 5 alternating runs on a 2-core AMD EPYC: the workers' system time
# 2.9-3.8 s here, 3.2-6.5 s there).
_OUTPUTS = RowBuffers(keep=8)


@nb.njit(cache=True, nogil=True)
def _remap(indptr, tokens, values, col_of, out_ptr, out_cols, out_values):  # pragma: no cover
    """Rows into unified columns, written straight to the output; a row whose columns do not rise is
    sorted there (`_radix_row` if it is long, else `_sort_row`) and genes of one column summed.
    Returns -1, or the position of the first token that is unknown or not above the one before it.

    A row is moved by plain loops (a gather of its columns, a copy of its values) and checked after,
    by loops without branches; only a row that fails a check (a token out of order or unknown, or a
    gene not kept) is moved again token by token, to skip what is not kept or to find the bad token."""
    longest = 0
    for r in range(len(indptr) - 1):
        longest = max(longest, indptr[r + 1] - indptr[r])
    bits = 1  # `_radix_row`'s digit: half the bits of the highest column, rounded up
    while (np.int64(1) << (2 * bits)) <= max(np.int64(col_of.max()) if len(col_of) else 0, 1):
        bits += 1
    cols_b, vals_b = np.empty(longest, np.int32), np.empty(longest, out_values.dtype)
    hist = np.empty(max(_BUCKETS_PER_COLUMN * longest, 2 << bits, 1), np.int32)
    n = len(col_of)
    out_ptr[0] = 0
    k = 0
    for r in range(len(indptr) - 1):
        lo, hi = indptr[r], indptr[r + 1]
        m = hi - lo
        t, v = tokens[lo:hi], values[lo:hi]
        oc, ov = out_cols[k : k + m], out_values[k : k + m]  # k + m <= hi: the row fits in the output
        for j in range(m):
            oc[j] = col_of[min(max(t[j], 0), n - 1)]
        for j in range(m):
            ov[j] = v[j]
        bad = m > 0 and (t[0] < 0 or t[m - 1] >= n)
        for j in range(1, m):
            bad |= t[j] <= t[j - 1]
        low, top, falls = 0, 0, False
        for j in range(m):
            low, top = min(low, oc[j]), max(top, oc[j])
        for j in range(1, m):
            falls |= oc[j] <= oc[j - 1]
        if bad or low < 0:  # token by token: the bad token's place, or the genes not kept skipped
            m, last_col, last_token, falls = 0, -1, -1, False
            for j in range(lo, hi):
                tj = tokens[j]
                if tj < 0 or tj >= n or col_of[tj] == _UNKNOWN or tj <= last_token:
                    return j
                last_token = tj
                c = col_of[tj]
                if c == _DROPPED:
                    continue
                falls |= c <= last_col
                last_col, top = c, max(top, c)
                out_cols[k + m], out_values[k + m] = c, values[j]
                m += 1
        if falls and m >= _RADIX_FROM << bits:
            m = _radix_row(out_cols[k : k + m], out_values[k : k + m], bits, cols_b, vals_b, hist)
        elif falls:
            m = _sort_row(out_cols[k : k + m], out_values[k : k + m], top, cols_b, vals_b, hist)
        k += m
        out_ptr[r + 1] = k
    return -1


@nb.njit(cache=True, nogil=True, inline="always")
def _sort_row(cols, values, top, cols_b, vals_b, hist):  # pragma: no cover
    """``cols`` (in ``[0, top]``) sorted in place with their ``values``, those of one column summed in
    the order given; returns how many are left. A counting sort by the columns' high bits into about
    `_BUCKETS_PER_COLUMN` buckets per column (bucket ``c >> shift``), then an insertion sort, which
    finds each bucket's few columns already in place or nearly. Stable, so the sums are those of the
    order given. Indices are unsigned (numba tests a signed index for wrapping around from the end).

    Measured on a source of 1,000 nonzeros per row over 62,710 columns (2-core AMD EPYC): 6.2 ns per
    nonzero with as many buckets as columns and signed indices, 5.5 unsigned, 4.3 with 4 buckets per
    column (fewer columns share a bucket, so fewer are out of place; 8 per column: 4.9, the prefix
    sum over the buckets costing more than the insertions saved)."""
    m = len(cols)
    shift = np.uint32(0)
    while (top >> shift) >= max(_BUCKETS_PER_COLUMN * m, 1):
        shift += np.uint32(1)
    buckets = (top >> shift) + 1
    h = hist[:buckets]
    h[:] = 0
    for i in range(m):
        h[np.uint32(cols[i]) >> shift] += 1
    total = 0
    for d in range(buckets):
        count = h[d]
        h[d] = total
        total += count
    for i in range(m):
        c = cols[i]
        d = np.uint32(c) >> shift
        at = np.uint32(h[d])
        h[d] = at + 1
        cols_b[at], vals_b[at] = c, values[i]
    for i in range(1, m):
        c = cols_b[i]
        if c < cols_b[i - 1]:
            x, j = vals_b[i], i - 1
            while j >= 0 and cols_b[j] > c:
                cols_b[j + 1], vals_b[j + 1] = cols_b[j], vals_b[j]
                j -= 1
            cols_b[j + 1], vals_b[j + 1] = c, x
    return _summed(cols_b[:m], vals_b[:m], cols, values)


@nb.njit(cache=True, nogil=True, inline="always")
def _radix_row(cols, values, bits, cols_b, vals_b, hist):  # pragma: no cover
    """`_sort_row` for a long row: two counting passes, by the low ``bits`` of the columns and then by
    the rest (``2 * bits`` in all cover every column), both counted in one pass first; stable, so
    the genes of one column are summed in the order given, and sorted in place.

    Measured on rows of random columns (2-core AMD EPYC, ns per nonzero, `_sort_row` against this):
    62,710 columns (8-bit digits), 5.9 / 4.8 at 512 genes a row, 6.6 / 4.5 at 1,000, 9.3 / 9.6 at
    128; 70,000 columns (9-bit digits), 8.4 / 7.8 at 1,000, 8.3 / 6.5 at 3,000. So rows of at least
    `_RADIX_FROM` times a digit's buckets come here."""
    m = len(cols)
    size = np.uint32(1) << np.uint32(bits)
    low, shift = size - np.uint32(1), np.uint32(bits)
    hist[: 2 * size] = 0
    for i in range(m):
        c = np.uint32(cols[i])
        hist[c & low] += 1
        hist[size + (c >> shift)] += 1
    below_low, below_high = 0, 0
    for d in range(size):
        count_low, count_high = hist[d], hist[size + d]
        hist[d], hist[size + d] = below_low, below_high
        below_low += count_low
        below_high += count_high
    for i in range(m):
        c = np.uint32(cols[i])
        at = np.uint32(hist[c & low])
        hist[c & low] = at + 1
        cols_b[at], vals_b[at] = c, values[i]
    for i in range(m):
        c = np.uint32(cols_b[i])
        d = size + (c >> shift)
        at = np.uint32(hist[d])
        hist[d] = at + 1
        cols[at], values[at] = c, vals_b[i]
    return _summed(cols, values, cols, values)


@nb.njit(cache=True, nogil=True, inline="always")
def _summed(sorted_cols, sorted_values, cols, values):  # pragma: no cover
    """``sorted_cols`` and their values written to ``cols`` / ``values`` (the same arrays, or others),
    those of one column summed in the order given; returns how many are left."""
    w = 0
    for i in range(len(sorted_cols)):
        if w > 0 and cols[w - 1] == sorted_cols[i]:  # two genes of one id: summed
            values[w - 1] += sorted_values[i]
        else:
            cols[w], values[w] = sorted_cols[i], sorted_values[i]
            w += 1
    return w


def member_map(tokens: np.ndarray, cols: np.ndarray, num_columns: int) -> MemberMap:
    """The map of a source whose gene ``tokens`` go to unified ``cols`` (-1: not kept)."""
    tokens = np.asarray(tokens, np.int64)
    col_of = np.full(int(tokens.max()) + 1 if len(tokens) else 0, _UNKNOWN, np.int32)
    col_of[tokens] = np.where(np.asarray(cols) >= 0, cols, _DROPPED)
    known = col_of[col_of != _UNKNOWN]  # in token order
    in_order = bool(np.all(known >= 0) and np.all(np.diff(known) > 0))
    return MemberMap(col_of, num_columns, in_order)


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
        # each source's keys on a few threads (Arrow's kernels release the GIL); the first failing
        # source, in the sources' order, raises
        with ThreadPoolExecutor(min(len(tables), _KEY_THREADS) or 1) as pool:
            keys = list(pool.map(lambda t, label: gene_keys(t, label, id_column), tables, labels))
        notes: list[str] = []
        # the id sources that give symbols (pairs with a null id or symbol are dropped anyway)
        named = [k for k in keys if k.by != "symbol" and k.symbols.null_count < len(k.symbols)]
        pairs = pa.table(
            {
                "id": pa.concat_arrays([k.ids for k in named] or [pa.nulls(0, pa.string())]),
                "symbol": pa.concat_arrays([k.symbols for k in named] or [pa.nulls(0, pa.string())]),
            }
        ).drop_null()
        symbol_only = any(k.by == "symbol" for k in keys)
        without_id = any(k.by != "symbol" and k.ids.null_count for k in keys)
        with ThreadPoolExecutor(3) as pool:
            # each Ensembl id's first symbol, in the order the sources give them, and (unless
            # sources matched by symbol, or genes without an id, need these first) the ids' codes:
            # three dictionary encodings of every gene listed (~60 ns each) on threads at once
            # (Arrow releases the GIL)
            coded = (
                None if symbol_only or without_id else pool.submit(first_seen_codes, [k.ids for k in keys])
            )
            named_ids, first_symbols, mixed = _first_of(pairs.column("id"), pairs.column("symbol"), pool)
            seen_and_codes = None if coded is None else coded.result()
        conflicts = np.flatnonzero(mixed)
        if len(conflicts):
            gene_id, first = named_ids[int(conflicts[0])].as_py(), first_symbols[int(conflicts[0])].as_py()
            where, other = next(
                (label, symbol)
                for k, label in zip(keys, labels, strict=True)
                if k.by != "symbol"
                for i, symbol in zip(k.ids.to_pylist(), k.symbols.to_pylist(), strict=True)
                if i == gene_id and symbol not in (None, first)
            )
            notes.append(
                f"{len(conflicts):,} Ensembl id(s) carry different symbols in different sources (matched "
                f"by id, first symbol kept), e.g. {gene_id} is {first} before, {other} in {where}"
            )
        resolved = []
        if symbol_only:  # each symbol's first Ensembl id, for the symbol-only sources
            named_symbols, first_ids, _ = _first_of(pairs.column("symbol"), pairs.column("id"))
        for k, label in zip(keys, labels, strict=True):
            if k.by != "symbol":
                resolved.append(k.ids if not k.ids.null_count else _by_symbol_where_null(k, label, notes))
                continue
            found = pc.take(first_ids, pc.index_in(k.symbols, value_set=named_symbols))
            ids = pc.if_else(pc.is_valid(found), found, _symbol_keys(k.symbols))
            notes.append(
                f"{label} has no Ensembl ids: its {len(ids):,} genes were matched by symbol ({k.column}), "
                f"{pc.sum(pc.is_valid(found)).as_py() or 0:,} to another source's Ensembl id"
            )
            if ids.null_count:
                notes.append(
                    f"{label}: {ids.null_count:,} gene(s) without a symbol in {k.column}, which it is "
                    "matched by: dropped (give every gene a symbol, or ids with --gene-id-column)"
                )
            resolved.append(ids)
        seen, code = first_seen_codes(resolved) if seen_and_codes is None else seen_and_codes
        ends = np.cumsum([len(ids) for ids in resolved])
        if genes == UNION:
            by_id = np.empty(len(seen), np.int64)  # each gene's place among the ids sorted
            by_id[to_numpy(pc.sort_indices(seen))] = np.arange(len(seen))
            union = union_order(
                [code[end - len(ids) : end] for ids, end in zip(resolved, ends, strict=True)], key=by_id
            )
            order = seen.take(from_numpy(union))
            col_of_seen = np.empty(len(seen), np.int64)
            col_of_seen[union] = np.arange(len(union))
        else:
            order = _unified_order(resolved, genes)
            col_of_seen = to_numpy_filled(pc.index_in(seen, value_set=order), -1).astype(np.int64)
        maps, members = [], []
        for t, k, ids, label, end in zip(tables, keys, resolved, labels, ends, strict=True):
            own = code[end - len(ids) : end]
            known = own >= 0
            hit = own[known]
            cols = np.full(len(own), -1, np.int64)
            cols[known] = col_of_seen[hit]
            distinct = np.zeros(len(seen), bool)
            distinct[hit] = True
            duplicates = len(hit) - int(np.count_nonzero(distinct))
            if duplicates:
                notes.append(f"{label}: {duplicates:,} gene(s) share an id with another of its genes: summed")
            maps.append(member_map(to_numpy(t.column("gene_token_id")), cols, len(order)))
            members.append(
                {
                    "genes": len(ids),
                    "measured": int(maps[-1].measured.sum()),
                    "matched_by": k.by,
                    "gene_id_column": k.column,
                    "duplicates_summed": duplicates,
                }
            )
        by_symbol = pc.starts_with(order, _BY_SYMBOL)
        symbols = pc.take(first_symbols, pc.index_in(order, value_set=named_ids))
        table = pa.table(
            {
                "gene_token_id": from_numpy(np.arange(len(order), dtype=np.int64)),
                "ensembl_id": pc.if_else(by_symbol, pa.nulls(len(order), pa.string()), order),
                "gene_name": pc.if_else(by_symbol, pc.utf8_slice_codeunits(order, len(_BY_SYMBOL)), symbols),
            }
        )
        return cls(table, tuple(maps), tuple(members), tuple(notes))


def _symbol_keys(symbols: pa.Array) -> pa.Array:
    """The keys of genes known by their symbol alone (``symbol:GFP``; null where the symbol is)."""
    return pc.utf8_replace_slice(symbols, 0, 0, _BY_SYMBOL)


def _by_symbol_where_null(keys: GeneKeys, label: str, notes: list[str]) -> pa.Array:
    """A source's ids where its genes without one (null or empty: spike-ins, transgenes) are keyed by
    their symbol (``symbol:GFP``, a gene of its own without an Ensembl id, as a symbol-only source's
    unmatched genes are; not matched to another source's Ensembl id through its symbol), the genes
    left without either null (not kept); both said in ``notes``."""
    ids = pc.if_else(pc.is_valid(keys.ids), keys.ids, _symbol_keys(keys.symbols))
    by_symbol = keys.ids.null_count - ids.null_count
    if by_symbol:
        named = pc.filter(keys.symbols, pc.is_null(keys.ids)).drop_null()
        shown = ", ".join(named.slice(0, 3).to_pylist()) + (", ..." if len(named) > 3 else "")
        notes.append(
            f"{label}: {by_symbol:,} gene(s) without an id in {keys.column} ({shown}) kept under their "
            "symbol, as genes without an Ensembl id"
        )
    if ids.null_count:
        notes.append(
            f"{label}: {ids.null_count:,} gene(s) with neither an id in {keys.column} nor a symbol: "
            "dropped (give them an id or a symbol in its gene table)"
        )
    return ids


def first_seen_codes(arrays: list[pa.Array]) -> tuple[pa.Array, np.ndarray]:
    """The distinct values of the string ``arrays`` taken one after the other, in order of first
    appearance, and each value's code into them (int64; -1: null): one hash table for all arrays, not
    one each, and one pass over them, array by array as chunks of one column rather than copied
    into one array first (the ids of 400 sources of 20k–60k genes, 2-core AMD EPYC: 2.4 → 1.0–1.2 s,
    and 67 MB of Arrow memory at most where the copy took 370 MB)."""
    encoded = pc.dictionary_encode(pa.chunked_array(arrays, pa.string()))
    if not encoded.num_chunks:
        return pa.array([], pa.string()), np.empty(0, np.int64)
    seen = encoded.chunk(encoded.num_chunks - 1).dictionary  # Arrow gives every chunk the whole one
    if any(len(c.dictionary) != len(seen) for c in encoded.chunks):
        msg = "internal error: a chunked dictionary encode gave its chunks different dictionaries"
        raise RuntimeError(msg)
    return seen, np.concatenate([to_numpy_filled(c.indices, -1).astype(np.int64) for c in encoded.chunks])


def _first_of(
    keys: pa.ChunkedArray, values: pa.ChunkedArray, pool: ThreadPoolExecutor | None = None
) -> tuple[pa.Array, pa.Array, np.ndarray]:
    """The distinct ``keys`` (no nulls) in order of first appearance, the first of the ``values``
    paired with each, and whether each is paired with more than one value: Arrow's ``group_by``
    without its Acero engine, whose import brings pyarrow.dataset and pandas (~0.9 s on a
    collection's serial path). In passes over the pairs, without sorting them: 300 sources of
    20k–40k genes (9M pairs) took 3.0 s with `np.unique` of the pairs, 1.4 s so (2-core Intel Xeon),
    most of it now the two dictionary encodings, which run at once with a ``pool``."""
    keys, values = (map if pool is None else pool.map)(
        lambda c: pc.dictionary_encode(one_array(c)), (keys, values)
    )
    key, value = to_numpy(keys.indices).astype(np.int64), to_numpy(values.indices).astype(np.int64)
    # a dictionary's codes are given in order of first appearance, so code order is that order; each
    # key's first pair is its smallest position (`minimum.at`: defined whatever the order of updates)
    first = np.full(len(keys.dictionary), len(key), np.int64)
    np.minimum.at(first, key, np.arange(len(key)))
    first_value = value[first]
    mixed = np.zeros(len(keys.dictionary), bool)
    mixed[key[value != first_value[key]]] = True
    return keys.dictionary, values.dictionary.take(from_numpy(first_value)), mixed


def union_order(codes: list[np.ndarray], key: np.ndarray | None = None) -> np.ndarray:
    """The columns' order of the genes that the sources list as ``codes`` (one array per source, in
    its gene-table order; -1: no id): each gene once.

    A source's rows move into the union by copies alone when its genes stand in the union in the
    order it lists them; any other source's rows are sorted (`MemberMap.remap`). So the union keeps
    the order of as many sources as it can:

    - A source that lists two genes the other way round from the first source is set aside.
    - The genes of the others are put in a topological order of the genes each lists one after the
      other, the smallest ``key`` first where that leaves a choice (the ids' order; default, the
      codes'). A source that still does not keep its order (a cycle through several sources) is set
      aside and the order made again, at most twice.
    - The genes only the sources set aside list come last, in order of first appearance.

    The first source always keeps its order; sources that list subsets of one common order all keep
    it. Time: the genes listed, times the log of the genes, a few times. Where every source kept
    lists its genes in ``key`` order (ids sorted, as most files list them), that order is the
    topological one and is taken without the ordering kernel (a collection's setup then starts no
    numba on its serial path).
    """
    flat = np.concatenate([np.asarray(c, np.int64) for c in codes] + [np.empty(0, np.int64)])
    offsets = np.concatenate([[0], np.cumsum([len(c) for c in codes])]).astype(np.int64)
    num_genes = int(flat.max()) + 1 if len(flat) else 0
    flat, offsets = _first_listed(flat, offsets, num_genes)
    key = np.arange(num_genes, dtype=np.int64) if key is None else np.asarray(key, np.int64)
    first_source = flat[: offsets[1]] if len(offsets) > 1 else flat[:0]
    taken = _rise_at(flat, offsets, _places(first_source, num_genes))  # agree with the first source
    in_key_order = _rise_at(flat, offsets, key)
    by_key = np.argsort(key, kind="stable")
    for attempt in range(3):
        if np.all(in_key_order[taken]):  # each one's genes follow each other in key order: key order
            member = np.zeros(len(key), bool)
            member[flat[np.repeat(taken, np.diff(offsets))]] = True
            union = by_key[member[by_key]]
        else:
            union = _topological(flat, offsets, taken, key, by_key, num_genes)
        at = _places(union, num_genes)
        keeps = _rise_at(flat, offsets, at)
        if attempt == 2 or not np.any(taken & ~keeps):
            break
        taken &= keeps
    rest = flat[at[flat] < 0]  # the genes only the sources set aside list
    return np.concatenate([union, rest[np.sort(np.unique(rest, return_index=True)[1])]])  # first appearance


def _first_listed(flat: np.ndarray, offsets: np.ndarray, num_genes: int) -> tuple[np.ndarray, np.ndarray]:
    """Each source's codes without -1 and without a gene's second listing (it stands where first)."""
    parts = []
    for s in range(len(offsets) - 1):
        codes = flat[offsets[s] : offsets[s + 1]]
        codes = codes[codes >= 0]
        if len(codes) and np.bincount(codes, minlength=num_genes).max() > 1:
            codes = codes[np.sort(np.unique(codes, return_index=True)[1])]
        parts.append(codes)
    out_offsets = np.concatenate([[0], np.cumsum([len(c) for c in parts])]).astype(np.int64)
    return np.concatenate([*parts, np.empty(0, np.int64)]), out_offsets


def _places(order: np.ndarray, num_genes: int) -> np.ndarray:
    """Each gene's place in ``order`` (-1: not in it)."""
    at = np.full(num_genes, -1, np.int64)
    at[order] = np.arange(len(order))
    return at


def _rise_at(flat: np.ndarray, offsets: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Per source: whether its genes' places ``at`` (-1: none, skipped) rise in the order it lists them."""
    rises = np.ones(len(offsets) - 1, bool)
    for s in range(len(offsets) - 1):
        places = at[flat[offsets[s] : offsets[s + 1]]]
        places = places[places >= 0]
        rises[s] = bool(np.all(places[1:] > places[:-1]))
    return rises


@nb.njit(cache=True, nogil=True)
def _topological(flat, offsets, taken, key, by_key, num_genes):  # pragma: no cover - numba
    """The genes the ``taken`` sources list, in an order where each one's genes follow each other as
    it lists them, the smallest ``key`` first of the genes free to come next; a cycle is broken by
    letting the gene of smallest key not yet out come next (``by_key``: the genes by key)."""
    after_ptr = np.zeros(num_genes + 1, np.int64)
    indegree = np.zeros(num_genes, np.int64)
    member = np.zeros(num_genes, np.bool_)
    for s in range(len(offsets) - 1):
        if taken[s]:
            for i in range(offsets[s], offsets[s + 1]):
                member[flat[i]] = True
                if i + 1 < offsets[s + 1]:
                    after_ptr[flat[i] + 1] += 1
                    indegree[flat[i + 1]] += 1
    for g in range(num_genes):
        after_ptr[g + 1] += after_ptr[g]
    after = np.empty(after_ptr[num_genes], np.int64)
    filled = after_ptr[:-1].copy()
    for s in range(len(offsets) - 1):
        if taken[s]:
            for i in range(offsets[s], offsets[s + 1] - 1):
                after[filled[flat[i]]] = flat[i + 1]
                filled[flat[i]] += 1
    total = 0
    heap = np.empty(num_genes, np.int64)  # (key << 32) | gene, of the genes free to come next
    size = 0
    for g in range(num_genes):
        if member[g]:
            total += 1
            if indegree[g] == 0:
                size = _push(heap, size, (key[g] << 32) | g)
    done = np.zeros(num_genes, np.bool_)
    union = np.empty(total, np.int64)
    n = cursor = 0
    while n < total:
        if size:
            g = heap[0] & 0xFFFFFFFF
            size = _pop(heap, size)
            if done[g]:
                continue
        else:  # a cycle: the gene of smallest key not yet out
            while not member[by_key[cursor]] or done[by_key[cursor]]:
                cursor += 1
            g = by_key[cursor]
        done[g] = True
        union[n] = g
        n += 1
        for k in range(after_ptr[g], after_ptr[g + 1]):
            h = after[k]
            indegree[h] -= 1
            if indegree[h] == 0 and not done[h]:
                size = _push(heap, size, (key[h] << 32) | h)
    return union


@nb.njit(inline="always")
def _push(heap, size, item):  # pragma: no cover - numba
    i = size
    while i > 0 and heap[(i - 1) >> 1] > item:
        heap[i] = heap[(i - 1) >> 1]
        i = (i - 1) >> 1
    heap[i] = item
    return size + 1


@nb.njit(inline="always")
def _pop(heap, size):  # pragma: no cover - numba
    """Drop the smallest (``heap[0]``); returns the new size."""
    size -= 1
    item = heap[size]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and heap[c + 1] < heap[c]:
            c += 1
        if heap[c] >= item:
            break
        heap[i] = heap[c]
        i = c
    if size:
        heap[i] = item
    return size


def _unified_order(resolved: list[pa.Array], genes: str | Path) -> pa.Array:
    """The collection's gene ids, in column order (an intersection, or a given gene list)."""
    if genes == INTERSECTION:
        firsts = [pc.unique(ids.drop_null()) for ids in resolved]
        counts = pc.value_counts(pa.concat_arrays(firsts))
        common = counts.field("values").take(
            from_numpy(np.flatnonzero(to_numpy(counts.field("counts")) == len(resolved)))
        )
        order = pc.filter(firsts[0], pc.is_in(firsts[0], value_set=common))
        if not len(order):
            msg = "the sources have no gene in common: --genes intersection would leave no column"
            raise DataValidationError(msg)
        return order
    return pc.unique(text_array(read_gene_list(genes)))

"""One gene space for a collection: every source's genes matched by Ensembl id, and each source's map
into it.

Each source's gene ids are found in its gene table (`_genekeys.gene_keys`: Ensembl ids, version
suffixes stripped; a source with none is matched by gene symbol, through the symbols the other
sources give their Ensembl ids, and flagged in the report). `GeneSpace.build` unifies the sources'
genes: the union (`_union_order.union_order`: in an order that keeps each source's own wherever
the sources agree, so sources listing their genes in one common order move into it by copies
alone), the genes every source measured, or a given gene table / vocabulary; two genes of one
source with the same id are summed. Each source gets a `_remap.MemberMap`, which moves its rows
into the unified columns.

A gene without an id (null or empty: spike-ins, transgenes) is keyed by its symbol (``symbol:GFP``),
a gene of its own without an Ensembl id, as a symbol-only source's unmatched genes are; one without
a symbol either is dropped. Both are reported; no two genes are ever one because they share "".
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from omicsio_jax import DataValidationError
from omicsio_jax.format import from_numpy, one_array, text_array, to_numpy, to_numpy_filled

from ._genekeys import GeneKeys, gene_keys, read_gene_list
from ._remap import MemberMap, member_map
from ._union_order import union_order

UNION, INTERSECTION = "union", "intersection"
_KEY_THREADS = 8  # sources whose gene keys are found at once (`GeneSpace.build`)
_SHOWN = 3  # the sources, genes a note names at most (then "...")
_BY_SYMBOL = "symbol:"  # the key of a gene without an Ensembl id: its symbol after this (`_symbol_keys`)


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
        maps, members, left_out, losing = [], [], [], 0  # losing: the sources with genes not in a given list
        for t, k, ids, label, end in zip(tables, keys, resolved, labels, ends, strict=True):
            own = code[end - len(ids) : end]
            known = own >= 0
            hit = own[known]
            cols = np.full(len(own), -1, np.int64)
            cols[known] = col_of_seen[hit]
            if genes not in (UNION, INTERSECTION) and np.any(lost := known & (cols < 0)):
                losing += 1
                if len(left_out) < _SHOWN:
                    left_out.append(_shown(label, ids.filter(from_numpy(lost))))
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
        if genes not in (UNION, INTERSECTION):
            _check_given(genes, order, members)
            dropped = int(np.count_nonzero(col_of_seen < 0))
            left_out += ["..."] if losing > len(left_out) else []
            notes.extend(_given_notes(genes, order, (dropped, len(seen)), left_out, maps))
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
        notes.append(
            f"{label}: {by_symbol:,} gene(s) without an id in {keys.column} ({first_few(named)}) kept "
            "under their symbol, as genes without an Ensembl id"
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


def _check_given(genes: str | Path, order: pa.Array, members: list[dict]) -> None:
    """Refuse a given gene list that no source measured a gene of (every cell would be empty)."""
    if not any(m["measured"] for m in members):
        msg = (
            f"--genes {genes}: none of its {len(order):,} gene(s) is among the sources' genes (matched by "
            "Ensembl id, version dropped): give a gene table keyed by the same ids, or --genes union"
        )
        raise DataValidationError(msg)


def first_few(values: pa.Array | list[str]) -> str:
    """The first `_SHOWN` of the text ``values``, as a note names them (``A, B, C, ...``)."""
    shown = values.slice(0, _SHOWN).to_pylist() if isinstance(values, pa.Array) else values[:_SHOWN]
    return ", ".join(shown) + (", ..." if len(values) > _SHOWN else "")


def _shown(label: str, genes: pa.Array) -> str:
    """A source and the first of its ``genes`` a note names: ``a (a.h5ad): 296 (ENSG…, ENSG…, ...)``."""
    return f"{label}: {len(genes):,} ({first_few(genes)})"


def _given_notes(
    genes: str | Path, order: pa.Array, dropped: tuple[int, int], left_out: list[str], maps: list[MemberMap]
) -> list[str]:
    """The notes on a given gene list: how many of the sources' distinct genes it drops (``dropped``:
    those, and all of them; ``left_out``: the first sources that had some, as `_shown` names them),
    and its genes no source measured. Genes only: the nonzeros dropped are not counted (a pass over
    the cells)."""
    notes = []
    if dropped[0]:
        notes.append(
            f"--genes {genes}: {dropped[0]:,} of the sources' {dropped[1]:,} genes are not in it and were "
            f"dropped, with their values: {'; '.join(left_out)}"
        )
    unmeasured = np.flatnonzero(~np.logical_or.reduce([m.measured for m in maps]))
    if len(unmeasured):
        notes.append(
            f"--genes {genes}: {len(unmeasured):,} of its {len(order):,} gene(s) measured by no source "
            f"({first_few(order.take(from_numpy(unmeasured)))}): their columns are all zeros, and "
            "presence marks them unmeasured"
        )
    return notes


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

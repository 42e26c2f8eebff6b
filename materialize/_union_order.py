"""The column order of a collection's union of genes (`union_order`), from each source's genes as
codes in the order its gene table lists them, and the numba kernel that makes it (`_topological`).

A source whose genes stand in the union in the order it lists them moves into the unified columns
by copies alone (`_remap.MemberMap.in_order`); the other sources' rows are sorted. So the union
keeps as many sources' own orders as it can: a topological order of the genes each source kept
lists one after the other, the smallest key (the ids' order) first where that leaves a choice.
`_genespace.GeneSpace.build` gives it each source's codes and the ids' order.
"""

from __future__ import annotations

import numba as nb
import numpy as np


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

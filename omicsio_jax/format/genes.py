"""Gene identifiers: Ensembl ids compared as stable ids, without their version suffix."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

_VERSIONED = re.compile(r"^(ENS[A-Z]*G\d+)\.\d+$", re.IGNORECASE)
_ENSEMBL_GENE = re.compile(r"^ENS[A-Z]*G\d+(\.\d+)?$", re.IGNORECASE)


def fold_ensembl(key: str) -> str:
    """``ENSG00000141510.17`` → ``ENSG00000141510`` (upper case); other keys upper-cased only."""
    match = _VERSIONED.match(key)
    return match.group(1).upper() if match else key.upper()


def is_ensembl_id(key: str) -> bool:
    """Whether ``key`` is an Ensembl gene id (``ENSG…``, ``ENSMUSG…``; a version suffix allowed)."""
    return _ENSEMBL_GENE.match(key) is not None


def name_lookup(columns: Iterable[Sequence[str]]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """The gene column each name stands for, over a gene table's name ``columns`` (say its
    ``ensembl_id`` then its ``gene_name`` values) in their order: a name takes the column it first
    names; and the names that a column of names gives to several genes (a symbol two Ensembl ids
    share), with all their columns, so that asking for one of them can be refused, not answered with
    its first gene."""
    lookup: dict[str, int] = {}
    shared: dict[str, list[int]] = {}
    for names in columns:
        held: dict[str, list[int]] = {}
        for col, name in enumerate(names):
            held.setdefault(str(name), []).append(col)
        for name, cols in held.items():
            if name not in lookup:
                lookup[name] = cols[0]
                if len(cols) > 1:
                    shared[name] = cols
    return lookup, shared

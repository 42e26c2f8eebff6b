"""Gene identifiers: Ensembl ids compared as stable ids, without their version suffix."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

# An Ensembl gene id as Ensembl writes it: ENS, the species' letters (none for human, MUS for mouse),
# G, the number (11 digits; 6 at least here, so no symbol like ``ENSG1`` counts), an optional version
# suffix (``.12``) and, as GENCODE writes the Y-chromosome copy of a pseudo-autosomal gene, an optional
# ``_PAR_Y`` tail: ``ENSG00000141510``, ``ENSMUSG00000064370.1``, ``ENSG00000182378.14_PAR_Y`` (the X
# copy is ``ENSG00000182378.14``). ASCII digits only and anchored at both ends, so Python (always with
# ``fullmatch``) and Arrow's RE2 (``.pattern``) read it alike. Stored ids are matched as written (upper
# case); a user's or a vocabulary's key is upper-cased first (`is_ensembl_id`, `fold_ensembl`).
ENSEMBL_GENE_ID = re.compile(r"^ENS[A-Z]*G[0-9]{6,}(\.[0-9]+)?(_PAR_Y)?$")
# An Ensembl id's version suffix: stripped (its first match, in Python's ``re`` and in Arrow's
# ``replace_substring_regex`` alike) from an id `ENSEMBL_GENE_ID` matches, its only ".", and
# nothing else (``ENSG00000182378.14_PAR_Y`` → ``ENSG00000182378_PAR_Y``: the two copies of a
# pseudo-autosomal gene stay two genes).
VERSION_SUFFIX = re.compile(r"\.[0-9]+")


def strip_version(gene_id: str) -> str:
    """An Ensembl gene id without its version suffix, as written otherwise (``ENSG00000141510.17`` →
    ``ENSG00000141510``, ``ENSG00000182378.14_PAR_Y`` → ``ENSG00000182378_PAR_Y``); other ids unchanged."""
    return VERSION_SUFFIX.sub("", gene_id, count=1) if ENSEMBL_GENE_ID.fullmatch(gene_id) else gene_id


def is_ensembl_id(key: str) -> bool:
    """Whether ``key`` is an Ensembl gene id in any case (``ENSG…``, ``ENSMUSG…``, ``ensg…``; a
    version suffix and a ``_PAR_Y`` tail allowed). Gene symbols (``TP53``, ``ENSA``) and transcript
    ids (``ENST…``) are not."""
    return ENSEMBL_GENE_ID.fullmatch(key.upper()) is not None


def fold_ensembl(key: str) -> str:
    """``ENSG00000141510.17`` (in any case) → ``ENSG00000141510``, ``ENSG00000182378.14_PAR_Y`` →
    ``ENSG00000182378_PAR_Y`` (`strip_version`); other keys upper-cased only."""
    return strip_version(key.upper())


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

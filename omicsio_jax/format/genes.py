"""Gene identifiers: Ensembl ids compared as stable ids, without their version suffix."""

from __future__ import annotations

import re

_VERSIONED = re.compile(r"^(ENS[A-Z]*G\d+)\.\d+$", re.IGNORECASE)
_ENSEMBL_GENE = re.compile(r"^ENS[A-Z]*G\d+(\.\d+)?$", re.IGNORECASE)


def fold_ensembl(key: str) -> str:
    """``ENSG00000141510.17`` → ``ENSG00000141510`` (upper case); other keys upper-cased only."""
    match = _VERSIONED.match(key)
    return match.group(1).upper() if match else key.upper()


def is_ensembl_id(key: str) -> bool:
    """Whether ``key`` is an Ensembl gene id (``ENSG…``, ``ENSMUSG…``; a version suffix allowed)."""
    return _ENSEMBL_GENE.match(key) is not None

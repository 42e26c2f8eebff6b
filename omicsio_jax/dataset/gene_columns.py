"""Columns of a dataset's genes named by their names, Ensembl ids (with or without a version) or
column numbers (`omicsio_jax.Dataset.gene_columns`); a peak table's peaks also by their coordinates
(``chr1:10010-10460`` or ``chr1-10010-10460``) where it has ``chrom``, ``start`` and ``end``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from omicsio_jax.core.errors import OmicsIOError, UnknownNameError
from omicsio_jax.format.genes import fold_ensembl, name_lookup

if TYPE_CHECKING:
    import pandas as pd


def gene_columns(
    features: pd.DataFrame, num_genes: int, genes: Sequence[str | int], where: str
) -> np.ndarray:
    """`omicsio_jax.Dataset.gene_columns` over a dataset's ``features`` table (``where``: the dataset,
    for messages)."""
    names = [features[key].astype(str) for key in ("ensembl_id", "gene_name", "peak_name") if key in features]
    lookup, shared = name_lookup(names)
    if any(not isinstance(g, (int, np.integer)) and str(g) not in lookup for g in genes):
        # peaks by their coordinates: made only where a name is none of the table's own (a peak
        # table's 10^5-10^6 of them, a gene table with chrom / start / end as well)
        lookup, shared = name_lookup([*names, *_coordinates(features)])
    by_id: dict[str, int] = {}  # Ensembl ids without their version
    if "ensembl_id" in features:
        for col, value in enumerate(features["ensembl_id"].astype(str)):
            by_id.setdefault(fold_ensembl(value), col)
    cols, unknown = [], []
    for g in genes:
        if isinstance(g, (int, np.integer)):
            if not 0 <= int(g) < num_genes:
                unknown.append(str(g))
            cols.append(int(g))
            continue
        if str(g) in shared:
            held = shared[str(g)]
            ids = features["ensembl_id"].astype(str) if "ensembl_id" in features else None
            if ids is not None and len({ids[c] for c in held}) < len(held):  # ids no better than names
                ids = None
            named = ", ".join(f"column {c}" if ids is None else f"{ids[c]} in column {c}" for c in held[:5])
            fix = "its column number" if ids is None else "its Ensembl id or its column number"
            msg = f"{where}: gene {g!r} is the name of {len(held)} genes ({named}): give {fix}"
            raise OmicsIOError(msg)
        col = lookup.get(str(g), by_id.get(fold_ensembl(str(g))))
        if col is None:
            unknown.append(str(g))
        cols.append(col)
    if unknown:
        msg = f"{len(unknown)} panel gene(s) not in {where}/features.parquet: {', '.join(unknown[:5])}"
        raise UnknownNameError(msg)
    return np.asarray(cols, dtype=np.int64)


def _coordinates(features: pd.DataFrame) -> list:
    """A peak table's names from its ``chrom``, ``start`` and ``end`` (none without them): 10x's
    ``chr1:10010-10460`` and Signac / ArchR's ``chr1-10010-10460``."""
    if not {"chrom", "start", "end"} <= set(features.columns):
        return []
    chrom, start, end = (_text(features[c]) for c in ("chrom", "start", "end"))
    return [chrom + ":" + start + "-" + end, chrom + "-" + start + "-" + end]


def _text(column: pd.Series) -> pd.Series:
    """A column's values as text, whole floats as integers (``10010.0`` → ``10010``)."""
    values = column.to_numpy()
    if values.dtype.kind == "f" and np.all(np.isfinite(values)) and np.all(values == np.round(values)):
        return column.astype("int64").astype(str)
    return column.astype(str)

"""Gene panels for the dense layout: rows pre-scattered to the panel's columns."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numba as nb
import numpy as np
import pyarrow as pa

from omicsio_jax import DataValidationError, ObjectStoreError
from omicsio_jax.format import as_input_path, name_lookup

from ._genekeys import strip_version

# A panel entry may name a gene by any of these gene-table columns.
_KEY_COLUMNS = ("ensembl_id", "gene_name", "gene_token_id")


@nb.njit(parallel=True, nogil=True, cache=True)
def _scatter_panel(indptr, tokens, values, token_to_col, col_to_panel, out):
    for i in nb.prange(indptr.shape[0] - 1):
        for j in range(indptr[i], indptr[i + 1]):
            p = col_to_panel[token_to_col[tokens[j]]]
            if p >= 0:
                out[i, p] = values[j]


@dataclasses.dataclass(frozen=True)
class Panel:
    """``col_to_panel[c]`` is the panel position of gene column ``c`` (-1 = not in the panel)."""

    features: pa.Table
    col_to_panel: np.ndarray

    def scatter(
        self, indptr: np.ndarray, tokens: np.ndarray, values: np.ndarray, token_to_col: np.ndarray
    ) -> np.ndarray:
        """Dense ``(num_cells, panel size)`` float32 rows from validated CSR rows of gene tokens."""
        out = np.zeros((len(indptr) - 1, self.features.num_rows), dtype=np.float32)
        _scatter_panel(indptr, tokens, values, token_to_col, self.col_to_panel, out)
        return out


def read_panel(panel: str | Path | Sequence[str], genes: pa.Table) -> Panel:
    """Resolve a panel (a text file with one gene per line, or a list) against the gene table.

    Each entry may be an Ensembl id, a gene name or a gene_token_id; the panel keeps its order.
    """
    if isinstance(panel, (str, Path)):
        path = as_input_path(str(panel))  # a local file or an s3:// object
        try:
            with path.open("rb") as f:
                lines = f.read().decode().splitlines()
        except (OSError, ObjectStoreError) as e:
            msg = f"cannot read panel file {path}: {getattr(e, 'strerror', None) or e}"
            raise DataValidationError(msg) from e
        entries = [line.split("#")[0].strip() for line in lines]
        entries = [e for e in entries if e]
        label = str(path)
    else:
        entries, label = [str(e) for e in panel], "the panel"
    if not entries:
        msg = f"{label} lists no genes"
        raise DataValidationError(msg)
    lookup, shared = name_lookup(
        genes.column(key).to_pylist() for key in _KEY_COLUMNS if key in genes.column_names
    )
    if "ensembl_id" in genes.column_names:  # an Ensembl id with or without its version matches
        for col, value in enumerate(genes.column("ensembl_id").to_pylist()):
            lookup.setdefault(strip_version(str(value)), col)
    cols, unknown, seen = [], [], set()
    for entry in entries:
        col = lookup.get(entry, lookup.get(strip_version(entry)))
        if entry in shared:
            raise _shared_name(label, entry, shared[entry], genes)
        if col is None:
            unknown.append(entry)
        elif col in seen:
            msg = f"{label} names gene {entry!r} twice (or under two names)"
            raise DataValidationError(msg)
        else:
            seen.add(col)
            cols.append(col)
    if unknown:
        shown = ", ".join(repr(u) for u in unknown[:5]) + (" …" if len(unknown) > 5 else "")
        msg = (
            f"{len(unknown)} gene(s) of {label} are not in the gene table: {shown} "
            f"(entries are matched against {', '.join(k for k in _KEY_COLUMNS if k in genes.column_names)})"
        )
        raise DataValidationError(msg)
    col_to_panel = np.full(genes.num_rows, -1, dtype=np.int32)
    col_to_panel[cols] = np.arange(len(cols), dtype=np.int32)
    return Panel(genes.take(pa.array(cols)), col_to_panel)


def _shared_name(label: str, entry: str, held: list[int], genes: pa.Table) -> DataValidationError:
    """The error of a panel ``entry`` that names the genes ``held`` (rows of ``genes``): each named by
    its Ensembl id where those tell them apart (a var index without gene ids has the names as ids)
    and its gene_token_id, and the fix that works."""
    ids = genes.column("ensembl_id").to_pylist() if "ensembl_id" in genes.column_names else None
    tokens = genes.column("gene_token_id").to_pylist() if "gene_token_id" in genes.column_names else None
    distinct = ids is not None and len({ids[c] for c in held}) == len(held)

    def named_by(c: int) -> str:
        words = ([str(ids[c])] if distinct else []) + ([f"gene_token_id {tokens[c]}"] if tokens else [])
        return " ".join(words) or f"row {c} of the gene table"

    named = ", ".join(named_by(c) for c in held[:5])
    fix = "its Ensembl id or its gene_token_id" if distinct else "its gene_token_id"
    return DataValidationError(
        f"{label} names gene {entry!r}, which {len(held)} genes share ({named}): give {fix}"
    )

"""Splice layers of the synthetic corpus (`materialize._synthetic_multimodal`): the RNA counts split
per cell and gene into ``LAYERS`` (shares ``LAYER_SHARES``), so that the three layers sum exactly to
``cells.parquet``. Chunk ``i`` of the RNA is split from ``np.random.default_rng([seed, _LAYER_STREAM,
i])``."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from numba import njit

from ._synthetic_model import SUB_BATCH

LAYERS = ("spliced", "unspliced", "ambiguous")
LAYER_SHARES = (0.75, 0.20, 0.05)  # expected share of a count in each layer
_LAYER_STREAM = 2**32 - 2  # rng streams [seed, _LAYER_STREAM, chunk index] of the splice split
_SMALL = 16  # counts up to this are split one molecule at a time, larger ones by two binomials
LAYER_SCHEMA = pa.schema(
    [
        ("cell_id", pa.string()),
        ("gene_token_id", pa.list_(pa.int32())),
        ("gene_expression", pa.list_(pa.float32())),
    ]
)


@njit(cache=True, nogil=True)
def _split_rows(
    offsets: np.ndarray,
    genes: np.ndarray,
    values: np.ndarray,
    bits: np.ndarray,
    big: np.ndarray,
    t1: int,
    t2: int,
    first_row: int,
    pos: np.ndarray,
    out_offsets: np.ndarray,
    out_genes: np.ndarray,
    out_values: np.ndarray,
) -> None:
    """Split the counts of CSR rows ``offsets`` into three layers, appended at ``pos`` to ``out_*[k]``.

    A count up to ``_SMALL`` sends each molecule to a layer by one 32-bit draw of ``bits``
    (``< t1``: spliced, ``< t2``: unspliced, else ambiguous); a larger one takes the next row of
    ``big`` (its spliced and unspliced parts, drawn by numpy binomials). The ambiguous part is
    the rest, so the layers sum exactly to the count; zero parts are left out.
    """
    p, q = 0, 0
    part = np.empty(3, np.int64)
    for i in range(offsets.size - 1):
        for j in range(offsets[i], offsets[i + 1]):
            v = np.int64(values[j])
            if v > _SMALL:
                a, b = big[q, 0], big[q, 1]
                q += 1
            else:
                a, b = 0, 0
                for _ in range(v):
                    x = np.int64(bits[p])
                    p += 1
                    a += x < t1
                    b += (x >= t1) & (x < t2)
            part[0], part[1], part[2] = a, b, v - a - b
            for k in range(3):
                if part[k] > 0:
                    out_genes[k, pos[k]] = genes[j]
                    out_values[k, pos[k]] = part[k]
                    pos[k] += 1
        for k in range(3):
            out_offsets[k, first_row + i + 1] = pos[k]


def split_layers(
    seed: int, index: int, offsets: np.ndarray, genes: np.ndarray, values: np.ndarray
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Split RNA chunk ``index`` (CSR rows) into the CSR rows of each of ``LAYERS`` (nonzeros only).

    Cells are split ``SUB_BATCH`` at a time, each batch's binomials then molecule draws taken
    from ``np.random.default_rng([seed, _LAYER_STREAM, index])``, which bounds the draws held.
    """
    rng = np.random.default_rng([seed, _LAYER_STREAM, index])
    n, nnz = offsets.size - 1, int(offsets[-1])
    out_offsets = np.zeros((3, n + 1), np.int64)
    out_genes, out_values = np.empty((3, nnz), np.int32), np.empty((3, nnz), np.float32)  # touched as filled
    pos = np.zeros(3, np.int64)
    t1, t2 = (round(float(s) * 2.0**32) for s in np.cumsum(LAYER_SHARES[:2]))
    for b in range(0, n, SUB_BATCH):
        e = min(b + SUB_BATCH, n)
        counts = values[offsets[b] : offsets[e]]
        large = counts > _SMALL
        big = np.empty((int(large.sum()), 2), np.int64)
        big[:, 0] = rng.binomial(counts[large].astype(np.int64), LAYER_SHARES[0])
        big[:, 1] = rng.binomial(
            counts[large].astype(np.int64) - big[:, 0], LAYER_SHARES[1] / (1.0 - LAYER_SHARES[0])
        )
        bits = rng.integers(0, 2**32, int(counts[~large].sum(dtype=np.int64)), dtype=np.uint32)
        _split_rows(
            offsets[b : e + 1], genes, values, bits, big, t1, t2, b, pos, out_offsets, out_genes, out_values
        )
    return [(out_offsets[k], out_genes[k, : pos[k]], out_values[k, : pos[k]]) for k in range(3)]

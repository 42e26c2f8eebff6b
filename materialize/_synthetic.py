"""Synthetic single-cell corpus shaped like Tahoe-100M.

Cells are generated in chunks of ``CHUNK_CELLS`` from
``np.random.default_rng([seed, chunk_index])`` and streamed to ``cells.parquet``
and ``cells.h5ad``; only O(cells) label codes stay in memory. Gene ids follow a
Zipf-like popularity law and are drawn by a numba kernel that only consumes
numpy random numbers, so the output is a pure function of the arguments.
With ``multimodal=True`` the corpus also gets splice layers of the RNA and an ATAC
modality (see `materialize._synthetic_multimodal`).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from numba import njit, prange
from tqdm import tqdm

CHUNK_CELLS = 8192
_SUB_BATCH = 2048  # cells per kernel call; bounds the random pool to ~30 MB
_SETUP_STREAM = 2**32 - 1  # rng stream of the global structure (never a chunk index)
_MARKERS, _BATCH_GENES = 50, 25  # marker genes per drug / cell type; batch genes per plate
MARKER_FRACTION = (0.03, 0.03, 0.015)  # default share of a cell's draws from its drug, cell-type, plate set
_BOOST = np.array([1.0, 4.0, 4.0, 2.0])  # mean count multiplier: background, drug, cell type, plate
_TISSUES = ["lung", "breast", "colon", "pancreas", "skin", "brain", "liver", "kidney", "ovary", "blood"]
_CHROMS = np.array([f"chr{i}" for i in range(1, 23)] + ["chrX", "chrY", "chrM"])
_NESTED = ["gene_token_id.list.element", "gene_expression.list.element"]
_SCHEMA = pa.schema([
    ("cell_id", pa.string()), ("gene_token_id", pa.list_(pa.int32())),
    ("gene_expression", pa.list_(pa.float32())), ("cell_type", pa.string()), ("drug", pa.string()),
    ("batch", pa.string()), ("dataset", pa.string()), ("tissue", pa.string()),
    ("organism", pa.string()), ("n_genes", pa.int32()), ("total_counts", pa.float32()),
])


@dataclass(frozen=True)
class SyntheticCorpus:
    """Paths and sizes of a generated corpus."""

    cells_parquet: Path | None
    genes_parquet: Path
    h5ad: Path | None
    num_cells: int
    num_genes: int
    nnz: int
    layers: dict[str, Path] | None = field(default=None, hash=False)  # splice layer name -> parquet
    atac_parquet: Path | None = None
    peaks_parquet: Path | None = None
    h5mu: Path | None = None
    num_peaks: int = 0
    atac_nnz: int = 0


@njit(cache=True)
def _radix_sort(keys: np.ndarray, tmp: np.ndarray, n: int, bits: int) -> np.ndarray:
    """LSD radix sort of ``keys[:n]`` (values ``< 2**bits``); returns the sorted buffer."""
    passes = max(1, (bits + 10) // 11)
    width = (bits + passes - 1) // passes
    counts = np.empty(1 << width, np.int64)
    src, dst = keys, tmp
    for shift in range(0, passes * width, width):
        counts[:] = 0
        for j in range(n):
            counts[(src[j] >> shift) & ((1 << width) - 1)] += 1
        total = 0
        for d in range(1 << width):
            counts[d], total = total, total + counts[d]
        for j in range(n):
            d = (src[j] >> shift) & ((1 << width) - 1)
            dst[counts[d]] = src[j]
            counts[d] += 1
        src, dst = dst, src
    return src


@njit(parallel=True, cache=True, nogil=True)
def _sample_cells(targets: np.ndarray, pool_offsets: np.ndarray, pool: np.ndarray, value_bits: np.ndarray,
                  out_offsets: np.ndarray, cdf: np.ndarray, guide: np.ndarray, shift: int,
                  rank_to_gene: np.ndarray, inv_mean: np.ndarray, marker_ranks: np.ndarray,
                  cell_rows: np.ndarray, marker_draws: np.ndarray, cell_scale: np.ndarray,
                  genes: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Draw sorted unique gene ids and geometric counts for a batch of cells.

    Cell ``i`` gets up to ``targets[i]`` entries of ``genes``/``values`` from
    ``out_offsets[i]``; returns how many it got.

    Per cell, marker draws (drug, cell type, plate: flags 1-3) come first, then
    Zipf draws by inverse CDF (``cdf`` scaled to 2**32, bucketed by the ``guide``
    table) until ``targets[i]`` distinct genes are found or the cell's slice of
    ``pool`` is used up. Genes are deduplicated by popularity rank, which keeps
    the hot head in cache; all randomness comes from ``pool`` and ``value_bits``.
    """
    n, num_genes, set_size = targets.shape[0], rank_to_gene.shape[0], marker_ranks.shape[1]
    counts = np.zeros(n, np.int64)
    inv_boost = 1.0 / _BOOST
    key_bits = int(np.ceil(np.log2(num_genes))) + 2  # sort key = gene * 4 + flag
    size = targets.max() + marker_draws.sum(axis=1).max() + 1
    n_blocks = min(n, 64)
    for b in prange(n_blocks):
        stamp = np.full(num_genes, -1, np.int32)  # stamp[rank] == i: rank already in cell i
        keys, tmp, ends = np.empty(size, np.int32), np.empty(size, np.int32), np.zeros(4, np.int64)
        for i in range(b * n // n_blocks, (b + 1) * n // n_blocks):
            k, p, end, c = targets[i], pool_offsets[i], pool_offsets[i + 1], 0
            for s in range(3):
                for _ in range(min(marker_draws[i, s], end - p)):
                    r = marker_ranks[cell_rows[i, s], (np.int64(pool[p]) * set_size) >> 32]
                    p += 1
                    new = stamp[r] != i
                    stamp[r], keys[c] = i, r
                    c += new
                ends[s + 1] = c
            c = min(c, k)
            while c < k and p < end:  # branch-free dedup of inverse-CDF draws
                x = np.int64(pool[p])
                p += 1
                r = guide[x >> shift]
                while cdf[r] <= x:
                    r += 1
                new = stamp[r] != i
                stamp[r], keys[c] = i, r
                c += new
            for j in range(c):
                flag = 0 if j >= ends[3] else (3 if j >= ends[2] else (2 if j >= ends[1] else 1))
                keys[j] = rank_to_gene[keys[j]] * 4 + flag
            chosen = _radix_sort(keys, tmp, c, key_bits)
            o, inv_scale = out_offsets[i], 1.0 / cell_scale[i]
            for j in range(c):
                g = chosen[j] >> 2
                genes[o + j] = g
                # geometric on {1, 2, ...} with mean mu: V > v  <=>  w <= q**v, q = 1 - 1 / mu
                q = 1.0 - min(inv_mean[g] * inv_scale * inv_boost[chosen[j] & 3], 1.0)
                w = (value_bits[o - out_offsets[0] + j] + 0.5) * 2.0**-32
                v, t = 1.0, q
                for _ in range(7):  # branch-free count of the first seven steps
                    v += w <= t
                    t *= q
                if w <= t:  # rare tail: V > 8
                    v = 1.0 + np.floor(np.log(w) / np.log(q))
                values[o + j] = min(v, 65535.0)
            counts[i] = c
    return counts


class _Model:
    """Global structure of a corpus (genes, plates, labels, marker sets) and its chunk generator."""

    def __init__(self, num_cells: int, num_genes: int, seed: int, num_plates: int | None,
                 mean_nnz: float, marker_fraction: tuple[float, float, float] = MARKER_FRACTION) -> None:
        num_plates = max(2, min(14, num_cells // 2000)) if num_plates is None else num_plates
        if not (0 < num_cells < 10**9 and 1 <= num_plates <= num_cells and num_genes >= 1 and mean_nnz > 0):
            raise ValueError("need 0 < num_cells < 1e9, 1 <= num_plates <= num_cells, "
                             "num_genes >= 1 and mean_nnz > 0")
        if len(marker_fraction) != 3 or not all(0 <= f for f in marker_fraction) or sum(marker_fraction) >= 1:
            raise ValueError(f"marker_fraction must be 3 shares >= 0 summing below 1, got {marker_fraction}")
        rng = np.random.default_rng([seed, _SETUP_STREAM])
        self.seed, self.num_cells, self.num_genes, self.mean_nnz = seed, num_cells, num_genes, mean_nnz
        self.marker_fraction = tuple(float(f) for f in marker_fraction)
        # genes: popularity rank -> gene id is a fixed random permutation; Zipf weights 1 / rank
        self.rank_to_gene = rng.permutation(num_genes).astype(np.int32)
        ranks = np.argsort(self.rank_to_gene)
        weights = 1.0 / np.arange(1, num_genes + 1)
        self.cdf = np.ceil(np.cumsum(weights) / weights.sum() * 2.0**32).astype(np.int64)
        self.cdf[-1] = 2**32  # a 32-bit draw x maps to the first rank with cdf > x
        self.shift = 32 - min(32, int(np.ceil(np.log2(max(num_genes, 2)))) + 2)
        buckets = np.arange(2 ** (32 - self.shift), dtype=np.int64) << self.shift
        self.guide = np.searchsorted(self.cdf, buckets, side="right").astype(np.int32)
        self.inv_mean = 1.0 / (1.0 + 40.0 / np.sqrt(ranks + 1.0))  # mean count falls with rank
        # expected distinct genes after m Zipf draws, used to size each cell's random pool
        self.pool_m = np.unique(np.geomspace(1.0, 64.0 * num_genes, 160).round())
        log_miss = np.log1p(-weights / weights.sum())
        self.pool_u = np.array([-np.expm1(m * log_miss).sum() for m in self.pool_m])

        # plates: contiguous, Dirichlet sizes >= 1; the last one holds every label
        shares = rng.dirichlet(np.full(num_plates, 2.0))
        sizes = 1 + np.floor(shares * (num_cells - num_plates)).astype(np.int64)
        sizes[-1] += num_cells - sizes.sum()
        starts = np.concatenate([[0], np.cumsum(sizes)])
        n_drugs = int(min(30, max(2, num_cells // 50), sizes[-1]))
        n_types = int(min(20, max(2, num_cells // 75), sizes[-1]))
        self.names = {"drug": ["DMSO_TF"] + [f"drug_{d:02d}" for d in range(1, n_drugs)],
                      "cell_type": [f"cell_line_{t:02d}" for t in range(n_types)],
                      "batch": [f"plate_{p:02d}" for p in range(num_plates)]}
        self.codes = {"batch": np.repeat(np.arange(num_plates), sizes).astype(np.int16),
                      "drug": np.empty(num_cells, np.int16), "cell_type": np.empty(num_cells, np.int16)}
        for p in range(num_plates):
            lo, hi, last = starts[p], starts[p + 1], p == num_plates - 1
            for key, n_labels in (("drug", n_drugs), ("cell_type", n_types)):
                size = n_labels if last else rng.integers(int(np.ceil(0.4 * n_labels)), max(2, n_labels))
                subset = np.sort(rng.choice(n_labels, size, replace=False))
                self.codes[key][lo:hi] = rng.choice(subset, hi - lo)
                if last:  # every label at least once on the evaluation plate
                    self.codes[key][lo + rng.choice(hi - lo, n_labels, replace=False)] = subset

        # marker sets (as popularity ranks, away from the always-expressed head)
        lo = min(200, num_genes // 10)
        candidates = np.arange(lo, num_genes)
        width = min(_MARKERS, candidates.size)
        sets = [rng.choice(candidates, width if s < n_drugs + n_types else min(_BATCH_GENES, width),
                           replace=False) for s in range(n_drugs + n_types + num_plates)]
        self.marker_ranks = np.stack([np.resize(s, width) for s in sets]).astype(np.int32)
        self.set_offset = np.array([0, n_drugs, n_drugs + n_types], np.int64)
        self.genes = pd.DataFrame({
            "gene_token_id": np.arange(num_genes, dtype=np.int32),
            "ensembl_id": [f"ENSG{i:011d}" for i in range(num_genes)],
            "gene_name": [f"GENE{i}" for i in range(num_genes)],
            "chromosome": _CHROMS[np.minimum(rng.geometric(0.09, num_genes) - 1, _CHROMS.size - 1)],
            "gene_type": np.where(rng.random(num_genes) < 0.85, "protein_coding", "lncRNA"),
        })

    def obs_codes(self, rows: slice) -> dict[str, tuple[list[str], np.ndarray]]:
        """Categories and integer codes of every string obs column for ``rows``."""
        cell_type = self.codes["cell_type"][rows]
        zeros = np.zeros(cell_type.size, np.int16)
        return {"cell_type": (self.names["cell_type"], cell_type),
                "drug": (self.names["drug"], self.codes["drug"][rows]),
                "batch": (self.names["batch"], self.codes["batch"][rows]),
                "dataset": (["synthetic"], zeros), "tissue": (_TISSUES, cell_type % len(_TISSUES)),
                "organism": (["Homo sapiens"], zeros)}

    def chunk(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Generate chunk ``index`` of cells; returns CSR ``(offsets, gene ids, counts)``."""
        rng = np.random.default_rng([self.seed, index])
        start = index * CHUNK_CELLS
        n = min(CHUNK_CELLS, self.num_cells - start)
        raw = rng.lognormal(np.log(self.mean_nnz) - 0.18, 0.6, n)  # mean exactly mean_nnz
        targets = np.clip(np.rint(raw), 50, max(50, self.num_genes // 4))
        targets = np.minimum(targets, self.num_genes).astype(np.int64)
        cell_scale = rng.lognormal(-0.08, 0.4, n)
        draws = rng.binomial(targets[:, None], self.marker_fraction).astype(np.int64)
        labels = [self.codes[key][start:start + n] for key in ("drug", "cell_type", "batch")]
        rows = self.set_offset + np.stack(labels, axis=1)
        zipf_draws = np.ceil(1.15 * np.interp(targets, self.pool_u, self.pool_m)).astype(np.int64)
        pool_sizes = draws.sum(axis=1) + zipf_draws + 32
        out_offsets = np.concatenate([[0], np.cumsum(targets)])
        genes, values = np.empty(out_offsets[-1], np.int32), np.empty(out_offsets[-1], np.float32)
        counts = np.empty(n, np.int64)
        for b in range(0, n, _SUB_BATCH):
            s = slice(b, min(b + _SUB_BATCH, n))
            pool_offsets = np.concatenate([[0], np.cumsum(pool_sizes[s])])
            pool = rng.integers(0, 2**32, pool_offsets[-1], dtype=np.uint32)
            bits = rng.integers(0, 2**32, out_offsets[s.stop] - out_offsets[b], dtype=np.uint32)
            counts[s] = _sample_cells(targets[s], pool_offsets, pool, bits, out_offsets[b:s.stop + 1],
                                      self.cdf, self.guide, self.shift, self.rank_to_gene, self.inv_mean,
                                      self.marker_ranks, rows[s], draws[s], cell_scale[s], genes, values)
        if (counts < targets).any():  # a pool ran dry (rare): drop the unfilled slots
            slot = np.arange(out_offsets[-1]) - np.repeat(out_offsets[:-1], targets)
            keep = slot < np.repeat(counts, targets)
            genes, values = genes[keep], values[keep]
        return np.concatenate([[0], np.cumsum(counts)]), genes, values


def _cell_ids_at(rows: np.ndarray) -> pa.StringArray:
    """Vectorised ``f"c{row:09d}"`` for each of ``rows``."""
    n = rows.size
    chars = np.empty((n, 10), np.uint8)
    chars[:, 0] = ord("c")
    chars[:, 1:] = rows.astype(np.int64)[:, None] // 10 ** np.arange(8, -1, -1) % 10 + ord("0")
    offsets = np.arange(0, 10 * (n + 1), 10, dtype=np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(chars))


def _cell_ids(start: int, n: int) -> pa.StringArray:
    """Vectorised ``f"c{row:09d}"`` for rows ``start .. start + n - 1``."""
    return _cell_ids_at(np.arange(start, start + n))


def _write_chunk(writer: pq.ParquetWriter | None, h5: h5py.File | None, model: _Model, start: int,
                 offsets: np.ndarray, genes: np.ndarray, values: np.ndarray, totals: np.ndarray,
                 row_group_size: int) -> None:
    """Append one chunk of cells (CSR rows from ``start``) to the parquet writer and/or h5ad ``X``."""
    n = offsets.size - 1
    if writer is not None:
        list_offsets = pa.array(offsets.astype(np.int32))
        columns = {"cell_id": _cell_ids(start, n),
                   "gene_token_id": pa.ListArray.from_arrays(list_offsets, pa.array(genes)),
                   "gene_expression": pa.ListArray.from_arrays(list_offsets, pa.array(values))}
        for key, (names, codes) in model.obs_codes(slice(start, start + n)).items():
            columns[key] = pa.array(names, pa.string()).take(pa.array(codes.astype(np.int32)))
        columns["n_genes"] = pa.array(np.diff(offsets).astype(np.int32))
        columns["total_counts"] = pa.array(totals)
        writer.write_table(pa.Table.from_pydict(columns, schema=_SCHEMA), row_group_size=row_group_size)
    if h5 is not None:
        _append_csr(h5["X"], start, offsets, genes, values)


def _create_csr(parent: h5py.Group, name: str, shape: tuple[int, int]) -> h5py.Group:
    """An empty, growable CSR matrix ``parent[name]`` in anndata's on-disk format."""
    x = parent.create_group(name)
    x.attrs.update({"encoding-type": "csr_matrix", "encoding-version": "0.1.0", "shape": list(shape)})
    x.create_dataset("data", (0,), maxshape=(None,), dtype=np.float32, chunks=(1 << 18,))
    x.create_dataset("indices", (0,), maxshape=(None,), dtype=np.int32, chunks=(1 << 18,))
    x.create_dataset("indptr", data=np.zeros(shape[0] + 1, np.int64))
    return x


def _append_csr(x: h5py.Group, start: int, offsets: np.ndarray, indices: np.ndarray, data: np.ndarray) -> None:
    """Append CSR rows ``start ..`` (``offsets`` from 0) to a matrix made by `_create_csr`."""
    n = offsets.size - 1
    old = x["data"].shape[0]
    for name, arr in (("data", data), ("indices", indices)):
        x[name].resize((old + arr.size,))
        x[name][old:] = arr
    x["indptr"][start + 1:start + n + 1] = offsets[1:] + old


def _open_h5ad(path: Path, num_cells: int, num_genes: int) -> h5py.File:
    """Create an h5ad file with anndata's root attributes and an empty, growable CSR ``X``."""
    f = h5py.File(path, "w")
    f.attrs.update({"encoding-type": "anndata", "encoding-version": "0.1.0"})
    _create_csr(f, "X", (num_cells, num_genes))
    return f


def _obs_frame(model: _Model, n_genes: np.ndarray, totals: np.ndarray) -> pd.DataFrame:
    """The cells' obs (categorical labels, ``n_genes``, ``total_counts``), indexed by cell id."""
    obs = pd.DataFrame({key: pd.Categorical.from_codes(codes, categories=names)
                        for key, (names, codes) in model.obs_codes(slice(None)).items()},
                       index=pd.Index([f"c{i:09d}" for i in range(model.num_cells)], name="cell_id"))
    obs["n_genes"], obs["total_counts"] = n_genes, totals
    return obs


def _var_frame(model: _Model) -> pd.DataFrame:
    """The genes' var, indexed by Ensembl id."""
    return model.genes.set_index("ensembl_id").astype({"chromosome": "category", "gene_type": "category"})


def _finish_h5ad(f: h5py.File, model: _Model, n_genes: np.ndarray, totals: np.ndarray) -> None:
    """Write ``obs``, ``var`` and the empty elements anndata expects (``layers`` unless written)."""
    try:  # imported here: anndata takes ~1 s to import and only the h5ad needs it
        from anndata.io import write_elem
    except ImportError:  # pragma: no cover - older anndata
        from anndata.experimental import write_elem

    write_elem(f, "obs", _obs_frame(model, n_genes, totals))
    write_elem(f, "var", _var_frame(model))
    for key in ("obsm", "varm", "obsp", "varp", "layers", "uns"):
        if key not in f:
            write_elem(f, key, {})


def make_synthetic_corpus(out_dir: str | Path, *, num_cells: int, num_genes: int = 62_710, seed: int = 0,
                          num_plates: int | None = None, mean_nnz: float = 1500.0,
                          marker_fraction: tuple[float, float, float] = MARKER_FRACTION,
                          write_parquet: bool = True, write_h5ad: bool = True,
                          row_group_size: int = 8192, progress: bool = False, multimodal: bool = False,
                          num_peaks: int = 200_000, atac_mean_nnz: float = 3000.0, atac_fraction: float = 0.9,
                          atac_shuffle: bool = True, write_h5mu: bool = False) -> SyntheticCorpus:
    """Write a synthetic Tahoe-like corpus to ``out_dir``.

    Parameters
    ----------
    out_dir
        Output folder, created if missing.
    num_cells, num_genes
        Corpus shape (``num_cells < 10**9``).
    seed
        Seed of every random stream; equal arguments give identical files.
    num_plates
        Number of contiguous plates, default ``max(2, min(14, num_cells // 2000))``.
        The last plate holds every drug and cell type.
    mean_nnz
        Mean number of expressed genes per cell (log-normal, clipped to
        ``[50, num_genes // 4]``).
    marker_fraction
        Share of a cell's gene draws taken from its drug's, its cell type's and its plate's
        marker sets (50, 50 and 25 genes, with 4×, 4× and 2× the mean count). The default,
        ``(0.03, 0.03, 0.015)``, hides cell identity in ~5 of ~150 genes; cell lines in real
        data differ in hundreds of genes — ``(0.03, 0.2, 0.015)`` is closer to that.
    write_parquet, write_h5ad
        Whether to write ``cells.parquet`` / ``cells.h5ad``; ``gene_metadata.parquet``
        is always written. With ``multimodal``, ``write_parquet`` also covers the layer and
        ATAC tables and ``write_h5ad`` the layers of ``cells.h5ad``.
    row_group_size
        Parquet row-group size in cells (ATAC: at most 4,096, its generation chunk).
    progress
        Show a tqdm progress bar in cells.
    multimodal
        Also write the further modalities of the cells, one table per modality keyed by
        ``cell_id`` (see `materialize._synthetic_multimodal`):
        ``rna_layers_{spliced,unspliced,ambiguous}.parquet`` (the RNA counts split
        ~75/20/5%: non-negative integers summing exactly to ``cells.parquet``, same rows and
        order, nonzeros only) and ``layers/*`` of ``cells.h5ad``; ``peaks.parquet`` (the
        peak table) and ``atac_cells.parquet`` (``cell_id``, ``peak_token_id``,
        ``peak_accessibility``, ``dataset``).
    num_peaks
        Peaks of the ATAC modality (at most 1,000,000), spread over GRCh38, 300–1000 bp wide.
    atac_mean_nnz
        Mean accessible peaks per cell (log-normal, clipped to ``[200, num_peaks // 10]``);
        peak popularity is Zipf-like, a tenth of the draws come from the cell type's own
        peaks, and values are small counts (80% 1, 15% 2, then 3 and 4).
    atac_fraction
        Share of the cells with ATAC (a seeded draw per cell).
    atac_shuffle
        Write the ATAC rows in a seeded random order (else in the RNA order); a cell's ATAC
        does not depend on it.
    write_h5mu
        Also write ``cells.h5mu`` (MuData: ``rna`` with the layers, ``atac`` in the ATAC
        order); needs ``multimodal`` and the ``mudata`` package (imported only then), and
        holds every nonzero in memory, so it is for small corpora.

    Returns
    -------
    SyntheticCorpus
        Paths of the written files and the corpus size.
    """
    if write_h5mu and not multimodal:
        raise ValueError("write_h5mu needs multimodal=True")
    model = _Model(num_cells, num_genes, seed, num_plates, mean_nnz, marker_fraction)
    mm = None
    if multimodal:  # imported here: that module imports this one
        from . import _synthetic_multimodal as mm
        atac = mm.AtacModel(model, num_peaks, atac_mean_nnz, atac_fraction, atac_shuffle)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    genes_path = out / "gene_metadata.parquet"
    pq.write_table(pa.Table.from_pandas(model.genes, preserve_index=False), genes_path, compression="zstd")
    cells_path = out / "cells.parquet" if write_parquet else None
    h5ad_path = out / "cells.h5ad" if write_h5ad else None
    writer = h5 = further = None
    n_genes, totals = np.empty(num_cells, np.int32), np.empty(num_cells, np.float32)

    def write(index: int, start: int, offsets: np.ndarray, genes: np.ndarray, values: np.ndarray) -> None:
        _write_chunk(writer, h5, model, start, offsets, genes, values, totals[start:start + offsets.size - 1],
                     row_group_size)
        if further is not None:
            further.rna_chunk(index, start, offsets, genes, values)

    try:
        if cells_path:  # encodings chosen for write speed: sorted ids delta-encode well
            strings = [f.name for f in _SCHEMA if f.type == pa.string()]
            flat = [f.name for f in _SCHEMA if not pa.types.is_list(f.type)]
            writer = pq.ParquetWriter(cells_path, _SCHEMA, compression="zstd", use_dictionary=strings,
                                      write_statistics=flat, column_encoding={
                                          _NESTED[0]: "DELTA_BINARY_PACKED", _NESTED[1]: "BYTE_STREAM_SPLIT"})
        h5 = _open_h5ad(h5ad_path, num_cells, num_genes) if h5ad_path else None
        if mm is not None:
            further = mm.MultimodalWriter(model, atac, out, write_parquet=write_parquet, h5ad=h5,
                                          write_h5mu=write_h5mu, row_group_size=row_group_size)
        with ThreadPoolExecutor(1) as pool, tqdm(total=num_cells, unit="cell", disable=not progress) as bar:
            pending: Future | None = None  # writing chunk i overlaps generating chunk i + 1
            for index, start in enumerate(range(0, num_cells, CHUNK_CELLS)):
                offsets, genes, values = model.chunk(index)
                n = offsets.size - 1
                n_genes[start:start + n] = np.diff(offsets)
                totals[start:start + n] = np.add.reduceat(values, offsets[:-1])
                if pending is not None:
                    pending.result()
                pending = pool.submit(write, index, start, offsets, genes, values)
                bar.update(n)
            if pending is not None:
                pending.result()
        if h5 is not None:
            _finish_h5ad(h5, model, n_genes, totals)
        if further is not None:
            further.write_atac(progress)
            further.finish(_obs_frame(model, n_genes, totals), _var_frame(model))
    finally:
        if writer is not None:
            writer.close()
        if h5 is not None:
            h5.close()
        if further is not None:
            further.close()
    nnz = int(n_genes.sum(dtype=np.int64))
    if further is None:
        return SyntheticCorpus(cells_path, genes_path, h5ad_path, num_cells, num_genes, nnz)
    return SyntheticCorpus(cells_path, genes_path, h5ad_path, num_cells, num_genes, nnz,
                           layers=further.layer_paths, atac_parquet=further.atac_path,
                           peaks_parquet=further.peaks_path, h5mu=further.h5mu_path, num_peaks=num_peaks,
                           atac_nnz=further.atac_nnz)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: generate a corpus and print one summary line."""
    parser = argparse.ArgumentParser(description="Write a synthetic Tahoe-like single-cell corpus.")
    parser.add_argument("out_dir", type=Path)
    for flag, default in (("--cells", 20_000), ("--genes", 62_710), ("--seed", 0), ("--plates", None)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--peaks", type=int, default=200_000, help="ATAC peaks (with --multimodal)")
    for flag in ("--no-h5ad", "--no-parquet", "--no-progress"):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("--multimodal", action="store_true",
                        help="also write splice layers and an ATAC modality")
    parser.add_argument("--h5mu", action="store_true", help="also write cells.h5mu (needs --multimodal)")
    args = parser.parse_args(argv)
    if args.h5mu and not args.multimodal:
        parser.error("--h5mu needs --multimodal")
    t0 = time.perf_counter()
    corpus = make_synthetic_corpus(args.out_dir, num_cells=args.cells, num_genes=args.genes, seed=args.seed,
                                   num_plates=args.plates, write_parquet=not args.no_parquet,
                                   write_h5ad=not args.no_h5ad, progress=not args.no_progress,
                                   multimodal=args.multimodal, num_peaks=args.peaks, write_h5mu=args.h5mu)
    paths = [corpus.cells_parquet, corpus.genes_parquet, corpus.h5ad, *(corpus.layers or {}).values(),
             corpus.atac_parquet, corpus.peaks_parquet, corpus.h5mu]
    files = [p.name for p in paths if p is not None]
    atac = f" peaks={corpus.num_peaks} atac_nnz={corpus.atac_nnz}" if args.multimodal else ""
    print(f"cells={corpus.num_cells} genes={corpus.num_genes} nnz={corpus.nnz}{atac} "
          f"files={','.join(files)} seconds={time.perf_counter() - t0:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

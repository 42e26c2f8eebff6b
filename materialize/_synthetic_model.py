"""The synthetic corpus's generative model: genes, cells and counts, as pure functions of the seed.

Gene ids follow a Zipf-like popularity law and are drawn by a numba kernel that only consumes
numpy random numbers; cells carry a drug, a cell type and a plate, each with its own marker genes
(`Model`). Shared by the RNA writer (`materialize._synthetic`) and the splice layers and ATAC
modality (`materialize._synthetic_multimodal`), with the h5 CSR helpers both write with.
"""

from __future__ import annotations

import h5py
import numpy as np
import pandas as pd
import pyarrow as pa
from numba import njit, prange

from omicsio_jax.format import mix64

CHUNK_CELLS = 8192
SUB_BATCH = 2048  # cells per kernel call; bounds the random pool to ~30 MB
_SETUP_STREAM = 2**32 - 1  # rng stream of the global structure (never a chunk index)
_MARKERS, _BATCH_GENES = 50, 25  # marker genes per drug / cell type; batch genes per plate
MARKER_FRACTION = (0.03, 0.03, 0.015)  # default share of a cell's draws from its drug, cell-type, plate set
PROGRAM_FRACTION = 0.5  # default share of the expressed head that each cell type takes from the tail
_BOOST = np.array([1.0, 4.0, 4.0, 2.0])  # mean count multiplier: background, drug, cell type, plate
_TISSUES = ["lung", "breast", "colon", "pancreas", "skin", "brain", "liver", "kidney", "ovary", "blood"]
_CHROMS = np.array([f"chr{i}" for i in range(1, 23)] + ["chrX", "chrY", "chrM"])


@njit(cache=True)
def radix_sort(keys: np.ndarray, tmp: np.ndarray, n: int, bits: int) -> np.ndarray:
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


_NORMAL_FROM = 30.0  # Poisson means from which a count is drawn by the normal approximation


@njit(cache=True, inline="always")
def _count(mu: float, bits: int) -> float:
    """A count of mean ``mu >= 1`` given that the gene is detected: ``1 + Poisson(mu - 1)``, drawn by
    inverse CDF from the uniform 32-bit ``bits`` (from `_NORMAL_FROM`: the normal approximation,
    its second uniform hashed from ``bits``). Capture given expression is Poisson (droplet counts are
    not zero-inflated); the spread between cells comes from their size factor and their genes."""
    w = (bits + 0.5) * 2.0**-32
    lam = mu - 1.0
    if lam < _NORMAL_FROM:
        k, p = 0.0, np.exp(-lam)
        cdf = p
        while w > cdf and k < 4.0 * _NORMAL_FROM:
            k += 1.0
            p *= lam / k
            cdf += p
        return 1.0 + k
    z = mix64(np.uint64(bits) * np.uint64(0x9E3779B97F4A7C15))  # a second uniform: bits hashed (splitmix64)
    u = (np.float64(z >> np.uint64(11)) + 0.5) * 2.0**-53
    normal = np.sqrt(-2.0 * np.log(w)) * np.cos(2.0 * np.pi * u)
    return 1.0 + max(0.0, np.floor(lam + np.sqrt(lam) * normal + 0.5))


@njit(parallel=True, cache=True, nogil=True)
def _sample_cells(
    targets: np.ndarray,
    pool_offsets: np.ndarray,
    pool: np.ndarray,
    value_bits: np.ndarray,
    out_offsets: np.ndarray,
    cdf: np.ndarray,
    guide: np.ndarray,
    shift: int,
    rank_to_gene: np.ndarray,
    inv_mean: np.ndarray,
    marker_genes: np.ndarray,
    types: np.ndarray,
    cell_rows: np.ndarray,
    marker_draws: np.ndarray,
    cell_scale: np.ndarray,
    genes: np.ndarray,
    values: np.ndarray,
) -> np.ndarray:
    """Draw sorted unique gene ids and their counts (`_count`) for a batch of cells.

    Cell ``i`` gets up to ``targets[i]`` entries of ``genes``/``values`` from
    ``out_offsets[i]``; returns how many it got.

    Per cell, marker draws (drug, cell type, plate: flags 1-3) come first, then
    Zipf draws by inverse CDF (``cdf`` scaled to 2**32, bucketed by the ``guide``
    table) until ``targets[i]`` distinct genes are found or the cell's slice of
    ``pool`` is used up. A drawn popularity rank is the gene ``rank_to_gene[t, rank]``
    of the cell's type ``t = types[i]`` (its expression program), and a gene's mean
    count falls with its rank in that program (``inv_mean[t, gene]``); all randomness
    comes from ``pool`` and ``value_bits``.
    """
    n, num_genes, set_size = targets.shape[0], rank_to_gene.shape[1], marker_genes.shape[1]
    counts = np.zeros(n, np.int64)
    inv_boost = 1.0 / _BOOST
    key_bits = int(np.ceil(np.log2(num_genes))) + 2  # sort key = gene * 4 + flag
    size = targets.max() + marker_draws.sum(axis=1).max() + 1
    n_blocks = min(n, 64)
    for b in prange(n_blocks):
        stamp = np.full(num_genes, -1, np.int32)  # stamp[gene] == i: gene already in cell i
        keys, tmp, ends = np.empty(size, np.int32), np.empty(size, np.int32), np.zeros(4, np.int64)
        for i in range(b * n // n_blocks, (b + 1) * n // n_blocks):
            k, p, end, c, kind = targets[i], pool_offsets[i], pool_offsets[i + 1], 0, types[i]
            for s in range(3):
                for _ in range(min(marker_draws[i, s], end - p)):
                    g = marker_genes[cell_rows[i, s], (np.int64(pool[p]) * set_size) >> 32]
                    p += 1
                    new = stamp[g] != i
                    stamp[g], keys[c] = i, g
                    c += new
                ends[s + 1] = c
            c = min(c, k)
            while c < k and p < end:  # branch-free dedup of inverse-CDF draws
                x = np.int64(pool[p])
                p += 1
                r = guide[x >> shift]
                while cdf[r] <= x:
                    r += 1
                g = rank_to_gene[kind, r]
                new = stamp[g] != i
                stamp[g], keys[c] = i, g
                c += new
            for j in range(c):
                flag = 0 if j >= ends[3] else (3 if j >= ends[2] else (2 if j >= ends[1] else 1))
                keys[j] = keys[j] * 4 + flag
            chosen = radix_sort(keys, tmp, c, key_bits)
            o, inv_scale = out_offsets[i], 1.0 / cell_scale[i]
            for j in range(c):
                g = chosen[j] >> 2
                genes[o + j] = g
                mu = 1.0 / min(inv_mean[kind, g] * inv_scale * inv_boost[chosen[j] & 3], 1.0)
                v = _count(mu, value_bits[o - out_offsets[0] + j])
                values[o + j] = min(v, 65535.0)
            counts[i] = c
    return counts


class Model:
    """Global structure of a corpus (genes, plates, labels, marker sets) and its chunk generator."""

    def __init__(
        self,
        num_cells: int,
        num_genes: int,
        seed: int,
        num_plates: int | None,
        mean_nnz: float,
        marker_fraction: tuple[float, float, float] = MARKER_FRACTION,
        program_fraction: float = PROGRAM_FRACTION,
    ) -> None:
        num_plates = max(2, min(14, num_cells // 2000)) if num_plates is None else num_plates
        if not (0 < num_cells < 10**9 and 1 <= num_plates <= num_cells and num_genes >= 1 and mean_nnz > 0):
            raise ValueError(
                "need 0 < num_cells < 1e9, 1 <= num_plates <= num_cells, num_genes >= 1 and mean_nnz > 0"
            )
        if len(marker_fraction) != 3 or not all(0 <= f for f in marker_fraction) or sum(marker_fraction) >= 1:
            raise ValueError(f"marker_fraction must be 3 shares >= 0 summing below 1, got {marker_fraction}")
        if not 0 <= program_fraction <= 1:
            raise ValueError(f"program_fraction must lie in [0, 1], got {program_fraction}")
        rng = np.random.default_rng([seed, _SETUP_STREAM])
        self.seed, self.num_cells, self.num_genes, self.mean_nnz = seed, num_cells, num_genes, mean_nnz
        self.marker_fraction = tuple(float(f) for f in marker_fraction)
        self.program_fraction = float(program_fraction)
        # genes: popularity rank -> gene id is a fixed random permutation; Zipf weights 1 / rank
        base = rng.permutation(num_genes).astype(np.int32)
        weights = 1.0 / np.arange(1, num_genes + 1)
        self.cdf = np.ceil(np.cumsum(weights) / weights.sum() * 2.0**32).astype(np.int64)
        self.cdf[-1] = 2**32  # a 32-bit draw x maps to the first rank with cdf > x
        self.shift = 32 - min(32, int(np.ceil(np.log2(max(num_genes, 2)))) + 2)
        buckets = np.arange(2 ** (32 - self.shift), dtype=np.int64) << self.shift
        self.guide = np.searchsorted(self.cdf, buckets, side="right").astype(np.int32)
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
        self.names = {
            "drug": ["DMSO_TF"] + [f"drug_{d:02d}" for d in range(1, n_drugs)],
            "cell_type": [f"cell_line_{t:02d}" for t in range(n_types)],
            "batch": [f"plate_{p:02d}" for p in range(num_plates)],
        }
        self.codes = {
            "batch": np.repeat(np.arange(num_plates), sizes).astype(np.int16),
            "drug": np.empty(num_cells, np.int16),
            "cell_type": np.empty(num_cells, np.int16),
        }
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
        sets = [
            rng.choice(
                candidates, width if s < n_drugs + n_types else min(_BATCH_GENES, width), replace=False
            )
            for s in range(n_drugs + n_types + num_plates)
        ]
        self.marker_genes = base[np.stack([np.resize(s, width) for s in sets])]
        self.set_offset = np.array([0, n_drugs, n_drugs + n_types], np.int64)
        self.genes = pd.DataFrame(
            {
                "gene_token_id": np.arange(num_genes, dtype=np.int32),
                "ensembl_id": [f"ENSG{i:011d}" for i in range(num_genes)],
                "gene_name": [f"GENE{i}" for i in range(num_genes)],
                "chromosome": _CHROMS[np.minimum(rng.geometric(0.09, num_genes) - 1, _CHROMS.size - 1)],
                "gene_type": np.where(rng.random(num_genes) < 0.85, "protein_coding", "lncRNA"),
            }
        )
        # expression programs, as real cell types differ: each type moves a share of the genes a cell
        # expresses (the top ~mean_nnz ranks) to the tail and takes as many tail genes up in their
        # place (which genes are expressed), and scales the excess count of the same share of all its
        # genes by a log-normal fold change (how much), so its Geneformer ranks and scGPT bins differ
        self.rank_to_gene = np.tile(base, (n_types, 1))
        head = min(num_genes, max(1, round(mean_nnz)))
        swaps = min(round(self.program_fraction * head), num_genes - head)
        for t in range(n_types if swaps else 0):
            up = head + rng.choice(num_genes - head, swaps, replace=False)
            down = rng.choice(head, swaps, replace=False)
            row = self.rank_to_gene[t]
            row[up], row[down] = row[down], row[up]
        ranks = np.argsort(self.rank_to_gene, axis=1)  # ranks[t, gene]: the gene's rank in type t
        excess = 40.0 / np.sqrt(ranks + 1.0)  # mean count 1 + excess falls with rank
        if self.program_fraction > 0:
            changed = rng.random((n_types, num_genes)) < self.program_fraction
            excess *= np.exp(np.where(changed, rng.normal(0.0, 1.0, (n_types, num_genes)), 0.0))
        self.inv_mean = 1.0 / (1.0 + excess)

    def obs_codes(self, rows: slice) -> dict[str, tuple[list[str], np.ndarray]]:
        """Categories and integer codes of every string obs column for ``rows``."""
        cell_type = self.codes["cell_type"][rows]
        zeros = np.zeros(cell_type.size, np.int16)
        return {
            "cell_type": (self.names["cell_type"], cell_type),
            "drug": (self.names["drug"], self.codes["drug"][rows]),
            "batch": (self.names["batch"], self.codes["batch"][rows]),
            "dataset": (["synthetic"], zeros),
            "tissue": (_TISSUES, cell_type % len(_TISSUES)),
            "organism": (["Homo sapiens"], zeros),
        }

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
        labels = [self.codes[key][start : start + n] for key in ("drug", "cell_type", "batch")]
        rows = self.set_offset + np.stack(labels, axis=1)
        zipf_draws = np.ceil(1.15 * np.interp(targets, self.pool_u, self.pool_m)).astype(np.int64)
        pool_sizes = draws.sum(axis=1) + zipf_draws + 32
        out_offsets = np.concatenate([[0], np.cumsum(targets)])
        genes, values = np.empty(out_offsets[-1], np.int32), np.empty(out_offsets[-1], np.float32)
        counts = np.empty(n, np.int64)
        for b in range(0, n, SUB_BATCH):
            s = slice(b, min(b + SUB_BATCH, n))
            pool_offsets = np.concatenate([[0], np.cumsum(pool_sizes[s])])
            pool = rng.integers(0, 2**32, pool_offsets[-1], dtype=np.uint32)
            bits = rng.integers(0, 2**32, out_offsets[s.stop] - out_offsets[b], dtype=np.uint32)
            counts[s] = _sample_cells(
                targets[s],
                pool_offsets,
                pool,
                bits,
                out_offsets[b : s.stop + 1],
                self.cdf,
                self.guide,
                self.shift,
                self.rank_to_gene,
                self.inv_mean,
                self.marker_genes,
                labels[1][s],
                rows[s],
                draws[s],
                cell_scale[s],
                genes,
                values,
            )
        if (counts < targets).any():  # a pool ran dry (rare): drop the unfilled slots
            slot = np.arange(out_offsets[-1]) - np.repeat(out_offsets[:-1], targets)
            keep = slot < np.repeat(counts, targets)
            genes, values = genes[keep], values[keep]
        return np.concatenate([[0], np.cumsum(counts)]), genes, values


def cell_ids_at(rows: np.ndarray) -> pa.StringArray:
    """Vectorised ``f"c{row:09d}"`` for each of ``rows``."""
    n = rows.size
    chars = np.empty((n, 10), np.uint8)
    chars[:, 0] = ord("c")
    chars[:, 1:] = rows.astype(np.int64)[:, None] // 10 ** np.arange(8, -1, -1) % 10 + ord("0")
    offsets = np.arange(0, 10 * (n + 1), 10, dtype=np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(chars))


def cell_ids(start: int, n: int) -> pa.StringArray:
    """Vectorised ``f"c{row:09d}"`` for rows ``start .. start + n - 1``."""
    return cell_ids_at(np.arange(start, start + n))


def create_csr(parent: h5py.Group, name: str, shape: tuple[int, int]) -> h5py.Group:
    """An empty, growable CSR matrix ``parent[name]`` in anndata's on-disk format."""
    x = parent.create_group(name)
    x.attrs.update({"encoding-type": "csr_matrix", "encoding-version": "0.1.0", "shape": list(shape)})
    x.create_dataset("data", (0,), maxshape=(None,), dtype=np.float32, chunks=(1 << 18,))
    x.create_dataset("indices", (0,), maxshape=(None,), dtype=np.int32, chunks=(1 << 18,))
    x.create_dataset("indptr", data=np.zeros(shape[0] + 1, np.int64))
    return x


def append_csr(x: h5py.Group, start: int, offsets: np.ndarray, indices: np.ndarray, data: np.ndarray) -> None:
    """Append CSR rows ``start ..`` (``offsets`` from 0) to a matrix made by `create_csr`."""
    n = offsets.size - 1
    old = x["data"].shape[0]
    for name, arr in (("data", data), ("indices", indices)):
        x[name].resize((old + arr.size,))
        x[name][old:] = arr
    x["indptr"][start + 1 : start + n + 1] = offsets[1:] + old

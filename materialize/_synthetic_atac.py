"""The ATAC modality of the synthetic corpus (`materialize._synthetic_multimodal`): a peak table over
GRCh38 and each cell's accessible peaks and values.

The peak table, popularity and cell-type peak sets come from ``np.random.default_rng([seed,
_ATAC_STREAM, 1])``, which cells have ATAC and their order from ``[seed, _ATAC_STREAM, 3]``. A
cell's peaks and values are a pure function of ``(seed, cell index)`` whatever the order or
chunking: a numba kernel draws them from a counter-based SplitMix64 stream keyed by
``SeedSequence([seed, _ATAC_STREAM, 2])`` and the cell index.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
from numba import njit, prange

from omicsio_jax.format import mix64

from ._synthetic_model import Model, radix_sort

_ATAC_STREAM = 2**32 - 3  # rng streams [seed, _ATAC_STREAM, 1 | 2 | 3] of the ATAC modality
_TYPE_PEAKS, _TYPE_SHARE = 1000, 0.1  # peaks per cell-type set; share of a cell's draws from its set
_ATAC_VALUES = (0.80, 0.95, 0.99)  # cumulative P(value <= 1, 2, 3); the rest is 4
_MIN_PEAKS = 200  # per-cell accessible peaks are clipped to [min(200, hi), hi], hi = num_peaks // 10
_PHI = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64 increment
_VALUE_SALT = np.uint64(0x6A09E667F3BCC909)  # separates a cell's value stream from its peak stream
_CHROM_LENGTHS = {  # GRCh38, bp; peaks are spread over them in proportion
    "chr1": 248956422,
    "chr2": 242193529,
    "chr3": 198295559,
    "chr4": 190214555,
    "chr5": 181538259,
    "chr6": 170805979,
    "chr7": 159345973,
    "chr8": 145138636,
    "chr9": 138394717,
    "chr10": 133797422,
    "chr11": 135086622,
    "chr12": 133275309,
    "chr13": 114364328,
    "chr14": 107043718,
    "chr15": 101991189,
    "chr16": 90338345,
    "chr17": 83257441,
    "chr18": 80373285,
    "chr19": 58617616,
    "chr20": 64444167,
    "chr21": 46709983,
    "chr22": 50818468,
    "chrX": 156040895,
    "chrY": 57227415,
}
_MAX_PEAKS = 1_000_000
ATAC_SCHEMA = pa.schema(
    [
        ("cell_id", pa.string()),
        ("peak_token_id", pa.list_(pa.int32())),
        ("peak_accessibility", pa.list_(pa.float32())),
        ("dataset", pa.string()),
    ]
)
PEAK_SCHEMA = pa.schema(
    [
        ("peak_token_id", pa.int32()),
        ("chrom", pa.string()),
        ("start", pa.int64()),
        ("end", pa.int64()),
        ("peak_name", pa.string()),
    ]
)


@njit(parallel=True, cache=True, nogil=True)
def _atac_targets(
    cells: np.ndarray, key: np.uint64, log_mean: float, sigma: float, lo: int, hi: int
) -> np.ndarray:
    """Accessible peaks wanted by each cell: log-normal from draws 0 and 1 of its stream, clipped."""
    out = np.empty(cells.size, np.int64)
    for i in prange(cells.size):
        s = mix64(key ^ (np.uint64(cells[i]) * _PHI))
        u1 = (np.float64(mix64(s) >> np.uint64(11)) + 0.5) * 2.0**-53
        u2 = np.float64(mix64(s + _PHI) >> np.uint64(11)) * 2.0**-53
        z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
        out[i] = min(max(np.int64(np.rint(np.exp(log_mean + sigma * z))), lo), hi)
    return out


@njit(parallel=True, cache=True, nogil=True)
def _atac_cells(
    cells: np.ndarray,
    cell_types: np.ndarray,
    key: np.uint64,
    targets: np.ndarray,
    out_offsets: np.ndarray,
    cdf: np.ndarray,
    guide: np.ndarray,
    shift: int,
    rank_to_peak: np.ndarray,
    type_ranks: np.ndarray,
    type_share: int,
    thresholds: np.ndarray,
    peaks: np.ndarray,
    values: np.ndarray,
) -> np.ndarray:
    """Draw sorted unique peak ids and small counts for each cell of ``cells``.

    Cell ``i`` gets up to ``targets[i]`` entries from ``out_offsets[i]``; returns how many it got.
    Its stream (``key``, ``cells[i]``) continues after the two draws of `_atac_targets`: each
    64-bit draw picks, by its low half, its cell type's peak set (``< type_share``) or the
    Zipf popularity law (inverse CDF of its high half, as the RNA genes), until ``targets[i]``
    distinct peaks are found (or ``32 * targets[i] + 1024`` draws). Values come from a second
    stream of the cell, one draw per sorted peak, against the cumulative ``thresholds``.
    """
    n, num_peaks, set_size = cells.size, rank_to_peak.size, type_ranks.shape[1]
    counts = np.zeros(n, np.int64)
    bits = max(1, int(np.ceil(np.log2(max(num_peaks, 2)))))
    size = max(1, targets.max())
    mask = np.uint64(0xFFFFFFFF)
    n_blocks = min(n, 64)
    for b in prange(n_blocks):
        stamp = np.full(num_peaks, -1, np.int32)  # stamp[rank] == i: rank already in cell i
        keys, tmp = np.empty(size, np.int32), np.empty(size, np.int32)
        for i in range(b * n // n_blocks, (b + 1) * n // n_blocks):
            k, c, d = targets[i], 0, 0
            s0 = mix64(key ^ (np.uint64(cells[i]) * _PHI))
            s = s0 + np.uint64(2) * _PHI
            limit = 32 * k + 1024
            while c < k and d < limit:  # branch-free dedup, as in the RNA kernel
                x = mix64(s)
                s += _PHI
                d += 1
                high = np.int64(x >> np.uint64(32))
                if np.int64(x & mask) < type_share:
                    r = type_ranks[cell_types[i], (high * set_size) >> 32]
                else:
                    r = guide[high >> shift]
                    while cdf[r] <= high:
                        r += 1
                new = stamp[r] != i
                stamp[r], keys[c] = i, r
                c += new
            for j in range(c):
                keys[j] = rank_to_peak[keys[j]]
            chosen = radix_sort(keys, tmp, c, bits)
            o, sv = out_offsets[i], mix64(s0 ^ _VALUE_SALT)
            for j in range(c):
                peaks[o + j] = chosen[j]
                u = np.int64(mix64(sv + np.uint64(j) * _PHI) >> np.uint64(32))
                v = 1.0
                for t in thresholds:
                    v += u >= t
                values[o + j] = v
            counts[i] = c
    return counts


def peak_table(rng: np.random.Generator, num_peaks: int) -> pd.DataFrame:
    """``num_peaks`` non-overlapping peaks of 300–1000 bp spread over GRCh38, sorted by chromosome
    (karyotype order: chr1 … chr22, chrX, chrY) then start; ``peak_token_id`` is the row."""
    names = list(_CHROM_LENGTHS)
    lengths = np.array(list(_CHROM_LENGTHS.values()), np.int64)
    per_chrom = rng.multinomial(num_peaks, lengths / lengths.sum())
    widths = rng.integers(300, 1001, num_peaks)
    starts, first = np.empty(num_peaks, np.int64), 0
    for n, length in zip(per_chrom, lengths, strict=True):
        w = widths[first : first + n]
        free = length - 20_000 - int(w.sum()) - n  # 10 kb clear at each end, >= 1 bp between peaks
        gaps = np.sort(rng.integers(0, free, n))
        starts[first : first + n] = 10_000 + gaps + np.concatenate([[0], np.cumsum(w[:-1] + 1)])[:n]
        first += n
    chrom = np.repeat(np.array(names), per_chrom)
    ends = starts + widths
    return pd.DataFrame(
        {
            "peak_token_id": np.arange(num_peaks, dtype=np.int32),
            "chrom": chrom,
            "start": starts,
            "end": ends,
            "peak_name": [
                f"{c}:{s}-{e}" for c, s, e in zip(chrom, starts.tolist(), ends.tolist(), strict=True)
            ],
        }
    )


def _zipf_guide(n: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Inverse-CDF tables of Zipf weights ``1 / rank`` over ``n`` ranks, as `Model` builds them."""
    weights = 1.0 / np.arange(1, n + 1)
    cdf = np.ceil(np.cumsum(weights) / weights.sum() * 2.0**32).astype(np.int64)
    cdf[-1] = 2**32
    shift = 32 - min(32, int(np.ceil(np.log2(max(n, 2)))) + 2)
    buckets = np.arange(2 ** (32 - shift), dtype=np.int64) << shift
    return cdf, np.searchsorted(cdf, buckets, side="right").astype(np.int32), shift


class AtacModel:
    """Peaks, their popularity and cell-type sets, which cells have ATAC and in which order."""

    def __init__(self, model: Model, num_peaks: int, mean_nnz: float, fraction: float, shuffle: bool) -> None:
        if not (1 <= num_peaks <= _MAX_PEAKS and mean_nnz > 0 and 0.0 <= fraction <= 1.0):
            raise ValueError(
                f"need 1 <= num_peaks <= {_MAX_PEAKS:,}, atac_mean_nnz > 0 and 0 <= atac_fraction <= 1"
            )
        self.model, self.num_peaks, self.mean_nnz = model, num_peaks, mean_nnz
        rng = np.random.default_rng([model.seed, _ATAC_STREAM, 1])
        self.peaks = peak_table(rng, num_peaks)
        self.rank_to_peak = rng.permutation(num_peaks).astype(np.int32)
        self.cdf, self.guide, self.shift = _zipf_guide(num_peaks)
        n_types = len(model.names["cell_type"])
        lo = min(2000, num_peaks // 10)  # cell-type peaks lie away from the always-open head
        width = min(_TYPE_PEAKS, max(1, (num_peaks - lo) // 4))
        self.type_ranks = np.stack(
            [rng.choice(np.arange(lo, num_peaks), width, replace=False) for _ in range(n_types)]
        ).astype(np.int32)
        self.key = np.random.SeedSequence([model.seed, _ATAC_STREAM, 2]).generate_state(1, np.uint64)[0]
        rng = np.random.default_rng([model.seed, _ATAC_STREAM, 3])
        self.order = np.flatnonzero(rng.random(model.num_cells) < fraction)
        if shuffle:
            self.order = rng.permutation(self.order)
        self.hi = max(1, num_peaks // 10)
        self.lo = min(_MIN_PEAKS, self.hi)

    def cells(self, cells: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """ATAC of the cells with these indices, in this order; returns CSR ``(offsets, peaks, values)``."""
        sigma = 0.6
        targets = _atac_targets(
            cells, self.key, np.log(self.mean_nnz) - sigma**2 / 2, sigma, self.lo, self.hi
        )
        out_offsets = np.concatenate([[0], np.cumsum(targets)])
        peaks, values = np.empty(out_offsets[-1], np.int32), np.empty(out_offsets[-1], np.float32)
        thresholds = np.array([round(t * 2.0**32) for t in _ATAC_VALUES], np.int64)
        counts = _atac_cells(
            cells,
            self.model.codes["cell_type"][cells],
            self.key,
            targets,
            out_offsets,
            self.cdf,
            self.guide,
            self.shift,
            self.rank_to_peak,
            self.type_ranks,
            round(_TYPE_SHARE * 2.0**32),
            thresholds,
            peaks,
            values,
        )
        if (counts < targets).any():  # a cell ran out of draws (rare): drop the unfilled slots
            slot = np.arange(out_offsets[-1]) - np.repeat(out_offsets[:-1], targets)
            keep = slot < np.repeat(counts, targets)
            peaks, values = peaks[keep], values[keep]
        return np.concatenate([[0], np.cumsum(counts)]), peaks, values

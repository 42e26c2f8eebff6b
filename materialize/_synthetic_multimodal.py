"""Further modalities of the synthetic corpus: splice layers, ATAC peaks and a MuData file.

Written by `make_synthetic_corpus(multimodal=True)` beside ``cells.parquet``, one table per
modality keyed by ``cell_id``:

- ``rna_layers_{spliced,unspliced,ambiguous}.parquet``: the RNA counts split per cell and gene
  (shares ``LAYER_SHARES``), so the three layers sum exactly to ``cells.parquet``; rows are the
  RNA's, in its order, each listing only its nonzero entries. Chunk ``i`` of the RNA is split
  from ``np.random.default_rng([seed, _LAYER_STREAM, i])``.
- ``peaks.parquet`` (the peak feature table) and ``atac_cells.parquet``: accessible peaks of a
  seeded fraction of the cells, by default in a seeded random order (not the RNA's), so a reader
  has to join on ``cell_id``. The peak table, popularity and cell-type peak sets come from
  ``np.random.default_rng([seed, _ATAC_STREAM, 1])``, which cells have ATAC and their order from
  ``[seed, _ATAC_STREAM, 3]``. A cell's peaks and values are a pure function of ``(seed, cell
  index)`` whatever the order or chunking: a numba kernel draws them from a counter-based
  SplitMix64 stream keyed by ``SeedSequence([seed, _ATAC_STREAM, 2])`` and the cell index.
- ``cells.h5mu``: both modalities in MuData's on-disk format, built with the ``mudata`` package
  (imported lazily: a test/demo extra), so it holds every nonzero in memory — for small corpora.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from numba import njit, prange
from tqdm import tqdm

from omicsio_jax.format import mix64

from ._synthetic_model import SUB_BATCH, Model, append_csr, cell_ids_at, create_csr, radix_sort

LAYERS = ("spliced", "unspliced", "ambiguous")
LAYER_SHARES = (0.75, 0.20, 0.05)  # expected share of a count in each layer
ATAC_CHUNK = 4096  # ATAC cells per generation chunk and at most per row group
_LAYER_STREAM = 2**32 - 2  # rng streams [seed, _LAYER_STREAM, chunk index] of the splice split
_ATAC_STREAM = 2**32 - 3  # rng streams [seed, _ATAC_STREAM, 1 | 2 | 3] of the ATAC modality
_SMALL = 16  # counts up to this are split one molecule at a time, larger ones by two binomials
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
LAYER_SCHEMA = pa.schema(
    [
        ("cell_id", pa.string()),
        ("gene_token_id", pa.list_(pa.int32())),
        ("gene_expression", pa.list_(pa.float32())),
    ]
)
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


def _list_writer(path: Path, schema: pa.Schema) -> pq.ParquetWriter:
    """A parquet writer with the encodings of ``cells.parquet``: delta-coded ids, split-byte values."""
    ids, values = (f.name for f in schema if pa.types.is_list(f.type))
    flat = [f.name for f in schema if not pa.types.is_list(f.type)]
    return pq.ParquetWriter(
        path,
        schema,
        compression="zstd",
        use_dictionary=[f.name for f in schema if f.name == "dataset"],
        write_statistics=flat,
        column_encoding={
            f"{ids}.list.element": "DELTA_BINARY_PACKED",
            f"{values}.list.element": "BYTE_STREAM_SPLIT",
        },
    )


def _lists(offsets: np.ndarray, ids: np.ndarray, values: np.ndarray) -> tuple[pa.ListArray, pa.ListArray]:
    """CSR rows as two list arrays sharing ``offsets``."""
    list_offsets = pa.array(offsets.astype(np.int32))
    return (
        pa.ListArray.from_arrays(list_offsets, pa.array(ids)),
        pa.ListArray.from_arrays(list_offsets, pa.array(values)),
    )


# --------------------------------------------------------------------------- splice layers


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


# --------------------------------------------------------------------------- ATAC


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


# --------------------------------------------------------------------------- writer


def _stack_csr(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], num_cols: int):
    """One scipy CSR matrix of consecutive CSR row blocks."""
    import scipy.sparse as sp

    indptr, base = [np.zeros(1, np.int64)], 0
    for offsets, _, _ in parts:
        indptr.append(offsets[1:].astype(np.int64) + base)
        base += int(offsets[-1])
    data = np.concatenate([p[2] for p in parts]) if parts else np.empty(0, np.float32)
    indices = np.concatenate([p[1] for p in parts]) if parts else np.empty(0, np.int32)
    indptr = np.concatenate(indptr)
    return sp.csr_matrix((data, indices, indptr), shape=(indptr.size - 1, num_cols))


class MultimodalWriter:
    """Writes the further modalities of a corpus beside its RNA (see the module docstring).

    `rna_chunk` is called for each RNA chunk in order (from the writer thread), `write_atac` once
    after the RNA, then `finish` (the ``.h5mu``) and, always, `close`.
    """

    def __init__(
        self,
        model: Model,
        atac: AtacModel,
        out: Path,
        *,
        write_parquet: bool,
        h5ad: h5py.File | None,
        write_h5mu: bool,
        row_group_size: int,
    ) -> None:
        self.model, self.atac, self.row_group_size = model, atac, row_group_size
        self.peaks_path = out / "peaks.parquet"
        pq.write_table(
            pa.Table.from_pandas(self.atac.peaks, schema=PEAK_SCHEMA, preserve_index=False),
            self.peaks_path,
            compression="zstd",
        )
        self.layer_paths = (
            {name: out / f"rna_layers_{name}.parquet" for name in LAYERS} if write_parquet else None
        )
        self.atac_path = out / "atac_cells.parquet" if write_parquet else None
        self.h5mu_path = out / "cells.h5mu" if write_h5mu else None
        self.writers: dict[str, pq.ParquetWriter] = {}
        self.h5ad = h5ad
        self.parts: dict[str, list] | None = {k: [] for k in ("X", *LAYERS)} if write_h5mu else None
        self.atac_parts: list = []
        self.atac_nnz = 0
        for name, path in (self.layer_paths or {}).items():
            self.writers[name] = _list_writer(path, LAYER_SCHEMA)
        if h5ad is not None:
            group = h5ad.create_group("layers")
            group.attrs.update({"encoding-type": "dict", "encoding-version": "0.1.0"})
            for name in LAYERS:
                create_csr(group, name, (model.num_cells, model.num_genes))

    def rna_chunk(
        self, index: int, start: int, offsets: np.ndarray, genes: np.ndarray, values: np.ndarray
    ) -> None:
        """Split RNA chunk ``index`` (cells from ``start``) into layers and write them."""
        layers = split_layers(self.model.seed, index, offsets, genes, values)
        ids = cell_ids_at(np.arange(start, start + offsets.size - 1)) if self.writers else None
        for name, (lo, lg, lv) in zip(LAYERS, layers, strict=True):
            if name in self.writers:
                gene_lists, value_lists = _lists(lo, lg, lv)
                table = pa.Table.from_arrays([ids, gene_lists, value_lists], schema=LAYER_SCHEMA)
                self.writers[name].write_table(table, row_group_size=self.row_group_size)
            if self.h5ad is not None:
                append_csr(self.h5ad["layers"][name], start, lo, lg, lv)
        if self.parts is not None:
            self.parts["X"].append((offsets, genes, values))
            for name, layer in zip(LAYERS, layers, strict=True):
                self.parts[name].append(layer)

    def _write_atac_chunk(
        self,
        writer: pq.ParquetWriter | None,
        cells: np.ndarray,
        offsets: np.ndarray,
        peaks: np.ndarray,
        values: np.ndarray,
    ) -> None:
        if writer is not None:
            peak_lists, value_lists = _lists(offsets, peaks, values)
            dataset = pa.array(["synthetic"] * cells.size, pa.string())
            table = pa.Table.from_arrays(
                [cell_ids_at(cells), peak_lists, value_lists, dataset], schema=ATAC_SCHEMA
            )
            writer.write_table(table, row_group_size=self.row_group_size)
        if self.parts is not None:
            self.atac_parts.append((offsets, peaks, values))

    def write_atac(self, progress: bool = False) -> None:
        """Generate and write the ATAC cells, ``ATAC_CHUNK`` at a time in the ATAC order."""
        order = self.atac.order
        writer = _list_writer(self.atac_path, ATAC_SCHEMA) if self.atac_path else None
        if writer is not None:
            self.writers["atac"] = writer
        with (
            ThreadPoolExecutor(1) as pool,
            tqdm(total=order.size, unit="cell", desc="atac", disable=not progress) as bar,
        ):
            pending: Future | None = None  # writing chunk i overlaps generating chunk i + 1
            for first in range(0, order.size, ATAC_CHUNK):
                cells = order[first : first + ATAC_CHUNK]
                offsets, peaks, values = self.atac.cells(cells)
                self.atac_nnz += int(offsets[-1])
                if pending is not None:
                    pending.result()
                pending = pool.submit(self._write_atac_chunk, writer, cells, offsets, peaks, values)
                bar.update(cells.size)
            if pending is not None:
                pending.result()

    def finish(self, obs: pd.DataFrame, var: pd.DataFrame) -> None:
        """Write ``cells.h5mu`` (if asked) from the collected chunks; ``obs`` / ``var`` are the RNA's."""
        if self.h5mu_path is None:
            return
        import anndata as ad
        import mudata as md  # imported here: only the .h5mu needs it (a test/demo extra)

        num_genes = self.model.num_genes
        rna = ad.AnnData(
            X=_stack_csr(self.parts["X"], num_genes),
            obs=obs,
            var=var,
            layers={name: _stack_csr(self.parts[name], num_genes) for name in LAYERS},
        )
        self.parts = None
        order = self.atac.order
        atac_obs = pd.DataFrame(
            {"dataset": pd.Categorical.from_codes(np.zeros(order.size, np.int8), categories=["synthetic"])},
            index=pd.Index(cell_ids_at(order).to_pylist(), name="cell_id"),
        )
        peaks = self.atac.peaks.set_index("peak_name").astype({"chrom": "category"})
        atac = ad.AnnData(X=_stack_csr(self.atac_parts, self.atac.num_peaks), obs=atac_obs, var=peaks)
        self.atac_parts = []
        with md.set_options(pull_on_update=False):
            md.MuData({"rna": rna, "atac": atac}).write(self.h5mu_path)

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()
        self.writers = {}

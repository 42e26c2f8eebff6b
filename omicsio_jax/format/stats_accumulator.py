"""`StatsAccumulator`: records streamed, in row order, into `GeneStats` and per-cell ``n_counts`` /
``n_genes`` (at materialize, and by ``omicsio-materialize stats``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from omicsio_jax.core.buffers import RowBuffers, aligned_empty, read_only
from omicsio_jax.format import codec
from omicsio_jax.format.gene_stats import TARGET_SUM, GeneStats
from omicsio_jax.format.stats_kernels import (
    NUM_BINS,
    accumulate,
    apply_hist,
    clear_spans,
    count_dtype,
    empty_span,
)


class StatsAccumulator:
    """Streams records (in row order) into `GeneStats` and per-cell ``n_counts`` / ``n_genes``.

    Float sums are kept per shard and added to the total when a shard ends, so the result depends
    only on the shard layout, not on how rows arrive in batches or parts.

    The histogram table holds ``count_dtype`` counts (uint16: 140 MB for 62,710 genes, where
    uint32 took 281 MB, each worker's first partition faulting all of it in); an increment past
    the type's largest count (65,535 cells of one partition in one bin of one gene) is kept
    aside and added back at `finish`, so the counts are exact whatever the partition's size.
    """

    def __init__(self, num_genes: int, shard_cells: int, count_dtype=np.uint16):
        self.shard_cells = shard_cells
        self.rows = 0
        self.hist = np.zeros((num_genes, NUM_BINS), count_dtype)
        self._spilled: list[np.ndarray] = []  # codes of increments past a full bin
        self.span = empty_span(num_genes)  # each gene's bins in use
        self.total = np.zeros((num_genes, 8), np.float64)  # the 6 sums, n_cells, padding
        self.partial = aligned_empty((num_genes, 8), np.float64)  # a gene's sums in one cache line
        self.partial[:] = 0
        self._buffers = RowBuffers(keep=5)  # a batch's histogram codes (3 arrays), `save`'s CSR (2)

    def add(
        self, buf: np.ndarray, starts: np.ndarray, *, check: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        """Add the records of the next rows; return their ``n_counts`` (float64) and ``n_genes`` (int32).
        ``check=False`` skips `codec.check_records` for records this process has just encoded
        (materialize: a second pass over every entry, ~0.2 ns each, that cannot find a fault)."""
        if check:
            u8, u32, f32 = codec.Records.check(buf, starts, self.hist.shape[0]).views(self.hist.shape[0])
        else:
            u8, u32, f32 = codec.views(read_only(buf))
        n = len(starts) - 1
        n_counts = np.empty(n, np.float64)
        n_genes = np.empty(n, np.int32)
        need = int(u32[starts[:-1] // 4 + 1].sum()) if n else 0  # entries per record header: ≥ the nonzeros
        codes, tmp = self._buffers.array(need, np.uint32), self._buffers.array(need, np.uint32)
        spill = self._buffers.array(need, np.uint32)
        done = 0
        while done < n:
            room = self.shard_cells - self.rows % self.shard_cells
            take = min(room, n - done)
            m = accumulate(
                u8,
                u32,
                f32,
                starts[done : done + take],
                TARGET_SUM,
                n_counts[done : done + take],
                n_genes[done : done + take],
                self.partial,
                codes,
            )
            spilled = apply_hist(codes, m, tmp, self.hist, self.span, spill)
            if spilled:
                self._spilled.append(spill[:spilled].copy())
            done += take
            self.rows += take
            if self.rows % self.shard_cells == 0:
                self._end_shard()
        return n_counts, n_genes

    def _end_shard(self) -> None:
        self.total += self.partial
        self.partial[:] = 0

    def finish(self) -> GeneStats:
        """The statistics of the rows added; the accumulator is empty again, ready for the next rows
        (only the spans of bins in use are zeroed: its table stays mapped, not faulted in anew)."""
        return self._finish(None)

    def save(self, path: str | Path) -> None:
        """`finish` and `GeneStats.save` to ``path`` in one, the histogram's CSR built in memory reused
        from one call to the next (a partition's statistics, the next partition's accumulator)."""
        self._finish(self._buffers).save(path)

    def _finish(self, buffers: RowBuffers | None) -> GeneStats:
        if self.rows % self.shard_cells:
            self._end_shard()
        stats = GeneStats.from_dense(
            self.rows, self.total[:, 6], self.total[:, :6].T, self.hist, self.span, buffers
        )  # copies (the histogram into ``buffers``' memory, if given)
        clear_spans(self.hist, self.span)
        if self._spilled:
            _add_spilled(stats, np.concatenate(self._spilled))
            self._spilled = []
        self.total[:] = 0
        self.rows = 0
        return stats


def _add_spilled(stats: GeneStats, codes: np.ndarray) -> None:
    """Add to ``stats``' histogram the increments `apply_hist` spilled (their bins, full, are among
    its entries); the counts widen to the narrowest type that holds them."""
    codes, extra = np.unique(codes, return_counts=True)
    genes = np.repeat(np.arange(stats.num_genes, dtype=np.uint32), np.diff(stats.hist_ptr))
    entries = (genes << np.uint32(11)) | stats.hist_bins  # the codes of the entries, ascending
    counts = stats.hist_counts.astype(np.int64)
    counts[np.searchsorted(entries, codes)] += extra
    stats.hist_counts = counts.astype(count_dtype(int(counts.max())))

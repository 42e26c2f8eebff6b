"""Partitions: the shard-aligned cell ranges a materialize run is split into.

Partition ``p`` holds the cells of shard ``p``: rows ``[p·shard_cells, (p+1)·shard_cells)`` of the
input (fewer in the last one). Partitions are written independently (`_partition.write_partition`,
on this process, a local process pool or a Dask cluster) and joined by `_finalize.Finalizer`;
since a shard's bytes depend only on its own cells, the dataset is byte-identical however the
partitions were spread.

A table input locates its partitions by ``spans``: ``(file index, first file row, end file row)``
triples (``end`` None: to the end of the file), in ``file_row_number`` terms, so that each worker
reads only its row groups. Other inputs (``.h5ad``, a ``--query``) use the cell range directly
(a ``--query`` cannot be split: it is one partition).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

Span = tuple[int, int, int | None]


@dataclasses.dataclass(frozen=True)
class Partition:
    """Cells ``[first_cell, first_cell + num_cells)`` of the input, written as the shards from
    ``index`` on (one shard, except for an input that cannot be split)."""

    index: int
    first_cell: int
    num_cells: int
    spans: tuple[Span, ...] | None = None

    @property
    def end_cell(self) -> int:
        return self.first_cell + self.num_cells

    def describe(self) -> str:
        return f"partition {self.index} (cells {self.first_cell:,}..{self.end_cell - 1:,})"


def cell_ranges(num_cells: int, shard_cells: int) -> list[tuple[int, int]]:
    """``(first_cell, num_cells)`` of each shard of a dataset of ``num_cells`` cells."""
    return [(first, min(shard_cells, num_cells - first)) for first in range(0, num_cells, shard_cells)]


def whole_partitions(num_cells: int, shard_cells: int) -> list[Partition]:
    """Partitions located by their cell range alone (``.h5ad`` rows)."""
    return [Partition(i, first, n) for i, (first, n) in enumerate(cell_ranges(num_cells, shard_cells))]


def partitions_from_counts(row_counts: Sequence[int], shard_cells: int) -> list[Partition]:
    """Partitions of files holding ``row_counts`` rows each, every row a cell (no filter)."""
    total = sum(int(c) for c in row_counts)
    return [
        range_of_counts(row_counts, first, n, index)
        for index, (first, n) in enumerate(cell_ranges(total, shard_cells))
    ]


def range_of_counts(row_counts: Sequence[int], first: int, num_cells: int, index: int = 0) -> Partition:
    """Cells ``[first, first + num_cells)`` of files holding ``row_counts`` rows each, located by spans."""
    bases = [0]
    for count in row_counts:
        bases.append(bases[-1] + int(count))
    end, spans = first + num_cells, []
    for f in range(len(row_counts)):
        lo, hi = max(first, bases[f]), min(end, bases[f + 1])
        if lo < hi:
            spans.append((f, lo - bases[f], None if hi == bases[f + 1] else hi - bases[f]))
    return Partition(index, first, num_cells, tuple(spans))


def partitions_from_boundaries(
    num_cells: int, shard_cells: int, boundaries: Sequence[tuple[int, int]], num_files: int
) -> list[Partition]:
    """Partitions of a filtered input: ``boundaries[k]`` is ``(file index, file row)`` of the first
    cell of partition ``k`` (the ``k·shard_cells``-th row passing the filter, in scan order). A
    partition spans from its boundary to the next one; rows between that fail the filter are
    dropped again by the worker, which applies the same filter."""
    ranges = cell_ranges(num_cells, shard_cells)
    if len(boundaries) != len(ranges):
        msg = f"internal error: {len(boundaries)} partition boundaries for {len(ranges)} partitions"
        raise RuntimeError(msg)
    out = []
    for index, (first, n) in enumerate(ranges):
        f0, r0 = boundaries[index]
        f1, r1 = boundaries[index + 1] if index + 1 < len(boundaries) else (num_files, 0)
        spans = []
        for f in range(f0, min(f1, num_files - 1) + 1):
            lo = r0 if f == f0 else 0
            hi = r1 if f == f1 else None
            if hi is None or hi > lo:
                spans.append((f, lo, hi))
        out.append(Partition(index, first, n, tuple(spans)))
    return out

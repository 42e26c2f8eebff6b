"""The Grain pipeline of the loader: one dataset element per fetch, flat-mapped into minibatches.

    MapDataset.range(fetches)            global fetch index i → (epoch, fetch) = divmod(i, per epoch)
      .map(read_fetch)                   sorted batched read (range reads) + in-memory shuffle
      .to_iter_dataset(ReadOptions)      fetches read ahead by a few threads (order preserved)
    FlatMapIterDataset(split)            ≤ fetch_factor minibatches per fetch (record lists)
      .map(densify)                      one numba decode pass + numba scatter → numpy host batch

Every element is a pure function of its index, so Grain's iterator state ({"next_index": ...}
plus the position inside the fetch) restores the stream bit-exactly, with any number of threads.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable, Sequence

import grain
import numpy as np
from grain.experimental import FlatMapIterDataset, FlatMapTransform

from . import _codec
from ._fetch import FetchedCells, FetchReader
from ._sampling import SamplingPlan


@dataclasses.dataclass(frozen=True)
class MiniBatch:
    """One host's minibatch before decoding: its records, global rows and the padding mask."""

    records: list[bytes]
    rows: np.ndarray  # global rows, -1 for padding
    mask: np.ndarray  # True for real cells
    epoch: int

    def joined(self) -> tuple[np.ndarray, np.ndarray]:
        """The records in one buffer: ``(buf, starts)`` with record ``i`` at ``buf[starts[i]:starts[i+1]]``."""
        return _codec.join_records(self.records)


class _EpochOrders:
    """Caches the global order of the most recent epochs (one permutation per epoch)."""

    def __init__(self, plan: SamplingPlan, keep: int = 2):
        self._plan, self._keep = plan, keep
        self._orders: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def __call__(self, epoch: int) -> np.ndarray:
        with self._lock:
            order = self._orders.get(epoch)
            if order is None:
                order = self._plan.epoch_order(epoch)
                self._orders[epoch] = order
                for old in sorted(self._orders)[: -self._keep]:
                    del self._orders[old]
            return order


class _SplitFetch(FlatMapTransform):
    """Cut a fetch's cells (already in serving order) into minibatches of ``local_batch`` rows."""

    def __init__(self, local_batch: int, max_fan_out: int):
        self.local_batch = local_batch
        self.max_fan_out = max_fan_out

    def flat_map(self, cells: FetchedCells) -> Sequence[MiniBatch]:
        out, b = [], self.local_batch
        for k in range(cells.fetch.num_batches):
            lo, hi = k * b, min((k + 1) * b, len(cells.rows))
            rows = cells.rows[lo:hi]
            mask = np.ones(b, dtype=bool)
            if hi - lo < b:  # the padded last batch of a tail
                rows = np.concatenate([rows, np.full(b - (hi - lo), -1, dtype=rows.dtype)])
                mask[hi - lo :] = False
            out.append(MiniBatch(cells.records[lo:hi], rows, mask, cells.fetch.epoch))
        return out


def build_pipeline(
    plan: SamplingPlan,
    reader: FetchReader,
    *,
    host: int,
    num_epochs: int | None,
    densify: Callable[[MiniBatch], object],
    num_threads: int = 2,
    prefetch_fetches: int = 2,
) -> grain.IterDataset:
    """The loader's stream of host batches as a Grain `IterDataset` (compose it freely)."""
    per_epoch = plan.fetches_per_epoch
    total = per_epoch * num_epochs if num_epochs is not None else sys.maxsize
    orders = _EpochOrders(plan)

    def read_fetch(index: int) -> FetchedCells:
        epoch, j = divmod(index, per_epoch)
        return reader(plan.fetch(epoch, j, host, order=orders(epoch)))

    fetches = grain.MapDataset.range(total).map(read_fetch)
    options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch_fetches)
    batches = FlatMapIterDataset(fetches.to_iter_dataset(options), _SplitFetch(plan.local_batch, plan.fetch_factor))
    return batches.map(densify)

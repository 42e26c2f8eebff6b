"""Sampling plans: which cells each fetch of each host reads, as pure functions of (seed, epoch, fetch).

An epoch is a global *order* of cells, identical on every host:

- ``block``: contiguous blocks of ``block_size`` cells in a random order (scDataset's
  BlockShuffling); ``block_size=1`` with ``fetch_factor=1`` is true random sampling.
- ``stream``: file order, nothing shuffled. ``stream_buffer``: file order, shuffled inside each
  fetch (a shuffle buffer of ``fetch_factor × batch_size`` cells).
- ``weighted``: blocks drawn with replacement, with probability proportional to the sum of
  their cells' weights (scDataset's BlockWeightedSampling): as many cells as the data's blocks
  hold (``ceil(n / block_size) × block_size``), drawn until the order holds that many (a drawn
  short last block falls short) and cut there.
- ``class_balanced``: ``mixture``'s blocks with each cell weighted by 1 / (cells of its class): where
  classes interleave, blocks are as short as their runs (fixed blocks across classes brought a
  rare class's cells with the common one's: at ``block_size`` 16, a class of 2% of the cells came at
  3% of the batches, not 25% of four classes).
- ``mixture``: ``weighted`` whose blocks never hold cells of two weights: runs of cells of one
  weight (a group's cells, each weighted ``weights[g] / cells of g``) cut into blocks of up to
  ``block_size``, each drawn with probability proportional to its cells' weight, so every cell is
  drawn in proportion to its weight whatever the block size and the groups' sizes (a block across
  two groups would bring the cells of the lighter one with the heavier one's weight, and a group's
  short last block would be drawn as if whole); as many cells as ``rows``, drawn until the order
  holds that many and cut there.

The order is cut into fetches of ``fetch_factor × local_batch`` cells, dealt round-robin to the
hosts (fetch ``k`` goes to host ``k % num_hosts``, as in scDataset's Appendix B), so every host
reads disjoint cells and takes the same number of steps. What does not fill a whole round of
fetches (the *tail*) is split into ``num_hosts`` equal contiguous parts; with
``drop_remainder=True`` each part yields only full batches, so fewer than
``batch_size + num_hosts`` cells per epoch are left out (different ones every epoch, since the
order changes); with ``drop_remainder=False`` the last batch of each part is padded and masked.

Randomness comes from ``np.random.default_rng([seed, stream, epoch, ...])`` with a distinct
``stream`` tag per use, never from sums of seeds.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math

import numpy as np

from omicsio_jax.core.errors import OmicsIOError

SAMPLINGS = ("block", "stream", "stream_buffer", "weighted", "class_balanced", "mixture")
_WEIGHTED = ("weighted", "class_balanced", "mixture")  # the samplings that take one weight per cell
# the weighted samplings whose blocks are runs of cells of one weight (a group's, a class's): a drawn
# block brings no cell of another weight, so groups and classes come in exactly their proportions
_RUN_BLOCKS = ("class_balanced", "mixture")
_ORDER_STREAM = 0
_FETCH_STREAM = 1


@dataclasses.dataclass(frozen=True)
class Fetch:
    """One fetch of one host: cells to read (in epoch order) and how to cut them into batches.

    ``rows`` are global cell rows; ``shuffle_key`` seeds the in-memory shuffle (None = keep
    order); ``num_batches`` minibatches of ``local_batch`` rows are taken from the (shuffled)
    rows, the last one padded if ``padded``.
    """

    epoch: int
    index: int
    rows: np.ndarray
    shuffle_key: tuple[int, ...] | None
    num_batches: int
    padded: bool


class AllRows:
    """The rows ``0..n-1`` of a dataset, as a plan over every cell samples from them, without holding
    them (``np.arange(10**8)`` is 0.8 GB): indexed like that array (a slice, positions, one position)."""

    dtype = np.dtype(np.int64)

    def __init__(self, n: int):
        self.n = int(n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key):
        if isinstance(key, slice):
            return np.arange(*key.indices(self.n), dtype=np.int64)
        positions = np.asarray(key)
        if positions.ndim == 0:
            i = int(positions)
            if not -self.n <= i < self.n:
                msg = f"position {i} out of range for {self.n} rows"
                raise IndexError(msg)
            return np.int64(i % self.n)
        return positions.astype(np.int64, copy=True)  # position p is row p

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.arange(self.n, dtype=dtype or np.int64)

    def digest(self) -> str:
        """The digest `SamplingPlan.describe` takes of ``np.arange(n)``, computed in pieces."""
        h = hashlib.sha256()
        for first in range(0, self.n, 1 << 23):
            h.update(np.arange(first, min(self.n, first + (1 << 23)), dtype=np.int64).data)
        return h.hexdigest()[:16]


class EpochOrder:
    """An epoch's order of ``rows``: the cells of ``blocks`` (block numbers, in order; a block is
    ``block_size`` consecutive entries of ``rows``, the last one maybe shorter, or with
    ``block_starts`` the entries from ``block_starts[k]`` to ``block_starts[k + 1]``), the first
    ``num_cells`` of them if given, or ``rows`` as they are (``blocks=None``). ``order[a:b]`` makes
    only the cells asked for."""

    def __init__(
        self,
        rows: np.ndarray,
        blocks: np.ndarray | None,
        block_size: int,
        num_cells: int | None = None,
        block_starts: np.ndarray | None = None,
    ):
        self.rows, self.blocks, self.block_size = rows, blocks, block_size
        self.block_starts = block_starts
        if blocks is None:
            self._ends = None
            self._len = len(rows)
        else:
            self._ends = np.cumsum(self._lengths(blocks))  # position after each chosen block
            self._len = int(self._ends[-1]) if len(blocks) else 0
        if num_cells is not None:
            self._len = min(self._len, num_cells)

    def _starts(self, blocks: np.ndarray) -> np.ndarray:
        return blocks * self.block_size if self.block_starts is None else self.block_starts[blocks]

    def _lengths(self, blocks: np.ndarray) -> np.ndarray:
        if self.block_starts is not None:
            return self.block_starts[blocks + 1] - self.block_starts[blocks]
        starts = blocks * self.block_size
        return np.minimum(starts + self.block_size, len(self.rows)) - starts

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, span: slice) -> np.ndarray:
        if not isinstance(span, slice) or span.step not in (None, 1):
            msg = "an epoch order is sliced with order[a:b]"
            raise TypeError(msg)
        begin, end, _ = span.indices(self._len)
        if self.blocks is None:
            return self.rows[begin:end]
        if end <= begin:
            return self.rows[:0]
        first = int(np.searchsorted(self._ends, begin, side="right"))  # the block holding position begin
        last = int(np.searchsorted(self._ends, end - 1, side="right"))  # ... and end - 1
        starts = self._starts(self.blocks[first : last + 1])
        lengths = self._lengths(self.blocks[first : last + 1])
        # positions in rows of every cell of these blocks, in block order
        offsets = np.repeat(starts - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
        cells = np.arange(lengths.sum()) + offsets
        skip = begin - (int(self._ends[first]) - int(lengths[0]))
        return self.rows[cells[skip : skip + end - begin]]


@dataclasses.dataclass(frozen=True)
class SamplingPlan:
    """Everything that decides the order of cells: the config half of the replay contract."""

    rows: np.ndarray | AllRows  # the cells sampled from (global rows, ascending)
    batch_size: int  # global batch size
    block_size: int
    fetch_factor: int
    seed: int
    sampling: str = "block"
    num_hosts: int = 1
    drop_remainder: bool = True
    weights: np.ndarray | None = None  # per entry of ``rows`` (weighted / class_balanced)

    def __post_init__(self) -> None:
        if self.sampling not in SAMPLINGS:
            msg = f"sampling must be one of {', '.join(SAMPLINGS)}; got {self.sampling!r}"
            raise OmicsIOError(msg)
        for name in ("batch_size", "block_size", "fetch_factor", "num_hosts"):
            if int(getattr(self, name)) < 1:
                msg = f"{name} must be a positive integer, got {getattr(self, name)!r}"
                raise OmicsIOError(msg)
        if self.batch_size % self.num_hosts:
            msg = (
                f"batch_size {self.batch_size} is the global batch: it must be divisible by the number of "
                f"hosts ({self.num_hosts}), e.g. batch_size={self.num_hosts * max(1, self.batch_size // self.num_hosts)}"
            )
            raise OmicsIOError(msg)
        if len(self.rows) == 0:
            msg = "cannot sample from an empty set of cells"
            raise OmicsIOError(msg)
        if self.sampling in _WEIGHTED:
            check_weights(self.sampling, self.weights, len(self.rows))

    @property
    def local_batch(self) -> int:
        return self.batch_size // self.num_hosts

    @property
    def fetch_cells(self) -> int:
        """Cells one host reads per fetch."""
        return self.fetch_factor * self.local_batch

    @property
    def epoch_cells(self) -> int:
        """Length of an epoch's order (for weighted sampling: as many cells as the data's blocks hold,
        ``ceil(n / block_size) × block_size``, whichever blocks are drawn)."""
        n = len(self.rows)
        if self.sampling == "weighted":
            return -(-n // self.block_size) * self.block_size
        return n

    @functools.cached_property
    def _run_blocks(self) -> np.ndarray:
        """A ``mixture``'s or ``class_balanced`` plan's blocks: where each starts among ``rows`` (and
        ``len(rows)`` last), every run of cells of one weight cut into blocks of up to ``block_size``."""
        n, b = len(self.weights), self.block_size
        change = np.flatnonzero(self.weights[1:] != self.weights[:-1]) + 1
        run_starts = np.concatenate(([0], change)).astype(np.int64)
        blocks = -(-(np.append(change, n) - run_starts) // b)  # per run
        within = np.arange(int(blocks.sum()), dtype=np.int64) - np.repeat(np.cumsum(blocks) - blocks, blocks)
        return np.append(np.repeat(run_starts, blocks) + within * b, n)

    @property
    def full_rounds(self) -> int:
        return self.epoch_cells // self.fetch_cells // self.num_hosts

    @property
    def tail_part(self) -> tuple[int, int]:
        """(smallest, largest) tail part a host gets."""
        tail = self.epoch_cells - self.full_rounds * self.num_hosts * self.fetch_cells
        return tail // self.num_hosts, -(-tail // self.num_hosts)

    @property
    def tail_batches(self) -> int:
        small, large = self.tail_part
        if self.drop_remainder:
            return small // self.local_batch
        return -(-large // self.local_batch)

    @property
    def fetches_per_epoch(self) -> int:
        """Fetches per host per epoch (the same on every host)."""
        return self.full_rounds + (1 if self.tail_batches else 0)

    @property
    def steps_per_epoch(self) -> int:
        return self.full_rounds * self.fetch_factor + self.tail_batches

    def order_of(self, epoch: int) -> EpochOrder:
        """The global order of cells for ``epoch`` (identical on every host), as its blocks: slices of it
        are made on demand, so a fetch never builds the whole epoch's order (0.8 GB at 10^8 cells)."""
        n, b = len(self.rows), self.block_size
        if self.sampling in ("stream", "stream_buffer"):
            return EpochOrder(self.rows, None, b)
        rng = np.random.default_rng([self.seed, _ORDER_STREAM, epoch])
        num_blocks = -(-n // b)
        if self.sampling == "block":
            blocks = rng.permutation(num_blocks)
        elif self.sampling in _RUN_BLOCKS:
            starts = self._run_blocks
            p = self.weights[starts[:-1]].astype(np.float64)  # a block's cells share one weight
            blocks = _draw_runs(rng, p / p.sum(), np.diff(starts), n)
            return EpochOrder(self.rows, blocks, b, n, block_starts=starts)
        else:
            block_weight = np.add.reduceat(self.weights.astype(np.float64), np.arange(0, n, b))
            blocks = _draw_blocks(
                rng, block_weight / block_weight.sum(), num_blocks * b - n, b, self.epoch_cells
            )
        return EpochOrder(self.rows, blocks, b, self.epoch_cells)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The global order of cells (rows) for ``epoch``, whole; identical on every host."""
        return self.order_of(epoch)[:]

    def fetch(self, epoch: int, index: int, host: int, order: EpochOrder | None = None) -> Fetch:
        """Fetch ``index`` (0 ≤ index < fetches_per_epoch) of ``host`` in ``epoch``."""
        if not 0 <= index < self.fetches_per_epoch:
            msg = f"fetch {index} out of range: an epoch has {self.fetches_per_epoch} fetches per host"
            raise IndexError(msg)
        order = self.order_of(epoch) if order is None else order
        shuffle = self.sampling != "stream"
        f, hosts = self.fetch_cells, self.num_hosts
        if index < self.full_rounds:
            k = index * hosts + host  # global fetch number: the same cells whoever reads them
            rows = order[k * f : (k + 1) * f]
            key = (self.seed, _FETCH_STREAM, epoch, k) if shuffle else None
            return Fetch(epoch, index, rows, key, self.fetch_factor, False)
        tail = order[self.full_rounds * hosts * f : self.epoch_cells]
        part = np.array_split(tail, hosts)[host]
        key = (self.seed, _FETCH_STREAM, epoch, self.full_rounds * hosts + host) if shuffle else None
        return Fetch(epoch, index, part, key, self.tail_batches, not self.drop_remainder)

    def serving_rows(self, fetch: Fetch) -> np.ndarray:
        """The cells of ``fetch`` in the order they are served, exactly ``num_batches × local_batch``
        of them: shuffled by its key, cut to whole batches, -1 for the padding of a padded tail."""
        rows = fetch.rows
        if fetch.shuffle_key is not None:
            rows = rows[np.random.default_rng(list(fetch.shuffle_key)).permutation(len(rows))]
        n = fetch.num_batches * self.local_batch
        if len(rows) >= n:
            return rows[:n]
        return np.concatenate([rows, np.full(n - len(rows), -1, rows.dtype)])

    def with_hosts(self, num_hosts: int) -> SamplingPlan:
        """The same plan dealt to ``num_hosts`` hosts (the epoch orders are the same)."""
        return dataclasses.replace(self, num_hosts=num_hosts)

    def describe(self) -> dict:
        """The plan as JSON-able config (rows and weights by checksum); not the number of hosts."""

        def digest(a: np.ndarray | AllRows | None) -> str | None:
            if isinstance(a, AllRows):
                return a.digest()
            # hashed through the buffer protocol: no copy (tobytes of 10^8 rows is 0.8 GB and 1.3 s)
            return None if a is None else hashlib.sha256(np.ascontiguousarray(a).data).hexdigest()[:16]

        return {
            "sampling": self.sampling,
            "batch_size": self.batch_size,
            "block_size": self.block_size,
            "fetch_factor": self.fetch_factor,
            "seed": self.seed,
            "drop_remainder": self.drop_remainder,
            "num_rows": len(self.rows),
            "rows": digest(self.rows),
            "weights": digest(self.weights),
            # class-balanced blocks are runs of one class (before, fixed blocks across classes): a
            # state saved with the old blocks stands in another order, and is refused
            **({"blocks": "one class each"} if self.sampling == "class_balanced" else {}),
        }


def _draw_blocks(
    rng: np.random.Generator, p: np.ndarray, short: int, block_size: int, cells: int
) -> np.ndarray:
    """`_draw` over blocks of ``block_size`` cells but the last, which lacks ``short`` cells (each time
    it is drawn, the order falls short). Without a short block this is the single draw it always was."""
    last = len(p) - 1
    mean = block_size - short * float(p[-1])  # cells a drawn block holds, on average (at least 1)
    return _draw(rng, p, cells, mean, lambda b: len(b) * block_size - short * np.count_nonzero(b == last))


def check_weights(sampling: str, weights: np.ndarray | None, num_rows: int) -> None:
    """Refuse weights that are not one per sampled cell, finite, non-negative and not all zero."""
    if weights is None or len(weights) != num_rows:
        msg = f"sampling={sampling!r} needs one weight per cell ({num_rows})"
        raise OmicsIOError(msg)
    if not np.all(np.isfinite(weights)) or np.any(weights < 0) or not np.any(weights > 0):
        msg = "weights must be finite, non-negative and not all zero"
        raise OmicsIOError(msg)


def _draw_runs(rng: np.random.Generator, p: np.ndarray, lengths: np.ndarray, cells: int) -> np.ndarray:
    """`_draw` over blocks of any ``lengths``."""
    return _draw(rng, p, cells, max(float(p @ lengths), 1.0), lambda b: int(lengths[b].sum()))


def _draw(rng: np.random.Generator, p: np.ndarray, cells: int, mean: float, held_by) -> np.ndarray:
    """Blocks drawn with replacement with probabilities ``p``: one per block, then more until they hold
    ``cells`` cells (``held_by(blocks)``: the cells those blocks hold; ``mean``: what a drawn block
    holds on average, which sizes each further draw)."""
    blocks = rng.choice(len(p), size=len(p), replace=True, p=p)
    held, drawn = held_by(blocks), [blocks]
    while held < cells:
        more = rng.choice(len(p), size=math.ceil((cells - held) / mean), replace=True, p=p)
        held += held_by(more)
        drawn.append(more)
    return np.concatenate(drawn)


def class_weights(codes: np.ndarray) -> np.ndarray:
    """Per-cell weights 1 / (cells of its class); cells with a missing label (-1) get weight 0."""
    codes = np.asarray(codes)
    valid = codes >= 0
    counts = np.bincount(codes[valid]) if valid.any() else np.zeros(0, np.int64)
    weights = np.zeros(len(codes), dtype=np.float64)
    weights[valid] = 1.0 / counts[codes[valid]]
    return weights

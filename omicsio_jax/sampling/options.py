"""How a loader samples cells: small option objects that validate themselves (`Block`, `Random`, `Stream`,
`Weighted`, `ClassBalanced`, `Mixture`).

Each says how an epoch orders the cells and how that order is read: ``fetch_factor × batch_size``
cells per fetch, read in one sorted batched read and (except for `Stream`) shuffled in memory
before they are cut into minibatches. ``drop_remainder`` decides the epoch's last cells: False
serves every one, the last batch padded and masked. The loaders turn an option into a
`SamplingPlan` (`to_plan`), a pure function of ``(seed, epoch, fetch)``.

>>> oj.make_loader(ds, batch_size=1024, sampling=oj.Block(block_size=16, fetch_factor=64))  # doctest: +SKIP
>>> oj.make_loader(ds, batch_size=1024, sampling=oj.Stream(drop_remainder=False))          # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import ClassVar

import numpy as np

from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.sampling.plan import AllRows, SamplingPlan, check_weights, class_weights


def _check_positive(option: object, *names: str) -> None:
    for name in names:
        value = getattr(option, name)
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            msg = (
                f"{type(option).__name__}({name}=...) must be a positive integer, got {value!r}; "
                f"e.g. {type(option).__name__}({name}=16)"
            )
            raise OmicsIOError(msg)


class Sampling:
    """What every sampling option has (each is a frozen dataclass with its own fields): ``kind`` (the
    plan's name for it), ``block_size``, ``fetch_factor`` and ``drop_remainder``."""

    kind: ClassVar[str]
    block_size: int = 1
    fetch_factor: int
    drop_remainder: bool

    def _check(self, *positive: str) -> None:
        _check_positive(self, "fetch_factor", *positive)
        if not isinstance(self.drop_remainder, bool):
            msg = f"{type(self).__name__}(drop_remainder=...) must be True or False, got {self.drop_remainder!r}"
            raise OmicsIOError(msg)

    def _check_by(self, example: str) -> None:
        """``by`` names an obs column (the options that group cells by one)."""
        by = getattr(self, "by", None)
        if not isinstance(by, str) or not by:
            msg = f"{type(self).__name__}(by=...) takes a categorical obs column, e.g. {example}; got {by!r}"
            raise OmicsIOError(msg)

    def for_rows(self, rows: np.ndarray) -> tuple[np.ndarray, Sampling]:
        """A loader's ``rows=`` (checked row numbers, in any order, maybe repeated) as the plan samples
        from them, ascending and each once, and this option for those rows."""
        return np.unique(rows), self

    def cell_weights(self, rows: np.ndarray | AllRows, obs: Callable[[str], np.ndarray]) -> np.ndarray | None:
        """Per-cell weights of ``rows`` (None: no weights); ``obs(name)`` gives an obs column."""
        return None

    def to_plan(
        self,
        rows: np.ndarray | AllRows,
        *,
        batch_size: int,
        seed: int,
        num_hosts: int,
        obs: Callable[[str], np.ndarray],
    ) -> SamplingPlan:
        """The sampling plan over ``rows`` (global rows, ascending) for a global ``batch_size``."""
        return self._plan(rows, self.cell_weights(rows, obs), batch_size, seed, num_hosts)

    def _plan_over_weighted_cells(
        self, rows, weights: np.ndarray, batch_size: int, seed: int, num_hosts: int
    ) -> SamplingPlan:
        """The plan over the cells of ``rows`` with a weight above 0 (blocks are runs of those cells,
        so a drawn block brings none of weight 0)."""
        keep = weights > 0
        kept = np.flatnonzero(keep) if isinstance(rows, AllRows) else np.asarray(rows)[keep]
        return self._plan(kept.astype(np.int64), weights[keep], batch_size, seed, num_hosts)

    def _plan(self, rows, weights, batch_size: int, seed: int, num_hosts: int) -> SamplingPlan:
        return SamplingPlan(
            rows,
            batch_size,
            self.block_size,
            self.fetch_factor,
            seed,
            self.kind,
            num_hosts,
            self.drop_remainder,
            weights,
        )


@dataclasses.dataclass(frozen=True)
class Block(Sampling):
    """scDataset's block shuffling: contiguous blocks of ``block_size`` cells in a random order, read
    ``fetch_factor × batch_size`` cells at a time and shuffled in memory. The default sampling.

    Bigger blocks read faster, smaller ones mix more labels into a minibatch (`entropy_bounds`,
    `tune`); ``Block(1, 1)`` is true random sampling, one cell per read.
    """

    kind: ClassVar[str] = "block"
    block_size: int = 16
    fetch_factor: int = 64
    drop_remainder: bool = dataclasses.field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        self._check("block_size")


@dataclasses.dataclass(frozen=True)
class Random(Sampling):
    """True random sampling: every cell its own block (``Block(block_size=1)``), read
    ``fetch_factor × batch_size`` cells at a time."""

    kind: ClassVar[str] = "block"
    fetch_factor: int = 64
    drop_remainder: bool = dataclasses.field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        self._check()


@dataclasses.dataclass(frozen=True)
class Stream(Sampling):
    """Cells in dataset order, ``fetch_factor × batch_size`` per read; with ``shuffle`` each such fetch
    is shuffled in memory (a shuffle buffer), else nothing is. For inference and evaluation,
    ``Stream(drop_remainder=False)`` serves every cell once."""

    shuffle: bool = False
    fetch_factor: int = 64
    drop_remainder: bool = dataclasses.field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        self._check()

    @property
    def kind(self) -> str:  # type: ignore[override]
        return "stream_buffer" if self.shuffle else "stream"


@dataclasses.dataclass(frozen=True, eq=False)
class Weighted(Sampling):
    """scDataset's weighted block sampling: blocks drawn with replacement with probability
    proportional to the sum of their cells' ``weights`` (one per sampled cell: per entry of the
    loader's ``rows``, else per cell of the dataset), as many cells as the data's blocks hold. A
    cell of weight 0 is no cell of the plan (never drawn, and its block's neighbours are the weighted
    cells around it), so an epoch holds as many cells as the blocks of the weighted cells.

    ``weights[i]`` is the weight of ``rows[i]`` in whatever order ``rows`` lists them (the plan
    samples from them ascending, each weight moved with its row); ``rows`` then lists each row
    once: a row listed twice is refused (its two weights would be ambiguous).
    """

    kind: ClassVar[str] = "weighted"
    weights: np.ndarray
    block_size: int = 16
    fetch_factor: int = 64
    drop_remainder: bool = dataclasses.field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        self._check("block_size")

    def for_rows(self, rows: np.ndarray) -> tuple[np.ndarray, Weighted]:
        weights = np.asarray(self.weights, dtype=np.float64)
        if weights.shape != rows.shape:
            msg = (
                f"Weighted has {weights.size} weights for {len(rows)} rows: pass one weight per entry of rows"
            )
            raise OmicsIOError(msg)
        unique, first, counts = np.unique(rows, return_index=True, return_counts=True)
        if len(unique) < len(rows):
            twice = unique[np.argmax(counts > 1)]
            msg = (
                f"rows lists row {twice} {counts.max()} times, and Weighted takes one weight per entry of rows: "
                "list each row once with its weight, e.g. rows, first = np.unique(rows, return_index=True) "
                "and weights[first] (or their sum per row)"
            )
            raise OmicsIOError(msg)
        return unique, dataclasses.replace(self, weights=weights[first])

    def cell_weights(self, rows, obs) -> np.ndarray:
        return np.asarray(self.weights, dtype=np.float64)

    def to_plan(self, rows, *, batch_size, seed, num_hosts, obs) -> SamplingPlan:
        """Weighted block sampling over the cells of weight above 0: a cell of weight 0 is never
        drawn, not even with the block of weighted cells it would otherwise share."""
        weights = self.cell_weights(rows, obs)
        check_weights(self.kind, weights, len(rows))  # every cell's, before those of weight 0 go
        return self._plan_over_weighted_cells(rows, weights, batch_size, seed, num_hosts)


@dataclasses.dataclass(frozen=True)
class ClassBalanced(Sampling):
    """Weighted block sampling with each cell weighted by 1 / (cells of its class in the obs column
    ``by``), so that every class is drawn about equally often; cells without a label are never drawn.
    A block holds cells of one class (up to ``block_size`` of a run of them, as `Mixture`'s blocks
    hold one group's): where a class's cells are contiguous its blocks are whole, where classes
    interleave (cell types within a sample) blocks are as short as their runs and reads come nearer
    one cell at a time. The classes are a
    categorical column's labels (a missing one: no label) or an integer column's values, each one a
    class (-1 too), as `split` groups them; a float column is refused."""

    kind: ClassVar[str] = "class_balanced"
    by: str
    block_size: int = 16
    fetch_factor: int = 64
    drop_remainder: bool = dataclasses.field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        self._check("block_size")
        self._check_by("ClassBalanced(by='cell_type')")

    def cell_weights(self, rows, obs) -> np.ndarray:
        # the loaders' obs gives each cell's class (`ObsOf.classes`); a plain callable, the classes' codes
        labels = np.asarray(getattr(obs, "classes", obs)(self.by))
        return class_weights(labels if isinstance(rows, AllRows) else labels[rows])

    def to_plan(self, rows, *, batch_size, seed, num_hosts, obs) -> SamplingPlan:
        """Weighted block sampling over the labelled cells (blocks are runs of those cells)."""
        weights = self.cell_weights(rows, obs)
        if not np.any(weights > 0):
            msg = f"ClassBalanced(by={self.by!r}): no cell among the rows sampled has a label in obs {self.by!r}"
            raise OmicsIOError(msg)
        return self._plan_over_weighted_cells(rows, weights, batch_size, seed, num_hosts)


@dataclasses.dataclass(frozen=True, eq=False)
class Mixture(Sampling):
    """A mixture of the groups of a categorical obs column (datasets, plates, assays): weighted
    block sampling over the cells of the groups named, each cell weighted ``weights[g] / (cells of
    g)``, so group ``g`` is drawn with probability ``weights[g] / sum(weights)``, whatever the
    groups' sizes and ``block_size``; groups not named are not drawn. A block holds cells of one
    weight (up to ``block_size`` of a run of one group's cells): where a group's cells are contiguous
    (each source of a collection is) its blocks are whole but for its last; where groups
    interleave, blocks are as short as their runs.

    >>> sampling = oj.Mixture(by="dataset_id", weights={"atlas_a": 0.6, "atlas_b": 0.4})  # doctest: +SKIP
    """

    kind: ClassVar[str] = "mixture"
    by: str
    weights: Mapping[str, float]
    block_size: int = 16
    fetch_factor: int = 64
    drop_remainder: bool = dataclasses.field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        self._check("block_size")
        self._check_by("Mixture(by='dataset_id', ...)")
        try:
            weights = {str(k): float(v) for k, v in dict(self.weights).items()}
        except (TypeError, ValueError):
            weights = {}
        if (
            not weights
            or not all(np.isfinite(w) and w >= 0 for w in weights.values())
            or not any(weights.values())
        ):
            msg = (
                f"Mixture(weights=...) maps groups of {self.by!r} to non-negative weights, not all zero, "
                f"e.g. {{'atlas_a': 0.6, 'atlas_b': 0.4}}; got {self.weights!r}"
            )
            raise OmicsIOError(msg)
        object.__setattr__(self, "weights", weights)

    def cell_weights(self, rows, obs) -> np.ndarray:
        codes = np.asarray(obs(self.by))
        categories = obs_categories(obs, self.by)
        unknown = sorted(set(self.weights) - set(categories))
        if unknown:
            msg = (
                f"Mixture names {', '.join(map(repr, unknown))}, not a group of obs {self.by!r} "
                f"(its groups: {', '.join(map(repr, categories[:10]))}{', ...' if len(categories) > 10 else ''})"
            )
            raise OmicsIOError(msg)
        codes = codes if isinstance(rows, AllRows) else codes[rows]
        per_group = np.array([self.weights.get(c, 0.0) for c in categories] + [0.0])  # last: no label
        size = np.bincount(np.where(codes < 0, len(categories), codes), minlength=len(categories) + 1)
        empty = [c for c, w, n in zip(categories, per_group, size, strict=False) if w > 0 and n == 0]
        if empty:
            which = "which has no cell" if len(empty) == 1 else "which have no cells"
            msg = f"Mixture gives weight to {', '.join(map(repr, empty))}, {which} among the rows sampled"
            raise OmicsIOError(msg)
        return (per_group / np.maximum(size, 1))[np.where(codes < 0, len(categories), codes)]

    def to_plan(self, rows, *, batch_size, seed, num_hosts, obs) -> SamplingPlan:
        """Weighted block sampling over the cells of the groups named, blocks cut within each group's
        runs (`SamplingPlan`'s ``mixture``: a drawn block brings no cell of another group)."""
        return self._plan_over_weighted_cells(rows, self.cell_weights(rows, obs), batch_size, seed, num_hosts)


def obs_categories(obs: Callable[[str], np.ndarray], name: str) -> list[str]:
    """The categories of the categorical obs ``name`` (the loaders' ``obs`` callable carries them as
    ``obs.categories(name)``)."""
    categories = getattr(obs, "categories", None)
    if categories is None:
        msg = f"obs {name!r}: this loader cannot tell a categorical column's groups"
        raise OmicsIOError(msg)
    return list(categories(name))


def as_sampling(sampling: Sampling | str) -> Sampling:
    """A sampling option from an option or the names ``"block"``, ``"random"``, ``"stream"`` (defaults)."""
    if isinstance(sampling, Sampling):
        return sampling
    named = {"block": Block, "random": Random, "stream": Stream}
    if sampling in named:
        return named[sampling]()
    msg = (
        f"sampling must be an option such as oj.Block(block_size=16, fetch_factor=64), oj.Random(), "
        f"oj.Stream(), oj.Weighted(weights), oj.ClassBalanced(by='cell_type') or oj.Mixture(by, weights), or one of "
        f"{', '.join(map(repr, named))}; got {sampling!r}"
    )
    raise OmicsIOError(msg)

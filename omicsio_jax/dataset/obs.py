"""A dataset's obs sidecars: `Categorical` columns, `ObsColumns` (each column loaded on first access)
and `rows_where` (the rows whose column takes given values)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from omicsio_jax.core.errors import DatasetFormatError, UnknownNameError
from omicsio_jax.format.manifest import ObsEntry


@dataclasses.dataclass(frozen=True)
class Categorical:
    """A categorical obs column: ``codes[i]`` indexes ``categories`` (-1 = missing). Indexed as a
    numpy array is: a cell gives its label (``None`` where missing), a slice, a mask or an array of
    rows a `Categorical` of those cells with the same categories.

    >>> cell_type = ds.obs["cell_type"]                      # doctest: +SKIP
    >>> cell_type[0], cell_type[:100].labels()               # doctest: +SKIP
    """

    codes: np.ndarray
    categories: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.codes)

    def __getitem__(self, rows) -> str | None | Categorical:
        codes = self.codes[rows]
        if np.ndim(codes) == 0:
            return None if codes < 0 else self.categories[int(codes)]
        return Categorical(codes, self.categories)

    def labels(self) -> np.ndarray:
        """The labels as a numpy object array (``None`` where missing)."""
        table = np.array([*self.categories, None], dtype=object)
        return table[np.where(self.codes < 0, len(self.categories), self.codes)]


class ObsColumns(Mapping):
    """A dataset's obs columns by name, each loaded on first access (``local_path``: the local file of
    one of the dataset's files, checked against the manifest's size, `Dataset.local_path`; a remote
    dataset's is downloaded then).

    A column is checked as it loads, at the cost of its header: it holds ``num_cells`` rows, and a
    categorical column has the manifest's number of categories. A column replaced by one of
    another length or set of categories is a `DatasetFormatError` naming the file and
    ``omicsio-materialize verify`` (which checks every byte against its SHA-256), not rows that are
    not the dataset's cells. Its values are not hashed here: a column of 10⁸ cells is
    memory-mapped, and read only where the loaders gather from it."""

    def __init__(
        self,
        entries: Sequence[ObsEntry],
        local_path: Callable[[str], Path],
        *,
        num_cells: int | None = None,
        where: str = "the dataset",
    ):
        self._entries, self._local_path = {e.name: e for e in entries}, local_path
        self._num_cells, self._where = num_cells, where
        self._loaded: dict[str, Categorical | np.ndarray] = {}

    def __getitem__(self, name: str) -> Categorical | np.ndarray:
        column = self._loaded.get(name)
        if column is None:
            entry = self._entries.get(name)
            if entry is None:
                msg = f"obs column {name!r} not in {self._where}; available: {', '.join(self._entries) or '(none)'}"
                raise UnknownNameError(msg)
            categorical = entry.kind == "categorical"
            rows_path = f"obs/{name}.codes.npy" if categorical else f"obs/{name}.npy"
            try:
                values = np.load(self._local_path(rows_path), mmap_mode="r")
            except ValueError as e:  # a header that is not numpy's (a pickled array, garbage)
                self._damaged(rows_path, str(e))
            if values.ndim != 1:
                self._damaged(rows_path, f"an array of shape {values.shape}, not one value per cell")
            if self._num_cells is not None and len(values) != self._num_cells:
                self._damaged(rows_path, f"{len(values):,} rows, the dataset has {self._num_cells:,} cells")
            column = values
            if categorical:
                categories_path = f"obs/{name}.categories.json"
                try:
                    categories = tuple(json.loads(self._local_path(categories_path).read_text()))
                except (ValueError, UnicodeDecodeError) as e:
                    self._damaged(categories_path, f"not a JSON list of categories ({e})")
                if entry.num_categories is not None and len(categories) != entry.num_categories:
                    self._damaged(
                        categories_path,
                        f"{len(categories)} categories, the manifest says {entry.num_categories}",
                    )
                # codes past the categories would reach a model as labels it has no class for (one pass
                # over the codes, once a process)
                low, high = (int(values.min()), int(values.max())) if len(values) else (-1, -1)
                if low < -1 or high >= len(categories):
                    self._damaged(
                        rows_path,
                        f"codes {low}..{high}, where -1..{len(categories) - 1} are a cell's categories",
                    )
                column = Categorical(values, categories)
            column = self._loaded.setdefault(name, column)
        return column

    def _damaged(self, relpath: str, problem: str) -> None:
        raise DatasetFormatError.run_verify(
            self._where, f"{self._where}: the obs sidecar {relpath} is damaged: {problem}"
        )

    def __contains__(self, name: object) -> bool:  # without loading it
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"obs({', '.join(self._entries)})"


def rows_where(
    obs: Mapping[str, Categorical | np.ndarray],
    column: str,
    values: Sequence[str | float],
    *,
    invert: bool = False,
) -> np.ndarray:
    """`omicsio_jax.Dataset.rows_where` over ``obs`` (a dataset's `ObsColumns`, which names a missing
    column)."""
    data = obs[column]
    if isinstance(data, Categorical):
        if set(data.categories) <= {"false", "true"}:  # a bool column (kept as a categorical: nulls)
            values = [str(v).lower() if isinstance(v, (bool, np.bool_)) else v for v in values]
        unknown = [v for v in values if v not in data.categories]
        if unknown:
            msg = f"{unknown!r} not among the categories of {column!r}: {list(data.categories)[:10]}"
            raise UnknownNameError(msg)
        keep = np.isin(data.codes, [data.categories.index(v) for v in values])
    else:
        wanted = np.asarray(values)
        if data.dtype.kind in "mM":  # dates and times: text such as "2024-05-01" is no match for them
            try:
                wanted = np.asarray(values, dtype=data.dtype)
            except (TypeError, ValueError) as e:
                example = '["2024-05-01"]' if data.dtype.kind == "M" else '[np.timedelta64(90, "s")]'
                msg = f"{list(values)!r} are not {data.dtype} values of obs {column!r}; e.g. {example}"
                raise TypeError(msg) from e
        elif data.dtype.kind in "biuf" and any(isinstance(v, str | bytes) for v in values):  # "5" is not 5
            msg = f"{list(values)!r} are not numbers, and obs {column!r} holds {data.dtype} values"
            raise TypeError(msg)
        keep = np.isin(np.asarray(data), wanted)
    return np.flatnonzero(~keep if invert else keep)

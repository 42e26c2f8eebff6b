"""The obs columns a loader carries in its batches, and the ones its sampling groups cells by.

A loader's ``obs=`` names columns (`obs_names`); a batch carries a categorical column as int32
codes (-1 = missing) and a numeric one as numbers (`obs_column`), an integer column only where the
batch's dtype holds every value (`carried_column`). `ObsOf` is the dataset's obs as the sampling
options read them (`ClassBalanced`'s classes, `Mixture`'s groups).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.dataset.dataset import Dataset
from omicsio_jax.dataset.obs import Categorical


def obs_names(obs: str | Sequence[str]) -> tuple[str, ...]:
    """A loader's ``obs=`` as column names: a list of names, or one name (``obs="cell_type"``: that
    column, not one per letter)."""
    names = (obs,) if isinstance(obs, str) else tuple(obs)
    for name in names:
        if not isinstance(name, str):
            msg = (
                f"obs takes obs column names, e.g. obs='cell_type' or obs=['cell_type', 'donor']; "
                f"got {name!r} in {obs!r}"
            )
            raise TypeError(msg)
    return names


def obs_column(ds: Dataset, name: str) -> Categorical | np.ndarray:
    """Obs column ``name`` as a batch carries it: a `Categorical` (its codes, -1 = missing) or the
    values of a numeric one; dates and times are refused, naming how to look them up instead."""
    column = ds.obs[name]  # (a missing one: `UnknownNameError` naming those there are)
    if not isinstance(column, Categorical) and column.dtype.kind in "mM":
        msg = (
            f"obs {name!r} of {ds.path} holds {column.dtype} values, which batches do not carry (they carry "
            f"categories and numbers): look them up by the batch's rows, ds.obs[{name!r}][np.asarray(batch.index)]"
        )
        raise OmicsIOError(msg)
    return column


def carried_column(ds: Dataset, name: str, numbers: type[np.number]) -> Categorical | np.ndarray:
    """`obs_column`, an integer column refused unless ``numbers``, the dtype its batches carry it as
    (the disk loaders' int32, a panel's float32), holds each of its values exactly (-2³¹…2³¹-1 in
    int32, ±2²⁴ in float32): batches would hold other numbers (10¹² wraps to -727379968 in int32)."""
    column = obs_column(ds, name)
    if isinstance(column, Categorical) or column.dtype.kind not in "iu" or not len(column):
        return column
    if np.can_cast(column.dtype, numbers):
        return column
    if np.dtype(numbers).kind in "iu":
        lo, hi = int(np.iinfo(numbers).min), int(np.iinfo(numbers).max)
    else:
        hi = 2 ** (np.finfo(numbers).nmant + 1)  # the integers a float holds exactly
        lo = -hi
    low, high = int(column.min()), int(column.max())
    if low < lo or high > hi:
        msg = (
            f"obs {name!r} of {ds.path} holds {column.dtype} values from {low} to {high}, which do not fit the "
            f"{np.dtype(numbers)} batch ({lo} to {hi}): leave it out of obs= and read it by the batch's rows, "
            f"ds.obs[{name!r}][np.asarray(batch.index)], or store it as a categorical (text) column"
        )
        raise OmicsIOError(msg)
    return column


def codes(column: Categorical | np.ndarray) -> np.ndarray:
    """A categorical column's codes, a numeric column's values."""
    return column.codes if isinstance(column, Categorical) else column


class ObsOf:
    """A dataset's obs as sampling options see them: ``obs(name)`` the codes of a categorical column
    (or a numeric one's values), ``obs.classes(name)`` the classes `ClassBalanced` balances,
    ``obs.categories(name)`` a categorical column's labels."""

    def __init__(self, ds: Dataset):
        self.ds = ds

    def __call__(self, name: str) -> np.ndarray:
        return codes(obs_column(self.ds, name))

    def classes(self, name: str) -> np.ndarray:
        """Each cell's class in obs ``name`` (-1: none): a categorical column's codes (-1: missing), an
        integer column's values as codes ``0 … k-1``, each distinct value a class (as `split` groups
        them); other columns are refused."""
        column = obs_column(self.ds, name)
        if isinstance(column, Categorical):
            return column.codes
        if column.dtype.kind in "iu":
            return np.unique(column, return_inverse=True)[1]
        msg = (
            f"ClassBalanced(by={name!r}): obs {name!r} of {self.ds.path} is numeric ({column.dtype} values), not "
            "classes: balance by a categorical obs or an integer one (each value a class), or weight the cells "
            "yourself with oj.Weighted(weights)"
        )
        raise OmicsIOError(msg)

    def categories(self, name: str) -> tuple[str, ...]:
        column = obs_column(self.ds, name)
        if not isinstance(column, Categorical):
            msg = f"obs {name!r} of {self.ds.path} is numeric: group by a categorical column"
            raise OmicsIOError(msg)
        return column.categories

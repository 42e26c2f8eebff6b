"""Exceptions of the training application, under omicsio_jax's root `OmicsIOError`."""

from __future__ import annotations

import omicsio_jax as oj


class TrainError(oj.OmicsIOError):
    """A user mistake in a training run (bad option, dataset or checkpoint directory)."""


class PredicateError(TrainError, ValueError):
    """An ``--eval-where`` predicate that the small parser does not accept."""


class CheckpointMismatchError(TrainError, oj.StateMismatchError):
    """A checkpoint written by another run (other dataset or config) was asked to be resumed."""

"""Exception hierarchy: one root, a few specific subclasses."""

from __future__ import annotations


class OmicsIOError(Exception):
    """Root of every error raised on purpose by omicsio_jax and materialize."""


class DataValidationError(OmicsIOError, ValueError):
    """Input data breaks an invariant of the list-column schema.

    The message names the file, the row and cell_id, and the broken invariant.
    """


class DatasetFormatError(OmicsIOError):
    """A materialized dataset directory is missing, incomplete or corrupted."""


class StateMismatchError(OmicsIOError, ValueError):
    """Restored loader/trainer state does not match the live dataset or config."""

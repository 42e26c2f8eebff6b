"""Exception hierarchy: one root, a few specific subclasses."""

from __future__ import annotations

import importlib


class OmicsIOError(Exception):
    """Root of every error raised on purpose by omicsio_jax and materialize."""


class DataValidationError(OmicsIOError, ValueError):
    """Input data breaks an invariant of the list-column schema.

    The message names the file, the row and cell_id, and the broken invariant.
    """


class UnknownNameError(OmicsIOError, KeyError):
    """A name that is not there (an obs column, a category, a modality, a gene): a ``KeyError``, so
    that mappings keep their ``in`` and ``.get``, whose message names what there is instead."""

    def __str__(self) -> str:  # KeyError would show the message quoted
        return str(self.args[0])


class DatasetFormatError(OmicsIOError):
    """A materialized dataset directory is missing, incomplete or corrupted."""

    @classmethod
    def run_verify(cls, dataset: object, problem: str) -> DatasetFormatError:
        """The error of a damaged file or shard of ``dataset`` (a folder or URL): ``problem``, then the
        command that checks every byte of it, on one line."""
        return cls(f"{problem}; run `omicsio-materialize verify {dataset}`".replace("\n", " "))


class DatasetReplacedError(OmicsIOError):
    """A local dataset was replaced (``omicsio-materialize --overwrite``) or removed while open: its
    folder is another, and the files there are not the ones the open handle's manifest lists. Open
    it again. (On object storage a handle keeps the generation it opened: `ObjectChangedError` once
    that is deleted.)"""


class StateMismatchError(OmicsIOError, ValueError):
    """Restored loader/trainer state does not match the live dataset or config."""


class MissingExtraError(OmicsIOError, ImportError):
    """A feature needs an optional dependency (an extra of the package) that cannot be imported."""

    @classmethod
    def require(cls, module: str, extra: str, feature: str):
        """``module``, imported; else this error, one line naming ``feature``, why the import failed
        (missing, or a version clash) and the extra that installs it."""
        try:
            return importlib.import_module(module)
        except ImportError as e:
            msg = f"{feature} needs {module} ({type(e).__name__}: {e}): pip install 'omicsio_jax[{extra}]'"
            raise cls(msg) from e


require = MissingExtraError.require  # the layers' and materialize's spelling of it

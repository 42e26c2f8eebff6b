"""A local dataset's files checked against their manifest sizes as they are first opened (`ListedFiles`)."""

from __future__ import annotations

import os
from pathlib import Path

from omicsio_jax.core.errors import DatasetFormatError, DatasetReplacedError
from omicsio_jax.format.manifest import Manifest


class ListedFiles:
    """The files a local dataset's manifest lists, each refused by `checked` if its size on disk is
    not the manifest's: a sidecar cut short by an interrupted copy, or replaced by another, is a
    `DatasetFormatError` naming it and ``omicsio-materialize verify``, not the error of whatever
    reader meets it first (Arrow's footer error, NumPy's mmap error) nor values read short.

    One ``stat`` per file and process (a file that passed is not looked at again), not a hash:
    the obs columns of 10⁸ cells are memory-mapped and read only where the loaders gather, and
    ``verify`` checks every byte against its SHA-256. A listed file that is missing is left to its
    reader, which says what is missing. The shards are checked apart (`ShardEntry`, their chunk
    indexes and records); a remote dataset's files are checked by size and SHA-256 as they download.
    """

    def __init__(self, root: Path):
        self._root = root
        self._identity = _identity(root)  # the folder opened: an --overwrite renames another into place
        self._manifest: Manifest | None = None
        self._sizes: dict[str, int] = {}
        self._passed: set[str] = set()

    def checked(self, manifest: Manifest, relpath: str) -> Path:
        """The local file of ``relpath``, refused unless it has the size ``manifest`` lists for it
        (a file the manifest does not list is not checked). Every call first checks that the
        dataset's folder is still the one opened (one ``stat``): every read of a local dataset opens
        its files by path, so after ``--overwrite`` it would read the new dataset's files, by the
        old manifest (same-size files pass, other sizes look damaged): `DatasetReplacedError`."""
        if _identity(self._root) != self._identity:
            msg = (
                f"{self._root} was replaced or removed since it was opened (omicsio-materialize --overwrite "
                "writes a new dataset in its place): open it again"
            )
            raise DatasetReplacedError(msg)
        path = self._root / relpath
        if manifest is not self._manifest:  # opened, or a split written through this handle since
            self._sizes = {f.path: f.num_bytes for f in manifest.files}
            self._manifest, self._passed = manifest, set()
        expected = self._sizes.get(relpath)
        if expected is None or relpath in self._passed:
            return path
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise DatasetFormatError.run_verify(
                self._root, f"{self._root}: its file {relpath}, listed in the manifest, is missing"
            ) from None
        except OSError:
            return path  # unreadable: its reader's own error names the file and the cause
        if size != expected:
            raise DatasetFormatError.run_verify(
                self._root,
                f"{self._root}: its file {relpath} is damaged: {size:,} bytes, the manifest says {expected:,}",
            )
        self._passed.add(relpath)
        return path


def _identity(root: Path) -> tuple[int, int] | None:
    """The folder's device and inode (None if it is gone)."""
    try:
        st = os.stat(root)
    except OSError:
        return None
    return st.st_dev, st.st_ino

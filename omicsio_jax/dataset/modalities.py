"""A multimodal dataset's further modalities (`Dataset.modality`): each is a dataset of its own, in
the subdirectory (or under the prefix) its manifest entry names, whose row ``i`` is the primary
dataset's cell ``i``.

`FurtherModalities` opens each on its first use, with the primary's options (a cache directory
given for the primary holds each modality's cache in a subdirectory of its own), checks that it is
the one the primary's manifest lists (its fingerprint and number of cells), keeps it, and closes
them all with the primary.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from omicsio_jax.core.errors import DatasetFormatError
from omicsio_jax.format.manifest import Manifest


class Opened(Protocol):
    """What this module uses of a `omicsio_jax.Dataset` (which hands its own class over to open
    the modalities with: no import back)."""

    path: Any
    manifest: Manifest
    is_remote: bool
    num_cells: int
    fingerprint: str
    obs: Mapping[str, Any]
    modality_cells: int | None

    def close(self) -> None: ...


class FurtherModalities:
    """The further modalities of ``primary``, each opened as ``open_dataset(path, **options)`` with
    the ``options`` ``primary`` was opened with."""

    def __init__(self, primary: Opened, options: Mapping[str, Any], open_dataset: Callable[..., Opened]):
        self._primary, self._options, self._open = primary, options, open_dataset
        self._opened: dict[str, Opened] = {}

    def get(self, name: str) -> Opened:
        """The dataset of the further modality ``name``, opened once."""
        opened = self._opened.get(name)
        if opened is not None:
            return opened
        primary = self._primary
        entry = primary.manifest.modality_entry(name)
        options = dict(self._options)
        if options["cache_dir"] is not None:
            options["cache_dir"] = Path(options["cache_dir"]) / entry.path
        path = f"{primary.path}/{entry.path}" if primary.is_remote else primary.path / entry.path
        try:
            sub = self._open(path, **options)
        except DatasetFormatError as e:
            msg = f"{primary.path}: modality {name!r} ({entry.path}) cannot be opened: {e}"
            raise DatasetFormatError(msg) from e
        if sub.fingerprint != entry.fingerprint or sub.num_cells != primary.num_cells:
            sub.close()
            raise DatasetFormatError.run_verify(
                primary.path,
                f"{primary.path}: modality {name!r} ({entry.path}) is not the one the manifest lists "
                f"(fingerprint {sub.fingerprint[:12]}…, manifest says {entry.fingerprint[:12]}…)",
            )
        has = primary.obs[f"has_{name}"] if f"has_{name}" in primary.obs else None
        if has is not None and not hasattr(has, "categories"):  # bool per cell (a numeric sidecar)
            sub.modality_cells = int(np.count_nonzero(np.asarray(has)))
        return self._opened.setdefault(name, sub)

    def close(self) -> None:
        """Close the modalities opened so far."""
        for sub in self._opened.values():
            sub.close()

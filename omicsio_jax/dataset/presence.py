"""Which genes each source of a collection measured: a gene a source did not measure is unknown in
its cells, not zero (CELLxGENE Census' presence matrix, here one bitmap per source).

>>> ds.presence.dataset_ids                      # the sources, as obs "dataset_id" names them  # doctest: +SKIP
>>> ds.measured_genes("pbmc_10x")                 # bool over the dataset's genes             # doctest: +SKIP
>>> loader = oj.make_loader(ds, batch_size=256, output=oj.Dense(measured=True))             # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from omicsio_jax.core.errors import DatasetFormatError, OmicsIOError
from omicsio_jax.format.manifest import PRESENCE_NAME


@dataclasses.dataclass(frozen=True)
class GenePresence:
    """``measured[k, g]``: source ``dataset_ids[k]`` measured gene column ``g``. A collection's sources
    are contiguous: source ``k`` holds rows ``first_cells[k]`` to ``first_cells[k + 1] - 1``."""

    dataset_ids: tuple[str, ...]
    measured: np.ndarray
    first_cells: np.ndarray  # one more than sources: the end

    def of(self, dataset_id: str) -> np.ndarray:
        """The genes ``dataset_id`` measured (bool over the dataset's columns)."""
        if dataset_id not in self.dataset_ids:
            msg = f"no source {dataset_id!r} in this collection; it has {', '.join(self.dataset_ids)}"
            raise OmicsIOError(msg)
        return self.measured[self.dataset_ids.index(dataset_id)]

    def measuring_cells(self) -> np.ndarray:
        """Per gene column, how many cells of the collection come from a source that measured it
        (int64): what a gene's mean over the cells that could express it divides by."""
        return np.diff(self.first_cells).astype(np.int64) @ self.measured.astype(np.int64)

    def sources_of(self, rows: np.ndarray) -> np.ndarray:
        """The source (row of ``measured``) of each global row; -1 for padding (a negative row)."""
        rows = np.asarray(rows)
        sources = np.searchsorted(self.first_cells, rows, side="right").astype(np.int32) - 1
        return np.where(rows >= 0, sources, -1).astype(np.int32)


def read_presence(ds: Any) -> GenePresence | None:
    """The presence bitmaps of a collection (None for a dataset of one source)."""
    if not any(f.path == PRESENCE_NAME for f in ds.manifest.files):
        return None
    import pyarrow.parquet as pq

    table = pq.read_table(ds.local_path(PRESENCE_NAME))
    bits = [np.frombuffer(b, np.uint8) for b in table.column("measured").to_pylist()]
    # the bitmaps cover the collection's genes; a dense panel's columns are some of them, each named
    # by its gene_token_id (the collection's column)
    columns = None
    if ds.layout == "dense":
        features = pq.read_table(ds.local_path("features.parquet"), columns=["gene_token_id"])
        columns = features.column(0).to_numpy().astype(np.int64)
        width = min((8 * len(b) for b in bits), default=0)
        if len(columns) and (columns.min() < 0 or columns.max() >= width):
            msg = (
                f"{ds.path}/{PRESENCE_NAME} covers {width} genes, but the panel's gene_token_id reaches "
                f"{int(columns.max())}; materialize the collection again"
            )
            raise DatasetFormatError(msg)
    measured = np.zeros((len(bits), ds.num_genes), bool)
    for k, b in enumerate(bits):
        if columns is None:
            measured[k] = np.unpackbits(b, count=ds.num_genes, bitorder="little").astype(bool)
        else:
            measured[k] = np.unpackbits(b, bitorder="little").astype(bool)[columns]
    firsts = table.column("first_cell").to_numpy()
    ends = firsts + table.column("num_cells").to_numpy()
    return GenePresence(
        tuple(str(i) for i in table.column("dataset_id").to_pylist()),
        measured,
        np.concatenate([firsts, ends[-1:]]).astype(np.int64),
    )


def require_presence(ds: Any, what: str) -> GenePresence:
    """``ds``'s presence, or a one-line error saying ``what`` needs a collection."""
    presence = getattr(ds, "presence", None)
    if presence is None:
        where = getattr(ds, "path", "this input")
        msg = (
            f"{what} needs a collection (a dataset materialized from several sources); {where} is not "
            "one: its source measured every one of its genes"
        )
        raise OmicsIOError(msg)
    return presence

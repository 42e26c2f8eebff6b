"""The output interface: how a minibatch of cells becomes the batch's ``x``.

An output kind is a small frozen dataclass holding the user's choices (``oj.Dense()``,
``oj.Panel(genes)``, ``oj.CSR()``, ...). A loader binds it to its rows (`OutputContext`: the
column space, how to resolve gene names, the batch geometry) and then calls ``from_records``
once per host batch with the batch's encoded records (and `RowKeys`: the global rows, epoch and
seed that kinds with random choices draw from), or ``from_csr`` with CSR rows (the query
stream). Every array of the result has the host batch's rows (or its per-device slabs) on its
leading axis, so one placement rule (`place_batch`) serves every kind; a kind whose ``x`` is
finished on the devices returns a `DeviceStep` (``Dense(measured=True)``: each row's source,
gathered into a mask where the batch lands). Adding a kind is one module here plus its export.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from omicsio_jax.core.errors import OmicsIOError

if TYPE_CHECKING:
    from omicsio_jax.format.codec import Records

Empty = Callable[[tuple[int, ...], Any], np.ndarray]  # allocates an uninitialized output array


@dataclasses.dataclass(frozen=True)
class RowKeys:
    """Who the rows of a host batch are: global ``rows`` (-1: padding), the ``epoch`` and the loader's
    ``seed``. Kinds that draw random choices (token masks) key them on these, never on positions."""

    rows: np.ndarray
    epoch: int = 0
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class OutputContext:
    """What an output is bound to.

    ``num_columns``: columns of the rows (the dataset's genes, or a table's gene tokens);
    ``gene_columns``: maps gene names / Ensembl ids / column numbers to columns (raising
    `OmicsIOError` for unknown ones); ``rows``: rows of one host batch, split into ``num_slabs``
    equal slices over this host's devices; ``mean_nnz``: nonzeros per cell, for capacities;
    ``source``: the dataset or table, for messages; ``dataset``: the `Dataset` itself when the
    rows are its records (kinds that need its gene table or statistics read them from it).
    """

    source: str
    num_columns: int
    gene_columns: Callable[[Sequence[str | int]], np.ndarray]
    rows: int = 1
    num_slabs: int = 1
    mean_nnz: float = 1.0
    dataset: Any = None

    @staticmethod
    def of_dataset(ds, *, rows: int = 1, num_slabs: int = 1) -> OutputContext:
        """The context of a materialized `Dataset`'s records."""
        m = ds.manifest
        return OutputContext(
            str(ds.path), ds.num_genes, ds.gene_columns, rows, num_slabs, m.nnz / max(m.num_cells, 1), ds
        )

    @staticmethod
    def of_table(table, *, rows: int = 1) -> OutputContext:
        """The context of a `CellTable`'s CSR rows (columns are its gene token ids)."""
        return OutputContext(str(table.spec), table.genes.num_tokens, table.genes.resolve, rows)


class Output(abc.ABC):
    """One output kind. Subclasses are frozen dataclasses; see the module docstring."""

    kind: str = ""
    needs_genes: bool = False  # its columns must be genes (token kinds), not a modality's own features

    @property
    def modalities(self) -> tuple[str | None, ...]:
        """The modalities whose records `from_records` takes: ``(None,)``, the dataset's own, for
        every kind but `Modalities` (which takes a dict of each named modality's records)."""
        return (None,)

    @property
    def decoding(self) -> str:
        """The kind of work its host batches are, for the default thread layout
        (`default_num_threads`): its ``kind``, or ``"csr"`` for rows shipped as slabs."""
        return self.kind

    def bind(self, ctx: OutputContext) -> Output:
        """A copy resolved against ``ctx`` (gene columns, capacities); the unbound spec is unchanged."""
        return self

    @abc.abstractmethod
    def config(self) -> dict:
        """JSON of everything that decides ``x``, compared on restore (``"output"`` names the kind)."""

    @abc.abstractmethod
    def from_records(self, records: Records, empty: Empty, keys: RowKeys | None = None) -> Any:
        """``x`` of the records (`Records`, checked), one per row of the host batch."""

    def warm_up(self) -> None:
        """Run `from_records` once on empty records (padding rows), so that numba's one-time start in
        this process (its typing context and the kernels' cached machine code) is paid now,
        e.g. on a thread while a loader's first fetch is read, not by the first batch."""
        from omicsio_jax.format import codec

        rows = getattr(self, "num_slabs", 1)  # a csr batch splits into its device slabs
        self.from_records(
            codec.Records.padding(rows),
            lambda shape, dtype: np.zeros(shape, dtype),
            RowKeys(np.full(rows, -1, np.int64)),
        )

    def from_csr(self, indptr: np.ndarray, indices: np.ndarray, values: np.ndarray, empty: Empty) -> Any:
        """``x`` of CSR rows (one per row of the host batch): the query stream's input."""
        msg = f"output {self.kind!r} cannot be computed from a query stream; materialize the data and use make_loader"
        raise OmicsIOError(msg)

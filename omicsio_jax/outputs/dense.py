"""``Dense``: every gene of every cell as a float32 row (the full transcriptome)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.dataset.presence import GenePresence, require_presence
from omicsio_jax.outputs import scatter
from omicsio_jax.outputs.base import Empty, Output, OutputContext, RowKeys
from omicsio_jax.outputs.batch import DeviceStep, SparseBatch
from omicsio_jax.outputs.csr import CSR, check_capacity
from omicsio_jax.outputs.measured import MeasuredRows, PresenceTable, presence_table
from omicsio_jax.outputs.normalize import Normalization

if TYPE_CHECKING:
    from omicsio_jax.format.codec import Records


@dataclasses.dataclass(frozen=True)
class Dense(Output):
    """``x``: ``(rows, genes)`` float32, optionally ``normalize``d (``"log1p"``, or ``"normalize_log1p"``:
    scanpy's ``normalize_total(target_sum)`` + ``log1p``), fused into the one decoding pass.

    ``measured=True`` (a collection): ``x`` is ``{"values": rows, "measured": bool mask}``, the mask
    False where the cell's source did not measure the gene (its 0 is unknown, not zero) and on
    padding rows, placed and sharded like the values. The host batch carries each row's source
    (`MeasuredRows`), and the mask is gathered where the batch is placed (`place_batch`).

    ``on_device=True`` (for GPUs and TPUs): the rows are built where the batch is placed, not on
    the host. The host batch carries them as `CSR` slabs (8 bytes a nonzero instead of 4 a gene:
    ~20× fewer bytes for a cell of 1,500 nonzeros over 60k genes) and `place_batch` densifies them
    on the devices (`SlabRows`), ``normalize`` applied there. Full rows written on the host are
    bound by its memory bandwidth, and then cross the host-to-device link in full. ``x`` is the
    same array: bit for bit without ``normalize``, with it up to the devices' float rounding.
    ``nnz_capacity`` (nonzeros per device slab) is `CSR`'s.

    The fields ``num_columns``, ``source``, ``presence``, ``table`` and ``slabs`` are filled in when
    a loader binds the output (`Output.bind`): leave them out.
    """

    normalize: str | None = None
    target_sum: float = 1e4
    measured: bool = False
    on_device: bool = False
    nnz_capacity: int | None = None
    num_columns: int | None = None  # set by bind
    source: str = ""
    presence: GenePresence | None = dataclasses.field(default=None, repr=False, compare=False)  # bound
    table: PresenceTable | None = dataclasses.field(default=None, repr=False, compare=False)  # bound
    slabs: CSR | None = dataclasses.field(default=None, repr=False, compare=False)  # bound, on_device

    kind = "dense"

    def __post_init__(self) -> None:
        Normalization(self.normalize, self.target_sum)  # raises for a mode that does not exist
        check_capacity(self.nnz_capacity)
        if self.nnz_capacity is not None and not self.on_device:
            msg = "Dense(nnz_capacity=...) sizes the slabs of Dense(on_device=True); pass on_device=True too"
            raise OmicsIOError(msg)

    @property
    def num_slabs(self) -> int:
        """Device slabs a host batch splits into (1 unless the rows are built on the devices)."""
        return self.slabs.num_slabs if self.slabs is not None else 1

    @property
    def decoding(self) -> str:
        return "csr" if self.on_device else self.kind

    def bind(self, ctx: OutputContext) -> Dense:
        bound = {"num_columns": ctx.num_columns, "source": ctx.source}
        if self.on_device:
            csr = CSR(self.nnz_capacity, normalize=self.normalize, target_sum=self.target_sum).bind(ctx)
            bound["slabs"], bound["nnz_capacity"] = csr, csr.nnz_capacity
        if self.measured:
            presence = require_presence(ctx.dataset, "Dense(measured=True)")
            bound["presence"] = presence
            bound["table"] = presence_table(presence, ctx, "Dense(measured=True)")
        return dataclasses.replace(self, **bound)

    def config(self) -> dict:
        return {
            "output": self.kind,
            "panel": None,
            "normalize": self.normalize,
            "target_sum": self.target_sum,
            **({"measured": True} if self.measured else {}),
            **({"on_device": True} if self.on_device else {}),
        }

    def from_records(
        self, records: Records, empty: Empty, keys: RowKeys | None = None
    ) -> np.ndarray | MeasuredRows | SlabRows:
        sources = None
        if self.measured:
            rows = keys.rows if keys is not None else np.full(len(records), -1)
            sources = self.presence.sources_of(rows)
        if self.on_device:
            return SlabRows(self.slabs.from_records(records, empty), sources, self.slabs, self.table)
        out = empty((len(records), self.num_columns), np.float32)
        x = scatter.decode_scatter(records, out, normalize=self.normalize, target_sum=self.target_sum)
        return x if sources is None else MeasuredRows(x, sources, self.table)

    def from_csr(self, indptr, indices, values, empty: Empty) -> np.ndarray:
        for flag in ("measured", "on_device"):
            if getattr(self, flag):
                msg = f"Dense({flag}=True) needs a materialized dataset's records; use make_loader"
                raise OmicsIOError(msg)
        out = empty((len(indptr) - 1, self.num_columns), np.float32)
        return scatter.scatter_dense(
            indptr,
            indices,
            values,
            self.num_columns,
            out=out,
            normalize=self.normalize,
            target_sum=self.target_sum,
        )


@dataclasses.dataclass(eq=False)
class SlabRows(DeviceStep):
    """``oj.Dense(on_device=True)``'s ``x`` on the host: the rows as `CSR` slabs (``slabs``, a
    `SparseBatch`) and, with ``measured=True``, each row's source. `place_batch` places them and
    makes the dense rows on the devices (``{"values": ..., "measured": ...}`` with the mask);
    ``dense()`` reads an unplaced batch's rows."""

    slabs: SparseBatch
    sources: Any
    csr: CSR
    table: PresenceTable | None

    def dense(self) -> np.ndarray:
        """The ``(rows, genes)`` rows of the slabs as numpy (built by JAX on its default device)."""
        return np.asarray(self.csr.densify(jax.tree.map(jax.numpy.asarray, self.slabs)))

    def to_place(self, sharding: jax.sharding.Sharding) -> dict[str, Any]:
        return {"slabs": self.slabs, "sources": self.sources}

    def on_device(self, placed: dict[str, Any]) -> Any:
        values = self.csr.densify(placed["slabs"])
        if placed["sources"] is None:
            return values
        return {"values": values, "measured": self.table.gather(placed["sources"])}


jax.tree_util.register_dataclass(SlabRows, data_fields=["slabs", "sources"], meta_fields=["csr", "table"])

"""``CSR``: fixed-shape padded sparse slabs, one per device, densified on the devices."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.dataset.presence import GenePresence, require_presence
from omicsio_jax.format import codec
from omicsio_jax.outputs import scatter
from omicsio_jax.outputs.base import Empty, Output, OutputContext, RowKeys
from omicsio_jax.outputs.batch import SparseBatch
from omicsio_jax.outputs.measured import PresenceTable, presence_table
from omicsio_jax.outputs.normalize import Normalization


@functools.partial(jax.jit, static_argnames=("rows_per_shard", "num_genes", "normalize", "target_sum"))
def _densify_sharded(row_ids, indices, values, *, rows_per_shard, num_genes, normalize, target_sum):
    """Densify each shard's slab where it lives (vmap over the sharded leading axis), then flatten."""

    def one(r, i, v):
        return scatter.densify_on_device(
            r, i, v, num_rows=rows_per_shard, num_genes=num_genes, normalize=normalize, target_sum=target_sum
        )

    return jax.vmap(one)(row_ids, indices, values).reshape(-1, num_genes)


def check_capacity(capacity) -> None:
    """A one-line error unless ``capacity`` (nonzeros per device slab) is a positive int or None."""
    if capacity is not None and (
        isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1
    ):
        msg = (
            f"nnz_capacity must be a positive number of nonzeros per device slab, or None to size it "
            f"from the dataset; got {capacity!r}"
        )
        raise OmicsIOError(msg)


@dataclasses.dataclass(frozen=True)
class CSR(Output):
    """``x``: a `SparseBatch` of ``(slabs, nnz_capacity)`` arrays, 8 bytes per nonzero (int16 row,
    uint16 column, float32 value) instead of a dense row's 4 bytes per gene.

    ``densify(x)`` builds the dense rows on the devices (jitted, ``normalize`` applied there).
    ``nnz_capacity`` (per slab) defaults to the mean plus 6 standard deviations of a slab's
    nonzeros for cells whose counts vary with a coefficient of variation ≤ 1; a slab beyond it
    raises an error that names the capacity to pass.

    ``measured=True`` (a collection): ``x.sources`` holds each row's source, and ``measured_mask(x)`` the
    rows' masks of the genes their sources measured, gathered on the devices.

    The fields ``num_columns``, ``num_slabs``, ``rows_per_slab``, ``source``, ``presence``,
    ``table`` and ``derived_capacity`` are filled in when a loader binds the output (`Output.bind`):
    leave them out.
    """

    nnz_capacity: int | None = None
    normalize: str | None = None
    target_sum: float = 1e4
    measured: bool = False
    num_columns: int = 0  # set by bind
    num_slabs: int = 1
    rows_per_slab: int = 0
    source: str = ""
    presence: GenePresence | None = dataclasses.field(default=None, repr=False, compare=False)  # bound
    table: PresenceTable | None = dataclasses.field(default=None, repr=False, compare=False)  # bound
    # bound: nnz_capacity was derived from the host batch, not asked for (so not part of the config,
    # which a restore onto another number of processes compares)
    derived_capacity: bool = dataclasses.field(default=False, repr=False, compare=False)

    kind = "csr"

    def __post_init__(self) -> None:
        Normalization(self.normalize, self.target_sum)  # raises for a mode that does not exist
        check_capacity(self.nnz_capacity)

    def bind(self, ctx: OutputContext) -> CSR:
        if ctx.rows % ctx.num_slabs:
            msg = f"a host batch of {ctx.rows} rows does not split into {ctx.num_slabs} equal device slabs"
            raise OmicsIOError(msg)
        rows = ctx.rows // ctx.num_slabs
        mean = max(ctx.mean_nnz, 1.0)
        asked = None if self.derived_capacity else self.nnz_capacity
        capacity = asked or int(-(-(rows * mean + 6 * np.sqrt(rows) * mean) // 256) * 256)
        presence = require_presence(ctx.dataset, "CSR(measured=True)") if self.measured else None
        return dataclasses.replace(
            self,
            presence=presence,
            table=presence_table(presence, ctx, "CSR(measured=True)") if self.measured else None,
            nnz_capacity=capacity,
            derived_capacity=asked is None,
            num_columns=ctx.num_columns,
            num_slabs=ctx.num_slabs,
            rows_per_slab=rows,
            source=ctx.source,
        )

    def config(self) -> dict:
        return {
            "output": self.kind,
            "panel": None,
            "normalize": self.normalize,
            "target_sum": self.target_sum,
            "nnz_capacity": None if self.derived_capacity else self.nnz_capacity,
            **({"measured": True} if self.measured else {}),
        }

    def from_records(self, records: codec.Records, empty: Empty, keys: RowKeys | None = None) -> SparseBatch:
        sources = None
        if self.measured:
            rows = keys.rows if keys is not None else np.full(len(records), -1)
            sources = self.presence.sources_of(rows)
        try:
            return SparseBatch(
                *codec.decode_slabs(
                    records,
                    num_rows=len(records),
                    num_slabs=self.num_slabs,
                    capacity=self.nnz_capacity,
                    num_columns=self.num_columns,
                    empty=empty,
                ),
                sources,
            )
        except codec.MalformedRecordError:
            raise  # the caller, who knows the rows, names the shard and cell
        except ValueError as e:  # too many nonzeros for the capacity
            msg = f"{self.source}: {e}"
            raise OmicsIOError(msg) from e

    def densify(self, x: SparseBatch) -> jax.Array:
        """Dense ``(rows, genes)`` float32 of a placed `SparseBatch`, computed where its slabs live."""
        return _densify_sharded(
            x.row_ids,
            x.indices,
            x.values,
            rows_per_shard=self.rows_per_slab,
            num_genes=self.num_columns,
            normalize=self.normalize,
            target_sum=self.target_sum,
        )

    def measured_mask(self, x: SparseBatch) -> jax.Array:
        """``(rows, genes)`` bool of a placed batch: the genes each row's source measured (False on
        padding), gathered where the rows live from the collection's presence bitmaps held there."""
        if self.table is None or x.sources is None:
            msg = "CSR.measured_mask(x) needs the output bound with measured=True: oj.CSR(measured=True)"
            raise OmicsIOError(msg)
        return self.table.gather(x.sources)

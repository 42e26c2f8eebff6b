"""``Dense``: every gene of every cell as a float32 row (the full transcriptome)."""

from __future__ import annotations

import dataclasses

import numpy as np

from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.dataset.presence import GenePresence, require_presence
from omicsio_jax.outputs import scatter
from omicsio_jax.outputs.base import Empty, Output, OutputContext, RowKeys
from omicsio_jax.outputs.measured import MeasuredRows, PresenceTable, presence_table
from omicsio_jax.outputs.normalize import Normalization


@dataclasses.dataclass(frozen=True)
class Dense(Output):
    """``x``: ``(rows, genes)`` float32, optionally ``normalize``d (``"log1p"``, or ``"normalize_log1p"``:
    scanpy's ``normalize_total(target_sum)`` + ``log1p``), fused into the one decoding pass.

    ``measured=True`` (a collection): ``x`` is ``{"values": rows, "measured": bool mask}``, the mask
    False where the cell's source did not measure the gene (its 0 is unknown, not zero) and on
    padding rows, placed and sharded like the values. The host batch carries each row's source
    (`MeasuredRows`), and the mask is gathered where the batch is placed (`place_batch`).
    """

    normalize: str | None = None
    target_sum: float = 1e4
    measured: bool = False
    num_columns: int | None = None  # set by bind
    source: str = ""
    presence: GenePresence | None = dataclasses.field(default=None, repr=False, compare=False)  # bound
    table: PresenceTable | None = dataclasses.field(default=None, repr=False, compare=False)  # bound

    kind = "dense"

    def __post_init__(self) -> None:
        Normalization(self.normalize, self.target_sum)  # raises for a mode that does not exist

    def bind(self, ctx: OutputContext) -> Dense:
        if not self.measured:
            return dataclasses.replace(self, num_columns=ctx.num_columns, source=ctx.source)
        presence = require_presence(ctx.dataset, "Dense(measured=True)")
        return dataclasses.replace(
            self,
            num_columns=ctx.num_columns,
            source=ctx.source,
            presence=presence,
            table=presence_table(presence, ctx, "Dense(measured=True)"),
        )

    def config(self) -> dict:
        return {
            "output": self.kind,
            "panel": None,
            "normalize": self.normalize,
            "target_sum": self.target_sum,
            **({"measured": True} if self.measured else {}),
        }

    def from_records(
        self, buf: np.ndarray, starts: np.ndarray, empty: Empty, keys: RowKeys | None = None
    ) -> np.ndarray | MeasuredRows:
        out = empty((len(starts) - 1, self.num_columns), np.float32)
        x = scatter.decode_scatter(buf, starts, out, normalize=self.normalize, target_sum=self.target_sum)
        if not self.measured:
            return x
        rows = keys.rows if keys is not None else np.full(len(starts) - 1, -1)
        return MeasuredRows(x, self.presence.sources_of(rows), self.table)

    def from_csr(self, indptr, indices, values, empty: Empty) -> np.ndarray:
        if self.measured:
            msg = "Dense(measured=True) needs a materialized collection's rows; use make_loader"
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

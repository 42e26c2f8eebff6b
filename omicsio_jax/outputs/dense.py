"""``Dense``: every gene of every cell as a float32 row (the full transcriptome)."""

from __future__ import annotations

import dataclasses

import numpy as np

from omicsio_jax.outputs import scatter
from omicsio_jax.outputs.base import Empty, Output, OutputContext, RowKeys
from omicsio_jax.outputs.normalize import Normalization


@dataclasses.dataclass(frozen=True)
class Dense(Output):
    """``x``: ``(rows, genes)`` float32, optionally ``normalize``d (``"log1p"``, or ``"normalize_log1p"``:
    scanpy's ``normalize_total(target_sum)`` + ``log1p``), fused into the one decoding pass."""

    normalize: str | None = None
    target_sum: float = 1e4
    num_columns: int | None = None  # set by bind
    source: str = ""

    kind = "dense"

    def __post_init__(self) -> None:
        Normalization(self.normalize, self.target_sum)  # raises for a mode that does not exist

    def bind(self, ctx: OutputContext) -> Dense:
        return dataclasses.replace(self, num_columns=ctx.num_columns, source=ctx.source)

    def config(self) -> dict:
        return {
            "output": self.kind,
            "panel": None,
            "normalize": self.normalize,
            "target_sum": self.target_sum,
        }

    def from_records(
        self, buf: np.ndarray, starts: np.ndarray, empty: Empty, keys: RowKeys | None = None
    ) -> np.ndarray:
        out = empty((len(starts) - 1, self.num_columns), np.float32)
        return scatter.decode_scatter(buf, starts, out, normalize=self.normalize, target_sum=self.target_sum)

    def from_csr(self, indptr, indices, values, empty: Empty) -> np.ndarray:
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

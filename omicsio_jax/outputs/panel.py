"""``Panel``: the chosen genes of every cell as float32 columns, in the order given."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.outputs import scatter
from omicsio_jax.outputs.base import Empty, Output, OutputContext, RowKeys
from omicsio_jax.outputs.normalize import Normalization

if TYPE_CHECKING:
    from omicsio_jax.format.codec import Records


@dataclasses.dataclass(frozen=True)
class Panel(Output):
    """``x``: ``(rows, len(genes))`` float32; ``genes`` are names, Ensembl ids or column numbers.

    Genes outside the panel are skipped while decoding (no full row is built). With
    ``normalize="normalize_log1p"`` a cell's total covers all its genes, as scanpy normalizes
    before subsetting.

    The fields ``gene_to_col`` and ``source`` are filled in when a loader binds the output
    (`Output.bind`): leave them out.
    """

    genes: Sequence[str | int] = ()
    normalize: str | None = None
    target_sum: float = 1e4
    gene_to_col: np.ndarray | None = dataclasses.field(default=None, compare=False)  # set by bind
    source: str = ""

    kind = "dense"  # a panel is a dense output over fewer columns (``output="dense", genes=...``)

    def __post_init__(self) -> None:
        Normalization(self.normalize, self.target_sum)  # raises for a mode that does not exist
        object.__setattr__(self, "genes", tuple(self.genes))

    def bind(self, ctx: OutputContext) -> Panel:
        columns = np.asarray(ctx.gene_columns(self.genes), dtype=np.int64)
        uniq, counts = np.unique(columns, return_counts=True)
        if (counts > 1).any():
            col = uniq[counts > 1][0]
            named = " and ".join(repr(g) for g, c in zip(self.genes, columns, strict=True) if c == col)
            msg = f"oj.Panel: {named} name the same gene (column {col} of {ctx.source}); give each gene once"
            raise OmicsIOError(msg)
        width = max(ctx.num_columns, int(columns.max(initial=-1)) + 1)
        return dataclasses.replace(
            self, gene_to_col=scatter.make_gene_to_col(width, columns), source=ctx.source
        )

    @property
    def num_columns(self) -> int:
        return len(self.genes)

    def config(self) -> dict:
        digest = hashlib.sha256(self.gene_to_col.tobytes()).hexdigest()[:16]
        return {
            "output": self.kind,
            "panel": digest,
            "normalize": self.normalize,
            "target_sum": self.target_sum,
        }

    def from_records(self, records: Records, empty: Empty, keys: RowKeys | None = None) -> np.ndarray:
        out = empty((len(records), self.num_columns), np.float32)
        return scatter.decode_scatter(
            records,
            out,
            gene_to_col=self.gene_to_col,
            normalize=self.normalize,
            target_sum=self.target_sum,
        )

    def from_csr(self, indptr, indices, values, empty: Empty) -> np.ndarray:
        out = empty((len(indptr) - 1, self.num_columns), np.float32)
        return scatter.scatter_panel(
            indptr,
            indices,
            values,
            self.gene_to_col,
            out=out,
            normalize=self.normalize,
            target_sum=self.target_sum,
        )

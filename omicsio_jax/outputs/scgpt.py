"""``ScGPTTokens``: scGPT's per-cell binned values with CLS, sampling and masking, fixed ``(rows, max_len)``."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from pathlib import Path

import numba
import numpy as np

from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.format import codec
from omicsio_jax.outputs.base import Empty, Output, OutputContext, RowKeys
from omicsio_jax.outputs.scgpt_kernel import scgpt_kernel
from omicsio_jax.outputs.token_common import (
    check_mask_prob,
    needs_counts,
    needs_dataset,
    needs_keys,
    plain_ints,
    vocabulary_of,
)
from omicsio_jax.outputs.vocabulary import Vocabulary, default_vocabulary

BINNINGS = ("scgpt", "tahoe")
MASK_MODES = ("bernoulli", "exact")


@dataclasses.dataclass(frozen=True)
class ScGPTTokens(Output):
    """``x``: a dict of ``gene_ids int32``, ``values float32`` (bins 1..n_bins−1; −2 at CLS and
    padding), ``masked_values float32`` (−1 where masked), ``mask bool`` (positions to predict) and
    ``pad_mask bool`` (True on padding), all ``(rows, max_len)``.

    Every kept nonzero of a cell (``genes``: only these columns / names, e.g. highly variable genes)
    is binned on the cell's own quantile edges before sampling: ``binning="scgpt"`` spreads ties at
    random as scGPT does, ``"tahoe"`` is Tahoe-x1's deterministic rule. Cells with more than
    ``max_len − 1`` genes keep a uniform sample of them, in random order. ``mask_mode="bernoulli"``
    masks each position with ``mask_prob`` (scGPT); ``"exact"`` masks ``floor((m − 1) · mask_prob)``
    of the first ``m − 1`` of the ``m`` gene positions, as Tahoe-x1's collator does (it counts CLS,
    whose value is its pad value, among the padding: its last gene is never masked). The dataset must hold counts (its manifest's ``values``);
    ``allow_non_counts=True`` bins normalized values too.

    >>> loader = oj.make_loader(ds, batch_size=64, output=oj.ScGPTTokens(max_len=1201))   # doctest: +SKIP

    The fields ``vocabulary`` and ``source`` are filled in when a loader binds the output
    (`Output.bind`): leave them out.
    """

    max_len: int = 1201
    n_bins: int = 51
    binning: str = "scgpt"
    mask_prob: float = 0.15
    mask_mode: str = "bernoulli"
    vocab: str | Path | None = None
    genes: Sequence[str | int] | None = None
    allow_non_counts: bool = False
    vocabulary: Vocabulary | None = dataclasses.field(default=None, compare=False, repr=False)  # set by bind
    source: str = ""

    kind = "scgpt"
    needs_genes = True  # tokens are genes: a gene-space modality only

    def __post_init__(self) -> None:
        plain_ints(self, "max_len", "n_bins")
        if isinstance(self.max_len, bool) or not isinstance(self.max_len, int) or self.max_len < 2:
            msg = (
                f"max_len={self.max_len!r} leaves no room for a gene token beside CLS; use e.g. max_len=1201"
            )
            raise OmicsIOError(msg)
        if isinstance(self.n_bins, bool) or not isinstance(self.n_bins, int) or self.n_bins < 3:
            msg = f"n_bins must be an integer ≥ 3 (scGPT uses 51), got {self.n_bins!r}"
            raise OmicsIOError(msg)
        if self.binning not in BINNINGS:
            msg = f"binning must be one of {', '.join(BINNINGS)}; got {self.binning!r}"
            raise OmicsIOError(msg)
        if self.mask_mode not in MASK_MODES:
            msg = f"mask_mode must be one of {', '.join(MASK_MODES)}; got {self.mask_mode!r}"
            raise OmicsIOError(msg)
        check_mask_prob(self.mask_prob, allow_one=self.mask_mode == "exact")
        if self.genes is not None:
            object.__setattr__(self, "genes", tuple(g if isinstance(g, str) else int(g) for g in self.genes))

    def bind(self, ctx: OutputContext) -> ScGPTTokens:
        ds = needs_dataset(self, ctx)
        needs_counts(self, ds)
        vocab = (
            vocabulary_of(self.vocab, ds) if self.vocab is not None else default_vocabulary(ctx.num_columns)
        )
        vocab.check_specials(("pad", "cls"), "")
        if self.genes is not None:
            # a gene is kept whichever of its columns names it: columns of one Ensembl id are summed
            # into the first (``canon``), whose token decides whether the sum is kept
            chosen = np.zeros(ctx.num_columns, bool)
            chosen[vocab.canon[ctx.gene_columns(list(self.genes))]] = True
            tok = np.where(chosen[vocab.canon], vocab.tok, -1).astype(np.int32)
            if not np.any(tok >= 0):
                msg = f"none of the {len(self.genes)} genes= has a token in the vocabulary ({vocab.source})"
                raise OmicsIOError(msg)
            vocab = dataclasses.replace(vocab, tok=tok)
        return dataclasses.replace(self, vocabulary=vocab, source=ctx.source)

    def config(self) -> dict:
        return {
            "output": self.kind,
            "max_len": self.max_len,
            "n_bins": self.n_bins,
            "binning": self.binning,
            "mask_prob": self.mask_prob,
            "mask_mode": self.mask_mode,
            "vocab": self.vocabulary.fingerprint() if self.vocabulary else None,
            "genes": None
            if self.genes is None
            else hashlib.sha256(repr(self.genes).encode()).hexdigest()[:16],
        }

    def from_records(
        self, records: codec.Records, empty: Empty, keys: RowKeys | None = None
    ) -> dict[str, np.ndarray]:
        keys = needs_keys(self, keys)
        n, length = len(records), self.max_len
        out = {
            "gene_ids": empty((n, length), np.int32),
            "values": empty((n, length), np.float32),
            "masked_values": empty((n, length), np.float32),
            "mask": empty((n, length), np.bool_),
            "pad_mask": empty((n, length), np.bool_),
        }
        v = self.vocabulary
        u8, u32, f32 = records.views(len(v.tok))
        scgpt_kernel(
            numba.get_num_threads(),
            u8,
            u32,
            f32,
            records.begins,
            keys.rows.astype(np.int64),
            keys.seed,
            keys.epoch,
            v.tok,
            v.canon,
            v.has_duplicates,
            np.linspace(0, 1, self.n_bins - 1),
            self.binning == "scgpt",
            float(self.mask_prob),
            self.mask_mode == "exact",
            v.pad,
            v.cls,
            out["gene_ids"],
            out["values"],
            out["masked_values"],
            out["mask"],
            out["pad_mask"],
        )
        return out

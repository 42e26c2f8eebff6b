"""``GeneformerTokens``: Geneformer's rank-value encoding with MLM masking, fixed ``(rows, max_len)``."""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from pathlib import Path

import numba
import numpy as np

from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.format import codec
from omicsio_jax.format.gene_stats import read_gene_medians
from omicsio_jax.outputs.base import Empty, Output, OutputContext, RowKeys
from omicsio_jax.outputs.geneformer_kernel import geneformer_kernel
from omicsio_jax.outputs.token_common import (
    ReplacementTokens,
    check_mask_prob,
    ensembl_ids,
    needs_counts,
    needs_dataset,
    needs_keys,
    plain_ints,
    vocabulary_of,
)
from omicsio_jax.outputs.vocabulary import Vocabulary, default_vocabulary, medians_by_column


@dataclasses.dataclass(frozen=True)
class GeneformerTokens(Output):
    """``x``: a dict of ``input_ids int32``, ``attention_mask bool``, ``labels int32`` (the original
    id where masked, -100 elsewhere), all ``(rows, max_len)``, and ``length int32 (rows,)`` (gene
    tokens kept; 0 for a cell with none, whose row stays in the batch).

    Genes are ranked by ``count / median`` (``medians``: a file of Ensembl id → median such as
    Geneformer's ``gene_median_dictionary.pkl``; default: the dataset's own corpus medians), the top
    ``max_len − 2`` kept between CLS and EOS (``special_tokens=False``: V1, ``max_len`` genes and no
    specials). ``vocab``: Ensembl id → token id (TSV, JSON, parquet or Geneformer's pickle);
    default: Tahoe-100M's layout (see `oj.default_vocabulary`). The dataset must hold counts (its
    manifest's ``values``); ``allow_non_counts=True`` ranks normalized values too.

    >>> loader = oj.make_loader(ds, batch_size=64, output=oj.GeneformerTokens(max_len=2048))   # doctest: +SKIP

    In a collection, MLM's random replacements are genes the cell's source measured (a token output
    never emits a gene its source did not measure).

    The fields ``vocabulary``, ``inv_median``, ``gene``, ``median``, ``column_of_token``,
    ``distinct_scales``, ``replacements`` and ``source`` are filled in when a loader binds the output (`Output.bind`):
    leave them out.
    """

    max_len: int = 2048
    special_tokens: bool = True
    mask_prob: float = 0.15
    vocab: str | Path | None = None
    medians: str | Path | None = None
    allow_non_counts: bool = False
    vocabulary: Vocabulary | None = dataclasses.field(default=None, compare=False, repr=False)  # set by bind
    inv_median: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    # (columns, 2) int32: each column's scale (float32 bits; 0: not kept) beside its token, as the
    # kernel reads them
    gene: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    # each column's median (float64) and each kept token's column: the float64 ranking of close keys
    median: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    column_of_token: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    # the kept genes' scales mostly distinct (a median per gene, as a published dictionary gives;
    # the corpus medians are histogram bin centres that many genes share): the ranking sort's choice
    distinct_scales: bool = dataclasses.field(default=False, compare=False, repr=False)
    # MLM's random replacements: the genes of each cell's source (`ReplacementTokens`)
    replacements: ReplacementTokens | None = dataclasses.field(default=None, compare=False, repr=False)
    source: str = ""

    kind = "geneformer"
    needs_genes = True  # tokens are genes: a gene-space modality only

    def __post_init__(self) -> None:
        plain_ints(self, "max_len")
        specials = 2 if self.special_tokens else 0
        if isinstance(self.max_len, bool) or not isinstance(self.max_len, int) or self.max_len <= specials:
            msg = (
                f"max_len={self.max_len!r} leaves no room for a gene token"
                f"{' beside CLS and EOS (special_tokens=True)' if specials else ''}; use e.g. max_len=2048"
            )
            raise OmicsIOError(msg)
        check_mask_prob(self.mask_prob, allow_one=False)

    def bind(self, ctx: OutputContext) -> GeneformerTokens:
        ds = needs_dataset(self, ctx)
        needs_counts(self, ds)
        vocab = (
            vocabulary_of(self.vocab, ds) if self.vocab is not None else default_vocabulary(ctx.num_columns)
        )
        vocab.check_specials(
            ("pad", "cls", "eos") if self.special_tokens else ("pad",),
            ", or pass special_tokens=False (omicsio-train: --no-special-tokens; Geneformer V1 has no CLS or EOS)",
        )
        if self.medians is None:
            medians = read_gene_medians(ds)
        else:
            medians = medians_by_column(self.medians, ensembl_ids(ds, self.medians), dataset=str(ds.path))
        known = np.isfinite(medians) & (medians > 0)
        if vocab.has_duplicates:
            # columns of one Ensembl id are summed into the first (``canon``) and ranked by its scale:
            # where that column has no median of its own (the dataset's statistics are per column, and
            # it may never be expressed), the first of its columns that has one
            donor = np.full(len(medians), len(medians), np.int64)
            np.minimum.at(donor, vocab.canon[known], np.flatnonzero(known))
            lent = ~known & (donor < len(medians))
            medians = medians.copy()
            medians[lent] = medians[donor[lent]]
            known |= lent
        unlisted = int(np.count_nonzero((vocab.tok >= 0) & np.isnan(medians)))
        # (with the dataset's own medians, a gene without one is a gene never expressed: no warning)
        if self.medians is not None and unlisted:
            warnings.warn(
                f"omicsio_jax: {unlisted:,} gene(s) of {ds.path} with a token have no median in {self.medians}: "
                "left out of the ranking (Geneformer's tokenizer would stop at them); check that the "
                "vocabulary and the medians are a pair",
                UserWarning,
                stacklevel=2,
            )
        if not np.any(known & (vocab.tok >= 0)):
            msg = (
                f"no gene of {ds.path} has both a token and a median "
                f"({'medians ' + str(self.medians) if self.medians else 'the dataset statistics'}); check the files"
            )
            raise OmicsIOError(msg)
        inv = np.zeros(len(medians), np.float32)
        inv[known] = (1.0 / medians[known]).astype(np.float32)
        scale = np.where(vocab.tok >= 0, inv, np.float32(0))  # a gene is kept where its scale is > 0
        gene = np.stack([scale.view(np.int32), vocab.tok.astype(np.int32)], axis=1)
        kept = scale[scale > 0]
        distinct = 2 * len(np.unique(kept)) >= len(kept)
        # a kept token's column (the first of its columns: duplicates are summed into it), for the
        # kernel's float64 ranking of genes whose keys come close
        kept_columns = np.flatnonzero(scale > 0)
        column_of_token = np.full(int(vocab.tok.max(initial=-1)) + 1, -1, np.int32)
        column_of_token[vocab.tok[kept_columns[::-1]]] = kept_columns[::-1]
        return dataclasses.replace(
            self,
            vocabulary=vocab,
            inv_median=inv,
            gene=gene,
            median=np.where(scale > 0, medians, np.nan).astype(np.float64),
            column_of_token=column_of_token,
            distinct_scales=distinct,
            replacements=ReplacementTokens.of(vocab, ds),
            source=ctx.source,
        )

    @property
    def scale(self) -> np.ndarray | None:
        """Each column's ``1 / median`` where it has a token and a median, else 0 (not kept): the
        first column of ``gene``, as float32; None before `bind`."""
        return None if self.gene is None else self.gene[:, 0].view(np.float32)

    def config(self) -> dict:
        digest = (
            None if self.inv_median is None else hashlib.sha256(self.inv_median.tobytes()).hexdigest()[:16]
        )
        return {
            "output": self.kind,
            "max_len": self.max_len,
            "special_tokens": self.special_tokens,
            "mask_prob": self.mask_prob,
            "vocab": self.vocabulary.fingerprint() if self.vocabulary else None,
            "medians": digest,
        }

    def from_records(
        self, records: codec.Records, empty: Empty, keys: RowKeys | None = None
    ) -> dict[str, np.ndarray]:
        keys = needs_keys(self, keys)
        n, length = len(records), self.max_len
        out = {
            "input_ids": empty((n, length), np.int32),
            "attention_mask": empty((n, length), np.bool_),
            "labels": empty((n, length), np.int32),
            "length": empty((n,), np.int32),
        }
        v = self.vocabulary
        u8, u32, f32 = records.views(len(v.tok))
        geneformer_kernel(
            numba.get_num_threads(),
            u8,
            u32,
            f32,
            records.begins,
            keys.rows.astype(np.int64),
            keys.seed,
            keys.epoch,
            self.gene,
            self.gene.view(np.float32),
            self.median,
            self.column_of_token,
            self.medians is not None,
            self.distinct_scales,
            v.canon,
            v.has_duplicates,
            self.replacements.ptr,
            self.replacements.tokens,
            self.replacements.sources(keys.rows),
            self.special_tokens,
            float(self.mask_prob),
            v.pad,
            v.cls,
            v.eos,
            v.mask,
            out["input_ids"],
            out["attention_mask"],
            out["labels"],
            out["length"],
        )
        return out

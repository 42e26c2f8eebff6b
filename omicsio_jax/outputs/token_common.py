"""What the token output kinds share: their vocabulary and their checks."""

from __future__ import annotations

import dataclasses

import numpy as np

from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.outputs.base import OutputContext, RowKeys
from omicsio_jax.outputs.vocabulary import Vocabulary, user_vocabulary


def plain_ints(output, *names: str) -> None:
    """Fields ``names`` of the frozen ``output`` that hold a numpy integer, as the int it is (its
    checks then take it as one)."""
    for name in names:
        value = getattr(output, name)
        if isinstance(value, np.integer):
            object.__setattr__(output, name, int(value))


def ensembl_ids(ds, path) -> np.ndarray:
    """The Ensembl id of every column of ``ds``, for a file (``path``) keyed on them."""
    if "ensembl_id" not in ds.features:
        msg = f"{path} is keyed on Ensembl ids but {ds.path}/features.parquet has no ensembl_id column"
        raise OmicsIOError(msg)
    return ds.features["ensembl_id"].to_numpy(dtype=object)


def vocabulary_of(path, ds) -> Vocabulary:
    """The user vocabulary in ``path`` bound to the dataset's Ensembl ids, or to its gene names where
    the file is keyed on symbols (`user_vocabulary`)."""
    features = ds.features
    ids, names = (
        features[c].to_numpy(dtype=object) if c in features else None for c in ("ensembl_id", "gene_name")
    )
    return user_vocabulary(path, ids, dataset=str(ds.path), symbols=names)


def needs_dataset(output, ctx: OutputContext):
    if ctx.dataset is None:
        msg = (
            f"{type(output).__name__} is computed from a materialized dataset's records "
            "(make_loader, GrainSource, oj.tokenize); materialize the data first"
        )
        raise OmicsIOError(msg)
    return ctx.dataset


def needs_counts(output, ds) -> None:
    """Token outputs rank or bin a cell's raw counts: a dataset whose manifest records other values
    (``nonnegative``: normalized, ``real``) is refused unless the output says ``allow_non_counts``.
    A dataset written before the manifest recorded its values passes."""
    values = ds.manifest.values
    if values in ("", "counts") or output.allow_non_counts:
        return
    name = type(output).__name__
    msg = (
        f"{ds.path} holds {values} values, not counts (its manifest's 'values'), and {name} expects "
        f"raw counts: materialize the counts (an AnnData's raw/X: --raw, use_raw=True) or pass "
        f"{name}(allow_non_counts=True)"
    )
    raise OmicsIOError(msg)


def needs_keys(output, keys: RowKeys | None) -> RowKeys:
    if keys is None:
        msg = (
            f"{type(output).__name__} draws per-cell random choices and needs the rows' keys; it works "
            "through make_loader, GrainSource and oj.tokenize, not the in-memory loader"
        )
        raise OmicsIOError(msg)
    return keys


def check_mask_prob(p, *, allow_one: bool) -> None:
    number = isinstance(p, int | float | np.floating) and not isinstance(p, bool)
    ok = number and (0 <= p <= 1 if allow_one else 0 <= p < 1)
    if not ok:
        msg = f"mask_prob must lie in [0, 1{']' if allow_one else ')'}, got {p!r}"
        raise OmicsIOError(msg)


@dataclasses.dataclass(frozen=True)
class ReplacementTokens:
    """The gene tokens MLM's random replacements are drawn from, per source (``tokens[ptr[k] :
    ptr[k + 1]]``, sorted): in a collection, the genes each source measured, so that a token output
    never emits a gene the cell's source did not measure (a source measuring no gene with a token
    draws from every one); in a dataset of one source, every gene token, as before."""

    ptr: np.ndarray  # int64, one more than the sources
    tokens: np.ndarray  # int32
    presence: object = None  # the collection's `GenePresence`, whose sources the rows belong to

    @classmethod
    def of(cls, vocab: Vocabulary, ds) -> ReplacementTokens:
        every = vocab.gene_tokens
        presence = getattr(ds, "presence", None)
        if presence is None:
            return cls(np.array([0, len(every)], np.int64), every)
        parts = []
        for measured in presence.measured:
            own = np.unique(vocab.tok[measured & (vocab.tok >= 0)]).astype(np.int32)
            parts.append(own if len(own) else every)
        ptr = np.concatenate([[0], np.cumsum([len(t) for t in parts])]).astype(np.int64)
        return cls(ptr, np.concatenate(parts), presence)

    def sources(self, rows: np.ndarray) -> np.ndarray:
        """Each row's source (int32; 0 for a padding row, whose tokens draw nothing)."""
        if self.presence is None:
            return np.zeros(len(rows), np.int32)
        return np.maximum(self.presence.sources_of(rows), 0).astype(np.int32)

"""materialize: the offline command that turns single-cell tables into omicsio_jax datasets.

Public names are imported on first use, so ``python -m materialize._shards`` (the shard writer
process) starts without loading DuckDB, AnnData or pandas.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

import omicsio_jax
from omicsio_jax import check_kernel_caches

# this package's kernels, as omicsio_jax's own (see there); they inline omicsio_jax's helpers too
check_kernel_caches(os.path.dirname(__file__), depends_on=(os.path.dirname(omicsio_jax.__file__),))

if TYPE_CHECKING:
    from ._collection_sources import Sources as Sources
    from ._index import build_gene_index as build_gene_index
    from ._materialize import MaterializeResult as MaterializeResult
    from ._materialize import materialize as materialize
    from ._options import Dask as Dask
    from ._options import InputOptions as InputOptions
    from ._options import Layout as Layout
    from ._options import Multimodal as Multimodal
    from ._parquet_stream import cells_per_batch as cells_per_batch
    from ._synthetic import SyntheticCorpus as SyntheticCorpus
    from ._synthetic import make_synthetic_corpus as make_synthetic_corpus

_PUBLIC = {
    "build_gene_index": "._index",
    "MaterializeResult": "._materialize",
    "materialize": "._materialize",
    "Dask": "._options",
    "InputOptions": "._options",
    "Layout": "._options",
    "Multimodal": "._options",
    "Sources": "._collection_sources",
    "SyntheticCorpus": "._synthetic",
    "make_synthetic_corpus": "._synthetic",
    "cells_per_batch": "._parquet_stream",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    msg = f"module 'materialize' has no attribute {name!r}"
    raise AttributeError(msg)

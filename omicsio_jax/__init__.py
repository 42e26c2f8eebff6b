"""omicsio_jax: single-cell omics data fed to JAX training at the speed of the hardware.

Public names are imported on first use (PEP 562), so ``import omicsio_jax`` is cheap and does not
load JAX: the materialize workers and the shard-format helpers use the package without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._dataset import Categorical as Categorical
    from ._dataset import Dataset as Dataset
    from ._dataset import open_dataset as open_dataset
    from ._cache import IOStats as IOStats
    from ._entropy import EntropyBounds as EntropyBounds
    from ._entropy import entropy_bounds as entropy_bounds
    from ._entropy import minibatch_entropy as minibatch_entropy
    from ._errors import DatasetFormatError as DatasetFormatError
    from ._errors import DataValidationError as DataValidationError
    from ._errors import OmicsIOError as OmicsIOError
    from ._errors import StateMismatchError as StateMismatchError
    from ._store import ObjectChangedError as ObjectChangedError
    from ._store import ObjectStoreError as ObjectStoreError
    from ._batch import Batch as Batch
    from ._batch import HostBatch as HostBatch
    from ._batch import SparseBatch as SparseBatch
    from ._batch import place_batch as place_batch
    from ._coverage import Coverage as Coverage
    from ._coverage import CoverageError as CoverageError
    from ._coverage import Tally as Tally
    from ._grain import GrainSource as GrainSource
    from ._grain import make_grain_loader as make_grain_loader
    from ._loader import Loader as Loader
    from ._loader import make_loader as make_loader
    from ._outputs import CSR as CSR
    from ._outputs import Dense as Dense
    from ._outputs import GeneformerTokens as GeneformerTokens
    from ._outputs import Modalities as Modalities
    from ._outputs import ScGPTTokens as ScGPTTokens
    from ._outputs import Output as Output
    from ._outputs import Panel as Panel
    from ._state import read_loader_states as read_loader_states
    from ._tokens import tokenize as tokenize
    from ._tune import TuneResult as TuneResult
    from ._tune import tune as tune
    from ._vocab import Vocabulary as Vocabulary
    from ._vocab import default_vocabulary as default_vocabulary
    from ._genestats import GeneStats as GeneStats
    from ._genes import GeneTable as GeneTable
    from ._genes import UnknownGeneError as UnknownGeneError
    from ._manifest import Manifest as Manifest
    from ._memory import MemoryLoader as MemoryLoader
    from ._memory import make_memory_loader as make_memory_loader
    from ._panel import InMemoryPanel as InMemoryPanel
    from ._prefetch import prefetch_to_device as prefetch_to_device
    from ._panel import load_panel as load_panel
    from ._manifest import verify_dataset as verify_dataset
    from ._query import CellTable as CellTable
    from ._query import CSRBatch as CSRBatch
    from ._query import PanelResult as PanelResult
    from ._query import arrow_csr as arrow_csr
    from ._query import open_table as open_table
    from ._sampling import SamplingPlan as SamplingPlan
    from ._scatter import scatter_dense as scatter_dense
    from ._scatter import scatter_panel as scatter_panel
    from ._stream import StreamIterator as StreamIterator
    from ._stream import StreamLoader as StreamLoader
    from ._stream import make_stream_loader as make_stream_loader

_PUBLIC = {
    "Categorical": "._dataset",
    "Dataset": "._dataset",
    "open_dataset": "._dataset",
    "IOStats": "._cache",
    "EntropyBounds": "._entropy",
    "entropy_bounds": "._entropy",
    "minibatch_entropy": "._entropy",
    "DatasetFormatError": "._errors",
    "DataValidationError": "._errors",
    "OmicsIOError": "._errors",
    "StateMismatchError": "._errors",
    "ObjectChangedError": "._store",
    "ObjectStoreError": "._store",
    "Batch": "._batch",
    "HostBatch": "._batch",
    "SparseBatch": "._batch",
    "place_batch": "._batch",
    "Coverage": "._coverage",
    "CoverageError": "._coverage",
    "Tally": "._coverage",
    "GrainSource": "._grain",
    "make_grain_loader": "._grain",
    "Loader": "._loader",
    "make_loader": "._loader",
    "CSR": "._outputs",
    "Dense": "._outputs",
    "GeneformerTokens": "._outputs",
    "Modalities": "._outputs",
    "ScGPTTokens": "._outputs",
    "Output": "._outputs",
    "Panel": "._outputs",
    "read_loader_states": "._state",
    "tokenize": "._tokens",
    "TuneResult": "._tune",
    "tune": "._tune",
    "Vocabulary": "._vocab",
    "default_vocabulary": "._vocab",
    "GeneStats": "._genestats",
    "GeneTable": "._genes",
    "UnknownGeneError": "._genes",
    "Manifest": "._manifest",
    "MemoryLoader": "._memory",
    "make_memory_loader": "._memory",
    "InMemoryPanel": "._panel",
    "prefetch_to_device": "._prefetch",
    "load_panel": "._panel",
    "verify_dataset": "._manifest",
    "CellTable": "._query",
    "CSRBatch": "._query",
    "PanelResult": "._query",
    "arrow_csr": "._query",
    "open_table": "._query",
    "SamplingPlan": "._sampling",
    "scatter_dense": "._scatter",
    "scatter_panel": "._scatter",
    "StreamIterator": "._stream",
    "StreamLoader": "._stream",
    "make_stream_loader": "._stream",
}
__all__ = list(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    msg = f"module 'omicsio_jax' has no attribute {name!r}"
    raise AttributeError(msg)


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])

"""omicsio_jax: single-cell omics data fed to JAX training at the speed of the hardware.

Public names are imported on first use (PEP 562), so ``import omicsio_jax`` is cheap and does not
load JAX: the materialize workers and the shard-format helpers use the package without it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from omicsio_jax.core.kernel_cache import check_kernel_caches
from omicsio_jax.core.lazy import lazy_exports
from omicsio_jax.core.openmp import passive_waits

check_kernel_caches(os.path.dirname(__file__))  # before any kernel loads a cache built from older modules
passive_waits()  # before numba's first parallel kernel starts OpenMP's threads

if TYPE_CHECKING:
    from omicsio_jax.core.errors import DatasetFormatError as DatasetFormatError
    from omicsio_jax.core.errors import DatasetReplacedError as DatasetReplacedError
    from omicsio_jax.core.errors import DataValidationError as DataValidationError
    from omicsio_jax.core.errors import MissingExtraError as MissingExtraError
    from omicsio_jax.core.errors import OmicsIOError as OmicsIOError
    from omicsio_jax.core.errors import StateMismatchError as StateMismatchError
    from omicsio_jax.core.errors import UnknownNameError as UnknownNameError
    from omicsio_jax.dataset.cache import IOStats as IOStats
    from omicsio_jax.dataset.dataset import Dataset as Dataset
    from omicsio_jax.dataset.dataset import open_dataset as open_dataset
    from omicsio_jax.dataset.obs import Categorical as Categorical
    from omicsio_jax.dataset.presence import GenePresence as GenePresence
    from omicsio_jax.dataset.splits import Split as Split
    from omicsio_jax.dataset.splits import split as split
    from omicsio_jax.format.gene_stats import GeneStats as GeneStats
    from omicsio_jax.format.manifest import Manifest as Manifest
    from omicsio_jax.format.manifest import verify_dataset as verify_dataset
    from omicsio_jax.loaders.disk import Loader as Loader
    from omicsio_jax.loaders.disk import make_loader as make_loader
    from omicsio_jax.loaders.grain_source import GrainSource as GrainSource
    from omicsio_jax.loaders.grain_source import GrainWorkersWarning as GrainWorkersWarning
    from omicsio_jax.loaders.grain_source import make_grain_loader as make_grain_loader
    from omicsio_jax.loaders.memory import MemoryLoader as MemoryLoader
    from omicsio_jax.loaders.memory import make_memory_loader as make_memory_loader
    from omicsio_jax.loaders.memory_panel import InMemoryPanel as InMemoryPanel
    from omicsio_jax.loaders.memory_panel import load_panel as load_panel
    from omicsio_jax.loaders.options import Placement as Placement
    from omicsio_jax.loaders.options import ReadOptions as ReadOptions
    from omicsio_jax.loaders.prefetch import prefetch_to_device as prefetch_to_device
    from omicsio_jax.loaders.state import read_loader_states as read_loader_states
    from omicsio_jax.loaders.stream import StreamIterator as StreamIterator
    from omicsio_jax.loaders.stream import StreamLoader as StreamLoader
    from omicsio_jax.loaders.stream import make_stream_loader as make_stream_loader
    from omicsio_jax.loaders.tune import TuneResult as TuneResult
    from omicsio_jax.loaders.tune import tune as tune
    from omicsio_jax.outputs.base import Output as Output
    from omicsio_jax.outputs.batch import Batch as Batch
    from omicsio_jax.outputs.batch import HostBatch as HostBatch
    from omicsio_jax.outputs.batch import SparseBatch as SparseBatch
    from omicsio_jax.outputs.batch import place_batch as place_batch
    from omicsio_jax.outputs.csr import CSR as CSR
    from omicsio_jax.outputs.dense import Dense as Dense
    from omicsio_jax.outputs.geneformer import GeneformerTokens as GeneformerTokens
    from omicsio_jax.outputs.modalities import Modalities as Modalities
    from omicsio_jax.outputs.normalize import Normalization as Normalization
    from omicsio_jax.outputs.panel import Panel as Panel
    from omicsio_jax.outputs.scatter import scatter_dense as scatter_dense
    from omicsio_jax.outputs.scatter import scatter_panel as scatter_panel
    from omicsio_jax.outputs.scgpt import ScGPTTokens as ScGPTTokens
    from omicsio_jax.outputs.tokenize import tokenize as tokenize
    from omicsio_jax.outputs.vocabulary import Vocabulary as Vocabulary
    from omicsio_jax.outputs.vocabulary import default_vocabulary as default_vocabulary
    from omicsio_jax.query.cell_table import CellTable as CellTable
    from omicsio_jax.query.cell_table import open_table as open_table
    from omicsio_jax.query.gene_table import GeneTable as GeneTable
    from omicsio_jax.query.gene_table import UnknownGeneError as UnknownGeneError
    from omicsio_jax.query.results import CSRBatch as CSRBatch
    from omicsio_jax.query.results import PanelResult as PanelResult
    from omicsio_jax.query.results import arrow_csr as arrow_csr
    from omicsio_jax.sampling.coverage import Coverage as Coverage
    from omicsio_jax.sampling.coverage import CoverageError as CoverageError
    from omicsio_jax.sampling.coverage import Tally as Tally
    from omicsio_jax.sampling.entropy import EntropyBounds as EntropyBounds
    from omicsio_jax.sampling.entropy import entropy_bounds as entropy_bounds
    from omicsio_jax.sampling.entropy import minibatch_entropy as minibatch_entropy
    from omicsio_jax.sampling.options import Block as Block
    from omicsio_jax.sampling.options import ClassBalanced as ClassBalanced
    from omicsio_jax.sampling.options import Mixture as Mixture
    from omicsio_jax.sampling.options import Random as Random
    from omicsio_jax.sampling.options import Sampling as Sampling
    from omicsio_jax.sampling.options import Stream as Stream
    from omicsio_jax.sampling.options import Weighted as Weighted
    from omicsio_jax.sampling.plan import SamplingPlan as SamplingPlan
    from omicsio_jax.storage.store import ObjectChangedError as ObjectChangedError
    from omicsio_jax.storage.store import ObjectStoreError as ObjectStoreError

_PUBLIC = {
    "Block": "omicsio_jax.sampling.options",
    "Random": "omicsio_jax.sampling.options",
    "Stream": "omicsio_jax.sampling.options",
    "Weighted": "omicsio_jax.sampling.options",
    "ClassBalanced": "omicsio_jax.sampling.options",
    "Mixture": "omicsio_jax.sampling.options",
    "Sampling": "omicsio_jax.sampling.options",
    "Placement": "omicsio_jax.loaders.options",
    "ReadOptions": "omicsio_jax.loaders.options",
    "Normalization": "omicsio_jax.outputs.normalize",
    "Categorical": "omicsio_jax.dataset.obs",
    "Dataset": "omicsio_jax.dataset.dataset",
    "open_dataset": "omicsio_jax.dataset.dataset",
    "GenePresence": "omicsio_jax.dataset.presence",
    "Split": "omicsio_jax.dataset.splits",
    "split": "omicsio_jax.dataset.splits",
    "IOStats": "omicsio_jax.dataset.cache",
    "EntropyBounds": "omicsio_jax.sampling.entropy",
    "entropy_bounds": "omicsio_jax.sampling.entropy",
    "minibatch_entropy": "omicsio_jax.sampling.entropy",
    "DatasetFormatError": "omicsio_jax.core.errors",
    "DatasetReplacedError": "omicsio_jax.core.errors",
    "MissingExtraError": "omicsio_jax.core.errors",
    "DataValidationError": "omicsio_jax.core.errors",
    "OmicsIOError": "omicsio_jax.core.errors",
    "StateMismatchError": "omicsio_jax.core.errors",
    "UnknownNameError": "omicsio_jax.core.errors",
    "check_kernel_caches": "omicsio_jax.core.kernel_cache",
    "ObjectChangedError": "omicsio_jax.storage.store",
    "ObjectStoreError": "omicsio_jax.storage.store",
    "Batch": "omicsio_jax.outputs.batch",
    "HostBatch": "omicsio_jax.outputs.batch",
    "SparseBatch": "omicsio_jax.outputs.batch",
    "place_batch": "omicsio_jax.outputs.batch",
    "Coverage": "omicsio_jax.sampling.coverage",
    "CoverageError": "omicsio_jax.sampling.coverage",
    "Tally": "omicsio_jax.sampling.coverage",
    "GrainSource": "omicsio_jax.loaders.grain_source",
    "GrainWorkersWarning": "omicsio_jax.loaders.grain_source",
    "make_grain_loader": "omicsio_jax.loaders.grain_source",
    "Loader": "omicsio_jax.loaders.disk",
    "make_loader": "omicsio_jax.loaders.disk",
    "CSR": "omicsio_jax.outputs.csr",
    "Dense": "omicsio_jax.outputs.dense",
    "GeneformerTokens": "omicsio_jax.outputs.geneformer",
    "Modalities": "omicsio_jax.outputs.modalities",
    "ScGPTTokens": "omicsio_jax.outputs.scgpt",
    "Output": "omicsio_jax.outputs.base",
    "Panel": "omicsio_jax.outputs.panel",
    "read_loader_states": "omicsio_jax.loaders.state",
    "tokenize": "omicsio_jax.outputs.tokenize",
    "TuneResult": "omicsio_jax.loaders.tune",
    "tune": "omicsio_jax.loaders.tune",
    "Vocabulary": "omicsio_jax.outputs.vocabulary",
    "default_vocabulary": "omicsio_jax.outputs.vocabulary",
    "GeneStats": "omicsio_jax.format.gene_stats",
    "GeneTable": "omicsio_jax.query.gene_table",
    "UnknownGeneError": "omicsio_jax.query.gene_table",
    "Manifest": "omicsio_jax.format.manifest",
    "MemoryLoader": "omicsio_jax.loaders.memory",
    "make_memory_loader": "omicsio_jax.loaders.memory",
    "InMemoryPanel": "omicsio_jax.loaders.memory_panel",
    "prefetch_to_device": "omicsio_jax.loaders.prefetch",
    "load_panel": "omicsio_jax.loaders.memory_panel",
    "verify_dataset": "omicsio_jax.format.manifest",
    "CellTable": "omicsio_jax.query.cell_table",
    "CSRBatch": "omicsio_jax.query.results",
    "PanelResult": "omicsio_jax.query.results",
    "arrow_csr": "omicsio_jax.query.results",
    "open_table": "omicsio_jax.query.cell_table",
    "SamplingPlan": "omicsio_jax.sampling.plan",
    "scatter_dense": "omicsio_jax.outputs.scatter",
    "scatter_panel": "omicsio_jax.outputs.scatter",
    "StreamIterator": "omicsio_jax.loaders.stream",
    "StreamLoader": "omicsio_jax.loaders.stream",
    "make_stream_loader": "omicsio_jax.loaders.stream",
}
__all__ = list(_PUBLIC)
__version__ = "0.1.0"
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)

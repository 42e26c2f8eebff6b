"""omicsio_jax: single-cell omics data fed to JAX training at the speed of the hardware."""

from ._dataset import Categorical as Categorical
from ._dataset import Dataset as Dataset
from ._dataset import open_dataset as open_dataset
from ._entropy import EntropyBounds as EntropyBounds
from ._entropy import entropy_bounds as entropy_bounds
from ._entropy import minibatch_entropy as minibatch_entropy
from ._errors import DatasetFormatError as DatasetFormatError
from ._errors import DataValidationError as DataValidationError
from ._errors import OmicsIOError as OmicsIOError
from ._errors import StateMismatchError as StateMismatchError
from ._loader import Batch as Batch
from ._loader import HostBatch as HostBatch
from ._loader import Loader as Loader
from ._loader import SparseBatch as SparseBatch
from ._loader import make_loader as make_loader
from ._genes import GeneTable as GeneTable
from ._genes import UnknownGeneError as UnknownGeneError
from ._manifest import Manifest as Manifest
from ._memory import InMemoryPanel as InMemoryPanel
from ._memory import MemoryLoader as MemoryLoader
from ._memory import load_panel as load_panel
from ._memory import make_memory_loader as make_memory_loader
from ._manifest import verify_dataset as verify_dataset
from ._query import CellTable as CellTable
from ._query import CSRBatch as CSRBatch
from ._query import PanelResult as PanelResult
from ._query import arrow_csr as arrow_csr
from ._query import open_table as open_table
from ._sampling import SamplingPlan as SamplingPlan
from ._scatter import scatter_dense as scatter_dense
from ._scatter import scatter_panel as scatter_panel
from ._stream import StreamLoader as StreamLoader
from ._stream import make_stream_loader as make_stream_loader

__version__ = "0.1.0"

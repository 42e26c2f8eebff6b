"""omicsio_jax: single-cell omics data fed to JAX training at the speed of the hardware."""

from ._dataset import Categorical as Categorical
from ._dataset import Dataset as Dataset
from ._dataset import open_dataset as open_dataset
from ._errors import DatasetFormatError as DatasetFormatError
from ._errors import DataValidationError as DataValidationError
from ._errors import OmicsIOError as OmicsIOError
from ._errors import StateMismatchError as StateMismatchError
from ._manifest import Manifest as Manifest
from ._manifest import verify_dataset as verify_dataset

__version__ = "0.1.0"

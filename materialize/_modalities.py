"""Further modalities of the primary's cells — splice layers, ATAC peaks, proteins — aligned by cell.

A multimodal dataset is the primary modality's dataset plus one complete dataset per further
modality under ``modalities/<name>/``, whose row ``i`` is the primary's cell ``i`` (see
`omicsio_jax.format.manifest`): a loader that asks for one modality reads no byte of the others, and
each modality keeps the codec, chunk indexes, statistics and checks of a dataset of its own.
The primary is written first; each further modality is then a `Source` whose batches come in the
primary's row order, with ``present`` marking the cells that have it (an absent cell gets an
empty row; ``require_all`` makes absence an error). Its inputs:

- **list-column tables**, one per modality, joined on ``cell_id`` with the primary's cells (read
  back from the primary's written partitions, so any primary input works). A table whose rows
  are already the primary's cells in order (the usual case: tables written together) is read as
  it is, in partitions, in parallel. Any other is first spilled by partition in one streaming
  pass (`_reorder`: DuckDB joins only the cell ids; the lists go to a memory-mapped Arrow file
  per partition), and each partition's writer takes its rows in order from its file. Splice layers (``layers=``) use the primary's gene table; other modalities have
  their own feature table (given, or ``<name>_features.parquet`` / ``peaks.parquet`` /
  ``features.parquet`` beside the table), keyed by the table's token column (``peak_token_id``).
- **.h5ad layers** (``layers=["spliced", ...]``): ``layers/<name>`` of the file, aligned by construction.
- **.h5mu** (MuData): ``mod/<name>`` of the file, aligned with the primary modality through
  MuData's ``obsmap`` (or, in a file without one, by obs names).

This module names them; the code: `_modality_inputs` (the modalities asked for), `_modality_table`
and `_modality_features` (list-column tables and their feature tables), `_modality_h5` (``.h5ad``
layers, ``.h5mu`` modalities).
"""

from ._modality_h5 import H5Modality as H5Modality
from ._modality_h5 import h5mu_alignment as h5mu_alignment
from ._modality_h5 import h5mu_modalities as h5mu_modalities
from ._modality_inputs import LAYER as LAYER
from ._modality_inputs import OWN as OWN
from ._modality_inputs import ModalityInput as ModalityInput
from ._modality_inputs import input_kind as input_kind
from ._modality_inputs import modality_inputs as modality_inputs
from ._modality_table import TableModality as TableModality

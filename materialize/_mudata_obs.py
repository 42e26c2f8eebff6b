"""An ``.h5mu`` file's own obs (``/obs``: annotations of the whole MuData, such as donor or sample),
carried with a modality's cells by their obs names.

MuData keeps obs at two levels: each modality's (``mod/rna/obs``) and the file's, over the union of
the modalities' cells. A modality's cells get the file's columns its own obs does not have, matched
by obs name (a cell the file's obs does not list gets nulls). The file's copies of the modalities'
own columns (``rna:cell_type``, which MuData's ``update`` writes) are left to the modalities.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


class FileObsColumn:
    """One column of the file's obs read for a modality's rows: ``rows[i]`` is the file's obs row of
    the modality's row ``i`` (-1: none), or None where the rows are the same. The column is read
    whole once (an obs column holds one value per cell)."""

    def __init__(self, column, num_rows: int, rows: np.ndarray | None):
        self._column, self._num_rows, self._rows = column, num_rows, rows
        self.type = column.type
        self._values: pa.Array | None = None

    def read(self, lo: int, hi: int) -> pa.Array:
        if self._values is None:
            self._values = self._column.read(0, self._num_rows)
        if self._rows is None:
            return self._values.slice(lo, hi - lo)
        rows = self._rows[lo:hi]
        return self._values.take(pa.array(np.maximum(rows, 0), mask=rows < 0))


def file_obs(file_frame, own_frame, own: dict, modalities: list[str]) -> dict:
    """The columns of the file's obs (``file_frame``) for a modality whose obs is ``own_frame`` with
    columns ``own``: those the modality lacks, but for the file's copies of the modalities' columns
    (``<modality>:<column>``). None of them when the file's obs names repeat (no cell is matched)."""
    names = [
        n
        for n, col in file_frame.columns.items()
        if col.type is not None and n not in own and n.split(":", 1)[0] not in modalities
    ]
    if not names:
        return {}
    total, count = len(file_frame), len(own_frame)
    file_ids = file_frame.index(0, total).to_numpy(zero_copy_only=False)
    own_ids = own_frame.index(0, count).to_numpy(zero_copy_only=False)
    rows = None
    if total != count or not np.array_equal(file_ids, own_ids):
        import pandas as pd

        index = pd.Index(file_ids)
        if not index.is_unique:
            return {}
        rows = index.get_indexer(own_ids).astype(np.int64)
    return {n: FileObsColumn(file_frame.columns[n], total, rows) for n in names}

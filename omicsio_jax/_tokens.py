"""`tokenize`: the token arrays of chosen cells, as a pure function (for inspection and tests)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import _codec
from ._dataset import Dataset, open_dataset
from ._fetch import FetchReader
from ._outputs import Output, OutputContext, RowKeys
from ._records import records_checked


def tokenize(ds: Dataset | str, rows: Sequence[int] | np.ndarray, output: Output, *, seed: int = 0,
             epoch: int = 0) -> dict[str, np.ndarray]:
    """The arrays ``output`` (`GeneformerTokens`, `ScGPTTokens`) makes for ``rows``, in that order.

    A loader with the same ``seed`` gives every cell exactly these arrays in ``epoch``, whatever
    batch it lands in (-1 in ``rows`` gives a padding row).

    >>> x = oj.tokenize(ds, [0, 5, 7], oj.GeneformerTokens(max_len=512))   # doctest: +SKIP
    >>> x["input_ids"].shape
    (3, 512)
    """
    ds = ds if isinstance(ds, Dataset) else open_dataset(ds)
    rows = np.asarray(rows, dtype=np.int64)
    real = rows[rows >= 0]
    if len(real):
        ds.check_rows(real)
    bound = output.bind(OutputContext.of_dataset(ds, rows=max(len(rows), 1)))
    buf, starts = _codec.join_records(FetchReader(ds)(rows))
    with records_checked(ds, rows):
        return bound.from_records(buf, starts, np.empty, RowKeys(rows, epoch, seed))

"""`tokenize`: the token arrays of chosen cells, as a pure function (for inspection and tests)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.dataset.batched_reads import OutputRecords
from omicsio_jax.dataset.dataset import Dataset, open_dataset
from omicsio_jax.outputs.base import Output, OutputContext, RowKeys
from omicsio_jax.outputs.resolve import resolve_output
from omicsio_jax.records.runs import records_checked


def tokenize(
    ds: Dataset | str,
    rows: Sequence[int] | np.ndarray,
    output: Output | Mapping[str, Output],
    *,
    seed: int = 0,
    epoch: int = 0,
) -> dict[str, np.ndarray]:
    """The arrays ``output`` (`GeneformerTokens`, `ScGPTTokens`) makes for ``rows``, in that order.

    A loader with the same ``seed`` gives every cell exactly these arrays in ``epoch``, whatever
    batch it lands in (-1 in ``rows`` gives a padding row). A dict ``{modality: output}`` gives a
    dict of each modality's arrays (tokens need a gene-space modality: the primary or a layer).

    >>> x = oj.tokenize(ds, [0, 5, 7], oj.GeneformerTokens(max_len=512))   # doctest: +SKIP
    >>> x["input_ids"].shape
    (3, 512)
    >>> x = oj.tokenize(ds, [0, 5], {"spliced": oj.ScGPTTokens(), "unspliced": oj.ScGPTTokens()})  # doctest: +SKIP
    """
    for name, value in (("seed", seed), ("epoch", epoch)):  # the draws' keys are 64-bit
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 0 <= value < 2**64:
            msg = f"tokenize({name}=...) must be an integer in 0..2**64-1, got {value!r}"
            raise OmicsIOError(msg)
    ds = ds if isinstance(ds, Dataset) else open_dataset(ds)
    given = np.asarray(rows)
    ds.check_rows(given[given != -1] if given.ndim == 1 else given)  # within the dataset; -1: padding
    rows = given.astype(np.int64)
    bound = resolve_output(output).bind(OutputContext.of_dataset(ds, rows=max(len(rows), 1)))
    read = OutputRecords(ds, bound.modalities)
    records = read.join(read(rows), 0, len(rows))
    with records_checked(ds, rows):
        return bound.from_records(records, np.empty, RowKeys(rows, epoch, seed))

"""`ClosingIterator`: the loaders' Grain iterator, closed by a ``with`` block as a dataset is."""

from __future__ import annotations

import grain


class ClosingIterator(grain.DatasetIterator):
    """A `grain.DatasetIterator` that is its own context manager::

        with oj.open_dataset("pbmc/") as ds, oj.make_loader(ds, batch_size=256) as loader:
            for batch in loader:
                ...

    Leaving the block calls `close` (the reading and placing threads stop, files close), whether
    the block ends or raises; a closed iterator raises ``ValueError`` on `next` (Grain's rule)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

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


class RunLength:
    """``len(loader)`` for a loader with ``num_epochs`` and ``steps_per_epoch``: the batches of the
    whole run from its start, ``steps_per_epoch × num_epochs``, as ``len`` of a Grain source is
    (the total ``tqdm(loader)`` shows). An endless loader (``num_epochs=None``) has no length: a
    one-line TypeError, as for any endless iterator. A loader is always true (``if loader:`` would
    otherwise ask its length: False for a run of no batches, an error for an endless one)."""

    num_epochs: int | None
    steps_per_epoch: int

    def __len__(self) -> int:
        if self.num_epochs is None:
            msg = (
                f"an endless {type(self).__name__} (num_epochs=None) has no length; its epochs are "
                f"steps_per_epoch={self.steps_per_epoch} batches"
            )
            raise TypeError(msg)
        return self.num_epochs * self.steps_per_epoch

    def __bool__(self) -> bool:
        return True

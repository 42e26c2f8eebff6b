"""Windows of a query's rows, as `make_stream_loader` shuffles and serves them.

A `Window` is consecutive rows of a query as CSR arrays, with each row's ``cell_rowid`` and
encoded obs columns. The query delivers them in Arrow record batches; `cut_windows` joins and cuts
those into windows of exactly the shuffle window's rows, each then permuted on its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import numpy as np


@dataclasses.dataclass
class Window:
    """Consecutive rows of a query: CSR arrays, each row's ``cell_rowid`` and its obs codes."""

    indptr: np.ndarray
    indices: np.ndarray
    values: np.ndarray
    rowids: np.ndarray
    obs: dict[str, np.ndarray]

    @property
    def num_rows(self) -> int:
        return len(self.rowids)

    def split(self, n: int) -> tuple[Window, Window]:
        """The first ``n`` rows and the rest, as views."""
        return (
            Window(
                self.indptr[: n + 1],
                self.indices,
                self.values,
                self.rowids[:n],
                {k: v[:n] for k, v in self.obs.items()},
            ),
            Window(
                self.indptr[n:],
                self.indices,
                self.values,
                self.rowids[n:],
                {k: v[n:] for k, v in self.obs.items()},
            ),
        )

    @staticmethod
    def concat(parts: list[Window]) -> Window:
        if len(parts) == 1:
            return parts[0]
        lengths = np.concatenate([np.diff(p.indptr) for p in parts])
        indptr = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=indptr[1:])
        return Window(
            indptr,
            np.concatenate([p.indices[p.indptr[0] : p.indptr[-1]] for p in parts]),
            np.concatenate([p.values[p.indptr[0] : p.indptr[-1]] for p in parts]),
            np.concatenate([p.rowids for p in parts]),
            {k: np.concatenate([p.obs[k] for p in parts]) for k in parts[0].obs},
        )


def cut_windows(parts: Iterable[Window], num_rows: int) -> Iterator[Window]:
    """Windows of exactly ``num_rows`` consecutive rows (the last one shorter)."""
    pending: list[Window] = []
    held = 0
    for part in parts:
        pending.append(part)
        held += part.num_rows
        while held >= num_rows:
            head, tail = Window.concat(pending).split(num_rows)
            yield head
            pending, held = ([tail] if tail.num_rows else []), tail.num_rows
    if held:
        yield Window.concat(pending)

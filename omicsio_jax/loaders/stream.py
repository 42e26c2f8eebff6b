"""`make_stream_loader`: a DuckDB query straight to sharded jax.Arrays, without materializing.

query → Arrow record batches (stage 4) → CSR views → optional shuffle window → numba scatter
(full transcriptome or gene panel, optional fused normalize + log1p) → 64-byte aligned host rows
→ `place_batch` with ``NamedSharding``. A background thread runs the
query and the scatter while the consumer computes. For inference and quick experiments; for
training on more than a few passes, materialize and use `make_loader` (block sampling, replay).

The shuffle window (``sampling=oj.Stream(shuffle=True, fetch_factor=f)``): consecutive windows of
``f × batch_size`` cells are each permuted with ``default_rng([seed, epoch, window])`` and
served. A cell moves at most one window from its place, so a window should span several plates
of the table to mix them. The query's rows arrive in Arrow record batches of `QUERY_BATCH_ROWS`.

Each pass is a `grain.DatasetIterator` (`StreamIterator`): its state is ``(epoch, batches
served)``; a restore runs the query again and skips the windows already served without
decoding them. At the end of a pass the cells served are checked against the query's.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Iterator, Sequence

import jax
import numpy as np

from omicsio_jax.core.buffers import RowBuffers
from omicsio_jax.core.errors import OmicsIOError
from omicsio_jax.core.producer import Background
from omicsio_jax.format.csr import take_rows
from omicsio_jax.loaders.batch_obs import obs_names
from omicsio_jax.loaders.iterator import ClosingIterator
from omicsio_jax.loaders.options import (
    Placement,
    ReadOptions,
    check_argument,
    numba_threads,
    numba_threads_in_force,
)
from omicsio_jax.loaders.output_repr import describe_output
from omicsio_jax.loaders.state import as_json, check_state, reads_state
from omicsio_jax.loaders.windows import Window, cut_windows
from omicsio_jax.outputs.base import Output, OutputContext
from omicsio_jax.outputs.batch import Batch, HostBatch, place_batch
from omicsio_jax.outputs.resolve import resolve_output
from omicsio_jax.query.cell_table import CellTable
from omicsio_jax.query.results import ObsSpec
from omicsio_jax.sampling.coverage import Coverage, Tally
from omicsio_jax.sampling.options import Stream

STATE_VERSION = 1
QUERY_BATCH_ROWS = 8192  # rows per Arrow record batch of the query

_INT32_MAX = np.iinfo(np.int32).max


class StreamLoader:
    """Batches of a query's cells as sharded jax.Arrays. Build with `make_stream_loader`.

    ``for batch in loader`` runs one pass (epoch 0); ``loader.epoch(e)`` runs pass ``e`` with
    its own shuffle. Each `Batch` has ``x`` (``(batch_size, features)`` float32), ``obs``,
    ``index`` (each cell's ``cell_rowid``, -1 for padding) and ``mask``.

    A context manager: leaving ``with oj.make_stream_loader(...) as loader:`` closes every pass it
    has started and still holds (their query threads stop, their connections close), as `close`
    does.
    """

    def __init__(
        self,
        table: CellTable,
        *,
        batch_size: int,
        output: Output,
        where: str | None,
        rowids: np.ndarray | None,
        obs: list[ObsSpec],
        shuffle_buffer: int,
        seed: int,
        mesh,
        data_axis: str,
        drop_remainder: bool,
        batch_rows: int,
        prefetch: int,
        decode_threads: int | None,
        sampling: Stream,
    ):
        self.table, self.batch_size, self.given_output = table, batch_size, output  # repr shows it as given
        self.output = output.bind(OutputContext.of_table(table, rows=batch_size))
        self.where, self.rowids, self.obs_specs = where, rowids, obs
        self.shuffle_buffer, self.seed = shuffle_buffer, seed
        self.mesh, self.data_axis, self.drop_remainder = mesh, data_axis, drop_remainder
        self.batch_rows, self.prefetch = batch_rows, prefetch
        self.decode_threads = numba_threads_in_force(decode_threads)  # of each batch's scatter
        self.sampling = sampling  # as given to make_stream_loader (shuffle_buffer, drop_remainder: its)
        # the shuffle window, rounded up to whole batches so only the last window leaves a remainder
        self.window_rows = -(-max(shuffle_buffer, batch_size) // batch_size) * batch_size
        self._buffers = RowBuffers()
        self._passes: weakref.WeakSet[StreamIterator] = weakref.WeakSet()  # for `close`

    def __repr__(self) -> str:
        rows = None if self.rowids is None else f"[{len(self.rowids):,} rowids]"
        output = describe_output(self.given_output)
        return (
            f"StreamLoader({self.table.spec!r}, batch_size={self.batch_size}, where={self.where!r}, rowids={rows}, "
            f"sampling={self.sampling}, output={output}, obs={[s.name for s in self.obs_specs]}, "
            f"seed={self.seed}, read=ReadOptions(prefetch={self.prefetch}, decode_threads={self.decode_threads}), "
            "hosts=1)"
        )

    def __iter__(self) -> StreamIterator:
        return self.epoch(0)

    def epoch(self, epoch: int) -> StreamIterator:
        """One pass over the query's cells, shuffled (when ``shuffle_buffer`` > 0) for ``epoch``."""
        one = StreamIterator(self, epoch)
        self._passes.add(one)
        return one

    def close(self) -> None:
        """Close every pass this loader has started and not yet let go of (`StreamIterator.close`)."""
        for one in list(self._passes):
            one.close()

    def __enter__(self) -> StreamLoader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def config(self) -> dict:
        """What decides the batches: the table's files, the query, the output and the shuffle."""

        def digest(value) -> str:
            return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]

        return as_json(
            {
                "table": digest(self.table.fingerprint()),
                "where": self.where,
                "rowids": None if self.rowids is None else digest(np.unique(self.rowids).tolist()),
                "obs": [s.name for s in self.obs_specs],
                **self.output.config(),
                "batch_size": self.batch_size,
                "shuffle_buffer": self.shuffle_buffer,
                "seed": self.seed,
                "drop_remainder": self.drop_remainder,
            }
        )

    def planned(self, epoch: int) -> Tally:
        """The cells a pass serves: the query's, less the last window's partial batch if dropped."""
        rows = self.table.select(self.where, rowids=self.rowids)  # the stream's order: ascending cell_rowid
        full = len(rows) // self.window_rows * self.window_rows
        last = rows[full:]
        if self.drop_remainder and len(last) % self.batch_size:
            kept = len(last) // self.batch_size * self.batch_size
            last = last[self._order(len(last), epoch, full // self.window_rows)[:kept]]
        return Tally.of(rows[:full]) + Tally.of(last)

    # ----- host side -------------------------------------------------------------------------
    def _windows(self) -> Iterator[Window]:
        for b in self.table.stream_csr(
            [s.name for s in self.obs_specs], where=self.where, rowids=self.rowids, batch_rows=self.batch_rows
        ):
            if len(b.rowids) and b.rowids.max() > _INT32_MAX:
                msg = f"cell_rowid {int(b.rowids.max())} does not fit the int32 batch index"
                raise OmicsIOError(msg)
            yield Window(
                b.indptr,
                b.indices,
                b.values,
                b.rowids,
                {s.name: s.encode(b.columns[s.name]) for s in self.obs_specs},
            )

    def _host_batches(self, epoch: int, skip: int = 0) -> Iterator[HostBatch]:
        """The pass's host batches after the first ``skip`` (whole windows skipped undecoded)."""
        per_window = self.window_rows // self.batch_size
        for number, window in enumerate(cut_windows(self._windows(), self.window_rows)):
            if skip >= per_window and window.num_rows == self.window_rows:
                skip -= per_window
                continue
            order = self._order(window.num_rows, epoch, number)
            full = (window.num_rows // self.batch_size) * self.batch_size
            yield from self._serve(window, order[skip * self.batch_size : full])
            if full < window.num_rows and not self.drop_remainder and skip <= full // self.batch_size:
                yield self._batch(window, order[full:])  # only the last window has a remainder
            skip = 0

    def _order(self, n: int, epoch: int, window: int) -> np.ndarray:
        if self.shuffle_buffer <= 0:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch, window]).permutation(n)

    def _serve(self, window: Window, order: np.ndarray) -> Iterator[HostBatch]:
        for start in range(0, len(order), self.batch_size):
            yield self._batch(window, order[start : start + self.batch_size])

    def _batch(self, window: Window, order: np.ndarray) -> HostBatch:
        n, b = len(order), self.batch_size
        if self.shuffle_buffer <= 0 and (n == 0 or order[-1] - order[0] == n - 1):  # contiguous: no copy
            indptr = window.indptr[order[0] : order[0] + n + 1] if n else window.indptr[:1]
            indices, values = window.indices, window.values
        else:
            indptr, indices, values = take_rows(
                window.indptr, window.indices, window.values, order.astype(np.int64)
            )
        if n < b:  # padding rows are empty
            indptr = np.concatenate([indptr, np.full(b - n, indptr[-1], np.int64)])
        with numba_threads(self.decode_threads):
            out = self.output.from_csr(indptr, indices, values, self._buffers.empty)
        mask = np.arange(b) < n
        index = np.full(b, -1, np.int32)
        index[:n] = window.rowids[order]
        obs = {}
        for s in self.obs_specs:
            column = np.full(
                b,
                -1 if s.categories is not None else np.nan,
                np.int32 if s.categories is not None else np.float32,
            )
            column[:n] = window.obs[s.name][order]
            obs[s.name] = column
        return HostBatch(out, obs, index, mask)


class StreamIterator(ClosingIterator):
    """One pass of a `StreamLoader` (epoch ``epoch``): `Batch`es, with Grain's state protocol."""

    def __init__(self, loader: StreamLoader, epoch: int):
        super().__init__()
        self._stream = None
        self.loader, self._epoch, self._step, self._served = loader, epoch, 0, Tally()
        self._done = False

    def __repr__(self) -> str:
        return f"StreamIterator(epoch={self._epoch}, step={self._step}, loader={self.loader!r})"

    def __next__(self) -> Batch:
        self._assert_not_closed()
        if self._done:
            raise StopIteration
        if self._stream is None:
            # the producer holds the loader, not this pass: a pass let go of (a ``for`` loop left by
            # ``break``) is then collected at once, and its collection stops the producer, whose
            # query's connection closes (`CellTable.stream`)
            loader, start = self.loader, (self._epoch, self._step)
            self._stream = Background(lambda: loader._host_batches(*start), depth=loader.prefetch)
        try:
            hb = next(self._stream)
            batch = place_batch(hb, self.loader.mesh, self.loader.data_axis)
        except StopIteration:
            self._done = True
            self.coverage().check(f"make_stream_loader on {self.loader.table.spec}")
            raise
        except BaseException:
            # a batch not served (the producer ends on an error making it; placing it failed or was
            # interrupted): the next call runs the query again from this step, as a restore does,
            # rather than end the pass there (its audit then failed as cells not served)
            self._stop()
            raise
        self._served = self._served + Tally.of(hb.index)  # the position moves only with a batch placed
        self._step += 1
        return batch

    def coverage(self) -> Coverage:
        """The cells served so far in this pass, and the query's (one extra query over the scalar columns)."""
        return Coverage(self._epoch, self._served, self.loader.planned(self._epoch))

    def get_state(self) -> dict:
        return {
            "version": STATE_VERSION,
            "config": self.loader.config(),
            "epoch": self._epoch,
            "step": self._step,
            "served": self._served.to_json(),
        }

    @reads_state
    def set_state(self, state: dict) -> None:
        """Resume ``state``: the query runs again and the batches already served are skipped (whole
        windows without decoding them); refuses a state of another query or config."""
        check_state(state, STATE_VERSION, self.loader.config())
        self._stop()
        self._epoch, self._step, self._done = int(state["epoch"]), int(state["step"]), False
        self._served = Tally.from_json(state["served"])

    def _stop(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def close(self) -> None:
        self._stop()
        super().close()


def make_stream_loader(
    table: CellTable,
    *,
    batch_size: int,
    where: str | None = None,
    rowids: Sequence[int] | np.ndarray | None = None,
    obs: str | Sequence[str] = (),
    output: str | Output = "dense",
    sampling: Stream = Stream(drop_remainder=False),
    seed: int = 0,
    placement: Placement | jax.sharding.Mesh | None = None,
    read: ReadOptions = ReadOptions(),
) -> StreamLoader:
    """Stream a query's cells to the devices as dense batches (full transcriptome or a panel).

    >>> table = oj.open_table("atlas/")                                         # doctest: +SKIP
    >>> auto = (jax.sharding.AxisType.Auto,)  # a train step's gradients need Auto axes    # doctest: +SKIP
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=auto)    # doctest: +SKIP
    >>> loader = oj.make_stream_loader(table, batch_size=1024, where="tissue = 'lung'",
    ...                                output=oj.Panel(panel), obs=("cell_type",), placement=mesh)  # doctest: +SKIP
    >>> for batch in loader: ...        # batch.x: (1024, len(panel)) float32, sharded P("data")

    Rows come in table order unless ``sampling=oj.Stream(shuffle=True, fetch_factor=f)`` (see the
    module docstring). The last partial batch is padded (``mask`` False) unless the sampling's
    ``drop_remainder``. ``output`` is `Dense` or `Panel` (or ``"dense"``); of ``read``,
    ``prefetch`` batches are made ahead on a thread (default 2), each scattered on
    ``decode_threads`` numba threads (default: all of numba's); ``num_threads`` is refused (that
    one thread runs the query and makes the batches). ``repr(loader)`` shows the settings in
    force. Single-host: every process would read the whole query.
    """
    if not isinstance(table, CellTable):
        msg = (
            f"make_stream_loader streams a query of a cell table, oj.open_table(path), not "
            f"{type(table).__name__}: a materialized dataset (oj.open_dataset) is read by oj.make_loader"
        )
        raise OmicsIOError(msg)
    placement, read = Placement.of(placement), ReadOptions.of(read)
    if placement.num_hosts > 1:
        msg = "make_stream_loader is single-host; materialize the data and use make_loader on several hosts"
        raise OmicsIOError(msg)
    if read.num_threads is not None:
        msg = (
            f"make_stream_loader takes no ReadOptions(num_threads={read.num_threads}): one thread runs the query "
            "and makes ReadOptions(prefetch=n) batches ahead, each scattered on ReadOptions(decode_threads=...) "
            "numba threads; leave num_threads None"
        )
        raise OmicsIOError(msg)
    check_argument("make_stream_loader", "batch_size", batch_size, minimum=1)
    check_argument("make_stream_loader", "seed", seed, minimum=0)
    if not isinstance(sampling, Stream):
        msg = (
            f"make_stream_loader reads a query in table order: sampling must be an oj.Stream (shuffle=True "
            f"shuffles within windows of fetch_factor × batch_size cells); got {sampling!r}"
        )
        raise OmicsIOError(msg)
    placement.check_batch_size(batch_size)
    output = resolve_output(output)
    if type(output).from_csr is Output.from_csr:  # (its own line, here rather than at the first batch)
        msg = (
            f"make_stream_loader makes Dense or Panel batches from a query, not {output.kind!r}: "
            "materialize the data and use make_loader for it"
        )
        raise OmicsIOError(msg)
    table.check_where(where)  # a column it lacks named now, not by the first batch's thread
    rows = None if rowids is None else table.check_rowids(rowids)
    return StreamLoader(
        table,
        batch_size=batch_size,
        output=output,
        where=where,
        rowids=rows,
        obs=table.obs_specs(obs_names(obs)),
        shuffle_buffer=sampling.fetch_factor * batch_size if sampling.shuffle else 0,
        seed=seed,
        mesh=placement.mesh,
        data_axis=placement.data_axis,
        drop_remainder=sampling.drop_remainder,
        batch_rows=QUERY_BATCH_ROWS,
        prefetch=read.with_defaults(prefetch=2).prefetch,
        decode_threads=read.decode_threads,
        sampling=sampling,
    )

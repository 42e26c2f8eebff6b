"""`prefetch_to_device`: place a host-batch iterator's batches on the devices ahead, on threads.

Grain's DataLoader yields numpy batches in the training loop's thread; placing a full-transcriptome
batch there (257 MB at batch 1,024) stalls the step on a GPU host. This wrapper pulls host
batches from the iterator, places each on a small thread pool (copies to the devices overlap the
step and each other) and hands them out in order. Its state is the wrapped iterator's state
after the last batch *handed out*, not after those prefetched, so checkpoints stay exact; every
process's states restore onto another number of processes wherever the wrapped iterator's do
(`make_loader`, `make_memory_loader`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import weakref
from collections.abc import Sequence
from typing import Any

from omicsio_jax.core.errors import StateMismatchError
from omicsio_jax.loaders.iterator import ClosingIterator
from omicsio_jax.loaders.state import read_loader_states
from omicsio_jax.outputs.batch import Batch, place_batch


class DevicePrefetch(ClosingIterator):
    """See `prefetch_to_device`."""

    def __init__(
        self, iterator, mesh=None, data_axis: str = "data", *, buffer_size: int = 2, threads: int = 2
    ):
        super().__init__()
        self._inner, self.mesh, self.data_axis = iterator, mesh, data_axis
        self._buffer_size = max(buffer_size, 1)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max(threads, 1), thread_name_prefix="omicsio-jax-place"
        )
        # an iterator dropped without `close` still ends its threads
        self._shutdown = weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
        # (placement, host batch until placed, the wrapped iterator's state after it)
        self._pending: collections.deque[tuple[concurrent.futures.Future, Any, Any]] = collections.deque()
        self._state = self._inner_state()
        self._exhausted = False

    def _inner_state(self):
        state = self._inner.get_state()
        return {"bytes": state.decode()} if isinstance(state, bytes) else state  # DataLoaderIterator: bytes

    def _fill(self) -> None:
        while not self._exhausted and len(self._pending) < self._buffer_size:
            try:
                host_batch = next(self._inner)
            except StopIteration:
                self._exhausted = True
                return
            self._pending.append((*self._place(host_batch), self._inner_state()))

    def _place(self, host_batch) -> tuple[concurrent.futures.Future, list]:
        """The placement of ``host_batch`` on a thread, and the host batch held until it is placed
        (a placement that fails is tried again)."""
        held = [host_batch]
        future = self._pool.submit(place_batch, host_batch, self.mesh, self.data_axis)
        future.add_done_callback(
            lambda f: held.clear() if not f.cancelled() and f.exception() is None else None
        )
        return future, held

    def __next__(self) -> Batch:
        self._assert_not_closed()
        self._fill()
        if not self._pending:
            raise StopIteration
        future, held, state = self._pending[0]
        # taken off only once placed: a KeyboardInterrupt while the loop waits leaves the batch first
        # in line and the state before it, so a checkpoint written then resumes with it and the next
        # call returns it; a placement that failed is tried again by the next call (a future keeps
        # its error: it would raise it on every call, the batch never placed)
        try:
            batch = future.result()
        except BaseException:
            if held and future.done() and not future.cancelled() and future.exception() is not None:
                self._pending[0] = (*self._place(held[0]), state)
            raise
        before, self._state = self._state, state
        self._pending.popleft()
        try:  # the next batches placed while the step runs
            self._fill()
        except BaseException:
            # not handed out after all (a KeyboardInterrupt while the wrapped iterator made the next
            # batch, its error): first in line again, placed, with the state before it
            self._pending.appendleft((future, held, state))
            self._state = before
            raise
        return batch

    def get_state(self) -> dict:
        """The wrapped iterator's state after the last batch this one returned."""
        return {"inner": self._state}

    def set_state(self, state: dict | Sequence[dict]) -> None:
        """Resume from `get_state` output: this process's, or every process's (a list, as
        `read_loader_states` returns it), handed to the wrapped iterator as the list of its own
        states: a wrapped `make_loader` or `make_memory_loader` then restores onto another number
        of processes (`Loader.set_state`)."""
        states = list(state) if isinstance(state, list | tuple) and state else [state]
        for s in states:
            if not isinstance(s, dict) or "inner" not in s:
                got = f"keys {sorted(map(str, s))}" if isinstance(s, dict) else type(s).__name__
                msg = (
                    f"not a prefetch_to_device state ({got}): pass what its get_state returned, "
                    "{'inner': <the wrapped iterator's state>}, or every process's (a list of them)"
                )
                raise StateMismatchError(msg)
        for future, _, _ in self._pending:
            future.cancel()
        self._pending.clear()
        inners = [self._as_inner(s["inner"]) for s in states]
        self._inner.set_state(inners[0] if len(inners) == 1 else inners)  # one: any iterator takes it
        self._state, self._exhausted = self._inner_state(), False

    @staticmethod
    def _as_inner(inner):
        """A saved wrapped state as the wrapped iterator takes it (a DataLoaderIterator's as bytes)."""
        if isinstance(inner, dict) and set(inner) == {"bytes"}:
            return inner["bytes"].encode()
        return json.loads(json.dumps(inner))

    async def load(self, directory):
        """Orbax v1 (``orbax.checkpoint.experimental.v1.load_checkpointables``): every process's state
        where the wrapped iterator's names its process (`make_loader`'s, `make_memory_loader`'s:
        another number of processes restores too), else this process's own (Grain's). Returns the
        coroutine Orbax awaits."""
        if not (isinstance(self._state, dict) and "process" in self._state):
            return await super().load(directory)

        async def restore() -> None:
            self.set_state(await asyncio.to_thread(read_loader_states, directory))

        return restore()

    def close(self) -> None:
        """Stop the placing threads and close the wrapped iterator; idempotent."""
        if self._shutdown.detach() is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if hasattr(self._inner, "close"):
            self._inner.close()
        super().close()


def prefetch_to_device(
    iterator, mesh=None, data_axis: str = "data", *, buffer_size: int = 2, threads: int = 2
) -> DevicePrefetch:
    """Batches of ``iterator`` (numpy `HostBatch`es or dicts, e.g. a Grain DataLoader's) as placed
    jax.Arrays, ``buffer_size`` ahead on ``threads`` threads (see `place_batch` for the sharding).

    >>> loader = oj.make_grain_loader(ds, batch_size=1024, num_epochs=None, worker_count=2)  # doctest: +SKIP
    >>> batches = oj.prefetch_to_device(iter(loader), mesh)                               # doctest: +SKIP
    >>> batch = next(batches)          # batch.x: a jax.Array sharded P("data")
    >>> state = batches.get_state()    # exact: the loader's state after this batch

    The result is a ``grain.DatasetIterator``: Grain's ``CheckpointSave``/``CheckpointRestore``
    and Orbax take it as they take the loader.
    """
    return DevicePrefetch(iterator, mesh, data_axis, buffer_size=buffer_size, threads=threads)

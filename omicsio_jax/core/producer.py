"""Run a producer generator in a background thread, a few items ahead of the consumer."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
_DONE = object()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


def _produce(make: Callable[[], Iterator], q: queue.Queue, stop: threading.Event, on: list[int]) -> None:
    on.append(threading.get_ident())  # the thread producing: `Background._shutdown` may run on it

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    try:
        for item in make():
            if not put(item):
                return
        put(_DONE)
    except BaseException as e:  # handed to the consumer, re-raised there
        put(_Failure(e))


class Background(Generic[T]):
    """Iterate ``make()`` in a daemon thread, up to ``depth`` items ahead. The producer's
    exceptions surface in `__next__`; `close` (also run when collected) stops the producer.

    ``executor``: run the producer on that executor's thread instead of a new one, so that a
    process reading one input after another keeps one reading thread. A new thread starts with
    empty per-thread allocator heaps (Arrow's mimalloc): every buffer it decodes into is fresh
    memory, faulted in and zeroed by the kernel, where a kept thread reuses its pages (measured:
    30–50% more CPU to read a parquet file of 16 row groups on a new thread for each)."""

    def __init__(
        self,
        make: Callable[[], Iterator[T]],
        depth: int = 2,
        name: str = "omicsio-jax-prefetch",
        *,
        executor: concurrent.futures.Executor | None = None,
    ):
        self._q: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        on: list[int] = []
        if executor is None:
            thread = threading.Thread(
                target=_produce, args=(make, self._q, self._stop, on), daemon=True, name=name
            )
            thread.start()
            join = thread.join
        else:
            future = executor.submit(_produce, make, self._q, self._stop, on)

            def join(timeout: float) -> None:
                concurrent.futures.wait([future], timeout=timeout)

        self._finalizer = weakref.finalize(self, Background._shutdown, self._stop, join, on)
        self._finished = False

    @staticmethod
    def _shutdown(stop: threading.Event, join: Callable[[float], None], on: list[int]) -> None:
        """Stop the producer and wait for it, unless this is its own thread: a producer that holds
        its consumer only weakly (`make_memory_loader`'s) may drop the last reference to it, and so
        collect this, between two items; it then sees ``stop`` once its item is out."""
        stop.set()
        if threading.get_ident() not in on:
            join(10)

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._finished:
            raise StopIteration
        item = self._q.get()
        if item is _DONE:
            self._finished = True
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self._finished = True
            self.close()
            raise item.error
        return item

    def close(self) -> None:
        self._finalizer()

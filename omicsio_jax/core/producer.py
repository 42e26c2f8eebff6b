"""Run a producer generator in a background thread, a few items ahead of the consumer."""

from __future__ import annotations

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


def _produce(make: Callable[[], Iterator], q: queue.Queue, stop: threading.Event) -> None:
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
    exceptions surface in `__next__`; `close` (also run when collected) stops the thread."""

    def __init__(self, make: Callable[[], Iterator[T]], depth: int = 2, name: str = "omicsio-jax-prefetch"):
        self._q: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_produce, args=(make, self._q, self._stop), daemon=True, name=name
        )
        self._thread.start()
        self._finalizer = weakref.finalize(self, Background._shutdown, self._stop, self._thread)
        self._finished = False

    @staticmethod
    def _shutdown(stop: threading.Event, thread: threading.Thread) -> None:
        stop.set()
        thread.join(timeout=10)

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

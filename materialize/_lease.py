"""A run's lease on an object-storage output, so that two runs never write one prefix at once.

Object storage has no ``flock`` (a local output's lock, `_shards.atomic_output_dir`); S3's
conditional writes stand in for it. A run creates ``.materialize-lease.json`` under the prefix only
where none exists (``If-None-Match: *``), and renews it every `RENEW_SECONDS` by replacing the one
it wrote (``If-Match`` its ETag), pushing its expiry `LEASE_SECONDS` ahead. A second run finds it
and is refused in one line naming the holder; a lease not renewed past its expiry (its run killed,
or its host gone), or one whose process is gone from this very host (the same boot and process
namespace), is taken over, by a replacement conditional on the ETag the new run saw, so that
of two runs taking it at once one wins. Before each step that could destroy another run's work
(the manifest's PUT, deleting objects) the holder renews at once (`Lease.check`), and as each
partition finishes it looks whether a renewal found the lease gone (`Lease.ensure`): a run whose
lease was taken over stops there, and leaves the prefix to the run that holds it. What such a run
(or a killed run's workers) may still upload lands among its own objects, never the holder's: a
run writes in place only into an empty prefix, else into a generation of its own
(`_output.staging_dir`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from omicsio_jax import OmicsIOError

from ._shards import process_running

LEASE_NAME = ".materialize-lease.json"
LEASE_SECONDS = 120.0  # how long a lease holds without a renewal
RENEW_SECONDS = 20.0  # how often its holder renews it


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _holder(body: dict) -> str:
    try:
        since = _when(float(body.get("started", 0)))
    except (TypeError, ValueError):
        since = "?"
    return f"host {body.get('host', '?')}, pid {body.get('pid', '?')}, since {since}"


def live_lease(store) -> dict | None:
    """The lease a run holds on ``store``'s prefix now (its record), or None: no lease, or a
    stale one (`_stale`)."""
    found = store.read_with_etag(LEASE_NAME)
    if found is None:
        return None
    body = _parse(found[0])
    return body if body is not None and not _stale(body) else None


def refused(store, body: dict) -> OmicsIOError:
    """The one-line error of a run that finds ``store``'s prefix leased by another (``body``)."""
    return OmicsIOError(
        f"another materialize run is writing {store.url} ({_holder(body)}; its lease, renewed every "
        f"{RENEW_SECONDS:.0f} s, holds until {_when(_expiry(body))}): wait for it to end, or give "
        "this run another output"
    )


@functools.cache
def _process_space() -> str:
    """Where a process id names one process: this host's boot and this process's pid namespace
    (containers on one host share a boot, not a namespace)."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(os.readlink(path) if path.endswith("/pid") else Path(path).read_text().strip())
        except OSError:
            return ""  # not known here: no lease is known to be this host's
    return "/".join(parts)


def _stale(body: dict) -> bool:
    """Whether the lease ``body`` holds no more: expired, or its process is gone from this host."""
    if _expiry(body) <= time.time():
        return True
    space = _process_space()
    if not space or body.get("space") != space:
        return False
    try:
        return not process_running(int(body.get("pid")))
    except (TypeError, ValueError):
        return False


def _expiry(body: dict) -> float:
    """When the lease ``body`` records expires (0 for a record without a time: expired)."""
    try:
        return float(body.get("expires", 0))
    except (TypeError, ValueError):
        return 0.0


def _parse(data: bytes) -> dict | None:
    try:
        body = json.loads(data)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


class Lease:
    """Held from ``__enter__`` to ``__exit__`` on an `S3Store`'s prefix, renewed by a thread; notes
    (a lease taken over) go to ``report``."""

    def __init__(self, store, report=None):
        self.store = store
        self.run = os.urandom(8).hex()
        self.started = time.time()
        self._report = report
        self._etag: str | None = None
        self._lost = False
        self.taken_over = False  # from a run that no longer held it (whose stray uploads may follow)
        self._lock = threading.Lock()  # one renewal at a time (the thread's, or `check`'s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        record = {
            "run": self.run,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "space": _process_space(),
            "started": self.started,
            "expires": time.time() + LEASE_SECONDS,
        }
        return json.dumps(record).encode()

    def __enter__(self) -> Lease:
        self._take()
        self._thread = threading.Thread(target=self._renewing, name="omicsio-lease", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.holds():  # still ours: removed (else another run's now; or, the store failing, it expires)
            with contextlib.suppress(OmicsIOError):
                self.store.delete([LEASE_NAME])

    def _take(self) -> None:
        for _ in range(3):  # the lease may go between a failed create and its read
            body = self._body()
            etag = self.store.put_if(LEASE_NAME, body)
            if etag is not None:
                self._etag = etag
                return
            found = self.store.read_with_etag(LEASE_NAME)
            if found is None:
                continue
            holder = _parse(found[0]) or {}
            if self.wrote(holder):  # our own create, retried by the client after it landed
                self._etag = found[1]
                return
            if not _stale(holder):
                raise refused(self.store, holder)
            etag = self.store.put_if(LEASE_NAME, body, found[1])
            if etag is None:
                continue  # another run took it first: its lease is read on the next turn
            self._etag, self.taken_over = etag, True
            if self._report is not None:
                self._report(
                    f"took over the lease on {self.store.url} of a run that no longer holds it "
                    f"({_holder(holder)}: expired, or its process gone); that run's objects are "
                    "replaced or removed"
                )
            return
        msg = f"could not take the lease on {self.store.url}: other runs took it at the same time; try again"
        raise OmicsIOError(msg)

    def wrote(self, body: dict) -> bool:
        """Whether the lease record ``body`` is this run's."""
        return body.get("run") == self.run

    def _renew(self) -> bool:
        """Replace the lease with a later expiry, if it is still the one this run wrote (under
        ``_lock``); False once it is not (taken over, or removed). A store that fails raises."""
        body = self._body()
        etag = self.store.put_if(LEASE_NAME, body, self._etag)
        if etag is None:
            found = self.store.read_with_etag(LEASE_NAME)
            if found is not None and self.wrote(_parse(found[0]) or {}):
                etag = found[1]  # our own replacement, retried by the client after it landed
            else:
                self._lost = True
                return False
        self._etag = etag
        return True

    def _renewing(self) -> None:
        while not self._stop.wait(RENEW_SECONDS):
            with self._lock:
                if self._lost:
                    return
                try:
                    self._renew()
                except OmicsIOError:  # the store failing now: tried again at the next turn, and by `check`
                    pass

    def check(self) -> None:
        """Renew the lease now, or raise `OmicsIOError` if this run no longer holds it: called before
        each step that could destroy another run's work."""
        with self._lock:
            if not self._lost and self._renew():  # (a store that fails raises its own error)
                return
        raise self._lost_error()

    def ensure(self) -> None:
        """Raise `OmicsIOError` if a renewal found the lease gone (no request made): called as each
        partition finishes, so that a run that lost it stops handing out partitions."""
        if self._lost:
            raise self._lost_error()

    def _lost_error(self) -> OmicsIOError:
        return OmicsIOError(
            f"this run no longer holds its lease on {self.store.url} (another run took it over after "
            f"{LEASE_SECONDS:.0f} s without a renewal, or it was removed): it stops here and leaves the "
            "prefix to that run"
        )

    def holds(self) -> bool:
        """Whether this run still holds the lease, renewed now to know; False where the store fails."""
        with self._lock:
            if self._lost:
                return False
            try:
                return self._renew()
            except OmicsIOError:
                return False

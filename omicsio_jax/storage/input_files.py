"""Input files on S3 for the readers that take a filesystem: DuckDB, pyarrow, h5py.

`s3_filesystem` is obstore behind fsspec's interface (protocol ``s3``), so DuckDB reads
``read_parquet('s3://…')`` through it once registered (`register_s3`): no DuckDB extension to
install, none pinning DuckDB's version (``httpfs`` is built for one DuckDB release). It is
configured by the standard AWS variables, like `omicsio_jax.storage.store.S3Store`. `ObjectPath` is an
``s3://`` URL with the few ``pathlib`` operations the input code uses (``suffix``, ``name``,
``parent(s)``, ``/``, ``exists``), so local paths and object keys travel the same code.
Failures other than a missing key (an unreachable endpoint, missing credentials, a missing bucket)
are the storage layer's one-line `ObjectStoreError`s (`object_store_error`), as on the output side;
a missing key is a `FileNotFoundError` (or ``exists()`` False), as for a local path.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import os
from datetime import timedelta

from omicsio_jax.core.errors import require
from omicsio_jax.storage.store import (
    S3_SCHEME,
    configured_endpoint,
    is_remote,
    object_store_error,
    request_timeout,
    require_credentials,
)


@functools.cache
def s3_filesystem(*, asynchronous: bool = False):
    """The process's fsspec filesystem for ``s3://`` URLs (needs ``omicsio_jax[s3]``); an
    ``asynchronous`` one for readers that drive it from their own event loop (zarr)."""
    FsspecStore = require("obstore.fsspec", "s3", "an s3:// input").FsspecStore

    class _S3(FsspecStore):
        protocol = ("s3", "s3a")  # the base class says "abstract", and DuckDB matches URLs by it

        def open(self, path, mode="rb", block_size=None, **kwargs):
            """Unbuffered reads are `PositionalFile`s, safe for DuckDB's threads; buffered (h5py) as usual.
            The size is looked up first: a failure then leaves no half-made file object behind (whose
            ``__del__`` would print an ``AttributeError``)."""
            if mode == "rb":
                url = path if str(path).startswith(S3_SCHEME) else S3_SCHEME + str(path)
                with _translated(url):
                    size = self.size(url)
                if block_size is None:
                    return PositionalFile(url, size)
                kwargs["size"] = size
            return super().open(path, mode, block_size=block_size, **kwargs)

    endpoint = configured_endpoint("an s3:// input")
    client = {"connect_timeout": timedelta(seconds=10), "timeout": request_timeout(300)}
    if endpoint.startswith("http://"):
        client["allow_http"] = True
    return _S3(
        "s3",
        client_options=client,
        retry_config={"max_retries": 3, "retry_timeout": timedelta(seconds=60)},
        asynchronous=asynchronous,
    )


class PositionalFile:
    """A read-only file over an S3 object whose position is per thread: DuckDB's threads share one
    Python file object and call ``seek`` then ``read`` on it, which a shared position would mix
    up. Each ``read`` is one range GET."""

    def __init__(self, url: str, size: int):
        import threading

        bucket, _, self._key = url[len(S3_SCHEME) :].partition("/")
        self._store, self.size, self.name = _bucket_store(bucket), size, url
        self._local = threading.local()
        self.closed = False

    def _pos(self) -> int:
        return getattr(self._local, "pos", 0)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos(), 2: self.size}[whence]
        self._local.pos = max(0, base + offset)
        return self._local.pos

    def tell(self) -> int:
        return self._pos()

    def read(self, n: int = -1) -> bytes:
        start = self._pos()
        end = self.size if n is None or n < 0 else min(self.size, start + n)
        if end <= start:
            return b""
        data = self._store.get_ranges(self._key, [(start, end)], None)[0]
        self._local.pos = start + len(data)
        return data

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> PositionalFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def _translated(url: str):
    """obstore's failures on ``url`` (and none of the AWS credential variables set) as the storage
    layer's one-line `ObjectStoreError`; a missing key stays a `FileNotFoundError`."""
    require_credentials(url)
    try:
        yield
    except Exception as e:
        import obstore.exceptions as oe

        if not isinstance(e, oe.BaseError):
            raise
        raise object_store_error(e, url) from e


def _info(url: str) -> dict | None:
    """fsspec's ``info`` of ``url`` (an object or a prefix), None where there is nothing."""
    with _translated(url):
        try:
            return s3_filesystem().info(url)
        except FileNotFoundError:
            return None


@functools.cache
def _bucket_store(bucket: str):
    from omicsio_jax.storage.store import S3Store

    return S3Store(S3_SCHEME + bucket, threads=4)


def register_s3(con) -> None:
    """Let a DuckDB connection read ``s3://`` URLs (once per connection)."""
    if "s3" not in con.list_filesystems():
        con.register_filesystem(s3_filesystem())


class ObjectPath(str):
    """An ``s3://bucket/key`` URL with the ``pathlib`` operations the input readers use."""

    @property
    def _key(self) -> str:
        return self[len(S3_SCHEME) :].rstrip("/")

    @property
    def name(self) -> str:
        return self._key.rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        name = self.name
        return name[name.rindex(".") :] if "." in name.lstrip(".") else ""

    @property
    def parent(self) -> ObjectPath:
        key = self._key
        return ObjectPath(S3_SCHEME + (key.rsplit("/", 1)[0] if "/" in key else key))

    @property
    def parents(self) -> list[ObjectPath]:
        out, path = [], self
        while "/" in path._key:
            path = path.parent
            out.append(path)
        return out

    def __truediv__(self, other: str) -> ObjectPath:
        return ObjectPath(f"{self.rstrip('/')}/{other}")

    def exists(self) -> bool:
        """Whether an object or a prefix is there; an `ObjectStoreError` where that cannot be told."""
        return _info(str(self)) is not None

    def is_file(self) -> bool:
        info = _info(str(self))
        return info is not None and info["type"] == "file"

    def open(self, mode: str = "rb", **kwargs):
        return s3_filesystem().open(str(self), mode, **kwargs)


def has_wildcard(text: str) -> bool:
    """Whether ``text`` (a path or one of its parts) holds a glob's wildcard: ``*``, ``?`` or ``[``."""
    return any(ch in text for ch in "*?[")


def is_glob(spec: str) -> bool:
    """Whether an input ``spec`` is a glob: it holds a wildcard (`has_wildcard`) and, when local,
    names no file or folder as written (a folder ``run[1]`` is itself, not a pattern for ``run1``)."""
    return has_wildcard(spec) and (is_remote(spec) or not os.path.lexists(spec))


def glob_root(spec: str) -> int:
    """How many leading ``/``-parts of a local glob name an existing folder as written: those are
    taken literally, wildcard characters and all (``run[1]/*.h5ad`` searches the folder ``run[1]``)."""
    parts = spec.split("/")
    for k in range(len(parts) - 1, 0, -1):
        if os.path.isdir("/".join(parts[:k]) or "/"):
            return k
    return 0


def local_glob(spec: str) -> list[str]:
    """The paths a local glob matches (``**``: any folders below), its existing leading folders
    taken literally (`glob_root`)."""
    import glob

    parts = spec.split("/")
    k = glob_root(spec)
    pattern = "/".join([glob.escape("/".join(parts[:k])), *parts[k:]]) if k else spec
    return glob.glob(pattern, recursive=True)


def as_input_path(spec: str):
    """``spec`` as an `ObjectPath` (``s3://``) or a `pathlib.Path`."""
    from pathlib import Path

    return ObjectPath(spec) if is_remote(spec) else Path(spec)


def expand_objects(spec: str, suffixes: tuple[str, ...], exclude: str) -> list[ObjectPath]:
    """Objects named by an ``s3://`` key, a prefix (searched recursively) or a glob, sorted."""
    fs = s3_filesystem()
    with _translated(spec):
        if is_glob(spec):
            keys = fs.glob(spec)
            found = [k for k in keys if not k.endswith("/")]
        elif spec.endswith(suffixes) and ObjectPath(spec).is_file():
            found = [spec[len(S3_SCHEME) :]]
        else:
            found = [
                k
                for k in fs.find(spec.rstrip("/") + "/")
                if k.endswith(suffixes) and not fnmatch.fnmatch(k.rsplit("/", 1)[-1], exclude)
            ]
    return sorted(ObjectPath(S3_SCHEME + k.removeprefix(S3_SCHEME)) for k in found)

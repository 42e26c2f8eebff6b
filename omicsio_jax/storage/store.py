"""Where a dataset lives: a local directory or an S3-compatible bucket, behind one small interface.

``s3://bucket/prefix`` URLs go to `S3Store` (obstore: range GETs with ``If-Match``, multipart
uploads, listing), configured by the standard AWS environment variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``; a plain ``http://`` endpoint is
allowed). Anything else is a local directory (`LocalStore`). Failures become one-line
`ObjectStoreError` messages that name the object and the fix; an object that changed since it was
first seen raises `ObjectChangedError`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

from omicsio_jax.core.errors import OmicsIOError, require

S3_SCHEME = "s3://"
_CREDENTIAL_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_SKIP_SIGNATURE",
    "AWS_PROFILE",
)


class ObjectStoreError(OmicsIOError):
    """An object-storage request failed (unreachable endpoint, missing credentials, bucket or key)."""


class ObjectChangedError(ObjectStoreError):
    """An object changed (its ETag differs) while a dataset that uses it was open."""


class _LocalWriteFailed(Exception):
    """A local file could not be written during a store call: the local disk's error, not the store's."""


def is_remote(location: str | os.PathLike[str]) -> bool:
    return str(location).startswith(S3_SCHEME)


def s3_url(location: str | os.PathLike[str]) -> str:
    """The ``s3://bucket/prefix`` URL ``location`` without its trailing slashes; `ObjectStoreError`
    if it names no bucket (``s3://``, whose slashes stripped would leave a local path ``s3:``)."""
    url = str(location)
    if not is_remote(url):
        msg = f"not an s3:// URL: {url!r}"
        raise ObjectStoreError(msg)
    if not url[len(S3_SCHEME) :].partition("/")[0]:
        msg = f"{url!r} names no bucket; use s3://BUCKET/PREFIX"
        raise ObjectStoreError(msg)
    return url.rstrip("/")


def default_cache_dir() -> Path:
    """This user's cache of omicsio_jax (gene tables, remote datasets): ``$OMICSIO_JAX_CACHE``, else
    ``~/.cache/omicsio_jax``; `OmicsIOError` where the user has no home (no ``HOME``, a user id
    without an entry in the password database: a container's or a batch job's)."""
    if "OMICSIO_JAX_CACHE" in os.environ:
        return Path(os.environ["OMICSIO_JAX_CACHE"])
    try:
        return Path.home() / ".cache" / "omicsio_jax"
    except RuntimeError as e:
        msg = (
            f"no home folder for omicsio_jax's cache (HOME is unset and user id {os.getuid()} has none): "
            "set OMICSIO_JAX_CACHE to a folder you can write"
        )
        raise OmicsIOError(msg) from e


def configured_endpoint(url: str) -> str:
    """``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` ("" for AWS itself), checked to have a scheme
    (obstore panics on one without)."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
    if endpoint and not endpoint.startswith(("http://", "https://")):
        msg = (
            f"the S3 endpoint {endpoint!r} (for {url}) has no scheme: set AWS_ENDPOINT_URL to "
            f"http://{endpoint} or https://{endpoint}"
        )
        raise ObjectStoreError(msg)
    return endpoint


TIMEOUT_VARIABLE = "OMICSIO_S3_TIMEOUT"


def request_timeout(default: float) -> timedelta:
    """How long one S3 request may take in all before it fails (then is retried, within a minute of
    its first try): ``OMICSIO_S3_TIMEOUT`` seconds, else ``default``. It bounds how long a stalled
    endpoint goes unnoticed, and must leave a whole range GET or upload part time at the slowest
    bandwidth the job accepts."""
    text = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not text:
        return timedelta(seconds=default)
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not (0 < seconds < float("inf")):
        msg = f"{TIMEOUT_VARIABLE}={text!r} is not a number of seconds above 0: set it to, e.g., 30"
        raise ObjectStoreError(msg)
    return timedelta(seconds=seconds)


def require_credentials(url: str) -> None:
    """`ObjectStoreError` naming the variables to set where none of the AWS credential variables is
    (rather than obstore's search of the instance metadata service, whose failure names neither)."""
    if not any(os.environ.get(v) for v in _CREDENTIAL_VARIABLES):
        msg = (
            f"no AWS credentials for {url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
            "AWS_PROFILE, or AWS_SKIP_SIGNATURE=true for a public bucket)"
        )
        raise ObjectStoreError(msg)


def object_store_error(
    e: Exception, url: str, *, etag: str | None = None, endpoint: str | None = None
) -> ObjectStoreError:
    """``e``, obstore's failure on the object or prefix ``url`` (``s3://bucket/key``), as the one-line
    `ObjectStoreError` that names it and the fix: an `ObjectChangedError` where ``etag`` (its ETag
    when first used) no longer holds. ``endpoint`` is the S3 endpoint's name (default: the configured
    one)."""
    import obstore.exceptions as oe

    bucket = url[len(S3_SCHEME) :].partition("/")[0]
    endpoint = endpoint or configured_endpoint(url) or "AWS S3"
    text = str(e)
    if isinstance(e, oe.PreconditionError) or "precondition fail" in text.lower():
        # (a retry inside a body's read that met the changed object is a GenericError)
        return ObjectChangedError(
            f"{url} changed while in use (its ETag is no longer {etag}): the dataset was "
            "rewritten under this prefix; open it again"
        )
    if "NoSuchBucket" in text:
        return ObjectStoreError(
            f"bucket {bucket!r} does not exist at {endpoint} (for {url}): create "
            "it, or check the URL and AWS_ENDPOINT_URL"
        )
    if isinstance(e, (FileNotFoundError, oe.NotFoundError)):
        if etag is not None:  # it existed with that ETag when first used
            return ObjectChangedError(
                f"{url} was deleted while in use (it had ETag {etag}): the dataset was "
                "rewritten under this prefix; open it again"
            )
        return ObjectStoreError(f"{url} does not exist")
    if (
        isinstance(e, (oe.PermissionDeniedError, oe.UnauthenticatedError))
        or "AccessDenied" in text
        or "InvalidAccessKeyId" in text
        or "SignatureDoesNotMatch" in text
    ):
        return ObjectStoreError(f"access to {url} denied: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
    if "kind: Timeout" in text or "TimedOut" in text:  # connected, but no whole answer in time
        return ObjectStoreError(
            f"the S3 endpoint {endpoint} did not answer in time (for {url}): check that it is up and not "
            f"overloaded ({TIMEOUT_VARIABLE} sets the seconds a request may take)"
        )
    if "error sending request" in text or "Connection refused" in text or "dns error" in text:
        return ObjectStoreError(
            f"cannot reach the S3 endpoint {endpoint} (for {url}): check AWS_ENDPOINT_URL and the network"
        )
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return ObjectStoreError(f"{url}: {first}")


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    size: int
    etag: str | None


def join(root: str, key: str) -> str:
    return f"{root.rstrip('/')}/{key}" if key else root


class LocalStore:
    """A directory, seen through the store interface (``local_root`` is the directory itself)."""

    def __init__(self, root: str | os.PathLike[str]):
        self.url = str(root)
        self.local_root: Path | None = Path(root)

    def describe(self, key: str = "") -> str:
        return str(self.local_root / key) if key else str(self.local_root)

    def read_bytes(self, key: str) -> bytes | None:
        try:
            return (self.local_root / key).read_bytes()
        except FileNotFoundError:
            return None

    def read_text(self, key: str) -> str | None:
        data = self.read_bytes(key)
        return None if data is None else data.decode()

    def head(self, key: str) -> ObjectInfo | None:
        try:
            return ObjectInfo((self.local_root / key).stat().st_size, None)
        except FileNotFoundError:
            return None

    def upload(self, local: Path, names: Sequence[str]) -> None:
        """Copy ``local/name`` to ``name`` for each name, in order (nothing to do when ``local`` is the root)."""
        if Path(local).resolve() == self.local_root.resolve():
            return
        for name in names:
            dest = self.local_root / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(local) / name, dest)

    def download(self, key: str, dest: Path) -> None:
        shutil.copyfile(self.local_root / key, dest)

    def list(self, prefix: str = "") -> list[tuple[str, int]]:
        base = self.local_root / prefix
        if not base.exists():
            return []
        found = [p for p in base.rglob("*") if p.is_file()]
        return sorted((p.relative_to(self.local_root).as_posix(), p.stat().st_size) for p in found)

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            (self.local_root / key).unlink(missing_ok=True)


class S3Store:
    """An ``s3://bucket/prefix`` location; keys are relative to the prefix."""

    def __init__(self, url: str, *, threads: int = 16):
        _ObStore = require("obstore.store", "s3", "an s3:// dataset").S3Store

        s3_url(url)  # names a bucket
        bucket, _, prefix = url[len(S3_SCHEME) :].partition("/")
        require_credentials(url)
        self.url, self.bucket, self.prefix = url.rstrip("/"), bucket, prefix.strip("/")
        self.local_root = None
        self.endpoint = configured_endpoint(url) or "AWS S3"
        client = {"connect_timeout": timedelta(seconds=10), "timeout": request_timeout(120)}
        if self.endpoint.startswith("http://"):
            client["allow_http"] = True
        retry = {
            # runs of faults: 3 retries ran out once in 85,000 GETs with 5% of them faulted
            # (benchmarks/soak.py); 5 make that ~10^-4 per 85,000, and an unreachable endpoint
            # is still reported within ~3 s of backoff
            "max_retries": 5,
            "retry_timeout": timedelta(seconds=60),
            "backoff": {
                "init_backoff": timedelta(milliseconds=100),
                "max_backoff": timedelta(seconds=5),
                "base": 2,
            },
        }
        self._store = _ObStore(bucket, prefix=self.prefix or None, client_options=client, retry_config=retry)
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None

    def __getstate__(self) -> dict:
        return {"url": self.url, "threads": self._threads}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["url"], threads=state["threads"])

    def describe(self, key: str = "") -> str:
        return join(self.url, key)

    def _fail(self, e: Exception, key: str, etag: str | None = None) -> ObjectStoreError:
        return object_store_error(e, self.describe(key), etag=etag, endpoint=self.endpoint)

    def _call(self, fn, key: str, *args, etag: str | None = None, **kwargs):
        try:
            return fn(self._store, key, *args, **kwargs)
        except _LocalWriteFailed:
            raise
        except Exception as e:  # obstore raises its own exception classes
            raise self._fail(e, key, etag) from e

    def _call_or_none(self, fn, key: str):
        """``fn(store, key)``, or None when the key does not exist (a missing bucket still raises)."""
        import obstore.exceptions as oe

        try:
            return fn(self._store, key)
        except (FileNotFoundError, oe.NotFoundError) as e:
            if "NoSuchBucket" in str(e):
                raise self._fail(e, key) from e
            return None
        except Exception as e:
            raise self._fail(e, key) from e

    def read_bytes(self, key: str) -> bytes | None:
        import obstore

        # the body is read inside the call: an error while it streams (a reset, a retry refused) is
        # converted like one of the request's
        return self._call_or_none(lambda store, k: bytes(obstore.get(store, k).bytes()), key)

    def read_text(self, key: str) -> str | None:
        data = self.read_bytes(key)
        return None if data is None else data.decode()

    def head(self, key: str) -> ObjectInfo | None:
        import obstore

        meta = self._call_or_none(obstore.head, key)
        return None if meta is None else ObjectInfo(int(meta["size"]), meta.get("e_tag"))

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]], etag: str | None) -> list[bytes]:
        """The byte ranges ``[begin, end)`` of ``key``, fetched concurrently, each with ``If-Match: etag``."""
        import obstore

        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="omicsio-s3")

        def get(r: tuple[int, int]) -> bytes:
            options = {"range": (int(r[0]), int(r[1]))}
            if etag is not None:
                options["if_match"] = etag
            return self._call(
                lambda store, k: bytes(obstore.get(store, k, options=options).bytes()), key, etag=etag
            )

        return list(self._pool.map(get, ranges))

    def write_bytes(self, key: str, data: bytes) -> None:
        import obstore

        self._call(obstore.put, key, data)

    def put_if(self, key: str, data: bytes, etag: str | None = None) -> str | None:
        """PUT ``data`` as ``key`` only where ``key`` does not exist (``etag`` None) or still has
        ``etag`` (S3's conditional writes, ``If-None-Match: *`` / ``If-Match``): its new ETag, or None
        where the condition failed (another writer got there first)."""
        import obstore
        import obstore.exceptions as oe

        mode = "create" if etag is None else {"e_tag": etag}
        try:
            return obstore.put(self._store, key, data, mode=mode)["e_tag"]
        except (oe.AlreadyExistsError, oe.PreconditionError):
            return None
        except (FileNotFoundError, oe.NotFoundError) as e:  # replacing an object deleted meanwhile
            if etag is None or "NoSuchBucket" in str(e):
                raise self._fail(e, key) from e
            return None
        except Exception as e:
            raise self._fail(e, key) from e

    def read_with_etag(self, key: str) -> tuple[bytes, str] | None:
        """``key``'s bytes and the ETag they have, or None when it does not exist."""
        import obstore

        def get(store, k: str) -> tuple[bytes, str]:
            result = obstore.get(store, k)
            return bytes(result.bytes()), result.meta["e_tag"]

        return self._call_or_none(get, key)

    def upload(self, local: Path, names: Sequence[str]) -> None:
        """PUT ``local/name`` as ``name`` for each name, in order (large files in parts, concurrently)."""
        import obstore

        for name in names:
            self._call(obstore.put, name, Path(local) / name, max_concurrency=8)

    def download(self, key: str, dest: Path) -> None:
        import obstore

        dest = Path(dest)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}-{threading.get_ident()}.part")  # unique per thread

        def fetch(store, k: str) -> None:  # the body streamed inside the call: its errors converted too
            try:
                f = open(tmp, "wb")  # noqa: SIM115 - closed below; its errors told from the store's
            except OSError as e:
                raise _LocalWriteFailed from e
            with f:
                for piece in obstore.get(store, k).stream(min_chunk_size=8 << 20):
                    try:
                        f.write(piece)
                    except OSError as e:
                        raise _LocalWriteFailed from e

        try:
            self._call(fetch, key)
            os.replace(tmp, dest)
        except _LocalWriteFailed as e:  # a full or unwritable cache: the local OSError, as it is
            raise e.__cause__ from None
        finally:
            tmp.unlink(missing_ok=True)

    def list(self, prefix: str = "") -> list[tuple[str, int]]:
        import obstore

        out = []
        try:
            for page in obstore.list(self._store, prefix or None):
                out += [(m["path"], int(m["size"])) for m in page]
        except Exception as e:
            raise self._fail(e, prefix) from e
        return sorted(out)

    def delete(self, keys: Iterable[str]) -> None:
        import obstore

        keys = list(keys)
        for start in range(0, len(keys), 1000):
            try:
                obstore.delete(self._store, keys[start : start + 1000])
            except Exception as e:
                raise self._fail(e, keys[start]) from e


def open_store(location: str | os.PathLike[str]) -> LocalStore | S3Store:
    """The store of a local directory or an ``s3://`` URL."""
    return S3Store(str(location)) if is_remote(location) else LocalStore(location)

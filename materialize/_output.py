"""Where a run writes: refusing an output it must not replace, staging the run beside it (or in a new
generation on object storage), and putting the finished dataset in place whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import json
import os
import posixpath
import secrets
import shutil
import sys
from collections.abc import Iterable, Iterator

from omicsio_jax import OmicsIOError
from omicsio_jax.format import (
    MANIFEST_NAME,
    PRESENCE_NAME,
    STATS_NAME,
    Manifest,
    glob_root,
    has_wildcard,
    is_glob,
    is_remote,
    open_store,
)

from ._finalize import FEATURES_NAME
from ._lease import LEASE_NAME, Lease, live_lease, refused
from ._partition import PARTS_DIR
from ._shards import atomic_output_dir, check_output_dir, scratch_folder
from ._sidecars import CellIdWriter


@contextlib.contextmanager
def scratch_dir(staging: str) -> Iterator[str]:
    """A local folder for intermediate files: in the staging directory (removed with the partitions'
    sidecars), or a temporary one when the output is on object storage (`scratch_folder`: one a
    killed run left is removed by a later run's)."""
    store = open_store(staging)
    if store.local_root is not None:
        folder = store.local_root / PARTS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        yield str(folder)
        return
    with scratch_folder("scratch") as folder:  # (a killed run's is removed by the next run's)
        yield folder


def check_apart(out, inputs: Iterable) -> None:
    """Refuse an output that lies inside an input folder (or a folder a glob input searches, where
    the glob reaches into it), that is an input, or that holds one. An output inside an input would
    be read as cells by every later run over that input (the same one with --overwrite included);
    an output holding an input would delete it when replaced. Paths are compared as they resolve
    (symlinks followed), ``s3://`` ones as written; ``ducklake:`` catalogs, whose data files are
    those their catalog lists, are not compared."""
    where = _location(out)
    for spec in inputs:
        if spec is None or str(spec).startswith("ducklake:"):
            continue
        root, pattern = _glob_parts(spec)
        if root[:1] != where[:1]:  # one local, the other on object storage
            continue
        rest = where[len(root) :] if where[: len(root)] == root else None
        if rest == () and not pattern:
            msg = f"output {out} is the input {spec}; give an output outside {spec}"
        elif rest and (not pattern or _reaches_below(pattern, rest)):
            msg = (
                f"output {out} lies inside the input {spec}, where runs over it would read the dataset's "
                f"files as cells; give an output outside {spec}"
            )
        elif rest == () or root[: len(where)] == where:
            msg = (
                f"output {out} holds the input {spec}, which replacing the output would delete; give an "
                f"output that does not hold {spec}"
            )
        else:
            continue
        raise OmicsIOError(msg)


def _location(path) -> tuple[str, ...]:
    """``path`` as its parts: a local one resolved (``("/", "home", ...)``), an ``s3://`` one as
    ``("s3://", bucket, ...)``."""
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    if is_remote(text):
        key = posixpath.normpath("/" + text[len("s3://") :])
        return ("s3://", *(part for part in key.split("/") if part))
    resolved = os.path.realpath(text)
    return (os.sep, *(part for part in resolved.split(os.sep) if part))


def _glob_parts(spec) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """An input's folder or file (`_location`) and, for a glob, the parts of its pattern below the
    last folder named without wildcards (``a/**/*.parquet`` → ``a``, ``("**", "*.parquet")``)."""
    text = os.fspath(spec) if isinstance(spec, os.PathLike) else str(spec)
    scheme = "s3://" if is_remote(text) else ""
    parts = text[len(scheme) :].split("/")
    # the parts from the first wildcard past the folders named as written (a file or folder that
    # exists as written is no glob, wildcards and all)
    start = 0 if scheme else glob_root(text)
    wild = None
    if is_glob(text):
        wild = next((i for i, part in enumerate(parts) if i >= start and has_wildcard(part)), None)
    if wild is None:
        return _location(text), ()
    if wild == 0:  # a pattern from its first part on: the current folder's (or the store's)
        root = "" if scheme else "."
    else:
        root = "/".join(parts[:wild]) or "/"  # (or the file system's root: /*.parquet)
    return _location(scheme + root), tuple(part for part in parts[wild:] if part)


# the table files a dataset holds (at its top, and in a further modality's folder)
_DATASET_TABLES = (FEATURES_NAME, CellIdWriter.path, STATS_NAME, PRESENCE_NAME)


def _reaches_below(pattern: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    """Whether a glob ``pattern`` (its parts, ``**`` any number of folders) matches some table file a
    dataset holds below the folder ``parts`` (``data/*/cells.parquet`` does not reach into
    ``data/ds``: a dataset holds no ``cells.parquet``; ``data/**/*.parquet`` does)."""
    if not parts:
        return bool(pattern) and any(fnmatch.fnmatchcase(name, pattern[-1]) for name in _DATASET_TABLES)
    if not pattern:
        return False
    if pattern[0] == "**":
        return _reaches_below(pattern[1:], parts) or _reaches_below(pattern, parts[1:])
    return fnmatch.fnmatchcase(parts[0], pattern[0]) and _reaches_below(pattern[1:], parts[1:])


def check_output(store, overwrite: bool, lease: Lease | None = None) -> None:
    """Refuse to replace an existing dataset without ``overwrite``, and anything that is not a dataset
    (an empty local folder is one to write); on object storage, a prefix another run holds the
    lease of (``lease``: this run's own)."""
    if store.local_root is not None:
        check_output_dir(store.local_root, overwrite=overwrite)
        return
    objects = store.list()
    if any(key == LEASE_NAME for key, _ in objects):  # another run's, live or left by a killed run
        holder = live_lease(store)
        if holder is not None and (lease is None or not lease.wrote(holder)):
            raise refused(store, holder)
        objects = [(key, size) for key, size in objects if key != LEASE_NAME]
    if not objects:
        return
    if not any(key == MANIFEST_NAME for key, _ in objects):
        if all(_ours(key) for key, _ in objects):
            if not overwrite:  # a killed run's parts, or a dataset whose manifest was deleted
                msg = (
                    f"refusing to write into {store.url}: it holds {len(objects)} object(s) of an unfinished "
                    f"materialize run and no {MANIFEST_NAME}; pass --overwrite (overwrite=True) to remove "
                    "them and write the dataset"
                )
                raise OmicsIOError(msg)
            return
        msg = (
            f"refusing to write into {store.url}: it holds {len(objects)} object(s) and no {MANIFEST_NAME}; "
            "choose an empty prefix (or delete these objects)"
        )
        raise OmicsIOError(msg)
    elif not overwrite:
        msg = f"output {store.url} already holds a dataset; pass --overwrite (overwrite=True) to replace it"
        raise OmicsIOError(msg)


# the top-level names a materialize run writes under its output (besides shards and generations)
_WRITTEN = (
    PARTS_DIR,
    "obs",
    "chunks",
    "modalities",
    MANIFEST_NAME,
    "features.parquet",
    "cell_ids.parquet",
    "gene_stats.parquet",
)


def _ours(key: str) -> bool:
    """Objects a materialize run writes (a dataset's, or an unfinished run's)."""
    top = key.split("/", 1)[0]
    return key != LEASE_NAME and (
        top in _WRITTEN
        or top.startswith("gen-")
        or (top.startswith("shard-") and top.endswith(".arrayrecord"))
    )


@contextlib.contextmanager
def staging_dir(store, overwrite: bool) -> Iterator[tuple[str, Lease | None]]:
    """Where the partitions and the finished files go, and on object storage the run's lease on the
    prefix (`_lease.Lease`: a second run is refused; ``check`` it before the dataset's manifest is
    put in place, ``ensure`` it as partitions finish).

    Locally a hidden sibling directory renamed into place (under a ``flock``). On object storage the
    prefix itself when it holds nothing, else (a dataset to replace, or objects a killed run left) a
    new generation under it (``gen-...``), made current by rewriting the prefix's manifest (one PUT)
    once it is complete, the old generation and the leftovers deleted only after
    (`omicsio_jax.format.dataset_root`). A run killed at any point leaves the old dataset whole and
    current; and a run's objects are never another's (a killed run's workers still uploading, a
    run that lost its lease while stalled): a stray writer can leave objects behind, not change
    this run's."""
    if store.local_root is not None:
        with atomic_output_dir(store.local_root, overwrite=overwrite) as tmp:
            yield str(tmp), None
            for parts in [tmp / PARTS_DIR, *(tmp / "modalities").glob(f"*/{PARTS_DIR}")]:
                shutil.rmtree(parts, ignore_errors=True)
        return
    with Lease(store, report=lambda note: print(f"materialize: {note}", file=sys.stderr)) as lease:
        check_output(store, overwrite, lease)  # as it is now, under the lease
        # in place only into an empty prefix whose lease was free: after a takeover, the run that held
        # it may still upload under the in-place names
        if not lease.taken_over and not [key for key, _ in store.list() if key != LEASE_NAME]:
            with _removed_if_it_fails(store, lambda: [k for k, _ in store.list() if _ours(k)], lease):
                yield store.url, lease
            keep = _listed(store, Manifest.from_dict(json.loads(store.read_text(MANIFEST_NAME))))
            lease.check()
            store.delete([k for k, _ in store.list() if _ours(k) and k not in keep])
            return
        generation = f"gen-{secrets.token_hex(8)}"
        staged = open_store(f"{store.url.rstrip('/')}/{generation}")
        with _removed_if_it_fails(staged, lambda: [k for k, _ in staged.list()], lease):
            yield staged.url, lease  # (its manifest makes no dataset current: the switch below does)
        manifest = Manifest.from_dict(json.loads(staged.read_text(MANIFEST_NAME)))
        keep = {MANIFEST_NAME, *(f"{generation}/{k}" for k in _listed(staged, manifest))}
        lease.check()
        store.write_bytes(
            MANIFEST_NAME, dataclasses.replace(manifest, generation=generation).to_json().encode()
        )
        lease.check()
        store.delete([k for k, _ in store.list() if _ours(k) and k not in keep])


@contextlib.contextmanager
def _removed_if_it_fails(store, written, lease: Lease) -> Iterator[None]:
    """Remove the objects ``written()`` lists if the run fails or is stopped, while it holds its
    ``lease`` (else they are the run's that took it over, or will be replaced by it). Best effort:
    nothing there looks complete (no manifest, or a generation no manifest names), and the next run
    there asks for ``--overwrite``, which removes them. If they cannot be removed either (the store
    is what failed), the run's error says so in a note, which the CLI prints on its line."""
    try:
        yield
    except BaseException as failure:
        if not lease.holds():
            raise
        try:
            store.delete(written())
        except OmicsIOError as e:
            failure.add_note(
                f"objects of the unfinished run remain under {store.url} (removing them failed too: "
                f"{str(e).splitlines()[0]}); the next run there with --overwrite removes them"
            )
        raise


def _listed(store, manifest: Manifest) -> set[str]:
    """The keys of a dataset's files (its manifest, shards, files, and its modalities' own)."""
    keep = {MANIFEST_NAME, *(s.path for s in manifest.shards), *(f.path for f in manifest.files)}
    for entry in manifest.modalities:
        sub = Manifest.from_dict(json.loads(store.read_text(f"{entry.path}/{MANIFEST_NAME}")))
        keep |= {
            f"{entry.path}/{name}"
            for name in (MANIFEST_NAME, *(s.path for s in sub.shards), *(f.path for f in sub.files))
        }
    return keep

"""Where a run writes: refusing an output it must not replace, staging the run beside it (or in a new
generation on object storage), and putting the finished dataset in place whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
import shutil
import sys
from collections.abc import Callable, Iterator

from omicsio_jax import OmicsIOError
from omicsio_jax.format import MANIFEST_NAME, Manifest, open_store

from ._lease import LEASE_NAME, Lease, live_lease, refused
from ._partition import PARTS_DIR
from ._shards import atomic_output_dir, check_output_dir, scratch_folder


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
        if holder is not None and (lease is None or holder.get("run") != lease.run):
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
def staging_dir(store, overwrite: bool) -> Iterator[tuple[str, Callable[[], None]]]:
    """Where the partitions and the finished files go, and what to call just before the dataset's
    manifest is put in place (on object storage, `Lease.check`: the run still holds its lease).

    Locally a hidden sibling directory renamed into place (under a ``flock``); on object storage,
    under the run's lease on the prefix (`_lease.Lease`: a second run is refused), the prefix itself
    when it holds no dataset, else a new generation under it (``gen-...``), made current by
    rewriting the prefix's manifest (one PUT) once it is complete, the old generation deleted only
    after (`omicsio_jax.format.dataset_root`). A run killed at any point leaves the old dataset
    whole and current."""
    if store.local_root is not None:
        with atomic_output_dir(store.local_root, overwrite=overwrite) as tmp:
            yield str(tmp), _nothing
            for parts in [tmp / PARTS_DIR, *(tmp / "modalities").glob(f"*/{PARTS_DIR}")]:
                shutil.rmtree(parts, ignore_errors=True)
        return
    with Lease(store, report=lambda note: print(f"materialize: {note}", file=sys.stderr)) as lease:
        check_output(store, overwrite, lease)  # as it is now, under the lease
        if store.head(MANIFEST_NAME) is None:  # nothing to replace: written in place
            with _removed_if_it_fails(store, lambda: [k for k, _ in store.list() if _ours(k)], lease):
                yield store.url, lease.check
            keep = _listed(store, Manifest.from_dict(json.loads(store.read_text(MANIFEST_NAME))))
            lease.check()
            store.delete([k for k, _ in store.list() if _ours(k) and k not in keep])
            return
        generation = f"gen-{secrets.token_hex(8)}"
        staged = open_store(f"{store.url.rstrip('/')}/{generation}")
        with _removed_if_it_fails(staged, lambda: [k for k, _ in staged.list()], lease):
            yield staged.url, _nothing  # (its manifest makes no dataset current: the switch below does)
        manifest = Manifest.from_dict(json.loads(staged.read_text(MANIFEST_NAME)))
        keep = {MANIFEST_NAME, *(f"{generation}/{k}" for k in _listed(staged, manifest))}
        lease.check()
        store.write_bytes(
            MANIFEST_NAME, dataclasses.replace(manifest, generation=generation).to_json().encode()
        )
        lease.check()
        store.delete([k for k, _ in store.list() if _ours(k) and k not in keep])


def _nothing() -> None:
    pass


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

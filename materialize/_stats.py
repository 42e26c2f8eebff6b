"""``omicsio-materialize stats DATASET``: corpus statistics for a dataset made before they existed.

Reads the shards once, in row order, through the same accumulator materialize uses, so the files
are byte-identical to what materialize writes today, and so is the manifest (its files and obs in
materialize's order). A multimodal dataset gets the statistics of every modality, each in its own
folder. New files are written under temporary names and renamed into place, then the manifests are
replaced atomically, the dataset's own last: an interrupted run leaves the dataset's manifest as it
was (a run stopped between a modality's manifest and the dataset's leaves the modality's newer than
the dataset's record of it, which `verify_dataset` reports; running the command again completes it).
The fingerprint does not change (statistics are derived files).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa

from omicsio_jax import OmicsIOError, open_dataset
from omicsio_jax.format import (
    MANIFEST_NAME,
    SPLITS_DIR,
    STATS_NAME,
    Manifest,
    ObsEntry,
    StatsAccumulator,
    chunk_index_path,
    file_entry,
    fsync_path,
    is_remote,
    manifest_lock,
    progress_bar,
    read_manifest,
    sha256_file,
    small_pages,
)

from ._open import CELL_STATS
from ._sidecars import CellIdWriter, make_obs_writer

_CHUNK_CELLS = 8192


def add_stats(path: str | Path, *, force: bool = False, progress: bool = True) -> str:
    """Compute and add ``gene_stats.parquet`` and obs ``n_counts`` / ``n_genes`` (of every modality);
    return a summary line. A further modality's folder (``DATASET/modalities/atac``) stands for its
    dataset, whose manifest lists the modality's."""
    if is_remote(str(path)):
        msg = (
            f"stats adds files to a local dataset, and {path} is on object storage: run it on a local copy "
            "and upload that (or materialize again with statistics)"
        )
        raise OmicsIOError(msg)
    root = _dataset_root(Path(path))
    ds = open_dataset(root)
    m = ds.manifest
    names = [
        entry.name for entry in m.modalities if force or not _has_stats(ds.modality(entry.name).manifest)
    ]
    own = force or not _has_stats(m)
    if not own and not names:
        if not (root / STATS_NAME).is_file():  # listed, but gone: not statistics it has
            msg = (
                f"{path}: its manifest lists {STATS_NAME}, which is missing: pass --force to compute it again"
            )
            raise OmicsIOError(msg)
        return f"{path}: already has statistics ({STATS_NAME}); pass --force to recompute them"
    for entry in m.modalities:
        if entry.name in names:
            sub = root / entry.path
            _write_manifest(sub, _add_files(sub, ds.modality(entry.name), progress))
    # every modality's manifest as it is now (also one a run stopped before this point rewrote)
    modalities = tuple(
        dataclasses.replace(entry, manifest_sha256=sha256_file(root / entry.path / MANIFEST_NAME))
        for entry in m.modalities
    )
    top = _add_files(root, ds, progress) if own else m
    with manifest_lock(root):  # the splits as listed now: `oj.split` may have written one meanwhile
        splits = tuple(f for f in read_manifest(root).files if f.path.startswith(SPLITS_DIR))
        files = tuple(f for f in top.files if not f.path.startswith(SPLITS_DIR)) + splits
        _write_manifest(root, dataclasses.replace(top, files=files, modalities=modalities).with_fingerprint())
    further = f"modalities {', '.join(names)}"
    if not own:
        return f"{path}: statistics of {further} added ({STATS_NAME}, obs n_counts, n_genes)"
    return (
        f"{path}: statistics of {m.num_cells:,} cells × {m.num_genes:,} genes added "
        f"({STATS_NAME}, obs n_counts, n_genes)" + (f", and of {further}" if names else "")
    )


def _dataset_root(path: Path) -> Path:
    """``path``, or the dataset whose further modality ``path`` is (``DATASET/modalities/atac``)."""
    top = path.parent.parent
    if (top / MANIFEST_NAME).exists():
        if any((top / entry.path).resolve() == path.resolve() for entry in read_manifest(top).modalities):
            return top
    return path


def _has_stats(m: Manifest) -> bool:
    return any(f.path == STATS_NAME for f in m.files)


def _add_files(root: Path, ds, progress: bool) -> Manifest:
    """The statistics of dataset ``ds`` (in folder ``root``) written into place; its manifest listing them."""
    m = ds.manifest
    clash = [
        o.name for o in m.obs if o.name in CELL_STATS and f"obs/{o.name}.npy" not in {f.path for f in m.files}
    ]
    if clash:
        msg = f"{root}: obs {', '.join(clash)} already exist and are not statistics; rename them first"
        raise OmicsIOError(msg)
    acc = StatsAccumulator(m.num_genes, m.shard_cells)
    try:  # before the shards are read: a dataset on shared storage is often not the user's to change
        staging = tempfile.TemporaryDirectory(dir=root, prefix=".stats-")
    except OSError as e:
        msg = (
            f"stats cannot write into {root} ({e.strerror}): it adds its files to the dataset's folder; "
            "run it as the folder's owner, or on a copy you can write"
        )
        raise OmicsIOError(msg) from e
    # `small_pages`: each chunk's records are a fresh read
    with small_pages(), staging as tmp_name:
        tmp = Path(tmp_name)
        writers = [
            make_obs_writer(tmp, "n_counts", pa.float64()),
            make_obs_writer(tmp, "n_genes", pa.int32()),
        ]
        try:
            with progress_bar(
                total=m.num_cells,
                unit="cells",
                unit_scale=True,
                progress=progress,
                desc="stats",
                dynamic_ncols=True,
            ) as bar:
                for begin in range(0, m.num_cells, _CHUNK_CELLS):
                    end = min(begin + _CHUNK_CELLS, m.num_cells)
                    buf, starts = ds.read_buffer(begin, end)
                    with ds.records_checked(np.arange(begin, end)):
                        columns = acc.add(buf, starts)
                    for writer, column in zip(writers, columns, strict=True):
                        writer.append(pa.array(column))
                    bar.update(end - begin)
            acc.finish().write(tmp / STATS_NAME)
            dtypes = [w.finish() for w in writers]
        finally:
            for w in writers:
                w.close()
        (root / "obs").mkdir(exist_ok=True)
        moves = [(tmp / STATS_NAME, root / STATS_NAME)] + [
            (tmp / f"{w.name}.npy", root / "obs" / f"{w.name}.npy") for w in writers
        ]
        for src, dst in moves:
            fsync_path(src)
            os.replace(src, dst)
    obs_paths = [f"obs/{w.name}.npy" for w in writers]
    new_obs = [ObsEntry(w.name, w.kind, dtype, None) for w, dtype in zip(writers, dtypes, strict=True)]
    return dataclasses.replace(
        m,
        files=_in_order(m, [file_entry(root, STATS_NAME)], [file_entry(root, p) for p in obs_paths]),
        obs=_obs_in_order(m, new_obs),
    )


def _presence_names(m: Manifest) -> set[str]:
    """The obs that materialize writes after ``n_counts`` / ``n_genes``: the modalities' ``has_<name>``."""
    return {f"has_{entry.name}" for entry in m.modalities}


def _obs_in_order(m: Manifest, new: list[ObsEntry]) -> tuple[ObsEntry, ...]:
    """``m``'s obs with ``new`` where materialize puts them: after the input's, before ``has_<name>``."""
    kept = [o for o in m.obs if o.name not in CELL_STATS]
    at = next((k for k, o in enumerate(kept) if o.name in _presence_names(m)), len(kept))
    return (*kept[:at], *new, *kept[at:])


def _in_order(m: Manifest, stats: list, obs: list) -> tuple:
    """``m``'s files with the statistics file and the ``obs`` files where materialize lists them: the
    statistics right after the cell ids, the obs files after the input's obs files (before the
    ``has_<name>`` files and the shards' chunk indexes)."""
    new = {f.path for f in (*stats, *obs)}
    kept = [f for f in m.files if f.path not in new]
    after_ids = next((k + 1 for k, f in enumerate(kept) if f.path == CellIdWriter.path), 0)
    kept[after_ids:after_ids] = stats
    later = {f"obs/{name}.npy" for name in _presence_names(m)} | {chunk_index_path(s.path) for s in m.shards}
    at = next((k for k, f in enumerate(kept) if f.path in later), len(kept))
    kept[at:at] = obs
    return tuple(kept)


def _write_manifest(root: Path, manifest: Manifest) -> None:
    """``root``'s manifest replaced by ``manifest`` atomically."""
    with tempfile.TemporaryDirectory(dir=root, prefix=".stats-") as tmp_name:
        staged = Path(tmp_name) / MANIFEST_NAME
        staged.write_text(manifest.to_json())
        fsync_path(staged)
        os.replace(staged, root / MANIFEST_NAME)
        fsync_path(root)

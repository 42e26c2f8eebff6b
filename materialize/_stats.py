"""``omicsio-materialize stats DATASET``: corpus statistics for a dataset made before they existed.

Reads the shards once, in row order, through the same accumulator materialize uses, so the files
are byte-identical to what materialize writes today. New files are written under temporary names
and renamed into place, then the manifest is replaced atomically: an interrupted run leaves the
dataset as it was. The fingerprint does not change (statistics are derived files).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
from tqdm.auto import tqdm

from omicsio_jax import OmicsIOError, open_dataset
from omicsio_jax.format import MANIFEST_NAME, STATS_NAME, ObsEntry, StatsAccumulator, file_entry, fsync_path

from ._materialize import CELL_STATS
from ._sidecars import make_obs_writer

_CHUNK_CELLS = 8192


def add_stats(path: str | Path, *, force: bool = False, progress: bool = True) -> str:
    """Compute and add ``gene_stats.parquet`` and obs ``n_counts`` / ``n_genes``; return a summary line."""
    ds = open_dataset(path)
    m = ds.manifest
    if any(f.path == STATS_NAME for f in m.files) and not force:
        return f"{path}: already has statistics ({STATS_NAME}); pass --force to recompute them"
    clash = [
        o.name for o in m.obs if o.name in CELL_STATS and f"obs/{o.name}.npy" not in {f.path for f in m.files}
    ]
    if clash:
        msg = f"{path}: obs {', '.join(clash)} already exist and are not statistics; rename them first"
        raise OmicsIOError(msg)
    acc = StatsAccumulator(m.num_genes, m.shard_cells)
    root = Path(path)
    with tempfile.TemporaryDirectory(dir=root, prefix=".stats-") as tmp_name:
        tmp = Path(tmp_name)
        writers = [
            make_obs_writer(tmp, "n_counts", pa.float64()),
            make_obs_writer(tmp, "n_genes", pa.int32()),
        ]
        try:
            with tqdm(
                total=m.num_cells,
                unit="cells",
                unit_scale=True,
                disable=not progress,
                desc="stats",
                file=sys.stderr,
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
        new_paths = [STATS_NAME, *(f"obs/{w.name}.npy" for w in writers)]
        files = tuple(f for f in m.files if f.path not in new_paths) + tuple(
            file_entry(root, p) for p in new_paths
        )
        obs = tuple(o for o in m.obs if o.name not in CELL_STATS) + tuple(
            ObsEntry(w.name, w.kind, dtype, None) for w, dtype in zip(writers, dtypes, strict=True)
        )
        manifest = dataclasses.replace(m, files=files, obs=obs).with_fingerprint()
        staged = tmp / MANIFEST_NAME
        staged.write_text(manifest.to_json())
        fsync_path(staged)
        os.replace(staged, root / MANIFEST_NAME)
        fsync_path(root)
    return (
        f"{path}: statistics of {m.num_cells:,} cells × {m.num_genes:,} genes added "
        f"({STATS_NAME}, obs n_counts, n_genes)"
    )

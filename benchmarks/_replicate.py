"""A big dataset made cheaply from a small one: its full shards repeated ``copies`` times under one
manifest (cell ids suffixed ``-r<copy>``, obs columns tiled, the same gene table and statistics).

``link=True`` hard-links the shards (many files, the bytes of a few: for opening costs with many
shards); ``link=False`` writes real copies, so the page cache cannot share them (for beyond-RAM
reads). The result is a valid dataset (`omicsio-materialize verify` passes).

    .venv/bin/python benchmarks/_replicate.py SRC OUT --copies 500 [--link]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from omicsio_jax.format.chunk_index import chunk_index_path
from omicsio_jax.format.manifest import MANIFEST_NAME, ShardEntry, file_entry, read_manifest


def replicate(src: str | os.PathLike, out: str | os.PathLike, copies: int, *, link: bool = False) -> Path:
    src, out = Path(src), Path(out)
    m = read_manifest(src)
    full = [s for s in m.shards if s.num_cells == m.shard_cells]
    cells = len(full) * m.shard_cells
    if out.exists():
        shutil.rmtree(out)
    (out / "obs").mkdir(parents=True)
    (out / "chunks").mkdir()
    shards, files = [], []
    for c in range(copies):
        for k, s in enumerate(full):
            i = c * len(full) + k
            name = f"shard-{i:05d}.arrayrecord"
            (os.link if link else shutil.copyfile)(src / s.path, out / name)
            shutil.copyfile(src / chunk_index_path(s.path), out / chunk_index_path(name))
            shards.append(ShardEntry(name, i * m.shard_cells, m.shard_cells, s.num_bytes, s.sha256))
    ids = pq.read_table(src / "cell_ids.parquet").column(0).to_pylist()[:cells]
    pq.write_table(
        pa.table({"cell_id": [f"{v}-r{c}" for c in range(copies) for v in ids]}), out / "cell_ids.parquet"
    )
    for f in m.files:
        if f.path.startswith("chunks/"):
            continue
        if f.path.startswith("obs/") and f.path.endswith(".npy"):
            np.save(out / f.path, np.tile(np.load(src / f.path)[:cells], copies))
        elif f.path != "cell_ids.parquet":
            (out / f.path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / f.path, out / f.path)
        files.append(file_entry(out, f.path))
    files += [file_entry(out, chunk_index_path(s.path)) for s in shards]
    nnz = round(m.nnz * cells / m.num_cells) * copies  # an estimate: only the full shards are kept
    manifest = dataclasses.replace(
        m,
        num_cells=cells * copies,
        nnz=nnz,
        shards=tuple(shards),
        files=tuple(files),
        source={**m.source, "replicated_from": str(src), "copies": copies},
    )
    (out / MANIFEST_NAME).write_text(manifest.with_fingerprint().to_json())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--copies", type=int, required=True)
    p.add_argument("--link", action="store_true", help="hard links instead of copies")
    a = p.parse_args()
    out = replicate(a.src, a.out, a.copies, link=a.link)
    print(json.dumps({"dataset": str(out), "shards": len(read_manifest(out).shards)}))


if __name__ == "__main__":
    main()

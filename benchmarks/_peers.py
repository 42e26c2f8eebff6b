"""Peer loaders measured on the same data as omicsio_jax's, plus page-cache helpers.

Every ``bench_*`` function returns ``{"name", "cells_per_s", "batches", "seconds", **parameters}``:
steady-state throughput of dense float32 numpy minibatches of shape ``(batch_size, num_genes)``
(what omicsio_jax's loader yields) over a window of at least ``seconds`` (`_provenance.MIN_WINDOW_S`
by default), after discarding the first ``warmup`` batches, timed as omicsio_jax's loader is
(`_provenance.window`). All randomness comes from ``seed``. Peers:

- `bench_scdataset`: scDataset (``BlockShuffling``, ``fetch_factor``) over the ``.h5ad`` opened
  backed; ``block_size=1, fetch_factor=1`` is its true-random mode.
- `bench_grain_stock`: Grain's stock ArrayRecord path (``ArrayRecordDataSource`` + shuffled
  ``IndexSampler`` + ``DataLoader``): true random, record by record.
- annbatch (Python >= 3.12) runs in its own virtualenv: `_annbatch_peer.py`, `bench_annbatch.py`.

Run alone (needs ``scripts/setup-bench.sh``; prints JSON lines, writes no results file)::

    python benchmarks/_peers.py --dataset /tmp/ds200k --seconds 10 [--cold]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _provenance import MIN_WINDOW_S, window  # noqa: E402

from omicsio_jax import open_dataset  # noqa: E402
from omicsio_jax.format import codec  # noqa: E402

CORPUS = Path(__file__).parent / "data" / "corpus_200k"


def _densify(indptr: np.ndarray, indices: np.ndarray, values: np.ndarray, num_genes: int) -> np.ndarray:
    """CSR rows -> dense float32 ``(rows, num_genes)``: ``np.zeros`` + one fancy assignment."""
    out = np.zeros((len(indptr) - 1, num_genes), np.float32)
    out[np.repeat(np.arange(len(indptr) - 1), np.diff(indptr)), indices] = values
    return out


def _epochs(
    make_epoch: Callable[[], Iterable[np.ndarray]], max_epochs: int | None = None
) -> Iterator[np.ndarray]:
    """Batches of ``make_epoch()``, then of a fresh call, and so on (``max_epochs`` times at most)."""
    epoch = 0
    while max_epochs is None or epoch < max_epochs:
        epoch += 1
        batch = None
        for batch in make_epoch():
            yield batch
        if batch is None:
            raise ValueError("an epoch yielded no batch: dataset smaller than one batch?")


def _measure(
    name: str,
    batches: Iterator[np.ndarray],
    *,
    seconds: float,
    warmup: int,
    batch_size: int,
    whole: int = 1,
    **params: Any,
) -> dict[str, Any]:
    """Discard ``warmup`` batches, then time batches for at least ``seconds``, ending after a whole
    number of ``whole`` batches (a fetch); check every batch's shape."""
    for _ in range(warmup):
        next(batches)

    timed = 0

    def step() -> int:
        nonlocal timed
        batch = next(batches)
        if batch.shape[0] != batch_size or batch.dtype != np.float32:
            raise AssertionError(f"{name}: got {batch.shape} {batch.dtype}, want ({batch_size}, G) float32")
        timed += 1
        return batch_size

    w = window(step, seconds=seconds, until=lambda: timed % whole == 0)
    return {"name": name, "cells_per_s": w.cells_per_s, "batches": w.steps, "seconds": w.seconds,
            "cells_per_cpu_s": w.as_dict()["cells_per_cpu_s"], "batch_size": batch_size, "warmup": warmup,
            **params}  # fmt: skip


def bench_scdataset(
    h5ad_path: str | os.PathLike[str],
    *,
    batch_size: int,
    block_size: int,
    fetch_factor: int,
    seed: int,
    seconds: float = MIN_WINDOW_S,
    warmup: int = 2,
    max_epochs: int | None = None,
) -> dict[str, Any]:
    """scDataset with ``BlockShuffling(block_size)`` over ``anndata.read_h5ad(path, backed="r")``.

    scDataset draws shuffled blocks, reads ``batch_size * fetch_factor`` cells per fetch (indices
    sorted) and yields in-memory-shuffled minibatches. Here ``fetch_callback`` reads the fetch as
    scipy CSR (``adata.X[sorted_indices]``) and ``batch_callback`` densifies only the minibatch
    (densifying a whole fetch, as ``adata_to_mindex`` does, needs 16 GB at 1024 x 64). Single
    process: iterating the dataset is what ``DataLoader(ds, batch_size=None, num_workers=0)``
    does, minus the tensor conversion. ``warmup`` is rounded up to whole fetches and the window ends
    on a fetch boundary, so it holds complete fetch cycles, not just in-memory slicing.
    ``max_epochs=1`` (a cold run) ends the window with the first epoch if that comes first.
    """
    import anndata
    from scdataset import BlockShuffling, scDataset

    adata = anndata.read_h5ad(h5ad_path, backed="r")
    num_genes = adata.n_vars

    def fetch(collection: anndata.AnnData, indices: np.ndarray) -> Any:
        return collection.X[indices]  # scipy CSR of the fetch

    def to_batch(fetched: Any, positions: np.ndarray) -> np.ndarray:
        rows = fetched[positions]
        return _densify(rows.indptr, rows.indices, rows.data, num_genes)

    dataset = scDataset(
        adata,
        BlockShuffling(block_size=block_size),
        batch_size=batch_size,
        fetch_factor=fetch_factor,
        drop_last=True,
        fetch_callback=fetch,
        batch_callback=to_batch,
        seed=seed,
    )
    try:
        return _measure(
            f"scdataset(block={block_size},fetch={fetch_factor})", _epochs(lambda: dataset, max_epochs),
            seconds=seconds, warmup=-(-warmup // fetch_factor) * fetch_factor, batch_size=batch_size,
            whole=fetch_factor, block_size=block_size, fetch_factor=fetch_factor, seed=seed, num_workers=0,
        )  # fmt: skip
    finally:
        adata.file.close()


def bench_grain_stock(
    dataset_dir: str | os.PathLike[str],
    *,
    batch_size: int,
    seed: int,
    seconds: float = MIN_WINDOW_S,
    warmup: int = 2,
) -> dict[str, Any]:
    """Grain's stock path over the dataset's shards: one record read per cell, true random order.

    ``ArrayRecordDataSource`` (Grain's default reader options: no readahead) + ``IndexSampler``
    (shuffle, epoch after epoch) + ``DataLoader(worker_count=0)`` with its default read threads; a
    ``Batch`` whose ``batch_fn`` decodes the minibatch's records with omicsio's codec and densifies.
    """
    import grain

    ds = open_dataset(dataset_dir)
    num_genes = ds.num_genes
    paths = [str(ds.path / shard.path) for shard in ds.manifest.shards]

    def to_dense(records: Sequence[bytes]) -> np.ndarray:
        indptr, indices, values = codec.decode_csr(codec.Records.of(list(records), num_genes))
        return _densify(indptr, indices, values, num_genes)

    source = grain.sources.ArrayRecordDataSource(paths)
    sampler = grain.samplers.IndexSampler(
        len(source), shuffle=True, seed=seed, num_epochs=None, shard_options=grain.sharding.NoSharding()
    )
    loader = grain.DataLoader(
        data_source=source,
        sampler=sampler,
        operations=[grain.transforms.Batch(batch_size, drop_remainder=True, batch_fn=to_dense)],
        worker_count=0,
    )
    return _measure(
        "grain_stock", iter(loader), seconds=seconds, warmup=warmup, batch_size=batch_size, seed=seed
    )


def proc_io(field: str) -> int:
    """A counter of this process's I/O from ``/proc/self/io``: ``rchar`` (bytes read by system calls,
    page cache or not), ``read_bytes`` (bytes the storage delivered)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/io")


def proc_status(field: str) -> int:
    """A memory figure of this process from ``/proc/self/status`` in bytes: ``VmRSS``, ``VmHWM`` (peak RSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def drop_page_cache(paths: Iterable[str | os.PathLike[str]]) -> bool:
    """Evict the files' pages from the page cache; True if every file was evicted.

    ``os.sync()`` first (only clean pages can be dropped), then
    ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file (no root needed); as root, also
    ``echo 1 > /proc/sys/vm/drop_caches``, which succeeding counts as success too.
    """
    os.sync()
    ok = True
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError:
            ok = False
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
            ok = True
        except OSError:
            pass
    return ok


def sequential_read_limit(paths: Sequence[str | os.PathLike[str]], *, chunk_bytes: int = 1 << 20) -> float:
    """Bytes/s reading the files front to back in ``chunk_bytes`` reads right after dropping their cache."""
    if not drop_page_cache(paths):
        raise OSError("could not drop the page cache: the figure would not be a cold read")
    buf = bytearray(chunk_bytes)
    total = 0
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total / (time.perf_counter() - start)


def _ensure_dataset(path: Path | None, parquet: Path) -> Path:
    """``path`` if it holds a dataset, else materialize ``parquet`` into it (or a temp dir)."""
    if path is not None and (path / "manifest.json").exists():
        return path
    from materialize import materialize

    out = path or Path(tempfile.mkdtemp(prefix="omicsio-peers-")) / "ds"
    print(f"materializing {parquet} -> {out}", flush=True)
    materialize(parquet, out, progress=False)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=CORPUS, help="holds cells.parquet and cells.h5ad")
    parser.add_argument("--dataset", type=Path, default=None, help="materialized dataset (made if missing)")
    parser.add_argument(
        "--seconds", type=float, default=MIN_WINDOW_S, help="seconds timed per configuration, after warm-up"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each run")
    args = parser.parse_args(argv)
    h5ad = args.corpus / "cells.h5ad"
    dataset = _ensure_dataset(args.dataset, args.corpus / "cells.parquet")
    shards = sorted(str(p) for p in dataset.glob("shard-*.arrayrecord"))
    files = {"shards": shards, "h5ad": [str(h5ad)]}

    print(json.dumps({"drop_page_cache": drop_page_cache([*shards, str(h5ad)])}), flush=True)
    for label, paths in files.items():
        limit = sequential_read_limit(paths)
        print(json.dumps({"sequential_read_limit_MBps": round(limit / 1e6), "files": label}), flush=True)
    for batch_size in (64, 1024):
        for block_size, fetch_factor in ((16, 64), (1, 1)):  # block shuffling; true random
            if args.cold:
                drop_page_cache(files["h5ad"])
            r = bench_scdataset(h5ad, batch_size=batch_size, block_size=block_size, fetch_factor=fetch_factor,
                                seconds=args.seconds, seed=args.seed)  # fmt: skip
            print(json.dumps({**r, "cold": args.cold}), flush=True)
        if args.cold:
            drop_page_cache(shards)
        r = bench_grain_stock(dataset, batch_size=batch_size, seconds=args.seconds, seed=args.seed)
        print(json.dumps({**r, "cold": args.cold}), flush=True)


if __name__ == "__main__":
    main()

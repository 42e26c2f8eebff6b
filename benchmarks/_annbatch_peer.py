"""annbatch's on-disk minibatch loader (PyPI ``annbatch``, scverse) as a benchmark peer, in its own virtualenv.

Run with ``.venv-annbatch/bin/python`` (made by ``scripts/setup-annbatch.sh``; annbatch needs
Python >= 3.12); this script never imports omicsio_jax::

    python benchmarks/_annbatch_peer.py convert INPUT.h5ad OUT.zarr [--seed 0]
    python benchmarks/_annbatch_peer.py run OUT.zarr --output dense|csr --batch-size 64 \\
        --seconds 10 --warmup 10 [--rounds 3] [--seed 0] [--label batch] [--spawned-at T]
    python benchmarks/_annbatch_peer.py first OUT.zarr --output dense|csr --batch-size 64 \\
        --spawned-at T [--label batch]

Each prints one JSON line (``first``: the seconds from spawn to the first batch, by phase). Every
read and write goes through zarrs-python's codec pipeline (``zarr.config.set({"codec_pipeline.path": "zarrs.ZarrsCodecPipeline"})``), which annbatch's docs set
before touching any store and call necessary for local-filesystem performance; zarr's other
settings (``threading.max_workers``: one thread per core; no ``direct_io``) are left at their
defaults.

``convert`` is annbatch's documented preprocessing (README, "Detailed walkthrough"):
``DatasetCollection(zarr.open_group(OUT, mode="w-")).add_adatas([INPUT], shuffle=True,
rng=np.random.default_rng(seed))``, every other argument at its default: the input read lazily
(``anndata.experimental.read_lazy``, all of ``obs`` and ``var`` kept, a ``src_path`` column added),
``shuffle_chunk_size=1000`` (contiguous runs of 1,000 input cells are dealt out in random order to
the output datasets), ``dataset_size="20GB"`` (cells per output dataset: 20 GiB divided by the
estimated uncompressed bytes per cell, ~1.7M cells at ~1,500 nonzeros per cell), each output
dataset permuted cell by cell in memory and written as sharded zarr v3 (``n_obs_per_chunk=64``,
``shard_size="1GB"``, Blosc lz4 level 3 with byte shuffle; CSR indices in the smallest dtype that
fits, uint16 for 62,710 genes). Memory: ``add_adatas`` reads each output dataset whole into RAM
before it permutes and writes it, so any corpus under ``dataset_size`` (i.e. up to ~1.7M such
cells) is held in memory entirely, with copies on top (its docs: "Memory usage should be
controlled by ``dataset_size``"); ``peak_rss_bytes`` shows what that costs. Seconds cover
``add_adatas`` alone (not imports). The output is a collection of one or more ``dataset_<i>``
groups; bytes are the sum of its files' sizes (``disk_bytes``: allocated blocks, as ``du``).

``run`` iterates ``annbatch.Loader`` over the collection and prints one JSON line. Config:
``Loader(batch_sampler=RandomSampler(chunk_size=512, preload_nchunks=32, batch_size=B,
drop_last=True, rng=np.random.default_rng(seed)), preload_to_gpu=False, to=None)
.use_collection(collection, load_adata=...)``, i.e. exactly ``Loader(chunk_size=512,
preload_nchunks=32, shuffle=True, drop_last=True, ...)`` with the sampler built here so that its
load requests can be counted (a ``RandomSampler`` subclass that only counts the batches of each
request it hands out, to find load boundaries). Why these:

- ``chunk_size=512, preload_nchunks=32`` (``--chunk-size``, ``--preload-nchunks``): the Loader's
  own defaults, and the setting of annbatch's scRNA-seq tutorial (sparse counts like ours, batch
  4096) with its rule of thumb "keep ``preload_nchunks`` around 32 so that ``chunk_size *
  preload_nchunks`` stays well above ``batch_size``". The README and the walkthrough show
  ``chunk_size=32, preload_nchunks=256`` for batch 4096 instead (8,192 cells per load in 256
  reads of 32 cells, against 16,384 in 32 reads of 512); no page recommends a setting for batch 64 or 1024. 512 × 32 reads 16,384 cells
  per load: a whole number of batches for any power-of-two batch size up to 16,384 (annbatch
  requires ``chunk_size * preload_nchunks`` to be a multiple of the batch size). A quick check on
  this 2-core machine (40k synthetic cells, 2 rounds, noisy) had 512 × 32 ahead of 32 × 256: csr
  b64 44.5k vs 37.8k cells/s, csr b1024 58.6k vs 37.3k, dense b64 24.1k vs 20.0k.
- ``shuffle=True`` (``RandomSampler``): chunks in random order and the 16,384 loaded cells permuted
  before they are split into batches, its training mode (``shuffle=False`` is its sequential
  "evaluation or inference" sampler, the Loader's default). Randomness comes from the preshuffled
  collection plus this block shuffle.
- ``drop_last=True``: every batch has ``batch_size`` rows, like the other peers' batches.
- ``preload_to_gpu=False``, ``to=None``: CPU, no cupy/torch/jax; batches are
  ``scipy.sparse.csr_matrix`` (float32 values, the collection's dtype).
- ``load_adata``: ``X`` as ``anndata.io.sparse_dataset(group["X"])`` and, only with ``--label``,
  that one ``obs`` column (``read_lazy(group).obs[[label]].to_memory()``), as annbatch's tutorials
  do: its README warns that otherwise *all* ``obs`` columns are gathered and yielded with every
  batch, at a cost. Built under ``ad.settings.override(remove_unused_categories=False)``, as its
  README does. Without ``--label`` batches carry no ``obs``.

``--output csr`` consumes annbatch's batch as it comes (a ``scipy.sparse.csr_matrix``, never
densified); ``--output dense`` densifies each batch with scipy's ``.toarray()`` into a float32
``(B, genes)`` numpy array inside the timed loop: annbatch has no dense output for a sparse store
(its docs densify on the GPU, ``x.cuda().to_dense()``).

Timing, per round: a fresh ``DatasetCollection`` and ``Loader`` (``--seed`` seeds the sampler's
generator each round, so every round does the same work). annbatch has no read-ahead: the loader
reads a whole load (``chunk_size * preload_nchunks`` cells) synchronously inside ``next()`` (zarr's
event loop and zarrs' threads decode it while the caller waits), then hands out its batches by
slicing memory. ``first_batch_s`` is from the ``DatasetCollection`` call to the first batch (it
opens the stores, reads the obs column and ``indptr``, does the first load). ``--warmup`` batches
(the first one included; with ``--warmup 0`` the first batch is still taken untimed) are
discarded, then batches are drained untimed to the end of the current load, then batches are
timed for at least ``--seconds`` (the parent's window, 10 s by default, as omicsio_jax's loader is
timed), the window extended to the end of a load (as the SLAF peer rounds up to whole chunks): a
window that stopped mid-load would time slicing of cells read before the clock started.
Epochs follow one another (the loader is re-iterated; the sampler's generator runs on). ``cells``
are the rows timed; ``cells_per_s`` is the median over rounds; ``cells_per_cpu_s`` is cells divided
by the process's CPU time (``time.process_time()``: user + sys of every thread) over the same
window, median over rounds (``cpu_per_wall`` = CPU seconds per wall second: how many cores it kept
busy). ``label_entropy_bits`` (with ``--label``): plug-in Shannon entropy ``-Σ p log2 p`` of that
column within each timed minibatch (missing values ignored), mean over all timed minibatches of all
rounds (computed after the clock stops); the timed work then includes annbatch gathering that
column for every batch (``pd.concat`` per load, ``.iloc`` per batch), as a training loop that needs
labels would.

Memory (both commands): ``peak_rss_bytes`` is this process's VmHWM. ``ru_maxrss`` of self and of
children is reported too, but neither is that: Linux carries ``ru_maxrss`` across fork + exec, so
self's can be the launching process's peak, and the only child is ``uname -p`` (``platform``, at
import), which reports the RSS of this process when it forked. annbatch and zarrs use threads only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

OUTPUTS = ("dense", "csr")
CHUNK_SIZE = 512  # Loader default; annbatch's scRNA-seq tutorial
PRELOAD_NCHUNKS = 32  # Loader default; "keep preload_nchunks around 32"


def _setup() -> None:
    """Quiet progress bars and known warnings; zarrs' codec pipeline, as annbatch's docs set it."""
    os.environ.setdefault("TQDM_DISABLE", "1")  # add_adatas' bars; read by tqdm at import
    for msg in (
        "Consolidated metadata is currently not part in the Zarr format 3 specification.*",
        "The 'future.infer_string' option is deprecated.*",
    ):  # zarr 3; anndata under pandas 3
        warnings.filterwarnings("ignore", message=msg)
    import zarr

    zarr.config.set({"codec_pipeline.path": "zarrs.ZarrsCodecPipeline"})


def _memory() -> dict[str, int]:
    """Peak RSS: VmHWM of this process, and ``ru_maxrss`` of self and children, in bytes."""
    hwm = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmHWM:"))  # fmt: skip
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {"peak_rss_bytes": hwm,
            "ru_maxrss_self_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "ru_maxrss_children_bytes": children}  # fmt: skip


def _sizes(root: str) -> tuple[int, int, int]:
    """``(files, sum of file sizes, allocated bytes)`` under ``root``."""
    files = size = blocks = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            st = os.lstat(os.path.join(dirpath, name))
            files, size, blocks = files + 1, size + st.st_size, blocks + st.st_blocks * 512
    return files, size, blocks


def _shape(collection: Any) -> tuple[int, int, int]:
    """``(cells, genes, datasets)`` of a collection, from its ``X`` metadata (sparse or dense)."""
    import zarr

    cells = genes = datasets = 0
    for group in collection:
        x = group["X"]
        shape = x.attrs["shape"] if isinstance(x, zarr.Group) else x.shape  # CSR group or dense array
        cells, genes, datasets = cells + int(shape[0]), int(shape[1]), datasets + 1
    return cells, genes, datasets


def _versions() -> dict[str, str]:
    return {f"{p}_version": version(p) for p in ("annbatch", "zarr", "zarrs", "anndata")}


def convert(input_path: str, outdir: str, seed: int) -> dict[str, Any]:
    """annbatch's preshuffled collection, ``DatasetCollection.add_adatas`` with its defaults."""
    if not os.path.isfile(input_path):
        raise SystemExit(f"_annbatch_peer convert: input not found: {input_path}")
    if os.path.exists(outdir):
        raise SystemExit(f"_annbatch_peer convert: {outdir} already exists; remove it or pick another path")
    _setup()
    import numpy as np
    import zarr
    from annbatch import DatasetCollection

    start = time.perf_counter()
    collection = DatasetCollection(zarr.open_group(outdir, mode="w-"))
    collection.add_adatas([input_path], shuffle=True, rng=np.random.default_rng(seed))
    seconds = time.perf_counter() - start
    cells, genes, datasets = _shape(collection)
    files, size, blocks = _sizes(outdir)
    return {
        "peer": "annbatch", "command": "convert", "seconds": seconds, "cells": cells,
        "cells_per_s": cells / seconds, "genes": genes, "datasets": datasets, **_memory(),
        "bytes": size, "disk_bytes": blocks, "files": files, "bytes_per_cell": size / cells,
        "input_bytes": os.path.getsize(input_path), "seed": seed,
        "config": "DatasetCollection.add_adatas(shuffle=True) defaults: read_lazy input, "
                  "shuffle_chunk_size=1000, dataset_size='20GB', n_obs_per_chunk=64, shard_size='1GB', "
                  "Blosc lz4 clevel 3 shuffle; zarrs codec pipeline",
        **_versions(),
    }  # fmt: skip


def _counting_sampler(**kwargs: Any) -> Any:
    """annbatch's ``RandomSampler``, counting the batches (splits) of every load request it hands out."""
    from annbatch.samplers import RandomSampler

    class CountingRandomSampler(RandomSampler):
        issued = 0  # batches the loader has been asked to produce so far (across epochs)
        loads = 0

        def sample(self, n_obs: int) -> Iterator[Any]:
            for request in super().sample(n_obs):
                self.issued += len(request["splits"])
                self.loads += 1
                yield request

    return CountingRandomSampler(**kwargs)


def _epochs(loader: Any) -> Iterator[dict[str, Any]]:
    """Batches of one pass over ``loader``, then of the next, and so on."""
    while True:
        batch = None
        for batch in loader:
            yield batch
        if batch is None:
            raise SystemExit("_annbatch_peer run: an epoch yielded no batch (fewer cells than one batch?)")


def _entropy_bits(labels: Any) -> float:
    """Plug-in entropy ``-Σ p log2 p`` (bits) of one minibatch's labels; missing values ignored."""
    import numpy as np

    counts = labels.value_counts(dropna=True).to_numpy()
    counts = counts[counts > 0]
    if counts.sum() == 0:
        return 0.0
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum()) + 0.0


def _open_loader(args: argparse.Namespace) -> tuple[Any, Any]:
    """A fresh ``DatasetCollection`` over ``args.dataset`` and the ``Loader`` over it (the config in
    the module's docstring); returns ``(loader, sampler)``."""
    import anndata as ad
    import numpy as np
    import zarr
    from annbatch import DatasetCollection, Loader

    collection = DatasetCollection(zarr.open_group(args.dataset, mode="r"))
    sampler = _counting_sampler(
        chunk_size=args.chunk_size,
        preload_nchunks=args.preload_nchunks,
        batch_size=args.batch_size,
        drop_last=True,
        rng=np.random.default_rng(args.seed),
    )
    with ad.settings.override(remove_unused_categories=False):
        loader = Loader(batch_sampler=sampler, preload_to_gpu=False, to=None)
        loader.use_collection(collection, load_adata=lambda group: _load_adata(group, args.label))
    return loader, sampler


def _load_adata(group: Any, label: str | None) -> Any:
    """``X`` backed, plus only the ``label`` column of obs (annbatch's tutorials' pattern)."""
    import anndata as ad
    import zarr

    x = ad.io.sparse_dataset(group["X"]) if isinstance(group["X"], zarr.Group) else group["X"]
    if label is None:
        return ad.AnnData(X=x)
    return ad.AnnData(X=x, obs=ad.experimental.read_lazy(group).obs[[label]].to_memory())


def _x(args: argparse.Namespace, batch: dict[str, Any], num_genes: int) -> Any:
    """A batch's ``X`` as ``--output`` asks (densified by scipy for ``dense``), its shape checked."""
    import numpy as np
    import scipy.sparse as sp

    x = batch["X"]
    if args.output == "dense":
        x = x.toarray() if sp.issparse(x) else np.asarray(x)
        if x.dtype != np.float32:
            x = x.astype(np.float32)
    elif not (sp.issparse(x) and x.format == "csr"):
        raise SystemExit(f"_annbatch_peer: --output csr, but annbatch yielded {type(x).__name__}")
    if x.shape != (args.batch_size, num_genes):
        raise SystemExit(
            f"_annbatch_peer: got a batch of shape {x.shape}, want ({args.batch_size}, {num_genes})"
        )
    return x


def _round(args: argparse.Namespace) -> dict[str, Any]:
    """One fresh loader: first-batch latency, warmup, drain to a load boundary, timed window."""
    start = time.perf_counter()
    loader, sampler = _open_loader(args)
    num_genes = loader.n_var
    batches = _epochs(loader)
    labels: list[Any] = []

    def take() -> None:
        batch = next(batches)
        _x(args, batch, num_genes)
        if args.label is not None and timing:
            labels.append(batch["obs"][args.label])

    timing = False
    try:
        take()
        first_batch_s = time.perf_counter() - start
        from_spawn_s = None if args.spawned_at is None else time.time() - args.spawned_at
        delivered = 1
        for _ in range(args.warmup - 1):
            take()
            delivered += 1
        while sampler.issued > delivered:  # drain to the end of the current load
            take()
            delivered += 1
        drained, loads0 = delivered, sampler.loads
        timing = True
        cpu0, t0 = time.process_time(), time.perf_counter()
        # at least --seconds, and end on a load boundary too: whole loads in the window
        while time.perf_counter() - t0 < args.seconds or sampler.issued > delivered:
            take()
            delivered += 1
        t1, cpu1 = time.perf_counter(), time.process_time()
    finally:
        batches.close()  # closes the loader's open iterator
    timed = delivered - drained
    entropy = [_entropy_bits(s) for s in labels]
    return {"cells": timed * args.batch_size, "batches": timed, "seconds": t1 - t0, "cpu_seconds": cpu1 - cpu0,
            "loads": sampler.loads - loads0, "first_batch_s": first_batch_s, "num_genes": num_genes,
            "first_batch_from_spawn_s": from_spawn_s,
            "num_cells": loader.n_obs, "entropy": entropy}  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Median cells/s of ``args.rounds`` rounds over annbatch's Loader."""
    if not os.path.isdir(args.dataset):
        raise SystemExit(
            f"_annbatch_peer run: no annbatch collection at {args.dataset}; make one with `convert`"
        )
    pool = args.chunk_size * args.preload_nchunks
    if pool % args.batch_size:
        raise SystemExit(
            f"_annbatch_peer run: annbatch needs chunk_size * preload_nchunks ({pool}) to be a "
            f"multiple of the batch size ({args.batch_size}); change --chunk-size / --preload-nchunks"
        )
    _setup()
    import zarr
    from annbatch import DatasetCollection

    try:
        collection = DatasetCollection(zarr.open_group(args.dataset, mode="r"))
    except zarr.errors.GroupNotFoundError:
        collection = None
    if collection is None or collection.is_empty:
        raise SystemExit(f"_annbatch_peer run: {args.dataset} is not an annbatch collection")
    num_cells, _, datasets = _shape(collection)
    if args.label is not None:
        missing = [i for i, g in enumerate(collection) if args.label not in g["obs"]]
        if missing:
            raise SystemExit(f"_annbatch_peer run: obs column {args.label!r} not in dataset(s) {missing}")

    runs = [_round(args) for _ in range(args.rounds)]
    rates = [r["cells"] / r["seconds"] for r in runs]
    per_cpu = [r["cells"] / r["cpu_seconds"] for r in runs]
    entropy = [e for r in runs for e in r["entropy"]]
    return {
        "peer": "annbatch", "command": "run", "output": args.output, "batch_size": args.batch_size,
        "cells_per_s": statistics.median(rates), "cells_per_s_runs": rates,
        "cells_per_cpu_s": statistics.median(per_cpu), "cells_per_cpu_s_runs": per_cpu,
        "cpu_per_wall": statistics.median(r["cpu_seconds"] / r["seconds"] for r in runs),
        "first_batch_s": statistics.median(r["first_batch_s"] for r in runs),
        "first_batch_s_runs": [r["first_batch_s"] for r in runs],
        "first_batch_from_spawn_s": runs[0]["first_batch_from_spawn_s"],  # the process's first round only
        "batches": statistics.median_low(r["batches"] for r in runs), "batches_runs": [r["batches"] for r in runs],
        "cells_runs": [r["cells"] for r in runs], "loads_runs": [r["loads"] for r in runs],
        "shape": [args.batch_size, runs[0]["num_genes"]] if args.output == "dense" else [args.batch_size, "csr"],
        "label": args.label,
        "label_entropy_bits": statistics.fmean(entropy) if entropy else None,
        "label_entropy_bits_runs": [statistics.fmean(r["entropy"]) for r in runs] if entropy else None,
        "window_s": args.seconds, "seconds_runs": [r["seconds"] for r in runs],
        "warmup": args.warmup, "rounds": args.rounds, "seed": args.seed,
        "num_cells": num_cells, "num_genes": runs[0]["num_genes"], "datasets": datasets,
        "chunk_size": args.chunk_size, "preload_nchunks": args.preload_nchunks,
        "cells_per_load": pool, "batches_per_load": pool // args.batch_size, **_memory(),
        "zarr_max_workers": zarr.config.get("threading.max_workers"), "cpus": len(os.sched_getaffinity(0)),
        "config": f"Loader(RandomSampler(chunk_size={args.chunk_size}, preload_nchunks={args.preload_nchunks}, "
                  f"drop_last=True), preload_to_gpu=False, to=None).use_collection(X"
                  f"{' + obs[' + repr(args.label) + ']' if args.label else ''}); zarrs codec pipeline",
        **_versions(),
    }  # fmt: skip


def first(args: argparse.Namespace, started_at: float) -> dict[str, Any]:
    """Seconds from this process's spawn (``--spawned-at``) to its first batch, in phases: the
    interpreter's start (to ``main``), the imports a user's script makes (annbatch, anndata, zarr
    with zarrs' pipeline), and the first batch from the ``DatasetCollection`` call (opening the
    stores, the obs column, the first load). Nothing else is read or checked first."""
    _setup()
    import annbatch  # noqa: F401
    import anndata  # noqa: F401 - what a user's script imports

    imported_at = time.time()
    start = time.perf_counter()
    loader, _ = _open_loader(args)
    _x(args, next(_epochs(loader)), loader.n_var)
    first_batch_s = time.perf_counter() - start
    done_at = time.time()
    return {
        "peer": "annbatch", "command": "first", "output": args.output, "batch_size": args.batch_size,
        "interpreter_s": started_at - args.spawned_at, "imports_s": imported_at - started_at,
        "first_batch_s": first_batch_s, "from_spawn_s": done_at - args.spawned_at, **_memory(), **_versions(),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    started_at = time.time()
    parser = argparse.ArgumentParser(description="annbatch's on-disk loader as a benchmark peer.")
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser(
        "convert", help="h5ad -> annbatch's preshuffled zarr collection; prints one JSON line"
    )
    conv.add_argument("input")
    conv.add_argument("output")
    conv.add_argument("--seed", type=int, default=0)
    loader = argparse.ArgumentParser(add_help=False)  # the Loader's arguments: `run` and `first`
    loader.add_argument("dataset")
    loader.add_argument("--output", choices=OUTPUTS, default="dense")
    loader.add_argument("--batch-size", type=int, default=64)
    loader.add_argument("--seed", type=int, default=0)
    loader.add_argument(
        "--label",
        default=None,
        help="obs column loaded with each batch (run: its per-minibatch entropy is reported)",
    )
    loader.add_argument("--chunk-size", type=int, default=CHUNK_SIZE)
    loader.add_argument("--preload-nchunks", type=int, default=PRELOAD_NCHUNKS)
    bench = sub.add_parser("run", parents=[loader], help="time annbatch.Loader; prints one JSON line")
    bench.add_argument("--seconds", type=float, default=10.0, help="the timed window of a round (at least)")
    bench.add_argument("--warmup", type=int, default=5)
    bench.add_argument("--rounds", type=int, default=3)
    bench.add_argument(
        "--spawned-at",
        type=float,
        default=None,
        help="time.time() just before this process was started: first_batch_from_spawn_s",
    )
    start = sub.add_parser(
        "first",
        parents=[loader],
        help="seconds from spawn to the first batch, by phase; prints one JSON line",
    )
    start.add_argument(
        "--spawned-at", type=float, required=True, help="time.time() just before this process was started"
    )
    args = parser.parse_args(argv)
    if args.command == "convert":
        print(json.dumps(convert(args.input, args.output, args.seed)), flush=True)
        return 0
    for name in ("batch_size", "rounds", "chunk_size", "preload_nchunks"):
        if getattr(args, name, 1) < 1:
            parser.error(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    if args.command == "first":
        print(json.dumps(first(args, started_at)), flush=True)
        return 0
    if not args.seconds > 0:
        parser.error(f"--seconds must be positive, got {args.seconds}")
    if args.warmup < 0:
        parser.error(f"--warmup must be ≥ 0, got {args.warmup}")
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

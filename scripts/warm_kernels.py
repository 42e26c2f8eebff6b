"""Compile omicsio_jax's numba kernels once, into their on-disk caches, before many processes need them.

Every kernel is ``@njit(cache=True)``: a process loads its machine code from the cache beside the
source (``__pycache__``), or compiles it and writes it there. A fresh checkout or install has no
cache, so the first processes to run compile the same kernels at the same time (the test suite's
two workers and the processes they start; a job's hosts and Grain workers). This runs the kernels
once, one after the other, on a small synthetic corpus: materialize from parquet, and a collection
of the parquet and the h5ad (its h5ad reader is the one a single h5ad input uses), then a batch of every output kind from the disk loader. Kernels called
later with other argument types (e.g. float64 values) still compile on their first call.

    .venv/bin/python scripts/warm_kernels.py      # scripts/test.sh runs it before the suite
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import omicsio_jax as oj
from materialize import Layout, make_synthetic_corpus, materialize


def main() -> None:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="omicsio-warm-") as tmp:
        root = Path(tmp)
        corpus = make_synthetic_corpus(root / "corpus", num_cells=1200, num_genes=500, seed=0, mean_nnz=60)
        layout = Layout(shard_cells=512)
        kw = {"progress": False, "layout": layout, "workers": 1}  # one process: each kernel compiled once
        materialize(corpus.cells_parquet, root / "ds", obs=("cell_type",), **kw)
        (root / "second").mkdir()
        second = root / "second" / "second.h5ad"  # a dataset id of its own: the file's name
        second.symlink_to(corpus.h5ad)
        materialize([corpus.cells_parquet, second], root / "collection", **kw)
        ds = oj.open_dataset(root / "ds")
        outputs = [
            "dense",
            "csr",
            oj.Dense(normalize="log1p"),
            oj.Panel(genes=list(range(0, 500, 10))),
            oj.GeneformerTokens(max_len=64),
            oj.ScGPTTokens(max_len=48),
        ]
        for output in outputs:
            loader = oj.make_loader(ds, batch_size=64, output=output, obs=("cell_type",), seed=0)
            next(iter(loader))
            loader.close()
        collection = oj.open_dataset(root / "collection")
        for output in (oj.Dense(measured=True), oj.CSR(measured=True)):
            loader = oj.make_loader(collection, batch_size=64, output=output, seed=0)
            x = next(iter(loader)).x
            if isinstance(output, oj.CSR):
                np.asarray(loader.densify(x))
            loader.close()
    print(f"numba kernels compiled into their caches in {time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()

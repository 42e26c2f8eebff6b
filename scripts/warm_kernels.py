"""Compile omicsio_jax's numba kernels once, into their on-disk caches, before many processes need them.

Every kernel is ``@njit(cache=True)``: a process loads its machine code from the cache beside the
source (``__pycache__``), or compiles it and writes it there. A fresh checkout or install has no
cache, so the first processes to run compile the same kernels at the same time (the test suite's
two workers and the processes they start; a job's hosts and Grain workers). This runs the kernels
once each on a small synthetic corpus: materialize from parquet, and a collection of the parquet and
the h5ad (its h5ad reader is the one a single h5ad input uses), then a batch of every output kind
from the disk loader. Kernels called later with other argument types (e.g. float64 values) still
compile on their first call.

Compiling is single-threaded, so the loaders' kernels compile in two processes of their own while
this one goes on with the inputs of other types: the token outputs once the first dataset is written,
the other outputs and the collection's masks once the collection is. Only the chunk reader's few
kernels are compiled by both at once.

    .venv/bin/python scripts/warm_kernels.py      # scripts/test.sh runs it before the suite
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import omicsio_jax as oj
from materialize import Layout, make_synthetic_corpus, materialize

# the loaders' kernels, in processes of their own (`main`): each part's outputs over dataset ``ds``
_PARTS = ("tokens", "outputs")


def _start(part: str, root: Path) -> tuple[str, subprocess.Popen]:
    return part, subprocess.Popen([sys.executable, __file__, part, str(root)])


def main() -> None:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="omicsio-warm-") as tmp:
        root = Path(tmp)
        corpus = make_synthetic_corpus(root / "corpus", num_cells=1200, num_genes=500, seed=0, mean_nnz=60)
        layout = Layout(shard_cells=512)
        kw = {"progress": False, "layout": layout, "workers": 1}  # one process: each kernel compiled once
        materialize(corpus.cells_parquet, root / "ds", obs=("cell_type",), **kw)
        parts = [_start("tokens", root)]
        try:
            (root / "second").mkdir()
            second = root / "second" / "second.h5ad"  # a dataset id of its own: the file's name
            second.symlink_to(corpus.h5ad)
            materialize([corpus.cells_parquet, second], root / "collection", **kw)
            parts.append(_start("outputs", root))
            _other_types(root, corpus, kw)
        except BaseException:
            for _, proc in parts:
                proc.kill()
            raise
        finally:
            failed = [part for part, proc in parts if proc.wait() != 0]
        if failed:
            raise SystemExit(f"warm_kernels: the {' and '.join(failed)} part failed")
        _readers(root)  # after the parts: the chunk reader's kernels are theirs too
    print(f"numba kernels compiled into their caches in {time.perf_counter() - start:.0f} s", file=sys.stderr)


def _loaders(part: str, root: Path) -> None:
    """A batch of each output of ``part`` over ``root/ds`` (and for ``outputs``, then the
    collection's masks over ``root/collection``)."""
    ds = oj.open_dataset(root / "ds")
    outputs = (
        [oj.GeneformerTokens(max_len=64), oj.ScGPTTokens(max_len=48)]
        if part == "tokens"
        else ["dense", "csr", oj.Dense(normalize="log1p"), oj.Panel(genes=list(range(0, 500, 10)))]
    )
    for output in outputs:
        loader = oj.make_loader(ds, batch_size=64, output=output, obs=("cell_type",), seed=0)
        next(iter(loader))
        loader.close()
    if part != "outputs":
        return
    collection = oj.open_dataset(root / "collection")
    for output in (oj.Dense(measured=True), oj.CSR(measured=True)):
        loader = oj.make_loader(collection, batch_size=64, output=output, seed=0)
        x = next(iter(loader)).x
        if isinstance(output, oj.CSR):
            np.asarray(loader.densify(x))
        loader.close()


def _other_types(root: Path, corpus, kw: dict) -> None:
    """The kernels again for the argument types other inputs bring: list columns of int64 tokens
    (what pyarrow makes of Python ints) with float32 or float64 values, a collection whose first source
    lists its genes in an order of its own (the union's ordering kernel, and the rows of the other
    source re-sorted) and a panel layout."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cells = pq.read_table(corpus.cells_parquet)
    genes = pq.read_table(corpus.cells_parquet.parent / "gene_metadata.parquet")
    for name, values in (("long", pa.float32()), ("wide", pa.float64())):
        table = cells.set_column(
            cells.schema.get_field_index("gene_token_id"),
            "gene_token_id",
            cells.column("gene_token_id").cast(pa.list_(pa.int64())),
        )
        table = table.set_column(
            table.schema.get_field_index("gene_expression"),
            "gene_expression",
            table.column("gene_expression").cast(pa.list_(values)),
        )
        (root / name).mkdir()
        pq.write_table(table, root / name / "cells.parquet")
        pq.write_table(genes, root / name / "gene_metadata.parquet")
        materialize(root / name / "cells.parquet", root / f"ds_{name}", **kw)
    # the long source with its gene table reversed (each row's tokens still rising)
    tokens = cells.column("gene_token_id").combine_chunks()
    indptr = tokens.offsets.to_numpy().astype(np.int64)
    lengths = np.diff(indptr)
    flip = np.repeat(indptr[:-1] + indptr[1:] - 1, lengths) - np.arange(indptr[-1])
    top = genes.num_rows - 1
    flat_tokens = top - tokens.flatten().to_numpy()[flip]
    flat_values = cells.column("gene_expression").combine_chunks().flatten().to_numpy()[flip]
    offsets = pa.array(indptr.astype(np.int32))
    reversed_cells = cells.set_column(
        cells.schema.get_field_index("gene_token_id"),
        "gene_token_id",
        pa.ListArray.from_arrays(offsets, pa.array(flat_tokens.astype(np.int64))),
    ).set_column(
        cells.schema.get_field_index("gene_expression"),
        "gene_expression",
        pa.ListArray.from_arrays(offsets, pa.array(flat_values)),
    )
    (root / "reversed").mkdir()
    pq.write_table(reversed_cells, root / "reversed" / "cells.parquet")
    pq.write_table(
        genes.set_column(
            genes.schema.get_field_index("gene_token_id"),
            "gene_token_id",
            pa.array(top - genes.column("gene_token_id").to_numpy()),
        ).sort_by("gene_token_id"),
        root / "reversed" / "gene_metadata.parquet",
    )
    materialize(
        [
            root / "reversed" / "cells.parquet",
            root / "wide" / "cells.parquet",
            root / "long" / "cells.parquet",
        ],
        root / "collection_reordered",
        **kw,
    )
    panel = genes.column("ensembl_id").to_pylist()[::7]
    materialize(
        corpus.cells_parquet, root / "panel", **{**kw, "layout": Layout(shard_cells=512, panel=panel)}
    )


def _readers(root: Path) -> None:
    """Rows of the int64-token dataset read by position, and a panel loaded into memory."""
    ds = oj.open_dataset(root / "ds_long")
    ds.read_csr(np.arange(0, ds.num_cells, 3))
    loader = oj.make_memory_loader(oj.load_panel(ds, progress=False), batch_size=64)
    next(iter(loader))
    loader.close()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in _PARTS:
        _loaders(sys.argv[1], Path(sys.argv[2]))
    else:
        main()

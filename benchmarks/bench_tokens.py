"""Tokenized loading: Geneformer / scGPT token batches against the csr output and SLAF, same cells, one run.

Every configuration runs in a fresh process, one after another, on the same 50k-cell synthetic corpus
(62,710 genes, ~1,500 expressed per cell): omicsio_jax's ``make_loader`` with ``output="csr"``,
``oj.GeneformerTokens(max_len=2048)`` and ``oj.ScGPTTokens(max_len=1201)`` at batch 64 and 256, and
SLAF's tokenized loader (``slafdb``, its own converter, its ``geneformer`` / ``scgpt`` token modes,
its default training config) on the h5ad of the same cells, in its own virtualenv. Also the
tokenizers' kernel cost alone (µs per cell, one thread) and materialize's throughput with and
without the corpus statistics (``--baseline`` = a checkout of the code before them).

    scripts/setup-slaf.sh                                    # .venv-slaf with slafdb 0.5.2
    git worktree add /tmp/before-stats 7f83aa4               # optional: materialize A/B
    .venv/bin/python benchmarks/bench_tokens.py --baseline /tmp/before-stats
    git worktree add /tmp/before-sort 65c77aa                # optional: token kernels A/B (session 15's sort)
    .venv/bin/python benchmarks/bench_tokens.py --threads 0 1 2 --kernel-baseline /tmp/before-sort
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent
DATA = HERE / "data"
CORPUS, DATASET, SLAF = DATA / "corpus_50k", DATA / "ds_50k", DATA / "slaf_50k.slaf"
SLAF_PYTHON = ROOT / ".venv-slaf" / "bin" / "python"


def ensure_data() -> None:
    from materialize import make_synthetic_corpus, materialize

    if not (CORPUS / "cells.h5ad").exists():
        make_synthetic_corpus(CORPUS, num_cells=50_000, seed=1, write_h5ad=True, progress=True)
    if not (DATASET / "manifest.json").exists():
        materialize(CORPUS / "cells.parquet", DATASET, overwrite=True)
    if SLAF_PYTHON.exists() and not SLAF.exists():
        subprocess.run(
            [SLAF_PYTHON, HERE / "_slaf_peer.py", "convert", CORPUS / "cells.h5ad", SLAF], check=True
        )


def _output(kind: str):
    import omicsio_jax as oj

    return {
        "csr": "csr",
        "geneformer": oj.GeneformerTokens(max_len=2048),
        "scgpt": oj.ScGPTTokens(max_len=1201),
    }[kind]


def child_loader(kind: str, batch_size: int, rounds: int, cells: int, num_threads: int) -> dict:
    """cells/s of make_loader (median over rounds of ``cells`` cells each, after a warm-up)."""
    import jax

    import omicsio_jax as oj

    ds = oj.open_dataset(DATASET)
    loader = oj.make_loader(
        ds, batch_size=batch_size, num_epochs=None, output=_output(kind), num_threads=num_threads
    )
    it = iter(loader)
    for _ in range(max(8, 4096 // batch_size)):  # warm-up: compile, fill the read-ahead and buffer pools
        jax.block_until_ready(next(it).x)
    steps = max(1, cells // batch_size)
    runs = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            jax.block_until_ready(next(it).x)
        runs.append(steps * batch_size / (time.perf_counter() - start))
    loader.close()
    return {
        "cells_per_s": statistics.median(runs),
        "cells_per_s_runs": runs,
        "cells_per_round": steps * batch_size,
    }


def child_kernels(cells: int) -> dict:
    """µs per cell of each output's decode from records, one numba thread, records already in memory,
    output arrays reused from one call to the next (as the loader recycles its batch buffers)."""
    import numba
    import numpy as np

    import omicsio_jax as oj
    from omicsio_jax.format.codec import join_records
    from omicsio_jax.outputs.base import OutputContext, RowKeys

    numba.set_num_threads(1)
    ds = oj.open_dataset(DATASET)
    buf, starts = join_records(ds.read_records(0, cells))
    keys = RowKeys(np.arange(cells))
    reused: dict = {}

    def empty(shape, dtype):  # the same arrays every call: no page faults of fresh memory in the timing
        return reused.setdefault((tuple(shape), np.dtype(dtype).str), np.zeros(shape, dtype))

    out = {}
    for kind in ("csr", "geneformer", "scgpt"):
        spec = _output(kind)
        bound = (oj.CSR() if spec == "csr" else spec).bind(OutputContext.of_dataset(ds, rows=cells))
        bound.from_records(buf, starts, empty, keys)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            bound.from_records(buf, starts, empty, keys)
            times.append(time.perf_counter() - start)
        out[kind] = 1e6 * statistics.median(times) / cells
    return out


def child_materialize(out_dir: str) -> dict:
    from materialize import materialize

    result = materialize(CORPUS / "cells.parquet", out_dir, overwrite=True, progress=False)
    shutil.rmtree(out_dir)
    return {"cells_per_s": result.cells_per_second, "seconds": result.seconds}


def run_child(args: list[str], *, pythonpath: str | None = None) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    proc = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env, cwd=ROOT
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_slaf(tokenizer: str, batch_size: int, rounds: int, cells: int) -> dict:
    max_len = 2048 if tokenizer == "geneformer" else 1201
    proc = subprocess.run(
        [
            SLAF_PYTHON,
            HERE / "_slaf_peer.py",
            "run",
            SLAF,
            "--tokenizer",
            tokenizer,
            "--batch-size",
            str(batch_size),
            "--max-len",
            str(max_len),
            "--num-batches",
            str(max(1, cells // batch_size)),
            "--warmup",
            "5",
            "--rounds",
            str(rounds),
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cells", type=int, default=16384, help="cells per timed round")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    p.add_argument("--threads", type=int, nargs="+", default=[1], help="make_loader num_threads settings")
    p.add_argument("--baseline", help="a checkout of omicsio_jax before the statistics, for materialize A/B")
    p.add_argument(
        "--kernel-baseline", help="a checkout of omicsio_jax whose token kernels to time beside these"
    )
    p.add_argument("--out", default=str(HERE / "results" / "tokens.json"))
    args = p.parse_args()
    if args.child:
        what, *rest = args.child
        if what == "loader":
            result = child_loader(rest[0], int(rest[1]), int(rest[2]), int(rest[3]), int(rest[4]))
        elif what == "kernels":
            result = child_kernels(int(rest[0]))
        else:
            result = child_materialize(rest[0])
        print(json.dumps(result))
        return
    ensure_data()
    rows = []
    for b in args.batch_sizes:
        for kind in ("csr", "geneformer", "scgpt"):
            for t in args.threads:
                r = run_child(["loader", kind, str(b), str(args.rounds), str(args.cells), str(t)])
                rows.append(
                    {
                        "label": f"omicsio {kind} b{b} num_threads={t}",
                        "kind": kind,
                        "batch_size": b,
                        "num_threads": t,
                        **r,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
        if SLAF_PYTHON.exists():
            for tokenizer in ("geneformer", "scgpt"):
                r = run_slaf(tokenizer, b, args.rounds, args.cells)
                rows.append(
                    {"label": f"slaf {tokenizer} b{b}", "kind": f"slaf-{tokenizer}", "batch_size": b, **r}
                )
                print(json.dumps(rows[-1]), flush=True)
    kernels = run_child(["kernels", "4096"])
    print(json.dumps({"kernel_us_per_cell": kernels}), flush=True)
    if args.kernel_baseline:
        kernels_baseline = run_child(["kernels", "4096"], pythonpath=args.kernel_baseline)
        print(json.dumps({"kernel_us_per_cell_baseline": kernels_baseline}), flush=True)
    mat = {"with_stats": run_child(["materialize", str(DATA / "tmp_mat_new")])}
    if args.baseline:
        mat["before_stats"] = run_child(["materialize", str(DATA / "tmp_mat_old")], pythonpath=args.baseline)
    print(json.dumps({"materialize": mat}), flush=True)
    ratios = {}
    by = {(r["kind"], r["batch_size"], r.get("num_threads")): r["cells_per_s"] for r in rows}
    best = {}  # (kind, batch) -> the fastest setting's cells/s
    for (kind, b, _), v in by.items():
        best[kind, b] = max(best.get((kind, b), 0), v)
    for b in args.batch_sizes:
        for kind in ("geneformer", "scgpt"):
            for t in args.threads:
                ratios[f"{kind} b{b} num_threads={t}: time vs csr"] = by[("csr", b, t)] / by[(kind, b, t)]
            ratios[f"{kind} b{b} best setting: time vs csr's best"] = best["csr", b] / best[kind, b]
            if (f"slaf-{kind}", b) in best:
                ratios[f"{kind} b{b}: speed vs SLAF (best setting)"] = best[kind, b] / best[f"slaf-{kind}", b]
    result = {
        "benchmark": "bench_tokens",
        "command": "python benchmarks/bench_tokens.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "cells": 50_000,
        "rows": rows,
        "kernel_us_per_cell": kernels,
        "materialize": mat,
        "ratios": ratios,
    }
    if args.kernel_baseline:
        result["kernel_us_per_cell_baseline"] = kernels_baseline
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(ratios, indent=1))


if __name__ == "__main__":
    main()

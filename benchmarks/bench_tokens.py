"""Tokenized loading: Geneformer / scGPT token batches against the csr output and SLAF, same cells, one run.

Every configuration runs in a fresh process on the same 50k-cell synthetic corpus
(62,710 genes, ~1,500 expressed per cell): omicsio_jax's ``make_loader`` with ``output="csr"``,
``oj.GeneformerTokens(max_len=2048)`` and ``oj.ScGPTTokens(max_len=1201)`` at batch 64 and 256, and
SLAF's tokenized loader (``slafdb``, its own converter, its ``geneformer`` / ``scgpt`` token modes,
its default training config) on the h5ad of the same cells, in its own virtualenv. Also the
tokenizers' kernel cost alone (µs per cell, one thread, a fresh process per round; with
``--kernel-baseline``, that checkout's rounds alternate with this tree's), Geneformer's also with a
median per gene (``geneformer-dictionary``: ``medians=`` a file of Ensembl id → median, as a
published ``gene_median_dictionary.pkl`` gives them, here the corpus medians each moved at random
within its histogram bin, seed 0; the corpus medians are bin centres, so many genes share one and
a cell's ranking keys tie far more than with a published dictionary), and materialize's
throughput with and without the corpus statistics (``--baseline`` = a checkout of the code before
them). Every loader and kernel figure is the median of ``--rounds`` windows of at least
``--seconds`` each; materialize's, of ``--rounds`` whole conversions. omicsio_jax's loader
configurations run round-robin: each round runs every one of them once, each in a fresh process,
the order reversed every other round, so that the machine's drift over the minutes of the run
falls alike on a token output and on the csr output it is divided by (SLAF's peer runs its rounds
in one process of its virtualenv).

    scripts/setup-slaf.sh                                    # .venv-slaf with slafdb 0.5.2
    git worktree add /tmp/before-stats 7f83aa4               # optional: materialize A/B
    .venv/bin/python benchmarks/bench_tokens.py --baseline /tmp/before-stats
    git worktree add /tmp/tok-before 147fcb8                 # optional: token kernels A/B (before the bucket sort)
    .venv/bin/python benchmarks/bench_tokens.py --kernel-baseline /tmp/tok-before
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _provenance import (  # noqa: E402
    add_window_options,
    baseline_commit,
    check_window,
    compare,
    loader_windows,
    medians,
    provenance,
    window,
    write_result,
)

DATA = HERE / "data"
CORPUS, DATASET, SLAF = DATA / "corpus_50k", DATA / "ds_50k", DATA / "slaf_50k.slaf"
MEDIANS = DATA / "ds_50k_median_dictionary.pkl"  # a median per gene (`median_dictionary`)
KERNEL_KINDS = ("csr", "geneformer", "geneformer-dictionary", "scgpt")
SLAF_PYTHON = ROOT / ".venv-slaf" / "bin" / "python"


def ensure_data() -> None:
    from materialize import make_synthetic_corpus, materialize

    if not (CORPUS / "cells.h5ad").exists():
        make_synthetic_corpus(CORPUS, num_cells=50_000, seed=1, write_h5ad=True, progress=True)
    if not (DATASET / "manifest.json").exists():
        materialize(CORPUS / "cells.parquet", DATASET, overwrite=True)
    if not MEDIANS.exists():
        median_dictionary(DATASET, MEDIANS)
    if SLAF_PYTHON.exists() and not SLAF.exists():
        subprocess.run(
            [SLAF_PYTHON, HERE / "_slaf_peer.py", "convert", CORPUS / "cells.h5ad", SLAF], check=True
        )


def median_dictionary(dataset: Path, out: Path, seed: int = 0) -> None:
    """A pickled ``{Ensembl id: median}`` with a median of its own for every gene, as a published
    dictionary has: the dataset's corpus medians (bin centres of its statistics' histograms, 40 per
    octave), each multiplied by ``2 ** u / 80`` for a uniform ``u`` in [-1, 1): still within its bin."""
    import pickle

    import numpy as np

    import omicsio_jax as oj
    from omicsio_jax.format.gene_stats import read_gene_medians

    ds = oj.open_dataset(dataset)
    medians = read_gene_medians(ds)
    ids = ds.features["ensembl_id"].tolist()
    moved = medians * 2.0 ** (np.random.default_rng(seed).uniform(-1.0, 1.0, len(medians)) / 80)
    known = np.isfinite(moved) & (moved > 0)
    table = {str(i): float(m) for i, m, k in zip(ids, moved, known, strict=True) if k and i is not None}
    out.write_bytes(pickle.dumps(table))


def _output(kind: str):
    import omicsio_jax as oj

    return {
        "csr": "csr",
        "geneformer": oj.GeneformerTokens(max_len=2048),
        "geneformer-dictionary": oj.GeneformerTokens(max_len=2048, medians=str(MEDIANS)),
        "scgpt": oj.ScGPTTokens(max_len=1201),
    }[kind]


def child_loader(kind: str, batch_size: int, rounds: int, seconds: float, num_threads: int) -> dict:
    """cells/s of make_loader: the median of ``rounds`` windows of at least ``seconds``, after a warm-up."""
    import omicsio_jax as oj

    ds = oj.open_dataset(DATASET)
    loader = oj.make_loader(
        ds,
        batch_size=batch_size,
        output=_output(kind),
        num_epochs=None,
        read=oj.ReadOptions(num_threads=num_threads),
    )
    runs = loader_windows(loader, batch_size, seconds=seconds, rounds=rounds, waited=lambda batch: batch.x)
    loader.close()
    return medians(runs, ("cells_per_s", "cells_per_cpu_s", "seconds", "batches"))


def child_kernels(cells: int, rounds: int, seconds: float) -> dict:
    """µs per cell of each output's decode from records, one numba thread, records already in memory
    and checked (a loader checks each fetch once, on the thread that read it; a checkout from before
    `codec.Records` checks them in every call), output arrays reused from one call to the next (as
    the loader recycles its batch buffers): the median of ``rounds`` windows of at least ``seconds``
    of calls on ``cells`` cells."""
    import numba
    import numpy as np

    import omicsio_jax as oj
    from omicsio_jax.format import codec
    from omicsio_jax.outputs.base import OutputContext, RowKeys

    numba.set_num_threads(1)
    ds = oj.open_dataset(DATASET)
    raw = codec.join_records(ds.read_records(0, cells))
    records = (codec.Records.check(*raw, ds.num_genes),) if hasattr(codec, "Records") else raw
    keys = RowKeys(np.arange(cells))
    reused: dict = {}

    def empty(shape, dtype):  # the same arrays every call: no page faults of fresh memory in the timing
        return reused.setdefault((tuple(shape), np.dtype(dtype).str), np.zeros(shape, dtype))

    out = {}
    for kind in KERNEL_KINDS:
        spec = _output(kind)
        bound = (oj.CSR() if spec == "csr" else spec).bind(OutputContext.of_dataset(ds, rows=cells))
        bound.from_records(*records, empty, keys)

        def step(bound=bound) -> int:
            bound.from_records(*records, empty, keys)
            return cells

        runs = [window(step, seconds=seconds) for _ in range(rounds)]
        us = [1e6 * w.seconds / w.cells for w in runs]
        out[kind] = statistics.median(us)
        out[f"{kind}_runs"] = us
    return out


def child_materialize(out_dir: str) -> dict:
    from materialize import materialize

    result = materialize(CORPUS / "cells.parquet", out_dir, overwrite=True, progress=False)
    shutil.rmtree(out_dir)
    return {"cells_per_s": result.cells_per_second, "seconds": result.seconds}


def materialize_rounds(out_dir: str, rounds: int, *, pythonpath: str | None = None) -> dict:
    """Median cells/s of ``rounds`` whole conversions of the corpus, each in a fresh process."""
    runs = [run_child(["materialize", out_dir], pythonpath=pythonpath) for _ in range(rounds)]
    return {**medians(runs, ("cells_per_s", "seconds")), "window": "one whole conversion per round"}


def loader_rounds(configs: list[tuple[str, int, int]], rounds: int, seconds: float) -> list[dict]:
    """One row per loader configuration ``(kind, batch_size, num_threads)``: the medians of ``rounds``
    rounds, each running every configuration once, in a fresh process (`child_loader`, one window),
    in the order given on even rounds and reversed on odd ones, so that the machine's drift over the
    minutes of the run falls on the token outputs and the csr output they are divided by alike."""
    keys = ("cells_per_s", "cells_per_cpu_s", "seconds", "batches")
    windows: dict[tuple[str, int, int], list[dict]] = {c: [] for c in configs}
    for r in range(rounds):
        for kind, b, t in configs if r % 2 == 0 else configs[::-1]:
            w = run_child(["loader", kind, str(b), "1", repr(seconds), str(t)])
            windows[kind, b, t].append({k: w[k] for k in keys})
            print(
                f"round {r + 1}/{rounds}: {_label(kind, b, t)}: {w['cells_per_s']:,.0f} cells/s", flush=True
            )
    rows = []
    for kind, b, t in configs:
        row = {"label": _label(kind, b, t), "kind": kind, "batch_size": b, "num_threads": t}
        rows.append({**row, **medians(windows[kind, b, t], keys)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


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


def kernel_rounds(rounds: int, seconds: float, baseline: str | None) -> tuple[dict, dict | None]:
    """µs per cell of each output's kernel (`child_kernels`), one fresh process per round; with a
    ``baseline`` checkout its rounds alternate with this tree's (every other pair in reverse
    order), so that the machine's drift over the minutes of the run falls on both alike."""
    trees = [None] if baseline is None else [None, baseline]
    runs: dict = {tree: [] for tree in trees}
    for r in range(rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            runs[tree].append(run_child(["kernels", "4096", "1", repr(seconds)], pythonpath=tree))

    def merged(per_round: list[dict]) -> dict:
        out = {}
        for kind in KERNEL_KINDS:
            out[kind] = statistics.median(r[kind] for r in per_round)
            out[f"{kind}_runs"] = [r[kind] for r in per_round]
        return out

    return merged(runs[None]), merged(runs[baseline]) if baseline else None


def run_slaf(tokenizer: str, batch_size: int, rounds: int, seconds: float) -> dict:
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
            "--seconds",
            repr(seconds),
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


def _label(kind: str, b: int, t: int) -> str:
    return f"omicsio {kind} b{b} ReadOptions(num_threads={t})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    add_window_options(p)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    p.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[1],
        help="make_loader's ReadOptions(num_threads=...) settings",
    )
    p.add_argument("--baseline", help="a checkout of omicsio_jax before the statistics, for materialize A/B")
    p.add_argument(
        "--kernel-baseline", help="a checkout of omicsio_jax whose token kernels to time beside these"
    )
    p.add_argument("--out", default=str(HERE / "results" / "tokens.json"))
    args = p.parse_args()
    if args.child:
        what, *rest = args.child
        if what == "loader":
            result = child_loader(rest[0], int(rest[1]), int(rest[2]), float(rest[3]), int(rest[4]))
        elif what == "kernels":
            result = child_kernels(int(rest[0]), int(rest[1]), float(rest[2]))
        else:
            result = child_materialize(rest[0])
        print(json.dumps(result))
        return
    check_window(args)
    kernel_baseline_commit = baseline_commit(args.kernel_baseline) if args.kernel_baseline else None
    ensure_data()
    configs = [
        (kind, b, t)
        for b in args.batch_sizes
        for kind in ("csr", "geneformer", "scgpt")
        for t in args.threads
    ]
    rows = loader_rounds(configs, args.rounds, args.seconds)
    if not SLAF_PYTHON.exists():
        print(f"no SLAF rows: {SLAF_PYTHON} is missing (scripts/setup-slaf.sh makes it)", flush=True)
    for b in args.batch_sizes:
        if SLAF_PYTHON.exists():
            for tokenizer in ("geneformer", "scgpt"):
                r = run_slaf(tokenizer, b, args.rounds, args.seconds)
                rows.append(
                    {"label": f"slaf {tokenizer} b{b}", "kind": f"slaf-{tokenizer}", "batch_size": b, **r}
                )
                print(json.dumps(rows[-1]), flush=True)
    kernels, kernels_baseline = kernel_rounds(args.rounds, args.seconds, args.kernel_baseline)
    print(json.dumps({"kernel_us_per_cell": kernels}), flush=True)
    if args.kernel_baseline:
        print(json.dumps({"kernel_us_per_cell_baseline": kernels_baseline}), flush=True)
    mat = {"with_stats": materialize_rounds(str(DATA / "tmp_mat_new"), args.rounds)}
    if args.baseline:
        mat["before_stats"] = materialize_rounds(
            str(DATA / "tmp_mat_old"), args.rounds, pythonpath=args.baseline
        )
    print(json.dumps({"materialize": mat}), flush=True)
    ratios = {
        "geneformer kernel: a median per gene (geneformer-dictionary) vs the corpus medians": (
            kernels["geneformer-dictionary"] / kernels["geneformer"]
        ),
        "geneformer-dictionary kernel: time vs csr's": kernels["geneformer-dictionary"] / kernels["csr"],
    }
    by = {(r["kind"], r["batch_size"], r.get("num_threads")): r["cells_per_s"] for r in rows}
    best: dict[tuple[str, int], dict] = {}  # (kind, batch) -> the row of the fastest setting
    for r in rows:
        key = (r["kind"], r["batch_size"])
        if key not in best or r["cells_per_s"] > best[key]["cells_per_s"]:
            best[key] = r
    comparisons = []
    for b in args.batch_sizes:
        for kind in ("geneformer", "scgpt"):
            for t in args.threads:
                ratios[f"{kind} b{b} ReadOptions(num_threads={t}): time vs csr"] = (
                    by[("csr", b, t)] / by[(kind, b, t)]
                )
            ratios[f"{kind} b{b} best setting: time vs csr's best"] = (
                best["csr", b]["cells_per_s"] / best[kind, b]["cells_per_s"]
            )
            peer = best.get((f"slaf-{kind}", b))
            if peer:
                ratios[f"{kind} b{b}: speed vs SLAF (best setting)"] = (
                    best[kind, b]["cells_per_s"] / peer["cells_per_s"]
                )
                comparisons.append(
                    compare(f"{kind} tokens b{b} (best setting): omicsio ÷ SLAF", best[kind, b], peer)
                )
    result = {
        "benchmark": "bench_tokens",
        **provenance(),
        "rounds": args.rounds,
        "window_s": args.seconds,
        "quick": args.quick,
        "cells": 50_000,
        "rows": rows,
        "comparisons": [c for c in comparisons if c],
        "kernel_us_per_cell": kernels,
        "materialize": mat,
        "ratios": ratios,
    }
    if args.kernel_baseline:
        result["kernel_us_per_cell_baseline"] = kernels_baseline
        result["kernel_baseline_commit"] = kernel_baseline_commit
        for kind in KERNEL_KINDS:
            ratios[f"{kind} kernel: time vs {kernel_baseline_commit[:7]}'s"] = (
                kernels[kind] / kernels_baseline[kind]
            )
    write_result(args.out, result, quick=args.quick)
    print(json.dumps(ratios, indent=1))


if __name__ == "__main__":
    main()

"""`make_loader`'s decoding threads: each output kind and batch size with the consumer decoding
(``num_threads=0``) against threads decoding ahead (half the cores for slabs, every core up to 8 for
rows built on the host), on this machine's cores.

The figures `default_num_threads` and `default_decode_threads` choose from. For each output
(``csr`` slabs, ``dense`` rows, a ``panel`` of the 2,000 genes detected in most cells, Geneformer
tokens), batch size and ``ReadOptions(num_threads=...)`` setting, a fresh process runs
`make_loader` on the 200k-cell dataset (``Block(16, 64)``, its default sampling) and times a
window of at least ``--seconds`` after a warm-up; the settings take turns, ``--rounds`` times, and
each figure is the median. Where the consumer decodes (``num_threads=0``), the numba threads per
batch are compared too, for every row output (dense, panel) and batch size: the default's against
one where it splits a batch over the cores, else against every core (on 2 cores a dense batch of
64 is decoded on one thread; the split is timed beside it). Reported per row: cells/s and cells per
CPU-second (every thread of the process), the decode threads the row ran with, and the setting
`make_loader`'s default resolves to on this machine.

    .venv/bin/python benchmarks/bench_layout.py               # 3 rounds of 10 s: ~16 minutes
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent
DATASET = HERE / "data" / "ds_200k"
sys.path.insert(0, str(HERE))
from _provenance import add_window_options, check_window, loader_windows, medians, provenance, write_result  # noqa: E402

# (output, batch sizes): dense rows and slabs at the sizes the README quotes, tokens at scDataset's
CASES = (
    ("csr", (64, 256, 1024)),
    ("dense", (64, 256, 1024)),
    ("panel", (64,)),
    ("geneformer", (64, 256)),
)
CORPUS = HERE / "data" / "corpus_200k"  # the dataset's parquet: the panel's genes (`top_genes`)
PANEL_GENES = 2000


def _output(kind: str):
    import omicsio_jax as oj

    if kind == "panel":
        from bench_loader import top_genes

        return oj.Panel(top_genes(CORPUS, PANEL_GENES))
    return {"csr": oj.CSR(), "dense": oj.Dense(), "geneformer": oj.GeneformerTokens(max_len=2048)}[kind]


def child(kind: str, batch_size: int, num_threads: int, decode_threads: int | None, seconds: float) -> dict:
    """One window of `make_loader` with ``num_threads`` decoding threads ahead and ``decode_threads``
    numba threads per batch (None: the default's), after a warm-up."""
    import omicsio_jax as oj

    ds = oj.open_dataset(DATASET)
    loader = oj.make_loader(
        ds,
        batch_size=batch_size,
        output=_output(kind),
        num_epochs=None,
        read=oj.ReadOptions(num_threads=num_threads, decode_threads=decode_threads),
    )
    (timed,) = loader_windows(loader, batch_size, seconds=seconds)
    loader.close()
    return {**timed, "decode_threads": loader.decode_threads}


def run_child(
    kind: str, batch_size: int, num_threads: int, decode_threads: int | None, seconds: float
) -> dict:
    decode = "default" if decode_threads is None else str(decode_threads)
    proc = subprocess.run(
        [sys.executable, __file__, "--child", kind, str(batch_size), str(num_threads), decode, repr(seconds)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    add_window_options(p)
    p.add_argument("--out", default=str(HERE / "results" / "layout.json"))
    args = p.parse_args()
    if args.child:
        kind, b, t, decode, seconds = args.child
        print(
            json.dumps(
                child(kind, int(b), int(t), None if decode == "default" else int(decode), float(seconds))
            )
        )
        return
    check_window(args)
    if not (DATASET / "manifest.json").exists():
        raise SystemExit(
            f"{DATASET} is missing: make it with benchmarks/bench_loader.py (see benchmarks/README.md)"
        )
    import omicsio_jax as oj
    from omicsio_jax.loaders.options import (
        MAX_DEFAULT_THREADS,
        ahead_threads,
        default_decode_threads,
        default_num_threads,
        usable_cores,
    )

    cores = usable_cores()
    genes = oj.open_dataset(DATASET).num_genes
    widths = {"dense": genes, "panel": PANEL_GENES}  # float32 columns of a host batch's rows

    def decode_default(kind: str, b: int, t: int) -> int:
        return default_decode_threads(_decoding(kind), t, b * widths.get(kind, 0) * 4, cores)

    # the consumer decoding (0) against the threads the rule gives on more than 2 cores: half of
    # them for slabs, every one (up to 8) for rows built on the host; with the consumer decoding,
    # the default's numba threads per batch against the other choice (one, or every core)
    settings = [
        (kind, b, t, None) for kind, sizes in CASES for b in sizes for t in (0, ahead_threads(kind, cores))
    ]
    settings += [
        (kind, b, 0, 1 if decode_default(kind, b, 0) > 1 else min(cores, MAX_DEFAULT_THREADS))
        for kind, sizes in CASES
        if kind in widths and cores > 1
        for b in sizes
    ]
    runs: dict[tuple, list[dict]] = {s: [] for s in settings}
    for r in range(args.rounds):  # round-robin: every setting once per round
        for s in settings:
            runs[s].append(run_child(*s, args.seconds))
            print(f"round {r + 1}: {_label(*s)}: {runs[s][-1]['cells_per_s']:,.0f} cells/s", flush=True)
    rows = []
    for kind, b, t, d in settings:
        default = default_num_threads(_decoding(kind), cores, batch_size=b)
        rows.append(
            {
                "label": _label(kind, b, t, d),
                "kind": kind,
                "batch_size": b,
                "num_threads": t,
                "decode_threads": runs[kind, b, t, d][0]["decode_threads"],
                "is_default": t == default and d is None,
                **medians(runs[kind, b, t, d], ("cells_per_s", "cells_per_cpu_s", "seconds", "cpu_per_wall")),
            }
        )
    best, default = {}, {}  # (kind, batch) -> the fastest row, the default's row
    for row in rows:
        key = (row["kind"], row["batch_size"])
        if key not in best or row["cells_per_s"] > best[key]["cells_per_s"]:
            best[key] = row
        if row["is_default"]:
            default[key] = row
    summary = {
        f"{kind} b{b}": {
            "default": row["num_threads"],
            "default decode_threads": row["decode_threads"],
            "fastest": best[kind, b]["num_threads"],
            "fastest decode_threads": best[kind, b]["decode_threads"],
            "default / fastest cells/s": row["cells_per_s"] / best[kind, b]["cells_per_s"],
        }
        for (kind, b), row in default.items()
    }
    result = {
        "benchmark": "bench_layout",
        **provenance(),
        "rounds": args.rounds,
        "window_s": args.seconds,
        "quick": args.quick,
        "dataset": str(DATASET.relative_to(ROOT)),
        "cores": cores,
        "rows": rows,
        "summary": summary,
    }
    write_result(args.out, result, quick=args.quick)
    print(json.dumps(summary, indent=1))


def _decoding(kind: str) -> str:
    """The output kind the thread defaults take a case for: a panel is a dense output over fewer columns."""
    return "dense" if kind == "panel" else kind


def _label(kind: str, b: int, t: int, d: int | None) -> str:
    """A row's label: the `ReadOptions` it ran with (its decode threads where given)."""
    decode = "" if d is None else f", decode_threads={d}"
    return f"{kind} b{b} ReadOptions(num_threads={t}{decode})"


if __name__ == "__main__":
    main()

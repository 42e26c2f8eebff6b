"""Partitioned materialize: throughput per worker and per core against the input-decode limit.

Every configuration runs as a fresh process restricted to a set of cores (``sched_setaffinity``,
inherited by its worker processes), round-robin over ``--repeats`` rounds (every other round in
reverse order), on the same corpus:

- ``decode``: the parquet input-decode limit — pyarrow delivering the list columns (``cell_id``,
  ``gene_token_id``, ``gene_expression``) as CSR batches, nothing encoded, on one core, the file
  read without pre-buffering and in materialize's batches (``cells_per_batch``: by its row width),
  as materialize reads plain local parquet; and DuckDB delivering the same in batches of 8,192
  cells (how it reads every other table input). Whole passes over the file, after the imports
  and numba's start, until at least 10 s have passed. Reported as CPU-seconds per 10^5 cells and
  cells/s per core.
- ``decode pyarrow ×N at once`` (N: the largest worker count): N copies of the pyarrow decode, one
  pinned to each of N cores, started together; their summed cells/s ÷ one copy's is what the
  machine itself gives N single-threaded processes (cores that share a physical core or memory
  bandwidth give less than N), which the materialize speedups are set against.
- ``materialize --workers N`` on N cores (N = 1, 2, … up to the machine's cores), each worker one
  partition at a time; the 1 → N speedup and materialize's cells/s per core as a fraction of the
  decode limit's. With ``--weak``, N workers convert N copies of the corpus (a glob over N links to
  its file, the gene table beside them), so that every worker writes the same partitions at every
  N, as on an atlas of many partitions per worker (the copies' cell ids repeat; nothing checks
  that a primary modality's ids are unique). Without it, N workers share the one corpus, and at
  16 workers each writes one partition: the run is then mostly its fixed costs (the workers'
  start, the finalizer's tail).
- ``materialize --workers 1 --no-stats`` on one core: the same without the corpus statistics, so
  that the fraction of the limit is reported with and without them, and what they cost on top.
- ``materialize --workers 1 --no-stats --compression uncompressed`` on one core: the same with
  shards stored uncompressed, so that what the default compression (``zstd:-1``) costs a core is
  reported beside the rest.
- ``materialize`` with its defaults on every core (what a user runs), for reference.
- Two parts of a conversion timed alone on one core, to say where its time goes: ``decode +
  encode`` (the decode above, then each batch encoded into records by `codec.encode_csr` on one
  numba thread, into a reused buffer), and ``write`` (the records of the corpus's first two
  shards, encoded once before the clock, written into shards as materialize's writer does: each
  record copied out of the batch's buffer, ArrayRecord with the default layout's options, each
  finished file's sha256). With the decode they price what a conversion cannot avoid; the summary
  gives each part's CPU-seconds per 10^5 cells, what the conversion spends besides them, and the
  fraction of the decode limit a conversion would reach if it spent nothing else.
- With ``--baseline CHECKOUT`` (a git worktree of another commit): that checkout's ``--workers 1``
  conversions, with and without statistics, and with the largest ``--workers``, in the same rounds,
  and this commit's cells/s ÷ its.

A round times whole decodes or conversions, repeated until at least 10 s have passed (a conversion on
16 cores takes a second or two); ``window_s`` records how long a round took (the median, and every
round's), ``cpu_s_per_1e5_cells`` the CPU time of the conversions alone (the worker processes'
included, the child's imports not).

    python benchmarks/bench_scale.py --cells 200000 --shard-cells 16384 --repeats 3
    python benchmarks/bench_scale.py --cells 131072 --shard-cells 8192 --workers 1 2 4 8 16  # 16 cores
    python benchmarks/bench_scale.py --cells 131072 --shard-cells 8192 --workers 1 2 4 8 16 --weak --readers pyarrow

Partitions are shards: with ``--shard-cells 16384`` a 200k-cell corpus has 13 of them, enough to
keep two workers busy to the end (at the default 65,536 it would have 4, and the last holds
3,392 cells). On 16 cores, 131,072 cells in shards of 8,192 (the corpus's row group: a partition
decodes no row group twice) give each of 1, 2, 4, 8 and 16 workers the same number of equal
partitions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _provenance import (  # noqa: E402
    MIN_WINDOW_S,
    add_window_options,
    baseline_commit,
    check_window,
    provenance,
    run_json,
    write_result,
)

UNCOMPRESSED = "uncompressed"  # the ArrayRecord compression of the row that prices the default's

_DECODE = """
import json, os, resource, sys, time
os.sched_setaffinity(0, {0})
kind, path, window = sys.argv[1], sys.argv[2], float(sys.argv[3])
import pyarrow as pa
from omicsio_jax.format.arrow import list_to_csr
if kind == "duckdb":
    import duckdb
    con = duckdb.connect()
    con.execute("SET threads = 1")
    con.execute("SET preserve_insertion_order = true")
    def batches():
        return con.sql(f"SELECT cell_id, gene_token_id, gene_expression FROM read_parquet('{path}')").to_arrow_reader(8192)
else:
    import pyarrow.parquet as pq
    pa.set_cpu_count(1); pa.set_io_thread_count(1)
    from materialize import cells_per_batch
    batch_cells = cells_per_batch(pq.read_metadata(path), "gene_token_id")  # as materialize reads the file

    def batches():
        return pq.ParquetFile(path, pre_buffer=False).iter_batches(batch_size=batch_cells, columns=["cell_id", "gene_token_id", "gene_expression"],
                                                 use_threads=False)
list_to_csr(pa.chunked_array([pa.array([[1, 2]], pa.list_(pa.int32()))]))  # numba's start, before the clock
encode = kind == "pyarrow+encode"  # each batch also encoded into records, on one numba thread
if encode:
    import numba
    import numpy as np
    from omicsio_jax.format.codec import encode_csr
    numba.set_num_threads(1)
    genes = pq.read_table(os.path.join(os.path.dirname(path), "gene_metadata.parquet"), columns=["gene_token_id"])
    token_to_col = np.arange(int(genes.column(0).to_numpy().max()) + 1, dtype=np.int32)
    buf = np.empty(1, np.uint8)

    def out(nbytes):  # one buffer, grown when a batch needs more (as materialize's shard slots)
        global buf
        if len(buf) < nbytes:
            buf = np.empty(nbytes, np.uint8)
        return buf[:nbytes]

    encode_csr(np.array([0, 1]), np.array([1], np.int32), np.array([1.0], np.float32), token_to_col=token_to_col,
               allow_negative=False, out=out)  # its compile, before the clock
start, cpu0 = time.perf_counter(), time.process_time()
cells = passes = 0
while passes == 0 or time.perf_counter() - start < window:  # whole passes over the file, at least the window
    for rb in batches():
        indptr, tokens = list_to_csr(rb.column(1)); _, values = list_to_csr(rb.column(2)); cells += rb.num_rows
        if encode:
            encode_csr(indptr, tokens.to_numpy(), values.to_numpy(), token_to_col=token_to_col, allow_negative=False,
                       out=out)
    passes += 1
print(json.dumps({"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu0, "cells": cells,
                  "passes": passes}))
"""

_WRITE = """
import hashlib, json, os, shutil, sys, tempfile, time
os.sched_setaffinity(0, {0})
path, window, shard_cells, options = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from array_record.python.array_record_module import ArrayRecordWriter
from omicsio_jax.format.arrow import list_to_csr
from omicsio_jax.format.codec import encode_csr
genes = pq.read_table(os.path.join(os.path.dirname(path), "gene_metadata.parquet"), columns=["gene_token_id"])
token_to_col = np.arange(int(genes.column(0).to_numpy().max()) + 1, dtype=np.int32)
rows = pq.ParquetFile(path).iter_batches(batch_size=2 * shard_cells, columns=["gene_token_id", "gene_expression"])
rb = next(rows)  # two shards' cells, encoded once before the clock
indptr, tokens = list_to_csr(rb.column(0)); _, values = list_to_csr(rb.column(1))
buf, starts = encode_csr(indptr, tokens.to_numpy(), values.to_numpy(), token_to_col=token_to_col, allow_negative=False)
view = memoryview(buf)
folder = tempfile.mkdtemp(dir=sys.argv[5])
start, cpu0 = time.perf_counter(), time.process_time()
cells = shards = 0
while shards < 2 or time.perf_counter() - start < window:
    first = (shards % 2) * shard_cells
    name = os.path.join(folder, f"shard-{shards % 2}.arrayrecord")
    writer = ArrayRecordWriter(name, options)
    for i in range(first, first + shard_cells):  # as materialize's writer: each record a bytes copy
        writer.write(bytes(view[starts[i]:starts[i + 1]]))
    writer.close()
    with open(name, "rb") as f:
        hashlib.file_digest(f, "sha256").hexdigest()
    cells += shard_cells
    shards += 1
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu0
shutil.rmtree(folder)
print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "cells": cells, "shards": shards}))
"""

_MATERIALIZE = """
import json, os, resource, shutil, sys, time
cores = json.loads(sys.argv[4])
if cores:
    os.sched_setaffinity(0, cores)
from materialize import Layout, materialize
workers = None if sys.argv[3] == "default" else int(sys.argv[3])
window = float(sys.argv[7])

def cpu():
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

seconds = cpu_seconds = 0.0
cells = conversions = 0
while conversions == 0 or seconds < window:  # whole conversions, at least the window
    shutil.rmtree(sys.argv[2], ignore_errors=True)
    start, cpu0 = time.perf_counter(), cpu()
    compression = {} if sys.argv[8] == "default" else {"compression": sys.argv[8]}
    layout = Layout(shard_cells=int(sys.argv[5]), **compression)
    result = materialize(sys.argv[1], sys.argv[2], workers=workers, layout=layout,
                         stats=sys.argv[6] == "stats", progress=False)
    seconds += time.perf_counter() - start
    cpu_seconds += cpu() - cpu0
    cells += result.manifest.num_cells
    conversions += 1
children = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"seconds": seconds, "cells": cells, "conversions": conversions, "workers": result.workers,
                  "partitions": result.partitions, "cpu_seconds": cpu_seconds,
                  "peak_rss_mib": next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 1024,
                  "largest_child_rss_mib": children.ru_maxrss / 1024}))
"""


def _run(code: str, *args, checkout: str | None = None) -> dict:
    """``code`` in a fresh process (`run_json`; ``checkout``: a ``--baseline``)."""
    return run_json(["-c", code, *map(str, args)], checkout=checkout)


def _run_together(code: str, args_per_process: list[tuple]) -> list[dict]:
    """``code`` in one fresh process per argument tuple, all started before any is waited for."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, *map(str, a)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for a in args_per_process
    ]
    outs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode:
            raise RuntimeError(err[-3000:])
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def _result(runs: dict[str, list[dict]], rounds: int, counts: list[int], args, parquet: Path) -> dict:
    """The results file's contents from the runs of the first ``rounds`` rounds."""
    runs = {label: rs[:rounds] for label, rs in runs.items()}
    rows = {}
    for label, rs in runs.items():
        rows[label] = {
            "label": label,
            "cells_per_s": statistics.median(r["cells_per_s"] for r in rs),
            "cells_per_s_runs": [r["cells_per_s"] for r in rs],
            "window_s": statistics.median(r["seconds"] for r in rs),
            "window_s_runs": [r["seconds"] for r in rs],
            "cpu_s_per_1e5_cells": statistics.median(r["cpu_seconds"] / r["cells"] * 1e5 for r in rs),
            **{k: v for k, v in rs[0].items() if k in ("workers", "partitions", "copies", "input_cells")},
            **(
                {
                    "peak_rss_mib": max(r["peak_rss_mib"] for r in rs),
                    "largest_child_rss_mib": max(r["largest_child_rss_mib"] for r in rs),
                }
                if "peak_rss_mib" in rs[0]
                else {}
            ),
        }
    one = rows["materialize 1 worker(s)"]["cells_per_s"]
    lean = rows["materialize 1 worker(s), no stats"]["cells_per_s"]
    raw = rows.get(f"materialize 1 worker(s), no stats, {UNCOMPRESSED}", {}).get("cells_per_s")
    summary = {
        f"speedup 1 -> {n} workers": rows[f"materialize {n} worker(s)"]["cells_per_s"] / one
        for n in counts
        if n > 1
    }
    for reader in args.readers:  # pyarrow: what materialize reads plain local parquet with
        decode = rows[f"decode {reader}"]["cells_per_s"]
        summary[f"materialize per core / decode limit per core ({reader})"] = one / decode
        summary[f"materialize without statistics per core / decode limit per core ({reader})"] = lean / decode
        summary[f"decode limit cells/s per core ({reader})"] = decode
        if raw is not None:
            summary[
                f"materialize without statistics, shards uncompressed, per core / decode limit per core ({reader})"
            ] = raw / decode
    summary["statistics cost on one core (time with ÷ time without - 1)"] = lean / one - 1
    if raw is not None:
        summary["compression cost on one core without statistics (time zstd:-1 ÷ time uncompressed - 1)"] = (
            raw / lean - 1
        )
    encode, write = rows.get("decode + encode (one core)"), rows.get("write (one core)")
    if encode is not None and write is not None:  # where a one-core conversion's CPU goes
        cpu = {label: rows[label]["cpu_s_per_1e5_cells"] for label in rows}
        decode_cpu = cpu["decode pyarrow"]
        parts = cpu["decode + encode (one core)"] + cpu["write (one core)"]
        lean_cpu = cpu["materialize 1 worker(s), no stats"]
        summary["CPU-s per 1e5 cells: decode (pyarrow)"] = decode_cpu
        summary["CPU-s per 1e5 cells: encode"] = cpu["decode + encode (one core)"] - decode_cpu
        summary["CPU-s per 1e5 cells: write (records to shards, sha256)"] = cpu["write (one core)"]
        summary["CPU-s per 1e5 cells: materialize without statistics, besides those parts"] = lean_cpu - parts
        summary["decode limit ÷ (decode + encode + write): the most a conversion could reach"] = (
            decode_cpu / parts
        )
    copies = next((label for label in rows if label.startswith("decode pyarrow ×")), None)
    if copies is not None:
        n = rows[copies]["copies"]
        machine = rows[copies]["cells_per_s"] / rows["decode pyarrow"]["cells_per_s"]
        summary[f"machine: {n} decodes at once ÷ one"] = machine
        if f"materialize {n} worker(s)" in rows:
            speedup = rows[f"materialize {n} worker(s)"]["cells_per_s"] / one
            summary[f"materialize 1 -> {n} workers ÷ linear ({n})"] = speedup / n
            summary[f"materialize 1 -> {n} workers ÷ the machine's {n} decodes at once"] = speedup / machine
    if args.baseline is not None:  # the same configurations of the baseline checkout, in the same rounds
        sha = args.baseline_commit[:7]
        base_one = rows[f"materialize 1 worker(s) @ {sha}"]["cells_per_s"]
        base_lean = rows[f"materialize 1 worker(s), no stats @ {sha}"]["cells_per_s"]
        summary[f"materialize 1 worker(s): this commit ÷ {sha}"] = one / base_one
        summary[f"materialize 1 worker(s), no stats: this commit ÷ {sha}"] = lean / base_lean
        summary[f"statistics cost on one core at {sha}"] = base_lean / base_one - 1
        if max(counts) > 1:
            n = max(counts)
            summary[f"materialize {n} worker(s): this commit ÷ {sha}"] = (
                rows[f"materialize {n} worker(s)"]["cells_per_s"]
                / rows[f"materialize {n} worker(s) @ {sha}"]["cells_per_s"]
            )
    result = {
        "benchmark": "bench_scale",
        **provenance(),
        "rounds": rounds,
        **({} if rounds == args.repeats else {"rounds_asked": args.repeats}),
        "window": f"whole decodes or conversions per round, at least {1.0 if args.quick else MIN_WINDOW_S:g} s (window_s: its seconds)",
        "quick": args.quick,
        "input": _shown(parquet),
        "scaling": "weak: N workers convert N copies of the input" if args.weak else "strong: one input",
        **(
            {}
            if args.baseline is None
            else {"baseline": {"checkout": args.baseline, "commit": args.baseline_commit}}
        ),
        "rows": rows,
        "summary": summary,
    }
    return result


def main() -> None:
    from bench_materialize import corpus_dir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", type=int, default=200_000)
    p.add_argument("--shard-cells", type=int, default=16_384)
    add_window_options(p, seconds=None, rounds_flag="--repeats")
    p.add_argument("--workers", type=int, nargs="+", default=None, help="worker counts (default 1..cores)")
    p.add_argument(
        "--weak",
        action="store_true",
        help="N workers convert N copies of the corpus (the same partitions per worker at every N)",
    )
    p.add_argument(
        "--readers",
        nargs="+",
        choices=("pyarrow", "duckdb"),
        default=["duckdb", "pyarrow"],
        help="decode limits to measure (pyarrow: how materialize reads plain local parquet)",
    )
    p.add_argument("--out", default=str(HERE / "results" / "scale.json"))
    p.add_argument(
        "--baseline",
        default=None,
        help="a checkout (git worktree) of another commit: its 1-worker conversions, with and without "
        "statistics, run in the same rounds, and the summary gives this commit's cells/s ÷ its",
    )
    args = p.parse_args()
    if args.baseline is not None:
        args.baseline = str(Path(args.baseline).resolve())
        args.baseline_commit = baseline_commit(args.baseline)  # not a checkout: fails here, before anything
    check_window(args, rounds_attr="repeats", rounds_flag="--repeats")
    cores = sorted(os.sched_getaffinity(0))
    counts = args.workers or list(range(1, len(cores) + 1))
    if "pyarrow" not in args.readers:  # before a corpus is made for nothing
        p.error("--readers must include pyarrow (the machine's row and the summary set against it)")
    parquet = (corpus_dir(args.cells, h5ad=False) / "cells.parquet").resolve()
    configs = (
        [("decode", reader) for reader in args.readers]
        + ([("decode copies", max(counts))] if max(counts) > 1 else [])
        + [("workers", n) for n in counts]
        + [("no stats", 1), ("uncompressed", 1), ("part", "decode + encode"), ("part", "write")]
        + ([] if args.weak else [("default", 0)])
        + (
            []
            if args.baseline is None
            else [("baseline", ("stats", 1)), ("baseline", ("no stats", 1))]
            + ([("baseline", ("stats", max(counts)))] if max(counts) > 1 else [])
        )
    )
    runs: dict[str, list[dict]] = {}
    window = 1.0 if args.quick else MIN_WINDOW_S  # --quick: a smoke run
    with tempfile.TemporaryDirectory(dir=HERE / "data") as tmp:
        out = Path(tmp).resolve() / "out"

        def source(workers: int | str) -> str:
            """The input of ``workers``: the corpus, or with ``--weak`` that many copies of it."""
            if not args.weak or workers == 1:  # --weak has no "default" configuration
                return str(parquet)
            copies = Path(tmp).resolve() / f"copies_{workers}"
            if not copies.exists():
                copies.mkdir()
                (copies / "gene_metadata.parquet").symlink_to(parquet.parent / "gene_metadata.parquet")
                for k in range(workers):
                    (copies / f"cells_{k:03d}.parquet").symlink_to(parquet)
            return str(copies / "cells_*.parquet")

        def convert(
            workers: int | str,
            stats: str,
            seconds: float,
            checkout: str | None = None,
            compression: str = "default",
        ) -> dict:
            """Conversions of ``workers`` (pinned to as many cores; "default": not pinned) for ``seconds``."""
            shutil.rmtree(out, ignore_errors=True)
            pinned = [] if workers == "default" else cores[:workers]
            result = _run(_MATERIALIZE, source(workers), out, workers, json.dumps(pinned), args.shard_cells, stats,
                          seconds, compression, checkout=checkout)  # fmt: skip
            result["input_cells"] = result["cells"] // result["conversions"]
            return result

        for checkout in [None] + ([] if args.baseline is None else [args.baseline]):
            # one conversion per checkout first, not timed: numba compiles into a fresh checkout's cache
            convert(1, "stats", 0.0, checkout)
        for round_ in range(args.repeats):
            # every other round backwards: a run's effect on the next (page cache, memory freed by the
            # deletion of its output) does not always fall on the same configuration
            for kind, value in configs if round_ % 2 == 0 else configs[::-1]:
                if kind == "decode":
                    label = f"decode {value}"
                    result = _run(_DECODE.replace("{0}", f"{{{cores[0]}}}"), value, parquet, window)
                elif kind == "decode copies":
                    label = f"decode pyarrow ×{value} at once"
                    together = _run_together(
                        _DECODE.replace("{0}", "{int(sys.argv[4])}"),
                        [("pyarrow", parquet, window, core) for core in cores[:value]],
                    )
                    result = {
                        "cells": sum(r["cells"] for r in together),
                        "seconds": max(r["seconds"] for r in together),
                        "cpu_seconds": sum(r["cpu_seconds"] for r in together),
                        "copies": value,
                        # each copy's own rate, summed: they do not end together
                        "cells_per_s": sum(r["cells"] / r["seconds"] for r in together),
                    }
                elif kind == "part":
                    label = f"{value} (one core)"
                    pin = f"{{{cores[0]}}}"
                    if value == "write":
                        from materialize import Layout

                        result = _run(
                            _WRITE.replace("{0}", pin),
                            parquet,
                            window,
                            args.shard_cells,
                            Layout().writer_options,
                            tmp,
                        )
                    else:
                        result = _run(_DECODE.replace("{0}", pin), "pyarrow+encode", parquet, window)
                elif kind == "baseline":
                    stats, n = value
                    label = (
                        f"materialize {n} worker(s){', no stats' if stats == 'no stats' else ''} "
                        f"@ {args.baseline_commit[:7]}"
                    )
                    result = convert(n, stats, window, args.baseline)
                else:
                    label = {
                        "default": "materialize default",
                        "no stats": f"materialize {value} worker(s), no stats",
                        "uncompressed": f"materialize {value} worker(s), no stats, {UNCOMPRESSED}",
                    }.get(kind, f"materialize {value} worker(s)")
                    result = convert(
                        "default" if kind == "default" else value,
                        "no stats" if kind in ("no stats", "uncompressed") else "stats",
                        window,
                        compression=UNCOMPRESSED if kind == "uncompressed" else "default",
                    )
                result.setdefault("cells_per_s", result["cells"] / result["seconds"])
                runs.setdefault(label, []).append(result)
                print(
                    f"round {round_ + 1}: {label:24s} {result['cells_per_s']:9,.0f} cells/s "
                    f"({result['cpu_seconds']:.1f} CPU-s in {result['seconds']:.1f} s)",
                    flush=True,
                )
            if round_ + 1 < args.repeats:  # a run cut short keeps the rounds it finished
                write_result(args.out, _result(runs, round_ + 1, counts, args, parquet), quick=args.quick)
    result = _result(runs, args.repeats, counts, args, parquet)
    print(json.dumps(result["summary"], indent=1))
    write_result(args.out, result, quick=args.quick)


def _shown(path: Path) -> str:
    """``path`` as the results file names it: relative to benchmarks/ where it lies there (a linked
    data folder resolves elsewhere: then the path as it is)."""
    try:
        return str(path.relative_to(HERE.resolve()))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    main()

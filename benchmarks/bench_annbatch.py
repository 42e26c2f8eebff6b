"""omicsio_jax's loader against annbatch (scverse's on-disk loader), on the same cells, in one run.

Same 200k-cell × 62,710-gene corpus for both: omicsio_jax reads its dataset materialized from
``cells.parquet``; annbatch reads its own preshuffled zarr collection converted from ``cells.h5ad``
of the same cells by ``_annbatch_peer.py convert`` (annbatch's documented preprocessing; the
conversion holds the whole corpus in RAM, ~10 GB at 200k cells), run in ``.venv-annbatch``
(annbatch needs Python >= 3.12). Configurations, each run in a fresh process, every one ``--rounds``
times round-robin (a slow spell of the shared machine hits all of them), medians reported:

- omicsio_jax ``make_loader``: dense batches of 64 and 1,024 and csr batch 1,024, ``sampling=oj.Block(16, 64)``,
  its defaults otherwise (``read=oj.ReadOptions()``: the decoding threads of `default_num_threads`
  for the output kind and the machine's cores), and the
  same three with ``oj.ReadOptions(num_threads=0)`` (on the consumer's thread, when asked for) and
  ``oj.ReadOptions(num_threads=2)``; ``prefetch`` reads stay on their own threads in every case;
  ``obs=("batch",)``, ``num_epochs=None``, seed 0.
- annbatch ``Loader`` at its best documented setting (the peer's defaults: ``chunk_size=512,
  preload_nchunks=32``, ``RandomSampler``, ``drop_last``, zarrs codec pipeline; see the peer's
  docstring), ``--output dense`` (each CSR batch densified with scipy in the timed loop, as annbatch
  has no dense output for a sparse store) and ``--output csr``, with ``--label batch``.

Measured per process, after imports: ``cells_per_s`` = cells over the timed window of at least
``--seconds`` (``warmup`` batches discarded first); ``cells_per_cpu_s`` = cells divided by ``time.process_time()`` over the same
window (user + sys of every thread of the process); ``cpu_per_wall`` = cores kept busy;
``first_batch_s`` = seconds to the first batch ready, for omicsio_jax from the ``make_loader`` call
(``open_dataset`` done before the clock; its seconds are in ``open_s``), for annbatch from the
``DatasetCollection`` call (opening the stores included, see the peer); ``first_batch_from_spawn_s`` =
seconds from just before the parent starts the process to its first batch ready (``time.time()`` on
both sides: the interpreter's start, every import, opening and the first batch: what a training
script waits for); ``peak_rss_bytes`` = VmHWM of
the process; ``label_entropy_bits`` = mean over the timed minibatches of the plug-in Shannon entropy
(bits) of the obs label ``batch`` (the plate) within each minibatch, missing labels ignored (no
padding: ``drop_remainder``/``drop_last``), next to the population entropy and the true-random
expectation (``oj.entropy_bounds``'s upper bound). Both sides time a window of at least
``--seconds``; annbatch extends its window to the end of a load of 16,384 cells (``seconds`` and
``batches`` say what each timed). Also the one-off cost of each format: annbatch's conversion (seconds, peak RSS,
bytes; recorded next to the collection as ``<collection>.convert.json`` when made here) and
omicsio's ``materialize`` from ``results/materialize.json`` (its 200k-cell parquet row, when the
corpus has 200k cells), plus both on-disk sizes.

    scripts/setup-annbatch.sh       # .venv-annbatch: Python 3.12, annbatch 0.3.1 + zarrs
    .venv/bin/python benchmarks/bench_annbatch.py --rounds 3          # writes results/annbatch.json
    .venv/bin/python benchmarks/bench_annbatch.py --markdown          # re-print the table of --out

The corpus (200,000 cells, seed 0), our dataset and the collection are made on first use under
``benchmarks/data/`` (``corpus_200k``, ``ds_200k``, ``annbatch_200k``); ``--corpus``, ``--dataset``
and ``--collection`` point elsewhere, ``--quick`` is a smoke mode (a short window, 1 round, results
written to a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _provenance import (  # noqa: E402
    add_window_options,
    baseline_commit,
    check_window,
    compare,
    provenance,
    window,
    write_result,
)
from bench_loader import baseline_env, make_loader_either, peak_rss_bytes  # noqa: E402

DATA = HERE / "data"
ANNBATCH_PYTHON = ROOT / ".venv-annbatch" / "bin" / "python"
PEER = HERE / "_annbatch_peer.py"
LABEL = "batch"  # the plate: the obs column whose per-minibatch entropy both sides report
CONFIGS = (("dense", 64), ("dense", 1024), ("csr", 1024))  # (output, batch size) compared
THREADS = (None, 0, 2)  # ReadOptions(num_threads=...) of make_loader: its default (None) first
# also run at annbatch's own in-memory buffer (preload_nchunks 32 × chunk_size 512 = 16,384 cells): (threads, fetch_factor)
EXTRA = {("csr", 1024): ((None, 16), (0, 16))}
BLOCK_SIZE, FETCH_FACTOR = 16, 64
# batches before the timed window, both loaders: our first three fetches are read while the first batches are
# decoded (a pipeline fill at csr b1024), annbatch's first loads
WARMUP = {64: 256, 1024: 256}
QUICK_WARMUP = {64: 16, 1024: 8}


# ----- child: one omicsio_jax configuration -------------------------------------------------------
def _our_loader(
    dataset: str,
    *,
    batch_size: int,
    output: str,
    num_threads: int | None,
    seconds: float,
    warmup: int,
    block_size: int = BLOCK_SIZE,
    fetch_factor: int = FETCH_FACTOR,
    seed: int = 0,
    spawned_at: float | None = None,
) -> dict:
    """One fresh loader: first-batch latency, ``warmup`` batches (the first included), then a timed
    window of at least ``seconds``."""
    import jax

    import omicsio_jax as oj

    start = time.perf_counter()
    ds = oj.open_dataset(dataset)
    opened = time.perf_counter()
    loader = make_loader_either(
        oj,
        ds,
        batch_size=batch_size,
        block_size=block_size,
        fetch_factor=fetch_factor,
        output=output,
        obs=(LABEL,),
        seed=seed,
        num_threads=num_threads,
    )
    it = iter(loader)
    jax.block_until_ready(next(it))
    first_batch_s = time.perf_counter() - opened
    from_spawn_s = None if spawned_at is None else time.time() - spawned_at
    for _ in range(max(warmup, 1) - 1):
        jax.block_until_ready(next(it))
    labels = []

    def step() -> int:
        batch = next(it)
        jax.block_until_ready(batch)  # x, obs, index, mask
        labels.append(batch.obs[LABEL])  # a reference; read after the clock stops
        return batch_size

    timed = window(step, seconds=seconds)
    threads_used = getattr(loader, "num_threads", num_threads)  # what the default resolved to
    loader.close()
    entropy = oj.minibatch_entropy([np.asarray(x) for x in labels])  # codes; -1 (missing) ignored
    return {
        **timed.as_dict(),
        "first_batch_s": first_batch_s,
        "threads_used": threads_used,
        "open_s": opened - start,
        "first_batch_from_spawn_s": from_spawn_s,
        "label_entropy_bits": float(entropy.mean()),
        "num_cells": ds.num_cells,
        "num_genes": ds.num_genes,
        "omicsio_jax_version": oj.__version__,
        "jax_version": jax.__version__,
    }


def _child(spec: dict) -> dict:

    out = _our_loader(**spec["kwargs"], spawned_at=spec.get("spawned_at"))
    return {**spec, **out, "peak_rss_bytes": peak_rss_bytes()}


# ----- parent --------------------------------------------------------------------------------------
def _last_json(proc: subprocess.CompletedProcess) -> dict:
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit status {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(spec: dict) -> dict:
    """One round of one configuration in a fresh process: ours via ``--child``, annbatch via its peer."""
    if spec["kind"] == "ours":
        child = {**spec, "spawned_at": time.time()}
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(child)],
            capture_output=True,
            text=True,
            check=False,
            env=baseline_env(spec),
        )
        return {**spec, **_last_json(proc)}
    kw = spec["kwargs"]
    cmd = [
        str(ANNBATCH_PYTHON),
        str(PEER),
        "run",
        kw["collection"],
        "--output",
        kw["output"],
        "--batch-size",
        str(kw["batch_size"]),
        "--seconds",
        repr(kw["seconds"]),
        "--warmup",
        str(kw["warmup"]),
        "--rounds",
        "1",
        "--seed",
        str(kw["seed"]),
        "--label",
        LABEL,
    ]
    proc = subprocess.run(
        [*cmd, "--spawned-at", repr(time.time())], capture_output=True, text=True, check=False
    )
    out = _last_json(proc)
    if "error" not in out:  # the peer's figures of its single round
        out = {**out, "seconds": out["seconds_runs"][0], "cells": out["cells_runs"][0]}
        out["cpu_seconds"] = out["cells"] / out["cells_per_cpu_s"]
    return {**spec, **out}


FIELDS = (
    "cells_per_s",
    "seconds",
    "cells_per_cpu_s",
    "cpu_per_wall",
    "first_batch_s",
    "first_batch_from_spawn_s",
    "label_entropy_bits",
    "open_s",
)


def run_rounds(plan: list[tuple[str, dict]], rounds: int) -> list[dict]:
    """Every configuration ``rounds`` times, round-robin; per configuration every round's figures and
    their medians (peak RSS: the largest)."""
    runs: dict[str, list[dict]] = {label: [] for label, _ in plan}
    for r in range(rounds):
        for label, spec in plan:
            result = run({"label": label, **spec})
            runs[label].append(result)
            shown = (f"{result['cells_per_s']:>9,.0f} cells/s {result['cells_per_cpu_s']:>9,.0f} cells/CPU-s "
                     f"first {result['first_batch_s']:5.2f} s ({result['first_batch_from_spawn_s']:5.2f} from spawn)  RSS {result['peak_rss_bytes'] / 2**20:>6,.0f} MiB  "
                     f"H {result['label_entropy_bits']:.3f} bits" if "error" not in result
                     else f"ERROR {result['error']}")  # fmt: skip
            print(f"[round {r + 1}/{rounds}] {label:34s} {shown}", flush=True)
    rows = []
    for (label, spec), results in zip(plan, runs.values(), strict=True):
        ok = [x for x in results if "error" not in x]
        row = {
            "label": label,
            "kind": spec["kind"],
            **{k: v for k, v in spec["kwargs"].items()},
            "baseline": spec.get("baseline"),
            "rounds": len(results),
            "errors": [x["error"] for x in results if "error" in x],
        }
        if ok:
            fields = [k for k in FIELDS if all(k in x for x in ok)]  # open_s: ours only
            row.update({k: statistics.median(x[k] for x in ok) for k in fields})
            row.update({f"{k}_runs": [x[k] for x in ok] for k in fields})
            row["peak_rss_bytes"] = max(x["peak_rss_bytes"] for x in ok)
            row["batches"] = statistics.median_low(x["batches"] for x in ok)
            row["num_cells"] = ok[0]["num_cells"]
            row["runs"] = ok
            print(
                f"median of {len(ok)}: {label:34s} {row['cells_per_s']:>9,.0f} cells/s "
                f"(runs {', '.join(f'{v:,.0f}' for v in row['cells_per_s_runs'])})",
                flush=True,
            )
        rows.append(row)
    return rows


def _tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def ensure_data(corpus: Path, dataset: Path, collection: Path, seed: int) -> dict | None:
    """The corpus (200k cells, seed 0, as bench_loader makes it), our dataset from its parquet, and
    annbatch's collection from its h5ad; returns the collection's conversion figures if recorded."""
    from materialize import make_synthetic_corpus, materialize

    if not (corpus / "cells.h5ad").exists():
        print(f"generating a 200,000-cell corpus in {corpus} ...", flush=True)
        make_synthetic_corpus(corpus, num_cells=200_000, seed=0, progress=True)
    if not (dataset / "manifest.json").exists():
        print(f"materializing {corpus / 'cells.parquet'} -> {dataset} ...", flush=True)
        materialize(corpus / "cells.parquet", dataset, overwrite=True)
    record = collection.with_name(collection.name + ".convert.json")
    if not collection.exists():
        partial = collection.with_name(collection.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        h5ad = corpus / "cells.h5ad"
        print(
            f"converting {h5ad} -> {collection} with annbatch: it holds the whole corpus in RAM, with copies "
            f"(~10 GB at 200k cells; {_mem_available() / 2**30:.1f} GiB available now) ...",
            flush=True,
        )
        proc = subprocess.run([str(ANNBATCH_PYTHON), str(PEER), "convert", str(h5ad), str(partial), "--seed",
                               str(seed)], capture_output=True, text=True, check=False)  # fmt: skip
        if proc.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            raise SystemExit(
                f"annbatch conversion failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}"
            )
        conversion = json.loads(proc.stdout.strip().splitlines()[-1])
        partial.rename(collection)
        record.write_text(json.dumps(conversion, indent=1) + "\n")
        print(f"converted in {conversion['seconds']:.1f} s, peak RSS {conversion['peak_rss_bytes'] / 2**30:.2f} GiB, "
              f"{conversion['bytes_per_cell']:,.0f} B/cell", flush=True)  # fmt: skip
    if record.exists():
        return json.loads(record.read_text())
    print(
        f"note: {collection} exists but {record.name} does not: conversion figures not recorded", flush=True
    )
    return None


def our_materialize(num_cells: int) -> dict | None:
    """omicsio's parquet → dataset figures from results/materialize.json, for a corpus of that size."""
    path = HERE / "results" / "materialize.json"
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    if not all(saved.get(k) for k in ("command", "date", "commit")):  # no provenance: not a figure to quote
        return None
    row = next((r for r in saved["rows"] if r["num_cells"] == num_cells and r["input"] == "parquet"), None)
    if row is None:
        return None
    return {
        "source": "results/materialize.json",
        "command": saved["command"],
        "date": saved["date"],
        "commit": saved["commit"],
        "input": "parquet",
        "cells_per_s": row["cells_per_s"],
        "seconds": num_cells / row["cells_per_s"],
        "peak_rss_bytes": round(row["peak_rss_mib_max"] * 2**20),
        "largest_child_peak_rss_bytes": round(row["child_peak_rss_mib_max"] * 2**20),
        "bytes_per_cell": row["dataset_bytes_per_cell"],
        "workers": row["workers"],
    }


def entropy_reference(dataset: Path) -> dict:
    """Population entropy of the label and the expected minibatch entropy under true random sampling."""
    import omicsio_jax as oj

    codes = np.asarray(oj.open_dataset(dataset).obs[LABEL].codes)
    counts = np.bincount(codes[codes >= 0])
    out = {"label": LABEL, "num_labels": int((counts > 0).sum())}
    for _, bs in CONFIGS:
        b = oj.entropy_bounds(counts, batch_size=bs, block_size=BLOCK_SIZE, fetch_factor=FETCH_FACTOR)
        out["population_bits"] = b.population
        out[f"true_random_b{bs}_bits"] = b.upper
    return out


def _ratio(a: dict, b: dict, key: str) -> float | None:
    return a[key] / b[key] if key in a and key in b else None


def ratios(rows: list[dict]) -> dict:
    """omicsio ÷ annbatch for cells/s and cells per CPU-second, per (output, batch size)."""
    by = {r["label"]: r for r in rows}
    out = {}
    for output, bs in CONFIGS:
        peer = by[f"annbatch {output} b{bs}"]
        for threads, fetch in _variants(output, bs):
            ours = by[_our_label(output, bs, threads, fetch)]
            tag = ours["label"].removeprefix("omicsio ")
            out[tag] = {
                "cells_per_s": _ratio(ours, peer, "cells_per_s"),
                "cells_per_cpu_s": _ratio(ours, peer, "cells_per_cpu_s"),
            }
    return out


def _variants(output: str, bs: int) -> list[tuple[int | None, int]]:
    """(num_threads, fetch_factor) of our runs of a configuration: the default first."""
    return [(t, FETCH_FACTOR) for t in THREADS] + list(EXTRA.get((output, bs), ()))


def _our_label(output: str, bs: int, threads: int | None, fetch: int = FETCH_FACTOR) -> str:
    return (
        f"omicsio {output} b{bs}"
        + ("" if threads == THREADS[0] else f" read=ReadOptions(num_threads={threads})")
        + ("" if fetch == FETCH_FACTOR else f" sampling=Block({BLOCK_SIZE}, {fetch})")
    )


def _n(v: float | None, fmt: str = ",.0f") -> str:
    return "–" if v is None else format(v, fmt)


def markdown(result: dict) -> str:
    """The results as a Markdown table (printed after a run, and by ``--markdown``)."""
    lines = [
        (
            "| configuration | cells/s | cells per CPU-s | cores busy | first batch (s) "
            "| first batch from process start (s) | peak RSS (MiB) | `batch` entropy (bits) | timed batches |"
        ),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    by = {r["label"]: r for r in result["rows"]}
    for output, bs in CONFIGS:
        for label in (
            *(_our_label(output, bs, *v) for v in _variants(output, bs)),
            f"annbatch {output} b{bs}",
        ):
            r = by.get(label)
            if r is None:
                continue
            if "cells_per_s" not in r:
                lines.append(f"| {label} | error: {r['errors'][-1] if r['errors'] else '?'} | | | | | | | |")
                continue
            bold = "**" if label == _our_label(output, bs, THREADS[0]) else ""
            first = _n(r["first_batch_s"], ".2f") + (f" (+{r['open_s']:.2f} open)" if "open_s" in r else "")
            lines.append(f"| {bold}{label}{bold} | {bold}{_n(r['cells_per_s'])}{bold} | {_n(r['cells_per_cpu_s'])} "
                         f"| {_n(r['cpu_per_wall'], '.2f')} | {first} | {_n(r.get('first_batch_from_spawn_s'), '.2f')} "
                         f"| {_n(r['peak_rss_bytes'] / 2**20)} | {_n(r['label_entropy_bits'], '.3f')} "
                         f"| {r['batches']:,} |")  # fmt: skip
        for tag, q in result["ratios"].items():
            if tag.startswith(f"{output} b{bs}"):
                variant = tag.removeprefix(f"{output} b{bs}").strip()
                lines.append(
                    f"| *omicsio{f' ({variant})' if variant else ''} ÷ annbatch* "
                    f"| *{_n(q['cells_per_s'], '.2f')}×* | *{_n(q['cells_per_cpu_s'], '.2f')}×* | | | | | | |"
                )
    ref = result.get("entropy_reference")
    if ref:
        lines.append("")
        lines.append(
            f"`batch` ({ref['num_labels']} plates): population entropy {ref['population_bits']:.3f} bits; "
            f"expected minibatch entropy under true random sampling "
            f"{ref['true_random_b64_bits']:.3f} (b64) / {ref['true_random_b1024_bits']:.3f} (b1024) bits."
        )
    lines.append("")
    lines.append(
        "First batch: omicsio from the `make_loader` call (its `open_dataset` in parentheses), whose first "
        "batch reads only its own cells (its fetch is read after it); annbatch from the "
        "`DatasetCollection` call (opening the stores included) through its first load (16,384 cells); "
        "from process start: from just before the process is started (interpreter, imports, open, first batch). "
        "annbatch dense = its scipy CSR batch densified with `.toarray()` in the timed loop."
    )
    conv, mat, disk = (
        result.get("annbatch_conversion"),
        result.get("omicsio_materialize"),
        result["disk_bytes"],
    )
    cells = result["num_cells"]
    lines.append("")
    if conv:
        lines.append(
            f"annbatch conversion (`add_adatas`, from h5ad): {conv['seconds']:,.1f} s "
            f"({conv['cells_per_s']:,.0f} cells/s), peak RSS {conv['peak_rss_bytes'] / 2**30:,.2f} GiB, "
            f"{conv['bytes_per_cell']:,.0f} B/cell."
        )
    if mat:
        lines.append(
            f"omicsio materialize (from parquet, {mat['workers']} workers; results/materialize.json): "
            f"{mat['seconds']:,.1f} s ({mat['cells_per_s']:,.0f} cells/s), peak RSS "
            f"{mat['peak_rss_bytes'] / 2**30:,.2f} GiB + largest child "
            f"{mat['largest_child_peak_rss_bytes'] / 2**30:,.2f} GiB, {mat['bytes_per_cell']:,.0f} B/cell."
        )
    lines.append(
        f"On disk: omicsio dataset {disk['omicsio_dataset'] / cells:,.0f} B/cell, annbatch collection "
        f"{disk['annbatch_collection'] / cells:,.0f} B/cell ({cells:,} cells)."
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument(
        "--corpus", type=Path, default=DATA / "corpus_200k", help="holds cells.parquet and cells.h5ad"
    )
    p.add_argument(
        "--dataset", type=Path, default=DATA / "ds_200k", help="our dataset (materialized if missing)"
    )
    p.add_argument(
        "--collection",
        type=Path,
        default=DATA / "annbatch_200k",
        help="annbatch's collection (converted from the corpus's h5ad if missing)",
    )
    add_window_options(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--baseline",
        metavar="CHECKOUT",
        help="also run omicsio's default-thread configurations from this checkout of an earlier commit "
        "(a git worktree), in the same rounds",
    )
    p.add_argument("--out", type=Path, default=HERE / "results" / "annbatch.json")
    p.add_argument("--markdown", action="store_true", help="only print the Markdown table of --out")
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return
    if args.markdown:
        print(markdown(json.loads(args.out.read_text())))
        return
    check_window(args)
    if not ANNBATCH_PYTHON.exists():
        raise SystemExit(f"{ANNBATCH_PYTHON} is missing: run scripts/setup-annbatch.sh first")
    rounds = args.rounds
    warmup = QUICK_WARMUP if args.quick else WARMUP
    corpus, dataset, collection = args.corpus.resolve(), args.dataset.resolve(), args.collection.resolve()
    conversion = ensure_data(corpus, dataset, collection, args.seed)

    import pyarrow.parquet as pq

    import omicsio_jax as oj

    num_cells = oj.open_dataset(dataset).num_cells
    corpus_cells = pq.ParquetFile(corpus / "cells.parquet").metadata.num_rows
    if corpus_cells != num_cells:
        raise SystemExit(
            f"{dataset} holds {num_cells:,} cells and {corpus} {corpus_cells:,}: not the same cells; "
            "pass the matching --dataset"
        )

    baseline = None if args.baseline is None else str(Path(args.baseline).resolve())
    base_sha = None if baseline is None else baseline_commit(baseline)
    plan: list[tuple[str, dict]] = []
    for output, bs in CONFIGS:
        common = {
            "batch_size": bs,
            "output": output,
            "seconds": args.seconds,
            "warmup": warmup[bs],
            "seed": args.seed,
        }
        for threads, fetch in _variants(output, bs):
            kwargs = {"dataset": str(dataset), **common, "num_threads": threads, "block_size": BLOCK_SIZE,
                      "fetch_factor": fetch}  # fmt: skip
            plan.append((_our_label(output, bs, threads, fetch), {"kind": "ours", "kwargs": kwargs}))
            if baseline is not None and (threads, fetch) in ((THREADS[0], FETCH_FACTOR), (0, FETCH_FACTOR)):
                plan.append((f"{_our_label(output, bs, threads, fetch)} @ {base_sha[:7]}",
                             {"kind": "ours", "kwargs": kwargs, "baseline": baseline}))  # fmt: skip
        plan.append(
            (
                f"annbatch {output} b{bs}",
                {"kind": "annbatch", "kwargs": {"collection": str(collection), **common}},
            )
        )
    rows = run_rounds(plan, rounds)

    mismatched = [r["label"] for r in rows if r.get("num_cells", num_cells) != num_cells]
    if mismatched:
        print(
            f"WARNING: {', '.join(mismatched)} saw another number of cells than {num_cells:,}: "
            "the collection is not of the same corpus",
            flush=True,
        )
    by = {r["label"]: r for r in rows}
    comparisons = [
        compare(f"{output} b{bs}{'' if variant == (THREADS[0], FETCH_FACTOR) else ' ' + _our_label(output, bs, *variant).removeprefix(f'omicsio {output} b{bs} ')}: omicsio ÷ annbatch",
                by.get(_our_label(output, bs, *variant)), by.get(f"annbatch {output} b{bs}"))
        for output, bs in CONFIGS
        for variant in _variants(output, bs)
    ]  # fmt: skip
    for r in (
        r for r in rows if r.get("baseline")
    ):  # this commit against the earlier one, and both against annbatch
        peer = f"annbatch {r['output']} b{r['batch_size']}"
        comparisons += [compare(f"{r['label']}: this commit ÷ {base_sha[:7]}", by.get(r["label"].rsplit(" @ ", 1)[0]), r),
                        compare(f"{r['label']}: {base_sha[:7]} ÷ annbatch", r, by.get(peer))]  # fmt: skip
    result = {
        "benchmark": "bench_annbatch", **provenance(), "rounds": rounds, "window_s": args.seconds,
        "baseline": None if baseline is None else {"checkout": baseline, "commit": base_sha},
        "quick": args.quick,
        "corpus": str(corpus), "dataset": str(dataset), "collection": str(collection), "num_cells": num_cells,
        "cell_count_mismatch": mismatched, "label": LABEL, "rows": rows, "ratios": ratios(rows),
        "comparisons": [c for c in comparisons if c],
        "entropy_reference": entropy_reference(dataset),
        "disk_bytes": {"omicsio_dataset": _tree_bytes(dataset), "annbatch_collection": _tree_bytes(collection)},
        "annbatch_conversion": conversion, "omicsio_materialize": our_materialize(num_cells),
    }  # fmt: skip
    write_result(args.out, result, quick=args.quick)
    print()
    print(markdown(result))


if __name__ == "__main__":
    main()

"""A collection of many sources with different gene sets against one source of the same cells.

The data (made on first use in benchmarks/data/, seed 0): a universe of 62,710 Ensembl ids and
``--sources`` parquet sources, each measuring a random 20k–60k of them (its gene table in its own
order: half the sources list their genes shuffled, as files in the wild do) with ``--cells`` cells
of ~1,000 nonzeros; and ``one/``, the same cells as one parquet table over the universe.

1. **Materialize**, each in a fresh process, ``--rounds`` rounds, alternating: the collection
   (genes unified by Ensembl id, presence bitmaps) against the single source; cells/s (whole
   conversions in one process until they took ``--seconds``, each round) and the peak RSS of the
   main process and of its largest child; the seconds a conversion spends opening its input (the
   sources read, their genes unified) and the rest, with the split of the collection's extra
   seconds between them (``materialize_split``: the workers start while the input opens, so their
   start falls in a collection's long opening but in a single source's rest, and the split
   overstates the opening's own cost); one conversion of each, untimed, before the rounds
   (numba compiles its kernels into a fresh checkout's cache). With ``--baseline CHECKOUT`` (a git
   worktree of another commit), that checkout converts both inputs too, in the same rounds, and
   the comparisons give this commit's cells/s ÷ its.
2. **Load**, each in a fresh process, round-robin: the collection's dataset with a mixture over its
   sources (equal weights) and ``measured=True`` against the single dataset with `make_loader`'s
   defaults, dense and csr at batch 1,024, a window of ``--seconds`` after warm-up. A third
   loader, the same as the collection's, reads the single source materialized as a collection of
   one (its mask all True): the masks' own cost (a dense batch's mask is a byte a gene beside the
   values' four) set apart from what the collection's many sources cost.

    .venv/bin/python benchmarks/bench_collection.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
DATA = HERE / "data"
sys.path.insert(0, str(HERE))
from _provenance import (  # noqa: E402
    add_window_options,
    baseline_commit,
    check_window,
    compare,
    medians,
    provenance,
    run_json,
    window,
    write_result,
)

UNIVERSE = 62_710
_ROW_GROUP = 8192


def _one_schema():
    import pyarrow as pa

    return pa.schema(
        [
            ("cell_id", pa.string()),
            ("gene_token_id", pa.list_(pa.int32())),
            ("gene_expression", pa.list_(pa.float32())),
        ]
    )


_MATERIALIZE = """
import json, resource, shutil, sys, time
from pathlib import Path
from materialize import materialize
import materialize._materialize as phases
exec(sys.argv[4])  # what the round sets first (`materialize_round`'s ``before``)
sources, window = json.loads(sys.argv[1]), float(sys.argv[3])
seconds, conversions, opening = 0.0, 0, 0.0

def timed(open_input):  # the seconds until the input is open (its sources read, genes unified)
    def run(*args, **kwargs):
        global opening
        start = time.perf_counter()
        try:
            return open_input(*args, **kwargs)
        finally:
            opening += time.perf_counter() - start
    return run

wrapped = [name for name in ("open_collection_source", "open_source") if hasattr(phases, name)]
if not wrapped:  # a renamed phase would leave the opening at 0 s and all of it in the rest
    sys.exit("bench_collection: materialize._materialize has neither open_collection_source nor open_source")
for name in wrapped:
    setattr(phases, name, timed(getattr(phases, name)))
while conversions == 0 or seconds < window:  # whole conversions, at least the window
    shutil.rmtree(sys.argv[2], ignore_errors=True)
    start = time.perf_counter()
    result = materialize(sources, sys.argv[2], progress=False)
    seconds += time.perf_counter() - start
    conversions += 1
print(json.dumps({"seconds": seconds, "conversions": conversions, "num_cells": result.manifest.num_cells,
                  "open_s": opening / conversions, "rest_s": (seconds - opening) / conversions,
                  "cells": conversions * result.manifest.num_cells, "workers": result.workers,
                  "child_peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
                  "peak_rss_bytes": next(int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines()
                                         if l.startswith("VmHWM:"))}))
"""


def make_data(root: Path, num_sources: int, cells: int) -> tuple[list[str], str]:
    """The sources' folders and the single source's folder (made once per shape)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    done = root / "done.json"
    if done.exists():
        made = json.loads(done.read_text())
        return made["sources"], made["one"]
    shutil.rmtree(root, ignore_errors=True)
    rng = np.random.default_rng(0)
    ids = np.array([f"ENSG{i:011d}" for i in range(UNIVERSE)])
    (root / "one").mkdir(parents=True)
    one_schema = _one_schema()
    one = pq.ParquetWriter(root / "one" / "cells.parquet", one_schema)
    pending: list[pa.Table] = []  # the single source's rows not yet written: row groups of 8,192 over sources
    paths = []
    for k in range(num_sources):
        width = int(rng.integers(20_000, 60_001))
        genes = np.sort(rng.choice(UNIVERSE, width, replace=False))
        if k % 2:
            genes = rng.permutation(genes)  # the source lists its genes in an order of its own
        folder = root / f"source_{k:02d}"
        folder.mkdir(parents=True)
        pq.write_table(
            pa.table({"gene_token_id": np.arange(width), "ensembl_id": ids[genes]}),
            folder / "gene_metadata.parquet",
        )
        nnz = rng.integers(600, 1_400, cells)
        tokens, values, universe_tokens = [], [], []
        for n in nnz:
            t = np.sort(rng.choice(width, int(n), replace=False)).astype(np.int32)
            tokens.append(t)
            values.append(rng.integers(1, 30, int(n)).astype(np.float32))
            universe_tokens.append(genes[t])
        cell_ids = [f"s{k}_c{i}" for i in range(cells)]
        lists = {
            "cell_id": cell_ids,
            "gene_token_id": pa.array(tokens, pa.list_(pa.int32())),
            "gene_expression": pa.array(values, pa.list_(pa.float32())),
        }
        pq.write_table(pa.table(lists), folder / "cells.parquet", row_group_size=8192)
        order = [np.argsort(u) for u in universe_tokens]
        pending.append(
            pa.table(
                {
                    "cell_id": cell_ids,
                    "gene_token_id": pa.array(
                        [u[o].astype(np.int32) for u, o in zip(universe_tokens, order, strict=True)],
                        pa.list_(pa.int32()),
                    ),
                    "gene_expression": pa.array(
                        [v[o] for v, o in zip(values, order, strict=True)], pa.list_(pa.float32())
                    ),
                },
                schema=one_schema,
            )
        )
        pending = _write_groups(one, pending, final=k == num_sources - 1)
        paths.append(str(folder / "cells.parquet"))
        print(f"source {k}: {width:,} genes, {cells:,} cells", flush=True)
    one.close()
    pq.write_table(
        pa.table({"gene_token_id": np.arange(UNIVERSE), "ensembl_id": ids}),
        root / "one" / "gene_metadata.parquet",
    )
    done.write_text(json.dumps({"sources": paths, "one": str(root / "one" / "cells.parquet")}))
    return paths, str(root / "one" / "cells.parquet")


def _write_groups(writer, pending: list, *, final: bool) -> list:
    """Write ``pending``'s rows in row groups of 8,192 (the last one shorter when ``final``); the rows
    left over. The single source is written as it is made, never held whole (a collection of 1M cells
    is ~8 GB of lists)."""
    import pyarrow as pa

    rows = pa.concat_tables(pending)
    start = 0
    while rows.num_rows - start >= _ROW_GROUP or (final and start < rows.num_rows):
        writer.write_table(rows.slice(start, _ROW_GROUP), row_group_size=_ROW_GROUP)
        start += _ROW_GROUP
    return [rows.slice(start)] if start < rows.num_rows else []


def materialize_round(
    source, out: Path, seconds: float, *, before: str = "", checkout: str | None = None
) -> dict:
    """Whole conversions of ``source`` in one fresh process until they took ``seconds`` together
    (``before``: Python that process runs first, e.g. a module setting patched; ``checkout``: a
    ``--baseline``'s, whose packages that process imports)."""
    out = Path(out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    try:
        r = run_json(
            ["-c", _MATERIALIZE, json.dumps(source), str(out), str(seconds), before], checkout=checkout
        )
    except RuntimeError as e:
        raise SystemExit(f"materialize failed: {str(e).strip().splitlines()[-1]}") from None
    return {**r, "cells_per_s": r["cells"] / r["seconds"]}


def _load(spec: dict) -> dict:
    """One loader configuration, in this (child) process."""
    import jax

    import omicsio_jax as oj

    ds = oj.open_dataset(spec["dataset"])
    if spec["collection"]:
        ids = ds.presence.dataset_ids
        sampling = oj.Mixture(by="dataset_id", weights=dict.fromkeys(ids, 1.0))
        output = oj.Dense(measured=True) if spec["output"] == "dense" else oj.CSR(measured=True)
    else:
        sampling = oj.Block()
        output = oj.Dense() if spec["output"] == "dense" else oj.CSR()
    loader = oj.make_loader(
        ds, batch_size=spec["batch_size"], output=output, sampling=sampling, num_epochs=None
    )
    it = iter(loader)
    for _ in range(spec["warmup"]):
        jax.block_until_ready(next(it).x)

    def step() -> int:
        jax.block_until_ready(next(it).x)
        return spec["batch_size"]

    w = window(step, seconds=spec["seconds"])
    loader.close()
    return {**spec, **w.as_dict()}


def load_once(spec: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def split(collection: dict, one: dict) -> dict:
    """Where the collection's extra seconds per conversion go (medians over the rounds): opening its
    input (its sources' metadata and gene tables read, their genes unified) and the rest (the
    partitions written and merged)."""
    return {
        f"{part} s a conversion: {what}": source[f"{key}_s"]
        for key, part in (("open", "open"), ("rest", "the rest"))
        for what, source in (("collection", collection), ("one source", one))
    } | {
        f"{part} s a conversion: collection - one source": collection[f"{key}_s"] - one[f"{key}_s"]
        for key, part in (("open", "open"), ("rest", "the rest"))
    }


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(_load(json.loads(sys.argv[2]))))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sources", type=int, default=50)
    p.add_argument("--cells", type=int, default=6_000, help="cells per source")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=4)
    add_window_options(p)
    p.add_argument(
        "--baseline",
        help="a git worktree of another commit: its conversions of both inputs in the same rounds, "
        "and this commit's cells/s ÷ its",
    )
    p.add_argument("--out", default=str(HERE / "results" / "collection.json"))
    args = p.parse_args()
    check_window(args)
    base = base_commit = None
    if args.baseline is not None:
        args.baseline = str(Path(args.baseline).resolve())
        base_commit = baseline_commit(args.baseline)  # not a checkout: fails here, before anything
        base = base_commit[:7]
    root = DATA / f"collection_{args.sources}x{args.cells}"
    sources, one = make_data(root, args.sources, args.cells)
    inputs = {"collection": sources, "one source": one}
    checkouts = {what: None for what in inputs}
    if base is not None:
        checkouts.update({f"{what} @ {base}": args.baseline for what in inputs})
    rows: dict[str, list[dict]] = {what: [] for what in checkouts}
    with tempfile.TemporaryDirectory(dir=DATA) as tmp:
        outs = {"collection": Path(tmp) / "collection", "one source": Path(tmp) / "one"}
        for what, checkout in checkouts.items():
            # one conversion each first, not timed: numba compiles into a fresh checkout's cache
            materialize_round(inputs[what.split(" @ ")[0]], Path(tmp) / "warm", 0.0, checkout=checkout)
        for r in range(args.rounds):
            order = list(checkouts) if r % 2 == 0 else list(checkouts)[::-1]
            for what in order:
                plain = what.split(" @ ")[0]
                out = outs[plain] if what == plain else Path(tmp) / "baseline"
                rows[what].append(
                    materialize_round(inputs[plain], out, args.seconds, checkout=checkouts[what])
                )
                print(f"materialize {what}: {rows[what][-1]['cells_per_s']:,.0f} cells/s", flush=True)
        materialized = {
            what: {
                "label": f"materialize, {what}",
                "num_cells": runs[0]["num_cells"],
                "workers": runs[0]["workers"],
                **medians(runs, ["cells_per_s", "seconds", "open_s", "rest_s"]),
                "peak_rss_mib_max": max(r["peak_rss_bytes"] for r in runs) / 2**20,
                "child_peak_rss_mib_max": max(r["child_peak_rss_bytes"] for r in runs) / 2**20,
            }
            for what, runs in rows.items()
        }
        measured = "one source, measured"  # the single source as a collection of one (untimed)
        outs[measured] = Path(tmp) / "one_measured"
        materialize_round([one], outs[measured], 0.0)
        loads: dict[str, list[dict]] = {}
        for _ in range(args.rounds):
            for output in ("dense", "csr"):
                for what in ("collection", "one source", measured):
                    spec = {
                        "dataset": str(outs[what]),
                        "collection": what != "one source",
                        "output": output,
                        "batch_size": args.batch_size,
                        "warmup": args.warmup,
                        "seconds": args.seconds,
                    }
                    label = f"{output} b{args.batch_size}, {what}"
                    loads.setdefault(label, []).append(load_once(spec))
                    print(f"{label}: {loads[label][-1]['cells_per_s']:,.0f} cells/s", flush=True)
    loaded = {
        label: {"label": label, **medians(runs, ["cells_per_s", "cells_per_cpu_s", "seconds"])}
        for label, runs in loads.items()
    }
    result = {
        "benchmark": "bench_collection",
        **provenance(),
        "rounds": args.rounds,
        "window": "materialize: whole conversions, at least --seconds per round; load: --seconds after warm-up",
        "quick": args.quick,
        "data": {"sources": args.sources, "cells_per_source": args.cells, "universe_genes": UNIVERSE},
        "materialize": materialized,
        "materialize_split": split(materialized["collection"], materialized["one source"]),
        "load": loaded,
        "comparisons": [
            compare(
                "materialize: collection / one source", materialized["collection"], materialized["one source"]
            ),
            *(
                compare(
                    f"{o} b{args.batch_size}: collection (mixture, measured) / one source",
                    loaded[f"{o} b{args.batch_size}, collection"],
                    loaded[f"{o} b{args.batch_size}, one source"],
                )
                for o in ("dense", "csr")
            ),
            *(
                compare(
                    f"{o} b{args.batch_size}: collection / one source, both with a mixture and measured",
                    loaded[f"{o} b{args.batch_size}, collection"],
                    loaded[f"{o} b{args.batch_size}, {measured}"],
                )
                for o in ("dense", "csr")
            ),
            *(
                compare(
                    f"materialize {what}: this commit / {base}",
                    materialized[what],
                    materialized[f"{what} @ {base}"],
                )
                for what in (inputs if base is not None else ())
            ),
        ],
        **({} if base is None else {"baseline": {"checkout": args.baseline, "commit": base_commit}}),
    }
    write_result(args.out, result, quick=args.quick)


if __name__ == "__main__":
    main()

"""Multimodal datasets: materialize speed and memory, and what a loader pays per modality.

The corpus is `make_synthetic_corpus(multimodal=True)`: RNA (~1,500 genes per cell of 62,710)
with spliced / unspliced / ambiguous layers that sum to it, and ATAC over 200,000 peaks (~3,000
per cell) for 90% of the cells, its table in another order than the RNA's (so materialize spills
it by partition). Two sizes of it are materialized, RNA alone and with every modality, each in a
fresh process on every core, ``--rounds`` times (medians reported; a round is one whole conversion,
its seconds recorded), in shards (= partitions) of ``--shard-cells`` so that both sizes fill
whole partitions; ``main_peak_rss_mib`` is the materialize process's largest resident set,
``worker_peak_rss_mib`` the largest of its worker and shard-writer processes (``ru_maxrss`` of
children; it includes the memory-mapped spill pages a worker touched, which the kernel can drop),
neither of which may grow with the number of cells.

The loaders (fresh processes, a window of ``--seconds`` (at least 10) each after two batches,
``--rounds`` round-robin, medians) read batches of 1,024 with ``oj.Block(16, 64)``, warm page cache:

- ``rna alone``: the RNA-only dataset, csr; ``rna of multimodal``: the same output from the
  multimodal dataset (target: ≥ 0.95× the former: a modality costs what a dataset of its own costs);
- ``all modalities``: ``{"rna", "spliced", "unspliced", "ambiguous", "atac"}`` all csr.

``read_per_cell_kb`` is the bytes the process read (``rchar``: through the page cache or not) per
cell served; ``shard_kb_per_cell`` the modality's shards on disk per cell.

    .venv/bin/python benchmarks/bench_multimodal.py               # writes results/multimodal.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
DATA = HERE / "data"
sys.path.insert(0, str(HERE))
from _provenance import add_window_options, check_window, medians, provenance, write_result  # noqa: E402

MODALITIES = ("spliced", "unspliced", "ambiguous", "atac")
LOADERS = {
    "rna alone": ("rna", "csr"),
    "rna of multimodal": ("multi", "csr"),
    "all modalities": ("multi", {"rna": "csr", **{m: "csr" for m in MODALITIES}}),
}


def corpus(num_cells: int) -> Path:
    """The synthetic multimodal corpus of ``num_cells`` cells (written once, kept in benchmarks/data)."""
    out = DATA / f"corpus_multimodal_{num_cells // 1000}k"
    if not (out / "atac_cells.parquet").exists():
        from materialize import make_synthetic_corpus

        start = time.perf_counter()
        make_synthetic_corpus(out, num_cells=num_cells, multimodal=True, write_h5ad=False, progress=True)
        print(f"corpus {out.name}: {time.perf_counter() - start:.0f} s", flush=True)
    return out


def _materialize_child(spec: dict) -> dict:
    from materialize import Layout, Multimodal, materialize

    root, kind = Path(spec["corpus"]), spec["kind"]
    multimodal = Multimodal()
    if kind == "multi":
        multimodal = Multimodal(
            layers={m: str(root / f"rna_layers_{m}.parquet") for m in MODALITIES[:3]},
            modalities={"atac": str(root / "atac_cells.parquet")},
        )
    result = materialize(
        root / "cells.parquet",
        spec["out"],
        layout=Layout(shard_cells=spec["shard_cells"]),
        multimodal=multimodal,
        overwrite=True,
        progress=False,
    )
    main_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    m = result.manifest
    return {
        **spec,
        "seconds": result.seconds,
        "cells_per_s": result.cells_per_second,
        "workers": result.workers,
        "peak_rss_mib": max(main_rss, children_rss),
        "main_peak_rss_mib": main_rss,
        "worker_peak_rss_mib": children_rss,
        "nnz": {"rna": m.nnz, **{e.name: e.nnz for e in m.modalities}},
    }


def _loader_child(spec: dict) -> dict:
    import os

    import jax

    import omicsio_jax as oj

    sys.path.insert(0, str(HERE))
    from _peers import proc_io

    ds = oj.open_dataset(spec["dataset"])
    batch = 1024
    loader = oj.make_loader(
        ds, batch_size=batch, sampling=oj.Block(16, 64), output=spec["output"], seed=0, num_epochs=None
    )
    it = iter(loader)
    for _ in range(2):
        jax.block_until_ready(next(it).x)
    read0, times0 = proc_io("rchar"), os.times()
    start = last = time.perf_counter()
    cells = 0
    while last - start < spec["seconds"]:
        jax.block_until_ready(next(it).x)
        cells, last = cells + batch, time.perf_counter()
    times = os.times()
    cpu = times.user - times0.user + times.system - times0.system
    return {
        **spec,
        "cells_per_s": cells / (last - start),
        "seconds": last - start,
        "cells_per_cpu_s": cells / cpu,
        "read_per_cell_kb": (proc_io("rchar") - read0) / cells / 1e3,
    }


def _run(kind: str, spec: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, f"--{kind}-child", json.dumps(spec)],
        check=False,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} child failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _shard_kb_per_cell(dataset: Path) -> dict:
    import omicsio_jax as oj

    ds = oj.open_dataset(dataset)
    return {
        name: sum(s.num_bytes for s in ds.modality(name).manifest.shards) / ds.num_cells / 1e3
        for name in ds.modalities
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="40000,160000", help="corpus sizes (cells) to materialize")
    p.add_argument(
        "--shard-cells",
        type=int,
        default=16384,
        help="cells per shard (= per partition): small enough that both sizes fill their partitions",
    )
    add_window_options(p, seconds=20.0)
    p.add_argument("--out", type=Path, default=HERE / "results" / "multimodal.json")
    p.add_argument("--materialize-child")
    p.add_argument("--loader-child")
    args = p.parse_args()
    if args.materialize_child:
        print(json.dumps(_materialize_child(json.loads(args.materialize_child))))
        return
    if args.loader_child:
        print(json.dumps(_loader_child(json.loads(args.loader_child))))
        return
    check_window(args)
    sizes = [int(x) for x in args.sizes.split(",")]
    runs = []
    for size in sizes:
        root = corpus(size)
        for r in range(args.rounds):
            for kind in ("rna", "multi"):
                out = DATA / f"ds_multimodal_{size // 1000}k_{kind}"
                result = _run(
                    "materialize",
                    {
                        "corpus": str(root),
                        "kind": kind,
                        "out": str(out),
                        "cells": size,
                        "shard_cells": args.shard_cells,
                        "round": r,
                    },
                )
                print(
                    f"[round {r + 1}/{args.rounds}] materialize {size:>7,} cells {kind:>5}: "
                    f"{result['cells_per_s']:8,.0f} cells/s, peak RSS main {result['main_peak_rss_mib']:6,.0f} MiB, "
                    f"workers {result['worker_peak_rss_mib']:6,.0f} MiB, {result['seconds']:.0f} s",
                    flush=True,
                )
                runs.append(result)
    materialize_summary = []
    for size in sizes:
        for kind in ("rna", "multi"):
            mine = [x for x in runs if x["cells"] == size and x["kind"] == kind]
            materialize_summary.append(
                {
                    "label": f"{size:,} cells, {'RNA alone' if kind == 'rna' else 'every modality'}",
                    "cells": size,
                    "kind": kind,
                    **medians(mine, ("cells_per_s", "seconds")),
                    "main_peak_rss_mib": max(x["main_peak_rss_mib"] for x in mine),
                    "worker_peak_rss_mib": max(x["worker_peak_rss_mib"] for x in mine),
                }
            )
    biggest = sizes[-1] // 1000
    datasets = {kind: DATA / f"ds_multimodal_{biggest}k_{kind}" for kind in ("rna", "multi")}
    loads = []
    for r in range(args.rounds):
        for label, (kind, output) in LOADERS.items():
            result = _run(
                "loader",
                {
                    "label": label,
                    "dataset": str(datasets[kind]),
                    "output": output,
                    "seconds": args.seconds,
                    "round": r,
                },
            )
            print(
                f"round {r} {label:>20}: {result['cells_per_s']:8,.0f} cells/s, "
                f"{result['read_per_cell_kb']:6.2f} kB read per cell",
                flush=True,
            )
            loads.append(result)
    summary = {}
    for label in LOADERS:
        mine = [x for x in loads if x["label"] == label]
        summary[label] = medians(mine, ("cells_per_s", "cells_per_cpu_s", "read_per_cell_kb", "seconds"))
    ratio = statistics.median(
        a["cells_per_s"] / b["cells_per_s"]
        for a, b in zip(
            [x for x in loads if x["label"] == "rna of multimodal"],
            [x for x in loads if x["label"] == "rna alone"],
            strict=True,
        )
    )
    result = {
        "benchmark": "bench_multimodal",
        **provenance(),
        "rounds": args.rounds,
        "window_s": args.seconds,
        "quick": args.quick,
        "materialize_summary": materialize_summary,
        "materialize": runs,
        "loaders": loads,
        "summary": summary,
        "rna_of_multimodal_over_rna_alone": ratio,
        "shard_kb_per_cell": _shard_kb_per_cell(datasets["multi"]),
    }
    write_result(args.out, result, quick=args.quick)
    print(
        json.dumps(
            {"summary": summary, "ratio": ratio, "shard_kb_per_cell": result["shard_kb_per_cell"]}, indent=1
        )
    )


if __name__ == "__main__":
    main()

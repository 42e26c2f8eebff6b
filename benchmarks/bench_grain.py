"""Grain's DataLoader over GrainSource against make_loader, on the same 200k-cell dataset, in one run.

Every configuration runs in a fresh process, all of them round-robin ``--rounds`` times (medians
reported), each timing a window of at least ``--seconds`` after its warm-up: make_loader, make_grain_loader with 0 worker processes (threads only) and with each
``--workers`` count, for dense and csr batches of 1,024 cells. Both deliver the same thing: the
batch's jax.Arrays on the default device (Grain's numpy batches placed by ``oj.prefetch_to_device`` on ``--place-threads`` threads, or in the loop with ``oj.place_batch``). Then the
checkpoint side: state size, Orbax ``CheckpointManager`` save and restore times, and the time to
the first batch after a restore.

    .venv/bin/python benchmarks/bench_grain.py --rounds 3 --workers 1 2
    # on a many-core machine: --workers 2 4 8 16 --make-data (writes the corpus and dataset first)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
DATA = HERE / "data"
sys.path.insert(0, str(HERE))
from _provenance import (  # noqa: E402
    add_window_options,
    check_window,
    medians,
    provenance,
    require_input,
    window,
    write_result,
)


def _consume(it, *, warmup: int, seconds: float, batch_size: int, place) -> dict:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(place(next(it)).x)

    def step() -> int:
        jax.block_until_ready(place(next(it)).x)
        return batch_size

    w = window(step, seconds=seconds).as_dict()
    return {**w, "main_process_cores": w["cpu_per_wall"]}


def _loader_kwargs(batch_size: int, output: str) -> dict:
    import omicsio_jax as oj

    return {
        "batch_size": batch_size,
        "sampling": oj.Block(16, 64),
        "output": output,
        "obs": ("batch",),
        "seed": 0,
        "num_epochs": None,
    }


def _child(spec: dict) -> dict:
    import omicsio_jax as oj

    ds = oj.open_dataset(spec["dataset"])
    kw = _loader_kwargs(spec["batch_size"], spec["output"])
    timing = {"warmup": 32, "seconds": spec["seconds"], "batch_size": spec["batch_size"]}
    if spec["kind"] == "make_loader":
        loader = oj.make_loader(ds, **kw, read=oj.ReadOptions(num_threads=spec["threads"]))
        out = _consume(iter(loader), **timing, place=lambda b: b)
        loader.close()
        return out
    threads = spec["threads"] if spec["workers"] == 0 else spec["worker_threads"]
    loader = oj.make_grain_loader(
        ds, **kw, read=oj.ReadOptions(num_threads=threads), worker_count=spec["workers"]
    )
    place = spec["place_threads"]
    if not place:  # placed in the loop's thread
        return _consume(iter(loader), **timing, place=oj.place_batch)
    batches = oj.prefetch_to_device(iter(loader), buffer_size=place, threads=place)
    return _consume(batches, **timing, place=lambda b: b)


def _checkpoint_costs(dataset: str) -> dict:
    """State sizes, Orbax save/restore times and the first batch after a restore (medians of 5)."""
    import grain
    import jax
    import orbax.checkpoint as ocp

    import omicsio_jax as oj

    ds = oj.open_dataset(dataset)
    kw = _loader_kwargs(1024, "dense")
    loader = oj.make_loader(ds, **kw)
    for _ in range(37):
        next(loader)
    grain_it = iter(oj.make_grain_loader(ds, **kw))
    for _ in range(37):
        next(grain_it)
    out = {
        "make_loader_state_bytes": len(json.dumps(loader.get_state())),
        "grain_dataloader_state_bytes": len(grain_it.get_state()),
    }
    del grain_it
    loader.close()  # its state stays readable; its threads stop (they would compete with the restores)
    saves, restores, firsts = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        with ocp.CheckpointManager(tmp) as mngr:
            for step in range(5):
                t = time.perf_counter()
                mngr.save(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(loader)))
                mngr.wait_until_finished()
                saves.append(time.perf_counter() - t)
            for step in range(5):
                fresh = oj.make_loader(ds, **kw)
                t = time.perf_counter()
                mngr.restore(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh)))
                restores.append(time.perf_counter() - t)
                jax.block_until_ready(next(fresh).x)
                firsts.append(time.perf_counter() - t)
                fresh.close()
    out.update(
        {
            "orbax_save_s": float(np.median(saves)),
            "orbax_restore_s": float(np.median(restores)),
            "restore_to_first_batch_s": float(np.median(firsts)),
        }
    )
    return out


def ensure_data(cells: int) -> Path:
    """The corpus (parquet only) and its materialized dataset under benchmarks/data/."""
    corpus, dataset = DATA / f"corpus_{cells // 1000}k", DATA / f"ds_{cells // 1000}k"
    if not (dataset / "manifest.json").exists():
        from materialize import make_synthetic_corpus, materialize

        if not (corpus / "cells.parquet").exists():
            make_synthetic_corpus(corpus, num_cells=cells, seed=0, write_h5ad=False, progress=True)
        materialize(corpus / "cells.parquet", dataset, overwrite=True)
    return dataset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--dataset", default=str(DATA / "ds_200k"))
    p.add_argument(
        "--make-data", action="store_true", help="write the 200k-cell corpus and dataset if missing"
    )
    add_window_options(p)
    p.add_argument("--workers", type=int, nargs="*", default=[1, 2], help="worker_count values besides 0")
    p.add_argument(
        "--threads",
        type=int,
        default=2,
        help="decoding threads (ReadOptions(num_threads=...)) of make_loader and of the 0-worker DataLoader",
    )
    p.add_argument(
        "--place-threads",
        type=int,
        default=0,
        help="threads (and batches ahead) of oj.prefetch_to_device for the DataLoader's batches; "
        "0: oj.place_batch in the loop's thread",
    )
    p.add_argument(
        "--worker-threads",
        type=int,
        default=None,
        help="decoding threads in each worker process (default: --threads)",
    )
    p.add_argument("--out", default=str(HERE / "results" / "grain.json"))
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return
    check_window(args)
    dataset = str(ensure_data(200_000)) if args.make_data else args.dataset
    require_input(
        Path(dataset) / "manifest.json",
        "benchmarks/bench_loader.py (data/ds_200k) or this script's --make-data",
        "--dataset",
    )
    plan = []
    for output in ("dense", "csr"):
        base = {
            "dataset": dataset,
            "batch_size": 1024,
            "output": output,
            "threads": args.threads,
            "worker_threads": args.worker_threads or args.threads,
            "place_threads": args.place_threads,
            "seconds": args.seconds,
        }
        plan.append((f"make_loader            {output} b1024", {**base, "kind": "make_loader"}))
        for w in [0, *args.workers]:
            plan.append(
                (f"make_grain_loader W={w:<2} {output} b1024", {**base, "kind": "grain", "workers": w})
            )
    runs: dict[str, list[dict]] = {label: [] for label, _ in plan}
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for r in range(args.rounds):
        for label, spec in plan:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", json.dumps(spec)],
                capture_output=True,
                text=True,
                env=env,
                timeout=900,
            )
            if proc.returncode:
                print(f"{label}: failed\n{proc.stderr[-2000:]}", flush=True)
                continue
            runs[label].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"round {r} {label}: {runs[label][-1]['cells_per_s']:>10,.0f} cells/s", flush=True)
    rows = []
    for label, spec in plan:
        rows.append(
            {
                "config": label,
                "label": label,
                **{k: v for k, v in spec.items() if k != "dataset"},
                "cells_per_s": None,
                "cells_per_s_runs": [],
                **medians(runs[label], ("cells_per_s", "main_process_cores", "seconds", "batches")),
            }
        )
    for output in ("dense", "csr"):
        ours = next(r for r in rows if r["kind"] == "make_loader" and r["output"] == output)["cells_per_s"]
        for r in rows:
            if r["output"] == output and r["cells_per_s"] and ours:
                r["ratio_to_make_loader"] = r["cells_per_s"] / ours
    costs = json.loads(
        subprocess.run(
            [
                sys.executable,
                "-c",
                f"import sys; sys.path.insert(0, {str(HERE)!r}); "
                f"import json, bench_grain; print(json.dumps(bench_grain._checkpoint_costs({dataset!r})))",
            ],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    result = {
        "benchmark": "bench_grain",
        **provenance(),
        "rounds": args.rounds,
        "window_s": args.seconds,
        "quick": args.quick,
        "threads": args.threads,
        "worker_threads": args.worker_threads or args.threads,
        "place_threads": args.place_threads,
        "rows": rows,
        "checkpoint": costs,
    }
    write_result(args.out, result, quick=args.quick)
    print(f"\n{'configuration':<36} {'cells/s':>10} {'× make_loader':>14}  runs")
    for r in rows:
        speed = f"{r['cells_per_s']:>10,.0f}" if r["cells_per_s"] else f"{'failed':>10}"
        ratio = f"{r.get('ratio_to_make_loader', float('nan')):>14.2f}"
        print(f"{r['config']:<36} {speed} {ratio}  {[round(s) for s in r['cells_per_s_runs']]}")
    print(json.dumps(costs, indent=1))


if __name__ == "__main__":
    main()

"""Grain's DataLoader over GrainSource against make_loader, on the same 200k-cell dataset, in one run.

Every configuration runs in a fresh process, all of them round-robin ``--rounds`` times (medians
reported): make_loader, make_grain_loader with 0 worker processes (threads only) and with each
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
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
DATA = HERE / "data"


def _consume(it, *, warmup: int, num_batches: int, batch_size: int, place) -> dict:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(place(next(it)).x)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(num_batches):
        jax.block_until_ready(place(next(it)).x)
    seconds = time.perf_counter() - start
    return {
        "cells_per_s": num_batches * batch_size / seconds,
        "seconds": seconds,
        "main_process_cores": (time.process_time() - cpu) / seconds,
    }


def _child(spec: dict) -> dict:
    import omicsio_jax as oj

    ds = oj.open_dataset(spec["dataset"])
    kw = {
        "batch_size": spec["batch_size"],
        "block_size": 16,
        "fetch_factor": 64,
        "seed": 0,
        "num_epochs": None,
        "obs": ("batch",),
        "output": spec["output"],
    }
    n = {"dense": 100, "csr": 300}[spec["output"]]
    if spec["kind"] == "make_loader":
        loader = oj.make_loader(ds, **kw, num_threads=spec["threads"])
        out = _consume(
            iter(loader), warmup=32, num_batches=n, batch_size=spec["batch_size"], place=lambda b: b
        )
        loader.close()
        return out
    threads = spec["threads"] if spec["workers"] == 0 else spec["worker_threads"]
    loader = oj.make_grain_loader(ds, **kw, num_threads=threads, worker_count=spec["workers"])
    place = spec["place_threads"]
    if not place:  # placed in the loop's thread
        return _consume(
            iter(loader), warmup=32, num_batches=n, batch_size=spec["batch_size"], place=oj.place_batch
        )
    batches = oj.prefetch_to_device(iter(loader), buffer_size=place, threads=place)
    return _consume(batches, warmup=32, num_batches=n, batch_size=spec["batch_size"], place=lambda b: b)


def _checkpoint_costs(dataset: str) -> dict:
    """State sizes, Orbax save/restore times and the first batch after a restore (medians of 5)."""
    import grain
    import jax
    import orbax.checkpoint as ocp

    import omicsio_jax as oj

    ds = oj.open_dataset(dataset)
    kw = {
        "batch_size": 1024,
        "block_size": 16,
        "fetch_factor": 64,
        "seed": 0,
        "num_epochs": None,
        "obs": ("batch",),
    }
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
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, nargs="*", default=[1, 2], help="worker_count values besides 0")
    p.add_argument(
        "--threads",
        type=int,
        default=2,
        help="decoding threads (num_threads) of make_loader and of the 0-worker DataLoader",
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
    dataset = str(ensure_data(200_000)) if args.make_data else args.dataset
    plan = []
    for output in ("dense", "csr"):
        base = {
            "dataset": dataset,
            "batch_size": 1024,
            "output": output,
            "threads": args.threads,
            "worker_threads": args.worker_threads or args.threads,
            "place_threads": args.place_threads,
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
        speeds = [x["cells_per_s"] for x in runs[label]]
        rows.append(
            {
                "config": label,
                **{k: v for k, v in spec.items() if k != "dataset"},
                "cells_per_s": float(np.median(speeds)) if speeds else None,
                "cells_per_s_runs": speeds,
                "main_process_cores": float(np.median([x["main_process_cores"] for x in runs[label]]))
                if speeds
                else None,
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
        "rounds": args.rounds,
        "threads": args.threads,
        "worker_threads": args.worker_threads or args.threads,
        "place_threads": args.place_threads,
        "command": "python benchmarks/bench_grain.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "rows": rows,
        "checkpoint": costs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{'configuration':<36} {'cells/s':>10} {'× make_loader':>14}  runs")
    for r in rows:
        speed = f"{r['cells_per_s']:>10,.0f}" if r["cells_per_s"] else f"{'failed':>10}"
        ratio = f"{r.get('ratio_to_make_loader', float('nan')):>14.2f}"
        print(f"{r['config']:<36} {speed} {ratio}  {[round(s) for s in r['cells_per_s_runs']]}")
    print(json.dumps(costs, indent=1))


if __name__ == "__main__":
    main()

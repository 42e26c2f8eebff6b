"""`oj.tune` checked against a longer measurement of the settings it timed.

Runs `oj.tune` (its default grid, ``--seconds`` of timing) on the 200k-cell dataset for the plate
label ``batch``, then times every setting tune timed again, each in a fresh process for
``--verify-seconds`` (after its first batch), ``--rounds`` times round-robin, and reports the
chosen setting's median throughput as a fraction of the best median (target ≥ 0.9) and that it
meets the entropy target.

    .venv/bin/python benchmarks/bench_tune.py                 # batch 1,024, tune 60 s, 3 rounds of 10 s
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
DATASET = HERE / "data" / "ds_200k"


def _child(spec: dict) -> dict:
    import jax

    import omicsio_jax as oj

    ds = oj.open_dataset(spec["dataset"])
    loader = oj.make_loader(
        ds,
        batch_size=spec["batch_size"],
        block_size=spec["block_size"],
        fetch_factor=spec["fetch_factor"],
        num_threads=spec["num_threads"],
        seed=0,
        num_epochs=None,
    )
    it = iter(loader)
    jax.block_until_ready(next(it).x)
    cells, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < spec["seconds"]:
        jax.block_until_ready(next(it).x)
        cells += spec["batch_size"]
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    loader.close()
    return {"cells_per_s": cells / wall, "cells_per_cpu_s": cells / cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--dataset", default=str(DATASET), help="made by bench_loader.py (ds_200k)")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--seconds", type=float, default=60.0, help="oj.tune's timing budget")
    p.add_argument("--verify-seconds", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(HERE / "results" / "tune.json"))
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return
    import omicsio_jax as oj

    ds = oj.open_dataset(args.dataset)
    start = time.perf_counter()
    result = oj.tune(ds, args.batch_size, label="batch", seconds=args.seconds)
    tune_s = time.perf_counter() - start
    print(result, flush=True)
    timed = [r for r in result.table if "cells_per_s" in r]
    runs: dict[tuple, list[dict]] = {}
    for r in range(args.rounds):
        for row in timed:
            key = (row["block_size"], row["fetch_factor"], row["num_threads"])
            spec = {
                "dataset": args.dataset,
                "batch_size": args.batch_size,
                "seconds": args.verify_seconds,
                "block_size": key[0],
                "fetch_factor": key[1],
                "num_threads": key[2],
            }
            proc = subprocess.run(
                [sys.executable, __file__, "--child", json.dumps(spec)],
                capture_output=True,
                text=True,
                check=True,
            )
            runs.setdefault(key, []).append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(
                f"[round {r + 1}/{args.rounds}] block {key[0]:>5} fetch {key[1]:>4} threads {key[2]}: "
                f"{runs[key][-1]['cells_per_s']:>9,.0f} cells/s",
                flush=True,
            )
    for row in timed:
        got = runs[(row["block_size"], row["fetch_factor"], row["num_threads"])]
        row["verify_cells_per_s"] = float(np.median([g["cells_per_s"] for g in got]))
        row["verify_cells_per_s_runs"] = [g["cells_per_s"] for g in got]
        row["verify_cells_per_cpu_s"] = float(np.median([g["cells_per_cpu_s"] for g in got]))
    best = max(timed, key=lambda r: r["verify_cells_per_s"])
    chosen = next(
        r
        for r in timed
        if (r["block_size"], r["fetch_factor"], r["num_threads"])
        == (result.block_size, result.fetch_factor, result.num_threads)
    )
    ratio = chosen["verify_cells_per_s"] / best["verify_cells_per_s"]
    print(
        f"chosen {result.loader_kwargs()}: {chosen['verify_cells_per_s']:,.0f} cells/s, "
        f"{ratio:.3f} × the best of the grid ({best['block_size']}/{best['fetch_factor']}/{best['num_threads']}: "
        f"{best['verify_cells_per_s']:,.0f}); entropy {result.entropy_ratio:.4f} × true random",
        flush=True,
    )
    out = {
        "benchmark": "bench_tune",
        "command": " ".join(["python benchmarks/bench_tune.py", *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "batch_size": args.batch_size,
        "tune_seconds": args.seconds,
        "tune_wall_s": tune_s,
        "verify_seconds": args.verify_seconds,
        "rounds": args.rounds,
        "chosen": result.loader_kwargs(),
        "chosen_entropy_ratio": result.entropy_ratio,
        "entropy_target": result.entropy_target,
        "chosen_over_best": ratio,
        "table": list(result.table),
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
